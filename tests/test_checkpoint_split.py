"""A chunked run's checkpoint kept split: its header and each node's own stage shards, not the whole file on
every node (issue 75; node/store/checkpoint_split.py).

The record's content hash is computed without writing the file and is byte for byte ``write_checkpoint``'s;
the whole file is assembled from a header and the stages' shards (from node directories, and from real
py-libp2p peers that each serve only their own stage under its key), checked stage by stage against the
record's leaves, and refused where a header, a shard or the assembled bytes are not the record's.
"""

from __future__ import annotations

import json

import pytest
from waiting import wait_until

from node.errors import StateError
from node.store.checkpoint import Checkpoint, build_checkpoint, read_checkpoint, write_checkpoint
from node.store.checkpoint_split import (assemble_checkpoint, assemble_in_dirs, bytes_range,
                                         checkpoint_digest, file_range, header_key, read_split, split_stages,
                                         stage_key, write_split)
from node.store.retention import checkpoint_files, prune_checkpoints_except
from tests.test_checkpoint_stage import ROUND, SHAPES, _layout, _leaf, _states
from ledger.chunkproof import chunked_weights_root


def _full(states: dict):
    leaves = [_leaf(s, *states[s]) for s in range(len(SHAPES))]
    ckpt = build_checkpoint(_layout(), ROUND, states, {s: leaf.encode() for s, leaf in enumerate(leaves)})
    return ckpt, chunked_weights_root(leaves)


def _shard(directory, stage: int, states: dict):
    """A node's own stage shard, as the finisher writes it (node/live/round/finisher.py write_shard)."""
    weights, momentum = states[stage]
    ckpt, _root = _full(states)
    shard = Checkpoint(ckpt.run_id, ROUND, ckpt.model_config, ckpt.config_hash,
                       {stage: ckpt.stage_hashes[stage]}, weights, momentum)
    path = directory / "checkpoints" / f"shard-{ROUND:08d}-stage{stage}.safetensors"
    return path, write_checkpoint(path, shard)


def _node_dir(tmp_path, name: str, stage: int, states: dict):
    """A node directory that kept the checkpoint split: the header and its own stage's shard."""
    directory = tmp_path / name
    path, shard_hash = _shard(directory, stage, states)
    ckpt, _root = _full(states)
    digest, header = checkpoint_digest(ckpt)
    write_split(directory / "checkpoints", ROUND, digest, header, {stage: shard_hash.hex()})
    return directory, path


def test_the_digest_is_the_written_files_and_the_header_its_first_bytes(tmp_path):
    ckpt, _root = _full(_states())
    digest, header = checkpoint_digest(ckpt)
    written = write_checkpoint(tmp_path / "whole.safetensors", ckpt)
    data = (tmp_path / "whole.safetensors").read_bytes()
    assert digest == written
    assert data.startswith(header) and len(header) == 8 + int.from_bytes(header[:8], "little")


def test_node_directories_each_with_one_stage_assemble_the_record_file(tmp_path):
    states = _states()
    ckpt, _root = _full(states)
    whole = write_checkpoint(tmp_path / "whole.safetensors", ckpt)
    dirs = [_node_dir(tmp_path, f"n{s}", s, states)[0] for s in range(len(SHAPES))]
    # retention sees the split files as the round's checkpoint files
    assert {p.name for p in checkpoint_files(dirs[0] / "checkpoints")[ROUND]} == {
        f"round-{ROUND:08d}.head", f"round-{ROUND:08d}.split.json", f"shard-{ROUND:08d}-stage0.safetensors"}
    dest = tmp_path / "out" / "assembled.safetensors"
    assert assemble_in_dirs(dirs, ROUND, whole, dest)
    assert dest.read_bytes() == (tmp_path / "whole.safetensors").read_bytes()
    # one stage's holder alone cannot: nothing is left behind
    assert not assemble_in_dirs(dirs[:1], ROUND, whole, tmp_path / "out" / "partial.safetensors")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["assembled.safetensors"]
    # and the retention prunes a split round whole: header, listing and shard, each blob forgotten first
    forgotten = []
    assert prune_checkpoints_except(dirs[0] / "checkpoints", set(), ROUND, forgotten.append) == [ROUND]
    assert not list((dirs[0] / "checkpoints").iterdir()) and len(forgotten) == 3


def test_a_damaged_shard_fails_the_records_hash_and_leaves_nothing(tmp_path):
    states = _states()
    ckpt, _root = _full(states)
    digest, _header = checkpoint_digest(ckpt)
    dirs = [_node_dir(tmp_path, f"n{s}", s, states) for s in range(len(SHAPES))]
    shard = dirs[1][1]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x40  # one bit of the last tensor's data
    shard.write_bytes(bytes(data))
    dest = tmp_path / "assembled.safetensors"
    assert not assemble_in_dirs([d for d, _ in dirs], ROUND, digest, dest)
    assert not dest.exists() and not list(tmp_path.glob(".assembled*"))


@pytest.mark.parametrize("damage", ["truncated", "trailing", "bad_json", "huge_length"])
def test_a_damaged_kept_header_assembles_nothing(tmp_path, damage):
    states = _states()
    ckpt, _root = _full(states)
    digest, header = checkpoint_digest(ckpt)
    dirs = [_node_dir(tmp_path, f"n{s}", s, states)[0] for s in range(len(SHAPES))]
    head = dirs[0] / "checkpoints" / f"round-{ROUND:08d}.head"
    bad = {"truncated": header[:-9], "trailing": header + b"x" * 8,
           "bad_json": header[:8] + b"[" * (len(header) - 8),
           "huge_length": (1 << 62).to_bytes(8, "little") + header[8:]}[damage]
    for directory in dirs:  # every copy of the header damaged alike
        path = directory / "checkpoints" / f"round-{ROUND:08d}.head"
        path.chmod(0o644)
        path.write_bytes(bad)
    assert head.read_bytes() == bad
    dest = tmp_path / "assembled.safetensors"
    assert not assemble_in_dirs(dirs, ROUND, digest, dest) and not dest.exists()


def test_split_stages_takes_the_first_source_that_verifies_and_names_the_others(tmp_path):
    states, other = _states(), _states(seed=7)
    ckpt, root = _full(states)
    digest, header = checkpoint_digest(ckpt)
    good = [_shard(tmp_path / "good", s, states)[0] for s in range(len(SHAPES))]
    bad = [_shard(tmp_path / "bad", s, other)[0] for s in range(len(SHAPES))]
    got = split_stages([bytes_range(b"\x00" * 16), bytes_range(header)],
                       lambda s: [file_range(bad[s]), file_range(good[s])], _layout(), ROUND, root, [1])
    assert set(got.weights) == set(SHAPES[1])
    assert all(got.weights[n].equal(states[1][0][n]) and got.momentum[n].equal(states[1][1][n])
               for n in SHAPES[1])
    with pytest.raises(StateError, match="no shard of stage 0 verified.*not the chunks its stage leaf"):
        split_stages([bytes_range(header)], lambda s: [file_range(bad[s])], _layout(), ROUND, root, [0])
    with pytest.raises(StateError, match="no checkpoint header verified.*weights root"):
        split_stages([bytes_range(header)], lambda s: [file_range(good[s])], _layout(), ROUND, b"\x01" * 32,
                     [0])
    # the whole, assembled and checked against the record's hash
    dest = tmp_path / "whole.safetensors"
    assemble_checkpoint([bytes_range(header)], lambda s: [file_range(good[s])], _layout(), ROUND, root,
                        digest, dest)
    assert read_checkpoint(dest, digest).stage_leaves == ckpt.stage_leaves
    with pytest.raises(StateError, match="not the record's"):
        assemble_checkpoint([bytes_range(header)], lambda s: [file_range(good[s])], _layout(), ROUND, root,
                            b"\x02" * 32, tmp_path / "other.safetensors")
    assert not (tmp_path / "other.safetensors").exists()


def test_a_source_whose_transport_failed_is_asked_once_more_a_wrong_one_is_not(tmp_path):
    """A holder whose connection dropped (a loaded peer: seen under scripts/stress-tests.sh) is asked again
    after the other sources; one that served a wrong part, or fails in transport twice, is not used."""
    from p2p.errors import P2PError

    states, other = _states(), _states(seed=7)
    ckpt, root = _full(states)
    _digest, header = checkpoint_digest(ckpt)
    good = _shard(tmp_path / "good", 0, states)[0]
    bad = _shard(tmp_path / "bad", 0, other)[0]
    asked = []

    def flaky(failures: int):
        def fetch(offset: int, length: int) -> bytes:
            asked.append(failures)
            if asked.count(failures) <= failures:
                raise P2PError("stream reset by the remote peer")
            return file_range(good)(offset, length)
        return fetch

    got = split_stages([bytes_range(header)], lambda s: [flaky(1), file_range(bad)], _layout(), ROUND, root,
                       [0])
    assert all(got.weights[n].equal(states[0][0][n]) for n in SHAPES[0])
    assert asked.count(1) >= 2
    with pytest.raises(StateError, match="stage 0: P2PError.*stage 0: .*stage 0: P2PError"):
        split_stages([bytes_range(header)], lambda s: [flaky(2), file_range(bad)], _layout(), ROUND, root,
                     [0])


def test_auto_splits_from_a_gib_and_a_hashed_run_never(monkeypatch):
    from node.config import load_config
    from node.errors import ConfigError
    from node.store import checkpoint_split

    small = _layout()
    params = 256 * 40 + 40 + 40 * 64 + 64
    assert checkpoint_split.checkpoint_bytes(small) == 4 * 2 * params  # weights and momentum, float32
    keeps = [checkpoint_split.keeps_split(s, small) for s in ("auto", "whole", "stages")]
    assert keeps == [False, False, True]
    monkeypatch.setattr(checkpoint_split, "SPLIT_ABOVE_BYTES", checkpoint_split.checkpoint_bytes(small))
    assert checkpoint_split.keeps_split("auto", small) and not checkpoint_split.keeps_split("whole", small)
    assert not checkpoint_split.keeps_split("stages", _layout(chunked=False))
    assert load_config(None, []).storage.checkpoints == "auto"
    with pytest.raises(ConfigError, match="storage.checkpoints='some'"):
        load_config(None, ["storage.checkpoints=some"])


def test_a_hashed_runs_checkpoint_is_not_split(tmp_path):
    ckpt, root = _full(_states())
    _digest, header = checkpoint_digest(ckpt)
    with pytest.raises(StateError, match="hashed run"):
        split_stages([bytes_range(header)], lambda s: [], _layout(chunked=False), ROUND, root, [0])


@pytest.mark.parametrize("body", [b"{", b"[" * 5000, json.dumps({"v": 2}).encode(),
                                  json.dumps({"v": 1, "round": 1, "content_hash": "00" * 32,
                                              "header": "zz" * 32, "stages": {}}).encode()])
def test_a_hostile_split_listing_is_refused_not_served(tmp_path, body):
    path = tmp_path / "round-00000001.split.json"
    path.write_bytes(body)
    assert read_split(path) is None


def test_peers_each_serving_their_own_stage_give_a_joiner_its_stage_and_a_puller_the_file(tmp_path):
    """Two real hosts keep one stage each (the header and their shard, served under the keys); a third
    reads stage 1 alone and then the whole file from them."""
    from p2p.config import P2PConfig
    from p2p.host import P2PHost
    from p2p.identity import Identity
    from node.store.checkpoint_split import alias_split

    states = _states()
    ckpt, root = _full(states)
    digest, _header = checkpoint_digest(ckpt)
    holders, dirs = [], []
    try:
        for stage in range(len(SHAPES)):
            directory, shard = _node_dir(tmp_path, f"n{stage}", stage, states)
            host = P2PHost.start(P2PConfig(gossip_resync_interval=0), Identity.generate(),
                                 data_dir=directory / "p2p")
            holders.append(host)
            split = read_split(directory / "checkpoints" / f"round-{ROUND:08d}.split.json")
            head = directory / "checkpoints" / f"round-{ROUND:08d}.head"
            header_sha = host.provide_blob(head, announce=False)
            assert host.provide_blob(shard, announce=False) == split["stages"][stage]
            alias_split(host, digest, header_sha, split["stages"])
            dirs.append(directory)
        addrs = [a for h in holders for a in h.listen_addrs]
        client = P2PHost.start(P2PConfig(bootstrap=addrs, gossip_resync_interval=0), Identity.generate(),
                               data_dir=tmp_path / "c")
        holders.append(client)
        wait_until(lambda: all(h.peer_id in client.peers() for h in holders[:-1]), 60, "client connected")
        peers = [h.peer_id for h in holders[:-1]]

        def remote(key):
            return [lambda o, n, p=p: client.fetch_blob_range(key, o, n, p, timeout=30) for p in peers]

        def shards(stage):
            return remote(stage_key(digest, stage))

        got = split_stages(remote(header_key(digest)), shards, _layout(), ROUND, root, [1])
        assert set(got.weights) == set(SHAPES[1]) and got.weights["head"].equal(states[1][0]["head"])
        dest = tmp_path / "pulled.safetensors"
        assemble_checkpoint(remote(header_key(digest)), shards, _layout(), ROUND, root, digest, dest)
        assert write_checkpoint(tmp_path / "whole.safetensors", ckpt) == digest
        assert dest.read_bytes() == (tmp_path / "whole.safetensors").read_bytes()
    finally:
        for host in holders:
            host.close()


def test_a_puller_that_knows_one_holder_finds_the_other_stages_holder_on_the_dht(tmp_path):
    """pull's split path (node/tools/pull.py): its link names only stage 0's holder; stage 1's holder is
    found by its key's DHT provider record, and the file assembled is the record's."""
    from types import SimpleNamespace

    from p2p.config import P2PConfig
    from p2p.host import P2PHost
    from p2p.identity import Identity
    from node.store.checkpoint_split import alias_split
    from node.tools.pull import _split_from_peers

    states = _states()
    ckpt, root = _full(states)
    digest, _header = checkpoint_digest(ckpt)
    hosts = []
    try:
        for stage in range(len(SHAPES)):
            directory, shard = _node_dir(tmp_path, f"n{stage}", stage, states)
            boot = hosts[0].listen_addrs if hosts else []
            host = P2PHost.start(P2PConfig(bootstrap=boot, gossip_resync_interval=0), Identity.generate(),
                                 data_dir=directory / "p2p")
            hosts.append(host)
            if stage:
                wait_until(lambda h=host: hosts[0].peer_id in h.peers(), 60, "holders connected")
            split = read_split(directory / "checkpoints" / f"round-{ROUND:08d}.split.json")
            head = host.provide_blob(directory / "checkpoints" / f"round-{ROUND:08d}.head", announce=False)
            host.provide_blob(shard, announce=False)
            alias_split(host, digest, head, split["stages"])
        client = P2PHost.start(P2PConfig(bootstrap=hosts[0].listen_addrs, gossip_resync_interval=0),
                               Identity.generate(), data_dir=tmp_path / "c")
        hosts.append(client)
        wait_until(lambda: hosts[0].peer_id in client.peers(), 60, "client connected")
        fetcher = SimpleNamespace(host=client, bootstrap_peers=[hosts[0].peer_id])
        commit = SimpleNamespace(checkpoint_hash=digest, round=ROUND, weights_root=root)
        staging = tmp_path / "staging"
        staging.mkdir()
        path = _split_from_peers(fetcher, _layout(), commit, staging)
        assert write_checkpoint(tmp_path / "whole.safetensors", ckpt) == digest
        assert path is not None and path.read_bytes() == (tmp_path / "whole.safetensors").read_bytes()
    finally:
        for host in hosts:
            host.close()
