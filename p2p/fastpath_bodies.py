"""The frame bodies of received yamux DATA frames: 1 MiB buffers handed back by their readers and reused.

A fresh 1 MiB ``bytearray`` per received frame costs a zero-fill and, when the allocator
maps it anew, 256 page faults; :mod:`p2p.fastpath_noise` decrypts each full-size body
into a buffer from this pool instead, and a reader that is done with one gives it back
(:func:`release_body`).
"""

from __future__ import annotations

from typing import Any

from p2p.fastpath_send import YAMUX_FRAME_PAYLOAD_BYTES

#: Full-size frame bodies handed back by their readers (:func:`release_body`), reused by the next frames.
_BODY_POOL: list[bytearray] = []
#: At most this many are kept (~8 MiB): enough for the bodies one flush of a blob range holds.
BODY_POOL_SIZE = 8


def new_body(size: int) -> bytearray:
    """A buffer for a frame body of ``size`` bytes: a released one if it fits, else a new one."""
    if size == YAMUX_FRAME_PAYLOAD_BYTES:
        try:
            return _BODY_POOL.pop()
        except IndexError:  # empty (or emptied by another host's thread meanwhile)
            pass
    return bytearray(size)


def release_body(chunk: Any) -> None:
    """Give back a frame body that :func:`p2p.fastpath.read_raw` handed out and nothing references any more.

    A fresh 1 MiB ``bytearray`` per received frame costs a zero-fill and, when
    the allocator maps it anew, 256 page faults; a body given back here is
    decrypted into again instead. Only call it once every use of ``chunk``
    (writes, hashing) has finished: its bytes will be overwritten.
    """
    full_size = type(chunk) is bytearray and len(chunk) == YAMUX_FRAME_PAYLOAD_BYTES
    if full_size and len(_BODY_POOL) < BODY_POOL_SIZE:
        _BODY_POOL.append(chunk)
