"""Rank 0's view of a cluster node's sharded outer state: one engine for the node (issue 75; docs/CLUSTER.md).

:class:`ShardedStageEngine` has the surface of :class:`training.stage_engine.StageEngine` that the node's
worker uses (node/live/worker/replica.py, aggregation.py); each call is a command every rank of the cluster
carries out on its :class:`training.cluster_outer.OuterShard` (:meth:`training.cluster_replica.
ClusterReplicaTrainer.outer`). Rank 0 holds its own shard only. The global weights and momentum the node
reads are :class:`KeptState` handles (each rank keeps its shard of the state while a handle lives; a read
fetches one tensor from its rank); the start state's engine part is streamed a tensor at a time
(:meth:`~ShardedStageEngine.streamed_state`); :meth:`~ShardedStageEngine.state_dict` gathers the shards
whole (tests; training/cluster_outer.py says what else moves, and when).

Not supported behind a cluster node (refused at config load, node/config_compute.py): the sliced exchange
(its slice aggregates step a whole-stage average). :meth:`prepare_aggregation` computes nothing ahead
(None: the node then aggregates at the apply, on the ranks).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence

import torch

from training.diloco import Aggregation, aggregate_with_report, outer_state_shape
from training.errors import AggregationError, EngineStateError
from training.stage_results import RoundResult


class _CompressorView:
    """What the node reads and calls of a stage engine's compressor, for the sharded engine."""

    def __init__(self, engine: ShardedStageEngine) -> None:
        self._engine = engine

    @property
    def bandwidth_budget(self) -> int:
        return self._engine.shard.engine.compressor.bandwidth_budget  # the stage's (ShardCompressor)

    @property
    def last_slices(self) -> list[bytes]:
        raise EngineStateError("a cluster node does not slice its contributions (diloco.exchange = \"full\")")

    def reset_feedback(self) -> None:
        self._engine._call("reset_feedback", changes=False)


class ShardedStageEngine:
    """The node's engine of a stage whose outer state is sharded over a cluster's ranks (module docstring).
    ``trainer``: the :class:`training.cluster_replica.ClusterReplicaTrainer`; ``shard``: rank 0's
    :class:`training.cluster_outer.OuterShard`."""

    def __init__(self, trainer, shard) -> None:
        self.trainer, self.shard = trainer, shard
        self.stage_index = shard.engine.stage_index
        self.shapes = {name: shard.plan.shapes[name] for name in shard.order}
        self.plan = shard.plan
        self.diloco_cfg = shard.engine.diloco_cfg
        self.compression_cfg = shard.engine.compression_cfg
        self.compressor = _CompressorView(self)
        self._hash: bytes | None = None  # the global weights' hash, until they change
        # The current global state's handles (KeptState: weights, momentum), until it changes: the node keeps
        # such states by reference (the finisher's held states, fork repair's bases, a chunked record), as a
        # one-process engine's objects; each rank keeps its shard of the state while a handle lives.
        self._global: dict[str, tuple[KeptState, KeptState]] = {}
        self._next_state = 0
        self._released: list[int] = []  # states whose handles are gone (appended by finalizers, any thread)

    def _call(self, op: str, *args, private=None, changes: bool = True):
        with self.trainer._lock:  # the command and the caches' invalidation as one (other threads read them)
            try:
                return self.trainer.outer((op, *args), private=private)
            finally:
                if changes:
                    self._hash, self._global = None, {}

    # -- the round counters and modes (the same on every rank: rank 0's shard engine) -----------------
    @property
    def last_encoded(self) -> int:
        return self.shard.engine.last_encoded

    @property
    def last_applied(self) -> int:
        return self.shard.engine.last_applied

    @property
    def delayed(self) -> bool:
        return self.shard.engine.delayed

    @property
    def lookahead(self) -> bool:
        return self.shard.engine.lookahead

    @property
    def can_prepare(self) -> bool:
        return self.shard.engine.can_prepare

    def can_apply(self, outer_round: int) -> bool:
        return self.shard.engine.can_apply(outer_round)

    def transmitted(self, outer_round: int) -> bool:
        return self.shard.engine.transmitted(outer_round)

    # -- a round -------------------------------------------------------------------------------------
    def prepare_encode(self, outer_round: int) -> None:
        self._call("prepare_encode", outer_round, changes=False)

    def encode_contribution(self, outer_round: int, declared_steps: int | None = None):
        """(the stage's contribution, its stats): the ranks' parts joined on rank 0."""
        return self._call("encode", outer_round, declared_steps, changes=False)

    def prepare_aggregation(self, outer_round: int, contributions: Sequence[bytes], *,
                            excluded: Mapping[int, str] | None = None) -> None:
        return None  # aggregated at the apply, on the ranks (module docstring)

    def prepared_valid(self, prepared, outer_round: int) -> bool:
        return False

    def _finish(self, outer_round: int, contributions: Sequence[bytes], excluded, aggregation,
                absorb: bool) -> RoundResult:
        if aggregation is not None and not absorb:
            raise EngineStateError("a cluster node aggregates its rounds on its ranks: no aggregation "
                                   "computed elsewhere (the sliced exchange) is applied")
        with self.trainer._lock:
            if aggregation is not None:
                kept, whole = self._incoming(aggregation.new_global, aggregation.new_momentum)
                result = self._call("absorb", outer_round, kept, private=whole)
            else:
                result = self._call("finish", outer_round, len(contributions), dict(excluded or {}), absorb,
                                    private=list(contributions))
            self._hash = result.weights_hash  # the new state's, streamed by the command
        return result

    def finish_round(self, outer_round: int, contributions: Sequence[bytes], *,
                     excluded: Mapping[int, str] | None = None, prepared=None,
                     aggregation=None) -> RoundResult:
        return self._finish(outer_round, contributions, excluded, aggregation, absorb=False)

    def apply_round(self, outer_round: int, contributions: Sequence[bytes], *,
                    excluded: Mapping[int, str] | None = None, prepared=None,
                     aggregation=None) -> RoundResult:
        if not self.can_apply(outer_round):
            raise EngineStateError(f"stage {self.stage_index}: round {outer_round} is not the next to apply")
        return self._finish(outer_round, contributions, excluded, aggregation, absorb=False)

    def absorb_round(self, outer_round: int, contributions: Sequence[bytes], *,
                     excluded: Mapping[int, str] | None = None, prepared=None,
                     aggregation=None) -> RoundResult:
        return self._finish(outer_round, contributions, excluded, aggregation, absorb=True)

    def screen_on_ranks(self, outer_round: int, contributions: Sequence[bytes], base, batch, model_cfg,
                        declared_steps, *, refuse_raw: bool):
        """Screening's reports of ``contributions`` against ``base`` (a kept global state), the weights on
        the ranks (training/cluster_screen.py: rank 0 never builds a whole weight set)."""
        from training.cluster_screen import screen_on_ranks

        return screen_on_ranks(self, outer_round, contributions, base, batch, model_cfg, self.diloco_cfg,
                               declared_steps, refuse_raw=refuse_raw)

    def screen_call(self, op: str, *args, private=None):
        """One command of a screening on the ranks (training/cluster_screen.py)."""
        return self._call(op, *args, private=private, changes=False)

    def contribution_dropped(self, outer_round: int) -> bool:
        return bool(self._call("dropped", outer_round, changes=False))

    # -- joining and re-basing -----------------------------------------------------------------------
    def rebase(self, global_weights: Mapping[str, torch.Tensor], momentum: Mapping[str, torch.Tensor],
               last_round: int) -> None:
        kept, whole = self._incoming(global_weights, momentum)
        self._call("rebase", last_round, kept, private=whole)

    def move_global(self, global_weights: Mapping[str, torch.Tensor],
                    momentum: Mapping[str, torch.Tensor]) -> None:
        kept, whole = self._incoming(global_weights, momentum)
        self._call("move_global", kept, private=whole)

    def _incoming(self, weights: Mapping[str, torch.Tensor], momentum: Mapping[str, torch.Tensor]):
        """``(kept state id, None)`` when ``weights`` and ``momentum`` are this engine's handles of one kept
        state (the ranks hold it: each takes its own shard, nothing moves), else ``(None, (weights,
        momentum))`` as plain dicts, sent to the owners a tensor at a time (a checkpoint's state, fork
        repair's derived one: whole on rank 0 already; a foreign handle is fetched whole first)."""
        if (isinstance(weights, KeptState) and isinstance(momentum, KeptState) and weights.engine is self
                and momentum.engine is self and weights.state_id == momentum.state_id
                and (weights.which, momentum.which) == ("weights", "momentum")):
            return weights.state_id, None
        return None, (_whole(weights), _whole(momentum))

    def skip_to(self, next_round: int) -> None:
        if self.shard.engine.last_encoded >= next_round - 1:
            return  # nothing to do on any rank (StageEngine.skip_to's own test): no command
        self._call("skip_to", next_round, changes=False)

    # -- the record and the state, from the shards ---------------------------------------------------
    def weights_hash(self) -> bytes:
        """The stage's ``stage_weights_hash``: streamed from the ranks (cached until the weights change)."""
        with self.trainer._lock:
            if self._hash is None:
                self._hash = self._call("hash", changes=False)
            return self._hash

    def chunk_roots(self) -> tuple[bytes, bytes]:
        """``(weightsRoot, momentumRoot)`` of the stage's chunk trees (ledger/chunkproof.py: the roots a
        chunked record's stage leaf holds) of the global weights and momentum, from the ranks' Merkle
        frontiers: no rank sends a tensor (training.cluster_engine.sharded_chunk_roots)."""
        return self._call("roots", changes=False)

    def _kept(self) -> tuple[KeptState, KeptState]:
        with self.trainer._lock:  # a change and its invalidation are one (_call): read the cache under it
            pair = self._global.get("state")
            if pair is None:
                state_id, released = self._new_state()
                self._call("keep", state_id, released, changes=False)
                pair = self._global["state"] = self._handles(state_id)
            return pair

    def _new_state(self) -> tuple[int, list[int]]:
        """A new kept state's id, and the ids of the states whose handles are gone (the ranks drop them)."""
        state_id, self._next_state = self._next_state, self._next_state + 1
        released = []
        while self._released:
            released.append(self._released.pop())
        return state_id, released

    def _handles(self, state_id: int) -> tuple[KeptState, KeptState]:
        """The (weights, momentum) handles of the state the ranks keep under ``state_id``."""
        ticket = _Ticket()
        weakref.finalize(ticket, self._released.append, state_id)
        shapes = {name: self.plan.shapes[name] for name in self.shard.order}
        moments = {name: tuple(outer_state_shape(self.diloco_cfg, shape)) for name, shape in shapes.items()}
        return (KeptState(self, state_id, "weights", shapes, ticket),
                KeptState(self, state_id, "momentum", moments, ticket))

    def aggregate_on_ranks(self, outer_round: int, base, contributions: Sequence[bytes],
                           excluded: Mapping | None = None) -> Aggregation:
        """``training.diloco.aggregate_with_report`` of ``contributions`` on ``base`` (global weights and
        momentum before the round: fork repair's derive), the engine unchanged. On the ranks when ``base`` is
        one of this engine's kept states: each rank aggregates its shard (as :meth:`finish_round` does) and
        keeps the new state, whose handles the result holds (``average`` None); else whole, on rank 0."""
        kept, whole = self._incoming(*base)
        if kept is None:
            return aggregate_with_report(whole[0], whole[1], contributions, self.diloco_cfg,
                                         stage_index=self.stage_index, outer_round=outer_round,
                                         compression_cfg=self.compression_cfg, excluded=excluded)
        if not contributions:
            raise AggregationError("no contributions to aggregate")
        with self.trainer._lock:
            state_id, released = self._new_state()
            reports, digest = self._call("derive", outer_round, len(contributions), dict(excluded or {}),
                                         kept, state_id, released, private=list(contributions),
                                         changes=False)
            weights, momentum = self._handles(state_id)
        return Aggregation(weights, momentum, digest, None, reports)

    @property
    def global_weights(self) -> Mapping[str, torch.Tensor]:
        """The global weights: a :class:`KeptState`, each tensor fetched from its rank when read (the same
        object until they change; the ranks keep their shards of it while it lives)."""
        return self._kept()[0]

    @property
    def momentum(self) -> Mapping[str, torch.Tensor]:
        """The outer momentum: a :class:`KeptState`, as :attr:`global_weights`."""
        return self._kept()[1]

    def state_dict(self, *, copy: bool = True) -> dict:
        """:meth:`StageEngine.state_dict` of the whole stage, the ranks' shards gathered (always copies)."""
        return self._call("state", changes=False)

    def streamed_state(self) -> tuple[tuple[int, int, int], Mapping[str, torch.Tensor]]:
        """``(counters, tensors)`` of the start state's engine part (training.replica_capture), the tensors
        a :class:`RankTensors` view: each fetched from the rank that holds it when read (a start state is
        written one tensor at a time: rank 0 never holds the stage's engine state). The engine must not
        change until the state is written (as for a one-process engine); a read after a change is refused."""
        counters, index = self._call("state_index", changes=False)
        return tuple(counters), RankTensors(self, index)

    def load_state_dict(self, state) -> None:
        raise EngineStateError("a cluster node's engine state is restored with rebase (a checkpoint), not "
                               "loaded whole")

    def rank_outer_bytes(self) -> list[dict[str, int]]:
        """Each rank's outer state in bytes (tensor accounting: training.cluster_outer.outer_state_bytes)."""
        return self._call("bytes", changes=False)


class RankTensors(Mapping):
    """name -> float32 tensor of a sharded engine's state, each fetched from its rank when read (one
    ``fetch`` command per read; nothing held here): :meth:`ShardedStageEngine.streamed_state`."""

    def __init__(self, engine: ShardedStageEngine, index: dict[str, tuple[int, tuple[int, ...]]]) -> None:
        self._engine, self._index = engine, index

    def __getitem__(self, name: str) -> torch.Tensor:
        owner, shape = self._index[name]
        return self._engine._call("fetch", name, owner, shape, changes=False)

    def __iter__(self):
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)


class _Ticket:
    """What a kept state's two handles share: when it is collected, the ranks may drop the state."""


class KeptState(Mapping):
    """name -> float32 tensor of one global state of a cluster's stage (``which``: its weights or momentum),
    each fetched from the rank that holds it when read (one ``fetch_kept`` command; nothing held here).
    The ranks keep their shards of the state while a handle to it lives (training/cluster_outer.py,
    KEPT_STATES): a state the node keeps a few rounds costs each rank its shard, not rank 0 the whole."""

    def __init__(self, engine: ShardedStageEngine, state_id: int, which: str,
                 shapes: dict[str, tuple[int, ...]], ticket: _Ticket) -> None:
        self._engine = weakref.ref(engine)  # no cycle through the engine's cache: released by refcount
        self.state_id, self.which, self._shapes, self._ticket = state_id, which, shapes, ticket

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._shapes:
            raise KeyError(name)
        engine = self._engine()
        if engine is None:
            raise EngineStateError("the cluster's engine is gone: its kept states with it")
        return engine._call("fetch_kept", self.state_id, self.which, name, engine.plan.owner(name),
                            changes=False)

    def __iter__(self):
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)

    @property
    def engine(self) -> ShardedStageEngine | None:
        """The engine whose ranks keep this state (None once it is gone)."""
        return self._engine()

    def shape_of(self, name: str) -> tuple[int, ...]:
        """A tensor's shape, without fetching it."""
        return self._shapes[name]


def _whole(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A plain dict of ``tensors``, fetched now if it is a :class:`KeptState` (before a command: a handle
    cannot be read while another command runs)."""
    return dict(tensors)
