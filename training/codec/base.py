"""The encoder protocol: what every encoder kind (``compression.encoder``) does, and what it shares.

An encoder turns a stage's pseudo-gradient into a contribution's bytes. The
wire format and the exact decoder are the same for every kind
(:mod:`training.codec_wire`); a kind only decides which coding each tensor
gets. A kind is a subclass of :class:`Encoder` in its own module
(``training/codec/v1.py`` ...), registered by version in
:mod:`training.codec.registry`; callers hold an :class:`Encoder` and never ask
which kind it is.

A kind defines two things: :meth:`Encoder.factorize` (the low-rank
factorization, :mod:`training.codec.factorize`) and
:meth:`Encoder.tensor_options` (every candidate of a tensor with its estimated
error, which the bandwidth policy allocates from). A kind that keeps state
across rounds overrides :meth:`Encoder.encode_round` (v3, v4:
:mod:`training.codec.reselect`). The rest is shared:

* :meth:`Encoder.encode_to_error_budget`: every tensor coded to
  ``compression.error_budget``. Candidates are tried in increasing byte cost;
  the first whose relative error ``||X - decode(encode(X))||_F / ||X||_F`` is
  within the budget wins. A low-rank candidate whose unquantized factorization
  already misses the budget is skipped without quantizing. If no candidate
  meets the budget, the one with the smallest error is used (the stats say so).
* :meth:`Encoder.encode_within`: the contribution fits a byte budget
  (:mod:`training.codec.allocation`); stateless.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import ClassVar

import torch

from training.codec.allocation import allocate, contribution_overhead
from training.codec.coding import (
    Candidate,
    Coded,
    ColumnQuantizer,
    Option,
    TensorOptions,
    candidates,
    code_lowrank,
    code_quant,
    rel_error,
)
from training.codec.factorize import Factorization
from training.codec.memo import EncoderMemo
from training.codec.stats import CompressionStats, TensorCodecStats
from training.codec_exact import f32_bytes
from training.codec_wire import matrix_view_shape, pack_contribution
from training.config import EncoderVersion
from training.config_base import QuantScale
from training.config_compression import CompressionConfig
from training.errors import ContributionEncodeError

logger = logging.getLogger(__name__)

#: ``(bytes, decoded tensors, stats)`` of one contribution; the decoded tensors are bit for bit what
#: :func:`training.codec_wire.decode_contribution` returns for the bytes.
Encoded = tuple[bytes, dict[str, torch.Tensor], CompressionStats]


def tensor_matrices(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The non-empty tensors as float32 matrices and their norms (refusing non-finite values)."""
    matrices, norms = {}, {}
    for name in sorted(tensors):
        value = tensors[name].detach().to(torch.float32)
        if value.numel() == 0:
            continue
        matrices[name] = value.reshape(matrix_view_shape(tuple(value.shape)))
        norms[name] = float(torch.linalg.vector_norm(matrices[name]))
        # A nan or inf element makes the norm non-finite, so a finite norm proves every element
        # finite; only a non-finite norm (possibly overflow of finite values) needs the full check.
        if not math.isfinite(norms[name]) and not bool(torch.isfinite(value).all()):
            raise ContributionEncodeError(f"{name!r}: pseudo-gradient has non-finite values")
    return matrices, norms


class Encoder(ABC):
    """One encoder kind under one compression configuration (module docstring)."""

    version: ClassVar[EncoderVersion]
    #: Whether :meth:`encode_round` carries a memo from round to round (then it is replica state).
    keeps_memo: ClassVar[bool] = False
    #: What a memo of this kind holds besides each tensor's coding
    #: (:class:`~training.codec.memo.EncoderMemo`).
    memo_bases: ClassVar[bool] = False
    memo_estimates: ClassVar[bool] = False

    def __init__(self, cfg: CompressionConfig) -> None:
        self.cfg = cfg
        # compression.quant_scale = "mse": low-bit scales clipped per column (training.codec.coding)
        self.clip = cfg.quant_scale == QuantScale.MSE

    # ------------------------------------------------------------------ what a kind defines

    @abstractmethod
    def factorize(self, matrix: torch.Tensor, rank: int) -> Factorization:
        """Top-``rank`` ``(U, sigma, V)`` of ``matrix``, deterministic."""

    @abstractmethod
    def tensor_options(self, matrix: torch.Tensor, shape: tuple[int, ...], norm: float) -> TensorOptions:
        """Every candidate of one tensor with its estimated relative error, in :func:`candidates` order."""

    # ------------------------------------------------------------------ a round of the compressor

    def encode_round(
        self, tensors: Mapping[str, torch.Tensor], budget: int, memo: EncoderMemo | None, *, stage_index: int,
        outer_round: int,
    ) -> tuple[bytes, dict[str, torch.Tensor], CompressionStats, EncoderMemo | None]:
        """One round under a byte budget: ``(bytes, decoded, stats, next memo)``.

        A kind without state codes with :meth:`encode_within` and hands the memo back as it got it.
        """
        return (*self.encode_within(tensors, budget, stage_index=stage_index, outer_round=outer_round), memo)

    def load_memo(self, state: Mapping[str, Mapping[str, torch.Tensor]],
                  shapes: Mapping[str, tuple[int, ...]]) -> EncoderMemo:
        """:meth:`EncoderMemo.to_tensors` back, checked against this kind and the stage (ValueError)."""
        return EncoderMemo.from_tensors(state, shapes, self.cfg, bases=self.memo_bases,
                                        estimates=self.memo_estimates)

    # ------------------------------------------------------------------ to an error budget

    def encode_tensor(self, name: str, tensor: torch.Tensor) -> tuple[dict, torch.Tensor, TensorCodecStats]:
        """Code one tensor to the error budget: ``(wire entry, decoded float32 tensor, stats)``.

        The decoded tensor is bit-identical to what :func:`~training.codec_wire.decode_contribution`
        returns for this entry. Candidates are screened with cheap float32
        estimates of their error; the winner's error is then measured on its exact
        decode (and the search goes on if rounding pushed it over the budget).
        """
        cfg = self.cfg
        shape = tuple(tensor.shape)
        value = tensor.detach().to(torch.float32)
        if not bool(torch.isfinite(value).all()):
            raise ContributionEncodeError(f"{name!r}: pseudo-gradient has non-finite values")
        raw_bytes = 4 * value.numel()
        header = {"n": name, "s": list(shape)}
        if not cfg.enabled or value.numel() == 0:
            entry = {**header, "c": "raw", "d": f32_bytes(value)}
            stats = TensorCodecStats(name, shape, "raw", 0, 32, raw_bytes, raw_bytes, 0.0, True)
            return entry, value.clone(), stats

        matrix = value.reshape(matrix_view_shape(shape))
        norm = float(torch.linalg.vector_norm(matrix))
        budget = cfg.error_budget
        options = candidates(shape, cfg)
        factors = None
        coded: list[Coded] = []
        quantizer = ColumnQuantizer(matrix, self.clip)

        def code(candidate: Candidate) -> Coded:
            nonlocal factors
            if candidate.codec == "quant":
                return code_quant(matrix, candidate.bits, candidate, norm, quantizer)
            if factors is None:
                factors = self.factorize(matrix, max(c.rank for c in options))
            return code_lowrank(matrix, factors, candidate, norm, self.clip)

        chosen = decoded = None
        error = float("inf")
        for candidate in options:
            if candidate.codec == "lowrank" and norm > 0:
                if factors is None:
                    factors = self.factorize(matrix, max(c.rank for c in options))
                # The unquantized rank-r factorization already misses the budget: skip.
                kept = float(torch.sum(factors[1][: candidate.rank].to(torch.float64) ** 2))
                if math.sqrt(max(norm * norm - kept, 0.0)) / norm > budget:
                    continue
            attempt = code(candidate)
            coded.append(attempt)
            if attempt.estimate <= budget:
                decoded = attempt.decode()
                error = rel_error(matrix, decoded, norm)
                if error <= budget:
                    chosen = attempt
                    break
        if chosen is None:
            # Nothing meets the budget: spend the effort to find the most accurate option.
            tried = {c.candidate.key for c in coded}
            coded.extend(code(c) for c in options if c.key not in tried)
            chosen = min(coded, key=lambda c: (c.estimate, c.candidate.cost))
            decoded = chosen.decode()
            error = rel_error(matrix, decoded, norm)
            logger.debug("%s: no codec meets error budget %.3g, best %.3g", name, budget, error)
        fields, payload = chosen.fields()
        candidate = chosen.candidate
        entry = {**header, "c": candidate.codec, **fields}
        stats = TensorCodecStats(
            name,
            shape,
            candidate.codec,
            candidate.rank,
            candidate.bits,
            raw_bytes,
            payload,
            error,
            error <= budget,
        )
        return entry, decoded.reshape(shape), stats

    def encode_to_error_budget(
        self, tensors: Mapping[str, torch.Tensor], *, stage_index: int, outer_round: int
    ) -> Encoded:
        """A stage's pseudo-gradient, every tensor coded to ``error_budget``: ``(bytes, decoded, stats)``."""
        stats = CompressionStats(outer_round=outer_round, stage_index=stage_index)
        entries = []
        decoded: dict[str, torch.Tensor] = {}
        for name in sorted(tensors):
            entry, value, tensor_stats = self.encode_tensor(name, tensors[name])
            entries.append(entry)
            decoded[name] = value
            stats.tensors.append(tensor_stats)
            stats.raw_bytes += tensor_stats.raw_bytes
        blob = pack_contribution(stage_index, outer_round, entries)
        stats.encoded_bytes = len(blob)
        return blob, decoded, stats

    # ------------------------------------------------------------------ within a byte budget

    def encode_within(
        self, tensors: Mapping[str, torch.Tensor], budget: int, *, stage_index: int, outer_round: int
    ) -> Encoded:
        """A stage's pseudo-gradient in at most ``budget`` bytes where possible: ``(bytes, decoded, stats)``.

        Stateless: a kind with a memo codes here as it codes a selection round.
        """
        matrices, norms = tensor_matrices(tensors)
        chosen, _ = self.select(tensors, matrices, norms, budget)
        return self.finish(
            tensors, matrices, norms, chosen, stage_index=stage_index, outer_round=outer_round
        )[:3]

    def select(
        self,
        tensors: Mapping[str, torch.Tensor],
        matrices: Mapping[str, torch.Tensor],
        norms: Mapping[str, float],
        budget: int,
    ) -> tuple[dict[str, Option], dict[str, TensorOptions]]:
        """``({name: chosen option}, {name: every option})`` under ``budget`` (:func:`allocate` on the
        estimates)."""
        overhead = contribution_overhead(tensors)
        found = {name: self.tensor_options(matrix, tuple(tensors[name].shape), norms[name])
                 for name, matrix in matrices.items()}
        options = {
            name: [(option.candidate.cost, (option.estimate * norms[name]) ** 2) for option in tensor.options]
            for name, tensor in found.items()
        }
        choice = allocate(options, budget - overhead)
        return {name: found[name].options[choice[name]] for name in found}, found

    def finish(
        self,
        tensors: Mapping[str, torch.Tensor],
        matrices: Mapping[str, torch.Tensor],
        norms: Mapping[str, float],
        chosen: Mapping[str, Option],
        *,
        stage_index: int,
        outer_round: int,
    ) -> tuple[bytes, dict[str, torch.Tensor], CompressionStats, dict[str, Coded]]:
        """Code the chosen options: ``(bytes, decoded, stats, {name: coded})`` (the winners' exact decode)."""
        stats = CompressionStats(outer_round=outer_round, stage_index=stage_index)
        entries, decoded, coded = [], {}, {}
        for name in sorted(tensors):
            shape = tuple(tensors[name].shape)
            if name not in chosen:  # empty tensor: the error-budget encoder's raw entry
                entry, value, tensor_stats = self.encode_tensor(name, tensors[name])
            else:
                winner = coded[name] = chosen[name].coded()
                value = winner.decode()
                error = rel_error(matrices[name], value, norms[name])
                fields, payload = winner.fields()
                candidate = winner.candidate
                entry = {"n": name, "s": list(shape), "c": candidate.codec, **fields}
                value = value.reshape(shape)
                tensor_stats = TensorCodecStats(
                    name,
                    shape,
                    candidate.codec,
                    candidate.rank,
                    candidate.bits,
                    4 * value.numel(),
                    payload,
                    error,
                    True,
                )
            entries.append(entry)
            decoded[name] = value
            stats.tensors.append(tensor_stats)
            stats.raw_bytes += tensor_stats.raw_bytes
        blob = pack_contribution(stage_index, outer_round, entries)
        stats.encoded_bytes = len(blob)
        return blob, decoded, stats, coded
