"""Encoder "v1": the encoder of runs whose run document names none (``compression.encoder``).

Factorizes with the randomized range finder on ``X``
(:func:`~training.codec.factorize.factorize_range`). Under a byte budget it
estimates every candidate's error by the algebra of its coding: quant(b) is
coded and decoded exactly, lowrank(r, b) from one quantization of the top
rank's factors per bit width (:func:`lowrank_estimates`).
"""

from __future__ import annotations

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
    code_quant,
)
from training.codec.factorize import Factorization, factorize_range
from training.codec_wire import MAX_WEIGHT
from training.config import EncoderVersion


def lowrank_estimates(
    matrix: torch.Tensor,
    factors: Factorization | BalancedFactors,
    ranks: Sequence[int],
    bits: int,
    norm: float,
) -> dict[int, float]:
    """Relative error estimates of ``lowrank(r, bits)`` for every r in ``ranks``, from one quantization.

    The per-column quantization of the factors makes the rank-r integers the
    first r columns of the top rank's, so one quantization, one ``matrix @ Q``
    and two small Gram matrices give every rank's estimate of
    ``||X - A B^T||^2 = ||X||^2 - 2 <X B, A> + <A^T A, B^T B>`` (A = P w S, B = Q,
    the same algebra as :func:`~training.codec.coding.code_lowrank`, summed per
    column). Only the choice uses these numbers; the winner is then coded (and
    exactly decoded) as before. ``factors`` may be a :class:`BalancedFactors`
    already built for ``max(ranks)``.
    """
    if not isinstance(factors, BalancedFactors):
        factors = BalancedFactors(factors, max(ranks))
    p_float, p_scales, q_float, q_scales = factors.quantized(bits)
    top = max(ranks)
    p_float, p_scales, q_float, q_scales = p_float[:, :top], p_scales[:top], q_float[:, :top], q_scales[:top]
    products = (p_scales.to(torch.float64) * q_scales.to(torch.float64)).to(torch.float32)
    # Per column k: <X Q_k, P_k>, and the Gram products (P^T P)_kl (Q^T Q)_kl, in float64.
    column_cross = torch.sum((matrix @ q_float).to(torch.float64) * p_float.to(torch.float64), dim=0)
    gram = (p_float.t() @ p_float).to(torch.float64) * (q_float.t() @ q_float).to(torch.float64)
    # Every rank's S and weights at once, elementwise as ``code_lowrank`` computes them for one rank:
    # S_r = float32(max(products[:r]) / MAX_WEIGHT), w_r = clamp(round(products / S_r), 0, MAX_WEIGHT).
    prefix_max = torch.cummax(products, dim=0).values[torch.tensor(ranks) - 1]
    scales = (prefix_max / MAX_WEIGHT).to(torch.float32)
    positive = scales > 0
    weights = torch.clamp(
        torch.round(products.reshape(1, -1) / torch.where(positive, scales, 1.0).reshape(-1, 1)),
        0,
        MAX_WEIGHT,
    )
    weights = torch.where(positive.reshape(-1, 1), weights, 0.0)
    columns = (weights * scales.reshape(-1, 1)).to(torch.float64)  # row i: d of ranks[i], beyond it unused
    estimates = {}
    for index, rank in enumerate(ranks):
        d = columns[index, :rank].clone()  # A = P diag(d); a fresh vector, as the per-rank code had
        if norm == 0.0:
            empty = not torch.any(d) or not torch.any(p_float[:, :rank]) or not torch.any(q_float[:, :rank])
            estimates[rank] = 0.0 if empty else float("inf")
            continue
        cross = float(torch.dot(column_cross[:rank], d))
        square = float(d @ gram[:rank, :rank] @ d)
        estimates[rank] = math.sqrt(max(norm * norm - 2 * cross + square, 0.0)) / norm
    return estimates


class V1Encoder(Encoder):
    """Encoder "v1" (module docstring)."""

    version = EncoderVersion.V1

    def factorize(self, matrix: torch.Tensor, rank: int) -> Factorization:
        return factorize_range(matrix, rank, self.cfg.sketch)

    def tensor_options(self, matrix: torch.Tensor, shape: tuple[int, ...], norm: float) -> TensorOptions:
        """Every candidate with its estimated error (quant ones coded, low-rank ones estimated)."""
        tensor_candidates = candidates(shape, self.cfg)
        lowrank = [c for c in tensor_candidates if c.codec == "lowrank"]
        estimates: dict[tuple[int, int], float] = {}
        raw_factors = balanced = None
        if lowrank:
            top = max(c.rank for c in lowrank)
            raw_factors = self.factorize(matrix, top)
            balanced = BalancedFactors(raw_factors, top, self.clip)
            for bits in sorted({c.bits for c in lowrank}):
                ranks = sorted({c.rank for c in lowrank if c.bits == bits})
                for rank, estimate in lowrank_estimates(matrix, balanced, ranks, bits, norm).items():
                    estimates[(rank, bits)] = estimate
        quantizer = ColumnQuantizer(matrix, self.clip)
        options = []
        for candidate in tensor_candidates:
            if candidate.codec == "quant":
                coded = code_quant(matrix, candidate.bits, candidate, norm, quantizer)
                options.append(Option(candidate, coded.estimate, lambda coded=coded: coded))
            else:
                estimate = estimates[(candidate.rank, candidate.bits)]
                options.append(Option(
                    candidate, estimate,
                    lambda candidate=candidate, estimate=estimate: balanced.coded(candidate, estimate),
                ))
        return TensorOptions(options, raw_factors)
