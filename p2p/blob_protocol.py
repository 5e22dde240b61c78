"""``/dlx/blob/1.0.0``: content-addressed bulk transfer over libp2p streams.

One request per stream (docs/P2P.md, "Blobs", is the specification; the frame
builders below are the only place the frames are made). The client sends one
frame ``{sha256: bin32, offset: int, length: int}`` of at most 4096 bytes
(``length == 0`` asks for the header only). The server answers one reply frame
(at most 4096 bytes), then, if ``status == "ok"``, exactly ``length`` raw bytes
in writes of ~1 MiB, then closes its side. The reply's keys depend on its status::

    ok            {status, total, sha256, offset, length}
    not_found     {status}
    out_of_range  {status, total}
    busy          {status}
    bad_request   {status, detail}

The server is :mod:`p2p.blob_server`. The client (:mod:`p2p.blob_client`) downloads
a blob as 8 MiB pieces spread over every provider at once (up to ``blob_concurrency``
streams); the first piece is asked for beside the size queries rather than after them;
a piece interrupted by a dying provider is put back with its remaining range and
finished by another provider. The bytes
land in a staging file (:mod:`p2p.staging`: copied per ~4 MiB into a reused aligned
buffer and written from it) and are hashed in order from that buffer as they
arrive (off the event loop); only a file matching its sha256 is committed to the
:class:`~p2p.blobstore.BlobStore`: nothing unverified is ever handed over. The
built-in libp2p request/response helper and Bitswap are not used: the first
fails above ~6.5 MB, the second runs at ~20 MB/s and holds the file in memory
several times.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from p2p.fastpath_send import YAMUX_FRAME_PAYLOAD_BYTES
from p2p.wire import ProtocolViolation, field

BLOB_PROTOCOL = TProtocol("/dlx/blob/1.0.0")
# One write on the stream: whole yamux frames of full Noise messages (p2p.fastpath_send),
# so no write ends in a runt frame; ~1 MiB.
CHUNK_BYTES = max(1, (1 << 20) // YAMUX_FRAME_PAYLOAD_BYTES) * YAMUX_FRAME_PAYLOAD_BYTES
PIECE_BYTES = 8 << 20  # unit of work handed to one provider
FILE_IO_BYTES = 4 * CHUNK_BYTES  # one disk read/write off the event loop (~4 MiB)
HASH_MEMORY_BYTES = 32 << 20  # received chunks kept for in-order hashing, at most
MAX_FRAME_BYTES = 4096  # request and reply frame bodies

RunBlocking = Callable[..., Awaitable[Any]]
OpenStream = Callable[[ID, TProtocol], Awaitable[Any]]


def request_frame(digest: bytes, offset: int, length: int) -> dict[str, Any]:
    """The client's request: ``length`` bytes of the blob ``digest`` from ``offset`` (0 = header only)."""
    return {"sha256": digest, "offset": offset, "length": length}


def parse_request(frame: dict[str, Any]) -> tuple[bytes, int, int]:
    """(sha256, offset, length) of a request frame; raises ProtocolViolation (reply ``bad_request``)."""
    digest = field(frame, "sha256", bytes)
    offset = field(frame, "offset", int, 0)
    length = field(frame, "length", int, 0)
    if len(digest) != 32:
        raise ProtocolViolation("sha256 must be 32 bytes")
    return digest, offset, length


def parse_reply(frame: dict[str, Any], digest: bytes, offset: int, length: int) -> tuple[str, int | None]:
    """(status, total) of a reply to the request (digest, offset, length); raises ProtocolViolation.

    An ``ok`` reply must echo the request and carry a ``total`` the range fits in; any other status
    means "this provider cannot serve this range now" (its ``total``, if any, is returned when it
    is an int).
    """
    status = field(frame, "status", str)
    if status != "ok":
        total = frame.get("total")
        return status, total if type(total) is int else None
    if field(frame, "sha256", bytes) != digest or field(frame, "offset", int) != offset:
        raise ProtocolViolation("header does not match the request")
    if field(frame, "length", int) != length:
        raise ProtocolViolation("header length does not match the request")
    total = field(frame, "total", int, 0)
    if offset + length > total:
        raise ProtocolViolation(f"range {offset}+{length} served from a blob of {total} bytes")
    return status, total


def ok_reply(total: int, digest: bytes, offset: int, length: int) -> dict[str, Any]:
    """Header of a served range; ``length`` raw bytes follow it."""
    return {"status": "ok", "total": total, "sha256": digest, "offset": offset, "length": length}


def not_found_reply() -> dict[str, Any]:
    return {"status": "not_found"}


def out_of_range_reply(total: int) -> dict[str, Any]:
    """The blob is here, but ``offset + length`` exceeds its ``total`` size."""
    return {"status": "out_of_range", "total": total}


def busy_reply() -> dict[str, Any]:
    """Every serving slot stayed taken for ``blob_stall_timeout``: ask again later."""
    return {"status": "busy"}


def bad_request_reply(detail: str) -> dict[str, Any]:
    """The request frame was not a valid request; ``detail`` is a human-readable reason."""
    return {"status": "bad_request", "detail": detail}
