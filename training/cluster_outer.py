"""A cluster node's outer state, sharded over its ranks behind the node (issue 75; docs/CLUSTER.md).

A node of ``compute.processes`` = N > 1 (:mod:`training.cluster_replica`) keeps its DiLoCoX outer state the
way :class:`training.cluster_engine.ClusterStageEngine` does: the stage's tensors are cut by
:func:`training.cluster_plan.plan_shards` (whole tensors, contiguous in chunk order) and rank r holds, in an
:class:`OuterShard`, a :class:`training.stage_engine.StageEngine` of its tensors only (global weights, outer
momentum, round-start weights, error-feedback residual, the delay correction's snapshots). Rank 0 (the node)
sees one engine, :class:`ShardedStageEngine`, with the surface the node's worker uses
(node/live/worker/replica.py, aggregation.py); each of its calls is a command that every rank carries out
together (:meth:`training.cluster_replica.ClusterReplicaTrainer.outer`).

The live weights are the FSDP2 shards of the inner steps' module (every rank holds 1/N of every tensor;
no process holds them whole). For a command that reads or writes them, each rank gathers its own tensors
whole (``full_tensor``, one tensor at a time: every rank takes part in each gather, only the owner keeps
it), its engine works on those copies, a command that changes them writes each back into every rank's
shards from its owner (``distribute_tensor``), and the copies are dropped when the command is done.

What moves to rank 0, and when:

* **The encode.** Each rank encodes its own tensors (:class:`training.cluster_encode.ShardCompressor`);
  under a byte budget the joint allocation is computed on rank 0 from the ranks' few numbers per tensor
  (norms, the candidates' costs and estimated errors), and rank 0 joins the ranks' messages. The
  contribution is the one-process contribution byte for byte: the wire, the record and every verifier are
  unchanged, and the bytes do not depend on N. (Encoder "v3" still has rank 0 gather the targets.)
* **Whole-stage readers**: the global weights and momentum the node reads (a checkpoint, the fraud proof's
  chunk states, the states it keeps a few rounds) are handles on states each rank keeps by reference
  (``keep``), read a tensor at a time (``fetch_kept``); screening and fork repair's derive on a kept state
  run on the ranks (``screen_load`` / ``screen_tensors``, training/cluster_screen.py; ``derive``); a
  re-base, move or absorb to a kept state copies each rank's own shard (:meth:`OuterShard._incoming`); a
  start state's engine part is streamed (``state_index``, ``fetch``); :meth:`~ShardedStageEngine.
  state_dict` gathers every rank's shard merged into the one-process layout (tests).

The aggregation runs sharded (:mod:`training.cluster_robust`: each rank decodes its part of every
contribution, exact square sums exchanged, every rank the same reports, each rank steps its own tensors)
and the weights hash is streamed to rank 0 a tensor at a time. The outer step is elementwise float32 per
tensor, so weights, momentum, hash and reports are the one-process engine's bits
(tests/test_cluster_node.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from training.cluster_encode import ShardCompressor, gather_to_zero
from training.cluster_engine import sharded_chunk_roots, streamed_weights_hash
from training.cluster_exchange import forward_to_ranks, split_to_ranks
from training.cluster_parts import exchange_plan
from training.cluster_plan import ShardPlan, join_contribution, plan_shards
from training.cluster_robust import round_reports, shard_aggregation, shard_facts
from training.cluster_screen import ScreeningShard
from training.codec.stats import CompressionStats
from training.diloco import Aggregation, outer_state_shape
from training.errors import EngineStateError
from training.replica_capture import engine_state_tensors
from training.stage_engine import StageEngine
from training.stage_results import RoundResult


def _scatter_from_zero(plan: ShardPlan, rank: int, whole: Mapping[str, torch.Tensor] | None,
                       shape_of) -> dict[str, torch.Tensor]:
    """Rank 0's ``whole`` dict cut along the plan: each rank gets its tensors (float32 copies)."""
    own: dict[str, torch.Tensor] = {}
    for name in plan.order:
        owner = plan.owner(name)
        if rank == 0:
            tensor = whole[name].detach().to(torch.float32).contiguous()
            if owner == 0:
                own[name] = tensor.clone()
            else:
                dist.send(tensor, dst=owner)
        elif owner == rank:
            own[name] = torch.empty(shape_of(name), dtype=torch.float32)
            dist.recv(own[name], src=0)
    return own


class OuterShard(ScreeningShard):
    """One rank's outer state (module docstring): a StageEngine of its tensors, driven by :meth:`run`.

    ``live``: the rank's FSDP2-sharded live parameters by name (DTensors; plain tensors in one process);
    the rank's own tensors are gathered from them for each command (:meth:`live_in`). Every method is
    collective: every rank runs the same, in order.
    """

    def __init__(self, stage_index: int, shapes: Mapping[str, tuple[int, ...]], diloco_cfg, compression_cfg,
                 exact: int, live: Mapping[str, torch.Tensor]) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.plan = plan_shards(shapes, self.world)
        parts = getattr(diloco_cfg, "exchange_parts", 1)
        # a run in parts: rank 0 forwards each contribution's parts (training/cluster_exchange.py)
        self.parts_plan = exchange_plan(shapes, parts) if parts > 1 and self.world > 1 else None
        self.own = self.plan.names[self.rank]
        self.order = list(shapes)  # the one-process engine's order (the module's parameters)
        self.diloco_cfg = diloco_cfg
        self.sharded = live
        self.live: dict[str, torch.Tensor] = {}
        # the engine state a start state is being written from, by the start state's names (no copies):
        # set by "state_index", read by "fetch", dropped by any command that may change the engine
        self._frozen: dict[str, torch.Tensor] | None = None
        # id -> this rank's shard of a global state (weights, momentum) the node keeps a handle on
        # (training.cluster_node_engine.KeptState): the engine's own dicts, which it replaces, never changes
        self.kept: dict[int, tuple[dict, dict]] = {}
        self.live_in()
        self.engine = StageEngine(stage_index, self.live, diloco_cfg, compression_cfg, exact=exact)
        self.release()
        stage_budget = compression_cfg.stage_bandwidth_budget(
            self.plan.numel(), diloco_cfg.inner_steps, diloco_cfg.num_replicas)
        self.engine.compressor = ShardCompressor(self.plan, self.rank, compression_cfg,
                                                 bandwidth_budget=stage_budget, exact=exact)

    # ------------------------------------------------------------------ live weights <-> FSDP shards

    def live_in(self) -> None:
        """The engine's live weights for a command that reads or writes them: the rank's own tensors
        gathered whole from the shards, held until :meth:`release` (between commands a rank holds none)."""
        live: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name in self.plan.order:
                param = self.sharded[name]
                full = param.full_tensor() if hasattr(param, "full_tensor") else param.detach()
                if name in self.own:
                    live[name] = full.to(torch.float32).contiguous().clone()
                del full
        self.live = {name: live[name] for name in self.order if name in live}  # the engine's order
        if hasattr(self, "engine"):
            self.engine.params = self.live

    def release(self) -> None:
        """Drop the rank's copy of its live weights after a command."""
        self.live = {}
        self.engine.params = {}

    def live_out(self) -> None:
        """The ranks' changed live tensors back into every rank's shards, from their owner, one at a time."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        with torch.no_grad():
            for name in self.plan.order:
                param, owner = self.sharded[name], self.plan.owner(name)
                if not isinstance(param, DTensor):  # one process: a plain parameter
                    param.copy_(self.live[name])
                    continue
                source = (self.live[name] if owner == self.rank
                          else torch.empty(tuple(param.shape), dtype=torch.float32))
                source = source.to(param.to_local().device, param.dtype)
                placed = distribute_tensor(source, param.device_mesh, param.placements, src_data_rank=owner)
                param.to_local().copy_(placed.to_local())

    def _momentum_shape(self, name: str) -> tuple[int, ...]:
        return tuple(outer_state_shape(self.diloco_cfg, self.plan.shapes[name]))

    def _weights_shape(self, name: str) -> tuple[int, ...]:
        return self.plan.shapes[name]

    # ------------------------------------------------------------------ the commands

    def run(self, op: str, args: tuple, private=None):
        """Carry out ``op`` (the same ``args`` on every rank; ``private``: rank 0's whole-stage inputs)."""
        handler = getattr(self, f"_op_{op}", None)
        if handler is None:
            raise EngineStateError(f"cluster outer command {op!r}: unknown")
        if op not in READ_ONLY:
            self._frozen = None  # the engine may change: a start state being written would be torn
        return handler(*args, private=private)

    def _op_prepare_encode(self, outer_round: int, *, private=None) -> None:
        self.live_in()
        try:
            self.engine.prepare_encode(outer_round)
        finally:
            self.release()

    def _op_encode(self, outer_round: int, declared: int | None, *, private=None):
        prepared = self.engine._prepared is not None
        if not prepared:
            self.live_in()
        try:
            part, stats = self.engine.encode_contribution(outer_round, declared)
            if not prepared and self.engine.lookahead:
                self.live_out()
        finally:
            self.release()
        gathered: list | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object((part, stats), gathered, dst=0)
        if self.rank != 0:
            return None
        blob = join_contribution([p for p, _s in gathered])
        merged = CompressionStats(outer_round=outer_round, stage_index=self.engine.stage_index)
        for _p, s in gathered:
            merged.raw_bytes += s.raw_bytes
            merged.tensors.extend(s.tensors)
            merged.encode_seconds = max(merged.encode_seconds, s.encode_seconds)
        merged.encoded_bytes = len(blob)
        return blob, merged

    def _split(self, outer_round: int, count: int, contributions: Sequence[bytes] | None):
        """This rank's message of each contribution and the errors of those that do not split: forwarded a
        part at a time in a run in parts (``diloco.exchange_parts`` > 1), scattered whole otherwise
        (training/cluster_exchange.py)."""
        stage = self.engine.stage_index
        if self.parts_plan is None:
            return split_to_ranks(contributions, self.plan, self.rank, stage_index=stage,
                                  outer_round=outer_round)
        return forward_to_ranks(contributions, self.parts_plan, self.plan, self.rank, count,
                                stage_index=stage, outer_round=outer_round)

    def _aggregate(self, outer_round: int, count: int, excluded, contributions, weights, momentum):
        """This rank's aggregation of its shard of ``weights`` and ``momentum`` (module docstring): each
        contribution's part decoded, the exact square sums exchanged, every rank the same reports."""
        parts, errors = self._split(outer_round, count, contributions)
        facts, decoded = shard_facts(
            parts, self.plan.shard_shapes(self.rank), stage_index=self.engine.stage_index,
            outer_round=outer_round, refuse_raw=self.engine.compression_cfg.enabled, split_errors=errors)
        every: list = [None] * self.world
        dist.all_gather_object(every, facts)
        reports = round_reports(every, self.diloco_cfg, excluded)
        return shard_aggregation(weights, momentum, decoded, reports, self.diloco_cfg, outer_round)

    def _op_finish(self, outer_round: int, count: int, excluded, absorb: bool, *, private=None):
        """The round aggregated per shard and applied: ``finish_round`` (or ``absorb_round`` when ``absorb``)
        with this rank's aggregation; RoundResult with the stage's hash on rank 0."""
        engine = self.engine
        aggregation = self._aggregate(outer_round, count, excluded, private, engine.global_weights,
                                      engine.momentum)
        blobs = [b""] * count
        step = engine.absorb_round if absorb else engine.finish_round
        result = self._writing(lambda: step(outer_round, blobs, aggregation=aggregation))
        return self._with_hash(result)

    def _op_derive(self, outer_round: int, count: int, excluded, base: int, state_id: int,
                   released: Sequence[int], *, private=None):
        """The aggregation of ``outer_round`` on the kept state ``base`` (fork repair's derive: the engine
        does not change), its new state kept under ``state_id``; ``(reports, its weights hash)`` on rank 0."""
        state = self._kept_state(base)
        aggregation = self._aggregate(outer_round, count, excluded, private, state[0], state[1])
        self._op_keep(state_id, released, state=(aggregation.new_global, aggregation.new_momentum))
        digest = streamed_weights_hash(self.plan, self.rank, aggregation.new_global)
        return (aggregation.contributions, digest) if self.rank == 0 else None

    def _writing(self, change):
        """``change()`` of the live weights: the live weights in, changed, back into the shards, released."""
        self.live_in()
        try:
            result = change()
            self.live_out()
            return result
        finally:
            self.release()

    def _with_hash(self, result: RoundResult):
        digest = self._op_hash()
        if self.rank == 0:
            result.weights_hash = digest
            return result
        return None

    def _incoming(self, kept: int | None, private) -> tuple[dict, dict]:
        """This rank's shard of a new global state (weights, momentum): of the state the ranks keep under
        ``kept`` (copies of each rank's own shard: nothing moves), else cut from rank 0's whole ``private``
        and sent to the owners a tensor at a time."""
        if kept is not None:
            state = self._kept_state(kept)
            return ({name: t.clone() for name, t in state[0].items()},
                    {name: t.clone() for name, t in state[1].items()})
        weights = _scatter_from_zero(self.plan, self.rank, None if private is None else private[0],
                                     self._weights_shape)
        momentum = _scatter_from_zero(self.plan, self.rank, None if private is None else private[1],
                                      self._momentum_shape)
        return weights, momentum

    def _op_absorb(self, outer_round: int, kept: int | None, *, private=None):
        """Absorb ``outer_round`` from a new global state (:meth:`_incoming`)."""
        weights, momentum = self._incoming(kept, private)
        aggregation = Aggregation(weights, momentum, b"", None, [])
        result = self._writing(lambda: self.engine.absorb_round(outer_round, [], aggregation=aggregation))
        return self._with_hash(result)

    def _op_rebase(self, last_round: int, kept: int | None, *, private=None) -> None:
        weights, momentum = self._incoming(kept, private)
        self._writing(lambda: self.engine.rebase(weights, momentum, last_round))

    def _op_move_global(self, kept: int | None, *, private=None) -> None:
        weights, momentum = self._incoming(kept, private)
        self._writing(lambda: self.engine.move_global(weights, momentum))

    def _op_skip_to(self, next_round: int, *, private=None) -> None:
        self.engine.skip_to(next_round)

    def _op_dropped(self, outer_round: int, *, private=None) -> bool:
        return self.engine.contribution_dropped(outer_round)

    def _op_reset_feedback(self, *, private=None) -> None:
        self.engine.compressor.reset_feedback()

    def _op_hash(self, *, private=None) -> bytes | None:
        """The stage's ``stage_weights_hash`` on rank 0: each tensor streamed from its owner in name order."""
        return streamed_weights_hash(self.plan, self.rank, self.engine.global_weights)

    def _op_roots(self, *, private=None) -> tuple[bytes, bytes] | None:
        """The stage's chunk roots (the fraud proof's weights and momentum roots) on rank 0, from each rank's
        Merkle frontier of its own chunks (training.cluster_engine.sharded_chunk_roots): no tensor moves."""
        return sharded_chunk_roots(self.plan, self.rank, self.engine.global_weights, self.engine.momentum)

    def _op_global(self, which: str, *, private=None) -> dict | None:
        """The whole global weights (``which`` "weights") or momentum on rank 0, in the one-process order."""
        own = self.engine.global_weights if which == "weights" else self.engine.momentum
        shape_of = self._weights_shape if which == "weights" else self._momentum_shape
        whole = gather_to_zero(self.plan, self.rank, own, shape_of)
        return None if whole is None else {name: whole[name] for name in self.order}

    def _op_state(self, *, private=None) -> dict | None:
        """The engine's state of the whole stage on rank 0 (:meth:`StageEngine.state_dict`'s layout, the
        shards merged in the one-process order): the start state a verifier loads."""
        gathered: list | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(self.engine.state_dict(copy=True), gathered, dst=0)
        return None if gathered is None else merge_states(gathered, self.order)

    def _op_keep(self, state_id: int, released: Sequence[int], *, private=None, state=None) -> None:
        """Keep this rank's shard of the current global state (or of ``state``) under ``state_id`` (by
        reference: no copy) and drop the states in ``released`` (their handles on rank 0 are gone); at most
        KEPT_STATES are kept."""
        for old in released:
            self.kept.pop(old, None)
        self.kept[state_id] = (self.engine.global_weights, self.engine.momentum) if state is None else state
        while len(self.kept) > KEPT_STATES:
            self.kept.pop(next(iter(self.kept)))

    def _kept_state(self, state_id: int) -> tuple[dict, dict]:
        state = self.kept.get(state_id)
        if state is None:
            raise EngineStateError(f"global state {state_id} of the cluster is no longer kept (at most "
                                   f"{KEPT_STATES} are)")
        return state

    def _op_fetch_kept(self, state_id: int, which: str, name: str, owner: int, *, private=None):
        """One tensor of a kept global state (``which``: "weights" or "momentum"), sent by its owner to rank
        0 (the tensor on rank 0, None elsewhere)."""
        state = self._kept_state(state_id)
        if self.rank == owner:
            tensor = state[0 if which == "weights" else 1][name].detach().to(torch.float32).contiguous()
            if self.rank == 0:
                return tensor
            dist.send(tensor, dst=0)
            return None
        if self.rank == 0:
            shape = self._weights_shape(name) if which == "weights" else self._momentum_shape(name)
            tensor = torch.empty(shape, dtype=torch.float32)
            dist.recv(tensor, src=owner)
            return tensor
        return None

    def _op_state_index(self, *, private=None):
        """The start state's engine part, to stream (``ShardedStageEngine.streamed_state``): each rank
        names its shard's tensors as a start state does (``engine_state_tensors``; the encoder memo is rank
        0's, the stage's) and keeps them by reference; rank 0 gets ``(counters, {name: (owner, shape)})``."""
        counters, tensors = engine_state_tensors(self.engine.state_dict(copy=False))
        if self.rank != 0:
            tensors = {name: t for name, t in tensors.items() if not name.startswith("encoder.")}
        self._frozen = tensors
        shapes = {name: tuple(t.shape) for name, t in tensors.items()}
        gathered: list | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(shapes, gathered, dst=0)
        if self.rank != 0:
            return None
        index: dict[str, tuple[int, tuple[int, ...]]] = {}
        for owner, names in enumerate(gathered):
            for name, shape in names.items():
                if name in index:
                    raise EngineStateError(f"start state tensor {name!r} held by ranks {index[name][0]} and "
                                           f"{owner}")
                index[name] = (owner, shape)
        return counters, index

    def _op_fetch(self, name: str, owner: int, shape: tuple[int, ...], *, private=None):
        """One tensor of the start state's engine part (``state_index``), sent by its owner to rank 0."""
        if self._frozen is None:
            raise EngineStateError(f"start state tensor {name!r}: the engine changed while the state was "
                                   "written")
        if self.rank == owner:
            tensor = self._frozen[name].detach().to(torch.float32).contiguous()
            if self.rank == 0:
                return tensor
            dist.send(tensor, dst=0)
            return None
        if self.rank == 0:
            tensor = torch.empty(shape, dtype=torch.float32)
            dist.recv(tensor, src=owner)
            return tensor
        return None

    def _op_bytes(self, *, private=None) -> list | None:
        """Each rank's outer state in bytes (tensor accounting), on rank 0."""
        gathered: list | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(outer_state_bytes(self.engine), gathered, dst=0)
        return gathered


#: The commands that do not change a rank's engine (a start state's streamed write may go on across them).
READ_ONLY = frozenset({"state_index", "fetch", "hash", "roots", "global", "state", "bytes", "dropped", "keep",
                       "fetch_kept", "screen_load", "screen_tensors", "screen_drop", "derive"})

#: The most global states a rank keeps for the node's handles (training.cluster_node_engine.KeptState): the
#: node holds a few rounds' (the finisher's, fork repair's bases, a chunked record's), each released when
#: its handles are gone; a handle to a state dropped past this bound is refused when read.
KEPT_STATES = 16


def outer_state_bytes(engine: StageEngine) -> dict[str, int]:
    """Bytes of an engine's outer state by kind (tensor accounting): global weights, momentum, round-start,
    error-feedback residual, the delay correction's snapshots (pending round ends, own decoded, sent)."""
    def size(weights) -> int:
        return sum(t.numel() * t.element_size() for t in weights.values())

    return {"global": size(engine.global_weights), "momentum": size(engine.momentum),
            "round_start": size(engine._round_start), "residual": size(engine.compressor.residual),
            "snapshots": sum(size(w) for group in (engine._round_end, engine._own_decoded, engine._sent)
                             for w in group.values())}


def kept_state_bytes(shard: OuterShard) -> int:
    """Bytes of the global states a rank keeps for the node's handles beyond its engine's current ones (the
    same objects, counted in :func:`outer_state_bytes`): its shards of earlier states' weights, momentum."""
    current = {id(shard.engine.global_weights), id(shard.engine.momentum)}
    seen: set[int] = set()
    total = 0
    for pair in shard.kept.values():
        for tensors in pair:
            if id(tensors) in current or id(tensors) in seen:
                continue
            seen.add(id(tensors))
            total += sum(t.numel() * t.element_size() for t in tensors.values())
    return total


def merge_states(states: Sequence[dict], order: Sequence[str]) -> dict:
    """The ranks' :meth:`StageEngine.state_dict` shards as one stage's (names in ``order``); the encoder's
    memo is rank 0's (the stage's, :class:`ShardCompressor`)."""
    def merged(dicts) -> dict:
        union = {name: tensor for d in dicts for name, tensor in d.items()}
        return {name: union[name] for name in order if name in union}

    first = states[0]
    out = {key: first[key] for key in ("version", "stage_index", "one_step_delay", "last_encoded",
                                       "last_applied")}
    for key in ("global_weights", "momentum", "error_feedback", "round_start"):
        out[key] = merged(s[key] for s in states)
    for key in ("round_end", "own_decoded", "sent"):
        out[key] = {r: merged(s[key][r] for s in states) for r in first[key]}
    others = first["others_previous"]
    out["others_previous"] = None if others is None else (
        merged(s["others_previous"][0] for s in states), others[1])
    out["encoder_memo"] = first["encoder_memo"]
    return out
