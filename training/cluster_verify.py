"""What a verifier with fewer processes than a cluster does with its round (issue 75; docs/CLUSTER.md).

A cluster of N ranks (training/cluster_engine.py) makes its contribution in two N-dependent ways: the
inner steps average the N ranks' gradients of their slices of the batch (FSDP's reduce-scatter), and each
rank encodes its shard of whole tensors with its share of the byte budget. A verifier of one process
redoes both in one process:

* :func:`emulated_inner_step`: the batch cut into the same N slices, each slice's mean loss divided by N
  and its gradient accumulated (the same mathematics; other float sums than the reduce-scatter), the
  gradient clip over the whole stage, the inner optimizer's step;
* :class:`ShardedEncoder`: the claimant's shard plan (:func:`training.cluster_plan.plan_shards` of the
  stage's shapes and N), one error-feedback encoder per shard with its budget share, the messages joined:
  given the cluster's pseudo-gradient, the cluster's bytes exactly (tests/test_cluster_engine.py).

The rerun's payloads are then compared with the claim by the tolerance rule (the claimant's fingerprint
names ``cluster = fsdp2;ranks=N``, the verifier's does not: another platform,
:func:`training.fingerprint.compare_rerun`), never bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from training.cluster_plan import join_contribution, plan_shards
from training.compression import ErrorFeedbackCompressor
from training.config import DilocoConfig
from training.config_compression import CompressionConfig
from training.errors import EngineStateError


class ShardedEncoder:
    """The N encoders of a cluster's stage in one process (module docstring)."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], world: int, diloco_cfg: DilocoConfig,
                 compression_cfg: CompressionConfig, *, exact: int = 0) -> None:
        self.plan = plan_shards(shapes, world)
        budget = compression_cfg.stage_bandwidth_budget(self.plan.numel(), diloco_cfg.inner_steps,
                                                        diloco_cfg.num_replicas)
        self.encoders = [ErrorFeedbackCompressor(self.plan.shard_shapes(rank), compression_cfg,
                                                 bandwidth_budget=self.plan.shard_budget(budget, rank),
                                                 exact=exact)
                         for rank in range(world)]

    def compress(self, pseudo_gradient: Mapping[str, torch.Tensor], *, stage_index: int,
                 outer_round: int) -> bytes:
        """The contribution the cluster sends for ``pseudo_gradient`` (the error feedback moves as each
        rank's does)."""
        parts = []
        for rank, encoder in enumerate(self.encoders):
            shard = {name: pseudo_gradient[name] for name in self.plan.names[rank]}
            parts.append(encoder.compress(shard, stage_index=stage_index, outer_round=outer_round)[0])
        return join_contribution(parts)


def emulated_inner_step(module: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
                        y: torch.Tensor, world: int, grad_clip: float) -> float:
    """One inner step of an N-rank cluster in one process (module docstring); returns the batch's mean
    loss."""
    from training.model import lm_loss
    from training.pipeline import clip_coefficient, scale_grads

    if x.size(0) % world:
        raise EngineStateError(f"a batch of {x.size(0)} rows does not split over {world} ranks")
    rows = x.size(0) // world
    module.train()
    optimizer.zero_grad(set_to_none=True)
    total_loss = 0.0
    for rank in range(world):
        part = slice(rank * rows, (rank + 1) * rows)
        loss = lm_loss(module(x[part]), y[part])
        torch.div(loss, world).backward()
        total_loss += float(loss.detach())
    if grad_clip > 0:
        total = torch.zeros((), dtype=torch.float64)
        for param in module.parameters():
            if param.grad is not None:
                total += param.grad.detach().double().pow(2).sum()
        scale_grads(module, clip_coefficient(total, grad_clip))
    optimizer.step()
    return total_loss / world
