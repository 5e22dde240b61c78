"""Yamux receive streams for :mod:`p2p.fastpath`: bodies kept as they arrive, windows credited in halves.

A stream's unread bytes are kept as the frame bodies they came in (:class:`ChunkBuffer`,
no copy on arrival), and a stream in raw-read mode (:func:`p2p.fastpath.read_raw`) gets
them whole; its receive window is credited back once half of it was consumed, growing up
to 16 MiB (as go-yamux does). :mod:`p2p.fastpath` checks the py-libp2p version and
applies these patches on import; nothing here patches anything by itself.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import libp2p.stream_muxer.yamux.yamux as _yamux
import trio
from libp2p.stream_muxer.exceptions import MuxedStreamEOF, MuxedStreamReset

#: Largest receive window a stream grows to (go-yamux's maximum).
MAX_RECEIVE_WINDOW = _yamux.MAX_WINDOW_SIZE


def batched_window_updates() -> None:
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


class ChunkBuffer:
    """A yamux stream's unread bytes, kept as the frame bodies they arrived in (no copy on arrival).

    Stands in for the ``bytearray`` py-libp2p 0.8.1 keeps per stream, with the
    operations its yamux code performs on one (``extend``, ``len``, truth,
    ``buffer[:n]``, ``del buffer[:n]``, ``bytes(buffer)``, ``clear``): appending a
    body no longer copies it, and a stream in raw-read mode (:func:`p2p.fastpath.read_raw`)
    gets whole bodies handed over as they are.
    """

    __slots__ = ("_offset", "_parts", "_size")

    def __init__(self) -> None:
        self._parts: deque[Any] = deque()  # bytes or bytearray nobody else holds
        self._offset = 0  # bytes of _parts[0] already consumed
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def extend(self, data: Any) -> None:
        if len(data):
            self._parts.append(data)
            self._size += len(data)

    def clear(self) -> None:
        self._parts.clear()
        self._offset = self._size = 0

    def take(self, n: int, whole_parts: bool = False) -> Any:
        """Up to ``n`` bytes (``n < 0``: all), consumed. ``whole_parts``: the first body as it is, no copy."""
        if n < 0 or n > self._size:
            n = self._size
        first = self._parts[0] if self._parts else b""
        if whole_parts and self._offset == 0 and 0 < len(first) <= n:
            self._parts.popleft()
            self._size -= len(first)
            return first
        pieces = []
        wanted = n
        while wanted:
            first = self._parts[0]
            end = min(len(first), self._offset + wanted)
            pieces.append(memoryview(first)[self._offset : end])
            wanted -= end - self._offset
            if end == len(first):
                self._parts.popleft()
                self._offset = 0
            else:
                self._offset = end
        self._size -= n
        return b"".join(pieces)

    def __bytes__(self) -> bytes:
        return b"".join(
            memoryview(part)[self._offset if index == 0 else 0 :] for index, part in enumerate(self._parts)
        )

    def __getitem__(self, key: slice) -> bytes:
        if isinstance(key, slice) and key.start in (None, 0) and key.step is None and key.stop is not None:
            parts, offset, size = list(self._parts), self._offset, self._size
            data = self.take(key.stop)  # a peek: put everything back
            self._parts, self._offset, self._size = deque(parts), offset, size
            return data
        return bytes(self)[key]

    def __delitem__(self, key: slice) -> None:
        if isinstance(key, slice) and key.start in (None, 0) and key.step is None and key.stop is not None:
            self.take(key.stop)
            return
        rest = bytearray(bytes(self))
        del rest[key]
        self.clear()
        self.extend(bytes(rest))


class StreamBuffers(dict):  # type: ignore[type-arg]
    """Yamux's ``stream_buffers``: every new (empty ``bytearray``) buffer becomes a :class:`ChunkBuffer`."""

    def __setitem__(self, key: Any, value: Any) -> None:
        if type(value) is bytearray and not value:
            value = ChunkBuffer()
        super().__setitem__(key, value)


def chunked_stream_buffers() -> None:
    """Keep yamux frame bodies as they arrive; let a blob reader take them whole.

    py-libp2p 0.8.1 appends each DATA body to the stream's ``bytearray`` (a copy)
    and ``read`` copies it out again as ``bytes``. With :class:`ChunkBuffer` the
    append is free, and a stream put in raw-read mode by :func:`p2p.fastpath.read_raw` gets
    each body (a ``bytearray`` decrypted in place, see :func:`p2p.fastpath._noise_reads_in_place`)
    without a copy. Other streams still get ``bytes`` (one copy, as before).
    """
    original_init = _yamux.Yamux.__init__
    original_read_stream = _yamux.Yamux.read_stream

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        self.stream_buffers = StreamBuffers(self.stream_buffers)

    async def read_stream(self: Any, stream_id: int, n: int = -1) -> bytes:
        stream = self.streams.get(stream_id)
        if not getattr(stream, "_dlx_raw_reads", False):
            return await original_read_stream(self, stream_id, n)
        # The stock read_stream's checks, in its order; only the data is taken without a copy.
        n = -1 if n is None else n
        while True:
            async with self.streams_lock:
                if stream_id not in self.streams:
                    raise MuxedStreamEOF("Stream closed")
                if self.event_shutting_down.is_set():
                    raise MuxedStreamEOF("Connection shut down")
                stream = self.streams[stream_id]
                buffer = self.stream_buffers.get(stream_id)
                if buffer is None:
                    if stream.reset_received:
                        raise MuxedStreamReset("Stream was reset")
                    raise MuxedStreamEOF("Stream buffer closed")
                if buffer and (stream.recv_closed or not stream.reset_received):
                    data = buffer.take(n, whole_parts=True)
                    if stream.closed:  # releases the backlog slot; drops the stream once drained
                        self._finalize_stream_locked(stream, fully_closed=True)
                    return data
                if stream.reset_received:
                    raise MuxedStreamReset("Stream was reset")
                if stream.recv_closed:
                    raise MuxedStreamEOF("Stream is closed for receiving")
                if stream.closed:
                    raise MuxedStreamReset("Stream is reset or closed")
            try:
                await self.stream_events[stream_id].wait()
                self.stream_events[stream_id] = trio.Event()
            except KeyError:
                raise MuxedStreamEOF("Stream was removed") from None

    _yamux.Yamux.__init__ = __init__  # type: ignore[method-assign]
    _yamux.Yamux.read_stream = read_stream  # type: ignore[method-assign]
