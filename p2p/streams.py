"""Giving up on a stream or connection: what a failing one raises, and how to close or reset it quietly."""

from __future__ import annotations

from typing import Any

import trio
from libp2p.exceptions import BaseLibp2pError

#: What a stream, connection or dial that failed raises: py-libp2p 0.8.1 wraps transport failures in
#: its own errors (streams, muxer, security, swarm, multiselect); trio's for a resource broken or closed
#: under us; the socket layer's (ConnectionError among them).
CONNECTION_ERRORS: tuple[type[Exception], ...] = (
    BaseLibp2pError,
    trio.BrokenResourceError,
    trio.ClosedResourceError,
    OSError,
)


async def reset_quietly(stream: Any) -> None:
    """Reset a stream we give up on, shielded and bounded (it may already be broken)."""
    with trio.move_on_after(1) as cleanup:
        cleanup.shield = True
        try:
            await stream.reset()
        except CONNECTION_ERRORS:
            pass  # already broken: nothing left to tell the peer


async def close_quietly(stream: Any) -> None:
    """Close our side of a stream, giving up after 1 s (the peer may be gone)."""
    with trio.move_on_after(1):
        try:
            await stream.close()
        except CONNECTION_ERRORS:
            pass  # the peer or the connection is gone: the stream ends either way
