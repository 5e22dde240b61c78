"""An in-memory run of M replicas that keeps what re-execution needs: start states, claims, contributions.

The loop is :func:`training.simulate.simulate`'s (the actions of
:func:`training.schedule.round_actions` in order, as the node runs them), with
one addition: before the first inner step of every round each replica
captures its start state (:func:`training.replica_capture.capture_replica_state`)
and, when it encodes, states what its envelopes would bind
(:class:`training.reexec.ContributionClaim`).

Dishonest replicas are subclasses of :class:`SimReplica` that override one
step (fault injection by subclass): :class:`OtherDataReplica`,
:class:`HalfStepsReplica`, :class:`PerturbedReplica`, :class:`ForgedStateReplica`,
:class:`OverDeclaringReplica` (a time-bounded run's replica that declares more steps than it trained),
:class:`CarriedStateReplica` (keeps its inner optimizer's state across rounds in a "fresh" run).
An honest :class:`SlowReplica` trains fewer steps in a time-bounded run and says so. An honest
:class:`StragglerReplica` has its round-0 contribution left out of the close (it came too late),
as a node's can be.
Tests and ``bench/bench_reexec.py`` use them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from training.config import DilocoConfig, ModelConfig, TrainingConfig
from training.config_compression import CompressionConfig
from training.data import Corpus, round_batches
from training.host_tensors import host_float32
from training.inner_optimizers import begin_round
from training.model import init_state_dict
from training.pipeline import LocalReplicaTrainer
from training.portable_rng import normal_tensor
from training.reexec import NO_APPLY, ContributionClaim, data_commitment, round_meta
from training.replica_capture import capture_replica_state
from training.replica_state import ReplicaStartState
from training.schedule import APPLY, ENCODE, TRAIN, applies_before_encode, inner_lr, round_actions, set_lr
from training.stage_engine import StageEngine

logger = logging.getLogger(__name__)


@dataclass
class SimConfig:
    """The run every replica of a simulation shares."""

    corpus: Corpus
    model: ModelConfig
    training: TrainingConfig
    diloco: DilocoConfig
    compression: CompressionConfig
    num_stages: int
    rounds: int
    micro_batches: int = 0  # > 0: train as a split pipeline with this many micro-batches


class SimReplica:
    """One honest replica: trainer, engines and the run's deterministic batches (as ReplicaWorker)."""

    def __init__(self, replica: int, sim: SimConfig) -> None:
        self.replica = replica
        self.sim = sim
        initial = init_state_dict(sim.model, sim.training.seed)
        self.trainer = LocalReplicaTrainer(sim.model, sim.training, sim.num_stages, state_dict=initial)
        self.engines = [
            StageEngine(spec.index, dict(module.named_parameters()), sim.diloco, sim.compression,
                        exact=sim.training.codec_kernels)
            for spec, module in zip(self.trainer.specs, self.trainer.stage_modules)
        ]

    # -- what a cheater overrides ------------------------------------------------------
    def left_out(self, outer_round: int) -> bool:
        """True if the round's close does not hold this replica's contribution."""
        return False

    def batches(self, outer_round: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        sim = self.sim
        return round_batches(sim.corpus, sim.training.seed, self.replica, outer_round, sim.diloco.inner_steps,
                             sim.training.batch_size, sim.model.block_size)

    def trains_step(self, outer_round: int, step: int) -> bool:
        return True

    def trained_steps(self, outer_round: int) -> int:
        """The inner steps this replica trains in ``outer_round``: H; in a time-bounded run, what its budget
        fitted (:class:`SlowReplica` fixes it, so that a test does not depend on a clock)."""
        return self.sim.diloco.inner_steps

    def declared_steps(self, outer_round: int) -> int | None:
        """What its contributions declare (None in a fixed-H run: version-1 contributions)."""
        return self.trained_steps(outer_round) if self.sim.diloco.budgeted else None

    def before_capture(self, outer_round: int) -> None:
        """Hook: change the state before it is captured and committed."""

    def begin_round(self, outer_round: int) -> None:
        """The round's start, as the node's (``training.inner_state = "fresh"``: a new inner optimizer)."""
        begin_round(self.trainer.optimizers, self.sim.training)

    def before_encode(self, outer_round: int) -> None:
        """Hook: change the weights between the inner steps and the encode."""

    # -- the round ----------------------------------------------------------------------
    def start_state(self, outer_round: int) -> ReplicaStartState:
        self.begin_round(outer_round)
        self.before_capture(outer_round)
        sim = self.sim
        meta = round_meta(outer_round, self.replica, sim.model, sim.diloco, run_rounds=sim.rounds,
                          num_stages=sim.num_stages, micro_batches=sim.micro_batches,
                          platform=self.trainer.platform.fingerprint())
        return capture_replica_state(meta, self.trainer, self.engines)

    def train(self, outer_round: int, first_step: int, end_step: int) -> None:
        sim = self.sim
        steps = sim.diloco.inner_steps
        batches = self.batches(outer_round)
        for step in range(first_step, min(end_step, self.trained_steps(outer_round))):
            if not self.trains_step(outer_round, step):
                continue
            set_lr(
                self.trainer.optimizers,
                inner_lr(sim.training, outer_round * steps + step, sim.rounds * steps),
            )
            x, y = batches[step]
            self.trainer.train_step(x, y, sim.micro_batches or 1)

    def encode(self, outer_round: int) -> dict[int, bytes]:
        self.before_encode(outer_round)
        payloads = {}
        for engine in self.engines:
            engine.skip_to(outer_round)
            payloads[engine.stage_index], _ = engine.encode_contribution(
                outer_round, self.declared_steps(outer_round)
            )
        return payloads

    def finish(self, outer_round: int, contributions: dict[int, list[bytes]]) -> None:
        for engine in self.engines:  # as node.live.node: apply, then put a left-out update back
            engine.finish_round(outer_round, contributions[engine.stage_index])
            if self.left_out(outer_round):
                engine.contribution_dropped(outer_round)


class SlowReplica(SimReplica):
    """Honest, in a time-bounded run: its budget fits ``steps`` inner steps a round, which it declares."""

    def __init__(self, replica: int, sim: SimConfig, steps: int) -> None:
        super().__init__(replica, sim)
        self.steps = steps

    def trained_steps(self, outer_round):
        return self.steps


class OverDeclaringReplica(SlowReplica):
    """Trains ``steps`` inner steps but declares ``steps + extra`` (to weigh more in the average)."""

    extra = 2

    def declared_steps(self, outer_round):
        return self.steps + self.extra


class StragglerReplica(SimReplica):
    """Honest, but its round-0 contribution reached the close too late and was left out."""

    def left_out(self, outer_round):
        return outer_round == 0


class OtherDataReplica(SimReplica):
    """Trains on another replica's shard (``replica + 1000``) but commits to its own data."""

    def batches(self, outer_round):
        sim = self.sim
        return round_batches(sim.corpus, sim.training.seed, self.replica + 1000, outer_round,
                             sim.diloco.inner_steps, sim.training.batch_size, sim.model.block_size)


class HalfStepsReplica(SimReplica):
    """Runs only the first half of the H inner steps."""

    def trains_step(self, outer_round, step):
        return step < self.sim.diloco.inner_steps // 2


class PerturbedReplica(SimReplica):
    """Adds a random perturbation of 1% of the update's norm to every stage's pseudo-gradient."""

    fraction = 0.01

    def before_encode(self, outer_round):
        for engine in self.engines:
            start = engine.state_dict()["round_start"]
            update = {n: start[n] - host_float32(p) for n, p in engine.params.items()}
            # The portable generator: the cheat is the same on every instruction set (torch.randn's is not).
            noise = {n: normal_tensor(f"dlx-sim-perturb/{outer_round}/{n}".encode(), tuple(u.shape), 1.0)
                     for n, u in update.items()}
            scale = self.fraction * _norm(update) / _norm(noise)
            with torch.no_grad():
                for name, param in engine.params.items():
                    param.sub_((scale * noise[name]).to(param.device))


class ForgedStateReplica(SimReplica):
    """From round 1 on, drops its error-feedback debt (residual set to zero) before committing its state."""

    def before_capture(self, outer_round):
        if outer_round >= 1:
            for engine in self.engines:
                engine.compressor.residual = {
                    n: torch.zeros_like(r) for n, r in engine.compressor.residual.items()
                }


class CarriedStateReplica(SimReplica):
    """In a run whose inner state is "fresh", keeps its inner optimizer's moments across rounds anyway (and
    commits them in its start states)."""

    def begin_round(self, outer_round):
        pass


def _norm(tensors: dict[str, torch.Tensor]) -> float:
    return float(sum(float(t.double().pow(2).sum()) for t in tensors.values())) ** 0.5


@dataclass
class SimRound:
    """Round ``outer_round`` as a verifier finds it in the record."""

    outer_round: int
    states: dict[int, ReplicaStartState] = field(default_factory=dict)  # replica -> start state
    claims: dict[int, list[ContributionClaim]] = field(default_factory=dict)  # replica -> one claim per stage
    contributions: dict[int, list[bytes]] = field(default_factory=dict)  # stage -> payloads in replica order
    train_seconds: float = 0.0  # all replicas' inner steps
    encode_seconds: float = 0.0  # all replicas' encodes (and apply of the previous round)
    # all replicas' start-state captures, serialisation, hashes, data commitments
    capture_seconds: float = 0.0


def run_with_states(replicas: list[SimReplica], sim: SimConfig) -> list[SimRound]:
    """Run ``sim.rounds`` rounds of ``replicas`` (replica order = canonical order); keep every start state."""
    records: list[SimRound] = []
    for outer_round in range(sim.rounds):
        record = SimRound(outer_round)
        for action in round_actions(sim.diloco, outer_round, last=outer_round == sim.rounds - 1):
            started = time.perf_counter()
            if action.kind == TRAIN:
                for member in replicas:
                    if action.first_step == 0:
                        record.states[member.replica] = member.start_state(outer_round)
                        record.capture_seconds += time.perf_counter() - started
                        started = time.perf_counter()
                    member.train(outer_round, action.first_step, action.end_step)
                    record.train_seconds += time.perf_counter() - started
                    started = time.perf_counter()
            elif action.kind == ENCODE:
                for member in replicas:
                    payloads = member.encode(outer_round)
                    record.encode_seconds += time.perf_counter() - started
                    started = time.perf_counter()
                    state = record.states[member.replica]
                    data = data_commitment(sim.corpus, sim.training, sim.model, sim.diloco, member.replica,
                                           outer_round, member.declared_steps(outer_round))
                    # A schedule that applies round t-1 before the encode (the overlap, "lookahead", "eager")
                    # binds that result (the global weights, which the encode does not move), as the node's
                    # envelope does.
                    before = applies_before_encode(sim.diloco, outer_round)
                    record.claims[member.replica] = [
                        ContributionClaim(stage, part.state_hash(), data, payloads[stage],
                                          member.engines[stage].weights_hash() if before else NO_APPLY)
                        for stage, part in enumerate(state.stages)
                    ]
                    for stage, payload in payloads.items():
                        if not member.left_out(outer_round):
                            record.contributions.setdefault(stage, []).append(payload)
                    record.capture_seconds += time.perf_counter() - started
                    started = time.perf_counter()
            elif action.kind == APPLY:
                contributions = (
                    records[action.outer_round].contributions
                    if action.outer_round < outer_round
                    else record.contributions
                )
                for member in replicas:
                    member.finish(action.outer_round, contributions)
                record.encode_seconds += time.perf_counter() - started
        records.append(record)
        logger.info("reexec sim round %d: %d replicas", outer_round, len(replicas))
    return records
