"""Adaptive compression of pseudo-gradients with error feedback (DiLoCoX, arXiv 2506.21263).

DiLoCoX's abstract names an "adaptive gradient compression scheme"; its exact
rule is not available to us, so the codec implements what the abstract
describes with choices documented in ``docs/DILOCOX.md`` section 3:
low-rank factorization plus quantization, rank and bit width chosen per tensor
and per round against an error budget or a byte budget, and error feedback
(Seide et al. 2014, Karimireddy et al. 2019; as in PowerSGD, Vogels et al.
2019) so that what a round leaves out is sent later.

This module is the codec's front door: the stage's :class:`ErrorFeedbackCompressor`
and the stateless encode functions. Which bytes are picked is the run's
encoder (``compression.encoder``; :mod:`training.codec`, one module per kind,
looked up in :mod:`training.codec.registry`); the wire format and the exact
decoder, the same for every encoder, are :mod:`training.codec_wire`.

Error feedback (per tensor, ``e_0 = 0``): ``target_t = g_t + e_{t-1}``,
``sent_t = decode(encode(target_t))``, ``e_t = target_t - sent_t``. Then
``sum_t sent_t = sum_t g_t - e_T``: the decoded contributions track the inputs up
to one bounded residual. With ``compression.error_feedback_decay = beta < 1`` the target is
``g_t + beta * e_{t-1}`` (one float32 multiply, then the add; ``beta = 1`` is the add alone, the same
bits as before the setting): a leaky accumulator (SparseLoCo, arXiv 2508.15706), whose left-out error
fades by ``beta`` a round instead of arriving whole.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch

from training.codec.base import Encoded
from training.codec.memo import EncoderMemo
from training.codec.registry import encoder_for
from training.codec.stats import CompressionStats, TensorCodecStats
from training.codec_wire import declare_steps
from training.config_compression import CompressionConfig
from training.errors import ContributionEncodeError, EngineStateError
from training.exact_codec import ExactCodec
from training.host_tensors import adopted, float32_scalar
from training.spilled import shapes_of, unheld

__all__ = [
    "CompressionStats",
    "ErrorFeedbackCompressor",
    "TensorCodecStats",
    "encode_contribution",
    "encode_with_memo",
    "encode_within_bandwidth",
    "feedback_target",
]


def feedback_target(value: torch.Tensor, residual: torch.Tensor, cfg: CompressionConfig) -> torch.Tensor:
    """``g + beta * e`` in float32 (``beta = compression.error_feedback_decay``; at 1, ``g + e`` alone)."""
    if cfg.error_feedback_decay == 1.0:
        return torch.add(value.to(torch.float32), residual)
    return torch.add(value.to(torch.float32), torch.mul(residual, float32_scalar(cfg.error_feedback_decay)))


def encode_contribution(
    tensors: Mapping[str, torch.Tensor], cfg: CompressionConfig, *, stage_index: int, outer_round: int
) -> Encoded:
    """Encode a stage's pseudo-gradient to ``cfg.error_budget``: ``(bytes, decoded tensors, stats)`` (no error
    feedback)."""
    return encoder_for(cfg).encode_to_error_budget(tensors, stage_index=stage_index, outer_round=outer_round)


def encode_within_bandwidth(
    tensors: Mapping[str, torch.Tensor],
    cfg: CompressionConfig,
    budget: int,
    *,
    stage_index: int,
    outer_round: int,
) -> Encoded:
    """Encode a stage's pseudo-gradient in at most ``budget`` bytes where possible: ``(bytes, decoded,
    stats)``.

    Same wire format and exact decode as :func:`encode_contribution`; only the
    choice of coding per tensor differs (:mod:`training.codec.allocation`).
    Stateless: encoders "v3" and "v4" code here exactly as "v2" (their state
    lives in :func:`encode_with_memo`).
    """
    return encoder_for(cfg).encode_within(tensors, budget, stage_index=stage_index, outer_round=outer_round)


def encode_with_memo(
    tensors: Mapping[str, torch.Tensor], cfg: CompressionConfig, budget: int, memo: EncoderMemo | None, *,
    stage_index: int, outer_round: int,
) -> tuple[bytes, dict[str, torch.Tensor], CompressionStats, EncoderMemo]:
    """A round of an encoder with a memo ("v3", "v4") under a byte budget: ``(bytes, decoded, stats, next
    memo)``.

    :mod:`training.codec.reselect`; an encoder that keeps no memo is refused.
    """
    encoder = encoder_for(cfg)
    if not encoder.keeps_memo:
        raise ContributionEncodeError(f"encoder {cfg.encoder!r} keeps no memo")
    return encoder.encode_round(tensors, budget, memo, stage_index=stage_index, outer_round=outer_round)


class ErrorFeedbackCompressor:
    """The run's encoder plus the error-feedback residual of one (replica, stage).

    ``compress(g_t)`` codes ``target = g_t + e_{t-1}`` and keeps
    ``e_t = target - decoded`` (module docstring). With
    ``cfg.error_feedback = False`` (or compression disabled) ``e`` stays zero.
    """

    def __init__(
        self,
        shapes: Mapping[str, tuple[int, ...]],
        cfg: CompressionConfig,
        *,
        bandwidth_budget: int | None = None,
        exact: int = 0,
    ) -> None:
        self.cfg = cfg
        # training.reproducible: encode in fixed order (training.exact_codec), the same bytes on any CPU.
        # 0 (or False): off; else the run's kernel version (TrainingConfig.codec_kernels), whose square root
        # the codec takes (True reads as version 1, the kernels of the runs made before versions).
        self.exact = int(exact)
        # Bytes per contribution (0: code to cfg.error_budget). The stage engine resolves
        # cfg.bandwidth_budget = "auto" from the round length and passes the number; without
        # that context "auto" falls back to the error budget.
        if bandwidth_budget is None:
            bandwidth_budget = cfg.bandwidth_budget if isinstance(cfg.bandwidth_budget, int) else 0
        self.bandwidth_budget = bandwidth_budget
        self.shapes = {name: tuple(shape) for name, shape in shapes.items()}
        self.residual = {name: torch.zeros(shape, dtype=torch.float32) for name, shape in self.shapes.items()}
        self.last_decoded: dict[str, torch.Tensor] = {}
        self._carry = False  # the residual holds an undelivered update (matters when feedback is off)
        # Under a byte budget, what the encoder carries between rounds ("v3", "v4":
        # training.codec.memo.EncoderMemo).
        self.encoder_memo: EncoderMemo | None = None

    @property
    def feeds_back(self) -> bool:
        """Whether the residual carries each round's coding error (compression and error feedback on)."""
        return bool(self.cfg.enabled and self.cfg.error_feedback)

    @property
    def carries(self) -> bool:
        """Whether the residual holds an undelivered update (:meth:`restore_undelivered`) not sent yet."""
        return self._carry

    def declare(self, blob: bytes, steps: int) -> bytes:
        """:meth:`compress`'s ``blob`` declaring ``steps`` inner steps (codec_wire version 2: a time-bounded
        run)."""
        return declare_steps(blob, steps)

    def compress(
        self, pseudo_gradient: Mapping[str, torch.Tensor], *, stage_index: int, outer_round: int
    ) -> tuple[bytes, CompressionStats]:
        if set(pseudo_gradient) != set(self.shapes):
            raise ContributionEncodeError("pseudo-gradient names differ from the stage's tensors")
        use_feedback = self.cfg.enabled and self.cfg.error_feedback
        carry = use_feedback or self._carry
        # An undelivered update carried without feedback (restore_undelivered) is added whole, never decayed.
        target = {
            name: (feedback_target(value, self.residual[name], self.cfg) if use_feedback
                   else torch.add(value.to(torch.float32), self.residual[name])) if carry else value
            for name, value in pseudo_gradient.items()
        }
        with ExactCodec(self.exact) if self.exact else contextlib.nullcontext():
            blob, decoded, stats = self._encode(target, stage_index, outer_round)
        if use_feedback:
            if not isinstance(self.residual, dict):  # kept in a file (training/stage_engine_outer.py): read
                self.residual = dict.fromkeys(self.residual)  # into the target above, replaced whole here
            for name in self.residual:
                self.residual[name] = torch.sub(target[name].to(torch.float32), decoded[name])
        elif self._carry:
            self.residual = {
                name: torch.zeros(shape, dtype=torch.float32) for name, shape in self.shapes.items()
            }
        self._carry = False
        self.last_decoded = decoded  # what every receiver will decode from ``blob``
        return blob, stats

    def _encode(self, target, stage_index: int, outer_round: int):
        encoder = encoder_for(self.cfg)
        if self.cfg.enabled and self.bandwidth_budget > 0:
            blob, decoded, stats, self.encoder_memo = encoder.encode_round(
                target,
                self.bandwidth_budget,
                self.encoder_memo,
                stage_index=stage_index,
                outer_round=outer_round,
            )
            return blob, decoded, stats
        return encoder.encode_to_error_budget(target, stage_index=stage_index, outer_round=outer_round)

    def restore_undelivered(self, sent: Mapping[str, torch.Tensor]) -> None:
        """Put a transmitted update that was never aggregated back into the residual.

        ``sent`` is the decoded contribution of a round that was dropped (a
        straggler's late contribution): ``e <- e + sent``, so the next
        :meth:`compress` sends it again (with error feedback off, that one next
        contribution still carries it). Then ``sum(aggregated sent) = sum(g) - e``
        holds again over the rounds that were aggregated.
        """
        if set(sent) != set(self.shapes):
            raise ContributionEncodeError("undelivered update names differ from the stage's tensors")
        for name, shape in shapes_of(sent).items():  # a spilled update's shapes, its tensors not read twice
            if shape != self.shapes[name]:
                raise ContributionEncodeError(f"undelivered {name!r}: shape {shape} != {self.shapes[name]}")
        if not isinstance(self.residual, dict):  # in a file or zeros (training/stage_engine_outer.py)
            self.residual = dict(self.residual.items())
        for name, value in sent.items():
            self.residual[name] = torch.add(self.residual[name], value.to(torch.float32))
        self._carry = True

    def reset_feedback(self) -> None:
        """Zero the residual and forget any undelivered update: the feedback a fresh process starts with."""
        self.residual = {name: torch.zeros(shape, dtype=torch.float32) for name, shape in self.shapes.items()}
        self._carry = False

    def state_dict(self, *, copy: bool = True) -> dict[str, torch.Tensor]:
        """The residual (error feedback), cloned unless ``copy=False`` (:meth:`StageEngine.state_dict`): then
        a residual not held in RAM (a file's, zeros) is given as it is, each tensor read when asked for."""
        if not copy and unheld(self.residual):
            return self.residual
        return {name: value.clone() if copy else value for name, value in self.residual.items()}

    def encoder_state(self) -> dict[str, dict[str, torch.Tensor]] | None:
        """The encoder's memo as tensors (:meth:`~training.codec.memo.EncoderMemo.to_tensors`), None without
        one."""
        return None if self.encoder_memo is None else self.encoder_memo.to_tensors()

    def load_encoder_state(self, state: Mapping[str, Mapping[str, torch.Tensor]] | None) -> None:
        """Restore :meth:`encoder_state` (None: no memo, the next "v3" / "v4" round selects)."""
        if state is None:
            self.encoder_memo = None
            return
        try:
            self.encoder_memo = encoder_for(self.cfg).load_memo(state, self.shapes)
        except (ValueError, TypeError, AttributeError) as exc:
            raise EngineStateError(f"encoder memo: {exc}") from None

    def load_state_dict(self, state: Mapping[str, torch.Tensor], *, adopt: bool = False) -> None:
        """Restore the residual from ``state`` (copied; ``adopt``: its float32 CPU tensors themselves, for a
        caller that hands them over, as a rerun does with a start state it parsed for it)."""
        if set(state) != set(self.shapes):
            raise EngineStateError("error-feedback state names differ from the stage's tensors")
        for name, value in state.items():
            if tuple(value.shape) != self.shapes[name]:
                raise EngineStateError(
                    f"error-feedback {name!r}: shape {tuple(value.shape)} != {self.shapes[name]}"
                )
        self.residual = {name: adopted(value) if adopt else value.detach().to(torch.float32).clone()
                         for name, value in state.items()}
        self._carry = any(bool(torch.any(value)) for value in self.residual.values())
