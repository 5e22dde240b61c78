"""The sending side of :mod:`p2p.fastpath`'s corrections to py-libp2p 0.8.1's Noise + yamux data path.

Outgoing yamux data frames carry up to ``YAMUX_FRAME_NOISE_MESSAGES`` full Noise
messages (never more than the peer's window allows), kept as header + payload view
(:class:`YamuxFrame`), encrypted in place into one reused buffer and sent in one write.
The same bytes go on the wire. :mod:`p2p.fastpath` checks the py-libp2p version and
applies these patches on import; nothing here patches anything by itself.
"""

from __future__ import annotations

import struct
from typing import Any

import libp2p.stream_muxer.yamux.yamux as _yamux
import trio
from libp2p.security.noise import io as _noise_io
from libp2p.security.secure_session import SecureSession
from libp2p.stream_muxer.exceptions import MuxedStreamError
from noise.backends.default.ciphers import ChaCha20Cipher
from noise.constants import MAX_NONCE
from noise.exceptions import NoiseMaxNonceError

#: Largest plaintext one Noise transport message carries (65535 - 16 bytes of MAC).
NOISE_PLAINTEXT_BYTES = _noise_io.MAX_PLAINTEXT_LENGTH
#: Noise messages per outgoing yamux data frame: fewer frames for the peer to parse.
YAMUX_FRAME_NOISE_MESSAGES = 16
#: Payload of a full outgoing yamux data frame (its 12-byte header shares the first message).
YAMUX_FRAME_PAYLOAD_BYTES = YAMUX_FRAME_NOISE_MESSAGES * NOISE_PLAINTEXT_BYTES - _yamux.HEADER_SIZE
TAG_BYTES = 16  # Poly1305 tag closing every Noise transport message
#: Bytes on the wire of one full outgoing yamux data frame (its Noise messages with their prefixes).
_MAX_FRAME_WIRE_BYTES = YAMUX_FRAME_NOISE_MESSAGES * (
    _noise_io.SIZE_NOISE_MESSAGE_LEN + _noise_io.MAX_NOISE_MESSAGE_LEN
)


def chacha_state(read_writer: Any, direction: str) -> Any:
    """The Noise cipher state of a transport read/writer if it is keyed ChaCha20-Poly1305, else None."""
    if type(read_writer) is not _noise_io.NoiseTransportReadWriter:
        return None
    protocol = getattr(read_writer.noise_state, "noise_protocol", None)
    state = getattr(protocol, f"cipher_state_{direction}", None)
    if state is None or not isinstance(state.cipher, ChaCha20Cipher) or not state.has_key():
        return None
    return state


def nonce(state: Any) -> bytes:
    """Noise's ChaChaPoly nonce for the state's counter (what ``ChaCha20Cipher.format_nonce`` makes)."""
    if state.n == MAX_NONCE:
        raise NoiseMaxNonceError("Nonce has depleted!")
    return b"\x00\x00\x00\x00" + state.n.to_bytes(8, "little")


def larger_yamux_frames() -> None:
    """Send yamux data frames of several Noise messages, and each frame in one socket write.

    py-libp2p 0.8.1 sliced writes into 64 KiB + 12 byte frames, one byte more than
    a Noise message carries, so each frame became two Noise messages. Frames of
    ``YAMUX_FRAME_NOISE_MESSAGES`` full messages cut the receiver's per-frame work
    by that factor; the yamux writer still never exceeds the peer's window. The
    messages of a frame are encrypted in place into one buffer (length prefixes
    included) rather than copied out, encrypted and joined.
    """
    _yamux.MAX_MESSAGE_SIZE = YAMUX_FRAME_PAYLOAD_BYTES + _yamux.HEADER_SIZE
    prefix_bytes = _noise_io.SIZE_NOISE_MESSAGE_LEN

    async def write_msg(self: Any, msg: bytes, prefix_encoded: bool = False) -> None:
        if prefix_encoded or len(msg) <= NOISE_PLAINTEXT_BYTES:  # handshake and small writes
            data = self.encrypt(msg.tobytes() if isinstance(msg, YamuxFrame) else msg)
            if prefix_encoded:
                data = self.prefix + data
            await self.read_writer.write_msg(data)
            return
        # The stock writer sent each Noise message of a large write separately:
        # one socket write (and trio checkpoint) per 64 KiB.
        state = chacha_state(self, "encrypt")
        if isinstance(msg, YamuxFrame) and state is None:
            msg = msg.tobytes()
        view = msg if isinstance(msg, YamuxFrame) else memoryview(msg)
        if state is None:  # not ChaChaPoly: the noise library's own encrypt, then one join
            parts = []
            for start in range(0, len(msg), NOISE_PLAINTEXT_BYTES):
                ciphertext = self.encrypt(bytes(view[start : start + NOISE_PLAINTEXT_BYTES]))
                parts.append(len(ciphertext).to_bytes(prefix_bytes, "big"))
                parts.append(ciphertext)
            await self.read_writer.read_write_closer.write(b"".join(parts))
            return
        messages = -(-len(msg) // NOISE_PLAINTEXT_BYTES)
        wire_bytes = len(msg) + messages * (prefix_bytes + TAG_BYTES)
        # One buffer per connection, reused write after write (writes are serialised by
        # yamux's write lock; a concurrent writer, should there be one, gets its own).
        wire = getattr(self, "_dlx_wire", None)
        if wire is None or len(wire) < wire_bytes or getattr(self, "_dlx_wire_busy", False):
            wire = bytearray(max(wire_bytes, _MAX_FRAME_WIRE_BYTES))
            if not getattr(self, "_dlx_wire_busy", False):
                self._dlx_wire = wire
        busy = wire is getattr(self, "_dlx_wire", None)
        with memoryview(wire) as out:
            position = 0
            for start in range(0, len(msg), NOISE_PLAINTEXT_BYTES):
                plaintext = view[start : start + NOISE_PLAINTEXT_BYTES]  # a frame's first is a short copy
                size = len(plaintext) + TAG_BYTES
                out[position : position + prefix_bytes] = size.to_bytes(prefix_bytes, "big")
                position += prefix_bytes
                state.cipher.cipher.encrypt_into(
                    nonce(state), plaintext, None, out[position : position + size]
                )
                state.n += 1
                position += size
            self._dlx_wire_busy = busy
            try:
                await self.read_writer.read_write_closer.write(out[:wire_bytes])
            finally:
                if busy:
                    self._dlx_wire_busy = False

    _noise_io.BaseNoiseMsgReadWriter.write_msg = write_msg  # type: ignore[method-assign]


class YamuxFrame:
    """An outgoing yamux DATA frame kept as its header and a view of its payload (no concatenation).

    py-libp2p 0.8.1 builds each frame as ``header + chunk``: a copy of every sent
    byte (1 MiB per frame) just before the Noise writer encrypts it into the wire
    buffer anyway. This stands in for those bytes between ``YamuxStream.write``
    and ``write_msg`` (:func:`uncopied_yamux_writes`), supporting what
    ``Yamux._write_frame`` does with a frame (``len``, ``frame[:HEADER_SIZE]``)
    and slices as the writer takes them: only a slice that spans the header is
    copied (the first Noise message of a frame, 64 KiB).
    """

    __slots__ = ("header", "payload")

    def __init__(self, header: bytes, payload: memoryview) -> None:
        self.header = header
        self.payload = payload

    def __len__(self) -> int:
        return len(self.header) + len(self.payload)

    def __getitem__(self, key: slice) -> Any:
        start, stop, step = key.indices(len(self))
        if step != 1:
            return self.tobytes()[key]
        header_bytes = len(self.header)
        if start >= header_bytes:
            return self.payload[start - header_bytes : stop - header_bytes]
        if stop <= header_bytes:
            return self.header[start:stop]
        return self.header[start:] + self.payload[: stop - header_bytes]

    def tobytes(self) -> bytes:
        return self.header + bytes(self.payload)


def uncopied_yamux_writes() -> None:
    """Hand each outgoing yamux DATA frame to the Noise writer as header + payload view, not joined.

    The stock ``YamuxStream.write`` (py-libp2p 0.8.1), line for line, except that
    over a keyed ChaChaPoly Noise session a frame is a :class:`YamuxFrame`
    instead of ``header + chunk``; the window accounting, locks, the 10 ms poll
    of an empty send window and its 5 s timeout are unchanged.
    """
    original_write = _yamux.YamuxStream.write

    async def write(self: Any, data: bytes) -> None:
        secured = self.conn.secured_conn
        if not isinstance(secured, SecureSession) or chacha_state(secured.conn, "encrypt") is None:
            return await original_write(self, data)
        if self.send_closed:
            raise MuxedStreamError("Stream is closed for sending")
        view = memoryview(data)
        total_len = len(view)
        sent = 0
        while sent < total_len:
            frame: YamuxFrame | None = None
            while frame is None:
                async with self.rw_lock.write_lock():
                    if self.send_closed:
                        raise MuxedStreamError("Stream is closed for sending")
                    async with self.window_lock:
                        if self.closed:
                            raise MuxedStreamError("Stream is closed")
                        if self.send_window > 0:
                            max_payload = _yamux.MAX_MESSAGE_SIZE - _yamux.HEADER_SIZE
                            to_send = min(self.send_window, max_payload, total_len - sent)
                            self.send_window -= to_send
                            header = struct.pack(
                                _yamux.YAMUX_HEADER_FORMAT, 0, _yamux.TYPE_DATA, 0, self.stream_id, to_send
                            )
                            frame = YamuxFrame(header, view[sent : sent + to_send])
                if frame is not None:
                    break
                self._zero_window_waits += 1
                with trio.move_on_after(5.0) as cancel_scope:
                    while True:
                        async with self.window_lock:
                            if self.send_window > 0 or self.closed:
                                break
                        await trio.sleep(0.01)
                if cancel_scope.cancelled_caught:
                    raise MuxedStreamError("Timed out waiting for window update after 5 seconds.")
            await self.conn._write_frame(frame)
            sent += len(frame.payload)

    write._dlx_original = original_write  # type: ignore[attr-defined]
    _yamux.YamuxStream.write = write  # type: ignore[method-assign]
