"""Encoder "v2": v1's candidates and bandwidth rule with cheaper arithmetic; no state across rounds.

Factorizes through the small Gram matrix (:func:`~training.codec.factorize.factorize_gram`)
and, under a byte budget, estimates every candidate's error from the factors'
rounding residuals without coding any candidate but the winner
(:meth:`V2Encoder.tensor_options`). About half v1's encoding time at the same
bytes and loss (docs/DILOCOX.md section 9).
"""

from __future__ import annotations

import functools

import math
from collections.abc import Sequence

import torch

from training.codec.base import Encoder
from training.codec.coding import (
    BalancedFactors,
    ColumnQuantizer,
    Option,
    TensorOptions,
    candidates,
    quant_coded,
)
from training.codec.factorize import Factorization, factorize_gram
from training.codec_exact import qmax
from training.config import EncoderVersion

QUANT_SAMPLE = 16384  # values per bit width the quant(b) estimates look at (whole rows)


def rounding_residuals(
    values: torch.Tensor, column_max: torch.Tensor, bits_list: Sequence[int]
) -> torch.Tensor:
    """``sum_i (v_ij - s_j round(v_ij / s_j))^2`` per column j, for ``s_j = column_max_j / qmax(b)``: (bit
    widths, columns).

    The squared error of :class:`~training.codec.coding.ColumnQuantizer` at each
    bit width, from one pass over ``values`` for all of them (``|v / s| <= qmax``,
    so no clamping), in float64 at the end. Selection only: the winner is
    quantized and decoded exactly.
    """
    limits, limits64 = _limits(tuple(bits_list))
    # A zero column divides to zeros (then rounds to no residual) whatever its positive divisor.
    safe = column_max.clamp_min(torch.finfo(torch.float32).tiny)
    scaled = (values / safe).unsqueeze(0) * limits  # v / s, in [-qmax, qmax]
    residual = scaled.sub_(torch.round(scaled))
    # (bits, columns), in units of s^2
    per_column = torch.sum(residual.mul_(residual), dim=1).to(torch.float64)
    steps = column_max.to(torch.float64).reshape(1, -1) / limits64
    return per_column * steps * steps


def clipped_residuals(quantizer: ColumnQuantizer, bits_list: Sequence[int],
                      residuals: torch.Tensor) -> torch.Tensor:
    """``residuals`` (bit widths, columns; :func:`rounding_residuals`) with each width the clipped search of
    ``quantizer`` measured replaced by its exact per-column squared errors (``compression.quant_scale =
    "mse"``; the same tensor otherwise)."""
    rows = []
    for index, bits in enumerate(bits_list):
        errors = quantizer.column_errors(bits)
        rows.append(residuals[index] if errors is None else errors.to(torch.float64))
    return torch.stack(rows) if any(quantizer.column_errors(b) is not None for b in bits_list) else residuals


_LIMITS: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}


def _limits(bits_list: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """``qmax(b)`` per bit width, shaped (bits, 1, 1) in float32 and (bits, 1) in float64 (cached; never
    modified)."""
    if bits_list not in _LIMITS:
        values = [float(qmax(bits)) for bits in bits_list]
        _LIMITS[bits_list] = (torch.tensor(values, dtype=torch.float32).reshape(-1, 1, 1),
                              torch.tensor(values, dtype=torch.float64).reshape(-1, 1))
    return _LIMITS[bits_list]


class V2Encoder(Encoder):
    """Encoder "v2" (module docstring)."""

    version = EncoderVersion.V2

    def factorize(self, matrix: torch.Tensor, rank: int) -> Factorization:
        return factorize_gram(matrix, rank, self.cfg.sketch)

    def tensor_options(self, matrix: torch.Tensor, shape: tuple[int, ...], norm: float) -> TensorOptions:
        """v1's candidates, estimated without coding any (only the winner is).

        ``quant(b)``: the exact rounding residual of every column (one pass for all
        bit widths; :func:`rounding_residuals`). ``lowrank(r, b)``, with ``P_k``,
        ``Q_k`` the balanced factor columns of :func:`~training.codec.factorize.factorize_gram`
        and ``E_k``, ``F_k`` their rounding residuals at b bits::

            ||X - sum_{k<r} (P_k - E_k)(Q_k - F_k)^T||^2
              ~= (||X||^2 - sum_{k<r} sigma_k^2)
                 + sum_{k<r} (|E_k|^2 |Q_k|^2 + |P_k|^2 |F_k|^2 + |E_k|^2 |F_k|^2)

        the truncation error plus each kept column's quantization error; the cross
        terms between columns (zero-mean rounding noise against orthogonal
        columns) and the 16-bit weights' rounding are left out. No product with
        ``X``: a few vector operations give every rank and bit width.
        """
        tensor_candidates = candidates(shape, self.cfg)
        clip = self.clip
        quantizer = ColumnQuantizer(matrix, clip)
        relative = (lambda square: math.sqrt(max(square, 0.0)) / norm) if norm else (lambda square: 0.0)
        quant_bits = sorted({c.bits for c in tensor_candidates if c.codec == "quant"})
        # Every ``stride``-th row: at most ~QUANT_SAMPLE values per bit width estimate the rest (scaled up).
        stride = max(1, matrix.numel() // QUANT_SAMPLE)
        sample = matrix[::stride]
        residuals = rounding_residuals(sample, quantizer.column_max, quant_bits) * (
            matrix.shape[0] / sample.shape[0]
        )
        quant_squares = torch.sum(clipped_residuals(quantizer, quant_bits, residuals), dim=1).tolist()
        estimates = {("quant", 0, bits): relative(square) for bits, square in zip(quant_bits, quant_squares)}
        lowrank = [c for c in tensor_candidates if c.codec == "lowrank"]
        raw_factors = factors = None
        if lowrank:
            top = max(c.rank for c in lowrank)
            raw_factors = factorize_gram(matrix, top, self.cfg.sketch)
            sigma = raw_factors[1]
            factors = BalancedFactors(raw_factors, top, clip)
            left, right = factors.left.matrix, factors.right.matrix
            bits_list = sorted({c.bits for c in lowrank})
            left_error = clipped_residuals(  # (bits, top)
                factors.left, bits_list, rounding_residuals(left, factors.left.column_max, bits_list))
            right_error = clipped_residuals(
                factors.right, bits_list, rounding_residuals(right, factors.right.column_max, bits_list))
            left_norm = torch.sum(left * left, dim=0).to(torch.float64)
            right_norm = torch.sum(right * right, dim=0).to(torch.float64)
            quantization = torch.cumsum(
                left_error * right_norm + left_norm * right_error + left_error * right_error, 1
            )
            truncation = (norm * norm - torch.cumsum(sigma.to(torch.float64) ** 2, 0)).clamp_min(0.0)
            squares = (truncation + quantization).tolist()  # [bit index][rank - 1]
            for candidate in lowrank:
                estimates[candidate.key] = relative(
                    squares[bits_list.index(candidate.bits)][candidate.rank - 1]
                )
        options = []
        for candidate in tensor_candidates:
            estimate = estimates[candidate.key]
            if candidate.codec == "quant":
                make = functools.partial(quant_coded, quantizer, candidate, estimate)
            else:
                make = functools.partial(factors.coded, candidate, estimate)
            options.append(Option(candidate, estimate, make))
        return TensorOptions(options, raw_factors)
