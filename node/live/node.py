"""A dlx-node contributor: joins a run, trains its stage(s), exchanges, commits.

The outer loop is DiLoCo's Algorithm 1 (arXiv 2311.08105) with DiLoCoX's
one-step-delay overlap (arXiv 2506.21263): round t's contributions travel and
are fetched in the background while round t+1 trains, and round t is finished
(closed, aggregated, attested, committed) after round t+1's inner steps::

    for outer_round in rounds:
        train_inner_steps(outer_round)          # H local AdamW steps
        publish_contributions(outer_round)      # encode, sign, archive, serve, announce
        finish_rounds_before(outer_round)       # close, fetch, aggregate, attest (round t-1)

The wire protocol (messages, coordinators, quorum, commits, checkpoints) is
specified in docs/PROTOCOL.md.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty

from node.live import protocol as msg
from node.live.protocol import run_topic
from node.store.archive import Archive, ArchivedContribution
from node.live.onchain import NodeChain
from node.store.checkpoint import Checkpoint, parse_checkpoint, write_checkpoint
from node.live.committer import Committer
from node.config import NodeConfig
from node.errors import NodeError, StateError
from node.live.exchange import ContributionPool
from node.fsutil import atomic_write_bytes, atomic_write_json
from node.live.replica import ReplicaWorker
from node.live.roundbook import PEER_TTL_S, Announced, RoundBook
from node.runconfig import canonical_json, config_hash, run_document
from node.live.topology import Declaration, Placement, assign_stages, committer_order
from p2p.envelope import Envelope, EnvelopeValidator, decode_envelope
from p2p.errors import EnvelopeRejected, P2PError
from p2p.host import P2PHost
from p2p.identity import Identity
from training.errors import PipelineError

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
CLOSE_FALLBACK_S = 6.0  # each next coordinator waits this much longer before closing


class RoundAbandoned(Exception):
    """Raised inside the inner loop when the node is asked to stop."""


@dataclass
class Progress:
    state: str = "starting"
    round: int = -1
    step: int = 0
    inner_steps: int = 0
    loss: float = math.nan
    eval_loss: float = math.nan
    peers: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    last_commit: int = -1
    last_finished: int = -1
    weights_root: str = ""
    history: list[dict] = field(default_factory=list)


class Node:
    """One contributor process (see module docstring)."""

    def __init__(self, cfg: NodeConfig, on_progress: Callable[[Progress], None] | None = None) -> None:
        self.cfg = cfg
        self.on_progress = on_progress
        self.data_dir = Path(cfg.data_dir).expanduser()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.stop_event = threading.Event()
        self.progress = Progress(inner_steps=cfg.diloco.inner_steps)
        self.book = RoundBook()
        self.run_id = cfg.ledger.run_id
        self.document = run_document(cfg)
        self.config_hash = config_hash(self.document)
        self.identity = Identity.load_or_create(cfg.path(cfg.p2p.key_file))
        self.peer_id = self.identity.peer_id
        self.archive = Archive(self.data_dir / "archive", self.run_id)
        self.checkpoint_dir = self.data_dir / "checkpoints"
        self.state_path = self.data_dir / "state.json"
        self.host: P2PHost | None = None
        self.chain: NodeChain | None = None
        self.worker: ReplicaWorker | None = None
        self.committer: Committer | None = None
        self.placement: Placement | None = None
        self.placements: dict[str, Placement] = {}
        self.validator = EnvelopeValidator(self.run_id, max_size=msg.MAX_GOSSIP_PAYLOAD + 4096,
                                           max_rounds_ahead=1 << 40, equivocation_exempt_kinds=(msg.HELLO,))
        self.contributions: ContributionPool | None = None
        self._threads: list[threading.Thread] = []
        self._state_lock = threading.RLock()
        self._state = self._load_state()
        self._train_info: dict[int, tuple[float, float, int]] = {}  # round -> (train loss, eval loss, tokens)
        self._accepted_closes: dict[tuple[int, int], msg.Close] = {}
        self._connected: set[str] = set()  # peers with an open connection (heartbeat's last look)
        self.first_round = -1  # first round this process contributes to (announced in hellos)
        # Rounds this node finished in an earlier life: it never signs a second, different
        # close or attestation for them (peers would hold both as equivocation evidence).
        self.previous_life_finished = self._state.get("last_finished", -1)

    # ------------------------------------------------------------------ lifecycle
    def run(self) -> Progress:
        """Join, train until ``cfg.rounds`` (or stop), finish pending rounds, shut down."""
        try:
            start_round, unfinished = self._join()
            self._train_loop(start_round, unfinished)
        finally:
            self.close()
        return self.progress

    def stop(self) -> None:
        """Ask the node to stop: the current round is abandoned, pending work flushed."""
        self.stop_event.set()

    def close(self) -> None:
        self.stop_event.set()
        if self.committer is not None:
            self.committer.close()
        if self.contributions is not None:
            self.contributions.close()
        for t in self._threads:
            t.join(timeout=5)
        if self.worker is not None:
            self.worker.close()
        if self.host is not None:
            self.host.close()
            self.host = None
        if self.chain is not None:
            self.chain.close()
        self._set_state("stopped")

    # ------------------------------------------------------------------ joining
    def _join(self) -> tuple[int, list[int]]:
        cfg = self.cfg
        self._set_state("joining")
        self.chain = NodeChain.connect(cfg)
        self.chain.check_run(self.run_id, self.config_hash)
        self.chain.ensure_registered(self.identity)
        self.host = P2PHost.start(cfg.p2p, self.identity, data_dir=self.data_dir)
        self.contributions = ContributionPool(self.host, self.book, self.run_id, self.data_dir / "incoming",
                                              cfg.p2p.max_blob_bytes, cfg.p2p.transfer_timeout,
                                              cfg.p2p.blob_concurrency)
        self._queue = self.host.subscribe(run_topic(self.run_id), validator=self._relay_ok)
        self._spawn(self._gossip_loop, "gossip")
        self._spawn(self._heartbeat_loop, "heartbeat")
        self.host.provide_blob(canonical_json(self.document))  # the run document, by its hash
        self.archive.write_run_document(canonical_json(self.document))
        for addr in cfg.p2p.bootstrap:
            try:
                self.host.connect(addr, timeout=10)
            except P2PError as exc:
                logger.warning("bootstrap %s unreachable: %s", addr, exc)
        self._resync()
        self.placement = self._await_placement()
        logger.info("placed: cluster %s replica %d stages %s", self.placement.cluster, self.placement.replica,
                    list(self.placement.stages))
        self.worker = ReplicaWorker(cfg, self.placement.replica, self.placement.stages, self.placement.rank)
        self.worker.start(rendezvous_timeout=self.cfg.join_timeout * 2, op_timeout=cfg.round_timeout * 2 + 60)
        self.committer = Committer(self)
        start_round, unfinished = self._entry_point()
        start_round = self.worker.agree_on_round(start_round)
        unfinished = [r for r in unfinished if r < start_round]
        self.first_round = start_round
        logger.info("entering at round %d (catching up %s)", start_round, unfinished or "nothing")
        return start_round, unfinished

    def _await_placement(self) -> Placement:
        deadline = time.monotonic() + self.cfg.join_timeout
        want = self.cfg.diloco.num_replicas
        while not self.stop_event.is_set():
            self.placements = self._compute_placements()
            mine = self.placements.get(self.peer_id)
            replicas = {p.replica for p in self.placements.values()}
            if mine is not None and (len(replicas) >= want or time.monotonic() > deadline):
                return mine
            if time.monotonic() > deadline + self.cfg.join_timeout:
                raise NodeError(f"cluster {self.cfg.cluster!r} did not form within {2 * self.cfg.join_timeout:.0f}s: "
                                f"check that its {self.cfg.cluster_size} members run and can reach each other")
            time.sleep(0.5)
        raise NodeError("stopped while joining")

    def _compute_placements(self) -> dict[str, Placement]:
        # Every peer ever heard of, not only the live ones: a replica index must not shift
        # when another cluster goes away (it seeds the replica's data shard).
        decls = [Declaration(self.peer_id, self.cfg.cluster, self.cfg.cluster_size)]
        for peer_id, info in self.book.live_peers(float("inf")).items():
            if peer_id != self.peer_id and self.chain.is_bound(info.hello.account, info.public_key):
                decls.append(Declaration(peer_id, info.hello.cluster, info.hello.cluster_size))
        return assign_stages(decls, self.cfg.pipeline.num_stages)

    def _entry_point(self) -> tuple[int, list[int]]:
        """Where this node enters: round 0 of a fresh run, or after the latest checkpoint."""
        others = [i.hello.training_round for p, i in self.book.live_peers(PEER_TTL_S).items()
                  if p != self.peer_id]
        live_round = max(others, default=-1)
        last_committed = self.chain.last_round(self.run_id)
        if last_committed < 0 and (live_round <= 0 or not self._round_closed(0)):
            # A fresh run whose round 0 is still open: a founding replica whose cluster formed
            # later than the others (a slow or loaded machine) still enters at round 0, and
            # the others wait for it up to the round deadline, as for any expected replica.
            return 0, []
        checkpoint = self.chain.latest_checkpoint(self.run_id)
        base = -1
        if checkpoint is not None:
            ckpt = self._download_checkpoint(checkpoint.round, checkpoint.content_hash)
            for stage in self.worker.stages:
                weights, momentum = ckpt.stage_state(self.worker.stage_names(stage))
                self.worker.load_global(stage, weights, momentum, ckpt.round)
            base = ckpt.round
            logger.info("restored stages %s from the chain-verified checkpoint of round %d",
                        list(self.worker.stages), base)
        start = max(live_round + 1, base + 1, self._state.get("last_contributed", -1) + 1)
        return start, list(range(base + 1, start))

    def _round_closed(self, outer_round: int) -> bool:
        """Whether any coordinator's close of ``outer_round`` (any stage) has reached this node."""
        return any(self.book.snapshot_closes(outer_round, stage) for stage in range(self.cfg.pipeline.num_stages))

    def _alive_peers(self) -> set[str]:
        """Peers that count as present: heard from within PEER_TTL_S, or still connected.

        A peer is declared gone only on evidence that survives a slow peer: a process that is
        stopped or starved of CPU keeps its connections open (the kernel holds them), so it stays
        expected until the round deadline; a crashed one drops its connections and, once its
        last message is PEER_TTL_S old, is gone.
        """
        return set(self.book.live_peers(PEER_TTL_S)) | self._connected

    def _download_checkpoint(self, round_index: int, content_hash: bytes) -> Checkpoint:
        path = self.checkpoint_dir / f"round-{round_index:08d}.safetensors"
        if path.exists() and hashlib.sha256(path.read_bytes()).digest() == content_hash:
            return parse_checkpoint(path.read_bytes(), content_hash)
        staged = self.data_dir / "incoming" / f"{content_hash.hex()}.part"
        staged.parent.mkdir(parents=True, exist_ok=True)
        # Every node assembles and serves the checkpoint: ask the live peers first (parallel
        # ranges from all of them), the DHT only if none of them has it.
        providers = [p for p in self.book.live_peers(PEER_TTL_S) if p != self.peer_id]
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
        # A joiner first replays the catch-up rounds that have closed already; with the
        # delay, the last one closes only after the peers' next round, so it waits.
        keep = 1 if self.cfg.diloco.one_step_delay else 0
        while len(unfinished) > keep and not self.stop_event.is_set():
            self._finish_round(unfinished.pop(0))
        outer_round = start_round
        end = self.cfg.rounds if self.cfg.rounds > 0 else None
        while not self.stop_event.is_set() and (end is None or outer_round < end):
            try:
                self._train_inner_steps(outer_round)
            except RoundAbandoned:
                logger.info("round %d abandoned on request", outer_round)
                break
            self._publish_contributions(outer_round)
            if not self.cfg.diloco.one_step_delay:
                unfinished.append(outer_round)
            while unfinished and (not self.cfg.diloco.one_step_delay or unfinished[0] < outer_round):
                self._finish_round(unfinished.pop(0))
            if self.cfg.diloco.one_step_delay:
                unfinished.append(outer_round)
            outer_round += 1
        # Finish what was exchanged; a stopping node waits only briefly.
        for r in unfinished:
            if self.stop_event.is_set():
                break
            self._finish_round(r)
        if self.committer is not None:
            self.committer.drain(timeout=self.cfg.round_timeout)

    def _train_inner_steps(self, outer_round: int) -> None:
        self.progress.round, self.progress.step = outer_round, 0
        self._set_state("training")

        def on_step(step: int, loss: float) -> None:
            self.progress.step, self.progress.loss = step, loss
            self._report(throttle=True)
            if self.stop_event.is_set():
                raise RoundAbandoned()

        try:
            stats = self.worker.train_round(outer_round, on_step)
        except PipelineError as exc:
            # A split cluster trains in lockstep; without its partner the replica cannot train.
            raise NodeError(
                f"round {outer_round}: pipeline of cluster {self.cfg.cluster!r} broke ({exc}); restart every "
                "node of the cluster: they rejoin from the chain's latest checkpoint"
            ) from exc
        eval_loss = self.worker.eval_loss()
        self.progress.eval_loss = eval_loss
        self._train_info[outer_round] = (stats.mean_loss, eval_loss, stats.tokens)
        logger.info("round %d: %d inner steps in %.1fs, loss %.4f, held-out %.4f", outer_round,
                    self.cfg.diloco.inner_steps, stats.seconds, stats.mean_loss, eval_loss)

    def _publish_contributions(self, outer_round: int) -> None:
        if outer_round <= self._state.get("last_contributed", -1):
            raise StateError(f"round {outer_round} was already contributed before a restart; refusing to re-sign")
        for stage in self.worker.stages:
            blob, cstats = self.worker.encode(stage, outer_round)
            envelope = Envelope.create(self.identity, self.run_id, outer_round, msg.CONTRIBUTION, blob,
                                       stage=stage, replica=self.placement.replica).to_bytes()
            digest = self.archive.put(outer_round, envelope)
            self.host.provide_blob(envelope)
            self.contributions.add(outer_round, stage, digest, envelope)
            self.book.add_announce(outer_round, stage,
                                   Announced(self.peer_id, self.placement.replica, digest, len(envelope)))
            self._gossip(outer_round, msg.ANNOUNCE, msg.Announce(digest, len(envelope)), stage)
            logger.info("round %d stage %d: contribution %s, %d bytes (ratio %.0fx)", outer_round, stage,
                        digest.hex()[:12], len(envelope), getattr(cstats, "ratio", float("nan")))
        self._state["last_contributed"] = outer_round
        self._save_state()

    # ------------------------------------------------------------------ finishing a round
    def _finish_round(self, outer_round: int) -> None:
        """Close, fetch, aggregate and attest ``outer_round`` for every stage this node holds."""
        self._set_state("finishing")
        contributed = outer_round in self._train_info
        sealed: list[ArchivedContribution] = []
        hashes: dict[int, bytes] = {}
        for stage in self.worker.stages:
            close = self._await_close(outer_round, stage)
            envelopes = self.contributions.collect(outer_round, stage, close)
            payloads = [decode_envelope(e, self.cfg.p2p.max_blob_bytes).payload for e in envelopes]
            hashes[stage] = self.worker.apply(stage, outer_round, payloads)
            for (replica, peer_id, digest, _size), envelope in zip(close.contributions, envelopes):
                self.archive.put(outer_round, envelope)
                sealed.append(ArchivedContribution(stage, replica, peer_id, digest))
        self.archive.seal_round(outer_round, sealed)
        for pruned in self.archive.prune(self.cfg.retention_rounds).values():
            for digest in pruned:
                self.host.remove_blob(digest.hex())
        checkpoint_round = (outer_round + 1) % self.cfg.checkpoint_every == 0
        for stage in self.worker.stages:
            shard_hash = self._write_shard(outer_round, stage, hashes[stage]) if checkpoint_round else b""
            train_loss, eval_loss, tokens = self._train_info.get(outer_round, (math.nan, math.nan, 0))
            last = stage == self.cfg.pipeline.num_stages - 1
            att = msg.Attestation(hashes[stage], self._stage_root(outer_round, stage), len(self._close_of(
                outer_round, stage).contributions), train_loss if last and contributed else math.nan,
                eval_loss if last and contributed else math.nan, tokens, shard_hash, b"")
            self.book.add_attestation(outer_round, stage, self.peer_id, att)
            if outer_round > self.previous_life_finished:
                self._gossip(outer_round, msg.ATTESTATION, att, stage)
        self.contributions.forget_before(outer_round - 2)
        self.progress.last_finished = outer_round
        self._state["last_finished"] = outer_round
        self._save_state()
        self.committer.submit(outer_round)
        self._report()

    def _close_of(self, outer_round: int, stage: int) -> msg.Close:
        return self._accepted_closes[(outer_round, stage)]

    def _stage_root(self, outer_round: int, stage: int) -> bytes:
        from ledger.merkle import merkle_root

        return merkle_root([c[2] for c in self._close_of(outer_round, stage).contributions])

    def _holders(self, stage: int) -> list[str]:
        self.placements = self._compute_placements()
        return sorted(p for p, pl in self.placements.items() if stage in pl.stages)

    def _await_close(self, outer_round: int, stage: int) -> msg.Close:
        """Wait for the round's close decision; close it ourselves if we are the coordinator."""
        order = committer_order(outer_round * 1000 + stage, self._holders(stage))
        started = time.monotonic()
        deadline = started + self.cfg.round_timeout

        def decide() -> msg.Close | None:
            now = time.monotonic()
            closes = self.book.snapshot_closes(outer_round, stage)
            live = alive
            # Coordinators that are gone (see _alive_peers) are skipped at once.
            ranked = [c for c in order if c == self.peer_id or c in live]
            for rank, coordinator in enumerate(order):
                if coordinator in closes and (rank == 0 or now >= started + rank * CLOSE_FALLBACK_S
                                              or coordinator in ranked[:1]):
                    return closes[coordinator][0]
            if self.peer_id in ranked and outer_round > self.previous_life_finished:
                rank = ranked.index(self.peer_id)
                if rank == 0 or now >= deadline + rank * CLOSE_FALLBACK_S:
                    return self._try_close(outer_round, stage, final=now >= deadline, alive=alive)
            return None

        last_resync = started
        alive = self._alive_peers()
        while True:
            self.contributions.prefetch(outer_round, stage)
            alive = self._alive_peers()
            close = self.book.wait_for(decide, timeout=1.0, stop=None)
            if close is None and time.monotonic() - last_resync > 5.0:
                last_resync = time.monotonic()
                self._resync()
            if close is not None:
                self._accepted_closes[(outer_round, stage)] = close
                return close
            if time.monotonic() > deadline + (len(order) + 2) * CLOSE_FALLBACK_S:
                raise NodeError(f"round {outer_round} stage {stage}: no coordinator closed the round within "
                                f"{self.cfg.round_timeout:.0f}s (+fallbacks); is a quorum of replicas alive?")

    def _try_close(self, outer_round: int, stage: int, final: bool, alive: set[str]) -> msg.Close | None:
        """As coordinator: close when every live replica's contribution is here, or at the deadline."""
        announced = self.book.snapshot_announces(outer_round, stage)
        have = self.contributions.have(outer_round, stage)
        ready = {a.peer_id: a for a in announced.values() if a.envelope_hash in have}
        # Expected: every live holder of the stage that entered the run at or before this
        # round, or has not yet decided where it enters (first_round -1: it is still joining;
        # at a fresh start that is everyone for a moment). A node that is catching up
        # (first_round > round) will not contribute to it.
        peers = self.book.live_peers(float("inf"))
        expected = {p for p, pl in self.placements.items() if stage in pl.stages and (
            (p == self.peer_id and outer_round in self._train_info)
            or (p in alive and p in peers and peers[p].hello.first_round <= outer_round))}
        replicas = {a.replica for a in ready.values()}
        if not (expected <= set(ready) or (final and len(replicas) >= self.cfg.quorum)):
            return None
        entries = sorted([[a.replica, a.peer_id, a.envelope_hash, a.size] for a in ready.values()],
                         key=lambda e: (e[0], e[1], e[2]))
        close = msg.Close(entries)
        data = self._gossip(outer_round, msg.CLOSE, close, stage)
        self.book.add_close(outer_round, stage, self.peer_id, close, data)
        late = {self.placements[p].replica for p in expected - set(ready)}
        logger.info("round %d stage %d closed with replicas %s%s", outer_round, stage, sorted(replicas),
                    f" (missing {sorted(late)})" if late else "")
        return close

    def _write_shard(self, outer_round: int, stage: int, weights_hash: bytes) -> bytes:
        weights, momentum = self.worker.global_state(stage)
        shard = Checkpoint(self.run_id, outer_round, _model_dict(self.cfg), self.config_hash,
                           {stage: weights_hash}, weights, momentum)
        path = self.checkpoint_dir / f"shard-{outer_round:08d}-stage{stage}.safetensors"
        digest = write_checkpoint(path, shard)
        self.host.provide_blob(path.read_bytes())
        return digest

    # ------------------------------------------------------------------ gossip
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

    def _relay_ok(self, data: bytes, _from: str = "") -> bool:
        """Topic validator: only well-formed, signed envelopes of this run are relayed."""
        try:
            env = decode_envelope(data, self.validator.max_size)
        except EnvelopeRejected:
            return False
        return env.run_id == self.run_id and env.kind in msg.KINDS

    def _gossip_loop(self) -> None:
        queue = self._queue
        while not self.stop_event.is_set():
            try:
                data, _from = queue.get(timeout=0.5)
            except Empty:
                continue
            try:
                self._on_message(data)
            except (EnvelopeRejected, msg.ProtocolError) as exc:
                if getattr(exc, "reason", "") != "replayed":
                    logger.debug("dropped message: %s", exc)
            except Exception:  # a bad message must never kill the consumer
                logger.exception("error while handling a gossip message; dropped")

    def _on_message(self, data: bytes) -> None:
        env = decode_envelope(data, self.validator.max_size)
        if env.kind == msg.HELLO:
            if env.run_id != self.run_id:
                return
            hello = msg.decode_payload(msg.HELLO, env.payload)
            self.book.add_hello(env.sender_peer_id, env.sender, hello)
            return
        env = self.validator.check(data)
        payload = msg.decode_payload(env.kind, env.payload)
        sender = env.sender_peer_id
        self.book.heard_from(sender)
        placed = self.placements.get(sender)
        if env.kind in (msg.ANNOUNCE, msg.CLOSE, msg.ATTESTATION) and (
                placed is None or env.stage not in placed.stages
                or (env.kind == msg.ANNOUNCE and env.replica != placed.replica)):
            self.placements = self._compute_placements() if self.chain is not None else {}
            placed = self.placements.get(sender)
            if placed is None or env.stage not in placed.stages or (
                    env.kind == msg.ANNOUNCE and env.replica != placed.replica):
                raise msg.ProtocolError(f"{env.kind} from {sender[-8:]} for stage {env.stage} replica "
                                        f"{env.replica} does not match its placement")
        if env.kind == msg.ANNOUNCE:
            self.book.add_announce(env.round, env.stage, Announced(sender, env.replica, payload.envelope_hash,
                                                                   payload.size))
            if self.worker is not None and env.stage in self.worker.stages:
                self.contributions.prefetch(env.round, env.stage)
        elif env.kind == msg.CLOSE:
            self.book.add_close(env.round, env.stage, sender, payload, data)
        elif env.kind == msg.ATTESTATION:
            self.book.add_attestation(env.round, env.stage, sender, payload)

    def _resync(self) -> None:
        """Pull recent run messages from every peer: gossip is best effort."""
        try:
            self.host.resync(run_topic(self.run_id), timeout=10)
        except P2PError as exc:
            logger.debug("resync failed: %s", exc)

    def _heartbeat_loop(self) -> None:
        while not self.stop_event.wait(HEARTBEAT_S):
            try:
                hello = msg.Hello(self.cfg.cluster, self.cfg.cluster_size, self.chain.account_bytes,
                                  self.host.listen_addrs, self.progress.round, self.first_round)
                env = Envelope.create(self.identity, self.run_id, 0, msg.HELLO, msg.encode_payload(hello))
                self.host.publish(run_topic(self.run_id), env.to_bytes())
                self._connected = set(self.host.peers())
                self.progress.peers = len(self._connected)
                stats = self.host.transfer_stats().values()
                self.progress.bytes_sent = sum(s.get("sent", 0) for s in stats)
                self.progress.bytes_received = sum(s.get("received", 0) for s in stats)
                self._report(throttle=True)
            except P2PError as exc:
                logger.debug("heartbeat: %s", exc)
            except Exception:
                logger.exception("heartbeat failed")

    def _spawn(self, target, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    # ------------------------------------------------------------------ state and progress
    def _load_state(self) -> dict:
        import json

        if not self.state_path.exists():
            return {}
        try:
            state = json.loads(self.state_path.read_text())
        except (OSError, ValueError) as exc:
            raise StateError(f"state file {self.state_path} is corrupt ({exc}); move it away to start fresh, "
                             "the node will then rejoin from the chain's latest checkpoint") from None
        if state.get("run_id") != self.run_id:
            return {}
        return state

    def _save_state(self) -> None:
        with self._state_lock:
            self._state["run_id"] = self.run_id
            atomic_write_json(self.state_path, self._state)

    def record_round(self, outer_round: int, weights_root: bytes, committed_by_me: bool) -> None:
        """Remember the weights root this node computed for a round (state.json, for operators/tests)."""
        with self._state_lock:
            self._state.setdefault("weights_roots", {})[str(outer_round)] = weights_root.hex()
            if committed_by_me:
                self._state.setdefault("committed", []).append(outer_round)
        self._save_state()

    def _set_state(self, state: str) -> None:
        self.progress.state = state
        self._report()

    _last_report = 0.0

    def _report(self, throttle: bool = False) -> None:
        now = time.monotonic()
        if throttle and now - self._last_report < 0.5:
            return
        self._last_report = now
        p = self.progress
        status = {
            "pid": os.getpid(), "peer_id": self.peer_id, "run_id": self.run_id, "state": p.state,
            "round": p.round, "step": p.step, "inner_steps": p.inner_steps, "loss": _num(p.loss),
            "eval_loss": _num(p.eval_loss), "peers": p.peers, "bytes_sent": p.bytes_sent,
            "bytes_received": p.bytes_received, "last_finished": p.last_finished, "last_commit": p.last_commit,
            "weights_root": p.weights_root, "updated_at": time.time(),
            "placement": None if self.placement is None else {
                "cluster": self.placement.cluster, "replica": self.placement.replica,
                "stages": list(self.placement.stages)},
            "listen_addrs": self.host.listen_addrs if self.host is not None else [],
        }
        try:
            atomic_write_json(self.data_dir / "status.json", status)
        except OSError as exc:
            logger.debug("status not written: %s", exc)
        if self.on_progress is not None:
            self.on_progress(p)


def _num(x: float) -> float | None:
    return None if x is None or math.isnan(x) else x


def _model_dict(cfg: NodeConfig) -> dict:
    import dataclasses

    return dataclasses.asdict(cfg.model)
