"""Assembling a node: every part built once, here, in dependency order, with its collaborators passed in.

Three steps, because a node learns where it sits only from its peers' hellos:

1. :meth:`NodeParts.connect`: the chain (run, registration, membership checked)
   and the libp2p host;
2. :meth:`NodeParts.open_rooms`: what runs from before the node is placed: the
   messenger, membership, the exchange and its contribution pool, the round
   coordinator, the spot checks, the committer, the gossip inbox and the
   heartbeat; then the bootstrap peers;
3. :meth:`NodeParts.take_seat`: the placement, the worker of the placed stages,
   and the round machinery that trains and finishes rounds with it.

Every part reads what it needs from the node's :class:`~node.live.state.base.NodeBase`
(configuration, identity, files and books, built by the constructor) and is handed its
collaborators: a step-2 part by its sub-package's factory (``build.py``) or its class,
the round machinery of step 3 from the :class:`~node.live.rooms.Rooms` of step 2.
The rooms built in step 2 read the :class:`~node.live.state.station.Station` for what
step 3 decides. Which class builds each variable part is a :class:`Kinds`: the
exchange by ``diloco.exchange`` (:data:`EXCHANGES`), and subclasses a test or an
adversary injects (tests/adversary.py).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from queue import Queue

from node import protocol as msg
from node.arenas import settle_interned_strings
from node.config import NodeConfig
from node.errors import NodeError, NotRegistered
from node.fsutil import atomic_write_bytes
from node.live.fraud.answerer import ChallengeAnswerer
from node.live.fraud.chunkstate import ChunkedStates
from node.live.state.base import NodeBase
from node.live.rooms import Rooms
from node.live.parts.record import build_committer
from node.live.record.committer import Committer
from node.live.parts.checks import build_spot_checks
from node.live.parts.fraud import (
    build_binder,
    build_case_defender,
    build_case_opener,
    build_chunked_states,
    build_fraud_prover,
)
from node.live.worker.contributor import Contributor
from node.live.exchange.coordination import RoundCoordinator, RoundStopped
from node.live.parts.peers import build_heartbeat, build_inbox, build_membership, build_messenger
from node.live.parts.round import build_coordinator, build_ending, build_lifecycle, build_pace
from node.live.round.ending import RunEnd, RunOverWatch
from node.live.round.entry import RunEntry
from node.live.exchange.protocol import Exchange
from node.live.exchange.pool import serve_blob
from node.store.checkpoint_split import serve_split
from node.live.exchange.registry import EXCHANGES
from node.live.round.finisher import RoundFinisher
from node.live.record.forkrepair import ForkRepair
from node.live.peers.heartbeat import Heartbeat
from node.live.inbox import GossipInbox
from node.live.state.lane import RoundLane
from node.live.peers.lifecycle import Lifecycle
from node.live.peers.membership import Membership
from node.live.peers.messenger import Messenger
from node.live.chain.onchain import NodeChain
from node.live.round.pacing import CommitPace
from node.live.worker.replica import ReplicaWorker, warm_up_imports
from node.live.round.resume import RestartRecovery
from node.live.state.roundbook import RoundBook
from node.live.state.roundclock import RoundClock
from node.live.state.roundstate import RoundState
from node.live.state.saidlog import SaidLog
from node.live.startup import StartupClock
from node.live.state.station import Station
from node.live.state.topology import Seat
from node.live.state.status import Progress, Reporter, StateFile
from node.live.checks.verifier import SpotChecker
from node.platforms import own_platforms
from node.protocol import run_topic
from node.runconfig import canonical_json, config_hash, run_document
from node.shardfetch import provide_run_dataset
from node.store.archive import Archive
from node.store.checkpoint import RunLayout
from p2p.envelope import EnvelopeValidator
from p2p.errors import P2PError
from p2p.host import P2PHost
from p2p.identity import Identity
from training.errors import PipelineError

logger = logging.getLogger(__name__)

#: Run message kinds a member may sign again with another payload (periodic or per-accusation): the
#: validator does not hold them as equivocation, and node/live/state/saidlog.py does not keep them.
EQUIVOCATION_EXEMPT = (msg.HELLO, msg.ACCUSATION, msg.VERDICT, msg.PARTIAL_ANNOUNCE)

@dataclass(frozen=True)
class Kinds:
    """The classes a node's variable parts are built from (subclasses: fault injection in tests)."""

    worker: type[ReplicaWorker] = ReplicaWorker
    coordinator: type[RoundCoordinator] = RoundCoordinator
    exchanges: Mapping[str, type[Exchange]] = field(default_factory=lambda: EXCHANGES)
    contributor: type[Contributor] = Contributor
    finisher: type[RoundFinisher] = RoundFinisher
    heartbeat: type[Heartbeat] = Heartbeat
    committer: type[Committer] = Committer
    forks: type[ForkRepair] = ForkRepair


#: The parts of an honest node.
HONEST = Kinds()


class NodeParts:
    """Every part of one node (see module docstring); the node reads them, only this class builds them.

    The constructor builds what needs nobody else (the node's files, identity and books); a part
    of a later step is None until its step ran, so :meth:`close` closes what was built.
    """

    def __init__(self, cfg: NodeConfig, *, stop: threading.Event, kinds: Kinds = HONEST,
                 on_progress: Callable[[Progress], None] | None = None,
                 startup: StartupClock | None = None) -> None:
        self.cfg = cfg
        self.startup = startup or StartupClock()  # where this process's start-up time goes (its log)
        self.kinds = kinds
        self.stop = stop
        self.data_dir = Path(cfg.data_dir).expanduser()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.progress = Progress(inner_steps=cfg.diloco.inner_steps)
        # utilization per round (docs/DILOCOX.md section 4)
        self.clock = RoundClock(self.data_dir / "timing.jsonl")
        self.book = RoundBook()
        self.run_id = cfg.ledger.run_id
        self.document = run_document(cfg)
        self.config_hash = config_hash(self.document)
        # What every checkpoint of the run must be: metadata from the run document, the stages' tensors.
        self.layout = RunLayout.of_document(self.run_id, self.config_hash, self.document)
        self.identity = Identity.load_or_create(cfg.path(cfg.p2p.key_file))
        self.peer_id = self.identity.peer_id
        self.archive = Archive(self.data_dir / "archive", self.run_id)
        self.checkpoint_dir = self.data_dir / "checkpoints"
        self.incoming_dir = self.data_dir / "incoming"
        self.evidence_dir = self.data_dir / "evidence"
        self.state = StateFile(self.data_dir / "state.json", self.run_id)
        # The validator's window moves with the run (RoundFinisher.forget_before): memory stays flat and
        # messages far outside the rounds this node works on are refused.
        self.validator = EnvelopeValidator(self.run_id, max_size=msg.MAX_GOSSIP_PAYLOAD + 4096,
                                           max_rounds_ahead=64 + 4 * cfg.checkpoint_every,
                                           equivocation_exempt_kinds=EQUIVOCATION_EXEMPT)
        self.said = SaidLog(root=self.data_dir / "said", exempt_kinds=EQUIVOCATION_EXEMPT,
                            max_bytes=msg.MAX_GOSSIP_PAYLOAD + 4096)
        self.station = Station()
        self.rounds = RoundState(self.station)
        # Per-round work off the training thread (node/live/state/lane.py): compressing and publishing a
        # contribution, serialising and serving a start state, the held-out eval on a copy.
        self.lane = RoundLane()
        self.reporter = Reporter(path=self.data_dir / "status.json", progress=self.progress,
                                 peer_id=self.peer_id, run_id=self.run_id, station=self.station,
                                 on_progress=on_progress)
        self.base = NodeBase(
            cfg=cfg, stop=stop, run_id=self.run_id, identity=self.identity, peer_id=self.peer_id,
            document=self.document, config_hash=self.config_hash, layout=self.layout, data_dir=self.data_dir,
            checkpoint_dir=self.checkpoint_dir, incoming_dir=self.incoming_dir,
            evidence_dir=self.evidence_dir, archive=self.archive, state=self.state, progress=self.progress,
            clock=self.clock, book=self.book, station=self.station, rounds=self.rounds, lane=self.lane,
            reporter=self.reporter, validator=self.validator, said=self.said)
        self._threads: list[threading.Thread] = []
        # Step 1
        self.chain: NodeChain | None = None
        self.host: P2PHost | None = None
        # Step 2
        self.messenger: Messenger | None = None
        self.membership: Membership | None = None
        self.exchange: Exchange | None = None
        self.coordinator: RoundCoordinator | None = None
        self.lifecycle: Lifecycle | None = None
        self.forks: ForkRepair | None = None
        self.ending: RunEnd | None = None
        self.pace: CommitPace | None = None
        self.spot_checks: SpotChecker | None = None
        self.committer: Committer | None = None
        self.chunked: ChunkedStates | None = None  # a chunked run's stage states (step 2)
        self.inbox: GossipInbox | None = None
        self.heartbeat: Heartbeat | None = None
        self.rooms: Rooms | None = None  # what step 3 builds from
        # Step 3
        self.worker: ReplicaWorker | None = None
        self.recovery: RestartRecovery | None = None
        self.contributor: Contributor | None = None
        self.finisher: RoundFinisher | None = None
        self.entry: RunEntry | None = None

    def assemble(self) -> None:
        """The three steps (see module docstring); the trainer's imports warm up meanwhile
        (warm_up_imports)."""
        warm_up = threading.Thread(target=warm_up_imports, name="warm-up-imports", daemon=True)
        warm_up.start()
        own_seat = self.connect()
        self.open_rooms(own_seat)
        self.take_seat(warm_up)

    # ------------------------------------------------------------------ step 1
    def connect(self) -> Seat:
        """The chain and the host; return this node's account's seat in the run."""
        cfg = self.cfg
        self.reporter.set_state("joining")
        self.chain = chain = NodeChain.connect(cfg, stop=self.stop)
        chain.check_run(self.run_id, self.config_hash, rounds=cfg.rounds, commitments=cfg.diloco.commitments,
                        cfg=cfg)
        chain.ensure_registered(self.identity)
        platform, legacy = own_platforms(cfg.training, cfg.compute.processes)
        chain.ensure_member(self.run_id, platform, also=(legacy,))
        # Before the first message arrives: the validator's window starts where this node can
        # enter (after the chain's latest checkpoint). Left at round 0, every message of a round
        # past max_rounds_ahead (68 at checkpoint_every = 1) would be refused as "future", the
        # start-up resync's included, and the sync cursor moves past them: a node restarted late
        # in a run never saw the closes and attestations of the rounds it catches up, and waited
        # for them forever (bench_chaos.py, kills after round 68).
        checkpoint = chain.latest_checkpoint(self.run_id)
        self.validator.advance(checkpoint.round + 1 if checkpoint is not None else 0)
        own_seat = chain.seat(self.run_id, chain.account_bytes, self.identity.public_key_bytes)
        if own_seat is None:
            raise NotRegistered(
                f"account {chain.client.address} joined run {self.run_id} but its seat is not "
                "bound to this node's key (registered with another key?)")
        self.startup.mark("chain checked")
        self.host = P2PHost.start(cfg.p2p, self.identity, data_dir=self.data_dir)
        self.startup.mark("host started")
        serve_split(self.host, self.checkpoint_dir)  # kept split checkpoints' keys (the blobs are stored)
        self.reporter.listening(self.host.listen_addrs)
        return chain.seat_of(own_seat)

    def _seat_on_chain(self, account: bytes, public_key: bytes) -> Seat | None:
        """A hello's account's seat in the run (held or ended), if it is bound to the key (Membership)."""
        seat = self.chain.seat(self.run_id, account, public_key, current=False)
        return None if seat is None else self.chain.seat_of(seat)

    # ------------------------------------------------------------------ step 2
    def open_rooms(self, own_seat: Seat) -> None:
        """Everything that runs before this node is placed (each part by its sub-package's factory, in
        dependency order), then the bootstrap peers."""
        base, kinds, host, chain = self.base, self.kinds, self.host, self.chain
        self.messenger = messenger = build_messenger(base, host=host)
        self.membership = membership = build_membership(base, seat=self._seat_on_chain, own_seat=own_seat)
        charges: Queue = Queue()  # accusations an exchange raises, opened by the spot checker
        binder = build_binder(base, chain=chain)
        self.exchange = exchange = kinds.exchanges[self.cfg.diloco.exchange](
            base, messenger=messenger, host=host, membership=membership, charges=charges, binder=binder)
        self.coordinator = coordinator = build_coordinator(base, kind=kinds.coordinator, messenger=messenger,
                                                           membership=membership, exchange=exchange)
        coordinator.run_over = RunOverWatch(chain, self.run_id)  # issue 80: a run that ended stops the node
        self.lifecycle = lifecycle = build_lifecycle(base, membership=membership)
        opener = build_case_opener(base, chain=chain)  # follows up this node's accusations
        self.spot_checks = spot_checks = build_spot_checks(
            base, chain=chain, host=host, messenger=messenger, membership=membership, exchange=exchange,
            coordinator=coordinator, lifecycle=lifecycle, charges=charges,
            on_accused=opener.accused if opener is not None else None)
        self.ending = build_ending(base, chain=chain, membership=membership)
        self.pace = build_pace(base, chain=chain)
        self.forks = forks = kinds.forks(base, chain=chain, coordinator=coordinator, exchange=exchange,
                                         lifecycle=lifecycle, membership=membership)
        self.chunked = build_chunked_states(base, chain=chain, host=host)
        fraud = build_fraud_prover(base, chain=chain, states=self.chunked)
        self.ending.prover = fraud  # the run's end waits for its kept proofs (node/live/round/ending.py)
        lifecycle.prover = fraud  # a re-entry waits for its game on the forked round (lifecycle.py)
        self.committer = build_committer(base, kind=kinds.committer, chain=chain, host=host,
                                         coordinator=coordinator, membership=membership, messenger=messenger,
                                         spot_checks=spot_checks, forks=forks, fraud=fraud)
        self.rooms = Rooms(chain=chain, host=host, messenger=messenger, membership=membership,
                           exchange=exchange, coordinator=coordinator, lifecycle=lifecycle,
                           spot_checks=spot_checks, forks=forks, committer=self.committer,
                           chunked=self.chunked, binder=binder)
        self.inbox = inbox = build_inbox(base, chain=chain, membership=membership, exchange=exchange,
                                         spot_checks=spot_checks)
        self.heartbeat = build_heartbeat(base, kind=kinds.heartbeat, chain=chain, host=host,
                                         messenger=messenger, membership=membership, spot_checks=spot_checks)
        queue = host.subscribe(run_topic(self.run_id), validator=inbox.relay_ok,
                               keep_for_sync=functools.partial(inbox.keep_for_sync, own_peer_id=host.peer_id))
        self._spawn(functools.partial(inbox.run, queue, self.stop), "gossip")
        self._spawn(self.heartbeat.run, "heartbeat")
        if fraud is not None:  # a chunked run: answer the availability challenges of its right rounds
            self._spawn(ChallengeAnswerer(run_id=self.run_id, chain=chain, states=self.chunked, prover=fraud,
                                          stop=self.stop).run, "challenges")
        defender = build_case_defender(base, chain=chain, states=self.chunked)
        if defender is not None:  # a version-3 run: answer the contribution cases on this node's work
            self._spawn(defender.run, "cases")
        if opener is not None:
            self._spawn(opener.run, "case-opener")
        self._meet_peers()
        self.startup.mark("peers met")

    def _meet_peers(self) -> None:
        """Serve the run document, dial the bootstrap peers, pull what they said recently."""
        serve_blob(self.host, canonical_json(self.document))  # the run document, by its hash
        self.archive.write_run_document(canonical_json(self.document))
        self._serve_tokenizer()
        self._serve_init_weights()
        peers = []
        for addr in self.cfg.p2p.bootstrap:
            try:
                peers.append(self.host.connect(addr, timeout=10))
            except P2PError as exc:
                logger.warning("bootstrap %s unreachable: %s", addr, exc)
        # A prepared dataset: shards missing here come from the peers (each checked), then all are served.
        provide_run_dataset(self.host, self.cfg.training.data_path, self.document, peers)
        self.messenger.resync()

    def _serve_tokenizer(self) -> None:
        """Serve the run's tokenizer file by its sha256 (joiners fetch it like the run document) and keep a
        copy as ``tokenizers/<sha256>.json``, where ``pull --archive`` and the export look for it."""
        from training.tokenizer import BYTES, load_tokenizer

        if self.cfg.model.tokenizer == BYTES:
            return
        tokenizer = load_tokenizer(self.cfg.model.tokenizer, [self.data_dir / "tokenizers"])
        serve_blob(self.host, tokenizer.data)
        kept = self.data_dir / "tokenizers" / f"{tokenizer.sha256}.json"
        kept.parent.mkdir(parents=True, exist_ok=True)
        if not kept.exists():
            atomic_write_bytes(kept, tokenizer.data)

    def _serve_init_weights(self) -> None:
        """An imported model's initial weights (training/hf_import.py): served by their sha256 (the run
        document's ``model.init_weights``; joiners and the seeder fetch them like the tokenizer), kept as
        ``initial/<sha256>.safetensors``, where a ``sha256:`` reference (audit, fraud proofs) finds them."""
        from training.hf_import import INIT_DIR, add_search_dir

        spec = self.document.get("model", {}).get("init_weights", "")
        if not spec:
            return
        digest = spec.removeprefix("sha256:")
        kept = self.data_dir / INIT_DIR / f"{digest}.safetensors"
        own = Path(self.cfg.model.init_weights).expanduser()
        if not kept.exists() and own.is_file():
            kept.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(own, kept)
            except OSError:
                shutil.copyfile(own, kept)
        add_search_dir(self.data_dir / INIT_DIR)
        self.host.provide_file(kept, digest)

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    # ------------------------------------------------------------------ step 3
    def take_seat(self, warm_up: threading.Thread | None = None) -> None:
        """Wait for this node's placement; build and start its worker and the round machinery (once the
        ``warm_up`` imports are done: the worker's own imports never race them)."""
        cfg = self.cfg
        placement = self.membership.await_placement(cfg.diloco.num_replicas, cfg.join_timeout, self.stop)
        self.station.place(placement)
        self.startup.mark("placed")
        if warm_up is not None:
            warm_up.join()
            self.startup.mark("trainer imports warmed up")
        settle_interned_strings()  # once the imports are in: the interned strings' table at its lasting size
        logger.info("placed: cluster %s replica %d stages %s", placement.cluster, placement.replica,
                    list(placement.stages))
        self.worker = worker = self.kinds.worker(cfg=cfg, replica=placement.replica, stages=placement.stages,
                                                 rank=placement.rank, data_key=self.data_key(placement))
        self.station.hold(worker)
        self.start_worker(worker)
        self.startup.mark("pipeline formed")
        self.build_round_machinery(worker)

    def data_key(self, placement) -> bytes | None:
        """The key this node's replica draws its batches by where the run's windows are keyed by account
        (``training.data_windows = "account"``; None otherwise): the account of the member that holds the
        replica's stage 0, this node's own where it does. Every stage of a split replica reads the same batch,
        and the stage-0 contribution, which reads its tokens, is signed by that account, the key the chain's
        data dispute recomputes the windows from (docs/FRAUD_PROOF.md "The data's binding")."""
        if self.cfg.training.data_windows != "account":
            return None
        if 0 in placement.stages:
            return self.chain.account_bytes
        peer = self.membership.first_stage_peer(placement)
        account = None if peer is None else self.membership.account_of(peer)
        if account is None:
            raise NodeError(f"replica {placement.replica}: no account known for its stage-0 member, whose "
                            "account keys the run's data windows")
        return account

    def start_worker(self, worker: ReplicaWorker) -> None:
        """Start the worker; a split cluster's rendezvous is tried again until the partner is there.

        A restarted node whose surviving partner has not noticed the death yet (it is finishing a
        round, not using the pipeline) or whose partner is itself restarting finds no partner at
        the first rendezvous; it waits (as the survivor does, PipelineRejoin) instead of exiting."""
        cfg = self.cfg
        attempts = 0
        while True:
            attempts += 1
            try:
                worker.start(rendezvous_timeout=cfg.join_timeout * 2, op_timeout=cfg.round_timeout * 2 + 60,
                             mark=self.startup.mark)
                return
            except PipelineError as exc:
                if self.stop.is_set():
                    raise RoundStopped("stopped while waiting for the cluster's pipeline to form") from None
                logger.warning(
                    "cluster %r: pipeline not formed yet (attempt %d: %s); waiting for the partner",
                    cfg.cluster, attempts, exc)
                self.reporter.set_state("waiting for partner")
                self.stop.wait(1.0)

    def build_round_machinery(self, worker: ReplicaWorker) -> None:
        """Recovery, contributor, finisher and entry for ``worker`` (a unit test calls this with fakes
        outside)."""
        base, rooms, kinds = self.base, self.rooms, self.kinds
        self.recovery = recovery = RestartRecovery(base, rooms, worker)
        self.contributor = contributor = kinds.contributor(base, rooms, worker=worker)
        self.finisher = finisher = kinds.finisher(base, rooms, worker=worker, recovery=recovery,
                                                  contributor=contributor)
        self.entry = RunEntry(base, rooms, worker=worker, contributor=contributor, finisher=finisher)

    # ------------------------------------------------------------------ closing
    def close(self) -> None:
        """Stop and close every part built so far, the threads that use the others first."""
        self.stop.set()
        if self.committer is not None:
            self.committer.close()
        if self.spot_checks is not None:
            self.spot_checks.close()
            self.progress.spot_checks_left_undone = self.spot_checks.left_undone
        if self.exchange is not None:
            self.exchange.close()
        for thread in self._threads:
            thread.join(timeout=5)
        self.lane.close()
        if self.worker is not None:
            self.worker.close()
        if self.host is not None:
            self.host.close()
            self.host = None
            self.reporter.listening([])
        if self.chain is not None:
            self.chain.close()
        self.reporter.set_state("stopped")
        self.reporter.close()
