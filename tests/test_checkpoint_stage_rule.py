"""One checkpoint rule for every stage, a node's own included (issue 63: G2 against a stage holder).

A stage holder that attests the agreed weights but serves other outer momentum used to split the honest
members: its honest co-holder built the checkpoint from its own shard (never comparing it with the others)
and signed a record with it, the members of the other stages saw two momenta and signed one without; the
quorum's record left the co-holder's signature out, and the node attests only what it signed. Now a node's
own shard is one of the attested shards, read from its disk and judged like the others, and in a chunked
run the agreed stage leaf names the momentum to take. Members that heard the same attestations build the
same checkpoint, or none, whether they hold the stage or not.

Real RoundBook, Membership, checkpoint bytes, stage leaves and CheckpointBuilder; the peers' blob store is
a dict served through the host's ``fetch_blob`` (the network is not what is tested here).
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from types import SimpleNamespace

import torch

from ledger.chunkproof import StageLeaf, tree_root
from node import protocol as msg
from node.live.record.checkpointbuild import CheckpointBuilder
from node.store.checkpoint import RunLayout, build_checkpoint, write_checkpoint
from tests.member_fixtures import three_seat_membership
from training.chunks import tensor_leaves
from training.hashing import stage_weights_hash

ROUND = 7
SHAPES = ({"w": (4,)},)
WEIGHTS = {"w": torch.arange(4, dtype=torch.float32)}
WEIGHTS_HASH = stage_weights_hash(WEIGHTS)
HONEST, OTHER = {"w": torch.full((4,), 0.5)}, {"w": torch.full((4,), 0.25)}


def layout(chunked: bool) -> RunLayout:
    return RunLayout(1, b"c" * 32, {}, SHAPES, chunked)


def stage_leaf(momentum) -> bytes:
    """The agreed stage leaf of a chunked run whose stage holds WEIGHTS and ``momentum``."""
    weights = tensor_leaves(WEIGHTS)
    return StageLeaf(0, len(weights), tree_root(weights), tree_root(tensor_leaves(momentum)),
                     b"f" * 32).encode()


class BlobPeers:
    """What the host's fetch_blob reaches: the shards the holders serve, by content hash."""

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}
        self.fetched: list[str] = []

    def shard(self, chunked: bool, momentum) -> bytes:
        data = build_checkpoint(layout(chunked), ROUND, {0: (WEIGHTS, momentum)}).to_bytes()
        self.blobs[hashlib.sha256(data).hexdigest()] = data
        return data

    def fetch_blob(self, content_hash: str, dest: Path, timeout: float) -> None:
        self.fetched.append(content_hash)
        dest.write_bytes(self.blobs[content_hash])

    def provide_blob(self, source, link: bool = False) -> str:
        return hashlib.sha256(Path(source).read_bytes() if link else source).hexdigest()

    def has_blob(self, content_hash: str) -> bool:
        return False  # what fetch_blob writes is not kept here

    def remove_blob(self, content_hash: str) -> bool:
        return False


def attestation(shard: bytes, leaf: bytes = b"") -> msg.Attestation:
    return msg.Attestation(WEIGHTS_HASH, b"r" * 32, 3, float("nan"), float("nan"), 100,
                           hashlib.sha256(shard).digest(), b"", leaf)


def member(tmp_path: Path, name: str, chunked: bool, own_shard: bytes | None):
    """A member's builder, its book and the peers' blobs; with ``own_shard``: it holds stage 0 and wrote that
    shard (what its finisher does on a checkpoint round)."""
    membership, book = three_seat_membership()
    peers = BlobPeers()
    home = tmp_path / name
    (home / "checkpoints").mkdir(parents=True)
    if own_shard is not None:
        (home / "checkpoints" / f"shard-{ROUND:08d}-stage0.safetensors").write_bytes(own_shard)
    node = SimpleNamespace(peer_id="peer-a", membership=membership, book=book, stop_event=threading.Event(),
                           layout=layout(chunked), host=peers, incoming_dir=home / "incoming",
                           checkpoint_dir=home / "checkpoints",
                           cfg=SimpleNamespace(round_timeout=2.0, p2p=SimpleNamespace(transfer_timeout=5),
                                               storage=SimpleNamespace(checkpoints="whole")))
    book.add_close(ROUND, 0, "peer-b", msg.Close([]), b"envelope")
    return CheckpointBuilder(node), book, peers


def build(tmp_path: Path, name: str, chunked: bool, holder: bool, other_attesters=("peer-c",)):
    """What one member builds of the round where peer-a and peer-b serve the honest momentum and
    ``other_attesters``, attesting the same weights (and leaf), other momentum: (content hash or None, shards
    fetched, the honest shard)."""
    leaf = stage_leaf(HONEST) if chunked else b""
    scratch = BlobPeers()
    honest_shard, other_shard = scratch.shard(chunked, HONEST), scratch.shard(chunked, OTHER)
    builder, book, peers = member(tmp_path, name, chunked, honest_shard if holder else None)
    peers.blobs.update(scratch.blobs)
    # peer-a is this member; as a non-holder its seat serves nothing of the stage's: another holder's
    # attestation stands in for it, so both members hear the same three shards' offers.
    book.add_attestation(ROUND, 0, "peer-a" if holder else "peer-d", attestation(honest_shard, leaf))
    book.add_attestation(ROUND, 0, "peer-b", attestation(honest_shard, leaf))
    for peer in other_attesters:
        book.add_attestation(ROUND, 0, peer, attestation(other_shard, leaf))
    atts = {0: book.snapshot_attestations(ROUND, 0)}
    leaves = [leaf] if chunked else []
    return builder.assemble(ROUND, atts, [WEIGHTS_HASH], leaves), peers.fetched, honest_shard


def test_a_chunked_run_takes_the_momentum_its_stage_leaf_commits_holder_or_not(tmp_path, caplog):
    caplog.set_level("ERROR", logger="node.live.record.checkpointbuild")
    held, held_fetched, honest_shard = build(tmp_path, "holder", chunked=True, holder=True)
    # The holder's own shard verifies against the leaf: it is the stage's state, read from disk, nothing
    # fetched and no holder waited for (whatever else is offered, the leaf names the one momentum).
    assert held is not None and held_fetched == []
    built = (tmp_path / "holder" / "checkpoints" / f"round-{ROUND:08d}.safetensors").read_bytes()
    assert hashlib.sha256(built).digest() == held
    # A member of another stage, offered the other momentum by more holders than the honest one, tries it
    # first, drops it and builds the same bytes from the honest shard: the holder costs the round nothing.
    other, fetched, _shard = build(tmp_path, "other-stage", chunked=True, holder=False,
                                   other_attesters=("peer-c", "peer-e", "peer-f"))
    assert other == held
    assert "its momentum is not the one stage 0's agreed leaf commits" in caplog.text
    assert fetched[-1] == hashlib.sha256(honest_shard).hexdigest() and len(fetched) == 2


def test_a_hashed_run_builds_none_when_a_holder_serves_other_momentum_holder_or_not(tmp_path):
    held, held_fetched, _shard = build(tmp_path, "holder", chunked=False, holder=True)
    other, _fetched, _shard = build(tmp_path, "other-stage", chunked=False, holder=False)
    # The momentum is in no record: two verified momenta, no checkpoint, for the holder too (it used to
    # build one from its own shard alone and sign a record no other member signed).
    assert held is None and other is None
    assert len(held_fetched) == 1  # the other holder's shard was judged, its own read from disk


def test_every_holder_agreeing_gives_the_same_checkpoint_holder_or_not(tmp_path):
    for chunked in (False, True):
        digests = []
        for name, holder in ((f"h{chunked}", True), (f"o{chunked}", False)):
            leaf = stage_leaf(HONEST) if chunked else b""
            scratch = BlobPeers()
            shard = scratch.shard(chunked, HONEST)
            builder, book, peers = member(tmp_path, name, chunked, shard if holder else None)
            peers.blobs.update(scratch.blobs)
            for peer in ("peer-a" if holder else "peer-d", "peer-b", "peer-c"):
                book.add_attestation(ROUND, 0, peer, attestation(shard, leaf))
            digests.append(builder.assemble(ROUND, {0: book.snapshot_attestations(ROUND, 0)}, [WEIGHTS_HASH],
                                            [leaf] if chunked else []))
        assert digests[0] is not None and digests[0] == digests[1], chunked


def test_a_holders_own_shard_off_the_agreed_weights_is_dropped_like_any_other(tmp_path):
    """Its own shard (other weights than the round's agreed ones) is not taken, nor does it end the round's
    checkpoint: the co-holders' verified shard is."""
    scratch = BlobPeers()
    good = scratch.shard(False, HONEST)
    own = build_checkpoint(layout(False), ROUND, {0: ({"w": WEIGHTS["w"] + 1}, HONEST)}).to_bytes()
    builder, book, peers = member(tmp_path, "holder", False, own)
    peers.blobs.update(scratch.blobs)
    own_att = msg.Attestation(WEIGHTS_HASH, b"r" * 32, 3, float("nan"), float("nan"), 100,
                              hashlib.sha256(own).digest(), b"")
    book.add_attestation(ROUND, 0, "peer-a", own_att)
    book.add_attestation(ROUND, 0, "peer-b", attestation(good))
    book.add_attestation(ROUND, 0, "peer-c", attestation(good))
    digest = builder.assemble(ROUND, {0: book.snapshot_attestations(ROUND, 0)}, [WEIGHTS_HASH])
    reference = tmp_path / "reference.safetensors"
    expected = build_checkpoint(layout(False), ROUND, {0: (WEIGHTS, HONEST)})
    assert digest == write_checkpoint(reference, expected)


def test_read_checkpoint_from_its_file_is_parse_checkpoint(tmp_path):
    """read_checkpoint reads a file without holding it whole (hashed in reads, tensors through safetensors'
    map): the same checkpoint as parse_checkpoint of its bytes, and the same refusals."""
    import hashlib

    import pytest
    import torch

    from node.errors import StateError
    from node.store.checkpoint import Checkpoint, parse_checkpoint, read_checkpoint, write_checkpoint

    checkpoint = Checkpoint(run_id=1, round=2, model_config={"preset": "tiny"}, config_hash=b"\1" * 32,
                            stage_hashes={0: b"\2" * 32},
                            weights={"w": torch.randn(30, 7), "e": torch.zeros(0, 3)},
                            momentum={"w": torch.randn(30, 7)}, stage_leaves={0: b"\3" * 40})
    path = tmp_path / "c.safetensors"
    digest = write_checkpoint(path, checkpoint)
    data = path.read_bytes()
    assert read_checkpoint(path, digest).to_bytes() == parse_checkpoint(data, digest).to_bytes() == data
    for bad in (b"", data[:7], data[:-1], b"\xff" * 8 + data[8:]):
        path.write_bytes(bad)
        with pytest.raises(StateError):
            parse_checkpoint(bad)
        with pytest.raises(StateError):
            read_checkpoint(path)
    path.write_bytes(data)
    with pytest.raises(StateError, match="hash mismatch"):
        read_checkpoint(path, hashlib.sha256(b"other").digest())
    with pytest.raises(StateError, match="cannot read"):
        read_checkpoint(tmp_path / "missing.safetensors")
