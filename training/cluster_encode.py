"""A cluster rank's encode of its shard whose bytes are the one-process encode's (issue 75; docs/CLUSTER.md).

Coded to the error budget (``compression.bandwidth_budget = 0``) every tensor's entry is independent, so each
rank encodes its own tensors and rank 0 joins the ranks' messages (:func:`training.cluster_plan.
join_contribution`). Under a byte budget (``"auto"``, the default) the codec's allocation is joint over the
stage's tensors (:func:`training.codec.allocation.allocate`), so :class:`ShardCompressor` splits the
encoder's round (training/codec/base.py, reselect.py) along what is per tensor and what is joint:

1. each rank takes its tensors' norms (``tensor_matrices``) and sends them to rank 0 (a float per tensor);
2. rank 0, which keeps the stage's encoder memo, says whether the round is a warm one (encoder "v4" between
   selections, :mod:`training.codec.reselect`) and, if it is, every tensor's coding
   (``warm_choices``: a pure function of the memo's estimates, the norms and the shapes);
3. in a selection round (and for a kind without a memo, "v1"/"v2") each rank estimates its tensors'
   candidates (``tensor_options``) and sends rank 0 each candidate's ``(cost, squared error)``: rank 0 runs
   the allocation over the stage (the same ``allocate`` on the same numbers in the same order) and sends
   every rank its tensors' choices;
4. each rank codes its tensors' chosen options (``finish``) into its message and keeps its decoded tensors
   for its residual; in a selection round it sends rank 0 its part of the next memo (each tensor's coding
   and estimates, a few numbers), which rank 0 merges in the stage's order.

Every number the allocation sees is computed by the same function on the same tensor as one process computes
it (each rank with rank 0's thread count for the encode: the codec's float sums follow it), and every entry
is coded alike, so the joined contribution is the one-process contribution byte for byte
(tests/test_cluster_node.py) and no rank, rank 0 included, holds more than its own tensors' targets.
Encoder "v3" keeps a basis per low-rank tensor in its memo, which its warm rounds start from: for it rank 0
still gathers the targets and encodes the stage (:meth:`ShardCompressor._encode_gathered`, a transient
copy of the stage's pseudo-gradient on rank 0).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from training.cluster_plan import ShardPlan, split_contribution
from training.codec.allocation import allocate, contribution_overhead
from training.codec.base import tensor_matrices
from training.codec.memo import EncoderMemo
from training.codec.reselect import RESELECT_ROUNDS
from training.codec.stats import CompressionStats
from training.codec_wire import decode_declared
from training.compression import ErrorFeedbackCompressor, encoder_for


class ShardCompressor(ErrorFeedbackCompressor):
    """A rank's error-feedback compressor of its shard whose encode matches the whole stage's (module
    docstring): ``bandwidth_budget`` is the stage's; rank 0 keeps the stage's encoder memo."""

    def __init__(self, plan: ShardPlan, rank: int, cfg, *, bandwidth_budget: int, exact: int) -> None:
        super().__init__(plan.shard_shapes(rank), cfg, bandwidth_budget=bandwidth_budget, exact=exact)
        self.plan, self.rank = plan, rank

    def _encode(self, target, stage_index: int, outer_round: int):
        # Every rank codes with rank 0's thread count: the codec's float sums (norms, factorizations) follow
        # it, and the bytes must be those one process with rank 0's threads codes.
        threads = [torch.get_num_threads()]
        dist.broadcast_object_list(threads, src=0)
        own = torch.get_num_threads()
        torch.set_num_threads(threads[0])
        try:
            return self._encode_shard(target, stage_index, outer_round)
        finally:
            torch.set_num_threads(own)

    def _encode_shard(self, target, stage_index: int, outer_round: int):
        if not (self.cfg.enabled and self.bandwidth_budget > 0):
            return super()._encode(target, stage_index, outer_round)  # per tensor: the shard alone
        encoder = encoder_for(self.cfg)
        if encoder.memo_bases:
            return self._encode_gathered(target, stage_index, outer_round)
        matrices, norms = tensor_matrices(target)
        gathered = self._to_zero(norms)
        decision = [self._decide(encoder, gathered, outer_round) if self.rank == 0 else None]
        dist.broadcast_object_list(decision, src=0)
        keep = decision[0]
        found = None
        if keep is not None:  # a warm round: the memo's codings (rank 0 keeps the memo; v4's needs no basis)
            chosen, _bases = encoder.warm_options(target, matrices, keep, None)
        else:
            found = {name: encoder.tensor_options(matrix, tuple(target[name].shape), norms[name])
                     for name, matrix in matrices.items()}
            options = {name: [(option.candidate.cost, (option.estimate * norms[name]) ** 2)
                              for option in tensor.options] for name, tensor in found.items()}
            every = self._to_zero(options)
            choice = [self._allocate(every) if self.rank == 0 else None]
            dist.broadcast_object_list(choice, src=0)
            chosen = {name: found[name].options[choice[0][name]] for name in found}
        blob, decoded, stats, coded = encoder.finish(target, matrices, norms, chosen, stage_index=stage_index,
                                                     outer_round=outer_round)
        if encoder.keeps_memo:
            self._next_memo(encoder, keep, matrices, coded, found)
        return blob, decoded, stats

    def _to_zero(self, value):
        """Every rank's ``value`` (a dict by tensor name) merged on rank 0 in the stage's name order."""
        gathered: list | None = [None] * self.plan.world if self.rank == 0 else None
        dist.gather_object(value, gathered, dst=0)
        if gathered is None:
            return None
        merged = {name: item for part in gathered for name, item in part.items()}
        return {name: merged[name] for name in sorted(merged)}

    def _stage_tensors(self) -> dict[str, torch.Tensor]:
        """The stage's tensors as shapes only (meta): what the overhead and the warm allocation read."""
        return {name: torch.empty(self.plan.shapes[name], device="meta") for name in sorted(self.plan.shapes)}

    def _decide(self, encoder, norms: Mapping[str, float], outer_round: int):
        """Rank 0: the warm round's codings of every tensor, or None for a selection round (the encoder's own
        test, training.codec.reselect.ReselectingEncoder.encode_round)."""
        memo = self.encoder_memo
        warm = (encoder.keeps_memo and memo is not None and outer_round % RESELECT_ROUNDS != 0
                and set(memo.choices) == set(norms) and encoder.memo_usable(memo))
        if not warm:
            return None
        return encoder.warm_choices(self._stage_tensors(), norms, self.bandwidth_budget, memo)

    def _allocate(self, options) -> dict[str, int]:
        """Rank 0: the allocation of the stage's budget over every tensor's candidates (Encoder.select)."""
        return allocate(options, self.bandwidth_budget - contribution_overhead(self._stage_tensors()))

    def _next_memo(self, encoder, keep, matrices, coded, found) -> None:
        """Rank 0's memo of the stage after this round: the merged parts of a selection, or the warm codings
        with the estimates kept (ReselectingEncoder.encode_round)."""
        if keep is not None:
            if self.rank == 0:
                self.encoder_memo = EncoderMemo(keep, {}, self.encoder_memo.estimates)
            return
        part = encoder.selection_memo(matrices, coded, found)
        choices = self._to_zero(part.choices)
        estimates = None if part.estimates is None else self._to_zero(part.estimates)
        if self.rank == 0:
            self.encoder_memo = EncoderMemo(choices, {}, estimates)

    def _encode_gathered(self, target, stage_index: int, outer_round: int):
        """Rank 0 gathers the targets and encodes the stage as one process would, each rank gets its part
        (encoder "v3", module docstring)."""
        whole = gather_to_zero(self.plan, self.rank, target, lambda name: self.plan.shapes[name])
        parts = None
        stats = CompressionStats(outer_round=outer_round, stage_index=stage_index)
        if self.rank == 0:
            ordered = {name: whole[name] for name in self.plan.order}
            whole_shapes, self.shapes = self.shapes, dict(self.plan.shapes)  # the memo is the stage's
            try:
                blob, _decoded, stats = super()._encode(ordered, stage_index, outer_round)
            finally:
                self.shapes = whole_shapes
            del ordered, whole, _decoded
            parts = split_contribution(blob, self.plan, stage_index=stage_index, outer_round=outer_round)
        received: list = [None]
        dist.scatter_object_list(received, parts, src=0)
        part = received[0]
        _steps, decoded = decode_declared(part, self.shapes, stage_index=stage_index, outer_round=outer_round)
        return part, decoded, stats

    def load_encoder_state(self, state) -> None:
        shapes, self.shapes = self.shapes, dict(self.plan.shapes)  # rank 0 keeps the stage's memo
        try:
            super().load_encoder_state(state)
        finally:
            self.shapes = shapes


def gather_to_zero(plan: ShardPlan, rank: int, own: Mapping[str, torch.Tensor], shape_of) -> dict | None:
    """Every rank's ``own`` tensors sent to rank 0, one at a time in chunk order: the whole dict on rank 0."""
    whole: dict[str, torch.Tensor] | None = {} if rank == 0 else None
    for name in plan.order:
        owner = plan.owner(name)
        if rank == 0:
            if owner == 0:
                whole[name] = own[name]
            else:
                tensor = torch.empty(shape_of(name), dtype=torch.float32)
                dist.recv(tensor, src=owner)
                whole[name] = tensor
        elif owner == rank:
            dist.send(own[name].detach().to(torch.float32).contiguous(), dst=0)
    return whole
