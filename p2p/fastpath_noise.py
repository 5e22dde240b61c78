"""Noise reads of the data-path corrections (:mod:`p2p.fastpath`): decrypted in place, bodies uncopied.

A Noise message's ciphertext is decrypted from a view of the connection's TCP receive
buffer (:mod:`p2p.fastpath_tcp`), and a yamux DATA body straight into one buffer of its
size (:mod:`p2p.fastpath_bodies`); see :func:`noise_reads_in_place`.
"""

from __future__ import annotations

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

from p2p import fastpath_bodies
from p2p.fastpath_send import TAG_BYTES, chacha_state, nonce
from p2p.fastpath_tcp import next_bytes, receive_buffer_of


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
    data = await next_bytes(tcp, count)
    if len(data) < count:
        raise IncompleteReadError(
            f"Connection closed during read operation: expected {count} bytes but received {len(data)} bytes",
            expected_bytes=count,
            received_bytes=len(data),
        )
    return data


def _decrypt(noise: Any, ciphertext: memoryview, into: memoryview | None = None) -> bytes | None:
    """Decrypt one message (into ``into``, exactly its plaintext size, if given), as the noise library
    does."""
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
    buffer = receive_buffer_of(noise.read_writer.read_write_closer.stream)
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
                decrypt_into(
                    nonce(state), view[body : body + size], None, out[received : received + plain_size]
                )
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


async def _read_plain(session: SecureSession, noise: Any, n: int | None) -> bytes:
    """``SecureSession.read`` in place: up to ``n`` (None or < 0: one message's) decrypted bytes."""
    if n == 0:
        return b""
    if n is None or n < 0:
        if session._dlx_plain:  # type: ignore[attr-defined]
            return _take_plain(session, None)
        message = _decrypt(noise, await _next_ciphertext(noise))
        if not message:
            raise ConnectionClosedError("Connection closed")
        return message
    parts = [_take_plain(session, n)] if session._dlx_plain else []  # type: ignore[attr-defined]
    received = len(parts[0]) if parts else 0
    while received < n:
        message = _decrypt(noise, await _next_ciphertext(noise))
        if not message:
            if parts:
                break  # as the stock read: return what was assembled
            raise ConnectionClosedError("Connection closed")
        wanted = n - received
        if len(message) > wanted:
            session._dlx_plain, session._dlx_plain_at = message, wanted  # type: ignore[attr-defined]
            message = message[:wanted]
        parts.append(message)
        received += len(message)
    return parts[0] if len(parts) == 1 else b"".join(parts)


async def _read_body_in_place(session: SecureSession, noise: Any, n: int) -> bytes | bytearray:
    """Exactly ``n`` bytes (a yamux DATA body), decrypted into one buffer."""
    plain = session._dlx_plain  # type: ignore[attr-defined]
    if len(plain) - session._dlx_plain_at >= n:  # type: ignore[attr-defined]
        return _take_plain(session, n)
    body = fastpath_bodies.new_body(n)
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


def noise_reads_in_place() -> None:
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
        return await _read_plain(self, noise, n)

    async def read_body(session: SecureSession, n: int) -> bytes | bytearray:
        """Exactly ``n`` bytes (a yamux DATA body), decrypted into one buffer."""
        noise = _fast_noise(session)
        if noise is None:
            return await original_read_exactly(session, n)
        return await _read_body_in_place(session, noise, n)

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
