"""A verifier's rerun of a cluster's round on the claimant's number of processes (issue 75; docs/CLUSTER.md).

A node of ``compute.processes`` = N (training/cluster_replica.py) makes a contribution that depends on N only
through its inner steps: FSDP2 averages the N ranks' gradients of their slices of the batch (a
reduce-scatter: other float sums than one process's). Its encode and outer steps are the one-process
engine's bits (training/cluster_outer.py). Its start states record ``cluster = fsdp2;ranks=N`` in the
platform fingerprint and hold the whole replica (weights, inner AdamW state, the engine's state merged), so
any verifier can load them.

A verifier allowed ``processes`` >= N (its own ``compute.processes``) reruns such a round bit for bit
(:func:`rerun_ranks`): :func:`training.reexec_rerun.reexecute` restores the one-process trainer and engines
from the start state as for any claim, and runs the inner steps on a cluster of N ranks of its own
(:class:`ClusterSteps`: the restored weights and AdamW state distributed into the FSDP shards, the trained
weights gathered back before the encode and the inner optimizer's state before the next start state is
captured). The rerun's fingerprint then names the same ``cluster`` as the claim's, so the verdict is the
same-platform rule: bit-exact demanded (training.fingerprint.compare_rerun). A verifier allowed fewer
processes reruns the inner steps in one process on the whole batch: another platform, judged by the
tolerance rule's three zones (a pass bound of 1e-4; relative distances of 2e-7 to 5e-7 measured), never bit
for bit; where its distance lands in the undecided zone nobody is accused.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from training.cluster_replica import ClusterReplicaTrainer
from training.errors import ReexecError
from training.muon import ADAM_FIELDS, state_kind

logger = logging.getLogger(__name__)


def claimed_ranks(platform) -> int:
    """The processes a start state's fingerprint names (``fsdp2;ranks=N``); 1 without one, or one process."""
    value = getattr(platform, "cluster", "") or ""
    ranks = value.partition(";ranks=")[2]
    return int(ranks) if ranks.isdigit() else 1


def rerun_ranks(platform, processes: int) -> int:
    """The ranks a verifier allowed ``processes`` reruns a claim of ``platform`` on: the claim's N when it
    was made by a cluster of N and ``processes >= N`` (then bit for bit), else 1 (one process)."""
    ranks = claimed_ranks(platform)
    return ranks if 1 < ranks <= max(1, int(processes)) else 1


class ClusterSteps:
    """The inner steps of a rerun on a cluster of ``world`` ranks (module docstring), for a restored
    one-stage :class:`training.pipeline.LocalReplicaTrainer` ``trainer`` whose live weights and AdamW state
    are the start state's. Use :meth:`session` around each run of steps; :meth:`close` stops the ranks."""

    def __init__(self, trainer, model_cfg, training_cfg, world: int, threads: int) -> None:
        if len(trainer.stage_modules) != 1:
            raise ReexecError(f"a cluster's claim holds one stage (a whole replica), the start state "
                              f"{len(trainer.stage_modules)}")
        self.trainer = trainer
        module, optimizer = trainer.stage_modules[0], trainer.optimizers[0]
        self.params = dict(module.named_parameters())
        self.cluster = ClusterReplicaTrainer(model_cfg, training_cfg, world, self.params, threads=threads)
        try:
            self.cluster.load_optimizer(_adam_state(self.params, optimizer))
        except BaseException:
            self.cluster.close()
            raise
        self.platform = self.cluster.platform

    @property
    def optimizers(self) -> list:
        return [self.cluster.optimizer]

    def train_step(self, x: torch.Tensor, y: torch.Tensor, _micro_batches: int = 1) -> float:
        return self.cluster.train_step(x, y)

    @contextlib.contextmanager
    def session(self):
        """A run of inner steps: the trainer's live weights (an apply may have changed them) into the shards
        before, the trained weights back into the trainer after."""
        self.cluster.load_weights(self.params)
        self.cluster.begin_steps()
        try:
            yield
        finally:
            self.cluster.end_steps()

            def back(name: str, tensor: torch.Tensor) -> None:
                with torch.no_grad():
                    self.params[name].copy_(tensor)

            self.cluster.live_weights(back)

    def reset_inner_state(self) -> None:
        """A new inner optimizer on every rank (``training.inner_state = "fresh"``, a round's start)."""
        self.cluster.reset_inner_state()

    def sync_optimizer(self) -> None:
        """The cluster's inner-optimizer state gathered into the trainer's (for the next start state)."""
        optimizer = self.trainer.optimizers[0]
        part = self.cluster.capture_part()
        for name, param in self.params.items():
            prefix, fields = state_kind(optimizer, param)
            values = {f: part.get(f"{prefix}.{f}/{name}") for f in fields}
            if all(value is not None for value in values.values()):
                optimizer.state[param] = {f: value.clone() for f, value in values.items()}

    def close(self) -> None:
        self.cluster.close()


def _adam_state(params: dict, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """name -> {field: tensor} of each parameter's AdamW state (empty before the first step)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, param in params.items():
        prefix, fields = state_kind(optimizer, param)
        state = optimizer.state.get(param, {})
        if not state:
            continue
        if prefix != "adam" or set(state) != set(ADAM_FIELDS):
            raise ReexecError(f"{name!r}: a cluster reruns AdamW's state {ADAM_FIELDS}, not {sorted(state)}")
        out[name] = {field: torch.as_tensor(state[field]) for field in fields}
    return out
