"""One node's stage trained by N processes: FSDP2 inner steps, the outer state sharded (issue 75).

A node that is a cluster runs N processes under ``torch.distributed`` (gloo on the CPU, NCCL on GPUs;
docs/CLUSTER.md). The stage module is sharded with FSDP2 (:func:`shard_stage_module`:
``torch.distributed.fsdp.fully_shard`` per block, then the root, over a one-dimensional DeviceMesh), so
the parameters, their gradients and the inner optimizer's state are each 1/N per rank
(:class:`ClusterTrainer`: data parallel, each rank its slice of the batch).

The outer state is sharded over the same ranks by :mod:`training.cluster_plan` (whole tensors, contiguous in
chunk order): rank r keeps, for its tensors only, a :class:`training.stage_engine.StageEngine` (round-start
and global weights, outer momentum, error-feedback residual, the delay correction's snapshots, its own
encoder with its share of the stage's byte budget). No process holds a whole stage's outer state.

A round, on every rank (:class:`ClusterStageEngine`):

* :meth:`~ClusterStageEngine.encode_contribution`: the rank gathers its own tensors' live weights from
  the FSDP shards (one tensor at a time) and encodes its shard: a codec_wire message of its tensors
  (the same header as a whole stage's). :meth:`~ClusterStageEngine.gather_contribution` joins the ranks'
  messages on rank 0: one contribution, the wire format every node decodes.
* :meth:`~ClusterStageEngine.apply_round`: rank 0 cuts each replica's contribution along the plan and
  hands each rank its parts (or each rank receives its parts from the exchange:
  :meth:`~ClusterStageEngine.apply_round_parts`); the robust aggregation runs per shard
  (:mod:`training.cluster_robust`), the outer step on each rank's own tensors, and the new local weights
  go back into the FSDP shards.
* :meth:`~ClusterStageEngine.weights_hash`: the stage's ``stage_weights_hash``, the tensors streamed to
  rank 0 one at a time in name order (a sha256 cannot be split); :meth:`~ClusterStageEngine.chunk_roots`:
  the fraud proof's weights and momentum roots from each rank's Merkle frontier
  (:mod:`training.cluster_merkle`), no tensor moved.

Bit-exactness: given the same contributions, every rank's outer step computes the same float32 operations
per tensor as a one-process :class:`StageEngine` of the whole stage, so the new weights, momentum, hash and
roots are the same bits (tests/test_cluster_engine.py). The inner steps under FSDP (a reduce-scatter of the
gradients) and a byte budget split N ways make a cluster's contribution a function of N: the fingerprint
records it (``cluster``, :func:`training.cluster_plan.cluster_identity`), and a bit-exact rerun needs a
verifier with the same N.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from training.chunks import cut_payload, tensor_leaves
from training.cluster_merkle import root_from_frontiers, shard_frontier
from training.cluster_plan import (
    ShardPlan,
    cluster_identity,
    join_contribution,
    plan_shards,
    split_contribution,
)
from training.cluster_robust import round_reports, shard_aggregation, shard_facts
from training.config import DilocoConfig
from training.config_compression import CompressionConfig
from training.errors import ContributionDecodeError, EngineStateError
from training.hashing import hash_tensor_into, weights_digest
from training.robust import ContributionReport
from training.stage_engine import StageEngine
from training.stage_results import RoundResult


def shard_stage_module(module: nn.Module, mesh) -> nn.Module:
    """``fully_shard`` each transformer block of ``module`` (a :class:`training.model.TransformerSlice`), then
    the module itself (the embeddings, norms and head), over ``mesh``; returns the module."""
    from torch.distributed.fsdp import fully_shard

    trunk = getattr(module, "trunk", None)
    blocks = trunk[module.family.blocks] if trunk is not None else {}
    for block in blocks.values():
        fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


def _world() -> tuple[int, int]:
    if not dist.is_initialized():
        raise EngineStateError("a cluster engine needs torch.distributed initialised (one process per rank)")
    return dist.get_rank(), dist.get_world_size()


@dataclass
class ClusterRound:
    """One applied round on one rank: the reports (the same on every rank) and the shard's round result."""

    outer_round: int
    reports: list[ContributionReport]
    result: RoundResult

    @property
    def accepted(self) -> list[int]:
        return [report.index for report in self.reports if report.accepted]


class ClusterStageEngine:
    """One rank's part of a cluster node's stage (module docstring). Every method is collective: every rank
    calls it, in the same order."""

    def __init__(self, stage_index: int, module: nn.Module, diloco_cfg: DilocoConfig,
                 compression_cfg: CompressionConfig, *, exact: int = 0) -> None:
        self.rank, self.world = _world()
        self.stage_index = stage_index
        self.module = module
        self.live = dict(module.named_parameters())
        shapes = {name: tuple(p.shape) for name, p in self.live.items()}
        self.plan: ShardPlan = plan_shards(shapes, self.world)
        self.own = self.plan.names[self.rank]
        self.diloco_cfg, self.compression_cfg = diloco_cfg, compression_cfg
        shard = {name: value for name, value in self._gathered() if value is not None}
        self.engine = StageEngine(stage_index, shard, diloco_cfg, compression_cfg, exact=exact)
        stage_budget = compression_cfg.stage_bandwidth_budget(
            self.plan.numel(), diloco_cfg.inner_steps, diloco_cfg.num_replicas)
        self.engine.compressor.bandwidth_budget = self.plan.shard_budget(stage_budget, self.rank)
        self.release_local()

    @property
    def identity(self) -> str:
        """The fingerprint's ``cluster`` field ("" for one process)."""
        return cluster_identity(self.world)

    # ------------------------------------------------------------------ live weights <-> FSDP shards

    def _gathered(self):
        """``(name, float32 host copy or None)`` per tensor in chunk order: the owner's whole tensor."""
        with torch.no_grad():
            for name in self.plan.order:
                param = self.live[name]
                full = param.full_tensor() if hasattr(param, "full_tensor") else param.detach()
                yield name, (full.to("cpu", torch.float32).contiguous().clone() if name in self.own else None)
                del full

    def pull_local(self) -> None:
        """The rank's tensors of the live (FSDP) weights, gathered, as its engine's local weights (held only
        while an encode or an apply runs: :meth:`release_local`)."""
        self.engine.params = {name: value for name, value in self._gathered() if value is not None}

    def release_local(self) -> None:
        """Drop the engine's copy of the local weights: between rounds they live in the FSDP shards only."""
        self.engine.params = {}

    def push_local(self) -> None:
        """The engine's local weights back into every rank's FSDP shards, one tensor at a time."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        with torch.no_grad():
            for name in self.plan.order:
                param, owner = self.live[name], self.plan.owner(name)
                if not isinstance(param, DTensor):  # one process: a plain parameter
                    param.copy_(self.engine.params[name])
                    continue
                source = (self.engine.params[name] if owner == self.rank
                          else torch.empty(tuple(param.shape), dtype=torch.float32))
                source = source.to(param.to_local().device, param.dtype)
                placed = distribute_tensor(source, param.device_mesh, param.placements, src_data_rank=owner)
                param.to_local().copy_(placed.to_local())

    # ------------------------------------------------------------------ a round

    def encode_contribution(self, outer_round: int, declared_steps: int | None = None):
        """``(this rank's message, stats)``: its shard's pseudo-gradient, encoded (module docstring)."""
        self.pull_local()
        blob, stats = self.engine.encode_contribution(outer_round, declared_steps)
        if self.engine.lookahead:  # the encode jumped the local weights to an estimate
            self.push_local()
        self.release_local()
        return blob, stats

    def gather_contribution(self, part: bytes) -> bytes | None:
        """The ranks' messages joined into the stage's contribution, on rank 0 (None elsewhere)."""
        parts: list | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(part, parts, dst=0)
        return join_contribution(parts) if self.rank == 0 else None

    def split_round(self, outer_round: int, contributions: Sequence[bytes] | None):
        """Rank 0 cuts each contribution along the plan and sends each rank its parts: ``(parts, errors)``
        on every rank (``errors[j]``: why contribution j did not split)."""
        bundles = None
        if self.rank == 0:
            if contributions is None:
                raise EngineStateError("rank 0 applies a round with the round's contributions")
            per_rank: list[list[bytes | None]] = [[] for _ in range(self.world)]
            errors: dict[int, ContributionDecodeError] = {}
            for index, blob in enumerate(contributions):
                try:
                    parts = split_contribution(blob, self.plan, stage_index=self.stage_index,
                                               outer_round=outer_round)
                except ContributionDecodeError as exc:
                    parts, errors[index] = [None] * self.world, exc
                for rank in range(self.world):
                    per_rank[rank].append(parts[rank])
            bundles = [(per_rank[rank], errors) for rank in range(self.world)]
        received: list = [None]
        dist.scatter_object_list(received, bundles, src=0)
        return received[0]

    def apply_round(self, outer_round: int, contributions: Sequence[bytes] | None, *,
                    excluded: Mapping[int, str] | None = None) -> ClusterRound:
        """Aggregate ``outer_round`` from the replicas' whole contributions (given on rank 0, None elsewhere;
        ``excluded`` too: screening's verdicts) and apply it (module docstring)."""
        parts, errors = self.split_round(outer_round, contributions)
        box = [excluded]
        dist.broadcast_object_list(box, src=0)
        return self.apply_round_parts(outer_round, parts, errors, excluded=box[0])

    def apply_round_parts(self, outer_round: int, parts: Sequence[bytes | None],
                          errors: Mapping[int, ContributionDecodeError] | None = None, *,
                          excluded: Mapping[int, str] | None = None) -> ClusterRound:
        """Aggregate and apply ``outer_round`` from this rank's parts of every contribution (canonical order;
        None where it did not split, ``errors`` saying why: the same on every rank)."""
        facts, decoded = shard_facts(
            parts, self.plan.shard_shapes(self.rank), stage_index=self.stage_index, outer_round=outer_round,
            refuse_raw=self.compression_cfg.enabled, split_errors=errors or {})
        every: list = [None] * self.world
        dist.all_gather_object(every, facts)
        reports = round_reports(every, self.diloco_cfg, excluded)
        aggregation = shard_aggregation(self.engine.global_weights, self.engine.momentum, decoded, reports,
                                        self.diloco_cfg, outer_round)
        self.pull_local()  # the delay correction re-bases the live weights
        result = self.engine.apply_round(outer_round, [part or b"" for part in parts],
                                         aggregation=aggregation)
        self.push_local()
        self.release_local()
        return ClusterRound(outer_round, reports, result)

    # ------------------------------------------------------------------ the record, from the shards

    def weights_hash(self) -> bytes | None:
        """The stage's :func:`training.hashing.stage_weights_hash` of the global weights, on rank 0 (None
        elsewhere): :func:`streamed_weights_hash`."""
        return streamed_weights_hash(self.plan, self.rank, self.engine.global_weights)

    def _tree_root(self, leaves: list[bytes]) -> bytes | None:
        return sharded_root(leaves, self.rank, self.world)

    def chunk_roots(self) -> tuple[bytes, bytes] | None:
        """``(weightsRoot, momentumRoot)`` of the stage's chunk trees (ledger/chunkproof.py), on rank 0:
        :func:`sharded_chunk_roots`."""
        return sharded_chunk_roots(self.plan, self.rank, self.engine.global_weights, self.engine.momentum)

    def payload_root(self, part: bytes) -> bytes | None:
        """The Merkle root over one contribution's payload pieces (the factors' ``payloadRoots``), from this
        rank's part of it, on rank 0."""
        return self._tree_root(cut_payload(part, self.plan.shard_shapes(self.rank)))

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """This rank's state: its shard's engine state, named by the cluster and the rank."""
        return {"cluster": self.identity or "single", "rank": self.rank, "world": self.world,
                "tensors": list(self.own), "engine": self.engine.state_dict()}

    def load_state_dict(self, state: Mapping) -> None:
        if (state.get("world"), state.get("rank"), list(state.get("tensors", ()))) != (
                self.world, self.rank, list(self.own)):
            raise EngineStateError(
                f"cluster state of rank {state.get('rank')}/{state.get('world')} over "
                f"{len(state.get('tensors', ()))} tensors, this is rank {self.rank}/{self.world} over "
                f"{len(self.own)}: a cluster restarts with the processes it saved with")
        self.engine.load_state_dict(state["engine"])

    def state_bytes(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Bytes of the training state this rank holds (tensor accounting, not RSS): its FSDP shards of the
        parameters and their gradients, the inner ``optimizer``'s state, and the outer state of its tensors
        (global weights, outer momentum, round start, error-feedback residual, pending snapshots)."""
        def local(tensor) -> int:
            tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            return tensor.numel() * tensor.element_size()

        params = sum(local(p) for p in self.live.values())
        grads = sum(local(p.grad) for p in self.live.values() if p.grad is not None)
        inner = 0 if optimizer is None else sum(
            local(value) for state in optimizer.state.values() for value in state.values()
            if isinstance(value, torch.Tensor) and value.dim() > 0)
        engine = self.engine
        outer = sum(t.numel() * t.element_size() for group in (
            engine.global_weights, engine.momentum, engine._round_start, engine.params,
            engine.compressor.residual) for t in group.values())
        snapshots = sum(t.numel() * t.element_size() for weights in engine._round_end.values()
                        for t in weights.values())
        return {"params": params, "grads": grads, "inner_optimizer": inner, "outer": outer + snapshots}


class ClusterTrainer:
    """The inner steps of a cluster's stage (a whole replica: embeddings to head): data parallel over the
    ranks, each rank the ``rank``-th of N equal slices of the batch; FSDP2 averages the gradients."""

    def __init__(self, module: nn.Module, training_cfg) -> None:
        from training.pipeline import make_inner_optimizer

        self.rank, self.world = _world()
        self.module = module
        self.training_cfg = training_cfg
        self.optimizer = make_inner_optimizer(module, training_cfg)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One inner step on the batch ``(x, y)`` (the same on every rank); returns the batch's mean loss."""
        from training.model import lm_loss
        from training.pipeline import clip_coefficient

        if x.size(0) % self.world:
            raise EngineStateError(f"a batch of {x.size(0)} rows does not split over {self.world} ranks")
        rows = x.size(0) // self.world
        part = slice(self.rank * rows, (self.rank + 1) * rows)
        self.module.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(self.module(x[part]), y[part])
        loss.backward()
        grad_clip = float(getattr(self.training_cfg, "grad_clip", 0.0) or 0.0)
        if grad_clip > 0:
            total = torch.zeros((), dtype=torch.float64)
            for param in self.module.parameters():
                if param.grad is not None:
                    grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
                    total += grad.detach().double().pow(2).sum().cpu()
            dist.all_reduce(total)
            coefficient = clip_coefficient(total, grad_clip)
            if coefficient != 1.0:
                for param in self.module.parameters():
                    if param.grad is not None:
                        param.grad.mul_(coefficient)
        self.optimizer.step()
        mean = loss.detach().to("cpu", torch.float64).reshape(1)
        dist.all_reduce(mean)
        return float(mean[0]) / self.world


def peak_share(state: Mapping[str, int], stage_bytes: int) -> float:
    """A rank's training state as a share of a one-process stage's (``stage_bytes``)."""
    return sum(state.values()) / stage_bytes if stage_bytes else math.nan


def streamed_weights_hash(plan, rank: int, own: Mapping[str, torch.Tensor]) -> bytes | None:
    """:func:`training.hashing.stage_weights_hash` of a stage sharded along ``plan`` (``own``: this rank's
    tensors), on rank 0 (None elsewhere): each tensor streamed from its owner to rank 0 in name order, never
    the whole stage. Every rank of the group calls it."""
    digest = weights_digest(len(plan.order)) if rank == 0 else None
    for name in plan.order:
        owner = plan.owner(name)
        if rank == 0:
            if owner == 0:
                tensor = own[name]
            else:
                tensor = torch.empty(plan.shapes[name], dtype=torch.float32)
                dist.recv(tensor, src=owner)
            hash_tensor_into(digest, name, tensor)
            del tensor
        elif owner == rank:
            dist.send(own[name].contiguous(), dst=0)
    return digest.digest() if rank == 0 else None


def sharded_root(leaves: list[bytes], rank: int, world: int) -> bytes | None:
    """The Merkle root (``ledger.merkle.merkle_root``) over every rank's ``leaves`` in rank order, on rank 0
    (None elsewhere): each rank hashes its own leaves into its frontier (:func:`training.cluster_merkle.
    shard_frontier`, about 2 log2 n hashes), rank 0 combines the frontiers; no leaf moves. Collective."""
    counts: list = [None] * world
    dist.all_gather_object(counts, len(leaves))
    first, total = sum(counts[:rank]), sum(counts)
    frontiers: list | None = [None] * world if rank == 0 else None
    dist.gather_object(shard_frontier(leaves, first, total), frontiers, dst=0)
    return root_from_frontiers(frontiers, total) if rank == 0 else None


def sharded_chunk_roots(plan, rank: int, weights: Mapping[str, torch.Tensor],
                        momentum: Mapping[str, torch.Tensor]) -> tuple[bytes, bytes] | None:
    """``(weightsRoot, momentumRoot)`` of a stage sharded along ``plan`` (``weights``, ``momentum``: this
    rank's tensors), on rank 0 (None elsewhere): each rank builds the tensor leaves of its own tensors at
    their stage-wide chunk indices (``tensor_leaves(..., first_tensor=...)``) and hashes them into its
    frontier (:func:`sharded_root`): the bits ``merkle_root(tensor_leaves(whole))`` gives, the stage never
    gathered. Collective over the group."""
    base, world = plan.tensor_base(rank), len(plan.names)
    roots = []
    for tensors in (weights, momentum):
        leaves = tensor_leaves(tensors, first_tensor=base)
        roots.append(sharded_root(leaves, rank, world))
        del leaves
    return None if rank != 0 else (roots[0], roots[1])
