"""A dlx-node contributor: joins a run, then trains, exchanges and finishes rounds until the end.

The outer loop is DiLoCo's Algorithm 1 (arXiv 2311.08105) with DiLoCoX's
one-step-delay overlap (arXiv 2506.21263), in the order
:func:`training.schedule.round_actions` gives for the configured delay
variant (the same order the simulation and the benchmark run). With the
default delay ("rebase")::

    for outer_round in rounds:
        train(outer_round)      # H local AdamW steps
        encode(outer_round)     # encode, sign, archive, serve, announce the pseudo-gradients
        apply(outer_round - 1)  # close, fetch, aggregate, attest round t-1 (fetched while round t trained)

The rooms: :class:`~node.live.membership.Membership` (placement, liveness),
:class:`~node.live.coordination.RoundCoordinator` (closes, quorum, rotation),
:class:`~node.live.inbox.GossipInbox` (parses and dispatches what peers send),
:class:`~node.live.exchange.ContributionPool` (fetching contributions),
:class:`~node.live.committer.Committer` (the chain side) and
:class:`~node.live.replica.ReplicaWorker` (the training side). The wire protocol
is specified in docs/PROTOCOL.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from ledger.errors import ChainWaitStopped, LedgerError
from ledger.records import RoundRecord
from node.config import NodeConfig
from node.errors import DLX_ERRORS, NotRegistered, StateError
from node.fsutil import atomic_write_bytes
from node.live import protocol as msg
from node.live.committer import Committer, CommitterContext
from node.live.coordination import CloseInterrupted, RoundCoordinator, RoundStopped
from node.live.exchange import ContributionPool, serve_blob
from node.live.inbox import GossipInbox
from node.live.lane import RoundLane
from node.live.membership import Membership
from node.live.onchain import NodeChain
from node.live.protocol import run_topic
from node.live.replica import PipelineRejoin, ReplicaWorker
from node.live.resume import RestartRecovery
from node.live.roundbook import Announced, RoundBook
from node.live.roundclock import RoundClock
from node.live.sliced import SlicedExchange
from node.live.status import Progress, StateFile, StatusWriter, write_status
from node.live.verifier import SpotChecker, VerifierContext
from node.live.topology import Placement
from node.runconfig import canonical_json, config_hash, run_document
from node.store.archive import Archive, ArchivedContribution
from node.store.checkpoint import Checkpoint, RunLayout, checkpoint_problems, parse_checkpoint, write_checkpoint
from node.store.retention import prune_archive, prune_checkpoints
from p2p.envelope import Envelope, EnvelopeValidator, decode_envelope
from p2p.errors import P2PError
from p2p.host import P2PHost
from p2p.identity import Identity
from training.errors import PipelineError
from training.schedule import APPLY, ENCODE, TRAIN, pending_after_round, round_actions

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
#: Hellos published per second by the whole run, about: a node says hello every
#: ``max(HEARTBEAT_S, (peers + 1) / HELLOS_PER_S)`` seconds, at most every ``MAX_HELLO_EVERY_S``.
#: Every hello reaches every node (gossip, each copy with a signature to check), so at one a
#: second per node a node's share of the run's hellos grew with the peers: at 16 nodes on 2
#: cores they were the largest part of an idle node's CPU.
HELLOS_PER_S = 4.0
#: Well inside the liveness window (roundbook.PEER_TTL_S = 20 s), so a live peer never lapses.
MAX_HELLO_EVERY_S = 5.0


def hello_every(peers: int) -> float:
    """Seconds between a node's hellos when it is connected to ``peers`` others."""
    return min(MAX_HELLO_EVERY_S, max(HEARTBEAT_S, (peers + 1) / HELLOS_PER_S))
#: With the one-step delay, round t-1's close, fetch and aggregation run on a prefetch thread while
#: round t trains (Node._prefetch). Safe because the close decision does not depend on the moment it
#: is taken: an ejection (learnt at different moments by different nodes) moves neither the rotation
#: nor which closes count (RoundCoordinator.await_close, Membership.present; it made honest nodes
#: aggregate different closes of a round in test_reexec_e2e before).
PREFETCH_APPLY = True
#: Rounds of state kept behind the last finished one (the committer and slow peers' attestations need them).
ROUNDS_KEPT = 3


@dataclass
class _Gathered:
    """A round's closes, contributions and prepared aggregations, stage by stage (:meth:`Node._gather_stage`)."""

    sealed_before: object  # RestartRecovery.sealed_closes() of the round
    stages: dict[int, tuple]
    waited: dict[str, float]  # seconds the gathering spent waiting and aggregating
    joined_s: float = 0.0  # seconds the training thread waited for it
    last_arrival: float | None = None


class RoundAbandoned(Exception):
    """Raised inside the inner loop when the node is asked to stop."""


class PipelineBroken(Exception):
    """A split cluster's pipeline failed while training ``outer_round`` (a partner died)."""

    def __init__(self, outer_round: int, reason: str) -> None:
        super().__init__(f"round {outer_round}: {reason}")
        self.outer_round = outer_round
        self.reason = reason


#: ``first_round`` in the hellos of a node sitting rounds out while its cluster's pipeline is down:
#: it contributes to no round until it re-enters, so no coordinator waits for it.
NOT_CONTRIBUTING = 2**62


class Node:
    """One contributor process (see module docstring)."""

    def __init__(self, cfg: NodeConfig, on_progress: Callable[[Progress], None] | None = None) -> None:
        self.cfg = cfg
        self.on_progress = on_progress
        self.data_dir = Path(cfg.data_dir).expanduser()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.stop_event = threading.Event()
        self.progress = Progress(inner_steps=cfg.diloco.inner_steps)
        self.clock = RoundClock(self.data_dir / "timing.jsonl")  # utilization per round (docs/DILOCOX.md section 4)
        self.book = RoundBook()
        self.run_id = cfg.ledger.run_id
        self.document = run_document(cfg)
        self.config_hash = config_hash(self.document)
        # What every checkpoint of the run must be: metadata from the run document, the stages' tensors.
        self.layout = RunLayout.of_run(self.run_id, self.config_hash, cfg.model, cfg.pipeline.num_stages)
        self.identity = Identity.load_or_create(cfg.path(cfg.p2p.key_file))
        self.peer_id = self.identity.peer_id
        self.archive = Archive(self.data_dir / "archive", self.run_id)
        self.checkpoint_dir = self.data_dir / "checkpoints"
        self.state = StateFile(self.data_dir / "state.json", self.run_id)
        self.host: P2PHost | None = None
        self.chain: NodeChain | None = None
        self.worker: ReplicaWorker | None = None
        self.committer: Committer | None = None
        self.placement: Placement | None = None
        self.membership: Membership | None = None
        self.coordinator: RoundCoordinator | None = None
        self.contributions: ContributionPool | None = None
        self.sliced: SlicedExchange | None = None  # diloco.exchange = "sliced" (docs/PROTOCOL.md)
        # The validator's window moves with the run (_forget_before): memory stays flat and
        # messages far outside the rounds this node works on are refused.
        self.validator = EnvelopeValidator(self.run_id, max_size=msg.MAX_GOSSIP_PAYLOAD + 4096,
                                           max_rounds_ahead=64 + 4 * cfg.checkpoint_every,
                                           equivocation_exempt_kinds=(msg.HELLO, msg.ACCUSATION, msg.VERDICT,
                                                                      msg.PARTIAL_ANNOUNCE))
        self._threads: list[threading.Thread] = []
        self._train_info: dict[int, tuple[float, float, int]] = {}  # round -> (train loss, eval loss, tokens)
        self._round_parts: dict[int, list] = {}  # round -> TrainStats of its parts trained so far
        self._reannounced: set[int] = set()  # rounds whose archived contribution this life announced again
        self.spot_checks: SpotChecker | None = None
        self._start_states: dict[int, dict[int, bytes]] = {}  # round -> stage -> start-state hash served
        # Per-round work off the training thread (node/live/lane.py): compressing and publishing a
        # contribution, serialising and serving a start state, the held-out eval on a copy.
        self.lane = RoundLane()
        self._capture_done = None  # future of the last start-state capture queued on the lane
        self._publish_done = None  # future of the last contribution encoded and published on the lane
        self._evals: dict[int, object] = {}  # round -> future of its held-out loss
        # With the delay, round t-1's close, fetch and aggregation while round t trains (_prefetch).
        self._prefetched: dict[int, Future] = {}
        self._apply_reached: dict[int, float] = {}  # round -> when the training thread reached its apply
        self._stage_hashes: dict[int, dict[int, bytes]] = {}  # round -> stage -> weights hash after its outer step
        self.ejected = False  # this node was found guilty on chain and removed from the run
        #: A round whose committed record differs from this node's: the node stops, and ``dlx-node start``
        #: starts it again in the same process, entering from the chain's latest checkpoint (:meth:`_on_diverged`).
        self.reenter_after: int | None = None
        self.first_round = -1  # first round this process contributes to (announced in hellos)
        self._last_report = 0.0
        self._status_writer = StatusWriter()  # status.json off the training thread

    # ------------------------------------------------------------------ lifecycle
    def run(self) -> Progress:
        """Join, train until ``cfg.rounds`` (or stop), finish pending rounds, shut down."""
        try:
            try:
                start_round, unfinished = self._join()
            except ChainWaitStopped as exc:  # a stop (SIGTERM, Ctrl-C) while waiting for the chain
                logger.info("stopped before the chain answered: %s", exc)
                return self.progress
            except RoundStopped as exc:  # a stop while the cluster's pipeline re-formed at entry
                logger.info("%s", exc)
                return self.progress
            self._train_loop(start_round, unfinished)
        finally:
            self.close()
        if self.ejected:
            raise NotRegistered(f"this node was found guilty on a spot check by run {self.run_id}'s quorum: its "
                                "stake was slashed and its seat removed (evidence under evidence/ of its peers)")
        return self.progress

    def stop(self) -> None:
        """Ask the node to stop: the current round is abandoned, pending work flushed."""
        self.stop_event.set()

    def close(self) -> None:
        self.stop_event.set()
        if self.committer is not None:
            self.committer.close()
        if self.spot_checks is not None:
            self.spot_checks.close()
        if self.contributions is not None:
            self.contributions.close()
        for t in self._threads:
            t.join(timeout=5)
        self.lane.close()
        if self.worker is not None:
            self.worker.close()
        if self.host is not None:
            self.host.close()
            self.host = None
        if self.chain is not None:
            self.chain.close()
        self._set_state("stopped")
        self._status_writer.close()

    # ------------------------------------------------------------------ joining
    def _join(self) -> tuple[int, list[int]]:
        cfg = self.cfg
        self._set_state("joining")
        self.chain = NodeChain.connect(cfg, stop=self.stop_event)
        self.chain.check_run(self.run_id, self.config_hash, rounds=cfg.rounds)
        self.chain.ensure_registered(self.identity)
        self.chain.ensure_member(self.run_id)
        # Before the first message arrives: the validator's window starts where this node can
        # enter (after the chain's latest checkpoint). Left at round 0, every message of a round
        # past max_rounds_ahead (68 at checkpoint_every = 1) would be refused as "future", the
        # start-up resync's included, and the sync cursor moves past them: a node restarted late
        # in a run never saw the closes and attestations of the rounds it catches up, and waited
        # for them forever (bench_chaos.py, kills after round 68).
        checkpoint = self.chain.latest_checkpoint(self.run_id)
        self.validator.advance(checkpoint.round + 1 if checkpoint is not None else 0)
        own_seat = self.chain.seat(self.run_id, self.chain.account_bytes, self.identity.public_key_bytes)
        if own_seat is None:
            raise NotRegistered(f"account {self.chain.client.address} joined run {self.run_id} but its seat is not "
                                "bound to this node's key (registered with another key?)")
        self.host = P2PHost.start(cfg.p2p, self.identity, data_dir=self.data_dir)

        def seat(account: bytes, public_key: bytes) -> tuple[int, int] | None:
            membership = self.chain.seat(self.run_id, account, public_key, current=False)
            return None if membership is None else membership.joined

        self.membership = Membership(self.peer_id, cfg.cluster, cfg.cluster_size, cfg.pipeline.num_stages,
                                     self.book, seat, joined=own_seat.joined)
        self.contributions = ContributionPool(
            self.host, self.book, self.run_id, self.data_dir / "incoming", cfg.p2p.max_blob_bytes,
            cfg.p2p.transfer_timeout, cfg.p2p.blob_concurrency,
            check_payload=self._check_contribution, evidence_dir=self.data_dir / "evidence",
            lazy=cfg.diloco.exchange == "sliced")  # sliced: only a coordinator or an aggregator fetches envelopes
        self.contributions.fallback_providers = self.membership.live_providers
        if cfg.diloco.exchange == "sliced":
            self.sliced = SlicedExchange(self.host, self.identity, self.run_id, lambda: self.worker,
                                         lambda: self.placement.replica, self._gossip, cfg.p2p.max_blob_bytes,
                                         cfg.p2p.transfer_timeout, self.archive, self.data_dir / "incoming",
                                         self.data_dir / "evidence", self.stop_event, self.contributions)
        # Rounds this node finished in an earlier life: it never signs a second, different
        # close or attestation for them (peers would hold both as equivocation evidence).
        self.coordinator = RoundCoordinator(
            self.peer_id, cfg.quorum, cfg.round_timeout, self.book, self.membership, self.contributions,
            contributed=lambda r: r in self._train_info or r in self._reannounced, gossip=self._gossip,
            resync=self._resync,
            previous_life_finished=self.state.get("last_finished", -1), transfer_timeout=cfg.p2p.transfer_timeout,
            stop=self.stop_event)
        self.inbox = inbox = GossipInbox(self.run_id, self.validator, self.book, self.membership, self.contributions,
                            held_stages=lambda: self.worker.stages if self.worker is not None else (),
                            record_signer=self._record_signer)
        if self.sliced is not None:
            inbox.add_handler(msg.PARTIAL_ANNOUNCE, self.sliced.on_announce)
        queue = self.host.subscribe(run_topic(self.run_id), validator=inbox.relay_ok,
                                    keep_for_sync=lambda data: inbox.keep_for_sync(data, self.host.peer_id))
        self._spawn(lambda: inbox.run(queue, self.stop_event), "gossip")
        self._spawn(self._heartbeat_loop, "heartbeat")
        serve_blob(self.host, canonical_json(self.document))  # the run document, by its hash
        self.archive.write_run_document(canonical_json(self.document))
        for addr in cfg.p2p.bootstrap:
            try:
                self.host.connect(addr, timeout=10)
            except P2PError as exc:
                logger.warning("bootstrap %s unreachable: %s", addr, exc)
        self._resync()
        self.placement = self.membership.await_placement(cfg.diloco.num_replicas, cfg.join_timeout, self.stop_event)
        logger.info("placed: cluster %s replica %d stages %s", self.placement.cluster, self.placement.replica,
                    list(self.placement.stages))
        self.worker = ReplicaWorker(cfg, self.placement.replica, self.placement.stages, self.placement.rank)
        self.worker.start(rendezvous_timeout=self.cfg.join_timeout * 2, op_timeout=cfg.round_timeout * 2 + 60)
        self.committer = Committer(CommitterContext(
            cfg, self.run_id, self.peer_id, self.book, self.chain, self.host, self.coordinator, self.membership,
            self.checkpoint_dir, self.data_dir / "incoming", self.stop_event,
            on_recorded=self._on_recorded, on_confirmed=self._on_confirmed, on_diverged=self._on_diverged,
            state=self.state, gossip=self._gossip, layout=self.layout))
        # Re-execution spot checks compare a rerun with the decoded contribution and replay round t-1
        # from the whole contributions: not done for sliced contributions yet (docs/PROTOCOL.md).
        checker_cfg = cfg if self.sliced is None else dataclasses.replace(cfg, spot_checks=0.0)
        self.spot_checks = SpotChecker(VerifierContext(
            checker_cfg, self.run_id, self.peer_id, self.chain, self.host, self.archive, self.membership, self._gossip,
            self._sign_envelope, self._stage_hashes_of, lambda: self.placement.replica, lambda: self.progress.round,
            self.data_dir / "spotchecks", self.data_dir / "evidence", self.stop_event, self._on_ejected))
        inbox.spot_checks = self.spot_checks
        proposal, unfinished = self._entry_point()
        start_round = self._agree_on_entry(proposal)
        if start_round is None:
            raise RoundStopped("stopped while the cluster's pipeline re-formed at entry")
        # A fresh node entering a running run ranks itself last as coordinator until a peer's close
        # names it (RoundCoordinator.unconfirmed_joiner).
        self.coordinator.unconfirmed_joiner = self.coordinator.previous_life_finished < 0 and start_round > 0
        # Every round before the agreed entry that this node has not applied is caught up, also
        # those between its own proposal and a partner's higher one: skipping them left this
        # node's stage without the rounds its partner had finished, and the partner's record
        # waiting forever for this stage's attestations (the split-cluster survivor race).
        unfinished = list(range(unfinished[0] if unfinished else proposal, start_round))
        self.recovery = RestartRecovery(self.archive, self.contributions, self.host, self.book, self.peer_id,
                                        self.placement.replica, self.worker.stages, cfg.p2p.max_blob_bytes,
                                        self._gossip, self.coordinator.previous_life_finished)
        self._reannounced = self.recovery.reannounce(unfinished)
        self.first_round = min([start_round, *self._reannounced])
        self.validator.advance(min([start_round, *unfinished]))
        logger.info("entering at round %d (catching up %s)", start_round, unfinished or "nothing")
        return start_round, unfinished

    def _agree_on_entry(self, proposal: int) -> int | None:
        """The entry round the cluster agrees on; if a partner dies meanwhile, wait until the pipeline
        re-forms (the partner restarted, or another member took the seat) and agree again. None if
        the node is asked to stop first."""
        while True:
            try:
                return self.worker.agree_on_round(proposal)
            except PipelineError as exc:
                logger.warning("pipeline of cluster %r broke while entering the run (%s); waiting for the "
                               "partner to come back", self.cfg.cluster, exc)
            self._set_state("waiting for partner")
            self.worker.leave_pipeline()
            rejoin = PipelineRejoin(self.worker, self.cfg.round_timeout * 2 + 60, self.stop_event)
            while not rejoin.done.wait(1.0):
                if self.stop_event.is_set():
                    return None
            self._set_state("joining")

    def _entry_point(self) -> tuple[int, list[int]]:
        """Where this node enters: round 0 of a fresh run, or after the latest checkpoint."""
        last_committed = self.chain.last_round(self.run_id)
        live_round = self.membership.live_training_round(last_committed, self._round_window())
        if last_committed < 0 and (live_round <= 0 or not self._round_closed(0)):
            # A fresh run whose round 0 is still open: a founding replica whose cluster formed
            # later than the others (a slow or loaded machine) still enters at round 0, and
            # the others wait for it up to the round deadline, as for any expected replica.
            return 0, []
        ckpt = self._entry_checkpoint()
        base = -1
        if ckpt is not None:
            for stage in self.worker.stages:
                weights, momentum = ckpt.stage_state(self.worker.stage_names(stage))
                self.worker.load_global(stage, weights, momentum, ckpt.round)
            base = ckpt.round
            logger.info("restored stages %s from the chain-verified checkpoint of round %d",
                        list(self.worker.stages), base)
        floor = max(base + 1, self.state.get("last_contributed", -1) + 1)
        start = self._no_orphan_round(floor, max(live_round + 1, floor), last_committed)
        return start, list(range(base + 1, start))

    def _no_orphan_round(self, floor: int, proposal: int, last_committed: int) -> int:
        """``proposal``, or the first round in [floor, proposal) that would otherwise stay open forever.

        Entering after the highest round another replica trains is right while that replica
        goes on; but if it breaks in that round (a split cluster losing a node) before anyone
        announced a contribution, and re-enters after the round this replica now trains, the
        round has no contributor at all and never closes: every replica waits for it (seen
        in bench_chaos.py: two clusters re-formed around each other's stale claims and both
        skipped round 88). Such a round, not closed, not committed, with no announced
        contribution and in no live replica's claimed range, is the one to enter at.
        """
        claims = self.membership.claimed_rounds(last_committed, self._round_window())
        for outer_round in range(max(floor, last_committed + 1), proposal):
            if self._round_closed(outer_round) or any(first <= outer_round <= now for first, now in claims):
                continue
            if any(self.book.snapshot_announces(outer_round, stage) for stage in range(self.cfg.pipeline.num_stages)):
                continue
            logger.info("round %d: no replica trains or contributed to it and it is not closed; entering there "
                        "rather than at round %d", outer_round, proposal)
            return outer_round
        return proposal

    def _last_committed(self) -> int:
        """The chain's last committed round (this node's committer may lag it), or the last it saw."""
        try:
            return self.chain.last_round(self.run_id)
        except DLX_ERRORS as exc:
            logger.debug("chain read failed (%s); using the last commit this node saw", exc)
            return self.progress.last_commit

    def _entry_checkpoint(self) -> Checkpoint | None:
        """The newest published checkpoint that verifies against the run and its record, preferring those
        upstream of every dispute; None if the run has published none.

        A checkpoint that cannot be fetched, or whose metadata or tensors disagree with the run
        document or the attested record, is passed over for the next older one (a member serving
        doctored bytes cannot keep nodes from entering). One at or after a round another member
        disputed is taken only when no undisputed one verifies: entering before the disputed
        round makes this node re-apply that round itself.
        """
        published = self.chain.checkpoints(self.run_id)
        if not published:
            return None
        disputed = self.chain.disputed_rounds(self.run_id, exclude=self.chain.client.address)
        first_disputed = min(disputed, default=None)
        newest_first = sorted(published, key=lambda c: -c.round)
        undisputed = [c for c in newest_first if first_disputed is None or c.round < first_disputed]
        downstream = [c for c in newest_first if first_disputed is not None and c.round >= first_disputed]
        refused = []
        for candidate in undisputed + downstream:
            try:
                ckpt = self._download_checkpoint(candidate.round, candidate.content_hash)
                record = self.chain.commit_of(self.run_id, candidate.round)
                problems = (["its round is not committed"] if record is None else
                            checkpoint_problems(ckpt, self.layout, candidate.round, record.weights_root))
            except DLX_ERRORS as exc:
                problems = [str(exc)]
            if problems:
                refused.append(f"round {candidate.round}: {'; '.join(problems)}")
                logger.error("the checkpoint of round %d does not verify against the run (%s); trying an older one",
                             candidate.round, "; ".join(problems))
                continue
            if candidate in downstream:
                logger.warning("entering from the checkpoint of round %d, at or after disputed round(s) %s: no "
                               "checkpoint before them verified", candidate.round, sorted(disputed))
            return ckpt
        raise StateError("no published checkpoint verifies against the run: " + " | ".join(refused)[:2000])

    def _round_window(self) -> int:
        """How many rounds past the last committed one a peer can honestly be (delay, commit lag, catch-up)."""
        return 8 + 2 * self.cfg.checkpoint_every

    def _round_closed(self, outer_round: int) -> bool:
        """Whether a valid close of ``outer_round`` (any stage) has reached this node.

        Only a close that passes the checks counts: an empty or otherwise invalid close a
        member publishes at the start must not make a founder believe round 0 is over and
        enter as a catch-up node.
        """
        for stage in range(self.cfg.pipeline.num_stages):
            for coordinator, (close, _data) in self.book.snapshot_closes(outer_round, stage).items():
                if self.coordinator.judge(outer_round, stage, coordinator, close) is None:
                    return True
        return False

    def _download_checkpoint(self, round_index: int, content_hash: bytes) -> Checkpoint:
        path = self.checkpoint_dir / f"round-{round_index:08d}.safetensors"
        if path.exists() and hashlib.sha256(path.read_bytes()).digest() == content_hash:
            return parse_checkpoint(path.read_bytes(), content_hash)
        staged = self.data_dir / "incoming" / f"{content_hash.hex()}.part"
        staged.parent.mkdir(parents=True, exist_ok=True)
        # Every node assembles and serves the checkpoint: ask the live peers first (parallel
        # ranges from all of them), the DHT only if none of them has it.
        providers = self.membership.live_providers()
        try:
            self.host.fetch_blob(content_hash.hex(), staged, providers=providers or None,
                                 timeout=self.cfg.p2p.transfer_timeout)
        except P2PError as exc:
            logger.info("checkpoint not fetched from live peers (%s); asking the DHT", exc)
            self.host.fetch_blob(content_hash.hex(), staged, timeout=self.cfg.p2p.transfer_timeout)
        data = Path(staged).read_bytes()
        staged.unlink(missing_ok=True)
        ckpt = parse_checkpoint(data, content_hash)  # refuses anything but the chain's bytes
        atomic_write_bytes(path, data)
        return ckpt

    # ------------------------------------------------------------------ the loop
    def _train_loop(self, start_round: int, unfinished: list[int]) -> None:
        """Run the rounds; a split cluster whose partner died waits for it and re-enters with it."""
        while True:
            try:
                self._run_rounds(start_round, unfinished)
                return
            except PipelineBroken as broken:
                resumed = self._await_partner(broken.outer_round, broken.reason, unfinished)
            if resumed is None:
                return  # asked to stop while waiting
            start_round, unfinished = resumed

    def _await_partner(self, broken_round: int, reason: str, unfinished: list[int]) -> tuple[int, list[int]] | None:
        """Sit rounds out until the cluster's pipeline is formed again; return where to re-enter.

        The round being trained is abandoned (nothing was sent for it). Meanwhile the node
        finishes every round the other replicas close, as a non-contributor (its stage stays
        current, it still coordinates, attests and signs records), and its hellos say it
        trains and contributes to no round, so nobody waits for this replica. Once the
        restarted partner is back, both agree on the entry round as at a start (the max of
        their proposals: the round after the highest one another replica trains, and no
        round this node finished or contributed to).
        """
        logger.warning("round %d: pipeline of cluster %r broke (%s); waiting for the partner to come back",
                       broken_round, self.cfg.cluster, reason)
        self._round_parts.pop(broken_round, None)
        self.lane.join()  # the abandoned round's start state may still be on its way
        self._start_states.pop(broken_round, None)  # nothing of the abandoned round is sent
        next_round = min([*unfinished, self.progress.last_finished + 1])
        unfinished.clear()
        timeout = self.cfg.round_timeout * 2 + 60
        while not self.stop_event.is_set():
            # Hellos now say: training no round, contributing to none. A restarted partner then
            # enters at the first round nobody else trains (a round no replica contributed to
            # could never close), and coordinators do not wait for this replica.
            self.first_round, self.progress.round = NOT_CONTRIBUTING, -1
            self._set_state("waiting for partner")
            self.worker.leave_pipeline()
            rejoin = PipelineRejoin(self.worker, timeout, self.stop_event)
            self.coordinator.interrupt = rejoin.done.is_set
            try:
                while not rejoin.done.is_set():
                    self._finish_round(next_round)
                    next_round += 1
            except CloseInterrupted:
                pass
            except RoundStopped:
                return None
            finally:
                self.coordinator.interrupt = None
            last_committed = self._last_committed()
            floor = max(next_round, self.state.get("last_contributed", -1) + 1)
            proposal = self._no_orphan_round(
                floor, max(self.membership.live_training_round(last_committed, self._round_window()) + 1, floor),
                last_committed)
            try:
                start_round = self.worker.agree_on_round(proposal)
            except PipelineError as exc:
                logger.warning("pipeline of cluster %r broke again while re-forming (%s)", self.cfg.cluster, exc)
                continue
            self.first_round = start_round
            logger.info("pipeline of cluster %r re-formed; entering at round %d (catching up %s)", self.cfg.cluster,
                        start_round, list(range(next_round, start_round)) or "nothing")
            return start_round, list(range(next_round, start_round))
        return None

    def _run_rounds(self, start_round: int, unfinished: list[int]) -> None:
        """Run the rounds in the order of :func:`training.schedule.round_actions`."""
        diloco = self.cfg.diloco
        # A joiner first replays the catch-up rounds that have closed already; with the
        # delay, the last one closes only after the peers' next round, so it waits.
        try:
            while len(unfinished) > pending_after_round(diloco) and not self.stop_event.is_set():
                self._finish_round(unfinished.pop(0))
        except RoundStopped as exc:
            logger.info("%s", exc)
            return
        outer_round = start_round
        end = self.cfg.rounds if self.cfg.rounds > 0 else None
        while not self.stop_event.is_set() and (end is None or outer_round < end):
            try:
                for action in round_actions(diloco, outer_round, last=end is not None and outer_round == end - 1):
                    if action.kind == TRAIN:
                        if PREFETCH_APPLY and diloco.one_step_delay and action.first_step == 0 and unfinished:
                            self._prefetch(unfinished[0])  # applied after (part of) this round's steps
                        self._train_inner_steps(action.outer_round, action.first_step, action.end_step)
                    elif action.kind == ENCODE:
                        with self.clock.phase("encode"):
                            self._encode(action.outer_round)
                        unfinished.append(action.outer_round)
                    elif action.kind == APPLY:
                        while unfinished and unfinished[0] <= action.outer_round:
                            self._finish_round(unfinished.pop(0))
            except (RoundAbandoned, RoundStopped):
                logger.info("round %d abandoned on request", outer_round)
                break
            outer_round += 1
        self.lane.join()  # a contribution still being encoded goes out (or its failure is raised here)
        # Finish what was exchanged; a stopping node waits only briefly.
        try:
            for r in unfinished:
                if self.stop_event.is_set():
                    break
                self._finish_round(r)
        except RoundStopped as exc:
            logger.info("%s", exc)
        if self.committer is not None:
            self.committer.drain(timeout=self.cfg.round_timeout)

    def _train_inner_steps(self, outer_round: int, first_step: int, end_step: int) -> None:
        self.progress.round, self.progress.step = outer_round, first_step
        self._set_state("training")

        def on_step(step: int, loss: float) -> None:
            self.progress.step, self.progress.loss = step, loss
            self._report(throttle=True)
            if self.stop_event.is_set():
                raise RoundAbandoned()

        if first_step == 0:  # what the round's contributions will bind (docs/DILOCOX.md section 11)
            with self.clock.phase("start_state"):
                # Copies of the weights and AdamW state now; the engines' part, the bytes, the hash and
                # serving them on the lane, after the previous round's encode and before the next
                # change to the engines (_encode and _finish_round join it first).
                serialise = self.worker.start_state_capture(outer_round)

                def serve() -> None:
                    with self.clock.lane("start_state"):
                        self._start_states[outer_round] = self.spot_checks.serve_start_states(
                            outer_round, serialise())

                self._capture_done = self.lane.submit(serve)
        try:
            stats = self.worker.train_round(outer_round, on_step, first_step, end_step)
        except PipelineError as exc:
            # A split cluster trains in lockstep; without its partner the replica cannot train.
            raise PipelineBroken(outer_round, str(exc)) from exc
        self._round_parts.setdefault(outer_round, []).append(stats)
        if end_step < self.cfg.diloco.inner_steps:
            return  # the rest of the round comes after the previous round is applied
        parts = self._round_parts.pop(outer_round)
        tokens = sum(p.tokens for p in parts)
        mean_loss = sum(p.mean_loss * p.tokens for p in parts) / tokens
        with self.clock.phase("eval"):
            self._evals[outer_round] = self._start_eval(outer_round)
        self._train_info[outer_round] = (mean_loss, math.nan, tokens)  # held-out loss: _eval_of()
        period = self.clock.trained(outer_round, sum(p.seconds for p in parts))
        self.progress.timing = self.clock.summary()
        logger.info("round %d: %d inner steps in %.1fs (%s), loss %.4f", outer_round,
                    self.cfg.diloco.inner_steps, period["inner_s"],
                    "first period" if period["wall_s"] is None else
                    f"{period['wall_s']:.1f}s since the last round's, utilization {period['utilization']:.1%}",
                    mean_loss)

    def _start_eval(self, outer_round: int):
        """The held-out loss of the weights after ``outer_round``'s training: a future.

        A chained replica evaluates a copy on the lane; a split one runs its pipeline now.
        """
        snapshot = self.worker.eval_snapshot()
        if snapshot is None:
            try:
                eval_loss = self.worker.eval_loss()
            except PipelineError as exc:
                raise PipelineBroken(outer_round, str(exc)) from exc
            self._evaluated(outer_round, eval_loss)
            done = Future()
            done.set_result(eval_loss)
            return done

        def evaluate() -> float:
            with self.clock.lane("eval"):
                eval_loss = snapshot()
            self._evaluated(outer_round, eval_loss)
            return eval_loss

        return self.lane.submit(evaluate)

    def _evaluated(self, outer_round: int, eval_loss: float) -> None:
        self.progress.eval_loss = eval_loss
        logger.info("round %d: held-out loss %.4f", outer_round, eval_loss)

    def _eval_of(self, outer_round: int) -> float:
        """The held-out loss after ``outer_round``'s training (nan if this process did not train it)."""
        future = self._evals.get(outer_round)
        return math.nan if future is None else self.lane.join(future)

    def _encode(self, outer_round: int) -> None:
        """Encode and publish ``outer_round``: the part reading the live weights here, the rest on the lane."""
        if outer_round <= self.state.get("last_contributed", -1):
            raise StateError(f"round {outer_round} was already contributed before a restart; refusing to re-sign")
        # The engines' last reader and writer on the lane (this round's start state, the previous
        # encode) are done; not the eval just queued, which reads its own copy.
        self._join_engine_work()
        prepared = [self.worker.prepare_encode(stage, outer_round) for stage in self.worker.stages]
        if all(prepared):
            def publish() -> None:
                with self.clock.lane("encode"):
                    self._publish_contributions(outer_round)

            self._publish_done = self.lane.submit(publish)
        else:  # "lookahead"/"eager": the next round starts from the compressed contribution
            self._publish_contributions(outer_round)

    def _join_engine_work(self) -> None:
        """Wait for the lane's tasks that read or write the engines (start states, encodes)."""
        for future in (self._capture_done, self._publish_done):
            if future is not None:
                self.lane.join(future)

    def _publish_contributions(self, outer_round: int) -> None:
        if outer_round <= self.state.get("last_contributed", -1):
            raise StateError(f"round {outer_round} was already contributed before a restart; refusing to re-sign")
        states = self._start_states.pop(outer_round, None)
        if states is None:
            raise StateError(f"round {outer_round}: no start state was captured; refusing to contribute unbound")
        data_commitment = self.worker.data_commitment(outer_round)
        for stage in self.worker.stages:
            blob, cstats = self.worker.encode(stage, outer_round)
            if self.sliced is not None:  # the envelope binds the slice blobs' hashes; the blobs are served
                blob = self.sliced.publish(outer_round, stage, self.worker.last_slices(stage))
            body = msg.encode_contribution_body(msg.ContributionBody(states[stage], data_commitment, blob))
            envelope = Envelope.create(self.identity, self.run_id, outer_round, msg.CONTRIBUTION, body,
                                       stage=stage, replica=self.placement.replica).to_bytes()
            digest = self.archive.put(outer_round, envelope)
            self.contributions.serve_own(envelope)
            self.contributions.add(outer_round, stage, digest, envelope)
            self.book.add_announce(outer_round, stage,
                                   Announced(self.peer_id, self.placement.replica, digest, len(envelope)))
            self._gossip(outer_round, msg.ANNOUNCE, msg.Announce(digest, len(envelope)), stage)
            logger.info("round %d stage %d: contribution %s, %d bytes (ratio %.0fx)", outer_round, stage,
                        digest.hex()[:12], len(envelope), getattr(cstats, "ratio", float("nan")))
        self.state.update(last_contributed=outer_round)
        self.clock.published(outer_round)

    # ------------------------------------------------------------------ finishing a round
    def _finish_round(self, outer_round: int) -> None:
        """Close, fetch, aggregate and attest ``outer_round`` for every stage this node holds."""
        self._set_state("finishing")
        started = time.monotonic()
        waited = {"close_wait": 0.0, "fetch_wait": 0.0, "aggregate": 0.0}
        contributed = outer_round in self._train_info
        sealed: list[ArchivedContribution] = []
        excluded: list[list] = []  # [stage, replica, peer id, envelope hash, reason, detail]
        hashes: dict[int, bytes] = {}
        gathered, overlapped = self._take_gathered(outer_round)
        waited["close_wait"] += gathered.joined_s  # the training thread waited for the prefetch
        for stage in self.worker.stages:
            # The prefetch's close is this node's decision of the round (RoundCoordinator.accepted): the
            # decision does not depend on when it is taken (no membership change seen meanwhile moves it).
            if stage not in gathered.stages:
                gathered.stages[stage] = self._gather_stage(outer_round, stage, gathered.sealed_before, waited)
            close, envelopes, payloads, screened, prepared = gathered.stages[stage]
            mark = time.monotonic()
            if self._capture_done is not None:  # the start state read the engines as they were
                self.lane.join(self._capture_done)
            if prepared is not None and not self.worker.prepared_valid(stage, prepared, outer_round):
                # (Never in the loop's order: nothing applies a round between the prefetch and here.)
                logger.warning("round %d stage %d: prefetched aggregation is stale; aggregating again",
                               outer_round, stage)
                screened, _reports = self.worker.screen(outer_round, payloads)
            if self.sliced is None:
                result = self.worker.apply(stage, outer_round, payloads, excluded=screened, prepared=prepared)
            else:
                result = self._apply_sliced(outer_round, stage, close)
                envelopes = self.sliced.held_envelopes(outer_round, stage, close)  # not every member's
            waited["aggregate"] += time.monotonic() - mark
            for entry in close.contributions:  # when each was here: the round's exchange time
                arrived = self.contributions.arrived_at(entry[2])
                if arrived is not None and (gathered.last_arrival is None or arrived > gathered.last_arrival):
                    gathered.last_arrival = arrived
            hashes[stage] = result.weights_hash
            self._stage_hashes.setdefault(outer_round, {})[stage] = result.weights_hash
            for report in result.contributions:
                if not report.accepted:
                    replica, peer_id, digest, _size = close.contributions[report.index]
                    logger.warning("round %d stage %d: contribution %s of replica %d (%s) excluded: %s %s",
                                   outer_round, stage, digest.hex()[:12], replica, peer_id[-8:], report.reason,
                                   report.detail)
                    excluded.append([stage, replica, peer_id, digest.hex(), report.reason, report.detail])
            if contributed and not any(entry[1] == self.peer_id for entry in close.contributions):
                self._join_engine_work()  # the residual it goes back into: after the encode on the lane
                self.worker.contribution_dropped(stage, outer_round)  # a straggler's update is sent again later
            for (replica, peer_id, digest, _size), envelope in zip(close.contributions, envelopes):
                if envelope is not None:
                    self.archive.put(outer_round, envelope)
                sealed.append(ArchivedContribution(stage, replica, peer_id, digest))
        # A sliced holder archives the closed envelopes it holds; each contributor archives its own.
        self.archive.seal_round(outer_round, sealed, excluded=excluded, all_held=self.sliced is None)
        # Retention (node/store/retention.py): never a round or the checkpoint a restart or a peer needs.
        prune_archive(self.archive, self.cfg.storage.keep_rounds, self.progress.last_commit, self.host.remove_blob)
        prune_checkpoints(self.checkpoint_dir, self.cfg.storage.keep_checkpoints, self.progress.last_commit,
                          self.host.remove_blob)
        checkpoint_round = (outer_round + 1) % self.cfg.checkpoint_every == 0
        # A round contributed to in an earlier life is attested with that life's figures (the same
        # attestation again), not with none: the training figures left with the process.
        figures = self.state.attested(outer_round) if not contributed else None
        if contributed:
            train_loss, _, tokens = self._train_info[outer_round]
            figures = (train_loss, self._eval_of(outer_round), tokens)
            self.state.remember_attested(outer_round, *figures)
        train_loss, eval_loss, tokens = figures if figures is not None else (math.nan, math.nan, 0)
        for stage in self.worker.stages:
            shard_hash = self._write_shard(outer_round, stage, hashes[stage]) if checkpoint_round else b""
            last = stage == self.cfg.pipeline.num_stages - 1
            att = msg.Attestation(hashes[stage], self.coordinator.stage_root(outer_round, stage),
                                  len(self.coordinator.accepted(outer_round, stage).contributions),
                                  train_loss if last else math.nan, eval_loss if last else math.nan, tokens,
                                  shard_hash, b"")
            self.book.add_attestation(outer_round, stage, self.peer_id, att)
            # Also for a round finished in an earlier life: the same attestation again (peers
            # that kept the first one drop it as a re-signed replay), so the round can commit.
            self._gossip(outer_round, msg.ATTESTATION, att, stage)
        self._forget_before(min(outer_round - ROUNDS_KEPT, self.committer.handled_through))
        self.progress.last_finished = outer_round
        self.state.update(last_finished=outer_round)
        self.committer.submit(outer_round)
        total = time.monotonic() - started
        waited["finish_other"] = max(0.0, total - sum(waited.values()))
        for phase, seconds in waited.items():
            self.clock.add(phase, seconds)
        self.clock.finished(outer_round, gathered.last_arrival, total=total, **waited, **overlapped)
        self.progress.timing = self.clock.summary()
        self._report()

    def _check_contribution(self, stage: int, outer_round: int, payload: bytes) -> None:
        """Raise (a ValueError or ProtocolError) unless a fetched contribution's payload fits the stage."""
        blob = msg.decode_contribution_body(payload).blob
        if self.sliced is not None:
            self.sliced.check_manifest(stage, outer_round, blob)
        else:
            self.worker.check_contribution(stage, outer_round, blob)

    def _apply_sliced(self, outer_round: int, stage: int, close: msg.Close):
        """The sliced exchange's aggregation: one valid partial per slice, assembled, the outer step."""
        used = self.sliced.partials(outer_round, stage, close)
        return self.worker.apply_partials(stage, outer_round, [partial.blob for partial in used])

    def _gather_stage(self, outer_round: int, stage: int, sealed_before, waited: dict[str, float],
                      prepare: bool = False, clock_from=None) -> tuple:
        """(close, envelopes, payloads, screened, prepared aggregation or None) of one stage of a round.

        Waits for the close and the contributions it names; ``prepare``: also aggregates (the pure
        part of the outer step, valid while no round is applied). Runs on the training thread, or
        on the prefetch thread while the next round trains (:meth:`_prefetch`; ``clock_from``: when
        the round deadline starts, see RoundCoordinator.await_close).
        """
        if sealed_before is not None:
            self.coordinator.adopt(outer_round, stage, sealed_before[stage])
        mark = time.monotonic()
        close = self.coordinator.accepted(outer_round, stage) or self.coordinator.await_close(
            outer_round, stage, clock_from=clock_from)
        waited["close_wait"] += time.monotonic() - mark
        if self.sliced is not None:  # the partials are fetched and applied at the apply (no screening)
            self.sliced.prefetch_inputs(outer_round, stage, close)  # an aggregator's envelopes, meanwhile
            return close, None, None, {}, None
        mark = time.monotonic()
        envelopes = self.contributions.collect(outer_round, stage, close)
        waited["fetch_wait"] += time.monotonic() - mark
        mark = time.monotonic()
        payloads = [msg.decode_contribution_body(decode_envelope(e, self.cfg.p2p.max_blob_bytes).payload).blob
                    for e in envelopes]
        screened, _reports = self.worker.screen(outer_round, payloads)
        prepared = None
        if prepare:
            prepared = self.worker.prepare_aggregation(stage, outer_round, payloads, screened)
            for envelope in envelopes:  # stored now (idempotent): the apply's own put then writes nothing
                self.archive.put(outer_round, envelope)
        waited["aggregate"] += time.monotonic() - mark
        return close, envelopes, payloads, screened, prepared

    def _prefetch(self, outer_round: int) -> None:
        """Close, fetch and aggregate ``outer_round`` on the prefetch thread while the next round trains.

        With the one-step delay round t-1 is applied after round t's inner steps; its close,
        its contributions and the pure part of its outer step do not depend on them (the
        global state changes only when a round is applied, and none is until then), so they
        are done meanwhile. The apply on the training thread joins it and uses the result
        (:meth:`_take_gathered`); an error there is raised as the inline gathering would.
        """
        if outer_round in self._prefetched:
            return
        sealed_before = self.recovery.sealed_closes(outer_round)

        # The deadline runs from when the training thread reaches the apply, as inline (set by
        # _take_gathered): only a decision that needs no deadline is taken sooner.
        def clock_from() -> float | None:
            return self._apply_reached.get(outer_round)

        def gather() -> _Gathered:
            waited = {"close_wait": 0.0, "fetch_wait": 0.0, "aggregate": 0.0}
            stages = {stage: self._gather_stage(outer_round, stage, sealed_before, waited, prepare=True,
                                                clock_from=clock_from)
                      for stage in self.worker.stages}
            return _Gathered(sealed_before, stages, waited)

        future: Future = Future()

        def run() -> None:
            try:
                future.set_result(gather())
            except BaseException as exc:  # noqa: BLE001 - raised on the training thread by _take_gathered
                future.set_exception(exc)

        # A daemon thread: one blocked on a close when the process exits must not hold the exit.
        threading.Thread(target=run, name=f"round-prefetch-{outer_round}", daemon=True).start()
        self._prefetched[outer_round] = future

    def _take_gathered(self, outer_round: int) -> tuple[_Gathered, dict[str, float]]:
        """The prefetched gathering of ``outer_round`` (waiting for it), or an empty one to fill inline."""
        future = self._prefetched.pop(outer_round, None)
        if future is None:
            return _Gathered(self.recovery.sealed_closes(outer_round), {}, {}), {}
        mark = time.monotonic()
        self._apply_reached[outer_round] = mark  # the prefetch's round deadline starts now
        self.book.notify()
        try:
            gathered = future.result()
        finally:
            self._apply_reached.pop(outer_round, None)
        gathered.joined_s = time.monotonic() - mark
        overlapped = {f"prefetch_{k}": v for k, v in gathered.waited.items()}
        return gathered, overlapped

    def _forget_before(self, outer_round: int) -> None:
        """Drop every room's state of rounds before ``outer_round`` (memory stays flat on long runs)."""
        self.contributions.forget_before(outer_round)
        if self.sliced is not None:
            self.sliced.forget_before(outer_round)
        self.coordinator.forget_before(outer_round)
        self.book.forget_before(outer_round)
        self.validator.advance(outer_round)
        for old in [r for r in self._train_info if r < outer_round]:
            del self._train_info[old]
        for old in [r for r in self._stage_hashes if r < outer_round - 8]:
            del self._stage_hashes[old]
        for old in [r for r in list(self._start_states) if r < outer_round]:  # list(): the lane adds rounds
            self._start_states.pop(old, None)
        for old in [r for r in self._evals if r < outer_round]:
            del self._evals[old]

    def _write_shard(self, outer_round: int, stage: int, weights_hash: bytes) -> bytes:
        weights, momentum = self.worker.global_state(stage)
        shard = Checkpoint(self.run_id, outer_round, dict(self.layout.model_config), self.config_hash,
                           {stage: weights_hash}, weights, momentum)
        path = self.checkpoint_dir / f"shard-{outer_round:08d}-stage{stage}.safetensors"
        digest = write_checkpoint(path, shard)
        serve_blob(self.host, path.read_bytes())
        return digest

    # ------------------------------------------------------------------ committer callbacks
    def _on_recorded(self, outer_round: int, weights_root: bytes, committed_by_me: bool) -> None:
        self.progress.weights_root = weights_root.hex()
        self.state.record_round(outer_round, weights_root, committed_by_me)
        if self.spot_checks is not None:
            self.spot_checks.on_recorded(outer_round, weights_root)

    def _stage_hashes_of(self, outer_round: int) -> dict[int, bytes]:
        """Stage -> weights hash of ``outer_round`` as this node computed it (round -1: the initial weights)."""
        if outer_round < 0:
            return self.worker.initial_hashes()
        return dict(self._stage_hashes.get(outer_round, {}))

    def _sign_envelope(self, outer_round: int, kind: str, payload: bytes) -> bytes:
        return Envelope.create(self.identity, self.run_id, outer_round, kind, payload,
                               replica=self.placement.replica if self.placement else -1).to_bytes()

    def _on_ejected(self, peer_id: str, account: bytes) -> None:
        """A member was found guilty on chain: stop counting it; if it is this node, stop."""
        self.membership.eject(peer_id)
        if peer_id == self.peer_id:
            logger.error("this node (account 0x%s) was found guilty by the run's quorum and removed from run %d; "
                         "stopping", account.hex(), self.run_id)
            self.ejected = True
            self.stop()
        else:
            logger.warning("member %s (account 0x%s) removed from the run: its messages no longer count",
                           peer_id[-8:], account.hex())

    def _on_confirmed(self, outer_round: int) -> None:
        self.progress.last_commit = max(self.progress.last_commit, outer_round)

    def _on_diverged(self, outer_round: int) -> None:
        """The chain's record of ``outer_round`` (a quorum's) is not what this node computed: re-enter from it.

        This node aggregated another set than the quorum did (a fork: docs/PROTOCOL.md, "When a
        node's weights leave the record"), so every later round of its would disagree as well. It
        stops, and the command starts it again, which enters after the chain's latest checkpoint
        as any restart does. Once per round in any life: if the same round diverges again (a
        checkpoint older than it, whose catch-up forks the same way), the node keeps going with
        the dispute on record.
        """
        done = self.state.get("reentered_for", [])
        if outer_round in done:
            logger.error("round %d: committed roots differ again after re-entering for it; not re-entering twice",
                         outer_round)
            return
        self.state.update(reentered_for=[*done[-15:], outer_round])
        logger.error("round %d: this node's weights left the run's committed record; stopping to re-enter from "
                     "the chain's latest checkpoint", outer_round)
        self.reenter_after = outer_round
        self.stop()

    # ------------------------------------------------------------------ gossip
    def _record_signer(self, record: RoundRecord, account: bytes, signature: bytes) -> tuple[str, bytes]:
        """(signer, EIP-712 digest) of a gossiped record signature by a member of the run, else ProtocolError."""
        try:
            signer = self.chain.signer_of(record, signature)
        except LedgerError as exc:
            raise msg.ProtocolError(f"record signature of round {record.round} does not verify: {exc}") from None
        if signer.lower() != "0x" + account.hex():
            raise msg.ProtocolError(f"record of round {record.round} is signed by {signer}, not by the account "
                                    f"0x{account.hex()} it names")
        if not self.chain.is_member(self.run_id, signer):
            raise msg.ProtocolError(f"record of round {record.round} is signed by {signer}, not a member of run "
                                    f"{self.run_id}")
        return signer, self.chain.client.record_digest(record)

    def _gossip(self, outer_round: int, kind: str, message, stage: int = -1) -> bytes:
        env = Envelope.create(self.identity, self.run_id, outer_round, kind, msg.encode_payload(message),
                              stage=stage, replica=self.placement.replica if self.placement else -1)
        data = env.to_bytes()
        try:
            self.host.publish(run_topic(self.run_id), data)
        except P2PError as exc:
            # Peers still get it: the host serves recent topic messages over /dlx/sync.
            logger.warning("publish %s for round %d failed: %s", kind, outer_round, exc)
        return data

    def _resync(self) -> None:
        """Pull recent run messages from every peer: gossip is best effort."""
        try:
            self.host.resync(run_topic(self.run_id), timeout=10)
        except P2PError as exc:
            logger.debug("resync failed: %s", exc)

    def _heartbeat_loop(self) -> None:
        last_hello, every = -math.inf, HEARTBEAT_S
        while not self.stop_event.wait(HEARTBEAT_S):
            try:
                if time.monotonic() - last_hello >= every - 0.05:
                    last_hello = time.monotonic()
                    hello = msg.Hello(self.cfg.cluster, self.cfg.cluster_size, self.chain.account_bytes,
                                      self.host.listen_addrs, self.progress.round, self.first_round)
                    env = Envelope.create(self.identity, self.run_id, 0, msg.HELLO, msg.encode_payload(hello))
                    self.host.publish(run_topic(self.run_id), env.to_bytes())
                connected = self.host.peers()
                every = hello_every(len(connected))
                self.membership.set_connected(connected)
                self.progress.peers = len(connected)
                self.progress.traffic = self.host.transfer_stats()
                stats = self.progress.traffic.values()
                self.progress.bytes_sent = sum(s.get("sent", 0) for s in stats)
                self.progress.bytes_received = sum(s.get("received", 0) for s in stats)
                self.progress.gossip_messages_sent = sum(s.get("messages_sent", 0) for s in stats)
                self.progress.gossip_messages_received = sum(s.get("messages_received", 0) for s in stats)
                if self.spot_checks is not None:
                    self.progress.spot_checks = self.spot_checks.checks_run
                    self.progress.spot_check_mismatches = self.spot_checks.mismatches
                    self.progress.chain_checks = self.spot_checks.chain_checks
                self._report(throttle=True)
            except P2PError as exc:
                logger.debug("heartbeat: %s", exc)
            except Exception:
                logger.exception("heartbeat failed")

    def _spawn(self, target, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    # ------------------------------------------------------------------ progress
    def _set_state(self, state: str) -> None:
        self.progress.state = state
        self._report()

    def _report(self, throttle: bool = False) -> None:
        now = time.monotonic()
        if throttle and now - self._last_report < 0.5:
            return
        self._last_report = now
        write_status(self.data_dir / "status.json", self.progress, self.peer_id, self.run_id, self.placement,
                     self.host.listen_addrs if self.host is not None else [], writer=self._status_writer)
        if self.on_progress is not None:
            self.on_progress(self.progress)

