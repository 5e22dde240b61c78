"""Adaptive compression of pseudo-gradients with error feedback (DiLoCoX, arXiv 2506.21263).

DiLoCoX's abstract names an "adaptive gradient compression scheme"; its exact
rule is not available to us, so this module implements what the abstract
describes with choices documented here (and in ``docs/DILOCOX.md``):
low-rank factorization plus quantization, rank and bit width chosen per tensor
and per round against an error budget, and error feedback (Seide et al. 2014,
Karimireddy et al. 2019; as in PowerSGD, Vogels et al. 2019) so that what a
round leaves out is sent later.

Per tensor ``X`` (float32; a tensor of ndim >= 2 is viewed as the matrix
``m x n`` with ``m = shape[0]``, ``n = prod(shape[1:])``), the candidates are

* ``quant(b)``: ``X ~= Xq * s[None, :]`` with per-column scales
  ``s_j = max_i |X_ij| / qmax_b``, ``qmax_b = 2**(b-1) - 1`` and
  ``Xq = clamp(round(X / s), -qmax_b, qmax_b)`` (a 1-D tensor is one column).
  Cost ``ceil(m*n*b/8) + 4*n`` bytes.
* ``lowrank(r, b)`` (only for ndim >= 2 and numel >= ``min_compress_numel``):
  rank-r factorization ``X ~= U_r diag(sigma_r) V_r^T`` (exact SVD for small
  matrices, otherwise a randomized subspace iteration with a fixed seed, so the
  encoder is deterministic), balanced factors ``P = U_r sqrt(sigma_r)``,
  ``Q = V_r sqrt(sigma_r)``, each quantized to b bits with per-column scales
  ``a_k = max|P[:,k]| / qmax_b``, ``c_k = max|Q[:,k]| / qmax_b``. The column
  scale products ``a_k c_k`` are stored as one float32 ``S = max_k(a_k c_k) / 65535``
  and 16-bit integer weights ``w_k = round(a_k c_k / S)``, which makes the decode a
  pure integer matrix product (below). Cost
  ``ceil(m*r*b/8) + ceil(n*r*b/8) + 2*r + 4`` bytes.
* ``raw``: float32 values, used only when compression is disabled.

Selection: candidates are tried in increasing byte cost; the first whose
relative error ``||X - decode(encode(X))||_F / ||X||_F <= error_budget`` wins.
A low-rank candidate whose unquantized factorization already misses the budget
is skipped without quantizing. If no candidate meets the budget, the one with
the smallest error is used (the stats say so).

Decode (bit-exact on every IEEE-754 platform; no float matmul, no BLAS, no
fused multiply-add, a fixed order of elementwise ops):

* ``quant``:   ``out = float32(Xq) * s[None, :]`` (one float32 multiply per element;
  ``|Xq| <= 32767`` converts exactly).
* ``lowrank``: ``M = (P_int * w[None, :]) @ Q_int^T`` in int64 (exact: the
  decoder bounds ``r * qmax_b**2 * 65535 < 2**53``), then
  ``out = float32(float64(M) * float64(S))``: the int64 -> float64 conversion is
  exact, the float64 product and the float32 rounding are each correctly rounded.
* ``raw``: the float32 values.

Error feedback (per tensor, ``e_0 = 0``): ``target_t = g_t + e_{t-1}``,
``sent_t = decode(encode(target_t))``, ``e_t = target_t - sent_t``. Then
``sum_t sent_t = sum_t g_t - e_T``: the decoded contributions track the inputs up
to one bounded residual.

Wire format (msgpack, version 1)::

    {"v": 1, "st": stage_index, "rd": outer_round,
     "t": [entry, ...]}                  # one entry per tensor, names ascending
    entry = {"n": name, "s": [dims], "c": "quant",   "b": bits, "q": packed, "x": f32 scales}
          | {"n": name, "s": [dims], "c": "lowrank", "b": bits, "r": rank,
             "p": packed P, "q": packed Q, "w": u16 LE weights, "x": f32 S}
          | {"n": name, "s": [dims], "c": "raw", "d": f32 values}

Integers are packed as ``u = q + qmax_b`` in b bits, little-endian within bytes
(value j of a byte at bit ``b*j``), zero padding; floats are little-endian
float32 bytes. :func:`decode_contribution` rejects anything else with
:class:`~training.errors.ContributionDecodeError`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

import msgpack
import numpy as np
import torch

from training.config import CompressionConfig
from training.errors import ContributionDecodeError, ContributionEncodeError, EngineStateError

logger = logging.getLogger(__name__)

CODEC_VERSION = 1
WEIGHT_BITS = 16  # integer weights of the low-rank columns
MAX_WEIGHT = (1 << WEIGHT_BITS) - 1
MAX_RANK = 64  # keeps the int64 decode product below 2**53 for every bit width
SUPPORTED_BITS = (2, 4, 8, 16)
FACTOR_SEED = 0x5EED  # fixed seed of the randomized range finder
EXACT_SVD_MAX_DIM = 96  # min(m, n) up to which an exact SVD is cheaper than sketching
_OVERSAMPLE = 8
_POWER_ITERATIONS = 2


def qmax(bits: int) -> int:
    """Largest magnitude of a symmetric ``bits``-bit quantized value."""
    return (1 << (bits - 1)) - 1


def matrix_view_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The ``(m, n)`` matrix a tensor of ``shape`` is coded as (1-D: one column)."""
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return shape[0], 1
    return shape[0], math.prod(shape[1:])


# ----------------------------------------------------------------------------- stats


@dataclass
class TensorCodecStats:
    """How one tensor was coded in one round."""

    name: str
    shape: tuple[int, ...]
    codec: str  # "raw" | "quant" | "lowrank"
    rank: int  # 0 unless lowrank
    bits: int  # 32 for raw
    raw_bytes: int
    payload_bytes: int  # packed integers + scales, without msgpack framing
    rel_error: float  # ||X - decoded||_F / ||X||_F (0 for a zero tensor)
    met_budget: bool


@dataclass
class CompressionStats:
    """Per-round codec report of one contribution."""

    outer_round: int
    stage_index: int
    raw_bytes: int = 0  # float32 size of the pseudo-gradient
    encoded_bytes: int = 0  # len() of the msgpack contribution
    encode_seconds: float = 0.0
    tensors: list[TensorCodecStats] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        """raw_bytes / encoded_bytes."""
        return self.raw_bytes / self.encoded_bytes if self.encoded_bytes else float("inf")

    @property
    def max_rel_error(self) -> float:
        return max((t.rel_error for t in self.tensors), default=0.0)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["ratio"] = self.ratio
        out["max_rel_error"] = self.max_rel_error
        return out


# ----------------------------------------------------------------------------- bit packing


def pack_ints(values: torch.Tensor, bits: int) -> bytes:
    """Pack signed ints in ``[-qmax, qmax]`` as ``bits``-bit offsets, little-endian."""
    offset = values.reshape(-1).to(torch.int64) + qmax(bits)
    array = offset.numpy()
    if bits == 16:
        return array.astype("<u2").tobytes()
    if bits == 8:
        return array.astype(np.uint8).tobytes()
    per_byte = 8 // bits
    pad = (-array.size) % per_byte
    array = np.concatenate([array.astype(np.uint8), np.zeros(pad, dtype=np.uint8)]).reshape(-1, per_byte)
    packed = np.zeros(array.shape[0], dtype=np.uint8)
    for j in range(per_byte):
        packed |= (array[:, j] << (bits * j)).astype(np.uint8)
    return packed.tobytes()


def unpack_ints(data: bytes, bits: int, count: int, where: str) -> torch.Tensor:
    """Inverse of :func:`pack_ints`; strict about length, padding and range."""
    expected = (count * bits + 7) // 8
    if len(data) != expected:
        raise ContributionDecodeError(f"{where}: {len(data)} payload bytes, expected {expected}")
    if bits == 16:
        array = np.frombuffer(data, dtype="<u2").astype(np.int64)
    elif bits == 8:
        array = np.frombuffer(data, dtype=np.uint8).astype(np.int64)
    else:
        per_byte = 8 // bits
        raw = np.frombuffer(data, dtype=np.uint8)
        mask = (1 << bits) - 1
        array = np.stack([(raw >> (bits * j)) & mask for j in range(per_byte)], axis=1).reshape(-1)
        array = array.astype(np.int64)
        if np.any(array[count:]):
            raise ContributionDecodeError(f"{where}: non-zero padding bits")
        array = array[:count]
    if array.size and int(array.max()) > 2 * qmax(bits):
        raise ContributionDecodeError(f"{where}: value out of the {bits}-bit symmetric range")
    return torch.from_numpy(array - qmax(bits))


def _f32_bytes(values: torch.Tensor) -> bytes:
    array = values.detach().to(torch.float32).reshape(-1).contiguous().numpy()
    return array.astype("<f4").tobytes()


def _f32_tensor(data: bytes, count: int, where: str, *, nonnegative: bool = False) -> torch.Tensor:
    if len(data) != 4 * count:
        raise ContributionDecodeError(f"{where}: {len(data)} bytes of float32, expected {4 * count}")
    array = np.frombuffer(data, dtype="<f4").astype(np.float32)
    if not np.all(np.isfinite(array)):
        raise ContributionDecodeError(f"{where}: non-finite float32 value")
    if nonnegative and np.any(array < 0):
        raise ContributionDecodeError(f"{where}: negative scale")
    return torch.from_numpy(array.copy())


# ----------------------------------------------------------------------------- reconstruction
# These three functions ARE the decoder: the encoder measures its error with
# them and error feedback subtracts their output, so every party computes the
# same float32 bits from the same integers.


def reconstruct_quant(q_int: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``float32(q_int) * scales[None, :]``; q_int is ``m x n`` int64, scales ``n`` float32."""
    return torch.mul(q_int.to(torch.float32), scales.reshape(1, -1))


def reconstruct_lowrank(
    p_int: torch.Tensor, q_int: torch.Tensor, weights: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """``float32(float64((P * w) @ Q^T) * float64(S))`` with the product in int64."""
    product = torch.matmul(torch.mul(p_int, weights.reshape(1, -1)), q_int.t())
    return torch.mul(product.to(torch.float64), scale.to(torch.float64)).to(torch.float32)


def _quantize_columns(matrix: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-column quantization: (int64 values, float32 scales)."""
    limit = qmax(bits)
    scales = matrix.abs().amax(dim=0) / limit
    # A zero column has scale 0; dividing it by any positive number keeps it 0.
    safe = scales.clamp_min(torch.finfo(torch.float32).tiny)
    q_int = torch.clamp(torch.round(matrix / safe), -limit, limit).to(torch.int64)
    return q_int, scales.to(torch.float32)


# ----------------------------------------------------------------------------- factorization


def _factorize(matrix: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-``rank`` ``(U, sigma, V)`` of ``matrix``; deterministic for given input.

    Exact SVD when the matrix is small; otherwise Halko et al.'s randomized
    range finder with ``_POWER_ITERATIONS`` subspace iterations and a FIXED
    Gaussian sketch (seed ``FACTOR_SEED``), so re-encoding the same input on
    the same platform gives the same bytes.
    """
    m, n = matrix.shape
    if min(m, n) <= max(EXACT_SVD_MAX_DIM, rank + _OVERSAMPLE):
        u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
        return u[:, :rank], s[:rank], vh[:rank].t()
    generator = torch.Generator().manual_seed(FACTOR_SEED)
    sketch = torch.randn(n, rank + _OVERSAMPLE, generator=generator, dtype=matrix.dtype)
    basis, _ = torch.linalg.qr(matrix @ sketch)
    for _ in range(_POWER_ITERATIONS):
        basis, _ = torch.linalg.qr(matrix.t() @ basis)
        basis, _ = torch.linalg.qr(matrix @ basis)
    u_small, s, vh = torch.linalg.svd(basis.t() @ matrix, full_matrices=False)
    return (basis @ u_small)[:, :rank], s[:rank], vh[:rank].t()


def _rank_candidates(m: int, n: int, max_rank: int) -> list[int]:
    top = min(max_rank, MAX_RANK, m, n)
    ranks = {r for r in (1, 2, 4, 8, 16, 32, 64) if r <= top}
    ranks.add(top)
    return sorted(ranks)


# ----------------------------------------------------------------------------- encoding


@dataclass
class _Candidate:
    codec: str
    rank: int
    bits: int
    cost: int


def _candidates(shape: tuple[int, ...], cfg: CompressionConfig) -> list[_Candidate]:
    m, n = matrix_view_shape(shape)
    out = [_Candidate("quant", 0, b, (m * n * b + 7) // 8 + 4 * n) for b in cfg.bit_choices]
    if len(shape) >= 2 and math.prod(shape) >= cfg.min_compress_numel:
        for rank in _rank_candidates(m, n, cfg.max_rank):
            for b in cfg.bit_choices:
                cost = (m * rank * b + 7) // 8 + (n * rank * b + 7) // 8 + 2 * rank + 4
                out.append(_Candidate("lowrank", rank, b, cost))
    # Cheapest first; ties: quant before lowrank, then fewer bits, lower rank.
    return sorted(out, key=lambda c: (c.cost, c.codec != "quant", c.bits, c.rank))


@dataclass
class _Coded:
    """A quantized candidate: the integers and scales that would go on the wire."""

    candidate: _Candidate
    ints: tuple[torch.Tensor, ...]  # quant: (Xq,); lowrank: (P_int, Q_int, w)
    scale: torch.Tensor  # quant: per-column scales; lowrank: S (0-d)
    estimate: float  # relative error from float32 algebra (selection only)

    def decode(self) -> torch.Tensor:
        """The exact decoder's output (bit-identical to decode_contribution)."""
        if self.candidate.codec == "quant":
            return reconstruct_quant(self.ints[0], self.scale)
        return reconstruct_lowrank(*self.ints, self.scale)

    def fields(self) -> tuple[dict, int]:
        bits = self.candidate.bits
        if self.candidate.codec == "quant":
            out = {"b": bits, "q": pack_ints(self.ints[0], bits), "x": _f32_bytes(self.scale)}
            return out, len(out["q"]) + len(out["x"])
        p_int, q_int, weights = self.ints
        out = {
            "b": bits,
            "r": self.candidate.rank,
            "p": pack_ints(p_int, bits),
            "q": pack_ints(q_int, bits),
            "w": weights.numpy().astype("<u2").tobytes(),
            "x": _f32_bytes(self.scale.reshape(1)),
        }
        return out, len(out["p"]) + len(out["q"]) + len(out["w"]) + 4


def _code_quant(matrix: torch.Tensor, bits: int, candidate: _Candidate, norm: float) -> _Coded:
    q_int, scales = _quantize_columns(matrix, bits)
    return _Coded(candidate, (q_int,), scales, _rel_error(matrix, reconstruct_quant(q_int, scales), norm))


def _code_lowrank(
    matrix: torch.Tensor, factors: tuple[torch.Tensor, torch.Tensor, torch.Tensor], candidate: _Candidate, norm: float
) -> _Coded:
    u, sigma, v = factors
    rank, bits = candidate.rank, candidate.bits
    root = torch.sqrt(sigma[:rank])
    p_int, p_scales = _quantize_columns(u[:, :rank] * root, bits)
    q_int, q_scales = _quantize_columns(v[:, :rank] * root, bits)
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
        estimate = 0.0 if not torch.any(weights) or not torch.any(p_int) or not torch.any(q_int) else float("inf")
    else:
        cross = float(torch.sum((matrix @ b).to(torch.float64) * a.to(torch.float64)))
        gram = float(torch.sum((a.t() @ a).to(torch.float64) * (b.t() @ b).to(torch.float64)))
        estimate = math.sqrt(max(norm * norm - 2 * cross + gram, 0.0)) / norm
    return _Coded(candidate, (p_int, q_int, weights), scale, estimate)


def _rel_error(matrix: torch.Tensor, decoded: torch.Tensor, norm: float) -> float:
    if norm == 0.0:
        return 0.0 if not torch.any(decoded) else float("inf")
    return float(torch.linalg.vector_norm(matrix - decoded)) / norm


def encode_tensor(
    name: str, tensor: torch.Tensor, cfg: CompressionConfig
) -> tuple[dict, torch.Tensor, TensorCodecStats]:
    """Code one tensor: ``(wire entry, decoded float32 tensor, stats)``.

    The decoded tensor is bit-identical to what :func:`decode_contribution`
    returns for this entry. Candidates are screened with cheap float32
    estimates of their error; the winner's error is then measured on its exact
    decode (and the search goes on if rounding pushed it over the budget).
    """
    shape = tuple(tensor.shape)
    value = tensor.detach().to(torch.float32)
    if not bool(torch.isfinite(value).all()):
        raise ContributionEncodeError(f"{name!r}: pseudo-gradient has non-finite values")
    raw_bytes = 4 * value.numel()
    header = {"n": name, "s": list(shape)}
    if not cfg.enabled or value.numel() == 0:
        entry = {**header, "c": "raw", "d": _f32_bytes(value)}
        stats = TensorCodecStats(name, shape, "raw", 0, 32, raw_bytes, raw_bytes, 0.0, True)
        return entry, value.clone(), stats

    matrix = value.reshape(matrix_view_shape(shape))
    norm = float(torch.linalg.vector_norm(matrix))
    budget = cfg.error_budget
    candidates = _candidates(shape, cfg)
    factors = None
    coded: list[_Coded] = []

    def code(candidate: _Candidate) -> _Coded:
        nonlocal factors
        if candidate.codec == "quant":
            return _code_quant(matrix, candidate.bits, candidate, norm)
        if factors is None:
            factors = _factorize(matrix, max(c.rank for c in candidates))
        return _code_lowrank(matrix, factors, candidate, norm)

    chosen = decoded = None
    error = float("inf")
    for candidate in candidates:
        if candidate.codec == "lowrank" and norm > 0:
            if factors is None:
                factors = _factorize(matrix, max(c.rank for c in candidates))
            # The unquantized rank-r factorization already misses the budget: skip.
            kept = float(torch.sum(factors[1][: candidate.rank].to(torch.float64) ** 2))
            if math.sqrt(max(norm * norm - kept, 0.0)) / norm > budget:
                continue
        attempt = code(candidate)
        coded.append(attempt)
        if attempt.estimate <= budget:
            decoded = attempt.decode()
            error = _rel_error(matrix, decoded, norm)
            if error <= budget:
                chosen = attempt
                break
    if chosen is None:
        # Nothing meets the budget: spend the effort to find the most accurate option.
        tried = {(c.candidate.codec, c.candidate.rank, c.candidate.bits) for c in coded}
        coded.extend(code(c) for c in candidates if (c.codec, c.rank, c.bits) not in tried)
        chosen = min(coded, key=lambda c: (c.estimate, c.candidate.cost))
        decoded = chosen.decode()
        error = _rel_error(matrix, decoded, norm)
        logger.debug("%s: no codec meets error budget %.3g, best %.3g", name, budget, error)
    fields, payload = chosen.fields()
    candidate = chosen.candidate
    entry = {**header, "c": candidate.codec, **fields}
    stats = TensorCodecStats(
        name, shape, candidate.codec, candidate.rank, candidate.bits, raw_bytes, payload, error, error <= budget
    )
    return entry, decoded.reshape(shape), stats


def encode_contribution(
    tensors: Mapping[str, torch.Tensor], cfg: CompressionConfig, *, stage_index: int, outer_round: int
) -> tuple[bytes, dict[str, torch.Tensor], CompressionStats]:
    """Encode a stage's pseudo-gradient: ``(bytes, decoded tensors, stats)`` (no error feedback)."""
    stats = CompressionStats(outer_round=outer_round, stage_index=stage_index)
    entries = []
    decoded: dict[str, torch.Tensor] = {}
    for name in sorted(tensors):
        entry, value, tensor_stats = encode_tensor(name, tensors[name], cfg)
        entries.append(entry)
        decoded[name] = value
        stats.tensors.append(tensor_stats)
        stats.raw_bytes += tensor_stats.raw_bytes
    blob = msgpack.packb(
        {"v": CODEC_VERSION, "st": stage_index, "rd": outer_round, "t": entries}, use_bin_type=True
    )
    stats.encoded_bytes = len(blob)
    return blob, decoded, stats


# ----------------------------------------------------------------------------- decoding


def _field(entry: dict, key: str, kind: type, where: str):
    if key not in entry:
        raise ContributionDecodeError(f"{where}: missing field {key!r}")
    value = entry[key]
    # bool is an int subclass; a bool where an int belongs is malformed input.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ContributionDecodeError(f"{where}: field {key!r} is {type(value).__name__}, not {kind.__name__}")
    return value


def _check_keys(entry: dict, allowed: set[str], where: str) -> None:
    extra = set(entry) - allowed
    if extra:
        raise ContributionDecodeError(f"{where}: unknown fields {sorted(map(str, extra))}")


def _decode_entry(entry: object, name: str, shape: tuple[int, ...], index: int) -> torch.Tensor:
    where = f"tensor {index} ({name!r})"
    if not isinstance(entry, dict):
        raise ContributionDecodeError(f"{where}: entry is {type(entry).__name__}, not a map")
    got_name = _field(entry, "n", str, where)
    if got_name != name:
        raise ContributionDecodeError(f"{where}: name {got_name!r} where {name!r} was expected")
    got_shape = _field(entry, "s", list, where)
    if [d for d in got_shape if not isinstance(d, int) or isinstance(d, bool)] or tuple(got_shape) != shape:
        raise ContributionDecodeError(f"{where}: shape {got_shape} does not match the stage's {list(shape)}")
    codec = _field(entry, "c", str, where)
    m, n = matrix_view_shape(shape)
    if codec == "raw":
        _check_keys(entry, {"n", "s", "c", "d"}, where)
        return _f32_tensor(_field(entry, "d", bytes, where), m * n, where).reshape(shape)
    bits = _field(entry, "b", int, where)
    if bits not in SUPPORTED_BITS:
        raise ContributionDecodeError(f"{where}: unsupported bit width {bits}")
    if codec == "quant":
        _check_keys(entry, {"n", "s", "c", "b", "q", "x"}, where)
        q_int = unpack_ints(_field(entry, "q", bytes, where), bits, m * n, where).reshape(m, n)
        scales = _f32_tensor(_field(entry, "x", bytes, where), n, where, nonnegative=True)
        return reconstruct_quant(q_int, scales).reshape(shape)
    if codec == "lowrank":
        _check_keys(entry, {"n", "s", "c", "b", "r", "p", "q", "w", "x"}, where)
        if len(shape) < 2:
            raise ContributionDecodeError(f"{where}: lowrank codec on a {len(shape)}-D tensor")
        rank = _field(entry, "r", int, where)
        if not 1 <= rank <= min(m, n, MAX_RANK):
            raise ContributionDecodeError(f"{where}: rank {rank} outside [1, {min(m, n, MAX_RANK)}]")
        p_int = unpack_ints(_field(entry, "p", bytes, where), bits, m * rank, where).reshape(m, rank)
        q_int = unpack_ints(_field(entry, "q", bytes, where), bits, n * rank, where).reshape(n, rank)
        weight_bytes = _field(entry, "w", bytes, where)
        if len(weight_bytes) != 2 * rank:
            raise ContributionDecodeError(f"{where}: {len(weight_bytes)} weight bytes, expected {2 * rank}")
        weights = torch.from_numpy(np.frombuffer(weight_bytes, dtype="<u2").astype(np.int64))
        scale = _f32_tensor(_field(entry, "x", bytes, where), 1, where, nonnegative=True).reshape(())
        return reconstruct_lowrank(p_int, q_int, weights, scale).reshape(shape)
    raise ContributionDecodeError(f"{where}: unknown codec {codec!r}")


def max_contribution_bytes(expected_shapes: Mapping[str, tuple[int, ...]]) -> int:
    """Upper bound on a well-formed contribution's size (raw float32 plus framing)."""
    numel = sum(math.prod(s) for s in expected_shapes.values())
    return 4 * numel + 1024 * (len(expected_shapes) + 1) + sum(8 * len(s) for s in expected_shapes.values())


def decode_contribution(
    data: bytes,
    expected_shapes: Mapping[str, tuple[int, ...]],
    *,
    stage_index: int | None = None,
    outer_round: int | None = None,
) -> dict[str, torch.Tensor]:
    """Decode a contribution into float32 tensors, strictly.

    ``expected_shapes`` is the stage's ``{name: shape}``; the contribution must
    hold exactly those tensors, in ascending name order. When given,
    ``stage_index`` and ``outer_round`` must match the header. Anything else
    (oversized, truncated, wrong types, wrong shapes, out-of-range integers,
    non-finite floats, trailing bytes) raises :class:`ContributionDecodeError`.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ContributionDecodeError(f"contribution is {type(data).__name__}, not bytes")
    limit = max_contribution_bytes(expected_shapes)
    if len(data) > limit:
        raise ContributionDecodeError(f"contribution of {len(data)} bytes exceeds the stage's limit {limit}")
    try:
        message = msgpack.unpackb(
            bytes(data), raw=False, use_list=True, strict_map_key=True,
            max_bin_len=limit, max_str_len=4096, max_array_len=max(len(expected_shapes), 64) + 8,
            max_map_len=16, max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise ContributionDecodeError(f"contribution is not valid msgpack: {type(exc).__name__}: {exc}") from None
    if not isinstance(message, dict):
        raise ContributionDecodeError("contribution is not a msgpack map")
    _check_keys(message, {"v", "st", "rd", "t"}, "contribution")
    version = _field(message, "v", int, "contribution")
    if version != CODEC_VERSION:
        raise ContributionDecodeError(f"contribution version {version}, this node decodes {CODEC_VERSION}")
    got_stage = _field(message, "st", int, "contribution")
    got_round = _field(message, "rd", int, "contribution")
    if stage_index is not None and got_stage != stage_index:
        raise ContributionDecodeError(f"contribution is for stage {got_stage}, expected {stage_index}")
    if outer_round is not None and got_round != outer_round:
        raise ContributionDecodeError(f"contribution is for round {got_round}, expected {outer_round}")
    entries = _field(message, "t", list, "contribution")
    names = sorted(expected_shapes)
    if len(entries) != len(names):
        raise ContributionDecodeError(f"contribution has {len(entries)} tensors, the stage has {len(names)}")
    decoded = {}
    for index, (entry, name) in enumerate(zip(entries, names)):
        value = _decode_entry(entry, name, tuple(expected_shapes[name]), index)
        # Finite scales can still overflow float32 in the product: refuse, never average an inf.
        if not bool(torch.isfinite(value).all()):
            raise ContributionDecodeError(f"tensor {index} ({name!r}): decodes to non-finite values")
        decoded[name] = value
    return decoded


# ----------------------------------------------------------------------------- error feedback


class ErrorFeedbackCompressor:
    """Adaptive codec plus the error-feedback residual of one (replica, stage).

    ``compress(g_t)`` codes ``target = g_t + e_{t-1}`` and keeps
    ``e_t = target - decoded`` (module docstring). With
    ``cfg.error_feedback = False`` (or compression disabled) ``e`` stays zero.
    """

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], cfg: CompressionConfig) -> None:
        self.cfg = cfg
        self.shapes = {name: tuple(shape) for name, shape in shapes.items()}
        self.residual = {name: torch.zeros(shape, dtype=torch.float32) for name, shape in self.shapes.items()}
        self.last_decoded: dict[str, torch.Tensor] = {}

    def compress(
        self, pseudo_gradient: Mapping[str, torch.Tensor], *, stage_index: int, outer_round: int
    ) -> tuple[bytes, CompressionStats]:
        if set(pseudo_gradient) != set(self.shapes):
            raise ContributionEncodeError("pseudo-gradient names differ from the stage's tensors")
        use_feedback = self.cfg.enabled and self.cfg.error_feedback
        target = {
            name: torch.add(value.to(torch.float32), self.residual[name]) if use_feedback else value
            for name, value in pseudo_gradient.items()
        }
        blob, decoded, stats = encode_contribution(
            target, self.cfg, stage_index=stage_index, outer_round=outer_round
        )
        if use_feedback:
            for name in self.residual:
                self.residual[name] = torch.sub(target[name].to(torch.float32), decoded[name])
        self.last_decoded = decoded  # what every receiver will decode from ``blob``
        return blob, stats

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: value.clone() for name, value in self.residual.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        if set(state) != set(self.shapes):
            raise EngineStateError("error-feedback state names differ from the stage's tensors")
        for name, value in state.items():
            if tuple(value.shape) != self.shapes[name]:
                raise EngineStateError(f"error-feedback {name!r}: shape {tuple(value.shape)} != {self.shapes[name]}")
        self.residual = {name: value.detach().to(torch.float32).clone() for name, value in state.items()}
