"""Compression under a bandwidth budget: choose each round's coding so the contribution fits the link.

The one-step delay hides the exchange of round t behind the inner steps of
round t+1 only if it fits in that time. Given ``compression.bandwidth_budget``
(bytes one replica may send for one stage in one round, e.g. link bytes/s x
round compute seconds / peers served), the encoder no longer works to a fixed
relative error: it spends the byte budget where it removes the most error.

Per tensor ``X_j`` every candidate coding ``c`` (quant(b), lowrank(r, b); see
:mod:`training.compression`) has a cost ``bytes_j(c)`` and an error
``err_j(c) = ||X_j - decode(c)||_F^2`` (absolute, not relative: a squared error
costs the same loss wherever it sits, to first order, and error feedback
re-sends it next round). The policy solves::

    minimise  sum_j err_j(c_j)   subject to   sum_j bytes_j(c_j) + framing <= budget

greedily on each tensor's lower convex hull of ``(bytes, err)``: start every
tensor at its cheapest coding, then repeatedly take the upgrade with the largest
error removed per extra byte that still fits (the classic optimal rule for the
convex relaxation of this knapsack). If even the cheapest codings exceed the
budget they are sent anyway (the stats report the overshoot). The resulting
per-round relative errors are what a fixed ``error_budget`` would have had to
be to fit: the policy chooses the error budget per round and per tensor.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence

import torch

from training.codec_wire import MAX_WEIGHT, matrix_view_shape, pack_contribution, qmax
from training.compression import (
    CompressionStats,
    TensorCodecStats,
    _Candidate,
    _candidates,
    _code_quant,
    _Coded,
    _ColumnQuantizer,
    _factorize,
    _rel_error,
    encode_tensor,
    factorize,
)
from training.config import CompressionConfig
from training.errors import ContributionEncodeError


QUANT_SAMPLE = 16384  # encoder "v2": values per bit width its quant(b) estimates look at (whole rows)


def framing_bytes(name: str, shape: Sequence[int]) -> int:
    """Upper estimate of the msgpack bytes of one entry besides its payload (keys, name, shape, headers)."""
    return 48 + len(name.encode()) + 9 * len(shape)


def lower_hull(points: Sequence[tuple[int, float]]) -> list[int]:
    """Indices of ``points`` (cost, error) on the lower-left convex hull, by increasing cost.

    Dominated points (costlier and not more accurate) and points above the
    hull are dropped; the first index is the cheapest point (ties: smaller error).
    """
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    hull: list[int] = []
    for index in order:
        cost, error = points[index]
        if hull and error >= points[hull[-1]][1]:
            continue  # not more accurate than a cheaper point
        while len(hull) >= 2:
            (c1, e1), (c2, e2) = points[hull[-2]], points[hull[-1]]
            # Drop hull[-1] if it lies on or above the segment from hull[-2] to this point.
            if (e1 - e2) * (cost - c2) <= (e2 - error) * (c2 - c1):
                hull.pop()
            else:
                break
        hull.append(index)
    return hull


def allocate(options: Mapping[str, Sequence[tuple[int, float]]], budget: int) -> dict[str, int]:
    """Pick one option index per tensor minimising total error with total cost <= ``budget`` (greedy on hulls).

    ``options[name]`` lists ``(cost_bytes, squared_error)``. Returns
    ``{name: option index}``; every tensor gets at least its cheapest option.
    """
    hulls = {name: lower_hull(points) for name, points in options.items()}
    position = {name: 0 for name in hulls}
    spent = sum(options[name][hull[0]][0] for name, hull in hulls.items())
    heap: list[tuple[float, str]] = []

    def push(name: str) -> None:
        hull, k = hulls[name], position[name]
        if k + 1 < len(hull):
            (c0, e0), (c1, e1) = options[name][hull[k]], options[name][hull[k + 1]]
            heapq.heappush(heap, (-(e0 - e1) / max(c1 - c0, 1), name))

    for name in sorted(hulls):
        push(name)
    while heap:
        _, name = heapq.heappop(heap)
        hull, k = hulls[name], position[name]
        extra = options[name][hull[k + 1]][0] - options[name][hull[k]][0]
        if spent + extra > budget:
            continue  # this upgrade does not fit; later (steeper-cost) ones of this tensor neither
        spent += extra
        position[name] = k + 1
        push(name)
    return {name: hulls[name][position[name]] for name in hulls}


class _Option:
    """A candidate coding with its estimated relative error; ``coded()`` quantizes it (only the winner's is needed)."""

    def __init__(self, candidate, estimate: float, make) -> None:
        self.candidate, self.estimate, self._make, self._coded = candidate, estimate, make, None

    def coded(self) -> _Coded:
        if self._coded is None:
            self._coded = self._make()
        return self._coded


class _Factors:
    """The balanced factors ``P = U sqrt(sigma)``, ``Q = V sqrt(sigma)`` of the top rank, quantized per bit width.

    Quantization is per column, so the rank-r integers and scales are the first
    r columns of the top rank's: what :func:`_code_lowrank` computes for rank r,
    value for value. The column maxima are shared by every bit width.
    """

    def __init__(self, factors: tuple[torch.Tensor, torch.Tensor, torch.Tensor], top: int) -> None:
        u, sigma, v = factors
        root = torch.sqrt(sigma[:top])
        self.left = _ColumnQuantizer(u[:, :top] * root)
        self.right = _ColumnQuantizer(v[:, :top] * root)
        self._quantized: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def quantized(self, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(P ints, P scales, Q ints, Q scales)`` at ``bits`` (integer-valued float32)."""
        if bits not in self._quantized:
            self._quantized[bits] = (*self.left.quantize(bits), *self.right.quantize(bits))
        return self._quantized[bits]

    def coded(self, candidate: _Candidate, estimate: float) -> _Coded:
        """The rank-r coding, as :func:`_code_lowrank` makes it (same integers, weights and scale)."""
        rank = candidate.rank
        p_float, p_scales, q_float, q_scales = self.quantized(candidate.bits)
        products = (p_scales[:rank].to(torch.float64) * q_scales[:rank].to(torch.float64)).to(torch.float32)
        scale = (products.max() / MAX_WEIGHT).to(torch.float32).reshape(())
        if scale > 0:
            weights = torch.clamp(torch.round(products / scale), 0, MAX_WEIGHT).to(torch.int64)
        else:
            weights = torch.zeros(rank, dtype=torch.int64)
        return _Coded(candidate, (p_float[:, :rank], q_float[:, :rank], weights), scale, estimate)


def _lowrank_estimates(
    matrix: torch.Tensor, factors: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | _Factors, ranks: Sequence[int],
    bits: int, norm: float,
) -> dict[int, float]:
    """Relative error estimates of ``lowrank(r, bits)`` for every r in ``ranks``, from one quantization.

    The per-column quantization of the factors makes the rank-r integers the
    first r columns of the top rank's, so one quantization, one ``matrix @ Q``
    and two small Gram matrices give every rank's estimate of
    ``||X - A B^T||^2 = ||X||^2 - 2 <X B, A> + <A^T A, B^T B>`` (A = P w S, B = Q,
    the same algebra as ``_code_lowrank``, summed per column). Only the choice
    uses these numbers; the winner is then coded (and exactly decoded) as before.
    ``factors`` may be a :class:`_Factors` already built for ``max(ranks)``.
    """
    if not isinstance(factors, _Factors):
        factors = _Factors(factors, max(ranks))
    p_float, p_scales, q_float, q_scales = factors.quantized(bits)
    top = max(ranks)
    p_float, p_scales, q_float, q_scales = p_float[:, :top], p_scales[:top], q_float[:, :top], q_scales[:top]
    products = (p_scales.to(torch.float64) * q_scales.to(torch.float64)).to(torch.float32)
    # Per column k: <X Q_k, P_k>, and the Gram products (P^T P)_kl (Q^T Q)_kl, in float64.
    column_cross = torch.sum((matrix @ q_float).to(torch.float64) * p_float.to(torch.float64), dim=0)
    gram = (p_float.t() @ p_float).to(torch.float64) * (q_float.t() @ q_float).to(torch.float64)
    # Every rank's S and weights at once, elementwise as ``_code_lowrank`` computes them for one rank:
    # S_r = float32(max(products[:r]) / MAX_WEIGHT), w_r = clamp(round(products / S_r), 0, MAX_WEIGHT).
    prefix_max = torch.cummax(products, dim=0).values[torch.tensor(ranks) - 1]
    scales = (prefix_max / MAX_WEIGHT).to(torch.float32)
    positive = scales > 0
    weights = torch.clamp(torch.round(products.reshape(1, -1) / torch.where(positive, scales, 1.0).reshape(-1, 1)),
                          0, MAX_WEIGHT)
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


def _all_codings(matrix: torch.Tensor, shape: tuple[int, ...], cfg: CompressionConfig, norm: float) -> list[_Option]:
    """Every candidate of one tensor with its estimated error (quant ones coded, low-rank ones estimated)."""
    candidates = _candidates(shape, cfg)
    lowrank = [c for c in candidates if c.codec == "lowrank"]
    estimates: dict[tuple[int, int], float] = {}
    if lowrank:
        top = max(c.rank for c in lowrank)
        factors = _Factors(_factorize(matrix, top), top)
        for bits in sorted({c.bits for c in lowrank}):
            ranks = sorted({c.rank for c in lowrank if c.bits == bits})
            for rank, estimate in _lowrank_estimates(matrix, factors, ranks, bits, norm).items():
                estimates[(rank, bits)] = estimate
    quantizer = _ColumnQuantizer(matrix)
    options = []
    for candidate in candidates:
        if candidate.codec == "quant":
            coded = _code_quant(matrix, candidate.bits, candidate, norm, quantizer)
            options.append(_Option(candidate, coded.estimate, lambda coded=coded: coded))
        else:
            estimate = estimates[(candidate.rank, candidate.bits)]
            options.append(_Option(
                candidate, estimate, lambda candidate=candidate, estimate=estimate: factors.coded(candidate, estimate),
            ))
    return options


def _rounding_residuals(values: torch.Tensor, column_max: torch.Tensor, bits_list: Sequence[int]) -> torch.Tensor:
    """``sum_i (v_ij - s_j round(v_ij / s_j))^2`` per column j, for ``s_j = column_max_j / qmax(b)``: (bit widths, columns).

    The squared error of :class:`~training.compression._ColumnQuantizer` at each
    bit width, from one pass over ``values`` for all of them (``|v / s| <= qmax``,
    so no clamping), in float64 at the end. Selection only: the winner is
    quantized and decoded exactly.
    """
    limits, limits64 = _limits(tuple(bits_list))
    # A zero column divides to zeros (then rounds to no residual) whatever its positive divisor.
    safe = column_max.clamp_min(torch.finfo(torch.float32).tiny)
    scaled = (values / safe).unsqueeze(0) * limits  # v / s, in [-qmax, qmax]
    residual = scaled.sub_(torch.round(scaled))
    per_column = torch.sum(residual.mul_(residual), dim=1).to(torch.float64)  # (bits, columns), in units of s^2
    steps = column_max.to(torch.float64).reshape(1, -1) / limits64
    return per_column * steps * steps


_LIMITS: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}


def _limits(bits_list: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """``qmax(b)`` per bit width, shaped (bits, 1, 1) in float32 and (bits, 1) in float64 (cached; never modified)."""
    if bits_list not in _LIMITS:
        values = [float(qmax(bits)) for bits in bits_list]
        _LIMITS[bits_list] = (torch.tensor(values, dtype=torch.float32).reshape(-1, 1, 1),
                              torch.tensor(values, dtype=torch.float64).reshape(-1, 1))
    return _LIMITS[bits_list]


def _quant_coded(quantizer: _ColumnQuantizer, candidate: _Candidate, estimate: float) -> _Coded:
    """``quant(b)`` coded as :func:`~training.compression._code_quant` codes it, without decoding it for an estimate."""
    q_float, scales = quantizer.quantize(candidate.bits)
    return _Coded(candidate, (q_float,), scales, estimate)


def _all_codings_v2(
    matrix: torch.Tensor, shape: tuple[int, ...], cfg: CompressionConfig, norm: float,
    bases: list | None = None,
) -> list[_Option]:
    """:func:`_all_codings` of encoder "v2": the same candidates, estimated without coding any (only the winner is).

    ``quant(b)``: the exact rounding residual of every column (one pass for all
    bit widths; :func:`_rounding_residuals`). ``lowrank(r, b)``, with ``P_k``,
    ``Q_k`` the balanced factor columns of :func:`~training.compression.factorize`
    (``"v2"``) and ``E_k``, ``F_k`` their rounding residuals at b bits::

        ||X - sum_{k<r} (P_k - E_k)(Q_k - F_k)^T||^2
          ~= (||X||^2 - sum_{k<r} sigma_k^2)
             + sum_{k<r} (|E_k|^2 |Q_k|^2 + |P_k|^2 |F_k|^2 + |E_k|^2 |F_k|^2)

    the truncation error plus each kept column's quantization error; the cross
    terms between columns (zero-mean rounding noise against orthogonal
    columns) and the 16-bit weights' rounding are left out. No product with
    ``X``: a few vector operations give every rank and bit width.

    ``bases`` (encoder "v3"): a list the factorization ``(U, sigma, V)`` is
    appended to (None when the tensor has no low-rank candidate); the options
    are the same.
    """
    candidates = _candidates(shape, cfg)
    quantizer = _ColumnQuantizer(matrix)
    relative = (lambda square: math.sqrt(max(square, 0.0)) / norm) if norm else (lambda square: 0.0)
    quant_bits = sorted({c.bits for c in candidates if c.codec == "quant"})
    # Every ``stride``-th row: at most ~QUANT_SAMPLE values per bit width estimate the rest (scaled up).
    stride = max(1, matrix.numel() // QUANT_SAMPLE)
    sample = matrix[::stride]
    residuals = _rounding_residuals(sample, quantizer.column_max, quant_bits) * (matrix.shape[0] / sample.shape[0])
    quant_squares = torch.sum(residuals, dim=1).tolist()
    estimates = {("quant", 0, bits): relative(square) for bits, square in zip(quant_bits, quant_squares)}
    lowrank = [c for c in candidates if c.codec == "lowrank"]
    factors = None
    if lowrank:
        top = max(c.rank for c in lowrank)
        u, sigma, v = factorize(matrix, top, "v2")
        if bases is not None:
            bases.append((u, sigma, v))
        factors = _Factors((u, sigma, v), top)
        left, right = factors.left.matrix, factors.right.matrix
        bits_list = sorted({c.bits for c in lowrank})
        left_error = _rounding_residuals(left, factors.left.column_max, bits_list)  # (bits, top)
        right_error = _rounding_residuals(right, factors.right.column_max, bits_list)
        left_norm = torch.sum(left * left, dim=0).to(torch.float64)
        right_norm = torch.sum(right * right, dim=0).to(torch.float64)
        quantization = torch.cumsum(left_error * right_norm + left_norm * right_error + left_error * right_error, 1)
        truncation = (norm * norm - torch.cumsum(sigma.to(torch.float64) ** 2, 0)).clamp_min(0.0)
        squares = (truncation + quantization).tolist()  # [bit index][rank - 1]
        for candidate in lowrank:
            estimates[("lowrank", candidate.rank, candidate.bits)] = relative(
                squares[bits_list.index(candidate.bits)][candidate.rank - 1]
            )
    elif bases is not None:
        bases.append(None)
    options = []
    for candidate in candidates:
        estimate = estimates[(candidate.codec, candidate.rank, candidate.bits)]
        if candidate.codec == "quant":
            make = lambda candidate=candidate, estimate=estimate: _quant_coded(  # noqa: E731
                quantizer, candidate, estimate
            )
        else:
            make = lambda candidate=candidate, estimate=estimate: factors.coded(candidate, estimate)  # noqa: E731
        options.append(_Option(candidate, estimate, make))
    return options


def encode_within_bandwidth(
    tensors: Mapping[str, torch.Tensor], cfg: CompressionConfig, budget: int, *, stage_index: int, outer_round: int
) -> tuple[bytes, dict[str, torch.Tensor], CompressionStats]:
    """Encode a stage's pseudo-gradient in at most ``budget`` bytes where possible: ``(bytes, decoded, stats)``.

    Same wire format and exact decode as :func:`training.compression.encode_contribution`;
    only the choice of coding per tensor differs (module docstring). Stateless:
    encoders "v3" and "v4" code here exactly as "v2" (their state lives in
    :func:`training.encoder_memo.encode_with_memo`).
    """
    matrices, norms = _matrices(tensors)
    chosen = _select(tensors, matrices, norms, cfg, budget)
    return _finish(tensors, matrices, norms, chosen, cfg, stage_index=stage_index, outer_round=outer_round)[:3]


def _matrices(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
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


def _select(tensors, matrices, norms, cfg: CompressionConfig, budget: int, bases: dict | None = None,
            codings: dict | None = None) -> dict:
    """``{name: chosen _Option}`` under ``budget`` (v1 / v2 estimates, :func:`allocate`).

    ``bases`` (encoder "v3"): filled with each tensor's factorization (None without a low-rank candidate).
    ``codings`` (encoder "v4"): filled with each tensor's options (every candidate and its estimate).
    """
    overhead = 32 + sum(framing_bytes(name, tuple(tensors[name].shape)) for name in sorted(tensors))
    found_codings = {}
    for name, matrix in matrices.items():
        shape = tuple(tensors[name].shape)
        if cfg.encoder == "v1":
            found_codings[name] = _all_codings(matrix, shape, cfg, norms[name])
        else:
            found = None if bases is None else []
            found_codings[name] = _all_codings_v2(matrix, shape, cfg, norms[name], found)
            if bases is not None:
                bases[name] = found[0]
    if codings is not None:
        codings.update(found_codings)
    options = {
        name: [(c.candidate.cost, (c.estimate * norms[name]) ** 2) for c in coded]
        for name, coded in found_codings.items()
    }
    choice = allocate(options, budget - overhead)
    return {name: found_codings[name][choice[name]] for name in found_codings}


def _finish(tensors, matrices, norms, chosen: Mapping, cfg: CompressionConfig, *, stage_index: int,
            outer_round: int) -> tuple[bytes, dict[str, torch.Tensor], CompressionStats, dict[str, _Coded]]:
    """Code the chosen options: ``(bytes, decoded, stats, {name: coded})`` (the winners' exact decode)."""
    stats = CompressionStats(outer_round=outer_round, stage_index=stage_index)
    entries, decoded, coded = [], {}, {}
    for name in sorted(tensors):
        shape = tuple(tensors[name].shape)
        if name not in chosen:  # empty tensor: the plain encoder's raw entry
            entry, value, tensor_stats = encode_tensor(name, tensors[name], cfg)
        else:
            winner = coded[name] = chosen[name].coded()
            value = winner.decode()
            error = _rel_error(matrices[name], value, norms[name])
            fields, payload = winner.fields()
            candidate = winner.candidate
            entry = {"n": name, "s": list(shape), "c": candidate.codec, **fields}
            value = value.reshape(shape)
            tensor_stats = TensorCodecStats(
                name, shape, candidate.codec, candidate.rank, candidate.bits, 4 * value.numel(), payload, error,
                True,
            )
        entries.append(entry)
        decoded[name] = value
        stats.tensors.append(tensor_stats)
        stats.raw_bytes += tensor_stats.raw_bytes
    blob = pack_contribution(stage_index, outer_round, entries)
    stats.encoded_bytes = len(blob)
    return blob, decoded, stats, coded
