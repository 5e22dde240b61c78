"""The Float32 soft-float's operations, their torch reference and the batch harness driver.

Shared by tests/test_float32.py (py-evm) and bench/fuzz_float32.py (anvil): :data:`OPS` mirrors the
operation numbers of contracts/src/test/Float32Harness.sol; :func:`reference` computes each one with torch
(numpy where the project computes in Python floats: the norm rule's float64 division and square
root; exact Python for integers wider than 64 bits); :func:`harness_call`
runs a batch on the contract with one ``eth_call``; :func:`mismatches` compares bit for bit, NaN class
only for a NaN result (the library's NaN bits follow x86's rule, docs/SOFTFLOAT.md, and ARM's differ).
Operands are numpy arrays of the encodings: uint32 / uint64, or Python ints for the integer conversions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from eth_abi import decode, encode
from eth_utils import function_signature_to_4byte_selector

import contracts


@dataclass(frozen=True)
class Op:
    """One harness operation: its number, operand width (bytes), result width, arity and kinds."""

    name: str
    number: int
    width: int  # bytes per operand: 4 binary32, 8 binary64, 32 int256
    out_width: int  # bytes per result: 4, 8, or 1 for a bool
    binary: bool

    @property
    def operand(self) -> str:
        return {4: "f32", 8: "f64", 32: "int"}[self.width]

    @property
    def result(self) -> str:
        return {4: "f32", 8: "f64", 1: "bool"}[self.out_width]


OPS = {op.name: op for op in (
    Op("add", 0, 4, 4, True), Op("sub", 1, 4, 4, True), Op("mul", 2, 4, 4, True), Op("div", 3, 4, 4, True),
    Op("mul64", 4, 8, 8, True), Op("toFloat32", 5, 8, 4, False), Op("toFloat64", 6, 4, 8, False),
    Op("fromInt", 7, 32, 8, False), Op("fromInt32", 8, 32, 4, False), Op("isNaN32", 9, 4, 1, False),
    Op("isFinite32", 10, 4, 1, False), Op("same32", 11, 4, 1, True), Op("div64", 12, 8, 8, True),
    Op("sqrt64", 13, 8, 8, False), Op("lt64", 14, 8, 1, True), Op("le64", 15, 8, 1, True),
)}
IDENTITY = Op("identity", 255, 4, 4, False)

_DTYPES = {4: (np.uint32, np.float32, torch.float32), 8: (np.uint64, np.float64, torch.float64)}
_RUN = function_signature_to_4byte_selector("run(uint256,bytes,bytes)")
_GAS = function_signature_to_4byte_selector("gasUsed(uint256,bytes,bytes)")

# ----------------------------------------------------------------------------- operand classes

F32_EDGES = {
    "+0": 0x00000000, "-0": 0x80000000,
    "min_subnormal": 0x00000001, "-min_subnormal": 0x80000001, "subnormal_3": 0x00000003,
    "max_subnormal": 0x007FFFFF, "-max_subnormal": 0x807FFFFF,
    "min_normal": 0x00800000, "-min_normal": 0x80800000,
    "1": 0x3F800000, "-1": 0xBF800000, "1+ulp": 0x3F800001, "1-ulp": 0x3F7FFFFF, "2": 0x40000000,
    "3": 0x40400000, "0.1": 0x3DCCCCCD, "1.5": 0x3FC00000, "2^-75": 0x1A000000, "2^75": 0x65000000,
    "2^24": 0x4B800000, "2^-24": 0x33800000, "2^-126+ulp": 0x00800001,
    "max_finite": 0x7F7FFFFF, "-max_finite": 0xFF7FFFFF, "max_finite-ulp": 0x7F7FFFFE,
    "+inf": 0x7F800000, "-inf": 0xFF800000,
    "qnan": 0x7FC00000, "-qnan": 0xFFC00000, "qnan_payload": 0x7FC12345,
    "snan": 0x7F800001, "-snan": 0xFFA00000,
}
F64_EDGES = {
    "+0": 0x0000000000000000, "-0": 0x8000000000000000,
    "min_subnormal": 0x0000000000000001, "-min_subnormal": 0x8000000000000001, "tiny": 0x0000000000000010,
    "max_subnormal": 0x000FFFFFFFFFFFFF, "min_normal": 0x0010000000000000,
    "1": 0x3FF0000000000000, "-1": 0xBFF0000000000000, "1+ulp": 0x3FF0000000000001,
    "1-ulp": 0x3FEFFFFFFFFFFFFF, "2": 0x4000000000000000, "1.5": 0x3FF8000000000000,
    "0.1": 0x3FB999999999999A, "2^-60": 0x3C30000000000000, "max_finite": 0x7FEFFFFFFFFFFFFF,
    "-max_finite": 0xFFEFFFFFFFFFFFFF, "huge": 0x7FE0000000000000, "+inf": 0x7FF0000000000000,
    "-inf": 0xFFF0000000000000, "qnan": 0x7FF8000000000000, "-qnan": 0xFFF8000000000000,
    "snan": 0x7FF0000000000001,
}
#: binary32's boundaries seen from binary64: the edge cases of the conversions (unary operations only)
F64_CONVERSION_EDGES = {
    "f32_max": 0x47EFFFFFE0000000, "f32_max_half_ulp_up": 0x47EFFFFFF0000000,
    "f32_overflow": 0x47F0000000000000, "f32_min_subnormal": 0x36A0000000000000,
    "f32_half_min_subnormal": 0x3690000000000000, "f32_above_half_min_subnormal": 0x3690000000000001,
    "f32_tie_1": 0x3FF0000010000000, "f32_tie_odd": 0x3FF0000030000000, "f32_above_tie": 0x3FF0000010000001,
    "f32_min_normal": 0x3810000000000000, "f32_below_min_normal": 0x380FFFFFF0000000,
    "f32_subnormal_tie": 0x36A8000000000000, "f32_max_subnormal_up": 0x380FFFFFFFFFFFFF,
}
INT_EDGES = {
    "0": 0, "1": 1, "-1": -1, "2^24": 1 << 24, "2^24+1": (1 << 24) + 1, "2^24+3": (1 << 24) + 3,
    "2^53": 1 << 53, "2^53+1": (1 << 53) + 1, "2^53+3": (1 << 53) + 3, "-(2^53+1)": -((1 << 53) + 1),
    "32767": 32767, "-32767": -32767, "2^63-1": (1 << 63) - 1, "2^64+2^40": (1 << 64) + (1 << 40),
    "2^128-2^103": (1 << 128) - (1 << 103), "2^128-2^104": (1 << 128) - (1 << 104), "2^128": 1 << 128,
    "int256_max": (1 << 255) - 1, "int256_min": -(1 << 255), "2^255-2^202": (1 << 255) - (1 << 202),
}


def edge_values(op: Op) -> np.ndarray | list[int]:
    """Every edge value of ``op``'s operand kind (module docstring)."""
    if op.width == 32:
        return list(INT_EDGES.values())
    table = F32_EDGES if op.width == 4 else F64_EDGES
    if op.width == 8 and not op.binary:
        table = {**table, **F64_CONVERSION_EDGES}
    return np.array(list(table.values()), dtype=_DTYPES[op.width][0])


def edge_operands(op: Op) -> tuple:
    """``(a, b)``: every edge value, or for a binary operation every ordered pair of edge values."""
    edges = edge_values(op)
    if not op.binary:
        return edges, None
    return np.repeat(edges, len(edges)), np.tile(edges, len(edges))


def random_bits(rng: np.random.Generator, width: int, count: int) -> np.ndarray | list[int]:
    """Uniformly random encodings (every bit pattern, NaNs and subnormals included), or random integers
    of random bit lengths up to 256 with either sign."""
    if width == 32:
        lengths = rng.integers(0, 256, size=count).tolist()
        values = []
        for length in lengths:
            word = int.from_bytes(rng.bytes(32), "big")
            magnitude = word >> (257 - length) if length else 0  # at most 255 bits
            values.append(-magnitude if word & 1 else magnitude)
        return values
    return rng.integers(0, 1 << (8 * width), size=count, dtype=_DTYPES[width][0], endpoint=False)


def biased_bits(rng: np.random.Generator, width: int, count: int) -> np.ndarray | list[int]:
    """Random encodings biased to the edges: exponents near 0, 1, the bias and the top, mantissas near 0
    and all ones, and short mantissas (exact ties and exact results are frequent)."""
    if width == 32:
        lengths = rng.choice([1, 2, 23, 24, 25, 26, 52, 53, 54, 55, 63, 64, 127, 128, 129, 200, 255],
                             size=count)
        values = []
        for length, low, sign in zip(lengths.tolist(), rng.integers(0, 1 << 8, size=count).tolist(),
                                     rng.integers(0, 2, size=count).tolist()):
            magnitude = (1 << length) - 1 - low if low < 128 else (1 << (length - 1)) + low
            magnitude = min(max(magnitude, 0), (1 << 255) - 1)
            values.append(-magnitude if sign else magnitude)
        return values
    unsigned, _, _ = _DTYPES[width]
    mantissa_bits, exponent_top = (23, 255) if width == 4 else (52, 2047)
    bias = exponent_top // 2
    exponents = np.concatenate([
        rng.integers(0, 4, size=count), rng.integers(bias - 30, bias + 30, size=count),
        rng.integers(exponent_top - 3, exponent_top + 1, size=count),
        rng.integers(0, exponent_top + 1, size=count),
    ])
    exponents = rng.permutation(exponents)[:count].astype(np.uint64)
    if width == 8:
        # binary32's range seen from binary64: the conversions' overflow and underflow boundaries
        near = rng.integers(0, 3, size=count)
        exponents = np.where(near == 0, rng.integers(1023 - 152, 1023 - 124, size=count).astype(np.uint64),
                             np.where(near == 1,
                                      rng.integers(1023 + 125, 1023 + 130, size=count).astype(np.uint64),
                                      exponents))
    kind = rng.integers(0, 4, size=count)
    full = np.uint64((1 << mantissa_bits) - 1)
    low = rng.integers(0, 1 << 8, size=count).astype(np.uint64)
    short = rng.integers(0, 1 << 6, size=count).astype(np.uint64) << np.uint64(mantissa_bits - 6)
    anything = rng.integers(0, 1 << mantissa_bits, size=count, dtype=np.uint64)
    mantissas = np.select([kind == 0, kind == 1, kind == 2], [low, full - low, short], anything)
    signs = rng.integers(0, 2, size=count).astype(np.uint64) << np.uint64(8 * width - 1)
    bits = signs | (exponents << np.uint64(mantissa_bits)) | mantissas
    return bits.astype(unsigned)


def near_bits(rng: np.random.Generator, values: np.ndarray) -> np.ndarray:
    """``values`` moved by a few units in the last place: operands whose results round near a tie."""
    step = rng.integers(-3, 4, size=values.size).astype(np.int64)
    return (values.astype(np.int64) + step).astype(values.dtype)


def tie_operands(rng: np.random.Generator, op: Op, count: int) -> tuple:
    """``(a, b)`` whose exact results lie on a rounding tie, or round up into the next binade, or are exact
    where rounding could go wrong (perfect squares, equal and adjacent pairs for the comparisons)."""
    name = op.name
    signs32 = rng.integers(0, 2, size=count).astype(np.uint32) << np.uint32(31)
    signs64 = rng.integers(0, 2, size=count).astype(np.uint64) << np.uint64(63)
    if name in ("add", "sub"):
        # b = 1 or 3 half units in the last place of a; a's mantissa all ones half the time (the binade carry)
        exponent = rng.integers(30, 220, size=count).astype(np.uint32)
        mantissa = np.where(rng.integers(0, 2, size=count) == 0, np.uint32(0x7FFFFF),
                            rng.integers(0, 1 << 23, size=count).astype(np.uint32))
        a = signs32 | (exponent << np.uint32(23)) | mantissa
        three = rng.integers(0, 2, size=count).astype(np.uint32)
        b = (a & np.uint32(0x80000000)) | ((exponent - np.uint32(24) + three) << np.uint32(23)) \
            | (three << np.uint32(22))
        return a, b ^ (signs32 if name == "add" else np.uint32(0))
    if name in ("mul", "mul64"):
        # an odd significand below 4/3 times 1.5: the product's dropped bits are exactly one half; or
        # (2 - ulp) x (1 + ulp) = 2 - ulp^2, which rounds up to 2
        width = op.width
        unsigned = _DTYPES[width][0]
        mbits, bias = (23, 127) if width == 4 else (52, 1023)
        low = 1 << mbits
        mantissa = (rng.integers(0, low // 3, size=count, dtype=np.uint64) | np.uint64(1))
        ea = rng.integers(bias - 60, bias + 60, size=count).astype(np.uint64)
        eb = rng.integers(bias - 60, bias + 60, size=count).astype(np.uint64)
        a = (ea << np.uint64(mbits)) | mantissa
        b = (eb << np.uint64(mbits)) | np.uint64(low >> 1)
        carry = rng.integers(0, 2, size=count) == 0
        a = np.where(carry, (ea << np.uint64(mbits)) | np.uint64(low - 1), a)
        b = np.where(carry, (eb << np.uint64(mbits)) | np.uint64(1), b)
        signs = signs32 if width == 4 else signs64
        return (a.astype(unsigned) | signs), b.astype(unsigned)
    if name in ("div", "div64"):
        # an odd significand divided by 2 into the subnormal range: an exact tie between two subnormals
        width = op.width
        unsigned = _DTYPES[width][0]
        mbits, bias = (23, 127) if width == 4 else (52, 1023)
        exponent = rng.integers(0, 2, size=count).astype(np.uint64)
        mantissa = rng.integers(0, 1 << mbits, size=count, dtype=np.uint64) | np.uint64(1)
        a = (exponent << np.uint64(mbits)) | mantissa
        b = np.full(count, (bias + 1) << mbits, dtype=np.uint64)
        signs = signs32 if width == 4 else signs64
        return a.astype(unsigned) | signs, b.astype(unsigned)
    if name == "toFloat32":
        # half a binary32 unit below or above: normal (low 29 bits 1 << 28) or subnormal ((2k + 1) 2^-150)
        exponent = rng.integers(1023 - 126, 1023 + 128, size=count).astype(np.uint64)
        mantissa = (rng.integers(0, 1 << 23, size=count, dtype=np.uint64) << np.uint64(29)) | np.uint64(
            1 << 28)
        normal = signs64 | (exponent << np.uint64(52)) | mantissa
        odd = (2 * rng.integers(0, 1 << 23, size=count) + 1).astype(np.float64)
        subnormal = (np.ldexp(odd, -150).view(np.uint64)) | signs64
        return np.where(rng.integers(0, 2, size=count) == 0, normal, subnormal), None
    if name in ("fromInt", "fromInt32"):
        keep = 53 if name == "fromInt" else 24
        values = []
        for shift, high, sign in zip(rng.integers(1, 200, size=count).tolist(),
                                     rng.integers(0, 1 << 62, size=count).tolist(),
                                     rng.integers(0, 2, size=count).tolist()):
            top = (1 << keep) - 1 if high & 1 else (1 << (keep - 1)) | (high >> (62 - keep + 1))
            value = (top << shift) | (1 << (shift - 1))
            value = min(value, (1 << 255) - 1)
            values.append(-value if sign else value)
        return values, None
    if name == "sqrt64":
        roots = rng.integers(1, 1 << 26, size=count).astype(np.float64)
        squares = (roots * roots).view(np.uint64)  # exact: 52 bits at most
        return squares + rng.integers(0, 2, size=count).astype(np.uint64), None
    if op.binary:  # same32, lt64, le64: equal, adjacent, and opposite-signed pairs
        a = random_bits(rng, op.width, count)
        unsigned = a.dtype.type
        sign = unsigned(1 << (8 * op.width - 1))
        step = rng.integers(0, 4, size=count)
        b = np.select([step == 0, step == 1, step == 2], [a, a + unsigned(1), a ^ sign], a - unsigned(1))
        return a, b.astype(a.dtype)
    return random_bits(rng, op.width, count), None


# ----------------------------------------------------------------------------- the torch reference


def _floats(bits: np.ndarray) -> torch.Tensor:
    unsigned, floating, _ = _DTYPES[bits.dtype.itemsize]
    return torch.from_numpy(np.ascontiguousarray(bits, dtype=unsigned).view(floating))


def _bits(tensor: torch.Tensor) -> np.ndarray:
    unsigned, floating, _ = _DTYPES[tensor.element_size()]
    return tensor.numpy().view(unsigned)


def int_to_float32(value: int) -> int:
    """The binary32 nearest the integer ``value`` (ties to even), as its encoding, by exact integer steps:
    a magnitude wider than 62 bits keeps its top 61 bits and a sticky bit, which rounds the same, then
    numpy's int64 -> float32 conversion (correctly rounded) and an exact scaling by a power of two."""
    magnitude = abs(value)
    shift = max(magnitude.bit_length() - 62, 0)
    if shift:
        magnitude = (magnitude >> shift) | (1 if magnitude & ((1 << shift) - 1) else 0)
    with np.errstate(over="ignore"):
        result = np.ldexp(np.float32(np.int64(magnitude)), shift).astype(np.float32)
    return int(np.float32(-result if value < 0 else result).view(np.uint32))


def reference(op: Op, a, b=None) -> np.ndarray:
    """What torch (CPU) gives for ``op`` on the encodings ``a`` (and ``b``): encodings, or 0/1 for a bool."""
    name = op.name
    if name == "fromInt":
        return np.array([float(v) for v in a], dtype=np.float64).view(np.uint64)
    if name == "fromInt32":
        return np.array([int_to_float32(v) for v in a], dtype=np.uint32)
    x = _floats(a)
    y = _floats(b) if op.binary else None
    if name in ("add", "sub", "mul", "div", "mul64"):
        kernel = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
                  "mul64": torch.mul}[name]
        return _bits(kernel(x, y))
    # The float64 division and square root of the norm rule are Python's (training/robust.py), which are
    # IEEE-754's correctly rounded operations; so is numpy's. torch's CPU float64 sqrt is not always (it
    # returns 1.0 for sqrt(1 - 2**-53), whose correctly rounded root is 1 - 2**-53).
    if name in ("div64", "sqrt64"):
        with np.errstate(all="ignore"):
            value = np.divide(x.numpy(), y.numpy()) if name == "div64" else np.sqrt(x.numpy())
        return value.view(np.uint64)
    if name == "toFloat32":
        return _bits(x.to(torch.float32))
    if name == "toFloat64":
        return _bits(x.to(torch.float64))
    if name == "isNaN32":
        return torch.isnan(x).numpy().astype(np.uint8)
    if name == "isFinite32":
        return torch.isfinite(x).numpy().astype(np.uint8)
    if name == "same32":
        return ((np.asarray(a) == np.asarray(b)) | (torch.isnan(x) & torch.isnan(y)).numpy()).astype(np.uint8)
    if name == "lt64":
        return (x < y).numpy().astype(np.uint8)
    if name == "le64":
        return (x <= y).numpy().astype(np.uint8)
    raise KeyError(name)


def is_nan(bits: np.ndarray, width: int) -> np.ndarray:
    """Whether each encoding of a ``width``-byte float is a NaN."""
    if width == 4:
        return (bits.astype(np.uint32) & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return (bits.astype(np.uint64) & np.uint64(0x7FFFFFFFFFFFFFFF)) > np.uint64(0x7FF0000000000000)


def mismatches(op: Op, got: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """Indices where ``got`` differs from ``expected``: bit for bit, NaN class only for a NaN result."""
    if op.out_width == 1:
        return np.flatnonzero(got != expected)
    nan_expected = is_nan(expected, op.out_width)
    agree = np.where(nan_expected, is_nan(got, op.out_width), got == expected)
    return np.flatnonzero(~agree)


# ----------------------------------------------------------------------------- the harness


def pack(op: Op, values) -> bytes:
    """Operands as the harness reads them: big-endian, ``op.width`` bytes each."""
    if op.width == 32:
        return b"".join((v & ((1 << 256) - 1)).to_bytes(32, "big") for v in values)
    unsigned = _DTYPES[op.width][0]
    return np.asarray(values, dtype=unsigned).astype(np.dtype(unsigned).newbyteorder(">")).tobytes()


def unpack(op: Op, data: bytes, width: int | None = None) -> np.ndarray:
    """Results as the harness writes them (``width`` bytes each; default the op's result width)."""
    width = width or op.out_width
    dtype = {1: np.uint8, 4: np.dtype(">u4"), 8: np.dtype(">u8")}[width]
    native = {1: np.uint8, 4: np.uint32, 8: np.uint64}[width]
    return np.frombuffer(data, dtype=dtype).astype(native)


def deploy_harness(w3) -> str:
    """Deploy Float32Harness from its committed artifact; its address."""
    artifact = contracts.artifact("Float32Harness")
    factory = w3.eth.contract(abi=artifact["abi"], bytecode=artifact["bytecode"])
    tx = factory.constructor().transact({"from": w3.eth.accounts[0]})
    return w3.eth.wait_for_transaction_receipt(tx)["contractAddress"]


def harness_call(w3, address: str, op: Op, a, b=None, *, gas: int | None = None,
                 measure: bool = False) -> np.ndarray:
    """One ``eth_call`` of the harness: ``op`` on every operand; ``measure``: the gas of each instead."""
    payload = encode(["uint256", "bytes", "bytes"],
                     [op.number, pack(op, a), pack(op, b) if op.binary else b""])
    call = {"to": address, "data": (_GAS if measure else _RUN) + payload}
    if gas is not None:
        call["gas"] = gas
    (data,) = decode(["bytes"], w3.eth.call(call))
    return unpack(op, data, 4 if measure else None)
