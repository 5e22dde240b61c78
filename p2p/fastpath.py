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
  straight into one buffer of their size (:func:`_noise_reads_in_place`);
- yamux stream buffers keep frame bodies as they arrive, and
  :func:`read_raw` hands them to a blob reader uncopied;
- yamux receive windows are credited back once half of them was consumed (as
  go-yamux does) instead of after every read, doubling up to 16 MiB;
- :func:`grant_receive_window` lets a reader that knows how much it is about to
  receive open the whole window at once (a new stream starts at 256 KiB, and
  py-libp2p's sender polls every 10 ms while its window is empty).

The sending side is :mod:`p2p.fastpath_send`, the yamux stream buffers and windows
:mod:`p2p.fastpath_streams`; this module reads (TCP, Noise), hands out the calls the
blob protocol uses and applies every patch (:data:`PATCHES`). Each patch checks the
py-libp2p version it was written for (pinned in pyproject.toml) and leaves the
library alone otherwise; ``tests/test_p2p_transfer.py`` fails if they are not applied.
"""

from __future__ import annotations

import errno
import importlib.metadata
import logging
from typing import Any

import libp2p.stream_muxer.yamux.yamux as _yamux
import trio
from cryptography.exceptions import InvalidTag
from libp2p.io.exceptions import ConnectionClosedError, IncompleteReadError
from libp2p.io.trio import TrioTCPStream
from libp2p.io.utils import DEFAULT_RETRY_READ_COUNT
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.security.noise import io as _noise_io
from libp2p.security.secure_session import SecureSession
from noise.exceptions import NoiseInvalidMessage

from p2p.fastpath_send import (
    TAG_BYTES,
    YAMUX_FRAME_PAYLOAD_BYTES,
    chacha_state,
    larger_yamux_frames,
    nonce,
    uncopied_yamux_writes,
)
from p2p.fastpath_streams import MAX_RECEIVE_WINDOW, batched_window_updates, chunked_stream_buffers

logger = logging.getLogger(__name__)

PATCHED_LIBP2P_VERSION = "0.8.1"
#: Bytes asked of the kernel per TCP read at first.
TCP_READ_BYTES = 256 * 1024
#: ... growing (doubling each time a read fills its request) up to this on a connection carrying bulk data.
MAX_TCP_READ_BYTES = 1 << 20
#: Room kept beside a read in a connection's receive buffer: a Noise message left over from the last one.
_LEFTOVER_BYTES = 2 * (_noise_io.SIZE_NOISE_MESSAGE_LEN + _noise_io.MAX_NOISE_MESSAGE_LEN)
#: A connection's receive buffer at first: one kernel read plus a leftover message.
TCP_BUFFER_BYTES = TCP_READ_BYTES + _LEFTOVER_BYTES

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


class _ReceiveBuffer:
    """Bytes read from one TCP connection and not consumed yet, in one reused bytearray.

    Reusing the buffer spares a fresh 256 KiB allocation (and its page faults) per
    ``recv``; Noise ciphertexts are decrypted straight out of it. A read that
    fills its whole request means more is waiting: the next reads ask for twice
    as much, up to :data:`MAX_TCP_READ_BYTES` (a 100 MB blob in ~100 ``recv``
    calls and event-loop passes instead of ~400), so only connections that carry
    bulk data hold the larger buffer.
    """

    __slots__ = ("data", "start", "end", "read_bytes")

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


async def _receive(tcp: TrioTCPStream, buffer: _ReceiveBuffer) -> bool:
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
        raise ConnectionClosedError(f"TCP connection reset by remote peer: {error}", transport="tcp") from error
    buffer.end += received
    if received == requested and buffer.read_bytes < MAX_TCP_READ_BYTES:
        buffer.grow()
    return received > 0


def _buffer_of(tcp: TrioTCPStream) -> _ReceiveBuffer:
    buffer = getattr(tcp, "_dlx_buffer", None)
    if buffer is None:
        if getattr(tcp, "_dlx_closed", False):
            return _ReceiveBuffer(0)  # a read after close: nothing to keep (it reads EOF)
        buffer = tcp._dlx_buffer = _ReceiveBuffer()  # type: ignore[attr-defined]
    return buffer


async def _next_bytes(tcp: TrioTCPStream, n: int) -> memoryview:
    """The next ``n`` bytes of the connection (``n`` <= one Noise message), consumed.

    Shorter only if the connection ended first. The view is into the receive
    buffer: use it before the next read on this connection.
    """
    buffer = _buffer_of(tcp)
    if buffer.end - buffer.start < n:
        async with tcp.read_lock:
            while buffer.end - buffer.start < n and await _receive(tcp, buffer):
                pass
    count = min(n, buffer.end - buffer.start)
    view = memoryview(buffer.data)[buffer.start : buffer.start + count]
    buffer.start += count
    return view


def _buffered_tcp_reads() -> None:
    """Serve small TCP reads from one reused buffer filled 256 KiB at a time.

    Noise reads a 2-byte length prefix, then up to 65535 bytes, each a separate
    ``recv`` and trio checkpoint in py-libp2p 0.8.1. Bytes left over from a larger
    read are kept in the connection's :class:`_ReceiveBuffer` and handed out first,
    in order (the Noise handshake reads through here; transport messages are then
    read from the same buffer by :func:`_noise_reads_in_place`).
    """
    original_read = TrioTCPStream.read

    async def read(self: TrioTCPStream, n: int | None = None) -> bytes:
        if n is not None and n <= 0:
            return b""
        buffer = _buffer_of(self)
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


def _fast_noise(session: SecureSession) -> Any:
    """The session's Noise transport read/writer if its messages can be read in place, else None."""
    noise = getattr(session, "_dlx_noise", False)
    if noise is False:
        noise = session.conn
        raw = getattr(getattr(noise, "read_writer", None), "read_write_closer", None)
        if (
            chacha_state(noise, "decrypt") is None
            or not isinstance(raw, RawConnection)
            or not isinstance(raw.stream, TrioTCPStream)
        ):
            noise = None
        session._dlx_noise = noise  # type: ignore[attr-defined]
        session._dlx_plain, session._dlx_plain_at = b"", 0  # type: ignore[attr-defined]  # decrypted, unread
    return noise


async def _next_ciphertext(noise: Any) -> memoryview:
    """The next Noise message's ciphertext, as a view into the TCP receive buffer."""
    tcp = noise.read_writer.read_write_closer.stream
    prefix = await _exact_bytes(tcp, _noise_io.SIZE_NOISE_MESSAGE_LEN)
    return await _exact_bytes(tcp, int.from_bytes(prefix, "big"))


async def _exact_bytes(tcp: TrioTCPStream, count: int) -> memoryview:
    """``count`` bytes from the TCP receive buffer, or the stock error if the connection ends first."""
    data = await _next_bytes(tcp, count)
    if len(data) < count:
        raise IncompleteReadError(
            f"Connection closed during read operation: expected {count} bytes but received {len(data)} bytes",
            expected_bytes=count,
            received_bytes=len(data),
        )
    return data


def _decrypt(noise: Any, ciphertext: memoryview, into: memoryview | None = None) -> bytes | None:
    """Decrypt one message (into ``into``, exactly its plaintext size, if given), as the noise library does."""
    state = noise.noise_state.noise_protocol.cipher_state_decrypt
    try:
        if into is None:
            plaintext = state.cipher.cipher.decrypt(nonce(state), ciphertext, None)
        else:
            state.cipher.cipher.decrypt_into(nonce(state), ciphertext, None, into)
            plaintext = None
    except InvalidTag:
        raise NoiseInvalidMessage("Failed authentication of message") from None
    state.n += 1
    return plaintext


def _decrypt_buffered(noise: Any, out: memoryview, received: int) -> int:
    """Decrypt the Noise messages already in the TCP receive buffer into ``out`` from ``received`` on.

    Stops at the first message that is not wholly buffered, is empty or would end
    past ``out`` (the caller takes those one at a time); returns the new fill of
    ``out``. A synchronous loop: no coroutine, lock or checkpoint per message
    (a 256 KiB read holds four of them).
    """
    buffer = _buffer_of(noise.read_writer.read_write_closer.stream)
    state = noise.noise_state.noise_protocol.cipher_state_decrypt
    decrypt_into = state.cipher.cipher.decrypt_into
    data, start, end = buffer.data, buffer.start, buffer.end
    prefix_bytes = _noise_io.SIZE_NOISE_MESSAGE_LEN
    limit = len(out)
    with memoryview(data) as view:
        while end - start >= prefix_bytes:
            size = (data[start] << 8) | data[start + 1]
            plain_size = size - TAG_BYTES
            if end - start - prefix_bytes < size or not 0 < plain_size <= limit - received:
                break
            body = start + prefix_bytes
            try:
                decrypt_into(nonce(state), view[body : body + size], None, out[received : received + plain_size])
            except InvalidTag:
                raise NoiseInvalidMessage("Failed authentication of message") from None
            state.n += 1
            received += plain_size
            start = body + size
            buffer.start = start
    return received


def _take_plain(session: SecureSession, n: int | None) -> bytes:
    """Up to ``n`` (None: all) decrypted bytes left over from the last message."""
    plain, offset = session._dlx_plain, session._dlx_plain_at  # type: ignore[attr-defined]
    if n is None or offset + n >= len(plain):
        session._dlx_plain, session._dlx_plain_at = b"", 0  # type: ignore[attr-defined]
        return plain if offset == 0 else plain[offset:]
    session._dlx_plain_at = offset + n  # type: ignore[attr-defined]
    return plain[offset : offset + n]


def _noise_reads_in_place() -> None:
    """Decrypt Noise messages straight from the TCP buffer, and yamux frame bodies straight into place.

    py-libp2p 0.8.1 copies every received byte about ten times on its way to a
    yamux stream buffer: sliced out of the socket read, gathered by
    ``read_exactly`` into a bytearray and copied to bytes (at the TCP, Noise and
    yamux levels each), written into and read out of a ``BytesIO`` by
    ``SecureSession``. Here a message's ciphertext is decrypted from a view of the
    connection's receive buffer, and a yamux DATA body is decrypted into one
    bytearray of its size, message by message (``decrypt_into``); only a message
    that straddles two frames is decrypted to a temporary and split. Same
    bytes, same errors (``IncompleteReadError`` at EOF, ``NoiseInvalidMessage``
    for a bad tag, ``ConnectionClosedError`` for an empty message) as the stock
    path, which is kept for anything but keyed ChaChaPoly over TCP.
    """
    original_read = SecureSession.read
    original_read_exactly = _yamux.read_exactly

    async def read(self: SecureSession, n: int | None = None) -> bytes:
        noise = _fast_noise(self)
        if noise is None:
            return await original_read(self, n)
        if n == 0:
            return b""
        if n is None or n < 0:
            if self._dlx_plain:  # type: ignore[attr-defined]
                return _take_plain(self, None)
            message = _decrypt(noise, await _next_ciphertext(noise))
            if not message:
                raise ConnectionClosedError("Connection closed")
            return message
        parts = [_take_plain(self, n)] if self._dlx_plain else []  # type: ignore[attr-defined]
        received = len(parts[0]) if parts else 0
        while received < n:
            message = _decrypt(noise, await _next_ciphertext(noise))
            if not message:
                if parts:
                    break  # as the stock read: return what was assembled
                raise ConnectionClosedError("Connection closed")
            wanted = n - received
            if len(message) > wanted:
                self._dlx_plain, self._dlx_plain_at = message, wanted  # type: ignore[attr-defined]
                message = message[:wanted]
            parts.append(message)
            received += len(message)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def read_body(session: SecureSession, n: int) -> bytes | bytearray:
        """Exactly ``n`` bytes (a yamux DATA body), decrypted into one buffer."""
        noise = _fast_noise(session)
        if noise is None:
            return await original_read_exactly(session, n)
        plain = session._dlx_plain  # type: ignore[attr-defined]
        if len(plain) - session._dlx_plain_at >= n:  # type: ignore[attr-defined]
            return _take_plain(session, n)
        body = _new_body(n)
        with memoryview(body) as out:
            received = 0
            if plain:
                left = _take_plain(session, None)
                out[: len(left)] = left
                received = len(left)
            while received < n:
                received = _decrypt_buffered(noise, out, received)
                if received == n:
                    break
                # The next message is not wholly buffered, straddles the body's end or is empty.
                ciphertext = await _next_ciphertext(noise)
                size = len(ciphertext) - TAG_BYTES
                if 0 < size <= n - received:
                    _decrypt(noise, ciphertext, out[received : received + size])
                    received += size
                    continue
                message = _decrypt(noise, ciphertext)
                if not message:
                    if not received:
                        raise ConnectionClosedError("Connection closed")
                    continue  # the stock read_exactly reads on past an empty message
                wanted = n - received
                out[received:n] = memoryview(message)[:wanted]
                session._dlx_plain, session._dlx_plain_at = message, wanted  # type: ignore[attr-defined]
                received = n
        return body

    async def read_exactly(reader: Any, n: int, retry_count: int = DEFAULT_RETRY_READ_COUNT) -> bytes:
        if not isinstance(reader, SecureSession) or _fast_noise(reader) is None:
            return await original_read_exactly(reader, n, retry_count)
        data = await reader.read(n)
        if len(data) != n:
            raise IncompleteReadError(
                f"Connection closed during read operation: expected {n} bytes but received {len(data)} bytes",
                expected_bytes=n,
                received_bytes=len(data),
            )
        return data

    async def read_data_body(self: Any, length: int) -> bytes | bytearray:
        with trio.fail_after(_yamux._yamux_data_read_timeout()):
            if isinstance(self.secured_conn, SecureSession):
                return await read_body(self.secured_conn, length)
            return await original_read_exactly(self.secured_conn, length)

    read._dlx_original = original_read  # type: ignore[attr-defined]
    SecureSession.read = read  # type: ignore[method-assign]
    _yamux.read_exactly = read_exactly
    _yamux.Yamux._read_data_body = read_data_body  # type: ignore[method-assign]



#: Full-size frame bodies handed back by their readers (:func:`release_body`), reused by the next frames.
_BODY_POOL: list[bytearray] = []
#: At most this many are kept (~8 MiB): enough for the bodies one flush of a blob range holds.
BODY_POOL_SIZE = 8


def _new_body(size: int) -> bytearray:
    """A buffer for a frame body of ``size`` bytes: a released one if it fits, else a new one."""
    if size == YAMUX_FRAME_PAYLOAD_BYTES:
        try:
            return _BODY_POOL.pop()
        except IndexError:  # empty (or emptied by another host's thread meanwhile)
            pass
    return bytearray(size)


def release_body(chunk: Any) -> None:
    """Give back a frame body that :func:`read_raw` handed out and nothing references any more.

    A fresh 1 MiB ``bytearray`` per received frame costs a zero-fill and, when
    the allocator maps it anew, 256 page faults; a body given back here is
    decrypted into again instead. Only call it once every use of ``chunk``
    (writes, hashing) has finished: its bytes will be overwritten.
    """
    if type(chunk) is bytearray and len(chunk) == YAMUX_FRAME_PAYLOAD_BYTES and len(_BODY_POOL) < BODY_POOL_SIZE:
        _BODY_POOL.append(chunk)


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
    ("buffered_tcp_reads", _buffered_tcp_reads),
    ("noise_reads_in_place", _noise_reads_in_place),
    ("chunked_stream_buffers", chunked_stream_buffers),
    ("batched_window_updates", batched_window_updates),
)


def _apply_patches() -> None:
    for name, patch in PATCHES:
        patch()
        applied.append(name)


if _version_matches():
    _apply_patches()
