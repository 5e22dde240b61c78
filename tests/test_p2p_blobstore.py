"""Blob store (atomic, verified, content-addressed) and the token bucket used for link shaping."""

import hashlib
import os

import pytest
import trio
import trio.testing

from p2p.blobstore import BlobStore, check_sha256_hex
from p2p.errors import BlobError, BlobHashMismatch, BlobNotFound, BlobTooLarge
from p2p.ratelimit import MIN_BURST_BYTES, PeerRateLimiter, TokenBucket


def test_put_bytes_and_file_are_content_addressed(tmp_path):
    store = BlobStore(tmp_path / "blobs", max_blob_bytes=1 << 20)
    data = os.urandom(300_000)
    sha = store.put_bytes(data)
    assert sha == hashlib.sha256(data).hexdigest()
    assert store.has(sha) and store.size(sha) == len(data)
    source = tmp_path / "src.bin"
    source.write_bytes(data[::-1])
    sha2 = store.put_file(source)
    assert store.path(sha2).read_bytes() == data[::-1]
    assert store.list() == sorted([sha, sha2])
    assert list(store.staging.iterdir()) == []


def test_limits_and_bad_ids(tmp_path):
    store = BlobStore(tmp_path, max_blob_bytes=10)
    with pytest.raises(BlobTooLarge):
        store.put_bytes(b"x" * 11)
    with pytest.raises(BlobError):
        check_sha256_hex("../../etc/passwd")
    with pytest.raises(BlobNotFound):
        store.export("ab" * 32, tmp_path / "out")


def test_commit_refuses_wrong_content(tmp_path):
    store = BlobStore(tmp_path, max_blob_bytes=1 << 20)
    staged = store.new_staging_file()
    staged.write_bytes(b"not what was promised")
    with pytest.raises(BlobHashMismatch):
        store.commit(staged, hashlib.sha256(b"promised").hexdigest())
    assert not staged.exists() and store.list() == []


def test_export_links_and_remove(tmp_path):
    store = BlobStore(tmp_path / "blobs", max_blob_bytes=1 << 20)
    sha = store.put_bytes(b"abc")
    out = store.export(sha, tmp_path / "nested" / "out.bin")
    assert out.read_bytes() == b"abc"
    assert out.stat().st_mode & 0o777 == 0o444  # a shared inode: nobody edits the stored blob in place
    assert store.export(sha, out) == out  # exporting onto itself is a no-op
    assert store.remove(sha) and not store.has(sha) and not store.remove(sha)
    assert out.read_bytes() == b"abc"  # the exported copy survives


def test_leftover_staging_files_are_cleaned(tmp_path):
    store = BlobStore(tmp_path, max_blob_bytes=100)
    store.new_staging_file().write_bytes(b"half a transfer")
    BlobStore(tmp_path, max_blob_bytes=100)
    assert list(store.staging.iterdir()) == []


def test_token_bucket_holds_the_rate():
    async def run():
        bucket = TokenBucket(rate=1_000_000, burst=100_000)
        start = trio.current_time()
        for _ in range(30):
            await bucket.consume(1 << 20)  # chunks larger than the burst still average out
        return trio.current_time() - start

    elapsed = trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))
    expected = (30 * (1 << 20) - 100_000) / 1_000_000
    assert expected * 0.99 <= elapsed <= expected * 1.01


def test_peer_limiter_is_per_peer_and_can_be_off():
    async def run():
        limiter = PeerRateLimiter(rate=1_000_000)
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            for peer in ("a", "b"):
                # a full bucket (the default burst) passes at once; 2 MB more take 2 s
                nursery.start_soon(limiter.consume, peer, "out", MIN_BURST_BYTES + 2_000_000)
        both = trio.current_time() - start
        off = PeerRateLimiter(rate=0)
        start = trio.current_time()
        await off.consume("a", "out", 10**12)
        return both, trio.current_time() - start

    both, off = trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))
    assert 1.9 <= both <= 2.0  # two peers in parallel: each at its own 1 MB/s
    assert off == 0


def test_removing_a_blob_drops_its_aliases(tmp_path):
    """An alias outlived its blob: one entry in memory for every published chunked state a run dropped."""
    store = BlobStore(tmp_path / "blobs", max_blob_bytes=1 << 20)
    kept = store.put_bytes(b"kept")
    for n in range(50):  # a long run: a state published and dropped every round
        sha, leaf = store.put_bytes(f"state {n}".encode()), hashlib.sha256(f"leaf {n}".encode()).hexdigest()
        store.alias(leaf, sha)
        assert store.served_path(leaf).read_bytes() == f"state {n}".encode()
        assert store.remove(sha)
    key = hashlib.sha256(b"kept leaf").hexdigest()
    store.alias(key, kept)
    assert store._aliases == {key: kept}  # 51 before: every removed blob's alias stayed
    assert not store.served_path(leaf).exists()  # an alias of a removed blob served nothing before either
    assert store.served_path(key).read_bytes() == b"kept"
