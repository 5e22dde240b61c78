"""The wire format of a compressed pseudo-gradient and its strict parsing (the bit packing and the exact
reconstruction are :mod:`training.codec_exact`).

Decode (bit-exact on every IEEE-754 platform: no rounded float reduction, a
fixed order of elementwise ops):

* ``quant``:   ``out = float32(Xq) * s[None, :]`` (one float32 multiply per element;
  ``|Xq| <= 32767`` converts exactly).
* ``lowrank``: ``M = (P_int * w[None, :]) @ Q_int^T``, an integer matrix (the
  decoder bounds ``r * qmax_b**2 * 65535 < 2**53``, so a float64 matrix product
  computes it exactly in any summation order: :func:`training.codec_exact.reconstruct_lowrank`),
  then ``out = float32(float64(M) * float64(S))``: the float64 product and the
  float32 rounding are each correctly rounded.
* ``raw``: the float32 values.

Wire format (msgpack, version 1)::

    {"v": 1, "st": stage_index, "rd": outer_round,
     "t": [entry, ...]}                  # one entry per tensor, names ascending
    entry = {"n": name, "s": [dims], "c": "quant",   "b": bits, "q": packed, "x": f32 scales}
          | {"n": name, "s": [dims], "c": "lowrank", "b": bits, "r": rank,
             "p": packed P, "q": packed Q, "w": u16 LE weights, "x": f32 S}
          | {"n": name, "s": [dims], "c": "raw", "d": f32 values}

Version 2 (a run whose rounds are bounded by time, ``diloco.round_budget_s > 0``; issue 44) adds one
header field, the inner steps the replica trained and declares for this round::

    {"v": 2, "st": stage_index, "rd": outer_round, "ns": declared_steps, "t": [entry, ...]}

``ns`` is a whole number in ``[1, MAX_DECLARED_STEPS]`` (the run's own range is checked by the
aggregation, which knows the run). A fixed-H run's contributions stay version 1, byte for byte;
both versions decode everywhere (:func:`decode_declared`).

Integers are packed as ``u = q + qmax_b`` in b bits, little-endian within bytes
(value j of a byte at bit ``b*j``), zero padding; floats are little-endian
float32 bytes. :func:`decode_contribution` rejects anything else with
:class:`~training.errors.ContributionDecodeError`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import msgpack
import numpy as np
import torch

from training.codec_exact import (  # qmax, f32_bytes, pack_ints, unpack_ints: importers take them from there
    f32_tensor,
    product_bound,
    qmax,
    reconstruct_lowrank,
    reconstruct_quant,
    unpack_array,
)
from training.errors import (
    ContributionCodecRefused,
    ContributionDecodeError,
    ContributionEncodeError,
    ContributionNonFiniteError,
    ContributionShapeError,
)

CODEC_VERSION = 1
#: What ``msgpack.unpackb`` raises on bytes that are no valid message: its own errors, ValueError for a limit
#: or a hook's refusal (ContributionDecodeError is one), TypeError for an unhashable map key.
MSGPACK_ERRORS = (msgpack.UnpackException, ValueError, TypeError)
#: The version whose header declares the inner steps trained (``"ns"``).
DECLARED_STEPS_VERSION = 2
#: The most inner steps a contribution may declare (far above any H; a bound for the decoder).
MAX_DECLARED_STEPS = 1 << 20
WEIGHT_BITS = 16  # integer weights of the low-rank columns
MAX_WEIGHT = (1 << WEIGHT_BITS) - 1
MAX_RANK = 64  # keeps the int64 decode product below 2**53 for every bit width
SUPPORTED_BITS = (2, 4, 8, 16)
# A float32 product (or float64 -> float32 rounding) of magnitude below this cannot round to inf.
_FINITE_BOUND = 2.0**127


def matrix_view_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The ``(m, n)`` matrix a tensor of ``shape`` is coded as (1-D: one column)."""
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return shape[0], 1
    return shape[0], math.prod(shape[1:])


# ----------------------------------------------------------------------------- decoding


def _field(entry: dict, key: str, kind: type, where: str):
    if key not in entry:
        raise ContributionDecodeError(f"{where}: missing field {key!r}")
    value = entry[key]
    # bool is an int subclass; a bool where an int belongs is malformed input.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ContributionDecodeError(
            f"{where}: field {key!r} is {type(value).__name__}, not {kind.__name__}"
        )
    return value


def _check_keys(entry: dict, allowed: set[str], where: str) -> None:
    extra = set(entry) - allowed
    if extra:
        raise ContributionDecodeError(f"{where}: unknown fields {sorted(map(str, extra))}")


def _decode_entry(
    entry: object, name: str, shape: tuple[int, ...], index: int, refuse_raw: bool = False
) -> tuple[torch.Tensor, bool]:
    """``(decoded tensor, whether it can hold a non-finite value)``.

    Finite scales can still overflow float32 in the product. The flag is False
    only when a bound on the inputs proves every output finite (raw values were
    checked as they were read), so the caller skips a pass over the output.
    """
    where = f"tensor {index} ({name!r})"
    if not isinstance(entry, dict):
        raise ContributionDecodeError(f"{where}: entry is {type(entry).__name__}, not a map")
    got_name = _field(entry, "n", str, where)
    if got_name != name:
        raise ContributionShapeError(f"{where}: name {got_name!r} where {name!r} was expected")
    got_shape = _field(entry, "s", list, where)
    if [d for d in got_shape if not isinstance(d, int) or isinstance(d, bool)] or tuple(got_shape) != shape:
        raise ContributionShapeError(f"{where}: shape {got_shape} does not match the stage's {list(shape)}")
    codec = _field(entry, "c", str, where)
    m, n = matrix_view_shape(shape)
    if codec == "raw":
        if refuse_raw and m * n > 0:
            # A compressed run's encoder only sends raw for empty tensors (compression.encode_tensor).
            raise ContributionCodecRefused(f"{where}: raw codec in a compressed run")
        _check_keys(entry, {"n", "s", "c", "d"}, where)
        return f32_tensor(_field(entry, "d", bytes, where), m * n, where).reshape(shape), False
    bits = _field(entry, "b", int, where)
    if bits not in SUPPORTED_BITS:
        raise ContributionDecodeError(f"{where}: unsupported bit width {bits}")
    if codec == "quant":
        _check_keys(entry, {"n", "s", "c", "b", "q", "x"}, where)
        q_int = torch.from_numpy(
            unpack_array(_field(entry, "q", bytes, where), bits, m * n, where, np.float32)
        ).reshape(m, n)
        scales = f32_tensor(_field(entry, "x", bytes, where), n, where, nonnegative=True)
        # |float32(q) * s| <= qmax * max(s), rounded: finite if that is below 2**127.
        bound = qmax(bits) * float(scales.max()) if scales.numel() else 0.0
        return reconstruct_quant(q_int, scales).reshape(shape), not bound < _FINITE_BOUND
    if codec == "lowrank":
        _check_keys(entry, {"n", "s", "c", "b", "r", "p", "q", "w", "x"}, where)
        if len(shape) < 2:
            raise ContributionDecodeError(f"{where}: lowrank codec on a {len(shape)}-D tensor")
        rank = _field(entry, "r", int, where)
        if not 1 <= rank <= min(m, n, MAX_RANK):
            raise ContributionDecodeError(f"{where}: rank {rank} outside [1, {min(m, n, MAX_RANK)}]")
        p_int = torch.from_numpy(
            unpack_array(_field(entry, "p", bytes, where), bits, m * rank, where, np.float64)
        )
        q_int = torch.from_numpy(
            unpack_array(_field(entry, "q", bytes, where), bits, n * rank, where, np.float64)
        )
        p_int, q_int = p_int.reshape(m, rank), q_int.reshape(n, rank)
        weight_bytes = _field(entry, "w", bytes, where)
        if len(weight_bytes) != 2 * rank:
            raise ContributionDecodeError(f"{where}: {len(weight_bytes)} weight bytes, expected {2 * rank}")
        weights = torch.from_numpy(np.frombuffer(weight_bytes, dtype="<u2").astype(np.int64))
        scale = f32_tensor(_field(entry, "x", bytes, where), 1, where, nonnegative=True).reshape(())
        # |float64(M) * S| <= max|P| * max|w| * max|Q| * rank * S, rounded twice: finite below 2**127.
        bound = product_bound(p_int, q_int, weights)
        value = reconstruct_lowrank(p_int, q_int, weights, scale, bound=bound).reshape(shape)
        return value, not bound * float(scale) < _FINITE_BOUND
    raise ContributionDecodeError(f"{where}: unknown codec {codec!r}")


def pack_contribution(stage_index: int, outer_round: int, entries: list[dict]) -> bytes:
    """The wire bytes of a contribution: its header and the encoded tensors, in the given (name) order."""
    return msgpack.packb(
        {"v": CODEC_VERSION, "st": stage_index, "rd": outer_round, "t": entries}, use_bin_type=True
    )


def check_declared_steps(steps: object) -> int:
    """``steps`` if it is a whole number in ``[1, MAX_DECLARED_STEPS]``, else ContributionDecodeError."""
    if type(steps) is not int:
        raise ContributionDecodeError(f"declared inner steps {steps!r}: not a whole number")
    if not 1 <= steps <= MAX_DECLARED_STEPS:
        raise ContributionDecodeError(f"declared inner steps {steps}: must be in [1, {MAX_DECLARED_STEPS}]")
    return steps


def declare_steps(blob: bytes, steps: int) -> bytes:
    """The version-2 bytes of a version-1 contribution ``blob``: the same tensors, ``steps`` declared.

    The encoders write version 1; the stage engine of a time-bounded run stamps the count it trained.
    """
    check_declared_steps(steps)
    message = msgpack.unpackb(blob, raw=False, use_list=True)
    if message.get("v") != CODEC_VERSION:
        raise ContributionEncodeError(f"declare_steps needs a version {CODEC_VERSION} contribution")
    return msgpack.packb({"v": DECLARED_STEPS_VERSION, "st": message["st"], "rd": message["rd"], "ns": steps,
                          "t": message["t"]}, use_bin_type=True)


def header_steps(data: bytes) -> int | None:
    """The inner steps a contribution declares; None for version 1 and for anything that is not a
    well-formed declaration (never raises: the strict check is :func:`decode_declared`'s)."""
    try:
        message = msgpack.unpackb(bytes(data), raw=False, max_bin_len=len(data), max_map_len=16)
        steps = (
            message.get("ns")
            if isinstance(message, dict) and message.get("v") == DECLARED_STEPS_VERSION
            else None
        )
        return check_declared_steps(steps) if steps is not None else None
    except MSGPACK_ERRORS:
        return None


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
    refuse_raw: bool = False,
) -> dict[str, torch.Tensor]:
    """Decode a contribution (either version) into float32 tensors, strictly: :func:`decode_declared`
    without the declared steps."""
    return decode_declared(data, expected_shapes, stage_index=stage_index, outer_round=outer_round,
                           refuse_raw=refuse_raw)[1]


def decode_declared(
    data: bytes,
    expected_shapes: Mapping[str, tuple[int, ...]],
    *,
    stage_index: int | None = None,
    outer_round: int | None = None,
    refuse_raw: bool = False,
) -> tuple[int | None, dict[str, torch.Tensor]]:
    """``(declared inner steps, float32 tensors)`` of a contribution, strictly; the steps are None for a
    version-1 contribution (a fixed-H run's: it trained exactly H).

    ``expected_shapes`` is the stage's ``{name: shape}``; the contribution must
    hold exactly those tensors, in ascending name order. When given,
    ``stage_index`` and ``outer_round`` must match the header. Anything else
    (oversized, truncated, wrong types, wrong shapes, out-of-range integers,
    non-finite floats, trailing bytes) raises :class:`ContributionDecodeError`
    (:class:`ContributionShapeError` for names, count or shapes that differ
    from the stage's, :class:`ContributionNonFiniteError` for non-finite
    values). ``refuse_raw`` (a run with compression on) makes a ``raw`` entry of
    a non-empty tensor a protocol violation, :class:`ContributionCodecRefused`.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ContributionDecodeError(f"contribution is {type(data).__name__}, not bytes")
    limit = max_contribution_bytes(expected_shapes)
    if len(data) > limit:
        raise ContributionDecodeError(f"contribution of {len(data)} bytes exceeds the stage's limit {limit}")
    # A well-formed contribution holds 2 + 2 per tensor maps and arrays (header, list, entry, shape).
    # More are refused as they are built: nested empty arrays cost ~60 bytes of Python list per byte.
    containers = [0, 2 + 2 * len(expected_shapes)]

    def bounded(value):
        containers[0] += 1
        if containers[0] > containers[1]:
            raise ValueError(f"more than {containers[1]} maps and arrays")
        return value

    try:
        message = msgpack.unpackb(
            bytes(data), raw=False, use_list=True, strict_map_key=True,
            max_bin_len=limit, max_str_len=4096, max_array_len=max(len(expected_shapes), 64) + 8,
            max_map_len=16, max_ext_len=0, object_hook=bounded, list_hook=bounded,
        )
    except MSGPACK_ERRORS as exc:
        raise ContributionDecodeError(
            f"contribution is not valid msgpack: {type(exc).__name__}: {exc}"
        ) from None
    if not isinstance(message, dict):
        raise ContributionDecodeError("contribution is not a msgpack map")
    version = _field(message, "v", int, "contribution")
    if version not in (CODEC_VERSION, DECLARED_STEPS_VERSION):
        raise ContributionDecodeError(f"contribution version {version}, this node decodes {CODEC_VERSION} "
                                      f"and {DECLARED_STEPS_VERSION}")
    declared = None
    if version == DECLARED_STEPS_VERSION:
        _check_keys(message, {"v", "st", "rd", "ns", "t"}, "contribution")
        if "ns" not in message:
            raise ContributionDecodeError(f"contribution version {version} without its declared inner steps")
        declared = check_declared_steps(message["ns"])
    else:
        _check_keys(message, {"v", "st", "rd", "t"}, "contribution")
    got_stage = _field(message, "st", int, "contribution")
    got_round = _field(message, "rd", int, "contribution")
    if stage_index is not None and got_stage != stage_index:
        raise ContributionDecodeError(f"contribution is for stage {got_stage}, expected {stage_index}")
    if outer_round is not None and got_round != outer_round:
        raise ContributionDecodeError(f"contribution is for round {got_round}, expected {outer_round}")
    entries = _field(message, "t", list, "contribution")
    names = sorted(expected_shapes)
    if len(entries) != len(names):
        raise ContributionShapeError(f"contribution has {len(entries)} tensors, the stage has {len(names)}")
    decoded = {}
    for index, (entry, name) in enumerate(zip(entries, names)):
        value, unchecked = _decode_entry(entry, name, tuple(expected_shapes[name]), index, refuse_raw)
        # Finite scales can still overflow float32 in the product: refuse, never average an inf.
        if unchecked and not bool(torch.isfinite(value).all()):
            raise ContributionNonFiniteError(f"tensor {index} ({name!r}): decodes to non-finite values")
        decoded[name] = value
    return declared, decoded
