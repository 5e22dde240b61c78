"""Corrections to py-libp2p 0.8.1's TCP + Noise + yamux data path, applied at import time.

Profiling a 100 MB blob fetch (py-spy, cProfile) showed the receiving host
thread spending most of its time in per-message and per-syscall Python work of
py-libp2p, not in cryptography or copying. Per 100 MB the stock stack made
~4200 ``recv`` calls (a 2-byte Noise length prefix, then the body, often in
pieces), ~1700 yamux data frames (each a full pass through ``handle_incoming``,
a wake-up of the reader and several lock round trips) and ~1700
WINDOW_UPDATE frames (one per read, each encrypted and sent on its own). These
patches change only how this host slices, buffers and acknowledges bytes; what
goes on the wire stays standard Noise and yamux, so any libp2p peer is
unaffected (docs/P2P.md, "Transport and security"):

- outgoing yamux data frames carry up to ``YAMUX_FRAME_NOISE_MESSAGES`` full
  Noise messages (never more than the peer's window allows, as the yamux spec
  requires), and the Noise messages of one frame go out in one socket write;
- TCP reads ask the kernel for 256 KiB at a time and serve the small reads
  (Noise length prefixes, bodies) from that buffer;
- yamux receive windows are credited back once half of them was consumed (as
  go-yamux does) instead of after every read, doubling up to 16 MiB;
- :func:`grant_receive_window` lets a reader that knows how much it is about to
  receive open the whole window at once (a new stream starts at 256 KiB, and
  py-libp2p's sender polls every 10 ms while its window is empty).

Each patch checks the py-libp2p version it was written for (pinned in
pyproject.toml) and leaves the library alone otherwise;
``tests/test_p2p_transfer.py`` fails if they are not applied.
"""

from __future__ import annotations

import importlib.metadata
import logging
from typing import Any

import libp2p.stream_muxer.yamux.yamux as _yamux
import trio
from libp2p.io.exceptions import ConnectionClosedError
from libp2p.io.trio import TrioTCPStream
from libp2p.security.noise import io as _noise_io

logger = logging.getLogger(__name__)

PATCHED_LIBP2P_VERSION = "0.8.1"
#: Largest plaintext one Noise transport message carries (65535 - 16 bytes of MAC).
NOISE_PLAINTEXT_BYTES = _noise_io.MAX_PLAINTEXT_LENGTH
#: Noise messages per outgoing yamux data frame: fewer frames for the peer to parse.
YAMUX_FRAME_NOISE_MESSAGES = 4
#: Payload of a full outgoing yamux data frame (its 12-byte header shares the first message).
YAMUX_FRAME_PAYLOAD_BYTES = YAMUX_FRAME_NOISE_MESSAGES * NOISE_PLAINTEXT_BYTES - _yamux.HEADER_SIZE
#: Bytes asked of the kernel per TCP read.
TCP_READ_BYTES = 256 * 1024
#: Largest receive window a stream grows to (go-yamux's maximum).
MAX_RECEIVE_WINDOW = _yamux.MAX_WINDOW_SIZE

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


def _larger_yamux_frames() -> None:
    """Send yamux data frames of several Noise messages, and each frame in one socket write.

    py-libp2p 0.8.1 sliced writes into 64 KiB + 12 byte frames, one byte more than
    a Noise message carries, so each frame became two Noise messages. Frames of
    ``YAMUX_FRAME_NOISE_MESSAGES`` full messages cut the receiver's per-frame work
    by that factor; the yamux writer still never exceeds the peer's window.
    """
    _yamux.MAX_MESSAGE_SIZE = YAMUX_FRAME_PAYLOAD_BYTES + _yamux.HEADER_SIZE

    async def write_msg(self: Any, msg: bytes, prefix_encoded: bool = False) -> None:
        if prefix_encoded or len(msg) <= NOISE_PLAINTEXT_BYTES:  # handshake and small writes
            data = self.encrypt(msg)
            if prefix_encoded:
                data = self.prefix + data
            await self.read_writer.write_msg(data)
            return
        # The stock writer sent each Noise message of a large write separately:
        # one socket write (and trio checkpoint) per 64 KiB.
        view = memoryview(msg)
        parts = []
        for start in range(0, len(msg), NOISE_PLAINTEXT_BYTES):
            ciphertext = self.encrypt(bytes(view[start : start + NOISE_PLAINTEXT_BYTES]))
            parts.append(len(ciphertext).to_bytes(_noise_io.SIZE_NOISE_MESSAGE_LEN, "big"))
            parts.append(ciphertext)
        await self.read_writer.read_write_closer.write(b"".join(parts))

    _noise_io.BaseNoiseMsgReadWriter.write_msg = write_msg  # type: ignore[method-assign]
    applied.append("larger_yamux_frames")


def _buffered_tcp_reads() -> None:
    """Serve small TCP reads from one 256 KiB ``recv``.

    Noise reads a 2-byte length prefix, then up to 65535 bytes, each a separate
    ``recv`` and trio checkpoint in py-libp2p 0.8.1. Bytes left over from a larger
    read are kept on the stream object and handed out first, in order.
    """
    original_read = TrioTCPStream.read

    async def read(self: TrioTCPStream, n: int | None = None) -> bytes:
        if n is not None and n <= 0:
            return b""
        pending = getattr(self, "_dlx_pending", None)
        if pending is not None and not self.read_lock.locked():
            return _take(self, pending, n)
        async with self.read_lock:  # a concurrent reader: take the buffer only while holding the lock
            pending = getattr(self, "_dlx_pending", None)
            if pending is not None:
                return _take(self, pending, n)
            try:
                data = await self.stream.receive_some(None if n is None else max(n, TCP_READ_BYTES))
            except trio.BrokenResourceError as error:
                raise ConnectionClosedError(
                    f"TCP connection reset by remote peer: {error}", transport="tcp"
                ) from error
            except trio.ClosedResourceError:
                return b""  # closed locally: EOF, as the stock read does
            if n is not None and len(data) > n:
                self._dlx_pending = (data, n)  # type: ignore[attr-defined]
                return data[:n]
            return data

    def _take(self: TrioTCPStream, pending: tuple[bytes, int], n: int | None) -> bytes:
        data, offset = pending
        if n is None or offset + n >= len(data):
            self._dlx_pending = None  # type: ignore[attr-defined]
            return data[offset:]
        self._dlx_pending = (data, offset + n)  # type: ignore[attr-defined]
        return data[offset : offset + n]

    read._dlx_original = original_read  # type: ignore[attr-defined]
    TrioTCPStream.read = read  # type: ignore[method-assign]
    applied.append("buffered_tcp_reads")


def _batched_window_updates() -> None:
    """Credit a yamux receive window back once half of it was consumed, and grow it.

    py-libp2p 0.8.1 sends a WINDOW_UPDATE after nearly every read (one 12-byte
    frame, one Noise message, one ``send`` per ~64 KiB received). go-yamux credits
    once half the window is consumed and grows the window up to 16 MiB; this does
    the same. The window only grows as the application consumes, so a stream whose
    reader stalls never gets a larger window.

    Invariant: ``target_recv_window == recv_window + buffered + _pending_recv_release``,
    so when the sender is blocked (``recv_window == 0``) the reader draining the
    buffer always reaches the half-window threshold: no deadlock.
    """

    async def credit(self: Any, *, bytes_read: int = 0) -> None:
        # No await before the update is decided: atomic on the trio loop, no lock needed.
        self._pending_recv_release += bytes_read
        if self._pending_recv_release < self.target_recv_window // 2:
            return
        grown = min(self.target_recv_window * 2, MAX_RECEIVE_WINDOW)
        increment = self._pending_recv_release + max(0, grown - self.target_recv_window)
        self.target_recv_window = max(grown, self.target_recv_window)
        self.recv_window += increment
        self._pending_recv_release = 0
        await self.send_window_update(increment)

    credit._dlx_original = _yamux.YamuxStream._auto_tune_and_send_window_update  # type: ignore[attr-defined]
    _yamux.YamuxStream._auto_tune_and_send_window_update = credit  # type: ignore[method-assign]
    applied.append("batched_window_updates")


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


if _version_matches():
    _larger_yamux_frames()
    _buffered_tcp_reads()
    _batched_window_updates()
