"""Random numbers every machine draws alike: Philox4x32-10 and a Box-Muller of correctly rounded operations.

``torch.Tensor.normal_`` is not a function of its generator's seed alone: for
a float32 tensor of 16 or more elements ATen's AVX2 kernel transforms the
uniforms with its own vectorised log/cos, the other kernels with libm's, so an
auditor without AVX2 (``ATEN_CPU_CAPABILITY=default``, an ARM machine, an
AVX-512 one) drew other initial weights from the same seed and replayed every
round to another root (issue 42). What replay and re-execution draw at random
comes from here instead (docs/DILOCOX.md, "A starting point every machine
derives alike"):

* **bits**: Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as
  1, 2, 3", SC 2011), a counter-based generator in 32-bit integer arithmetic,
  evaluated in numpy ``uint64`` (the 32 x 32 -> 64-bit products are exact). The
  key is the first 8 bytes of ``sha256(stream)``, the counter the element pair's
  index, so every tensor's draw is independent of every other's and of the order
  they are drawn in. Checked against Random123's known-answer vectors.
* **normals**: Box-Muller in float64 from one 53-bit uniform and one 32-bit angle
  per pair. Its log, sin and cos are polynomials evaluated with ``+ - * /`` and
  ``sqrt`` only, which IEEE 754 rounds correctly on every CPU and numpy never
  fuses, after an exact reduction (``frexp``; the angle's octant from its top
  three bits). So the float64 values, and their float32 casts, are the same bits
  on any CPU, instruction set, thread count and torch or numpy build. Accuracy:
  a few units in the last place of float64, far below the float32 result's.

Vectorised over chunks of :data:`CHUNK` pairs; no Python loop per element.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch

#: Philox4x32's multipliers and Weyl key increments (Random123, philox.h).
PHILOX_M0, PHILOX_M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
PHILOX_W0, PHILOX_W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
PHILOX_ROUNDS = 10
CHUNK = 1 << 16  # element pairs per numpy pass: its arrays (512 KiB each) stay in the cache

_MASK32 = np.uint64(0xFFFFFFFF)
_SHIFT32 = np.uint64(32)

# log(m) = 2 atanh(f), f = (m - 1) / (m + 1), |f| <= 0.1716 for m in [sqrt(1/2), sqrt(2)): the series
# 2 f (1 + f^2/3 + f^4/5 + ...) to f^24 leaves < 1e-19 relative.
_ATANH_COEFFS = tuple(1.0 / (2 * k + 1) for k in range(13))
_LN2 = 0.6931471805599453
_SQRT_HALF = 0.7071067811865476
# sin and cos on [0, pi/4] by Taylor to x^21 and x^20: the first term left out is < 2e-18.
_SIN_COEFFS = tuple((-1) ** k / math.factorial(2 * k + 1) for k in range(11))  # exact int, one rounding
_COS_COEFFS = tuple((-1) ** k / math.factorial(2 * k) for k in range(11))
_OCTANT_TURN = 2.0 * 3.141592653589793 / 2.0**32  # radians per unit of the 32-bit angle
_OCTANT_UNITS = 1 << 29  # units of the 32-bit angle per octant


def stream_key(stream: bytes) -> tuple[int, int]:
    """Philox's two 32-bit key words for the named stream: the first 8 bytes of its sha256, little-endian."""
    digest = hashlib.sha256(stream).digest()
    return int.from_bytes(digest[0:4], "little"), int.from_bytes(digest[4:8], "little")


def philox4x32(counters: np.ndarray, key: tuple[int, int], rounds: int = PHILOX_ROUNDS) -> np.ndarray:
    """Philox4x32-``rounds`` of ``counters`` (shape (n, 4), values < 2^32) under ``key``: (n, 4) uint64 words.
    """
    words = _philox_words(
        *(np.ascontiguousarray(counters[:, i], dtype=np.uint64) for i in range(4)), key, rounds
    )
    return np.stack(words, axis=1)


def _philox_words(c0: np.ndarray, c1: np.ndarray, c2: np.ndarray, c3: np.ndarray, key: tuple[int, int],
                  rounds: int = PHILOX_ROUNDS) -> tuple[np.ndarray, ...]:
    """Philox4x32 on four word arrays (overwritten): one round is two 32 x 32 -> 64-bit products (exact in
    uint64), their high halves xored with the other words and the key, their low halves kept."""
    k0, k1 = np.uint64(key[0]), np.uint64(key[1])
    product0, product1 = np.empty_like(c0), np.empty_like(c0)
    for _ in range(rounds):
        np.multiply(c0, PHILOX_M0, out=product0)
        np.multiply(c2, PHILOX_M1, out=product1)
        np.right_shift(product1, _SHIFT32, out=c0)
        c0 ^= c1
        c0 ^= k0
        np.right_shift(product0, _SHIFT32, out=c2)
        c2 ^= c3
        c2 ^= k1
        np.bitwise_and(product1, _MASK32, out=c1)
        np.bitwise_and(product0, _MASK32, out=c3)
        k0, k1 = (k0 + PHILOX_W0) & _MASK32, (k1 + PHILOX_W1) & _MASK32
    return c0, c1, c2, c3


def _horner(x: np.ndarray, coeffs: tuple[float, ...]) -> np.ndarray:
    out = np.full_like(x, coeffs[-1])
    for c in coeffs[-2::-1]:
        out = out * x + c  # two correctly rounded operations (numpy does not fuse them)
    return out


def _log(u: np.ndarray) -> np.ndarray:
    """Natural log of ``u`` in (0, 1], from ``frexp`` and a polynomial (correctly rounded ops only)."""
    mantissa, exponent = np.frexp(u)  # exact: u = mantissa * 2^exponent, mantissa in [1/2, 1)
    low = mantissa < _SQRT_HALF
    mantissa = np.where(low, mantissa * 2.0, mantissa)  # exact
    exponent = (exponent - low).astype(np.float64)
    f = (mantissa - 1.0) / (mantissa + 1.0)
    return exponent * _LN2 + 2.0 * f * _horner(f * f, _ATANH_COEFFS)


def _cos_sin(angle: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of ``2 pi angle / 2^32`` for 32-bit ``angle`` (uint64 array), reduced to [0, pi/4] exactly.
    """
    octant = (angle >> np.uint64(29)).astype(np.int64)
    units = (angle & np.uint64(_OCTANT_UNITS - 1)).astype(np.int64)
    odd = (octant & 1) == 1
    x = np.where(odd, _OCTANT_UNITS - units, units).astype(np.float64) * _OCTANT_TURN  # in [0, pi/4]
    x2 = x * x
    sin_x, cos_x = x * _horner(x2, _SIN_COEFFS), _horner(x2, _COS_COEFFS)
    swap = (octant == 1) | (octant == 2) | (octant == 5) | (octant == 6)
    cos_phi, sin_phi = np.where(swap, sin_x, cos_x), np.where(swap, cos_x, sin_x)
    cos_phi = np.where((octant >= 2) & (octant <= 5), -cos_phi, cos_phi)
    sin_phi = np.where(octant >= 4, -sin_phi, sin_phi)
    return cos_phi, sin_phi


def standard_normal(stream: bytes, count: int) -> np.ndarray:
    """``count`` standard normal float64 values of the named stream, the same bits on every machine.

    Pair ``i`` is Philox of counter ``(i mod 2^32, i div 2^32, 0, 0)``: words 0-1 give
    ``u = (53-bit integer + 1) / 2^53`` in (0, 1], word 2 the angle; value ``2i`` is
    ``sqrt(-2 log u) cos(angle)``, value ``2i + 1`` the sine's.
    """
    key = stream_key(stream)
    out = np.empty(count + (count & 1), dtype=np.float64)
    pairs = len(out) // 2

    def fill(start: int) -> None:
        index = np.arange(start, min(pairs, start + CHUNK), dtype=np.uint64)
        zeros = np.zeros_like(index)
        words = _philox_words(index & _MASK32, index >> _SHIFT32, zeros, zeros.copy(), key)
        bits53 = (words[0] << np.uint64(21)) | (words[1] >> np.uint64(11))
        uniform = (bits53 + np.uint64(1)).astype(np.float64) * 2.0**-53  # in (0, 1]; exact (at most 2^53)
        radius = np.sqrt(-2.0 * _log(uniform))
        cos_phi, sin_phi = _cos_sin(words[2])
        out[2 * start:2 * (start + len(index)):2] = radius * cos_phi
        out[2 * start + 1:2 * (start + len(index)):2] = radius * sin_phi

    for start in range(0, pairs, CHUNK):
        fill(start)
    return out[:count]


def normal_tensor(stream: bytes, shape: tuple[int, ...], std: float, mean: float = 0.0) -> torch.Tensor:
    """A float32 tensor of ``shape`` filled with ``mean + std * N(0, 1)`` of the named stream (computed in
    float64, one rounding to float32 at the end)."""
    count = 1
    for size in shape:
        count *= int(size)
    values = standard_normal(stream, count)
    # in place: the same two correctly rounded operations as ``values * std + mean``, without two more
    # float64 copies of the tensor beside it (issue 75: 16 bytes per element of a model's largest tensor)
    np.multiply(values, float(std), out=values)
    np.add(values, float(mean), out=values)
    return torch.from_numpy(values.astype(np.float32)).reshape(shape)
