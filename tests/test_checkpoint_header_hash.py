"""A header-hashed run's checkpoint: the record's checkpointHash commits the file's header, so a committer
signs with its own stages checked and never fetches another stage's shard (issue 75;
node/store/checkpoint_hash.py).

The header is built from the run document and the agreed stage hashes and leaves, byte for byte what
``write_checkpoint`` writes first; two committers of a 2-stage run on real py-libp2p hosts, each holding one
stage, sign the same hash having made no fetch at all (a file-hashed committer of the same round fetches the
other stage's shard: the count is what changes), and a puller assembles the whole file from them. A header
that lies about a leaf, the metadata or the layout is refused, and so is a file whose tensors are not its
leaves'; file-hashed records keep their meaning.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from waiting import wait_until

from ledger.chunkproof import chunked_weights_root
from node import protocol as msg
from node.errors import StateError
from node.live.state.roundbook import RoundBook
from node.store.checkpoint import build_checkpoint, checkpoint_problems, parse_checkpoint, write_checkpoint
from node.store.checkpoint_hash import (HEADER_HASH_TAG, checkpoint_header, file_record_hash, header_hash,
                                        metadata_only, names_record, record_hash)
from node.store.checkpoint_split import (assemble_checkpoint, assemble_in_dirs, bytes_range,
                                         checkpoint_digest, header_key, keeps_split, split_stages, stage_key,
                                         verified_header, write_split)
from tests.test_checkpoint_split import _shard
from tests.test_checkpoint_stage import ROUND, SHAPES, _layout, _leaf, _states
from training.hashing import stage_weights_hash


def _hashed(layout=None):
    return replace(layout or _layout(), header_hashed=True)


def _full(states: dict, layout):
    leaves = [_leaf(s, *states[s]) for s in range(len(SHAPES))]
    ckpt = build_checkpoint(layout, ROUND, states, {s: leaf.encode() for s, leaf in enumerate(leaves)})
    return ckpt, chunked_weights_root(leaves)


@pytest.mark.parametrize("moments", [1, 2])
def test_the_header_is_built_from_the_run_and_the_agreed_leaves_without_tensors(tmp_path, moments):
    layout = replace(_hashed(), outer_moments=moments)
    states = _states()
    if moments == 2:  # outer Adam: both moments stacked
        states = {s: (w, {n: torch.stack([m[n], m[n] * 2]) for n in m}) for s, (w, m) in states.items()}
    ckpt, _root = _full(states, layout)
    _digest, header = checkpoint_digest(ckpt)
    meta = metadata_only(layout, ROUND, ckpt.stage_hashes, ckpt.stage_leaves)
    assert checkpoint_header(layout, meta) == header
    write_checkpoint(tmp_path / "whole.safetensors", ckpt)
    data = (tmp_path / "whole.safetensors").read_bytes()
    assert data.startswith(header)
    # the record's hash: a domain-separated sha256 of exactly those bytes, never the file's sha256
    assert header_hash(header) == hashlib.sha256(b"dlx-checkpoint-header-hash/v1" + header).digest()
    assert HEADER_HASH_TAG == b"dlx-checkpoint-header-hash/v1"
    assert record_hash(data, True) == header_hash(header)
    assert file_record_hash(tmp_path / "whole.safetensors", True) == header_hash(header)
    assert record_hash(data, False) == hashlib.sha256(data).digest() != header_hash(header)
    assert names_record(data, header_hash(header)) and names_record(data, hashlib.sha256(data).digest())
    assert not names_record(data[:20], header_hash(header))


def test_a_header_that_lies_about_a_leaf_metadata_or_layout_is_refused():
    layout = _hashed()
    states = _states()
    ckpt, root = _full(states, layout)
    _digest, header = checkpoint_digest(ckpt)
    record = header_hash(header)
    got, leaves = verified_header(bytes_range(header), layout, ROUND, root, record)
    assert got.stage_leaves == ckpt.stage_leaves and len(leaves) == len(SHAPES)
    with pytest.raises(StateError, match="checked against the record's checkpointHash"):
        verified_header(bytes_range(header), layout, ROUND, root)

    def lying(**change):
        meta = metadata_only(layout, ROUND, change.get("hashes", ckpt.stage_hashes),
                             change.get("leaves", ckpt.stage_leaves))
        meta.config_hash = change.get("config_hash", meta.config_hash)
        return checkpoint_header(layout, meta)

    other_leaf = {**ckpt.stage_leaves, 1: _leaf(1, *_states(seed=9)[1]).encode()}
    # served in the record's place: its hash is not the record's
    with pytest.raises(StateError, match="not the record's checkpointHash"):
        verified_header(bytes_range(lying(leaves=other_leaf)), layout, ROUND, root, record)
    # signed as it is (a lying quorum): its leaves do not give the weights root, its metadata not the run's
    bad_leaf = lying(leaves=other_leaf)
    with pytest.raises(StateError, match="weights root"):
        verified_header(bytes_range(bad_leaf), layout, ROUND, root, header_hash(bad_leaf))
    bad_meta = lying(config_hash=b"x" * 32)
    with pytest.raises(StateError, match="config hash"):
        verified_header(bytes_range(bad_meta), layout, ROUND, root, header_hash(bad_meta))
    # offsets of its own choosing (the metadata right): not the header the run document gives
    text = header[8:].replace(b'"F32"', b'"F32" ', 1)
    bad_layout = len(text).to_bytes(8, "little") + text
    with pytest.raises(StateError, match="not the one the run document gives"):
        verified_header(bytes_range(bad_layout), layout, ROUND, root, header_hash(bad_layout))
    # a header-hashed rule only for a chunked run
    from node.config import load_config
    from node.errors import ConfigError

    with pytest.raises(ConfigError, match="checkpoint_hash = \"header\" needs a chunked"):
        load_config(None, ["diloco.checkpoint_hash=header", "diloco.commitments=hashed"])


def test_node_directories_assemble_it_and_a_damaged_shard_fails_its_leaf_not_the_hash(tmp_path):
    """Assembled from node directories with no run document (an auditor's, a seeder's): the header's hash
    is the record's; a damaged shard's tensors are then caught by their stage leaf, as pull and audit
    check."""
    layout = _hashed()
    states = _states()
    ckpt, root = _full(states, layout)
    _digest, header = checkpoint_digest(ckpt)
    record = header_hash(header)
    dirs = _split_dirs(tmp_path, states, record, header)
    dest = tmp_path / "assembled.safetensors"
    assert assemble_in_dirs([d for d, _ in dirs], ROUND, record, dest)
    write_checkpoint(tmp_path / "whole.safetensors", ckpt)
    assert dest.read_bytes() == (tmp_path / "whole.safetensors").read_bytes()
    assert checkpoint_problems(parse_checkpoint(dest.read_bytes()), layout, ROUND, root) == []
    shard = dirs[1][1]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x40
    shard.write_bytes(bytes(data))
    damaged = tmp_path / "damaged.safetensors"
    assert assemble_in_dirs([d for d, _ in dirs], ROUND, record, damaged)
    assert record_hash(damaged.read_bytes(), True) == record  # the header is the record's...
    problems = checkpoint_problems(parse_checkpoint(damaged.read_bytes()), layout, ROUND, root)
    # ...its stage 1 is not its leaf's
    assert any("not the chunks its stage leaf" in p or "stage hashes" in p for p in problems), problems
    # and split_stages (a joiner, pull) refuses the damaged shard outright
    with pytest.raises(StateError, match="no shard of stage 1 verified"):
        split_stages([bytes_range(header)], lambda s: [lambda o, n, p=shard: p.read_bytes()[o:o + n]],
                     layout, ROUND, root, [1], record)


def _split_dirs(tmp_path, states: dict, record: bytes, header: bytes) -> list:
    """(node directory, its shard) of one node a stage, each keeping the header-hashed checkpoint split."""
    dirs = []
    for stage in range(len(SHAPES)):
        directory = tmp_path / f"n{stage}"
        path, shard_hash = _shard(directory, stage, states)
        write_split(directory / "checkpoints", ROUND, record, header, {stage: shard_hash.hex()})
        dirs.append((directory, path))
    return dirs


def test_a_seeder_serves_its_parts_under_the_keys_and_an_auditor_assembles_it(tmp_path):
    """A header-hashed record names no whole file: the seeder serves the nodes' header and every stage's
    shard under the record's keys (node/commands/seeder.py), and an auditor's link to it gets the file."""
    from node.commands.seeder import ArchiveSeeder
    from node.tools.evidence import PeerFetcher, PeerSource

    layout = _hashed()
    ckpt, _root = _full(_states(), layout)
    _digest, header = checkpoint_digest(ckpt)
    record = header_hash(header)
    dirs = _split_dirs(tmp_path, _states(), record, header)
    write_checkpoint(tmp_path / "whole.safetensors", ckpt)
    seeder = ArchiveSeeder.start([d for d, _ in dirs], 1)
    try:
        assert record.hex() not in seeder.served  # no file is served under the header's hash
        fetcher = PeerFetcher.start([seeder.multiaddr])
        try:
            got = PeerSource(fetcher, 1).checkpoint(ROUND, record.hex())
        finally:
            fetcher.close()
    finally:
        seeder.close()
    assert got == (tmp_path / "whole.safetensors").read_bytes()


def test_a_header_hashed_run_keeps_its_checkpoints_split_whatever_the_setting():
    assert keeps_split("whole", _hashed()) and keeps_split("auto", _hashed())
    assert not keeps_split("whole", _layout()) and not keeps_split("auto", _layout())


class Counting:
    """A real host, its fetches counted (requests and bytes)."""

    def __init__(self, host) -> None:
        self.host, self.requests, self.bytes = host, [], 0

    def __getattr__(self, name):
        return getattr(self.host, name)

    def fetch_blob(self, sha256_hex, dest, *args, **kwargs):
        path = self.host.fetch_blob(sha256_hex, dest, *args, **kwargs)
        self.requests.append(("blob", sha256_hex))
        self.bytes += path.stat().st_size
        return path

    def fetch_blob_range(self, key, offset, length, *args, **kwargs):
        data = self.host.fetch_blob_range(key, offset, length, *args, **kwargs)
        self.requests.append(("range", key))
        self.bytes += len(data)
        return data


def _committer(tmp_path, name, host, layout, stage, states, holders, storage="stages"):
    """A node's CheckpointBuilder on a real host, holding ``stage`` (its shard written and served, as its
    finisher does on a checkpoint round)."""
    from node.live.record.checkpointbuild import CheckpointBuilder

    home = tmp_path / name
    path, shard_hash = _shard(home, stage, states)
    host.provide_blob(path, link=True)
    membership = SimpleNamespace(holders=lambda s: [holders[s]], alive=lambda: set(holders),
                                 live_providers=lambda: [p for p in holders if p != host.peer_id])
    node = SimpleNamespace(peer_id=host.peer_id, membership=membership, book=RoundBook(),
                           stop_event=threading.Event(), layout=layout, host=Counting(host),
                           incoming_dir=home / "incoming", checkpoint_dir=home / "checkpoints",
                           cfg=SimpleNamespace(round_timeout=5.0, p2p=SimpleNamespace(transfer_timeout=30),
                                               storage=SimpleNamespace(checkpoints=storage)))
    return CheckpointBuilder(node), node.host, shard_hash


def test_committers_sign_the_header_hash_without_fetching_another_stage_and_a_puller_assembles(tmp_path):
    """Two real hosts, one stage each: header-hashed, each signs the same checkpointHash having fetched
    nothing (0 requests, 0 bytes); file-hashed, the same round costs a committer the other stage's shard. A
    third host pulls the file from what the two serve under the keys."""
    from p2p.config import P2PConfig
    from p2p.host import P2PHost
    from p2p.identity import Identity

    states = _states()
    layout = _hashed()
    full, root = _full(states, layout)
    _digest, header = checkpoint_digest(full)
    hosts = []
    try:
        for name in ("a", "b", "c"):
            boot = [a for h in hosts for a in h.listen_addrs]
            hosts.append(P2PHost.start(P2PConfig(bootstrap=boot, gossip_resync_interval=0),
                                       Identity.generate(), data_dir=tmp_path / f"p2p-{name}"))
        wait_until(lambda: all(len(h.peers()) >= 2 for h in hosts), 60, "hosts connected")
        holders = [hosts[0].peer_id, hosts[1].peer_id]
        leaves = [full.stage_leaves[s] for s in range(len(SHAPES))]
        hashes = [stage_weights_hash(states[s][0]) for s in range(len(SHAPES))]
        built = [_committer(tmp_path, f"n{s}", hosts[s], layout, s, states, holders) for s in range(2)]
        atts = {s: {holders[s]: msg.Attestation(hashes[s], b"r" * 32, 1, float("nan"), float("nan"), 10,
                                                built[s][2], b"", leaves[s])} for s in range(2)}
        signed = [builder.assemble(ROUND, atts, hashes, leaves) for builder, _host, _sh in built]
        assert signed == [header_hash(header)] * 2
        assert [(host.requests, host.bytes) for _b, host, _sh in built] == [([], 0), ([], 0)]
        for s in range(2):  # each keeps the header and its own shard, nothing of the other stage
            kept = sorted(p.name for p in (tmp_path / f"n{s}" / "checkpoints").iterdir())
            assert kept == [f"round-{ROUND:08d}.head", f"round-{ROUND:08d}.split.json",
                            f"shard-{ROUND:08d}-stage{s}.safetensors"]

        # the same round file-hashed: the committer of stage 0 downloads stage 1's shard to hash the file
        file_layout = _layout()
        file_full, _root = _full(states, file_layout)
        builder, counted, _sh = _committer(tmp_path, "file-a", hosts[0], file_layout, 0, states, holders)
        assert builder.assemble(ROUND, atts, hashes, leaves) == checkpoint_digest(file_full)[0]
        shard1 = (tmp_path / "n1" / "checkpoints" / f"shard-{ROUND:08d}-stage1.safetensors")
        assert counted.requests == [("blob", built[1][2].hex())] and counted.bytes == shard1.stat().st_size

        # a puller assembles the header-hashed file from the two holders' keys
        client = hosts[2]

        def remote(key):
            return [lambda o, n, p=p: client.fetch_blob_range(key, o, n, p, timeout=30) for p in holders]

        record = signed[0]
        dest = tmp_path / "pulled.safetensors"
        assemble_checkpoint(remote(header_key(record)), lambda s: remote(stage_key(record, s)), layout, ROUND,
                            root, record, dest)
        write_checkpoint(tmp_path / "whole.safetensors", full)
        assert dest.read_bytes() == (tmp_path / "whole.safetensors").read_bytes()
        with pytest.raises(StateError, match="no checkpoint header verified.*not the record's"):
            split_stages(remote(header_key(record)), lambda s: remote(stage_key(record, s)), layout, ROUND,
                         root, [0], b"\x07" * 32)

        # an auditor told of the two holders (an audit LINK's bootstrap peers): the file from their keys
        from node.tools.evidence import PeerFetcher, PeerSource

        source = PeerSource(PeerFetcher(client, tmp_path / "auditor", holders), 1)
        (tmp_path / "auditor").mkdir()
        assert source.checkpoint(ROUND, record.hex()) == dest.read_bytes()

        # a member of stage 1 that built none checks the committed one: the header and its own stage, by
        # range under their keys, never a whole file; a committed hash of another header does not verify
        checker, counted, _sh = _committer(tmp_path, "checker", client, layout, 1, states, holders)
        assert checker.committed_problems(ROUND, record, root) == []
        assert {kind for kind, _key in counted.requests} == {"range"}
        assert {key for _kind, key in counted.requests} == {header_key(record), stage_key(record, 1)}
        assert counted.bytes == len(header) + shard1.stat().st_size
        [wrong] = checker.committed_problems(ROUND, b"\x07" * 32, root)
        assert "not fetched from its stages' holders: no checkpoint header verified" in wrong  # not served
    finally:
        for host in hosts:
            host.close()


@pytest.mark.parametrize("overrides, rule", [
    ([], "file"),  # the default preset: the demo's kind of run, its document and records unchanged
    (["model.preset=mini"], "file"),
    (["model.preset=llama-124m"], "header"),  # chunked and 1.0 GB: kept split by default, header-hashed
    (["model.preset=llama-124m", "diloco.commitments=hashed"], "file"),  # its momentum in no record
    (["model.preset=llama-124m", "diloco.checkpoint_hash=file"], "file"),
    (["model.preset=mini", "diloco.checkpoint_hash=header"], "header"),
])
def test_the_rule_is_the_run_documents_and_auto_hashes_the_header_where_kept_split(overrides, rule):
    from node.config import load_config
    from node.runconfig import config_hash, node_config_from_run, run_document
    from node.store.checkpoint import RunLayout

    document = run_document(load_config(None, overrides))
    # named only when "header": every file-hashed document (and its configHash) is what it was
    assert document["diloco"].get("checkpoint_hash") == (rule if rule == "header" else None)
    again = node_config_from_run(document)  # as a joiner or an auditor reads it
    assert again.diloco.checkpoint_hash == rule
    assert config_hash(run_document(again)) == config_hash(document)
    assert RunLayout.of_document(1, config_hash(document), document).header_hashed == (rule == "header")
