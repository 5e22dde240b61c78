"""Screening a round's contributions on a cluster's ranks: no whole-stage copy on rank 0 (issue 75).

Screening (training/screening.py, docs/DILOCOX.md section 10) evaluates the model's float64 loss at the global
weights ``theta`` and, for each contribution ``d_i`` alone, at ``theta - lr * d_i`` (and ``theta + lr * d_i``
under versions 2 and 3). One process builds each of these weight sets whole (float32), a float64 copy of it
and a float64 model, beside every contribution decoded whole: several times the stage on rank 0. Here:

* each rank decodes its part of every contribution (the aggregation's split and strict decoder,
  :func:`training.cluster_robust.shard_facts`; a contribution that fails on any rank is not screened, as
  ``decode_full`` leaves out one that fails whole) and keeps it for the screening's session;
* ``screen_contributions`` runs unchanged on rank 0 with a ``shift`` that builds nothing: a weight set is a
  :class:`WeightSet` (which kept global state, which contribution, which factor and sign);
* its loss (:class:`StreamedModelLoss`, a :class:`training.screening.ModelLoss`) runs the same float64 model
  forward with the parameters on the meta device, each block's made real just before the block runs and
  dropped after it: fetched from the ranks that own its tensors, each computed there by the one-process
  arithmetic (:func:`training.screening.shifted` of that tensor) and sent to rank 0.

Each parameter's float64 value is the one-process screening's, and the forward is the same module's (the
same operations in the same order, on SCREENING_THREADS threads), so the losses, the reports and the
exclusions are the same bits (tests/test_cluster_screen.py). Rank 0 holds the embeddings, the final norm and
the head in float64 for the forward, one block at a time, and the activations.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from training.cluster_robust import shard_facts
from training.cluster_stream import BlockStreamer
from training.errors import EngineStateError
from training.model import GPT
from training.screening import ModelLoss, decode_full, screen_contributions, shifted


@dataclass(frozen=True)
class WeightSet:
    """The weights one loss is taken at: the kept global state ``state_id`` alone (``index`` None), or shifted
    by contribution ``index`` times ``factor`` (float32) with ``sign`` (training.screening.shifted)."""

    state_id: int
    index: int | None = None
    factor: float = 0.0
    sign: int = 0


@dataclass(frozen=True)
class Screened:
    """Contribution ``index``, decoded on the ranks (each its part) for a screening session."""

    index: int


def shift_on_ranks(base: WeightSet, contribution: Screened, factor: torch.Tensor, sign: int) -> WeightSet:
    """``screen_contributions``' ``shift`` for weights that stay on the ranks."""
    return WeightSet(base.state_id, contribution.index, float(factor), sign)


class ScreeningShard:
    """The ranks' side of a screening (an :class:`training.cluster_outer.OuterShard` mixin): each rank's
    decoded parts by session, its tensors of a weight set computed and sent to rank 0."""

    def _screen_sessions(self) -> dict:
        sessions = getattr(self, "_sessions", None)
        if sessions is None:
            sessions = self._sessions = {}
        return sessions

    def _op_screen_load(self, session: int, outer_round: int, count: int, refuse_raw: bool, *, private=None):
        """Split the contributions (rank 0's ``private``), decode this rank's parts; on rank 0, which decoded
        on every rank (the others are not screened)."""
        parts, errors = self._split(outer_round, count, private)
        facts, decoded = shard_facts(parts, self.plan.shard_shapes(self.rank),
                                     stage_index=self.engine.stage_index, outer_round=outer_round,
                                     refuse_raw=refuse_raw, split_errors=errors)
        failed = torch.tensor([1 if fact.failed else 0 for fact in facts], dtype=torch.int64)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        usable = [not bool(flag) for flag in failed.tolist()]
        self._screen_sessions()[session] = {index: decoded[index] for index in range(count) if usable[index]}
        return usable if self.rank == 0 else None

    def _op_screen_tensors(self, session: int, weights: WeightSet, wanted: Sequence[tuple[str, int]], *,
                           private=None):
        """The tensors ``wanted`` (name, owner) of ``weights``, each computed by its owner and sent to rank 0
        in that order: a dict on rank 0."""
        decoded = self._screen_sessions().get(session)
        kept = self.kept.get(weights.state_id)
        if decoded is None or kept is None:
            raise EngineStateError(f"screening session {session}: its contributions or its global state "
                                   f"{weights.state_id} are no longer held")
        out: dict[str, torch.Tensor] = {}
        for name, owner in wanted:
            if owner == self.rank:
                value = kept[0][name]
                if weights.index is not None:
                    factor = torch.tensor(weights.factor, dtype=torch.float32)
                    value = shifted({name: value}, decoded[weights.index], factor, weights.sign)[name]
                value = value.detach().to(torch.float32).contiguous()
                if self.rank == 0:
                    out[name] = value
                else:
                    dist.send(value, dst=0)
            elif self.rank == 0:
                out[name] = torch.empty(self.plan.shapes[name], dtype=torch.float32)
                dist.recv(out[name], src=owner)
        return out if self.rank == 0 else None

    def _op_screen_drop(self, session: int, *, private=None) -> None:
        self._screen_sessions().pop(session, None)


class StreamedModelLoss(ModelLoss):
    """:class:`training.screening.ModelLoss` whose weights stay on the ranks (module docstring): the model on
    the meta device, each block's parameters fetched (``fetch(weights, names)``: name -> float32 tensor) and
    made float64 just before it runs, dropped after (training.cluster_stream.BlockStreamer)."""

    def __init__(self, model_cfg, x: torch.Tensor, y: torch.Tensor, fetch) -> None:
        with torch.device("meta"):
            self.model = GPT(model_cfg, seed=None).to(torch.float64).eval()
        self.x, self.y = x, y
        self._weights: WeightSet | None = None
        self._streamer = BlockStreamer(self.model, lambda names: fetch(self._weights, names), torch.float64)

    def logits(self, weights: WeightSet) -> torch.Tensor:
        self._weights = weights
        try:
            with self._streamer.top(), torch.no_grad():
                return self.model(self.x)[0]
        finally:
            self._weights = None


_sessions = itertools.count()


def screen_on_ranks(engine, outer_round: int, contributions: Sequence[bytes], base, batch, model_cfg,
                    diloco_cfg, declared_steps, *, refuse_raw: bool):
    """``screen_contributions``' reports of ``contributions`` against ``base`` for a cluster's engine
    (:class:`training.cluster_node_engine.ShardedStageEngine`): on its ranks when ``base`` is one of its kept
    states (its :class:`training.cluster_node_engine.KeptState`), else (a whole state in hand, another
    engine's handle) as one process screens it. ``batch``: the round's screening batch ``(x, y)``."""
    state_id = getattr(base, "state_id", None)
    ours = getattr(base, "engine", None) is engine and getattr(base, "which", None) == "weights"
    if state_id is None or not ours:
        decoded = [decode_full([blob], [engine.shapes], outer_round=outer_round, refuse_raw=refuse_raw)
                   for blob in contributions]
        return screen_contributions(ModelLoss(model_cfg, *batch), base, decoded, diloco_cfg, declared_steps)
    session = next(_sessions)
    usable = engine.screen_call("screen_load", session, outer_round, len(contributions), refuse_raw,
                                private=list(contributions))
    try:
        def fetch(weights: WeightSet, names: Sequence[str]) -> Mapping[str, torch.Tensor]:
            wanted = [(name, engine.plan.owner(name)) for name in names]
            return engine.screen_call("screen_tensors", session, weights, wanted)

        loss = StreamedModelLoss(model_cfg, *batch, fetch)
        screened = [Screened(index) if ok else None for index, ok in enumerate(usable)]
        return screen_contributions(loss, WeightSet(state_id), screened, diloco_cfg, declared_steps,
                                    shift=shift_on_ranks)
    finally:
        engine.screen_call("screen_drop", session)
