"""The training side of a round: H inner steps, the start state a contribution binds, the eval, the encode.

:meth:`Contributor.train` runs (part of) a round's inner steps; before its first
step it captures the start state the round's contributions bind (docs/DILOCOX.md
section 11) and, after its last, starts the held-out eval. :meth:`Contributor.encode`
encodes, signs, archives, serves and announces the round's pseudo-gradients.

What does not read the live weights runs on the round lane (node/live/state/lane.py),
in the order submitted: serialising and serving the start state, compressing and
publishing the contribution, the eval on a copy. The training thread joins the
lane's engine work (:meth:`Contributor.join_engine_work`) before it changes what a
queued task still reads.
"""

from __future__ import annotations

import logging
import math
from concurrent.futures import Future

from node.live.state.base import NodeBase
from node.live.rooms import Rooms
from node import protocol as msg
from node.errors import StateError
from node.fsutil import retry_on_full_disk
from node.live.worker.replica import ReplicaWorker
from node.live.state.roundbook import Announced
from node.live.state.roundstate import TrainFigures
from training.errors import PipelineError
from training.schedule import applies_before_encode

logger = logging.getLogger(__name__)


class RoundAbandoned(Exception):
    """Raised inside the inner loop when the node is asked to stop."""


class PipelineBroken(Exception):
    """A split cluster's pipeline failed while training ``outer_round`` (a partner died)."""

    def __init__(self, outer_round: int, reason: str) -> None:
        super().__init__(f"round {outer_round}: {reason}")
        self.outer_round = outer_round
        self.reason = reason


class Contributor:
    """Trains, encodes and publishes this node's contributions (see module docstring)."""

    def __init__(self, base: NodeBase, rooms: Rooms, *, worker: ReplicaWorker) -> None:
        self.cfg = base.cfg
        self.worker = worker
        self.rounds = base.rounds
        self.lane = base.lane
        self.clock = base.clock
        self.progress = base.progress
        self.reporter = base.reporter
        self.spot_checks = rooms.spot_checks  # node.live.checks.verifier.SpotChecker: serves the start states
        self.exchange = rooms.exchange
        self.binder = rooms.binder  # a version-3 run: each contribution signed by this node's account
        self.pool = rooms.exchange.pool
        self.archive = base.archive
        self.book = base.book
        self.messenger = rooms.messenger
        self.state = base.state
        self.forks = rooms.forks  # whether the round a start state holds stands (announceable)
        self.peer_id = base.peer_id
        self.stop = base.stop
        self._capture_done: Future | None = None  # the last start-state capture queued on the lane
        self._publish_done: Future | None = None  # the last contribution encoded and published on the lane
        # round -> stage -> applied_hash its contributions bind
        self._applied: dict[int, dict[int, bytes]] = {}

    # -- training ---------------------------------------------------------------------
    def train(self, outer_round: int, first_step: int, end_step: int) -> None:
        """Inner steps ``first_step <= k < end_step`` of ``outer_round``; raises RoundAbandoned on stop."""
        self.progress.round, self.progress.step = outer_round, first_step
        self.reporter.set_state("training")

        def on_step(step: int, loss: float) -> None:
            self.progress.step, self.progress.loss = step, loss
            self.reporter.report(throttle=True)
            if self.stop.is_set():
                raise RoundAbandoned()

        if first_step == 0:  # what the round's contributions will bind (docs/DILOCOX.md section 11)
            self.clock.round_starting()
            if self.rounds.starting(outer_round, self.cfg.diloco):
                logger.warning("round %d: begins on our result of a round being re-based on the record; our "
                               "contribution of it will not be announced", outer_round)
            # training.inner_state = "fresh": the round's inner optimizer is new, and its start state says so
            self.worker.begin_round(outer_round)
            with self.clock.phase("start_state"):
                self._capture_start_state(outer_round)
        try:
            # A time-bounded round's budget is the round clock's (node/live/state/roundclock.py).
            stats = self.worker.train_round(outer_round, on_step, first_step, end_step,
                                            budget_elapsed=self.clock.budget_elapsed)
        except PipelineError as exc:
            # A split cluster trains in lockstep; without its partner the replica cannot train.
            raise PipelineBroken(outer_round, str(exc)) from exc
        self.rounds.parts.setdefault(outer_round, []).append(stats)
        if end_step < self.cfg.diloco.inner_steps:
            return  # the rest of the round comes after the previous round is applied
        parts = self.rounds.parts.pop(outer_round)
        tokens = sum(p.tokens for p in parts)
        mean_loss = sum(p.mean_loss * p.tokens for p in parts) / tokens
        with self.clock.phase("eval"):
            self.rounds.evals[outer_round] = self._start_eval(outer_round)
        # held-out loss: eval_of()
        self.rounds.trained[outer_round] = TrainFigures(mean_loss, math.nan, tokens)
        steps = tokens // (self.cfg.training.batch_size * self.cfg.model.block_size)
        period = self.clock.trained(outer_round, sum(p.seconds for p in parts), steps,
                                    sum(p.cpu_seconds for p in parts))
        self.progress.timing = self.clock.summary()
        logger.info("round %d: %d inner steps in %.1fs (%s), loss %.4f", outer_round, steps,
                    period["inner_s"], "first period" if period["wall_s"] is None else
                    f"{period['wall_s']:.1f}s since the last round's, utilization "
                    f"{period['utilization']:.1%}",
                    mean_loss)

    def _capture_start_state(self, outer_round: int) -> None:
        # Copies of the weights and AdamW state now; the engines' part, the bytes, the hash and
        # serving them on the lane, after the previous round's encode and before the next
        # change to the engines (encode and the finisher's apply join it first).
        # (the copies wait in a file beside the start states, not in RAM: training/spilled.py)
        serialise = self.worker.start_state_capture(outer_round, self.spot_checks.states.writing_dir)
        for engine in self.worker.engines.values():  # its transmitted updates wait there too (issue 75)
            engine.spill_dir = self.spot_checks.states.writing_dir

        def serve() -> None:
            with self.clock.lane("start_state"):
                # Written to files and linked into the blob store (training.replica_capture.
                # StartStateCapture), not built whole in memory: about 40 bytes per parameter held (issue
                # 75); a worker whose capture is a plain function (tests' adversaries) gives bytes.
                write = getattr(serialise, "write", None)
                hashes = getattr(serialise, "hashes", None)
                states = self.spot_checks.states
                if hashes is not None and not states.keeps(outer_round, len(serialise.parts)):
                    # not kept: hashed, never written; rebuilt when asked (node/live/checks/staterebuild.py)
                    self.rounds.start_states[outer_round] = states.serve_hashes(outer_round, hashes())
                    return
                streams = getattr(serialise, "streams", None)
                if streams is not None and states.streams_parts():
                    # straight from the tensors into the blob store's pieces: no file of the whole state
                    # beside them (issue 75)
                    parts = streams()
                else:
                    parts = serialise() if write is None else retry_on_full_disk(
                        lambda: write(states.writing_dir), stop=self.stop,
                        what=f"round {outer_round}'s start state", kind="served blob")
                served = self.spot_checks.serve_start_states(outer_round, parts)
                self.rounds.start_states[outer_round] = served

        self._capture_done = self.lane.submit(serve)

    def abandon(self, outer_round: int) -> None:
        """The round being trained is abandoned (its split cluster's pipeline broke): nothing of it is
        sent."""
        self.rounds.parts.pop(outer_round, None)
        self.clock.interrupted()  # the wait for the partner is nobody's round (nor its budget)
        self.lane.join()  # the abandoned round's start state may still be on its way
        self.rounds.start_states.pop(outer_round, None)

    # -- the held-out eval ---------------------------------------------------------------
    def _start_eval(self, outer_round: int) -> Future:
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

    def eval_of(self, outer_round: int) -> float:
        """The held-out loss after ``outer_round``'s training (nan if this process did not train it)."""
        future = self.rounds.evals.get(outer_round)
        return math.nan if future is None else self.lane.join(future)

    # -- the contribution ----------------------------------------------------------------
    def encode(self, outer_round: int) -> None:
        """Encode and publish ``outer_round``: the part reading the live weights here, the rest on the
        lane."""
        if outer_round <= self.state.get("last_contributed", -1):
            raise StateError(
                f"round {outer_round} was already contributed before a restart; refusing to re-sign")
        # The engines' last reader and writer on the lane (this round's start state, the previous
        # encode) are done; not the eval just queued, which reads its own copy.
        self.join_engine_work()
        # What the round's training applied of round t-1 (the overlap, lookahead, eager), bound by its
        # contributions: the engines' global state now, read before the lane encodes.
        self._applied[outer_round] = {
            stage: self.worker.global_hash(stage) if applies_before_encode(self.cfg.diloco, outer_round)
            else msg.NO_APPLY for stage in self.worker.stages}
        prepared = [self.worker.prepare_encode(stage, outer_round) for stage in self.worker.stages]
        if all(prepared):
            def publish() -> None:
                with self.clock.lane("encode"):
                    self.publish(outer_round)

            self._publish_done = self.lane.submit(publish)
        else:  # "lookahead"/"eager": the next round starts from the compressed contribution
            self.publish(outer_round)

    def join_engine_work(self) -> None:
        """Wait for the lane's tasks that read or write the engines (start states, encodes)."""
        for future in (self._capture_done, self._publish_done):
            if future is not None:
                self.lane.join(future)

    def join_start_state(self) -> None:
        """Wait until the last start state was read from the engines (before they change)."""
        if self._capture_done is not None:
            self.lane.join(self._capture_done)

    def publish(self, outer_round: int) -> None:
        """Sign, archive, serve and announce this node's contribution of every held stage of
        ``outer_round``."""
        if outer_round <= self.state.get("last_contributed", -1):
            raise StateError(
                f"round {outer_round} was already contributed before a restart; refusing to re-sign")
        # A round begun on a result of ours that left (or may have left) the record is never announced,
        # whenever the chain's verdict comes (docs/PROTOCOL.md, "The rounds a fork touched").
        if outer_round not in self.rounds.withheld and not self.forks.announceable(outer_round):
            self.rounds.withheld.add(outer_round)
        states = self.rounds.start_states.pop(outer_round, None)
        if states is None:
            raise StateError(
                f"round {outer_round}: no start state was captured; refusing to contribute unbound")
        applied = self._applied.pop(outer_round, None)
        if applied is None:
            raise StateError(
                f"round {outer_round}: what its training applied was not read; refusing to contribute")
        if outer_round in self.rounds.withheld:
            for stage in self.worker.stages:  # encoded as always (the engines transmit it), never announced
                self.encode_stage(stage, outer_round)
            logger.warning("round %d: not contributed: trained on a result this node re-based away from",
                           outer_round)
            self.clock.published(outer_round)
            return
        data_commitment = self.worker.data_commitment(outer_round)
        for stage in self.worker.stages:
            blob, cstats = self.encode_stage(stage, outer_round)
            blob = self.exchange.contribution_blob(outer_round, stage, blob)
            contributor, binding = (b"", b"") if self.binder is None else self.binder.sign(
                outer_round, stage, blob, self.worker.stage_shapes(stage))
            body = msg.encode_contribution_body(msg.ContributionBody(states[stage], data_commitment, blob,
                                                                     applied[stage], contributor, binding))
            envelope = self.exchange.sign_contribution(outer_round, stage, body, blob)
            # Kept even if the close leaves it out: the audit's rerun of this replica needs it
            # (node/store/archive.py). A full disk pauses the contribution
            # until space is freed (it must be archived before it is sent).
            digest = retry_on_full_disk(
                lambda: self.archive.put_own(outer_round, envelope, stage, self.worker.replica, self.peer_id),
                what=f"round {outer_round}'s contribution of stage {stage}", kind="contribution",
                stop=self.stop)
            self.pool.serve_own(outer_round, envelope)  # a full disk pauses it too (serve_when_space)
            self.pool.add(outer_round, stage, digest, envelope)
            self.book.add_announce(outer_round, stage,
                                   Announced(self.peer_id, self.worker.replica, digest, len(envelope)))
            self.exchange.announced(outer_round, stage, digest, envelope)  # before the announce that starts
            self.messenger.gossip(outer_round, msg.ANNOUNCE, msg.Announce(digest, len(envelope)), stage)
            logger.info("round %d stage %d: contribution %s, %d bytes (ratio %.0fx)", outer_round, stage,
                        digest.hex()[:12], len(envelope), getattr(cstats, "ratio", float("nan")))
        retry_on_full_disk(lambda: self.state.update(last_contributed=outer_round),
                           what=f"round {outer_round}'s state.json", kind="state.json", stop=self.stop)
        self.clock.published(outer_round)

    def encode_stage(self, stage: int, outer_round: int):
        """(the stage's encoded contribution blob, compression stats): the worker's encode."""
        return self.worker.encode(stage, outer_round)
