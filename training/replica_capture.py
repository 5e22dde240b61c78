"""Capturing a replica's start state from the live objects, and round 0's from the configuration alone
(the format and its hash: :mod:`training.replica_state`)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from training.butterfly import slice_for_exchange
from training.config import DilocoConfig, ModelConfig, TrainingConfig
from training.config_compression import CompressionConfig
from training.errors import ReplicaStateError
from training.host_tensors import host_float32, host_float32_copy
from training.muon import state_kind
from training.pipeline import LocalReplicaTrainer
from training.replica_state import ReplicaStartState, RoundMeta, StageStartState
from training.spilled import ChainedTensors, MergedTensors, SpilledTensors, spill_float32, unheld
from training.stage_engine import StageEngine

logger = logging.getLogger(__name__)


def capture_stage_state(
    meta: RoundMeta, engine: StageEngine, module: nn.Module, optimizer: torch.optim.Optimizer, *,
    copy: bool = True,
) -> StageStartState:
    """The start state of ``engine.stage_index`` from the live objects (call before the round's first inner
    step).

    ``module`` and ``optimizer``: the stage's module and inner AdamW (a
    :class:`~training.pipeline.LocalReplicaTrainer`'s ``stage_modules[s]`` and
    ``optimizers[s]``, or a ``PipelineStageTrainer``'s ``module`` and ``optimizer``).
    Everything is copied: training on afterwards does not change the capture. ``copy=False``: the live
    tensors themselves (float32 CPU ones; others are converted), for a caller that only hashes or writes
    the state before anything changes (a rerun's next state: 40 bytes per parameter of copies saved).
    """
    if not copy:
        live = {n: host_float32(t) for n, t in _live_trainer_tensors(module, optimizer).items()}
        return _engine_part(meta, engine, live, copy=False)
    return capture_engine_part(meta, engine, capture_trainer_part(module, optimizer))


def capture_trainer_part(module: nn.Module, optimizer: torch.optim.Optimizer,
                         spill_dir: Path | None = None) -> Mapping[str, torch.Tensor]:
    """The part of :func:`capture_stage_state` the inner steps change (weights, AdamW state), copied.

    Take it before the round's first inner step; :func:`capture_engine_part` may follow later
    (on another thread), as long as the engine has not changed in between. With ``spill_dir`` the copies
    go to a file there instead of RAM (:mod:`training.spilled`: three times the stage's weights, held until
    the start state is written), each read back when the state is written; where the file cannot be
    written (a full disk) they stay in RAM, with a warning.
    """
    live = _live_trainer_tensors(module, optimizer)
    # float32 CPU copies whatever the device: the state's bytes are the host's (docs/GPU.md).
    if spill_dir is not None:
        try:
            return spill_float32(live, spill_dir)
        except OSError as exc:
            logger.warning("start state's weights and optimizer state kept in RAM: not written to %s (%s)",
                           spill_dir, exc)
    return host_float32_copy(live)


def _live_trainer_tensors(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The weights and the inner optimizer's state by their start-state names: the live tensors."""
    live: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters():
        live[f"param/{name}"] = param
        state = optimizer.state.get(param, {})
        prefix, fields = state_kind(optimizer, param)
        if state and set(state) != set(fields):
            raise ReplicaStateError(f"{name!r}: inner optimizer state has fields {sorted(state)}, expected "
                                    f"{sorted(fields)} ({prefix})")
        for field_name, value in state.items():
            live[f"{prefix}.{field_name}/{name}"] = torch.as_tensor(value)
    return live


def capture_engine_part(
    meta: RoundMeta, engine: StageEngine, trainer_part: Mapping[str, torch.Tensor]
) -> StageStartState:
    """:func:`capture_stage_state` from its trainer part and the engine's current state (copied)."""
    return _engine_part(meta, engine, trainer_part, copy=True)


def start_state_bytes(meta: RoundMeta, engine: StageEngine,
                      trainer_part: Mapping[str, torch.Tensor]) -> bytes:
    """``capture_engine_part(...).to_bytes()`` without copying the engine's tensors first: the engine must
    not change until this returns (the node serialises a start state before the next encode or apply)."""
    return _engine_part(meta, engine, trainer_part, copy=False).to_bytes()


def write_start_state(meta: RoundMeta, engine: StageEngine, trainer_part: Mapping[str, torch.Tensor],
                      path: Path) -> bytes:
    """:func:`start_state_bytes` written to the file ``path`` as they are made, returning their sha256: the
    same bytes, never held whole in memory (a stage's start state is about 40 bytes per parameter it holds).
    The engine must not change until this returns, as for :func:`start_state_bytes`."""
    state = _engine_part(meta, engine, trainer_part, copy=False)
    try:
        with open(path, "wb") as out:
            return state.write_to(out)
    except BaseException:
        path.unlink(missing_ok=True)  # a full disk: no partial state left behind
        raise


class StartStateCapture:
    """A round's start states, captured in two parts: the copies of what the inner steps change (taken when
    this is made), and the engines' state, added when it is called (bytes per stage, as
    :func:`start_state_bytes`) or written (:meth:`write`: files, as :func:`write_start_state`). Either runs
    once, before the engines change and after the previous encode finished; ``engine_of(stage)`` reads
    the stage's engine then."""

    def __init__(self, meta: RoundMeta, engine_of: Callable[[int], StageEngine],
                 parts: dict[int, Mapping[str, torch.Tensor]]) -> None:
        self.meta, self.engine_of, self.parts = meta, engine_of, parts

    def __call__(self) -> dict[int, bytes]:
        return {stage: start_state_bytes(self.meta, self.engine_of(stage), part)
                for stage, part in self.parts.items()}

    def hashes(self) -> dict[int, bytes]:
        """Stage -> the sha256 of the bytes :meth:`write` would write, computed without writing or holding
        them (a node that keeps this round's state by its hash alone and rebuilds it when asked:
        node/live/checks/staterebuild.py)."""
        return {stage: _engine_part(self.meta, self.engine_of(stage), part, copy=False).state_hash()
                for stage, part in self.parts.items()}

    def streams(self) -> dict[int, Callable[[], Iterator[tuple[bytes | memoryview, bool]]]]:
        """Stage -> a function giving its start state's bytes in order as ``(bytes, is a tensor's data)``
        (:meth:`StageStartState.parts`): what a store keeping the tensors' data as shared pieces writes
        from, with no file of the whole state (issue 75); each call reads the engine again (a write retried
        after a full disk), so all must run before the engines change, as :meth:`write`."""
        return {stage: functools.partial(self._parts, stage) for stage in self.parts}

    def _parts(self, stage: int) -> Iterator[tuple[bytes | memoryview, bool]]:
        return _engine_part(self.meta, self.engine_of(stage), self.parts[stage], copy=False).parts()

    def write(self, directory: Path) -> dict[int, Path]:
        """Stage -> the file in ``directory`` holding its start state's bytes (never whole in memory)."""
        directory.mkdir(parents=True, exist_ok=True)
        out = {}
        for stage, part in self.parts.items():
            path = directory / f"start-state-{self.meta.outer_round:08d}-stage{stage}.part"
            write_start_state(self.meta, self.engine_of(stage), part, path)
            out[stage] = path
        return out


def engine_state_tensors(engine_state: Mapping) -> tuple[tuple[int, int, int], Mapping[str, torch.Tensor]]:
    """``(counters, tensors)`` of a :meth:`StageEngine.state_dict` as a start state names them (the same
    tensors, not copied): the engine part's layout, which :class:`training.cluster_node_engine.
    ShardedStageEngine` builds on each rank for its shard. A spilled snapshot (the transmitted updates of an
    engine with a ``spill_dir``) stays in its file: the tensors are then a mapping that reads it when asked.
    """
    tensors: dict[str, torch.Tensor] = {}
    spilled: list[Mapping[str, torch.Tensor]] = []

    def add(prefix: str, part: Mapping[str, torch.Tensor]) -> None:
        if unheld(part):  # in a file (or zeros): read a tensor at a time when the state is written
            spilled.append(part.renamed(prefix))
        else:
            tensors.update({f"{prefix}{n}": t for n, t in part.items()})

    for group, key in (("global", "global_weights"), ("momentum", "momentum"), ("residual", "error_feedback"),
                       ("round_start", "round_start")):
        add(f"{group}/", engine_state[key])
    for kind in ("round_end", "own_decoded", "sent"):
        for outer_round, snapshot in engine_state[kind].items():
            add(f"{kind}.{int(outer_round)}/", snapshot)
    others = engine_state["others_previous"]
    if others is not None:
        tensors.update({f"others_previous/{n}": t for n, t in others[0].items()})
    memo = engine_state.get("encoder_memo")
    if memo is not None:  # encoders "v3", "v4": each tensor's coding (v3: and the low-rank ones' bases)
        for kind in ("choice", "basis", "estimate"):
            tensors.update({f"encoder.{kind}/{n}": t for n, t in memo.get(kind, {}).items()})
    counters = (int(engine_state["last_encoded"]) + 1, int(engine_state["last_applied"]) + 1,
                -1 if others is None else int(others[1]))
    # Stored +1 so that "nothing yet" (-1) is 0 and every counter is a non-negative integer.
    return counters, ChainedTensors([tensors, *spilled]) if spilled else tensors


def _engine_part(meta: RoundMeta, engine: StageEngine, trainer_part: Mapping[str, torch.Tensor], *,
                 copy: bool) -> StageStartState:
    streamed = getattr(engine, "streamed_state", None)
    if streamed is not None:  # a cluster's: each tensor fetched from the rank that holds it when written
        counters, engine_part = streamed()
    else:
        counters, tensors = engine_state_tensors(engine.state_dict(copy=copy))
        engine_part = _host_part(tensors)
    # A spilled trainer part stays in its file: each tensor is read when the state is written.
    held = trainer_part if isinstance(trainer_part, SpilledTensors) else \
        {n: t.detach().to(torch.float32).contiguous() for n, t in trainer_part.items()}
    return StageStartState(meta, engine.stage_index, counters, MergedTensors(held, engine_part))


def _host_part(tensors: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """Contiguous float32 tensors of ``tensors``; spilled parts (a :class:`ChainedTensors` of a dict and
    :class:`SpilledTensors`) stay in their files, each tensor read when the state is written."""
    if not isinstance(tensors, ChainedTensors):
        return {n: t.detach().to(torch.float32).contiguous() for n, t in tensors.items()}
    return ChainedTensors([_host_part(part) if isinstance(part, dict) else part for part in tensors.parts])


def capture_replica_state(
    meta: RoundMeta, trainer: LocalReplicaTrainer, engines: Sequence[StageEngine], *, copy: bool = True
) -> ReplicaStartState:
    """:func:`capture_stage_state` of every stage of a replica chained in one process (``copy``: as there).
    """
    return ReplicaStartState(tuple(
        capture_stage_state(meta, engine, module, optimizer, copy=copy)
        for engine, module, optimizer in zip(engines, trainer.stage_modules, trainer.optimizers)
    ))


def initial_replica_state(
    meta: RoundMeta,
    model_cfg: ModelConfig,
    training_cfg: TrainingConfig,
    diloco_cfg: DilocoConfig,
    compression_cfg: CompressionConfig,
) -> ReplicaStartState:
    """The start state of round 0, a pure function of the run's configuration (the anchor of the chain).

    Weights ``init_state_dict(model, training.seed)``, no AdamW state, zero
    residual, engines at round -1. A replica whose round-0 state hash differs
    did not start from the run's weights.
    """
    if meta.outer_round != 0:
        raise ReplicaStateError(f"the initial state is round 0's, not round {meta.outer_round}'s")
    trainer = LocalReplicaTrainer(model_cfg, training_cfg, meta.num_stages)
    engines = [StageEngine(spec.index, dict(module.named_parameters()), diloco_cfg, compression_cfg,
                           exact=training_cfg.codec_kernels)
               for spec, module in zip(trainer.specs, trainer.stage_modules)]
    for engine in engines:
        slice_for_exchange(engine, diloco_cfg)
    return capture_replica_state(meta, trainer, engines)
