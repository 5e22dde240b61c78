"""Finishing a round: close, fetch, aggregate, seal, attest; then the committer takes it to the chain.

For every stage this node holds, :meth:`RoundFinisher.finish` waits for the
round's close (docs/PROTOCOL.md, "Closing a round"), has the exchange fetch
and aggregate what it names and take the outer step, seals the round in the
archive, writes and serves the stage shard on checkpoint rounds, and gossips
the stage's attestation. With the one-step delay, round t-1's close, fetch and
the pure part of its aggregation run on a prefetch thread while round t trains
(:meth:`RoundFinisher.prefetch`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

from node.live.state.base import NodeBase
from node.live.rooms import Rooms
from node import protocol as msg
from node.arenas import trim_heap
from node.fsutil import retry_on_full_disk
from node.live.worker.contributor import Contributor
from node.live.exchange.protocol import InputsWithheld
from node.live.exchange.pool import serve_blob
from node.live.fraud.contribution_binding import bindings_in
from node.live.worker.replica import ReplicaWorker
from node.live.round.resume import RestartRecovery
from node.live.state.roundstate import Gathered, StageInputs
from node.store.archive import ArchivedContribution
from node.store.checkpoint import Checkpoint, write_checkpoint
from node.store.readback import read_back
from node.live.fraud.window import DisputeWindow
from node.store.retention import (Retention, prune_archive_before, prune_checkpoints_except,
                                  prune_shards)
from node.live.round.prefetch import ApplyPrefetch

logger = logging.getLogger(__name__)

#: Rounds of state kept behind the last finished one (the committer and slow peers' attestations need them).
ROUNDS_KEPT = 3

#: Global states (per stage, references: the engine never changes one in place) kept behind the last
#: applied round, for a survivor's re-entry (:meth:`RoundFinisher.held_states`, node/live/round/entry.py). The
#: round it re-enters, t, is still open, so it finished t - 1 at most and needs the state of t - 1 - pending
#: (pending <= 1): the last applied state (the engine's own, no copy) and the one before it (one copy of a
#: stage's weights and momentum held in memory). More would cost a copy of the stage per round kept.
HELD_ROUNDS = 1


@dataclass
class StageApplied:
    """One stage of a round after its outer step: what the round's seal and attestation need of it."""

    stage: int
    weights_hash: bytes
    sealed: list[ArchivedContribution]
    excluded: list[list]  # [stage, replica, peer id, envelope hash, reason, detail]
    # A chunked run's (node/live/fraud/chunkstate.py): derives, keeps and publishes the stage's chunk state,
    # and returns its stage leaf (of the record's root) for the attestation. Called in the round's tail (on
    # the round lane with overlap_tail): it costs several times the outer step (bench/bench_chunk_state.py)
    # and nothing the next round's inner steps read depends on it.
    record_state: Callable[[], bytes] | None = None
    _leaf: bytes | None = None

    def stage_leaf(self) -> bytes:
        """The stage leaf, derived once (a tail paused by a full disk and tried again does not redo it)."""
        if self._leaf is None:
            self._leaf = self.record_state() if self.record_state is not None else b""
        return self._leaf


class RoundFinisher(ApplyPrefetch):
    """Finishes rounds for the stages this node holds (see module docstring)."""

    def __init__(self, base: NodeBase, rooms: Rooms, *, worker: ReplicaWorker, recovery: RestartRecovery,
                 contributor: Contributor) -> None:
        cfg = self.cfg = base.cfg
        self.worker = worker
        self.rounds = base.rounds
        self.exchange = rooms.exchange
        self.pool = rooms.exchange.pool
        self.coordinator = rooms.coordinator
        self.recovery = recovery
        self.contributor = contributor
        self.committer = rooms.committer
        self.forks = rooms.forks
        self.archive = base.archive
        self.host = rooms.host
        self.book = base.book
        self.messenger = rooms.messenger
        self.validator = base.validator
        self.state = base.state
        self.clock = base.clock
        self.progress = base.progress
        self.reporter = base.reporter
        self.layout = base.layout
        self.config_hash = base.config_hash
        self.checkpoint_dir = base.checkpoint_dir
        self.peer_id = base.peer_id
        self.chunked = rooms.chunked  # a chunked run's stage states (None: a hashed run)
        self.spot_checks = rooms.spot_checks  # serves this node's start states (the retention prunes them)
        # what may be deleted, from the chain's windows (node/store/retention.py)
        window = DisputeWindow(rooms.chain, cfg.ledger.run_id)
        self.retention = Retention(cfg.storage, window.own_open, window.open)
        self.stop = base.stop  # a write paused by a full disk gives up (DiskFull) when the node stops
        self.run_id = cfg.ledger.run_id
        # round -> stage -> (global weights, momentum) once the round was applied (the state before a round's
        # apply is recorded as the previous round's: a re-base of that round is in it).
        self._held: dict[int, dict[int, tuple[dict, dict]]] = {}
        self._replays: dict[int, dict[int, tuple[dict, dict]]] = {}  # finished rounds to absorb again
        # the round lane (node/live/state/lane.py): a round's seal and attestation with overlap_tail
        self.lane = base.lane
        self._tail: Future | None = None  # the last such round's, until settle()

    # -- a survivor's re-entry (node/live/round/entry.py, RunEntry.await_partner) ------------------
    def held_states(self) -> dict[int, dict[int, tuple[dict, dict]]]:
        """Round -> stage -> the global (weights, momentum) after that round, for the last rounds applied
        here."""
        stages = set(self.worker.stages)
        return {r: dict(states) for r, states in self._held.items() if set(states) == stages}

    def replay(self, outer_round: int, states: dict[int, tuple[dict, dict]]) -> None:
        """Have the next :meth:`finish` of ``outer_round`` (a round finished already, whose global state this
        node re-entered before) absorb ``states`` again instead: nothing fetched, sealed, attested or signed
        a second time."""
        self._replays[outer_round] = states

    def _hold(self, outer_round: int, stage: int) -> None:
        self._held.setdefault(outer_round, {})[stage] = self.worker.global_state(stage)
        for old in [r for r in self._held if r < outer_round - HELD_ROUNDS]:
            del self._held[old]
        for old in [r for r in self._replays if r < outer_round - HELD_ROUNDS]:
            del self._replays[old]  # never asked for again (its round is long applied)

    def _replay(self, outer_round: int, states: dict[int, tuple[dict, dict]]) -> None:
        self.contributor.join_start_state()  # the start state read the engines as they were
        self.contributor.join_engine_work()
        for stage in self.worker.stages:
            self.worker.absorb_held(stage, outer_round, *states[stage])
            self._hold(outer_round, stage)
        logger.info("round %d: applied again from the result this node finished it with (re-entry)",
                    outer_round)

    # -- one round ------------------------------------------------------------------------
    def finish(self, outer_round: int, overlap_tail: bool = False) -> None:
        """Close, fetch, aggregate and attest ``outer_round`` for every stage this node holds.

        ``overlap_tail``: what follows the outer step (seal, retention, the attestation with its
        checkpoint shard, the hand-over to the committer) runs on the round lane (node/live/state/lane.py)
        while the next round trains, instead of on this thread; nothing the inner steps read
        depends on it. The main loop's applies pass it (issue 44: it was the most of a round's idle
        time on the training thread); every other caller gets the round finished on return.
        """
        self.settle()
        replayed = self._replays.pop(outer_round, None)
        if replayed is not None:
            self._replay(outer_round, replayed)
            return
        self.reporter.set_state("finishing")
        started = time.monotonic()
        self._rebase_before(outer_round)
        waited = {"close_wait": 0.0, "fetch_wait": 0.0, "aggregate": 0.0}
        contributed = outer_round in self.rounds.trained
        gathered, overlapped = self._take_gathered(outer_round)
        waited["close_wait"] += gathered.joined_s  # the training thread waited for the prefetch
        applied = [self._apply_stage(outer_round, stage, gathered, waited, contributed)
                   for stage in self.worker.stages]
        waited["finish_other"] = max(0.0, time.monotonic() - started - sum(waited.values()))
        for phase, seconds in waited.items():
            self.clock.add(phase, seconds)

        def tail() -> None:
            tail_started = time.monotonic()
            with self.clock.lane("finish") if overlap_tail else nullcontext():
                # A full disk pauses the seal (and so, at the next round's settle, the training thread) until
                # space is freed, then does it: every step is idempotent and the hand-over to the committer
                # comes last, so the round is sealed, attested and committed once (issue 45).
                retry_on_full_disk(lambda: self._seal_and_attest(outer_round, applied, contributed,
                                                                 report_state=not overlap_tail),
                                   what=f"round {outer_round}'s archive seal and attestation",
                                   kind="archive seal", stop=self.stop)
            tail_s = time.monotonic() - tail_started
            if not overlap_tail:
                self.clock.add("finish_other", tail_s)
            self.clock.finished(outer_round, gathered.last_arrival, total=time.monotonic() - started,
                                **waited, **overlapped, tail=tail_s, tail_overlapped=tail_s if overlap_tail
                                else 0.0)
            self.progress.timing = self.clock.summary()
            self.reporter.report()

        if overlap_tail:
            self._tail = self.lane.submit(tail)
        else:
            tail()
        # Rounds ROUNDS_KEPT behind this one: none of them is what the tail still reads.
        self.forget_before(min(outer_round - ROUNDS_KEPT, self.committer.handled_through))

    def settle(self) -> None:
        """Wait until the last round finished with ``overlap_tail`` is sealed, attested and handed to the
        committer (its failure is raised here, the round lane's first failure)."""
        tail, self._tail = self._tail, None
        if tail is not None:
            self.lane.join(tail)

    def _seal_and_attest(self, outer_round: int, applied: list[StageApplied], contributed: bool,
                         report_state: bool) -> None:
        """What follows a round's outer step: seal, retention, attest, then the committer takes it."""
        # A sliced holder archives the closed envelopes it holds; each contributor archives its own.
        self.archive.seal_round(outer_round, [c for a in applied for c in a.sealed],
                                excluded=[e for a in applied for e in a.excluded],
                                all_held=self.exchange.holds_all_envelopes)
        # Retention (node/store/retention.py): never a round or the checkpoint a restart, a peer or an open
        # window on chain needs.
        self.retain(outer_round)
        self._attest(outer_round, {a.stage: (a.weights_hash, a.stage_leaf()) for a in applied}, contributed,
                     report_state)
        self.progress.last_finished = outer_round
        self.state.update(last_finished=outer_round)
        self.committer.submit(outer_round)

    def retain(self, outer_round: int) -> None:
        """Delete the archive rounds, served start states and checkpoints no open window needs any more
        (``storage.retention``, node/store/retention.py), after ``outer_round``'s seal."""
        if self.retention.keeps_all:
            return
        committed = self.progress.last_commit
        held = sorted({*self.archive.rounds(), *self.spot_checks.states.served_rounds()})
        floor = self.retention.rounds_floor(outer_round, committed, held)
        states = self.spot_checks.states
        states.forget_before(min(floor, committed + 1))
        # a start state rebuilt from an older kept one replays the rounds between (staterebuild.py)
        prune_archive_before(self.archive, states.archive_floor(floor), committed, self.host.remove_blob)
        kept, shards = self.retention.checkpoint_plan(self.checkpoint_dir, committed,
                                                      one_stage=self.layout.num_stages == 1)
        prune_checkpoints_except(self.checkpoint_dir, kept, committed, self.host.remove_blob)
        prune_shards(shards, self.host.remove_blob)

    def _rebase_before(self, outer_round: int) -> None:
        """Take the chain's record of an earlier round this node forked from, before applying ``outer_round``
        (node/live/record/forkrepair.py; waits until the round before stands: the chain's verdict, or a quorum
        of attestations confirming this node's result, at most ``round_timeout``)."""
        rebases = self.forks.due(outer_round)
        if rebases:
            self.contributor.join_start_state()  # the start state read the engines as they were
            self.contributor.join_engine_work()
            for rebase in rebases:
                if self.forks.apply(rebase):
                    self._withhold_on(rebase.outer_round)
            # the next start state does not follow from the last one by a replay: it is kept, not rebuilt
            self.spot_checks.states.discontinuity()

    def _withhold_on(self, rebased: int) -> None:
        """A round whose start state was captured before the re-base of ``rebased`` and is not announced yet
        holds the forked result in its start state's global weights: it would not rerun from what it binds
        with the record, so it is never announced; the node contributes again from the next round it starts
        (docs/PROTOCOL.md, "When a node's weights leave the record")."""
        for outer_round in self.rounds.withhold_on(rebased, self.cfg.diloco):
            logger.warning("round %d: trained on our result of round %d before the re-base; our contribution "
                           "of it is not announced (we contribute again from the next round)", outer_round,
                           rebased)

    def _apply_stage(self, outer_round: int, stage: int, gathered: Gathered, waited: dict[str, float],
                     contributed: bool) -> StageApplied:
        """The outer step of one stage of the round, on the close's set (gathered now unless prefetched)."""
        # The prefetch's close is this node's decision of the round (RoundCoordinator.accepted): the
        # decision does not depend on when it is taken (no membership change seen meanwhile moves it).
        if stage not in gathered.stages:
            gathered.stages[stage] = self.gather_stage(outer_round, stage, gathered.sealed_before, waited)
        inputs = gathered.stages[stage]
        mark = time.monotonic()
        self.contributor.join_start_state()  # the start state read the engines as they were
        self.forks.remember_base(outer_round, stage, self.worker.global_state(stage))
        self._hold(outer_round - 1, stage)  # after any re-base of the round before (_rebase_before)
        inputs, (result, envelopes) = self._apply_or_reclose(outer_round, stage, inputs, waited)
        self._hold(outer_round, stage)
        waited["aggregate"] += time.monotonic() - mark
        close = inputs.close
        for entry in close.contributions:  # when each was here: the round's exchange time
            arrived = self.pool.arrived_at(entry[2])
            if arrived is not None and (gathered.last_arrival is None or arrived > gathered.last_arrival):
                gathered.last_arrival = arrived
        self.rounds.stage_hashes.setdefault(outer_round, {})[stage] = result.weights_hash
        excluded = []
        for report in result.contributions:
            if not report.accepted:
                replica, peer_id, digest, _size = close.contributions[report.index]
                logger.warning("round %d stage %d: contribution %s of replica %d (%s) excluded: %s %s",
                               outer_round, stage, digest.hex()[:12], replica, peer_id[-8:], report.reason,
                               report.detail)
                excluded.append([stage, replica, peer_id, digest.hex(), report.reason, report.detail])
        if contributed and not any(entry[1] == self.peer_id for entry in close.contributions):
            # the residual it goes back into: after the encode on the lane
            self.contributor.join_engine_work()
            self.worker.contribution_dropped(stage, outer_round)  # a straggler's update is sent again later
        sealed = []
        for (replica, peer_id, digest, _size), envelope in zip(close.contributions, envelopes):
            if envelope is not None:
                retry_on_full_disk(lambda: self.archive.put(outer_round, envelope),
                                   what=f"round {outer_round}'s archive of stage {stage}", kind="archive",
                                   stop=self.stop)
            sealed.append(ArchivedContribution(stage, replica, peer_id, digest))
        record_state = None
        if self.chunked is not None and inputs.payloads is not None:
            # The engine replaces its global dicts at each outer step (never writes them in place), so these
            # are the round's state whenever the tail records them.
            weights, momentum = self.worker.global_state(stage)
            record_state = partial(self.chunked.record, outer_round, stage, weights, momentum,
                                   result.contributions, inputs.payloads,
                                   [entry[2] for entry in close.contributions], bindings_in(envelopes))
        return StageApplied(stage, result.weights_hash, sealed, excluded, record_state)

    def _apply_or_reclose(self, outer_round: int, stage: int, inputs: StageInputs, waited: dict[str, float]):
        """``(inputs, exchange.apply(..))``; a close whose inputs never came (InputsWithheld: a member that
        signed a reference and serves nothing) is refused and the next coordinator's applied instead
        (docs/PROTOCOL.md, "Sliced exchange", withholding). Every refusal refuses at least one coordinator."""
        while True:
            try:
                return inputs, self.exchange.apply(outer_round, stage, inputs)
            except InputsWithheld as exc:
                self.coordinator.withdraw(outer_round, stage, inputs.close, str(exc))
                inputs = self.gather_stage(outer_round, stage, None, waited)

    def _attest(self, outer_round: int, results: dict[int, tuple[bytes, bytes]], contributed: bool,
                report_state: bool = True) -> None:
        """Gossip this node's attestation of every held stage (with the stage shard on checkpoint rounds);
        ``results``: stage -> (weights hash, stage leaf); ``report_state``: say "checkpointing" in status.json
        meanwhile (not while the next round trains)."""
        checkpoint_round = (outer_round + 1) % self.cfg.checkpoint_every == 0
        report_state = report_state and checkpoint_round
        # A round contributed to in an earlier life is attested with that life's figures (the same
        # attestation again), not with none: the training figures left with the process.
        figures = self.state.attested(outer_round) if not contributed else None
        if contributed:
            trained = self.rounds.trained[outer_round]
            figures = (trained.train_loss, self.contributor.eval_of(outer_round), trained.tokens)
            self.state.remember_attested(outer_round, *figures)
        train_loss, eval_loss, tokens = figures if figures is not None else (math.nan, math.nan, 0)
        if report_state:
            self.reporter.set_state("checkpointing")  # the stage shards (bench/bench_chaos.py kills by phase)
        for stage in self.worker.stages:
            weights_hash, stage_leaf = results[stage]
            shard_hash = self.write_shard(outer_round, stage, weights_hash) if checkpoint_round else b""
            last = stage == self.cfg.pipeline.num_stages - 1
            att = msg.Attestation(weights_hash, self.coordinator.stage_root(outer_round, stage),
                                  len(self.coordinator.accepted(outer_round, stage).contributions),
                                  train_loss if last else math.nan, eval_loss if last else math.nan, tokens,
                                  shard_hash, b"", stage_leaf)
            self.book.add_attestation(outer_round, stage, self.peer_id, att)
            # Also for a round finished in an earlier life: the same attestation again (peers
            # that kept the first one drop it as a re-signed replay), so the round can commit.
            self.messenger.gossip(outer_round, msg.ATTESTATION, att, stage)
        if report_state:
            self.reporter.set_state("finishing")

    def write_shard(self, outer_round: int, stage: int, weights_hash: bytes) -> bytes:
        """Write and serve this stage's checkpoint shard of ``outer_round``; its content hash."""
        weights, momentum = self.worker.global_state(stage)
        shard = Checkpoint(self.run_id, outer_round, dict(self.layout.model_config), self.config_hash,
                           {stage: weights_hash}, weights, momentum)
        path = self.checkpoint_dir / f"shard-{outer_round:08d}-stage{stage}.safetensors"
        digest = write_checkpoint(path, shard)
        serve_blob(self.host, path, link=True)  # one copy on disk: the store links the file
        # the engine's state in its unnamed files is these bytes: read it from the shard from now on
        read_back(path, {"weights.": weights, "momentum.": momentum})
        return digest

    def forget_before(self, outer_round: int) -> None:
        """Drop every room's state of rounds before ``outer_round`` (memory stays flat on long runs)."""
        self.exchange.forget_before(outer_round)
        self.coordinator.forget_before(outer_round)
        self.book.forget_before(outer_round)
        self.validator.advance(outer_round)
        self.rounds.forget_before(outer_round)
        if self.chunked is not None:
            self.chunked.forget_before(outer_round)
        trim_heap()  # what the dropped rounds held goes back to the system (node/arenas.py)


