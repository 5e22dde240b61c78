"""The checkpoint state of a :class:`~training.stage_engine.StageEngine`: what it saves and how it is checked
when restored."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from training.diloco import outer_state_shape
from training.errors import EngineStateError
from training.host_tensors import Weights, adopted, host_float32_copy
from training.spilled import unheld

ENGINE_STATE_VERSION = 1


def _as_held(weights: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """``weights`` as the engine holds them, not copied: a spilled snapshot or outer state stays in its file
    (read a tensor at a time by whoever reads it), any other mapping a dict of its tensors."""
    return weights if unheld(weights) else dict(weights)


class EngineState:
    """The :class:`~training.stage_engine.StageEngine` methods that save and restore its state (a mixin)."""

    def state_dict(self, *, copy: bool = True) -> dict:
        """Global weights, momentum, error feedback, local snapshots and round counters (cloned).

        ``copy=False``: the engine's own host tensors, not copies, for a caller that is done with them
        before the engine changes next (serialising a start state on the spot: a copy of gigabytes saved).
        """
        snap = host_float32_copy if copy else _as_held
        return {
            "version": ENGINE_STATE_VERSION,
            "stage_index": self.stage_index,
            "one_step_delay": self.delayed,
            "last_encoded": self.last_encoded,
            "last_applied": self.last_applied,
            "global_weights": snap(self.global_weights),
            "momentum": snap(self.momentum),
            "error_feedback": self.compressor.state_dict(copy=copy),
            "round_start": snap(self._round_start),
            "round_end": {int(r): snap(weights) for r, weights in self._round_end.items()},
            "own_decoded": {int(r): snap(weights) for r, weights in self._own_decoded.items()},
            "others_previous": None if self._others_previous is None else (
                snap(self._others_previous[0]), self._others_previous[1]
            ),
            "sent": {int(r): snap(weights) for r, weights in self._sent.items()},
            # Encoders "v3", "v4" only (None otherwise): last round's codings (v3: and bases).
            "encoder_memo": self.compressor.encoder_state(),
        }

    def load_state_dict(self, state: Mapping, *, adopt: bool = False) -> None:
        """Restore :meth:`state_dict`; the live params are the trainer's to restore. ``adopt``: keep the
        state's float32 CPU tensors themselves rather than copies (the caller hands them over: a rerun's
        parsed start state, 40 bytes per parameter of the replica, would otherwise sit beside the copies).
        """
        try:
            if state["version"] != ENGINE_STATE_VERSION:
                raise EngineStateError(
                    f"engine state version {state['version']}, expected {ENGINE_STATE_VERSION}"
                )
            if state["stage_index"] != self.stage_index:
                raise EngineStateError(
                    f"engine state is for stage {state['stage_index']}, not {self.stage_index}"
                )
            if bool(state["one_step_delay"]) != self.delayed:
                raise EngineStateError("engine state was saved with a different diloco.one_step_delay")
            last_encoded, last_applied = int(state["last_encoded"]), int(state["last_applied"])
            round_end = {int(r): self._checked(f"round_end[{r}]", s, adopt)
                         for r, s in state["round_end"].items()}
            if sorted(round_end) != list(range(last_applied + 1, last_encoded + 1)):
                raise EngineStateError(
                    "engine state: pending round snapshots do not match the round counters"
                )
            global_weights = self._checked("global_weights", state["global_weights"], adopt)
            momentum = self._checked("momentum", state["momentum"], adopt)
            round_start = self._checked("round_start", state["round_start"], adopt)
            # "eager" state (absent in states saved before it existed: lookahead for one round).
            own_decoded = {
                int(r): self._checked(f"own_decoded[{r}]", s, adopt)
                for r, s in state.get("own_decoded", {}).items()
            }
            others = state.get("others_previous")
            others_previous = (
                None if others is None
                else (self._checked("others_previous", others[0], adopt), int(others[1]))
            )
            sent = {int(r): self._checked(f"sent[{r}]", s, adopt) for r, s in state.get("sent", {}).items()}
            self.compressor.load_state_dict(state["error_feedback"], adopt=adopt)
            self.compressor.load_encoder_state(state.get("encoder_memo"))
        except (KeyError, TypeError, AttributeError) as exc:
            raise EngineStateError(f"engine state is malformed: {type(exc).__name__}: {exc}") from None
        self.global_weights, self.momentum, self._round_start = global_weights, momentum, round_start
        self._round_end = round_end
        self._own_decoded, self._others_previous, self._sent = own_decoded, others_previous, sent
        self.last_encoded, self.last_applied = last_encoded, last_applied
        self._own_blob = {}
        self._park_snapshots()  # an engine keeping its outer state on disk: the restored state goes there
        self._park_residual()

    def _checked(self, what: str, weights: Mapping[str, torch.Tensor], adopt: bool = False) -> Weights:
        if set(weights) != set(self.shapes):
            raise EngineStateError(
                f"engine state {what}: tensor names differ from stage {self.stage_index}'s"
            )
        for name, value in weights.items():
            # The outer state of outer Adam holds two moments per weight (training.diloco.outer_state_shape).
            shape = (
                outer_state_shape(self.diloco_cfg, self.shapes[name])
                if what == "momentum"
                else self.shapes[name]
            )
            if tuple(value.shape) != shape:
                raise EngineStateError(
                    f"engine state {what}[{name!r}]: shape {tuple(value.shape)} != {shape}"
                )
        if adopt:
            return {name: adopted(value) for name, value in weights.items()}
        return host_float32_copy(weights)
