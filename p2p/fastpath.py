"""Corrections to py-libp2p 0.8.1's TCP + Noise + yamux data path, applied at import time.

Profiling a 100 MB blob fetch (py-spy, cProfile, perf) showed the receiving
host thread spending most of its time in per-message and per-syscall Python
work of py-libp2p, and in copies. Per 100 MB the stock stack made ~4200
``recv`` calls (a 2-byte Noise length prefix, then the body, often in pieces),
~1700 yamux data frames (each a full pass through ``handle_incoming``, a
wake-up of the reader and several lock round trips), ~1700 WINDOW_UPDATE
frames (one per read, each encrypted and sent on its own), and copied every
received byte about ten times. These patches change only how this host slices,
buffers, copies and acknowledges bytes; what goes on the wire stays standard
Noise and yamux, so any libp2p peer is unaffected (docs/P2P.md, "Transport and
security"):

- outgoing yamux data frames carry up to ``YAMUX_FRAME_NOISE_MESSAGES`` full
  Noise messages (never more than the peer's window allows, as the yamux spec
  requires), encrypted in place into one reused buffer and sent in one write;
- TCP reads go into one reused buffer per connection, 256 KiB at a time, and
  the small reads (handshake messages) are served from it; closing the
  connection releases it, whoever still holds the closed stream;
- Noise messages are decrypted straight out of that buffer, yamux DATA bodies
  straight into one buffer of their size
  (:func:`p2p.fastpath_noise.noise_reads_in_place`);
- yamux stream buffers keep frame bodies as they arrive, and
  :func:`read_raw` hands them to a blob reader uncopied;
- yamux receive windows are credited back once half of them was consumed (as
  go-yamux does) instead of after every read, doubling up to 16 MiB;
- :func:`grant_receive_window` lets a reader that knows how much it is about to
  receive open the whole window at once (a new stream starts at 256 KiB, and
  py-libp2p's sender polls every 10 ms while its window is empty).

One module per part: the sending side is :mod:`p2p.fastpath_send`, TCP reads
:mod:`p2p.fastpath_tcp`, Noise reads :mod:`p2p.fastpath_noise` (frame bodies from
:mod:`p2p.fastpath_bodies`), the yamux stream buffers and windows
:mod:`p2p.fastpath_streams`; this module hands out the calls the blob protocol uses
and applies every patch (:data:`PATCHES`). Each patch checks the py-libp2p version it
was written for (pinned in pyproject.toml) and leaves the library alone otherwise;
``tests/test_p2p_transfer.py`` fails if they are not applied.
"""

from __future__ import annotations

import importlib.metadata
import logging
from typing import Any

import libp2p.stream_muxer.yamux.yamux as _yamux

from p2p.fastpath_noise import noise_reads_in_place
from p2p.fastpath_send import larger_yamux_frames, uncopied_yamux_writes
from p2p.fastpath_streams import MAX_RECEIVE_WINDOW, batched_window_updates, chunked_stream_buffers
from p2p.fastpath_tcp import buffered_tcp_reads

logger = logging.getLogger(__name__)

PATCHED_LIBP2P_VERSION = "0.8.1"
applied: list[str] = []  # names of the patches in force (checked by the tests)


def _version_matches() -> bool:
    version = importlib.metadata.version("libp2p")
    if version != PATCHED_LIBP2P_VERSION:
        logger.warning(
            "py-libp2p %s is not the pinned %s: data-path patches not applied (transfers will be slower)",
            version,
            PATCHED_LIBP2P_VERSION,
        )
        return False
    return True


def read_raw(stream: Any) -> None:
    """Let reads on ``stream`` return received frame bodies as they are (``bytes`` or ``bytearray``).

    For a reader that only writes and hashes what it reads (a blob range): it
    saves copying every byte once more. No-op for non-yamux streams.
    """
    muxed = getattr(stream, "muxed_stream", None)
    if isinstance(muxed, _yamux.YamuxStream) and "chunked_stream_buffers" in applied:
        muxed._dlx_raw_reads = True  # type: ignore[attr-defined]


async def grant_receive_window(stream: Any, expected_bytes: int) -> None:
    """Let the peer send ``expected_bytes`` on ``stream`` without waiting for window updates.

    For a reader that has asked for a known amount and will consume it promptly
    (a blob range): one WINDOW_UPDATE right away instead of the window growing
    from 256 KiB step by step. Capped at 16 MiB; no-op for non-yamux streams.
    """
    muxed = getattr(stream, "muxed_stream", None)
    if not isinstance(muxed, _yamux.YamuxStream) or "batched_window_updates" not in applied:
        return
    target = min(max(expected_bytes, 0), MAX_RECEIVE_WINDOW)
    increment = target - muxed.target_recv_window
    if increment <= 0:
        return
    muxed.target_recv_window = target
    muxed.recv_window += increment
    await muxed.send_window_update(increment)


#: The patches in the order they are applied, by the names :data:`applied` lists.
PATCHES = (
    ("larger_yamux_frames", larger_yamux_frames),
    ("uncopied_yamux_writes", uncopied_yamux_writes),
    ("buffered_tcp_reads", buffered_tcp_reads),
    ("noise_reads_in_place", noise_reads_in_place),
    ("chunked_stream_buffers", chunked_stream_buffers),
    ("batched_window_updates", batched_window_updates),
)


def _apply_patches() -> None:
    for name, patch in PATCHES:
        patch()
        applied.append(name)


if _version_matches():
    _apply_patches()
