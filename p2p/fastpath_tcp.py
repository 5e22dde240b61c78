"""TCP reads of the data-path corrections (:mod:`p2p.fastpath`): one reused receive buffer per connection.

py-libp2p 0.8.1 makes a ``recv`` (and a trio checkpoint) per Noise length prefix and per
body. Here each connection reads into one reused buffer, 256 KiB at a time and more while
it carries bulk data; the small reads (handshake messages) and the Noise transport
messages (:mod:`p2p.fastpath_noise`) are served from it, and closing the connection
releases it, whoever still holds the closed stream.
"""

from __future__ import annotations

import errno

import trio
from libp2p.io.exceptions import ConnectionClosedError
from libp2p.io.trio import TrioTCPStream
from libp2p.security.noise import io as _noise_io

#: Bytes asked of the kernel per TCP read at first.
TCP_READ_BYTES = 256 * 1024
#: ... growing (doubling each time a read fills its request) up to this on a connection carrying bulk data.
MAX_TCP_READ_BYTES = 1 << 20
#: Room kept beside a read in a connection's receive buffer: a Noise message left over from the last one.
_LEFTOVER_BYTES = 2 * (_noise_io.SIZE_NOISE_MESSAGE_LEN + _noise_io.MAX_NOISE_MESSAGE_LEN)
#: A connection's receive buffer at first: one kernel read plus a leftover message.
TCP_BUFFER_BYTES = TCP_READ_BYTES + _LEFTOVER_BYTES


class ReceiveBuffer:
    """Bytes read from one TCP connection and not consumed yet, in one reused bytearray.

    Reusing the buffer spares a fresh 256 KiB allocation (and its page faults) per
    ``recv``; Noise ciphertexts are decrypted straight out of it. A read that
    fills its whole request means more is waiting: the next reads ask for twice
    as much, up to :data:`MAX_TCP_READ_BYTES` (a 100 MB blob in ~100 ``recv``
    calls and event-loop passes instead of ~400), so only connections that carry
    bulk data hold the larger buffer.
    """

    __slots__ = ("data", "end", "read_bytes", "start")

    def __init__(self, size: int = TCP_BUFFER_BYTES) -> None:
        self.data = bytearray(size)
        self.start = 0
        self.end = 0
        self.read_bytes = TCP_READ_BYTES

    def grow(self) -> None:
        """Double the read size (up to the maximum), keeping the unconsumed bytes."""
        self.read_bytes = min(2 * self.read_bytes, MAX_TCP_READ_BYTES)
        data = bytearray(self.read_bytes + _LEFTOVER_BYTES)
        left = self.end - self.start
        data[:left] = self.data[self.start : self.end]
        self.data, self.start, self.end = data, 0, left

    def take(self, n: int | None) -> bytes:
        """Up to ``n`` (None: all) buffered bytes, as a copy."""
        count = self.end - self.start if n is None else min(n, self.end - self.start)
        with memoryview(self.data) as view:
            data = view[self.start : self.start + count].tobytes()
        self.start += count
        return data


async def _receive(tcp: TrioTCPStream, buffer: ReceiveBuffer) -> bool:
    """One ``recv`` into the buffer's free tail (moving what is left to the front first); False at EOF."""
    if buffer.start == buffer.end:
        buffer.start = buffer.end = 0
    elif len(buffer.data) - buffer.end < buffer.read_bytes:
        left = buffer.end - buffer.start  # under one Noise message: a short move
        buffer.data[:left] = buffer.data[buffer.start : buffer.end]
        buffer.start, buffer.end = 0, left
    requested = len(buffer.data) - buffer.end
    try:
        with memoryview(buffer.data) as view, view[buffer.end :] as tail:
            received = await tcp.stream.socket.recv_into(tail)
    except trio.ClosedResourceError:
        return False  # closed locally: EOF, as the stock read does
    except OSError as error:
        if error.errno in (errno.EBADF, errno.ENOTSOCK):
            return False
        raise ConnectionClosedError(
            f"TCP connection reset by remote peer: {error}", transport="tcp"
        ) from error
    buffer.end += received
    if received == requested and buffer.read_bytes < MAX_TCP_READ_BYTES:
        buffer.grow()
    return received > 0


def receive_buffer_of(tcp: TrioTCPStream) -> ReceiveBuffer:
    buffer = getattr(tcp, "_dlx_buffer", None)
    if buffer is None:
        if getattr(tcp, "_dlx_closed", False):
            return ReceiveBuffer(0)  # a read after close: nothing to keep (it reads EOF)
        buffer = tcp._dlx_buffer = ReceiveBuffer()  # type: ignore[attr-defined]
    return buffer


async def next_bytes(tcp: TrioTCPStream, n: int) -> memoryview:
    """The next ``n`` bytes of the connection (``n`` <= one Noise message), consumed.

    Shorter only if the connection ended first. The view is into the receive
    buffer: use it before the next read on this connection.
    """
    buffer = receive_buffer_of(tcp)
    if buffer.end - buffer.start < n:
        async with tcp.read_lock:
            while buffer.end - buffer.start < n and await _receive(tcp, buffer):
                pass
    count = min(n, buffer.end - buffer.start)
    view = memoryview(buffer.data)[buffer.start : buffer.start + count]
    buffer.start += count
    return view


def buffered_tcp_reads() -> None:
    """Serve small TCP reads from one reused buffer filled 256 KiB at a time.

    Noise reads a 2-byte length prefix, then up to 65535 bytes, each a separate
    ``recv`` and trio checkpoint in py-libp2p 0.8.1. Bytes left over from a larger
    read are kept in the connection's :class:`ReceiveBuffer` and handed out first,
    in order (the Noise handshake reads through here; transport messages are then
    read from the same buffer by :func:`p2p.fastpath_noise.noise_reads_in_place`).
    """
    original_read = TrioTCPStream.read

    async def read(self: TrioTCPStream, n: int | None = None) -> bytes:
        if n is not None and n <= 0:
            return b""
        buffer = receive_buffer_of(self)
        if buffer.end == buffer.start:
            async with self.read_lock:
                if buffer.end == buffer.start and not await _receive(self, buffer):
                    return b""
        return buffer.take(n)

    original_close = TrioTCPStream.close

    async def close(self: TrioTCPStream) -> None:
        # The buffer goes with the socket: py-libp2p objects that outlive a connection (a handler, a list of
        # connections) then keep a few hundred bytes of it, not 0.4-1.1 MiB (docs/P2P.md, issue 45).
        self._dlx_closed = True  # type: ignore[attr-defined]
        self._dlx_buffer = None  # type: ignore[attr-defined]
        await original_close(self)

    read._dlx_original = original_read  # type: ignore[attr-defined]
    close._dlx_original = original_close  # type: ignore[attr-defined]
    TrioTCPStream.read = read  # type: ignore[method-assign]
    TrioTCPStream.close = close  # type: ignore[method-assign]
