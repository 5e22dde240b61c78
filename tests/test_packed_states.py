"""Start states kept as packed blobs: shared runs stored once, the same bytes served (issue 75,
p2p/blobpack.py).

A node serves its start state every round and keeps a few rounds' worth while the chain's windows are open;
about half of a state's bytes are runs it or an earlier state holds already. The blob store keeps such a
file as pieces shared by content. These tests check that what is served is byte for byte the file (also to
a real py-libp2p peer on 127.0.0.1), that the disk holds each shared run once, that removing a blob frees
only what no other blob names, that a restart serves the same blobs, and that a damaged manifest or piece
is refused rather than served.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import struct

import pytest
from waiting import wait_until

from node.live.checks.heldstates import HeldStates, state_cuts
from p2p.blobpack import MANIFEST_MAGIC, MANIFEST_SUFFIX, MIN_PIECE_BYTES, PACKED_DIR, PIECES_DIR, read_packed
from p2p.blobstore import BlobStore
from p2p.errors import BlobError
from training.reexec import round_meta
from training.replica_capture import StartStateCapture, capture_trainer_part

from tests.test_start_state_streaming import _round, _stage


def _disk(root) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and ".staging" not in p.parts)


def _pieces(store: BlobStore) -> set[str]:
    return {p.name for p in store.pieces_dir.iterdir()} if store.pieces_dir.is_dir() else set()


def _file(tmp_path, name: str, runs: list[bytes]):
    path = tmp_path / name
    path.write_bytes(b"".join(runs))
    cuts, offset = [], 0
    for run in runs:
        cuts.append((offset, len(run)))
        offset += len(run)
    return path, cuts


def test_a_packed_blob_is_its_file_byte_for_byte_and_shares_its_runs(tmp_path):
    store = BlobStore(tmp_path / "blobs", max_blob_bytes=1 << 24)
    rng = random.Random(7)
    shared, small = rng.randbytes(3 * MIN_PIECE_BYTES + 5), rng.randbytes(100)
    a, cuts_a = _file(tmp_path, "a", [b"head-a", shared, small, rng.randbytes(2 * MIN_PIECE_BYTES), shared])
    b, cuts_b = _file(tmp_path, "b", [b"head-b", shared, rng.randbytes(MIN_PIECE_BYTES)])
    digest_a, digest_b = store.put_packed(a, cuts_a), store.put_packed(b, cuts_b)
    assert digest_a == hashlib.sha256(a.read_bytes()).hexdigest()
    assert digest_b == hashlib.sha256(b.read_bytes()).hexdigest()
    assert not store.has(digest_a) and store.packed(digest_a) is not None  # no file holds it
    for path, digest in ((a, digest_a), (b, digest_b)):
        data, packed = path.read_bytes(), store.packed(digest)
        assert packed.size == len(data) and packed.pread(0, len(data) + 99) == data
        for _ in range(200):  # any range, across parts and pieces
            offset = rng.randrange(len(data))
            length = rng.randrange(1, len(data) - offset + 1)
            assert packed.pread(offset, length) == data[offset:offset + length]
        assert read_packed(store.root, digest) == data
    # the shared run is one piece, named three times; the 100-byte run is literal
    assert len(_pieces(store)) == 3
    pieces_bytes = sum(p.stat().st_size for p in store.pieces_dir.iterdir())
    assert pieces_bytes == len(shared) + 2 * MIN_PIECE_BYTES + MIN_PIECE_BYTES
    assert pieces_bytes < a.stat().st_size + b.stat().st_size - len(shared) * 2
    # removing a frees its own piece, not the shared one; removing b frees everything
    assert store.remove(digest_a) and store.packed(digest_a) is None
    assert len(_pieces(store)) == 2 and read_packed(store.root, digest_b) == b.read_bytes()
    assert not (store.packed_dir / f"{digest_a}{MANIFEST_SUFFIX}").exists()
    assert store.remove(digest_b) and _pieces(store) == set() and list(store.packed_dir.iterdir()) == []
    assert not store.remove(digest_b)


def test_a_restart_serves_the_same_blobs_and_sweeps_what_no_manifest_names(tmp_path):
    store = BlobStore(tmp_path / "blobs", max_blob_bytes=1 << 24)
    path, cuts = _file(tmp_path, "a", [b"x" * 10, os.urandom(2 * MIN_PIECE_BYTES)])
    digest = store.put_packed(path, cuts)
    (store.pieces_dir / ("0" * 64)).write_bytes(b"a piece a crash left before its manifest")
    again = BlobStore(tmp_path / "blobs", max_blob_bytes=1 << 24)
    assert again.packed(digest).pread(0, 1 << 20) == path.read_bytes()
    assert ("0" * 64) not in _pieces(again) and len(_pieces(again)) == 1


@pytest.mark.parametrize("damage", ["other magic", "size off by one", "unknown part", "truncated",
                                    "trailing bytes", "piece missing", "piece short", "empty piece"])
def test_a_damaged_manifest_or_piece_is_not_served(tmp_path, damage, caplog):
    store = BlobStore(tmp_path / "blobs", max_blob_bytes=1 << 24)
    path, cuts = _file(tmp_path, "a", [b"head", os.urandom(2 * MIN_PIECE_BYTES), b"tail"])
    digest = store.put_packed(path, cuts)
    manifest = store.packed_dir / f"{digest}{MANIFEST_SUFFIX}"
    data = bytearray(manifest.read_bytes())
    head = len(MANIFEST_MAGIC)
    piece_at = head + 12 + 1 + 4 + 4  # the second part: after the first, a 4-byte literal
    piece = store.pieces_dir / bytes(data[piece_at + 1:piece_at + 33]).hex()
    assert data[piece_at:piece_at + 1] == b"p" and piece.is_file()
    if damage == "other magic":
        data[head - 1:head] = b"2"
    elif damage == "size off by one":
        data[head:head + 8] = struct.pack("<Q", struct.unpack("<Q", data[head:head + 8])[0] + 1)
    elif damage == "unknown part":
        data[piece_at:piece_at + 1] = b"x"
    elif damage == "truncated":
        del data[-3:]
    elif damage == "trailing bytes":
        data += b"\0"
    elif damage == "piece missing":
        piece.unlink()
    elif damage == "piece short":
        piece.chmod(0o644)
        piece.write_bytes(piece.read_bytes()[:-1])
    else:
        data[piece_at + 33:piece_at + 41] = struct.pack("<Q", 0)
    manifest.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        again = BlobStore(tmp_path / "blobs", max_blob_bytes=1 << 24)
    assert again.packed(digest) is None and f"packed blob {manifest} not served" in caplog.text
    assert read_packed(again.root, digest) is None


def test_a_bad_cut_or_an_oversized_file_is_refused_and_leaves_nothing(tmp_path):
    store = BlobStore(tmp_path / "blobs", max_blob_bytes=3 * MIN_PIECE_BYTES)
    path, _ = _file(tmp_path, "a", [os.urandom(2 * MIN_PIECE_BYTES)])
    with pytest.raises(BlobError, match="out of order or past the file's end"):
        store.put_packed(path, [(MIN_PIECE_BYTES, MIN_PIECE_BYTES), (0, MIN_PIECE_BYTES)])
    with pytest.raises(BlobError, match="out of order or past the file's end"):
        store.put_packed(path, [(MIN_PIECE_BYTES, 2 * MIN_PIECE_BYTES)])
    big, cuts = _file(tmp_path, "big", [os.urandom(4 * MIN_PIECE_BYTES)])
    with pytest.raises(BlobError, match="exceeds max_blob_bytes"):
        store.put_packed(big, cuts)
    assert _pieces(store) == set() and not list(store.staging.iterdir())


class PackingHost:
    """A node's blob side on a real :class:`BlobStore` (what P2PHost's provide_blob / provide_packed /
    remove_blob do to it, without the DHT)."""

    def __init__(self, store: BlobStore) -> None:
        self.store = store

    def provide_blob(self, data, announce: bool = True, link: bool = False) -> str:
        return self.store.put_bytes(data) if isinstance(data, bytes) else self.store.put_file(data, link=link)

    def provide_packed(self, path, cuts, compress=False) -> str:
        return self.store.put_packed(path, cuts, compress)

    def provide_packed_parts(self, parts) -> str:
        return self.store.put_packed_parts(parts)

    def remove_blob(self, digest: str) -> bool:
        return self.store.remove(digest)


def _served_states(tmp_path, rounds: int):
    """A node's own start states of ``rounds`` real rounds of the ``tiny`` stage, served as the node serves
    them (StartStateCapture.write, then HeldStates.serve); (store, states, {round: the file's bytes})."""
    cfg, trainer, module, optimizer, engine = _stage()
    store = BlobStore(tmp_path / "blobs", max_blob_bytes=1 << 26)
    states = HeldStates(PackingHost(store), tmp_path / "work", tmp_path / "evidence", num_stages=1,
                        stop=None)
    blobs, written = {}, {}
    for outer_round in range(rounds):
        meta = round_meta(outer_round, 0, cfg.model, cfg.diloco, run_rounds=rounds, num_stages=1,
                          micro_batches=0)
        capture = StartStateCapture(meta, lambda stage: engine, {0: capture_trainer_part(module, optimizer)})
        path = capture.write(states.writing_dir)[0]
        written[outer_round] = path.read_bytes()
        digest = states.serve(outer_round, {0: path}, 0)[0]
        assert digest == hashlib.sha256(written[outer_round]).digest() and not path.exists()
        _round(cfg, trainer, engine, outer_round, blobs)
    return store, states, written


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Five real rounds' start states served by one node (trained once for this module's tests)."""
    return _served_states(tmp_path_factory.mktemp("served"), 5)


def test_a_nodes_start_states_are_served_packed_at_about_half_their_bytes(served):
    store, states, written = served
    for data in written.values():
        digest = hashlib.sha256(data).hexdigest()
        assert store.packed(digest).pread(0, len(data)) == data == read_packed(store.root, digest)
    files = sum(len(data) for data in written.values())
    held = _disk(store.root)
    # Of a state's copies of the stage, the round-start and last-encode snapshots are the live weights and
    # the decoded update of round r - 1 is the previous state's: about half is stored once.
    assert held < 0.7 * files, (held, files)
    # What a retention drops frees its own pieces and no other state's
    states.forget_before(3)
    for outer_round, data in written.items():
        digest = hashlib.sha256(data).hexdigest()
        assert (store.packed(digest) is None) == (outer_round < 3)
        if outer_round >= 3:
            assert store.packed(digest).pread(0, len(data)) == data
    assert _disk(store.root) < held
    states.forget_before(99)
    assert _pieces(store) == set() and _disk(store.root) == 0


def test_a_start_state_streamed_into_the_store_is_its_file_packed_with_no_file_written(tmp_path):
    # issue 75: a node's own start state goes from its tensors into the store's pieces; the file it was
    # written to before (10 x the stage's weights) sat beside the pieces packed from it
    cfg, trainer, module, optimizer, engine = _stage()
    blobs: dict = {}
    for outer_round in range(2):
        _round(cfg, trainer, engine, outer_round, blobs)
    meta = round_meta(2, 0, cfg.model, cfg.diloco, run_rounds=3, num_stages=1, micro_batches=0)
    capture = StartStateCapture(meta, lambda stage: engine, {0: capture_trainer_part(module, optimizer)})
    path = capture.write(tmp_path / "written")[0]
    data = path.read_bytes()
    filed = BlobStore(tmp_path / "filed", max_blob_bytes=1 << 26)
    digest = filed.put_packed(path, state_cuts(path))
    streamed = BlobStore(tmp_path / "streamed", max_blob_bytes=1 << 26)
    held = HeldStates(PackingHost(streamed), tmp_path / "work", tmp_path / "evidence", num_stages=1,
                      stop=None)
    assert held.streams_parts()
    assert held.serve(2, capture.streams(), 0) == {0: hashlib.sha256(data).digest()}
    assert digest == hashlib.sha256(data).hexdigest()
    assert streamed.packed(digest).pread(0, len(data)) == data == read_packed(streamed.root, digest)
    # the same manifest and pieces as the file's packing: shared with the states packed from files
    manifest = f"{PACKED_DIR}/{digest}{MANIFEST_SUFFIX}"
    assert (streamed.root / manifest).read_bytes() == (filed.root / manifest).read_bytes()
    assert _pieces(streamed) == _pieces(filed) and not list(streamed.staging.iterdir())
    assert not list(held.writing_dir.glob("*")) and held.expected_part_bytes(0) == len(data)
    # stored once per distinct tensor, as the file's packing (the round-start snapshot is the live weights)
    assert _disk(streamed.root) < 0.7 * len(data)


def test_a_packed_start_state_is_fetched_whole_by_a_real_peer(served, tmp_path):
    from p2p.config import P2PConfig
    from p2p.host import P2PHost
    from p2p.identity import Identity

    written = {r: data for r, data in served[2].items() if r >= 2}
    a = P2PHost.start(P2PConfig(gossip_resync_interval=0), Identity.generate(), data_dir=tmp_path / "a")
    b = P2PHost.start(P2PConfig(bootstrap=a.listen_addrs, gossip_resync_interval=0), Identity.generate(),
                      data_dir=tmp_path / "b")
    try:
        wait_until(lambda: b.peer_id in a.peers() and a.peer_id in b.peers(), 60, "a and b connected")
        for outer_round, data in written.items():
            path = tmp_path / f"state-{outer_round}"
            path.write_bytes(data)
            digest = a.provide_packed(path, state_cuts(path))
            got = b.fetch_blob(digest, tmp_path / f"got-{outer_round}", providers=[a.peer_id], timeout=60)
            assert got.read_bytes() == data
            assert b.fetch_blob_range(digest, 100, 5000, a.peer_id, timeout=60) == data[100:5100]
        assert (a.store.root / PIECES_DIR).is_dir() and (a.store.root / PACKED_DIR).is_dir()
    finally:
        b.close()
        a.close()


def test_a_published_state_is_packed_with_the_start_states_global_weights_and_momentum(tmp_path):
    """A chunked run's published stage state (the global weights and outer momentum after a round) is kept
    as a packed blob whose tensors are the pieces the node's start state of the next round holds already:
    the same bytes and sha256 as before, served under its alias to a real py-libp2p peer, and under a tenth
    of its size of new disk (issue 75: the published states repeated 2 of a start state's copies of the
    stage for the whole proof window)."""
    from types import SimpleNamespace

    from node.commitments import scheme_named
    from node.live.fraud.chunkstate import ChunkedStates, state_key
    from node.store.checkpoint import Checkpoint
    from p2p.config import P2PConfig
    from p2p.host import P2PHost
    from p2p.identity import Identity

    cfg, trainer, module, optimizer, engine = _stage()
    blobs: dict = {}
    for outer_round in range(3):
        _round(cfg, trainer, engine, outer_round, blobs)
    a = P2PHost.start(P2PConfig(gossip_resync_interval=0), Identity.generate(), data_dir=tmp_path / "a")
    b = P2PHost.start(P2PConfig(bootstrap=a.listen_addrs, gossip_resync_interval=0), Identity.generate(),
                      data_dir=tmp_path / "b")
    try:
        held = HeldStates(a, tmp_path / "work", tmp_path / "evidence", num_stages=1, stop=None)
        meta = round_meta(3, 0, cfg.model, cfg.diloco, run_rounds=4, num_stages=1, micro_batches=0)
        capture = StartStateCapture(meta, lambda stage: engine, {0: capture_trainer_part(module, optimizer)})
        held.serve(3, capture.write(held.writing_dir), 0)
        before = _disk(a.store.root)
        state = engine.state_dict(copy=True)
        weights, momentum = state["global_weights"], state["momentum"]
        layout = SimpleNamespace(run_id=7, model_config={"preset": "test"})
        states = ChunkedStates(cfg=SimpleNamespace(commitment_scheme=scheme_named("chunked")), host=a,
                               layout=layout, config_hash=b"\x01" * 32, spill_dir=tmp_path / "chunk-states")
        leaf = hashlib.sha256(b"a stage leaf").digest()
        states.publish(2, 0, leaf, weights, momentum)
        expected = Checkpoint(7, 2, {"preset": "test"}, b"\x01" * 32, {}, weights, momentum).to_bytes()
        digest = states._published[2][0]
        assert digest == hashlib.sha256(expected).hexdigest() and not a.store.has(digest)
        assert a.read_blob(digest) == expected and list((tmp_path / "chunk-states").iterdir()) == []
        added = _disk(a.store.root) - before
        assert added < len(expected) / 10, (added, len(expected))  # the manifest only
        wait_until(lambda: b.peer_id in a.peers() and a.peer_id in b.peers(), 60, "a and b connected")
        assert b.fetch_alias(state_key(leaf), a.peer_id, len(expected) + 1, timeout=60) == expected
        # removing the start state keeps every piece the published state names, and the reverse
        held.forget_before(99)
        assert a.read_blob(digest) == expected
        assert a.remove_blob(digest) and _pieces(a.store) == set()
    finally:
        b.close()
        a.close()


def _sparse(rng: random.Random, size: int) -> bytes:
    """Bytes like a version-3 stage's sum trees: big-endian sums, mostly zero bytes (91-96% in a real run)."""
    data = bytearray(size)
    for at in range(0, size - 8, 96):
        data[at + 88:at + 96] = rng.randrange(1 << 40).to_bytes(8, "big")
    return bytes(data)


def test_a_blob_packed_compressed_is_its_file_byte_for_byte_at_a_fraction_of_its_bytes(tmp_path):
    """``compress``: the literal runs become compressed pieces (blocks of at most 1 MiB) where zlib saves a
    quarter, an incompressible run stays literal; every range reads back as the file, after a restart too,
    and the pieces go with the blob."""
    from p2p.blobpack import COMPRESS_BLOCK_BYTES, MANIFEST_MAGIC_V2

    store = BlobStore(tmp_path / "blobs", max_blob_bytes=1 << 24)
    rng = random.Random(11)
    sparse, noise = _sparse(rng, 2 * COMPRESS_BLOCK_BYTES), rng.randbytes(2 * MIN_PIECE_BYTES)
    path, _cuts = _file(tmp_path, "norms", [sparse, noise])
    data = path.read_bytes()
    digest = store.put_packed(path, [], compress=True)
    assert digest == hashlib.sha256(data).hexdigest() and not store.has(digest)
    manifest = (store.packed_dir / f"{digest}{MANIFEST_SUFFIX}").read_bytes()
    assert manifest.startswith(MANIFEST_MAGIC_V2)
    kinds = [part[0] for part in store.packed(digest).parts]
    assert kinds == ["z", "z", "b"], kinds  # the sparse run's two blocks, then the noise's literally
    assert _disk(store.root) < len(data) / 5, (_disk(store.root), len(data))
    for blob in (store.packed(digest), BlobStore(tmp_path / "blobs", max_blob_bytes=1 << 24).packed(digest)):
        assert blob.pread(0, len(data) + 1) == data
        for _ in range(100):
            offset = rng.randrange(len(data))
            length = rng.randrange(1, min(3 * COMPRESS_BLOCK_BYTES, len(data) - offset) + 1)
            assert blob.pread(offset, length) == data[offset:offset + length]
    assert read_packed(store.root, digest) == data
    # without compress the same file is one literal run in its manifest, as before (version 1)
    plain = BlobStore(tmp_path / "plain", max_blob_bytes=1 << 24)
    assert plain.put_packed(path, []) == digest
    assert (plain.packed_dir / f"{digest}{MANIFEST_SUFFIX}").read_bytes().startswith(MANIFEST_MAGIC)
    assert store.remove(digest) and _pieces(store) == set()


@pytest.mark.parametrize("damage", ["piece garbled", "inflates short", "version 1 magic"])
def test_a_damaged_compressed_piece_or_manifest_is_not_served(tmp_path, damage, caplog):
    import zlib

    store = BlobStore(tmp_path / "blobs", max_blob_bytes=1 << 24)
    path, _cuts = _file(tmp_path, "norms", [_sparse(random.Random(3), 300_000)])
    digest = store.put_packed(path, [], compress=True)
    manifest = store.packed_dir / f"{digest}{MANIFEST_SUFFIX}"
    (piece,) = [store.pieces_dir / name for name in _pieces(store)]
    stored = piece.stat().st_size
    piece.chmod(0o644)
    if damage == "piece garbled":  # the same length, other bytes: it does not inflate
        piece.write_bytes(b"\xff" * stored)
    elif damage == "inflates short":  # a valid stream of the right stored length but fewer bytes
        short = zlib.compress(b"\0" * 1000, 6)
        piece.write_bytes(short + b"\0" * (stored - len(short)))
    else:
        manifest.write_bytes(MANIFEST_MAGIC + manifest.read_bytes()[len(MANIFEST_MAGIC):])
    with caplog.at_level(logging.WARNING):
        again = BlobStore(tmp_path / "blobs", max_blob_bytes=1 << 24)
    assert read_packed(again.root, digest) is None
    if damage == "version 1 magic":  # a version-1 reader refuses a compressed piece
        assert again.packed(digest) is None and "part kind b'z' unknown" in caplog.text
    else:  # the lengths match: loaded, but no byte of it is served
        with pytest.raises(BlobError, match="does not inflate"):
            again.packed(digest).pread(0, 10)


def test_a_version_3_stages_sum_trees_are_kept_compressed_and_fetched_whole_by_a_real_peer(tmp_path):
    """What a version-3 run publishes beside a stage's state (its factors and sum trees, under
    ``norms_key(leaf)``) is kept as compressed pieces where the node spills (issue 75: 0.75 x the stage's
    bytes a round at ``mini``, for every round of the proof window), and a real py-libp2p peer fetches the
    same bytes under the alias."""
    from types import SimpleNamespace

    from node.commitments import scheme_named
    from node.live.fraud.chunkstate import ChunkedStates
    from p2p.config import P2PConfig
    from p2p.host import P2PHost
    from p2p.identity import Identity

    a = P2PHost.start(P2PConfig(gossip_resync_interval=0), Identity.generate(), data_dir=tmp_path / "a")
    b = P2PHost.start(P2PConfig(bootstrap=a.listen_addrs, gossip_resync_interval=0), Identity.generate(),
                      data_dir=tmp_path / "b")
    try:
        states = ChunkedStates(cfg=SimpleNamespace(commitment_scheme=scheme_named("normed")), host=a,
                               layout=SimpleNamespace(run_id=7), config_hash=b"\x01" * 32,
                               spill_dir=tmp_path / "chunk-states")
        blob = _sparse(random.Random(5), 600_000)
        alias = hashlib.sha256(b"norms of a stage leaf").hexdigest()
        before = _disk(a.store.root)
        states.publish_part(2, 0, alias, blob)
        digest = states._published_norms[2][0]
        assert digest == hashlib.sha256(blob).hexdigest() and a.read_blob(digest) == blob
        assert _disk(a.store.root) - before < len(blob) / 5
        assert list((tmp_path / "chunk-states").iterdir()) == []
        wait_until(lambda: b.peer_id in a.peers() and a.peer_id in b.peers(), 60, "a and b connected")
        assert b.fetch_alias(alias, a.peer_id, len(blob) + 1, timeout=60) == blob
        states.forget_before(99)  # its window closed: gone with its pieces
        assert not a.store.packed(digest) and _pieces(a.store) == set()
    finally:
        b.close()
        a.close()
