"""The codec's numbers: bit-packed integers, float32 fields and the exact reconstruction (the decoder's
arithmetic, bit-exact on every IEEE-754 platform; the formulas and the wire format:
:mod:`training.codec_wire`)."""

from __future__ import annotations

import numpy as np
import torch

from training.errors import (
    ContributionDecodeError,
    ContributionNonFiniteError,
)


def qmax(bits: int) -> int:
    """Largest magnitude of a symmetric ``bits``-bit quantized value."""
    return (1 << (bits - 1)) - 1


_EXACT_FLOAT64_INTEGER = 1 << 53  # every integer of at most this magnitude is a float64
#: Elements of the float64 product :func:`reconstruct_lowrank` holds at once (8 MiB).
RECONSTRUCT_BLOCK_ELEMENTS = 1 << 20


def pack_ints(values: torch.Tensor, bits: int) -> bytes:
    """Pack signed ints in ``[-qmax, qmax]`` as ``bits``-bit offsets, little-endian.

    ``values`` are int64 or integer-valued floats. Below 16 bits the offsets
    ``u = q + qmax`` (< 256) are formed in the input dtype (exact for these
    integers) and converted once to bytes; sub-byte fields are then combined
    ``per_byte`` at a time on uint8 columns (field j shifted by ``bits * j``):
    the same bytes as one shift and OR per field on int64 (tests keep that
    reference).
    """
    flat = values.reshape(-1)
    if bits == 16:
        return (flat.to(torch.int64) + qmax(bits)).numpy().astype("<u2").tobytes()
    offset = torch.add(flat, qmax(bits)).to(torch.uint8).numpy()
    if bits == 8:
        return offset.tobytes()
    per_byte = 8 // bits
    pad = (-offset.size) % per_byte
    if pad:
        offset = np.concatenate([offset, np.zeros(pad, dtype=np.uint8)])
    fields = offset.reshape(-1, per_byte)
    packed = fields[:, 0].copy()
    for j in range(1, per_byte):
        packed |= fields[:, j] << np.uint8(bits * j)
    return packed.tobytes()


def unpack_ints(data: bytes, bits: int, count: int, where: str) -> torch.Tensor:
    """Inverse of :func:`pack_ints`; strict about length, padding and range."""
    return torch.from_numpy(unpack_array(data, bits, count, where, np.int64))


def _signed_tables(bits: int) -> dict:
    """Byte -> its ``8 // bits`` signed values (``u - qmax``), per dtype; built once per bit width."""
    per_byte = 8 // bits
    fields = (np.arange(256)[:, None] >> (bits * np.arange(per_byte))[None, :]) & ((1 << bits) - 1)
    signed = fields - qmax(bits)  # integer arithmetic, then exact conversion (no -0.0)
    return {dtype: signed.astype(dtype) for dtype in (np.int64, np.float32, np.float64)}


_TABLES = {bits: _signed_tables(bits) for bits in (2, 4, 8)}


def unpack_array(data: bytes, bits: int, count: int, where: str, dtype) -> np.ndarray:
    """:func:`unpack_ints` as a numpy array of ``dtype`` (int64, or the exact float32 / float64 values).

    Sub-word widths go through a byte -> values table (one gather instead of a
    shift and a mask per field). The checks and their order are unchanged:
    length, then padding bits, then the range (``u = 2**bits - 1`` is the one
    unsigned value outside the symmetric range).
    """
    expected = (count * bits + 7) // 8
    if len(data) != expected:
        raise ContributionDecodeError(f"{where}: {len(data)} payload bytes, expected {expected}")
    limit = qmax(bits)
    if bits == 16:
        unsigned = np.frombuffer(data, dtype="<u2")
        if unsigned.size and int(unsigned.max()) > 2 * limit:
            raise ContributionDecodeError(f"{where}: value out of the {bits}-bit symmetric range")
        array = unsigned.astype(dtype)
        array -= limit
        return array
    raw = np.frombuffer(data, dtype=np.uint8)
    per_byte = 8 // bits
    used = count % per_byte  # fields of the last byte that hold values; the rest is padding
    if used and raw[-1] >> (bits * used):
        raise ContributionDecodeError(f"{where}: non-zero padding bits")
    array = _TABLES[bits][dtype][raw].reshape(-1)[:count]
    if array.size and array.max() > limit:
        raise ContributionDecodeError(f"{where}: value out of the {bits}-bit symmetric range")
    return array


def f32_bytes(values: torch.Tensor) -> bytes:
    """``values`` as little-endian float32 bytes (row-major)."""
    array = values.detach().to(torch.float32).reshape(-1).contiguous().numpy()
    return array.astype("<f4").tobytes()


def f32_tensor(data: bytes, count: int, where: str, *, nonnegative: bool = False) -> torch.Tensor:
    if len(data) != 4 * count:
        raise ContributionDecodeError(f"{where}: {len(data)} bytes of float32, expected {4 * count}")
    array = np.frombuffer(data, dtype="<f4").astype(np.float32)  # a writable copy
    if not np.all(np.isfinite(array)):
        raise ContributionNonFiniteError(f"{where}: non-finite float32 value")
    if nonnegative and np.any(array < 0):
        raise ContributionDecodeError(f"{where}: negative scale")
    return torch.from_numpy(array)


# These three functions ARE the decoder: the encoder measures its error with
# them and error feedback subtracts their output, so every party computes the
# same float32 bits from the same integers.


def reconstruct_quant(q_int: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``float32(q_int) * scales[None, :]``; q_int is ``m x n`` int64, scales ``n`` float32."""
    return torch.mul(q_int.to(torch.float32), scales.reshape(1, -1))


def product_bound(p_int: torch.Tensor, q_int: torch.Tensor, weights: torch.Tensor) -> int:
    """``max|P| * max|w| * max|Q| * rank``: bounds every partial sum of ``(P * w) @ Q^T``."""
    rank = int(weights.numel())
    if not (rank and p_int.numel() and q_int.numel()):
        return 0
    return int(p_int.abs().max()) * int(weights.abs().max()) * int(q_int.abs().max()) * rank


def reconstruct_lowrank(
    p_int: torch.Tensor,
    q_int: torch.Tensor,
    weights: torch.Tensor,
    scale: torch.Tensor,
    *,
    bound: int | None = None,
) -> torch.Tensor:
    """``float32(float64((P * w) @ Q^T) * float64(S))``: the integer product, computed exactly.

    The product is an integer matrix. It is computed by a float64 matrix
    product (BLAS, ~10x faster than torch's int64 matmul), which is exact here
    whatever the summation order, blocking, thread count or use of fused
    multiply-add: every operand is an integer, and with
    ``bound = max|P| * max|w| * max|Q| * rank`` every product ``P_ik w_k Q_jk``,
    every partial sum of them (in any order and grouping) and the result are
    integers of magnitude at most ``bound``. When ``bound <= 2**53`` each of
    them is a representable double, so no operation ever rounds and the result
    is the int64 product converted to float64, bit for bit (after ``+ 0.0``
    turns a ``-0.0`` into the integer 0's ``+0.0``). The wire decoder
    guarantees ``bound <= 64 * 32767 * 65535 * 32767 < 2**52`` (rank <= 64,
    bits <= 16, u16 weights); other inputs take the int64 path. ``bound`` may
    be passed when the caller computed it. The integers may be given as int64
    or as integer-valued floats.
    """
    if bound is None:
        bound = product_bound(p_int, q_int, weights)
    exact = bound <= _EXACT_FLOAT64_INTEGER
    if exact:
        left = torch.mul(p_int.to(torch.float64), weights.to(torch.float64).reshape(1, -1))  # < 2**31: exact
        right = q_int.to(torch.float64).t()
    else:
        left = torch.mul(p_int.to(torch.int64), weights.to(torch.int64).reshape(1, -1))
        right = q_int.to(torch.int64).t()
    scale64 = scale.to(torch.float64)
    out = torch.empty((left.shape[0], right.shape[1]), dtype=torch.float32)
    # A block of rows at a time (issue 75: the whole float64 product and its scaled copy were 16 bytes per
    # element beside the float32 result, on every thread that decodes at once). Each element of the product
    # is an exact integer whatever the blocking (above), and the scaling and the rounding to float32 are
    # elementwise, so the bits are the whole product's.
    rows = max(1, RECONSTRUCT_BLOCK_ELEMENTS // max(1, right.shape[1]))
    for start in range(0, left.shape[0], rows):
        if exact:
            # + 0.0: an all-zero sum of products with a negative factor is -0.0 in float64 but 0 in int64.
            block = torch.mm(left[start : start + rows], right).add_(0.0)
        else:
            block = torch.matmul(left[start : start + rows], right).to(torch.float64)
        out[start : start + rows] = block.mul_(scale64)
    return out
