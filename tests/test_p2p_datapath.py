"""The blob data path's parts on their own: py-libp2p patches, in-order hashing, chunk writes, the rate
cap."""

import errno
import hashlib
import os
import random

import pytest
import trio
import trio.lowlevel
import trio.testing
from libp2p.io.trio import TrioTCPStream

from p2p import fastpath, fastpath_send, fastpath_streams, fastpath_tcp
from p2p.errors import BlobError
from p2p import staging as staging_module
from p2p.blob_hashing import InOrderHasher
from p2p.blob_server import read_cached
from p2p.errors import BlobError
from p2p.ratelimit import TokenBucket
from p2p.staging import DIRECT_IO_ALIGN, RangeWriter, StagingFile, buffer_pool


async def run_inline(fn, *args, **kwargs):
    """Stands in for the host's thread pool: the hasher's work is the same, only where it runs differs."""
    return fn(*args, **kwargs)


def test_data_path_patches_are_in_force():
    # A py-libp2p upgrade that silently drops them would only show as a slow benchmark.
    assert sorted(fastpath.applied) == [
        "batched_window_updates", "buffered_tcp_reads", "chunked_stream_buffers", "larger_yamux_frames",
        "noise_reads_in_place", "uncopied_yamux_writes",
    ]
    from libp2p.stream_muxer.yamux import yamux

    assert yamux.MAX_MESSAGE_SIZE == fastpath_send.YAMUX_FRAME_NOISE_MESSAGES \
        * fastpath_send.NOISE_PLAINTEXT_BYTES


def test_buffered_tcp_reads_return_every_byte_in_order():
    payload = os.urandom(3 << 20)
    sizes = random.Random(7)

    async def main():
        left, right = trio.socket.socketpair()
        writer = trio.SocketStream(left)
        reader = TrioTCPStream(trio.SocketStream(right))
        received = bytearray()

        async def send():
            await writer.send_all(payload)
            await writer.aclose()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            while True:
                # The sizes Noise and yamux ask for: 2-byte prefixes, 12-byte headers, bodies.
                chunk = await reader.read(sizes.choice([2, 12, 4096, 65535, None]))
                if not chunk:
                    break
                received += chunk
        await reader.close()
        return bytes(received)

    assert trio.run(main) == payload


def test_closing_a_tcp_stream_releases_its_receive_buffer():
    async def main():
        left, right = trio.socket.socketpair()
        writer = trio.SocketStream(left)
        reader = TrioTCPStream(trio.SocketStream(right))
        await writer.send_all(b"x" * 100)
        assert await reader.read(10) == b"x" * 10
        assert len(reader._dlx_buffer.data) == fastpath_tcp.TCP_BUFFER_BYTES
        await reader.close()
        assert reader._dlx_buffer is None  # whoever still holds the stream holds no buffer
        assert await reader.read(10) == b""  # EOF, as py-libp2p's read of a closed stream
        assert reader._dlx_buffer is None  # ... and no new buffer kept
        await writer.aclose()

    trio.run(main)


def test_an_unjoined_yamux_frame_slices_as_its_bytes():
    """What Yamux._write_frame and the Noise writer take of a frame equals the joined header + payload."""
    header, payload = os.urandom(12), os.urandom(200_000)
    frame = fastpath_send.YamuxFrame(header, memoryview(payload))
    joined = header + payload
    assert len(frame) == len(joined) and frame.tobytes() == joined
    step = fastpath_send.NOISE_PLAINTEXT_BYTES
    for start, stop in [(0, 12), (0, step), (step, 2 * step), (5, 20), (12, 13),
                        (3 * step, len(joined) + 99)]:
        assert bytes(frame[start:stop]) == joined[start:stop], (start, stop)
    assert bytes(frame[::7]) == joined[::7]


def test_receive_buffer_grows_keeping_unread_bytes():
    buffer = fastpath_tcp.ReceiveBuffer()
    buffer.data[:10] = b"0123456789"
    buffer.start, buffer.end = 3, 10
    while buffer.read_bytes < fastpath_tcp.MAX_TCP_READ_BYTES:
        buffer.grow()
    assert buffer.read_bytes == fastpath_tcp.MAX_TCP_READ_BYTES
    assert bytes(buffer.data[buffer.start : buffer.end]) == b"3456789"
    assert len(buffer.data) >= fastpath_tcp.MAX_TCP_READ_BYTES + 2 * 65537


def hash_out_of_order(tmp_path, pieces, memory_budget):
    """Write ``pieces`` (offset, bytes) in the given order, as fetch streams do, and hash them."""
    total = sum(len(data) for _, data in pieces)
    path = tmp_path / "staging.part"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDWR)
    try:
        os.ftruncate(fd, total)
        hasher = InOrderHasher(fd, total, run_inline, memory_budget=memory_budget)

        async def main():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(hasher.run)
                for offset, data in pieces:
                    chunks = [data[i : i + 1000] for i in range(0, len(data), 1000)]
                    os.pwritev(fd, chunks, offset)
                    hasher.written(offset, chunks)
                    await trio.lowlevel.checkpoint()  # let the hasher take what is contiguous

        trio.run(main)
    finally:
        os.close(fd)
    return hasher, path


@pytest.mark.parametrize("memory_budget,reads_back", [(1 << 20, False), (5000, True)])
def test_hash_of_pieces_landing_out_of_order(tmp_path, memory_budget, reads_back):
    blob = os.urandom(40_000)
    ranges = [(0, 7000), (7000, 13000), (13000, 30001), (30001, 40000)]
    order = [2, 3, 0, 1]  # the front arrives last: everything else waits in memory or on disk
    pieces = [(ranges[i][0], blob[ranges[i][0] : ranges[i][1]]) for i in order]
    hasher, path = hash_out_of_order(tmp_path, pieces, memory_budget)
    assert hasher.hexdigest() == hashlib.sha256(blob).hexdigest()
    assert path.read_bytes() == blob
    # Within the budget nothing is read back; over it, the excess comes from the staging file.
    assert (hasher.read_back > 0) is reads_back
    assert hasher.read_back <= len(blob)


def test_the_next_range_to_hash_is_hashed_by_the_job_that_writes_it(tmp_path):
    """What a blob fetch's flush does: claim the range if it is next, else leave it to the hasher."""
    blob = os.urandom(30_000)
    path = tmp_path / "staging.part"
    path.write_bytes(b"")
    staging = StagingFile(path, len(blob))
    pool = buffer_pool(1 << 16)
    released = []
    try:
        hasher = InOrderHasher(staging.fd, len(blob), run_inline)

        async def main():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(hasher.run)
                for start, end in [(0, 10_000), (20_000, 30_000), (10_000, 20_000)]:
                    writer = RangeWriter(staging, start, pool)
                    chunks = [blob[start : start + 4000], bytearray(blob[start + 4000 : end])]
                    if hasher.claim(start):
                        block = hasher.write_and_hash(writer, chunks, final=True)
                        hasher.hashed_inline(start, [block.view])
                        writer.release(block)
                    else:
                        block = writer.write(chunks, final=True)
                        assert hasher.written(start, [block.view], released.append)
                    assert writer.position == end
                    await trio.lowlevel.checkpoint()

        trio.run(main)
    finally:
        staging.close()
    assert hasher.hexdigest() == hashlib.sha256(blob).hexdigest()
    assert path.read_bytes() == blob
    # The first and the middle range were next when written; the last waited in memory and was
    # handed back once hashed.
    assert hasher.hashed_with_write == 20_000 and hasher.read_back == 0
    assert [len(view) for view in released] == [10_000]


def write_ranges(path, blob, ranges, direct, fail_at=None, seed=3):
    """Write ``blob`` into a staging file at ``path`` range by range, in chunks of random sizes.

    ``ranges``: (start, end) in write order, as a download's pieces and resumed pieces land.
    ``fail_at``: {range index: bytes received before its provider "fails"}; the range then
    stops there with a final write, as ``_fetch_piece`` does, and the writer's position says
    what is on disk. Returns each range's final position.
    """
    sizes = random.Random(seed)
    staging = StagingFile(path, len(blob), direct=direct)
    pool = buffer_pool(1 << 18)
    positions = []
    try:
        for index, (start, end) in enumerate(ranges):
            writer = RangeWriter(staging, start, pool)
            stop = end if fail_at is None or index not in fail_at else start + fail_at[index]
            at, batch, buffered = start, [], 0
            while at < stop:
                size = min(stop - at, sizes.choice([1, 511, 4096, 5000, 65536, 100_000]))
                chunk = blob[at : at + size]
                batch.append(chunk if sizes.random() < 0.5 else bytearray(chunk))
                buffered += size
                at += size
                if buffered >= 150_000:
                    block = writer.write(batch, final=False)
                    assert bytes(block.view) == blob[block.offset : block.offset + len(block)]
                    assert writer.position % DIRECT_IO_ALIGN == 0  # what is carried completes a block
                    writer.release(block)
                    batch, buffered = [], 0
            block = writer.write(batch, final=True)
            assert bytes(block.view) == blob[block.offset : block.offset + len(block)]
            writer.release(block)
            assert writer.position == stop and writer.carried == 0
            positions.append(writer.position)
        direct_used = staging.direct
    finally:
        staging.close()
    return positions, direct_used


@pytest.mark.parametrize("direct", [True, False])
def test_range_writes_put_every_byte_at_its_offset(tmp_path, direct):
    # An unaligned total (a last partial block), pieces out of order, and a piece whose provider
    # failed mid-block and was resumed by another from an unaligned offset.
    blob = os.urandom(3 * 400_000 + 1234)
    path = tmp_path / "staging.part"
    path.write_bytes(b"")
    piece = 400_000
    # (the second piece's provider fails after 123457 bytes; the last range resumes it)
    ranges = [(piece, 2 * piece), (0, piece), (2 * piece, len(blob)), (piece + 123_457, 2 * piece)]
    positions, direct_used = write_ranges(path, blob, ranges, direct, fail_at={0: 123_457})
    assert positions == [piece + 123_457, piece, len(blob), 2 * piece]
    assert path.stat().st_size == len(blob)
    assert path.read_bytes() == blob
    if not direct:
        assert not direct_used


def test_direct_writes_refused_at_write_time_fall_back_to_buffered(tmp_path, monkeypatch):
    """A filesystem that opens with O_DIRECT but refuses the writes (EINVAL): the same bytes land buffered."""
    blob = os.urandom(1_000_000 + 17)
    path = tmp_path / "staging.part"
    path.write_bytes(b"")
    real_write_all = staging_module._write_all
    refused = []

    def refusing_write_all(fd, view, offset):
        if fd != staging_under_test[0].fd:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        real_write_all(fd, view, offset)

    staging_under_test = []
    real_init = StagingFile.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        if self.direct_fd is None:  # O_DIRECT unavailable here: pretend it opened
            self.direct_fd = os.open(self.path, os.O_RDWR)
        staging_under_test.append(self)

    monkeypatch.setattr(StagingFile, "__init__", init)
    monkeypatch.setattr(staging_module, "_write_all", refusing_write_all)
    positions, direct_used = write_ranges(path, blob, [(0, len(blob))], direct=True)
    assert refused and not direct_used  # refused once, then every write went buffered
    assert len(refused) == 1
    assert path.read_bytes() == blob


def test_a_closed_staging_file_waits_for_its_running_write(tmp_path):
    """A cancelled download closes its staging file; a write still running keeps the descriptors open."""
    path = tmp_path / "staging.part"
    path.write_bytes(b"")
    staging = StagingFile(path, 1 << 20)
    with staging.writing():
        staging.close()
        assert staging.fd >= 0  # still open for the running write
        staging.write_buffered(memoryview(b"late"), 0)
    assert staging.fd == -1 and staging.direct_fd is None
    with pytest.raises(BlobError), staging.writing():
        pass
    assert path.read_bytes()[:4] == b"late"


def test_a_served_block_is_read_from_the_page_cache_in_place(tmp_path):
    data = os.urandom(300_000)
    path = tmp_path / "blob"
    path.write_bytes(data)  # just written: in the page cache
    buffer = bytearray(1 << 18)
    fd = os.open(path, os.O_RDONLY)
    try:
        block = read_cached(fd, buffer, 100_000, 150_000)
        past_end = read_cached(fd, buffer, 100, len(data))
    finally:
        os.close(fd)
    if not hasattr(os, "RWF_NOWAIT"):
        assert block is None  # the server then reads on its thread pool
        return
    assert bytes(block) == data[150_000:250_000]
    assert past_end is None  # nothing there: the thread-pool read reports the shrunk blob


def test_rate_cap_holds_over_a_transfer_whatever_the_chunk_size():
    rate = 125e6  # 1 Gbps

    async def main():
        bucket = TokenBucket(rate)
        start = trio.current_time()
        sent = 0
        for size in [1 << 20] * 50 + [4 << 20] * 10 + [100] * 30:
            await bucket.consume(size)
            sent += size
        return bucket, sent, trio.current_time() - start

    bucket, sent, elapsed = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    # Virtual time: what the cap allows, less at most one burst (10 ms of the rate, at least 2 MiB).
    assert bucket.burst == pytest.approx(max(rate * 0.01, 2 << 20))
    assert elapsed >= (sent - bucket.burst) / rate
    assert elapsed <= sent / rate + 1e-6


def _through_two_caps(sizes, rate, burst, receiving=True):
    """Virtual seconds for chunks sent through a sending cap, then read under a receiving cap."""

    async def main():
        sender = TokenBucket(rate, burst)
        receiver = TokenBucket(rate, burst, receiving=receiving)  # its clock starts at the request
        start = trio.current_time()
        for size in sizes:
            await sender.consume(size)  # the provider's cap, then the chunk is on the wire
            await receiver.consume(size)  # the fetcher's cap, once it has read the chunk
        return trio.current_time() - start

    return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_small_transfer_under_two_caps_in_series_takes_bytes_over_rate_once():
    # node-level observation (docs/DILOCOX.md): a 344 kB contribution under a 16 KiB bucket
    # took ~1.4x bytes / rate: the receiving cap charged the chunk a second time on arrival.
    rate, burst, size = 10_000.0, 16 << 10, 344_000
    elapsed = _through_two_caps([size], rate, burst)
    assert elapsed == pytest.approx((size - burst) / rate, rel=1e-6)
    charged_twice = _through_two_caps([size], rate, burst, receiving=False)
    assert charged_twice == pytest.approx(2 * (size - burst) / rate, rel=1e-6)
    # a paced stream of frames is not slowed by the receiving cap either
    sizes = [1 << 20] * 20
    assert _through_two_caps(sizes, 125e6, burst) == pytest.approx((sum(sizes) - burst) / 125e6, rel=1e-6)


def test_a_receiving_cap_still_holds_a_sender_that_ignores_the_cap():
    rate, burst, chunk = 1e6, 16 << 10, 1 << 20

    async def main():
        receiver = TokenBucket(rate, burst, receiving=True)
        start = trio.current_time()
        for _ in range(30):
            await receiver.consume(chunk)  # every chunk already there: no pacing upstream
        return trio.current_time() - start

    elapsed = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    # beats the cap by at most one burst plus one chunk
    assert elapsed >= (30 * chunk - burst - chunk) / rate
    assert elapsed <= 30 * chunk / rate


def test_peer_limiter_receiving_clock_starts_at_the_request():
    from p2p.ratelimit import PeerRateLimiter

    async def main():
        limiter = PeerRateLimiter(rate=10_000, burst=1000)
        limiter.expect("a")
        await trio.sleep(10)  # 100 kB arrive at the rate
        start = trio.current_time()
        await limiter.consume("a", "in", 100_000)
        free = trio.current_time() - start
        start = trio.current_time()
        await limiter.consume("b", "in", 100_000)  # never asked for: held to the cap
        held = trio.current_time() - start
        return free, held

    free, held = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert free == 0
    assert held == pytest.approx(99_000 / 10_000)


def test_a_blob_fetch_sends_few_window_updates(tmp_path, monkeypatch):
    """py-libp2p alone credits the yamux window after every read: ~400 updates for 24 MiB."""
    from libp2p.stream_muxer.yamux import yamux

    from p2p.config import P2PConfig
    from p2p.host import P2PHost
    from p2p.identity import Identity

    updates = []
    original = yamux.YamuxStream.send_window_update

    async def counted(self, increment, skip_lock=False):
        updates.append(increment)
        await original(self, increment, skip_lock)

    monkeypatch.setattr(yamux.YamuxStream, "send_window_update", counted)
    blob = os.urandom(24 << 20)
    with P2PHost.start(P2PConfig(), Identity.generate(), data_dir=tmp_path / "provider") as provider, \
            P2PHost.start(P2PConfig(), Identity.generate(), data_dir=tmp_path / "fetcher") as fetcher:
        sha = provider.provide_blob(blob, announce=False)
        fetcher.connect(provider.listen_addrs[0])
        before = len(updates)  # connection set-up (identify, pubsub, DHT) is not the blob's
        out = fetcher.fetch_blob(sha, tmp_path / "out.bin", providers=[provider.peer_id], timeout=60)
        blob_updates = len(updates) - before
    assert out.read_bytes() == blob
    # Per 8 MiB piece: the grant of its whole range, then a credit or two; gossip may add a few.
    assert blob_updates <= 40, blob_updates


def test_chunk_buffer_behaves_as_the_bytearray_yamux_expects():
    """Every operation py-libp2p's yamux performs on a stream buffer, against a real bytearray."""
    rng = random.Random(11)
    chunked, reference = fastpath_streams.ChunkBuffer(), bytearray()
    for _ in range(3000):
        op = rng.choice(["extend", "extend", "slice", "del", "bytes", "take", "take_whole", "clear"])
        n = rng.choice([0, 1, 12, 100, 5000, 70000])
        if op == "extend":
            data = os.urandom(n)
            chunked.extend(rng.choice([data, bytearray(data)]))
            reference.extend(data)
        elif op == "slice":
            assert chunked[:n] == bytes(reference[:n])
        elif op == "del":
            del chunked[:n]
            del reference[:n]
        elif op == "bytes":
            assert bytes(chunked) == bytes(reference)
        elif op in ("take", "take_whole"):
            got = chunked.take(rng.choice([-1, n]), whole_parts=op == "take_whole")
            assert bytes(got) == bytes(reference[: len(got)])
            if op == "take":  # a plain take returns everything it may, as bytes
                assert isinstance(got, bytes)
            del reference[: len(got)]
        else:
            chunked.clear()
            reference.clear()
        assert len(chunked) == len(reference)
        assert bool(chunked) == bool(reference)
    assert bytes(chunked) == bytes(reference)


def test_yamux_stream_buffers_are_chunk_buffers():
    buffers = fastpath_streams.StreamBuffers()
    buffers[1] = bytearray()
    buffers[2] = bytearray(b"x")  # not a fresh buffer: left alone
    assert isinstance(buffers[1], fastpath_streams.ChunkBuffer)
    assert isinstance(buffers[2], bytearray)


def _noise_pair():
    """Two keyed ChaChaPoly Noise states (NN handshake done in memory): (sender, receiver)."""
    from noise.connection import NoiseConnection

    initiator = NoiseConnection.from_name(b"Noise_NN_25519_ChaChaPoly_SHA256")
    responder = NoiseConnection.from_name(b"Noise_NN_25519_ChaChaPoly_SHA256")
    initiator.set_as_initiator()
    responder.set_as_responder()
    initiator.start_handshake()
    responder.start_handshake()
    responder.read_message(initiator.write_message())
    initiator.read_message(responder.write_message())
    return initiator, responder


def _receiving_session(sock, noise_state):
    """py-libp2p's own receiving stack (TCP stream, raw connection, Noise reader, secure session)."""
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.network.connection.raw_connection import RawConnection
    from libp2p.peer.id import ID
    from libp2p.security.noise.io import NoiseTransportReadWriter
    from libp2p.security.secure_session import SecureSession

    keys = create_new_key_pair()
    raw = RawConnection(TrioTCPStream(trio.SocketStream(sock)), False)
    return SecureSession(
        local_peer=ID.from_pubkey(keys.public_key),
        local_private_key=keys.private_key,
        remote_peer=ID.from_pubkey(keys.public_key),
        remote_permanent_pubkey=keys.public_key,
        is_initiator=False,
        conn=NoiseTransportReadWriter(raw, noise_state),
    )


def _wire(sender, plaintexts):
    return b"".join(len(c).to_bytes(2, "big") + c for c in (sender.encrypt(p) for p in plaintexts))


def test_noise_messages_read_in_place_give_the_exact_plaintext():
    """Yamux-sized reads (12-byte headers, bodies straddling Noise messages) over a real socket."""
    from types import SimpleNamespace

    from libp2p.stream_muxer.yamux import yamux

    sender, receiver = _noise_pair()
    rng = random.Random(5)
    plaintext = os.urandom(3 << 20)
    messages, position = [], 0
    while position < len(plaintext):
        size = rng.choice([1, 12, 1000, 65519])
        messages.append(plaintext[position : position + size])
        position += size
    reads = []
    position = 0
    while position < len(plaintext):
        size = min(rng.choice([12, 100, 65519, 70000, 1 << 20]), len(plaintext) - position)
        reads.append(size)
        position += size

    async def main():
        left, right = trio.socket.socketpair()
        session = _receiving_session(right, receiver)
        conn = SimpleNamespace(secured_conn=session)
        received = bytearray()

        async def send():
            await trio.SocketStream(left).send_all(_wire(sender, messages))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            for index, size in enumerate(reads):
                if index % 2:
                    chunk = await yamux.Yamux._read_data_body(conn, size)  # a DATA body, decrypted in place
                else:
                    chunk = await yamux.read_exactly(session, size)  # a header, or any exact read
                assert len(chunk) == size
                received += chunk
        assert session._dlx_noise is not None  # the in-place path, not the stock fallback
        return bytes(received)

    assert trio.run(main) == plaintext


@pytest.mark.parametrize("damage", ["tampered", "truncated"])
def test_noise_reader_refuses_a_tampered_or_cut_message(damage):
    from libp2p.io.exceptions import IncompleteReadError
    from libp2p.stream_muxer.yamux import yamux
    from noise.exceptions import NoiseInvalidMessage

    sender, receiver = _noise_pair()
    wire = bytearray(_wire(sender, [b"a" * 1000, b"b" * 1000]))
    if damage == "tampered":
        wire[-5] ^= 1  # inside the second message's tag
    else:
        del wire[-100:]

    async def main():
        left, right = trio.socket.socketpair()
        session = _receiving_session(right, receiver)
        async with trio.SocketStream(left) as writer:
            await writer.send_all(bytes(wire))
        assert await yamux.read_exactly(session, 1000) == b"a" * 1000
        await yamux.read_exactly(session, 1000)

    expected = NoiseInvalidMessage if damage == "tampered" else IncompleteReadError
    with pytest.raises(expected):
        trio.run(main)
