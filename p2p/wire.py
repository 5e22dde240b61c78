"""Framing shared by the dlx stream protocols: 4-byte big-endian length + msgpack map."""

from __future__ import annotations

from typing import Any

import msgpack

from p2p.errors import P2PError


class ProtocolViolation(P2PError):
    """A peer sent a frame that does not follow the protocol (closed, truncated, oversized, malformed)."""


async def read_exactly(stream: Any, length: int) -> bytes:
    """Read exactly ``length`` bytes (a yamux read returns at most one buffered frame)."""
    parts: list[bytes] = []
    remaining = length
    while remaining:
        chunk = await stream.read(remaining)
        if not chunk:
            raise ProtocolViolation(f"stream closed with {remaining} of {length} bytes missing")
        parts.append(chunk)
        remaining -= len(chunk)
    return b"".join(parts)


async def read_frame(stream: Any, max_len: int, max_containers: int | None = None) -> dict[str, Any]:
    """Read one length-prefixed msgpack map of at most ``max_len`` bytes (see :func:`decode_body`)."""
    length = int.from_bytes(await read_exactly(stream, 4), "big")
    if length > max_len:
        raise ProtocolViolation(f"frame of {length} bytes exceeds limit {max_len}")
    return decode_body(await read_exactly(stream, length), max_containers)


def container_bound(limit: int | None, error, repeated=None) -> dict[str, Any]:
    """msgpack ``unpackb`` hooks that raise ``error()`` once more than ``limit`` maps and arrays are built
    (None: no bound), and ``repeated(key)`` for a map that holds a key twice.

    Checked while decoding, before any key is looked at: nested empty containers cost tens of
    bytes of Python objects per input byte. A repeated key is refused, not resolved: msgpack
    libraries differ on which of the two values they keep (the first, the last, an error), so a
    map with one would mean different things to different receivers (docs/PROTOCOL.md).
    """
    built = [0]
    repeated = repeated or (lambda key: ValueError(f"a map holds the key {key!r} twice"))

    def count(container: Any) -> Any:
        built[0] += 1
        if limit is not None and built[0] > limit:
            raise error()
        return container

    def pairs(items: list[tuple[Any, Any]]) -> dict[Any, Any]:
        count(items)
        out = dict(items)
        if len(out) != len(items):
            seen: set = set()
            raise repeated(next(k for k, _ in items if k in seen or seen.add(k)))
        return out

    return {"object_pairs_hook": pairs, "list_hook": count}


def decode_body(body: bytes, max_containers: int | None = None) -> dict[str, Any]:
    """The msgpack map of one frame body (the bytes after the length prefix).

    ``max_containers`` bounds the maps and arrays the body may hold in all: a 16 MiB body of
    nested empty arrays would otherwise become ~1 GiB of Python lists (one per byte) before
    any field is looked at. Decoding stops at the first container over the bound.
    """
    hooks = container_bound(
        max_containers, lambda: ProtocolViolation(f"frame holds more than {max_containers} maps and arrays"),
        lambda key: ProtocolViolation(f"malformed frame: a map holds the key {key!r} twice"))
    try:
        frame = msgpack.unpackb(body, raw=False, strict_map_key=True, max_ext_len=0, **hooks)
    except ProtocolViolation:
        raise
    except (ValueError, TypeError, msgpack.UnpackException) as exc:  # msgpack's errors on bad input
        raise ProtocolViolation(f"malformed frame: {type(exc).__name__}: {exc}") from None
    if not isinstance(frame, dict):
        raise ProtocolViolation("frame is not a map")
    return frame


def decode_frame(data: bytes, max_len: int, max_containers: int | None = None) -> dict[str, Any]:
    """Decode one complete frame (length prefix + body) held in memory; the inverse of encode_frame."""
    if len(data) < 4:
        raise ProtocolViolation(f"frame of {len(data)} bytes has no length prefix")
    length = int.from_bytes(data[:4], "big")
    if length > max_len:
        raise ProtocolViolation(f"frame of {length} bytes exceeds limit {max_len}")
    if len(data) != 4 + length:
        raise ProtocolViolation(f"frame announces {length} body bytes, holds {len(data) - 4}")
    return decode_body(bytes(data[4:]), max_containers)


def encode_frame(frame: dict[str, Any]) -> bytes:
    """4-byte big-endian body length, then the body: msgpack of ``frame`` (keys in insertion order)."""
    body = msgpack.packb(frame, use_bin_type=True)
    return len(body).to_bytes(4, "big") + body


async def write_frame(stream: Any, frame: dict[str, Any]) -> None:
    await stream.write(encode_frame(frame))


def field(frame: dict[str, Any], name: str, kind: type, low: int | None = None) -> Any:
    """``frame[name]`` checked for type (bool is not an int) and lower bound."""
    value = frame.get(name)
    if type(value) is not kind:
        raise ProtocolViolation(f"field {name!r}: expected {kind.__name__}, got {type(value).__name__}")
    if low is not None and value < low:
        raise ProtocolViolation(f"field {name!r}={value}: must be >= {low}")
    return value
