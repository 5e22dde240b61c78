"""Restoring a replica from its start state (the inverse of :mod:`training.replica_capture`): weights,
inner-optimizer state and engine state, each checked against the run's shapes first."""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from training.butterfly import slice_for_exchange
from training.config import DilocoConfig, ModelConfig, TrainingConfig
from training.config_compression import CompressionConfig
from training.errors import EngineStateError, ReplicaStateError
from training.muon import optimizer_prefixes, state_kind
from training.pipeline import LocalReplicaTrainer
from training.replica_state import ReplicaStartState, StageStartState
from training.stage_engine import StageEngine
from training.stage_engine_state import ENGINE_STATE_VERSION
from training.stages import merge_state_dicts, split_stages, stage_param_shapes


def restore_replica(
    state: ReplicaStartState,
    model_cfg: ModelConfig,
    training_cfg: TrainingConfig,
    diloco_cfg: DilocoConfig,
    compression_cfg: CompressionConfig,
    *,
    consume: bool = False,
) -> tuple[LocalReplicaTrainer, list[StageEngine]]:
    """A chained trainer and one engine per stage, in exactly the captured state.

    ``consume``: the caller hands ``state`` over (a rerun's parsed start state): the inner optimizer and the
    engines keep its float32 tensors themselves instead of copies, and each stage's tensors are dropped
    from ``state`` once restored (issue 75: the state is about 40 bytes per parameter of the replica, and
    its copies were made beside it)."""
    meta = state.meta
    specs = split_stages(model_cfg.n_layer, meta.num_stages)
    for part, spec in zip(state.stages, specs):
        _check_stage(part, stage_param_shapes(model_cfg, spec), diloco_cfg.outer_moments)
    weights = merge_state_dicts([part.group("param") for part in state.stages])
    trainer = LocalReplicaTrainer(model_cfg, training_cfg, meta.num_stages, state_dict=weights)
    del weights
    engines = []
    for part, module, optimizer in zip(state.stages, trainer.stage_modules, trainer.optimizers):
        _restore_optimizer(part, module, optimizer, adopt=consume)
        engine = StageEngine(part.stage_index, dict(module.named_parameters()), diloco_cfg, compression_cfg,
                             exact=training_cfg.codec_kernels)
        slice_for_exchange(engine, diloco_cfg)  # as the node's engines encode (node.live.worker.replica)
        last_encoded, last_applied, others_count = part.engine_counters
        _load_engine(engine, part, diloco_cfg, last_encoded, last_applied, others_count, adopt=consume)
        engines.append(engine)
        if consume and isinstance(part.tensors, dict):
            part.tensors.clear()
    return trainer, engines


def _restore_optimizer(part: StageStartState, module: nn.Module, optimizer, adopt: bool = False) -> None:
    """Put the captured inner-optimizer state of every parameter back (the run's optimizer decides which
    fields each holds, :func:`training.muon.state_kind`); any other optimizer tensor in the state is refused.
    ``adopt``: a moment already on the parameter's device is kept itself, not copied (``restore_replica``'s
    ``consume``)."""
    used = set()
    for name, param in module.named_parameters():
        prefix, names = state_kind(optimizer, param)
        fields = {f: part.tensors.get(f"{prefix}.{f}/{name}") for f in names}
        if all(value is not None for value in fields.values()):
            # The moments live with the parameter; the step count stays a CPU scalar (AdamW's own
            # choice unless capturable or fused).
            optimizer.state[param] = {f: value.clone() if f == "step" else value.to(param.device,
                                                                                   copy=not adopt)
                                      for f, value in fields.items()}
            used.update(f"{prefix}.{f}/{name}" for f in names)
        elif any(value is not None for value in fields.values()):
            raise ReplicaStateError(
                f"stage {part.stage_index} {name!r}: inner optimizer state ({prefix}) is incomplete"
            )
    stray = sorted(n for n in part.tensors if n.startswith(optimizer_prefixes()) and n not in used)
    if stray:
        raise ReplicaStateError(
            f"stage {part.stage_index} state: {stray[0]!r} is not state of the run's inner "
            "optimizer (training.optimizer)"
        )


def _load_engine(engine: StageEngine, part: StageStartState, diloco_cfg: DilocoConfig, last_encoded: int,
                 last_applied: int, others_count: int, adopt: bool = False) -> None:
    """``engine.load_state_dict`` of ``part``; a state the engine refuses (e.g. a bad encoder memo) is a
    :class:`ReplicaStateError` like any other malformed state."""
    try:
        engine.load_state_dict({
            "version": ENGINE_STATE_VERSION,
            "stage_index": part.stage_index,
            "one_step_delay": diloco_cfg.one_step_delay,
            "last_encoded": last_encoded - 1,
            "last_applied": last_applied - 1,
            "global_weights": part.group("global"),
            "momentum": part.group("momentum"),
            "error_feedback": part.group("residual"),
            "round_start": part.group("round_start"),
            "round_end": {r: part.group(f"round_end.{r}") for r in part.rounds_of("round_end")},
            "own_decoded": {r: part.group(f"own_decoded.{r}") for r in part.rounds_of("own_decoded")},
            "others_previous": None if others_count < 0 else (part.group("others_previous"), others_count),
            "sent": {r: part.group(f"sent.{r}") for r in part.rounds_of("sent")},
            "encoder_memo": _encoder_memo(part),
        }, adopt=adopt)
    except EngineStateError as exc:
        raise ReplicaStateError(f"stage {part.stage_index} state: {exc}") from None


def _encoder_memo(part: StageStartState) -> dict | None:
    """The engine's ``encoder_memo`` from the ``encoder.*`` groups (None without any): "choice" and "basis"
    always (v3's bases may be none), "estimate" when the state has it (v4)."""
    groups = {kind: part.group(f"encoder.{kind}") for kind in ("choice", "basis", "estimate")}
    if not any(groups.values()):
        return None
    if not groups["estimate"]:
        del groups["estimate"]
    return groups


def _check_stage(
    part: StageStartState, shapes: Mapping[str, tuple[int, ...]], outer_moments: int = 1
) -> None:
    """Every tensor group of ``part`` names exactly the stage's parameters, with their shapes (the
    ``momentum`` group of an outer-Adam run: both moments stacked, ``(outer_moments, *shape)``)."""
    groups: dict[str, set[str]] = {}
    for name, value in part.tensors.items():
        group, _, tensor_name = name.partition("/")
        if group.startswith("encoder.") and tensor_name in shapes:
            # Encoder "v3"'s / "v4"'s memo: its own shapes, checked when the engine loads it
            # (EncoderMemo.from_tensors).
            if group not in ("encoder.choice", "encoder.basis", "encoder.estimate"):
                raise ReplicaStateError(f"stage {part.stage_index} state: unexpected tensor {name!r}")
            groups.setdefault(group, set()).add(tensor_name)
            continue
        expected = () if group == "adam.step" else shapes.get(tensor_name)
        if group == "momentum" and expected is not None and outer_moments != 1:
            expected = (outer_moments, *expected)
        if expected is None or tuple(value.shape) != tuple(expected):
            raise ReplicaStateError(
                f"stage {part.stage_index} state: unexpected tensor {name!r} {tuple(value.shape)}"
            )
        groups.setdefault(group, set()).add(tensor_name)
    for group in ("param", "global", "momentum", "residual", "round_start"):
        if groups.get(group) != set(shapes):
            raise ReplicaStateError(
                f"stage {part.stage_index} state: group {group!r} does not hold every parameter"
            )
