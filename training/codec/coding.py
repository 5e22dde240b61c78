"""The codings every encoder chooses from, and how one is made: shared by all encoder kinds.

Per tensor ``X`` (float32; a tensor of ndim >= 2 is viewed as the matrix
``m x n`` with ``m = shape[0]``, ``n = prod(shape[1:])``), the candidates are

* ``quant(b)``: ``X ~= Xq * s[None, :]`` with per-column scales
  ``s_j = max_i |X_ij| / qmax_b``, ``qmax_b = 2**(b-1) - 1`` and
  ``Xq = clamp(round(X / s), -qmax_b, qmax_b)`` (a 1-D tensor is one column).
  Cost ``ceil(m*n*b/8) + 4*n`` bytes.
* ``lowrank(r, b)`` (only for ndim >= 2 and numel >= ``min_compress_numel``):
  rank-r factorization ``X ~= U_r diag(sigma_r) V_r^T`` (the encoder's own
  factorization, :mod:`training.codec.factorize`), balanced factors
  ``P = U_r sqrt(sigma_r)``, ``Q = V_r sqrt(sigma_r)``, each quantized to b
  bits with per-column scales ``a_k = max|P[:,k]| / qmax_b``,
  ``c_k = max|Q[:,k]| / qmax_b``. The column scale products ``a_k c_k`` are
  stored as one float32 ``S = max_k(a_k c_k) / 65535`` and 16-bit integer
  weights ``w_k = round(a_k c_k / S)``, which makes the decode a pure integer
  matrix product (:mod:`training.codec_wire`). Cost
  ``ceil(m*r*b/8) + ceil(n*r*b/8) + 2*r + 4`` bytes.
* ``raw``: float32 values, used only when compression is disabled.

A :class:`Coded` holds a candidate's integers and scales; its :meth:`Coded.decode`
is the wire decoder's output, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from training.codec.factorize import Factorization
from training.codec_exact import f32_bytes, pack_ints, qmax, reconstruct_lowrank, reconstruct_quant
from training.codec_wire import MAX_RANK, MAX_WEIGHT, matrix_view_shape
from training.config_compression import CompressionConfig

# ----------------------------------------------------------------------------- quantization


#: ``compression.quant_scale = "mse"``: the fractions of a column's largest magnitude tried as the value that
#: maps to ``qmax`` (the rest is clamped), at ``CLIPPED_BITS`` or fewer bits; 1.0 is the "max" scale.
CLIP_FRACTIONS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.42, 0.35, 0.3, 0.25, 0.2)
#: The widths the "mse" scale searches; wider ones round finely enough that clipping gains little.
CLIPPED_BITS = 4


def quantize_columns(matrix: torch.Tensor, bits: int,
                     clip: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-column quantization: (int64 values, float32 scales)."""
    q_float, scales = ColumnQuantizer(matrix, clip).quantize(bits)
    return q_float.to(torch.int64), scales


class ColumnQuantizer:
    """:func:`quantize_columns` of one matrix at several bit widths, sharing the column maxima.

    ``quantize(bits)`` returns the integers as float32 (integer-valued, the
    same numbers the int64 form holds): the error estimates and the decode use
    them as floats, and only the winner's are packed.

    ``clip`` (``compression.quant_scale = "mse"``): at ``CLIPPED_BITS`` or fewer bits each column's scale is
    ``c_j * f_j / qmax_b`` with ``f_j`` the fraction of ``CLIP_FRACTIONS`` whose decode has the smallest
    squared error in that column (the first on a tie); values beyond ``c_j f_j`` clamp to ``+-qmax_b``. The
    wire format and the decoder are unchanged (a scale is any finite non-negative float32): only which
    integers and scales the encoder writes. At 2 bits (``{-1, 0, 1}``) the "max" scale rounds every value
    below half the column's largest to 0; a Gaussian column of 256 is then coded with about 0.8 relative
    error, with the clipped scale about 0.44.
    """

    def __init__(self, matrix: torch.Tensor, clip: bool = False) -> None:
        self.matrix = matrix
        self.column_max = matrix.abs().amax(dim=0)
        self.clip = clip
        self._clipped: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def column_limit(self, bits: int) -> torch.Tensor:
        """Per column, the magnitude coded as ``qmax(bits)``: the column maxima, or their clipped fraction."""
        if not self.clip or bits > CLIPPED_BITS:
            return self.column_max
        return self._search(bits)[0]

    def column_errors(self, bits: int) -> torch.Tensor | None:
        """Per column, its squared error (float32) where the clipped search measured it; else None."""
        if not self.clip or bits > CLIPPED_BITS:
            return None
        return self._search(bits)[1]

    def quantize(self, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._round(self.column_limit(bits), bits)

    def _round(self, column_limit: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
        limit = qmax(bits)
        scales = column_limit / limit
        # A zero column has scale 0; dividing it by any positive number keeps it 0.
        safe = scales.clamp_min(torch.finfo(torch.float32).tiny)
        # + 0.0 turns round()'s -0.0 (from small negatives) into the +0.0 an int64 0 converts to.
        q_float = torch.clamp(torch.round(self.matrix / safe), -limit, limit).add_(0.0)
        return q_float, scales.to(torch.float32)

    def _search(self, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(column limits, squared errors)`` of the best fraction per column (elementwise float32 and one
        sum per column: a fixed tree under training.exact_codec).

        Each fraction's error is computed in one work array, written in place (``out=``): the same IEEE
        operations on the same values as ``_round`` then ``matrix - reconstruct_quant(...)``, squared and
        summed over the same layout, so the same bits, without the six whole-matrix temporaries per
        fraction (fresh pages to fault in and zero, at 12 passes over the stage per bit width). The
        ``+ 0.0`` that ``_round`` adds for the packed integers is left out: a ``-0.0`` integer decodes to a
        signed zero whose difference from any value squares to the same number.
        """
        if bits not in self._clipped:
            limit = qmax(bits)
            tiny = torch.finfo(torch.float32).tiny
            best_limit = best_error = work = None
            for fraction in CLIP_FRACTIONS:
                column_limit = self.column_max * fraction
                scales = column_limit / limit
                safe = scales.clamp_min(tiny)
                if work is None:  # the layout the whole-matrix operations give (the sum's order follows it)
                    work = torch.div(self.matrix, safe)
                else:
                    torch.div(self.matrix, safe, out=work)
                torch.round(work, out=work)
                torch.clamp(work, -limit, limit, out=work)
                torch.mul(work, scales.reshape(1, -1), out=work)
                torch.sub(self.matrix, work, out=work)
                torch.mul(work, work, out=work)
                error = torch.sum(work, dim=0)
                if best_limit is None:
                    best_limit, best_error = column_limit, error
                    continue
                better = error < best_error
                best_limit = torch.where(better, column_limit, best_limit)
                best_error = torch.where(better, error, best_error)
            self._clipped[bits] = (best_limit, best_error)
        return self._clipped[bits]


# ----------------------------------------------------------------------------- candidates


@dataclass(frozen=True)
class Candidate:
    """One coding of a tensor: ``codec`` "quant" or "lowrank", its rank (0 for quant), bits and byte cost."""

    codec: str
    rank: int
    bits: int
    cost: int

    @property
    def key(self) -> tuple[str, int, int]:
        """``(codec, rank, bits)``: the coding without its cost (what an encoder's memo keeps)."""
        return self.codec, self.rank, self.bits


def rank_candidates(m: int, n: int, max_rank: int) -> list[int]:
    top = min(max_rank, MAX_RANK, m, n)
    ranks = {r for r in (1, 2, 4, 8, 16, 32, 64) if r <= top}
    ranks.add(top)
    return sorted(ranks)


_CANDIDATES: dict[tuple, tuple[Candidate, ...]] = {}


def candidates(shape: tuple[int, ...], cfg: CompressionConfig) -> list[Candidate]:
    """Every coding of a tensor of ``shape`` under ``cfg``, cheapest first (a fresh list; the entries are
    shared)."""
    key = (tuple(shape), tuple(cfg.bit_choices), cfg.max_rank, cfg.min_compress_numel)
    if key not in _CANDIDATES:
        if len(_CANDIDATES) >= 256:
            _CANDIDATES.clear()
        _CANDIDATES[key] = tuple(_list_candidates(shape, cfg))
    return list(_CANDIDATES[key])


def _list_candidates(shape: tuple[int, ...], cfg: CompressionConfig) -> list[Candidate]:
    m, n = matrix_view_shape(shape)
    out = [Candidate("quant", 0, b, (m * n * b + 7) // 8 + 4 * n) for b in cfg.bit_choices]
    if len(shape) >= 2 and math.prod(shape) >= cfg.min_compress_numel:
        for rank in rank_candidates(m, n, cfg.max_rank):
            for b in cfg.bit_choices:
                cost = (m * rank * b + 7) // 8 + (n * rank * b + 7) // 8 + 2 * rank + 4
                out.append(Candidate("lowrank", rank, b, cost))
    # Cheapest first; ties: quant before lowrank, then fewer bits, lower rank.
    return sorted(out, key=lambda c: (c.cost, c.codec != "quant", c.bits, c.rank))


def lookup(shape: tuple[int, ...], cfg: CompressionConfig, key: tuple[str, int, int]) -> Candidate | None:
    """The candidate ``(codec, rank, bits)`` of a tensor of ``shape``, None if ``cfg`` has no such coding."""
    return next((c for c in candidates(shape, cfg) if c.key == key), None)


# ----------------------------------------------------------------------------- coded candidates


@dataclass
class Coded:
    """A quantized candidate: the integers and scales that would go on the wire."""

    candidate: Candidate
    # quant: (Xq,); lowrank: (P_int, Q_int, w); int64, or integer-valued float32
    ints: tuple[torch.Tensor, ...]
    scale: torch.Tensor  # quant: per-column scales; lowrank: S (0-d)
    estimate: float  # relative error from float32 algebra (selection only)

    def decode(self) -> torch.Tensor:
        """The exact decoder's output (bit-identical to decode_contribution)."""
        if self.candidate.codec == "quant":
            return reconstruct_quant(self.ints[0], self.scale)
        # |P|, |Q| <= qmax and w <= MAX_WEIGHT by construction: a bound below 2**53 for every
        # width and rank <= MAX_RANK, so the decoder's exact float64 path, without measuring it.
        bound = qmax(self.candidate.bits) ** 2 * MAX_WEIGHT * self.candidate.rank
        return reconstruct_lowrank(*self.ints, self.scale, bound=bound)

    def fields(self) -> tuple[dict, int]:
        """``(wire fields of the entry, payload bytes)``."""
        bits = self.candidate.bits
        if self.candidate.codec == "quant":
            out = {"b": bits, "q": pack_ints(self.ints[0], bits), "x": f32_bytes(self.scale)}
            return out, len(out["q"]) + len(out["x"])
        p_int, q_int, weights = self.ints
        out = {
            "b": bits,
            "r": self.candidate.rank,
            "p": pack_ints(p_int, bits),
            "q": pack_ints(q_int, bits),
            "w": weights.numpy().astype("<u2").tobytes(),
            "x": f32_bytes(self.scale.reshape(1)),
        }
        return out, len(out["p"]) + len(out["q"]) + len(out["w"]) + 4


def rel_error(matrix: torch.Tensor, decoded: torch.Tensor, norm: float) -> float:
    """``||matrix - decoded||_F / norm`` (0 for a zero matrix decoded to zeros, else inf)."""
    if norm == 0.0:
        return 0.0 if not torch.any(decoded) else float("inf")
    return float(torch.linalg.vector_norm(matrix - decoded)) / norm


def code_quant(
    matrix: torch.Tensor,
    bits: int,
    candidate: Candidate,
    norm: float,
    quantizer: ColumnQuantizer | None = None,
) -> Coded:
    """``quant(bits)`` of ``matrix``, its estimate the relative error of its exact decode."""
    q_float, scales = (quantizer or ColumnQuantizer(matrix)).quantize(bits)
    return Coded(candidate, (q_float,), scales, rel_error(matrix, reconstruct_quant(q_float, scales), norm))


def quant_coded(quantizer: ColumnQuantizer, candidate: Candidate, estimate: float) -> Coded:
    """``quant(b)`` coded as :func:`code_quant` codes it, without decoding it for an estimate."""
    q_float, scales = quantizer.quantize(candidate.bits)
    return Coded(candidate, (q_float,), scales, estimate)


def code_lowrank(matrix: torch.Tensor, factors: Factorization, candidate: Candidate, norm: float,
                 clip: bool = False) -> Coded:
    """``lowrank(r, b)`` of ``matrix`` from its factorization, with a float32 estimate of its error (``clip``:
    the factors' scales as :class:`ColumnQuantizer` clips them)."""
    u, sigma, v = factors
    rank, bits = candidate.rank, candidate.bits
    root = torch.sqrt(sigma[:rank])
    p_int, p_scales = quantize_columns(u[:, :rank] * root, bits, clip)
    q_int, q_scales = quantize_columns(v[:, :rank] * root, bits, clip)
    products = (p_scales.to(torch.float64) * q_scales.to(torch.float64)).to(torch.float32)
    scale = (products.max() / MAX_WEIGHT).to(torch.float32).reshape(())
    if scale > 0:
        weights = torch.clamp(torch.round(products / scale), 0, MAX_WEIGHT).to(torch.int64)
    else:
        weights = torch.zeros(rank, dtype=torch.int64)
    # ||X - A B^T||^2 = ||X||^2 - 2 <X B, A> + <A^T A, B^T B> with A = P*w*S, B = Q (float32
    # BLAS, cheap); the exact integer decode is only run for the candidate that wins.
    a = p_int.to(torch.float32) * (weights.to(torch.float32) * scale)
    b = q_int.to(torch.float32)
    if norm == 0.0:
        estimate = (
            0.0 if not torch.any(weights) or not torch.any(p_int) or not torch.any(q_int) else float("inf")
        )
    else:
        cross = float(torch.sum((matrix @ b).to(torch.float64) * a.to(torch.float64)))
        gram = float(torch.sum((a.t() @ a).to(torch.float64) * (b.t() @ b).to(torch.float64)))
        estimate = math.sqrt(max(norm * norm - 2 * cross + gram, 0.0)) / norm
    return Coded(candidate, (p_int, q_int, weights), scale, estimate)


class BalancedFactors:
    """The balanced factors ``P = U sqrt(sigma)``, ``Q = V sqrt(sigma)`` of the top rank, quantized per bit
    width.

    Quantization is per column, so the rank-r integers and scales are the first
    r columns of the top rank's: what :func:`code_lowrank` computes for rank r,
    value for value. The column maxima are shared by every bit width (``clip``: :class:`ColumnQuantizer`'s,
    also per column, so the same holds).
    """

    def __init__(self, factors: Factorization, top: int, clip: bool = False) -> None:
        u, sigma, v = factors
        root = torch.sqrt(sigma[:top])
        self.left = ColumnQuantizer(u[:, :top] * root, clip)
        self.right = ColumnQuantizer(v[:, :top] * root, clip)
        self._quantized: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def quantized(self, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(P ints, P scales, Q ints, Q scales)`` at ``bits`` (integer-valued float32)."""
        if bits not in self._quantized:
            self._quantized[bits] = (*self.left.quantize(bits), *self.right.quantize(bits))
        return self._quantized[bits]

    def coded(self, candidate: Candidate, estimate: float) -> Coded:
        """The rank-r coding, as :func:`code_lowrank` makes it (same integers, weights and scale)."""
        rank = candidate.rank
        p_float, p_scales, q_float, q_scales = self.quantized(candidate.bits)
        products = (p_scales[:rank].to(torch.float64) * q_scales[:rank].to(torch.float64)).to(torch.float32)
        scale = (products.max() / MAX_WEIGHT).to(torch.float32).reshape(())
        if scale > 0:
            weights = torch.clamp(torch.round(products / scale), 0, MAX_WEIGHT).to(torch.int64)
        else:
            weights = torch.zeros(rank, dtype=torch.int64)
        return Coded(candidate, (p_float[:, :rank], q_float[:, :rank], weights), scale, estimate)


class Option:
    """A candidate coding with its estimated relative error; ``coded()`` quantizes it (only the winner's is
    needed)."""

    def __init__(self, candidate: Candidate, estimate: float, make: Callable[[], Coded]) -> None:
        self.candidate, self.estimate, self._make, self._coded = candidate, estimate, make, None

    def coded(self) -> Coded:
        if self._coded is None:
            self._coded = self._make()
        return self._coded


@dataclass
class TensorOptions:
    """Every candidate of one tensor with its estimate (candidate order), and the factorization they came
    from."""

    options: list[Option]
    factors: Factorization | None  # the top rank's (U, sigma, V); None without a low-rank candidate
