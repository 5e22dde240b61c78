"""A joiner of a chunked run fetches only its stages of a checkpoint, by range, checked against the record
(issue 75; node/store/checkpoint_stage.py).

The checkpoint is a real file served by a real py-libp2p host on 127.0.0.1; the joiner reads the header
and its stage's tensors by range, gets exactly the tensors the file holds, and reads a small part of the
file. Every way a server can lie about the parts it is not hashed on (the header, the metadata, the stage
leaves, a stage's tensors) is refused with a message naming it.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch
from waiting import wait_until

from ledger.chunkproof import StageLeaf, chunked_weights_root, tree_root
from node.errors import StateError
from node.store.checkpoint import RunLayout, build_checkpoint
from node.store.checkpoint_stage import MAX_HEADER_BYTES, fetch_checkpoint_stages
from training.chunks import tensor_leaves

SHAPES = ({"emb": (256, 40), "ln": (40,)}, {"head": (40, 64), "out": (64,)})
ROUND = 5


def _layout(chunked: bool = True, run_id: int = 1) -> RunLayout:
    return RunLayout(run_id, b"c" * 32, {"preset": "test"}, SHAPES, chunked)


def _states(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {s: ({n: torch.randn(*shape, generator=gen) for n, shape in shapes.items()},
                {n: torch.randn(*shape, generator=gen) for n, shape in shapes.items()})
            for s, shapes in enumerate(SHAPES)}


def _leaf(stage: int, weights: dict, momentum: dict) -> StageLeaf:
    leaves = tensor_leaves({n: weights[n] for n in SHAPES[stage]})
    return StageLeaf(stage, len(leaves), tree_root(leaves),
                     tree_root(tensor_leaves({n: momentum[n] for n in SHAPES[stage]})), b"f" * 32)


def _checkpoint(states: dict, leaf_states: dict | None = None, layout: RunLayout | None = None):
    """(the file's bytes, the record's weights root) of a checkpoint of ``states``, its metadata's stage
    leaves those of ``leaf_states`` (default: the same states)."""
    leaves = [_leaf(s, *(leaf_states or states)[s]) for s in range(len(SHAPES))]
    encoded = {s: leaf.encode() for s, leaf in enumerate(leaves)}
    ckpt = build_checkpoint(layout or _layout(), ROUND, states, encoded)
    return ckpt.to_bytes(), chunked_weights_root(leaves)


class Ranges:
    """fetch_range over bytes, counting what was read."""

    def __init__(self, data: bytes) -> None:
        self.data, self.read = data, 0

    def __call__(self, offset: int, length: int) -> bytes:
        self.read += length
        return self.data[offset:offset + length]


def test_a_stage_is_fetched_by_range_from_a_real_peer_and_is_the_files(tmp_path):
    from p2p.config import P2PConfig
    from p2p.host import P2PHost
    from p2p.identity import Identity

    states = _states()
    data, root = _checkpoint(states)
    path = tmp_path / "round.safetensors"
    path.write_bytes(data)
    a = P2PHost.start(P2PConfig(gossip_resync_interval=0), Identity.generate(), data_dir=tmp_path / "a")
    b = P2PHost.start(P2PConfig(bootstrap=a.listen_addrs, gossip_resync_interval=0), Identity.generate(),
                      data_dir=tmp_path / "b")
    try:
        digest = a.provide_blob(path, announce=False, link=True)
        wait_until(lambda: b.peer_id in a.peers() and a.peer_id in b.peers(), 60, "a and b connected")
        read = []

        def fetch_range(offset: int, length: int) -> bytes:
            read.append(length)
            return b.fetch_blob_range(digest, offset, length, a.peer_id, timeout=60)

        ckpt = fetch_checkpoint_stages(fetch_range, _layout(), ROUND, root, [1])
    finally:
        b.close()
        a.close()
    assert sorted(ckpt.weights) == sorted(SHAPES[1]) == sorted(ckpt.momentum)
    for name in SHAPES[1]:
        assert torch.equal(ckpt.weights[name], states[1][0][name])
        assert torch.equal(ckpt.momentum[name], states[1][1][name])
    weights, momentum = ckpt.stage_state(list(SHAPES[1]))
    assert torch.equal(momentum["head"], states[1][1]["head"])
    stage_bytes = 8 * sum(torch.Size(s).numel() for s in SHAPES[1].values())
    header = struct.unpack("<Q", data[:8])[0]
    assert sum(read) == 8 + header + stage_bytes < len(data) / 2  # stage 0 (the larger) never read
    assert not list((tmp_path / "b").rglob("*.safetensors"))


def _forged_header(data: bytes, change) -> bytes:
    """``data`` with its header replaced by ``change(header)`` (the data after it kept)."""
    length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + length])
    change(header)
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data[8 + length:]


def _meta(change):
    def edit(header):
        meta = json.loads(header["__metadata__"]["dlx"])
        change(meta)
        header["__metadata__"]["dlx"] = json.dumps(meta)
    return edit


def _entry(name: str, **fields):
    def edit(header):
        header[name].update(fields)
    return edit


CASES = {
    "momentum": (lambda d, s: _checkpoint({**s, 1: (s[1][0], _states(9)[1][1])}, s)[0],
                 "stage 1 weights or momentum are not the chunks"),
    "run id": (lambda d, s: _checkpoint(s, layout=_layout(run_id=2))[0], "its run id is 2"),
    "leaves": (lambda d, s: _forged_header(d, _meta(lambda m: m["stage_leaves"].pop("0"))),
               r"stage leaves of stages \[1\], not of each"),
    "stage hash": (lambda d, s: _forged_header(d, _meta(lambda m: m["stage_hashes"].update({"1": "0" * 64}))),
                   "stage hash of stage 1"),
    "dtype": (lambda d, s: _forged_header(d, _entry("weights.head", dtype="F16")), "'weights.head' is not"),
    "shape": (lambda d, s: _forged_header(d, _entry("momentum.out", shape=[32, 2])), "'momentum.out' is not"),
    "offsets": (lambda d, s: _forged_header(d, _entry("weights.out", data_offsets=[-4, 252])),
                "'weights.out' is not"),
    "missing": (lambda d, s: _forged_header(d, lambda h: h.pop("momentum.head")),
                "no tensor 'momentum.head'"),
    "cut": (lambda d, s: d[:len(d) - 300], "cut short"),
    "huge header": (lambda d, s: struct.pack("<Q", MAX_HEADER_BYTES + 1) + d[8:], "header of"),
    "not json": (lambda d, s: struct.pack("<Q", 4) + b"{{{{" + d[12:], "not JSON"),
    "nested": (lambda d, s: struct.pack("<Q", 200_000) + b"[" * 200_000 + d[8:], "not JSON"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_what_a_server_lies_about_is_refused_with_a_message_naming_it(case):
    states = _states()
    data, root = _checkpoint(states)
    forge, message = CASES[case]
    with pytest.raises(StateError, match=message):
        fetch_checkpoint_stages(Ranges(forge(data, states)), _layout(), ROUND, root, [1])


def test_a_record_of_other_weights_and_a_hashed_run_are_refused():
    states = _states()
    data, _root = _checkpoint(states)
    _other, other_root = _checkpoint(_states(3))
    with pytest.raises(StateError, match="is not the attested record's weightsRoot"):
        fetch_checkpoint_stages(Ranges(data), _layout(), ROUND, other_root, [1])
    with pytest.raises(StateError, match="a hashed run's checkpoint is checked whole"):
        fetch_checkpoint_stages(Ranges(data), _layout(chunked=False), ROUND, other_root, [1])
    with pytest.raises(StateError, match="its round is 5"):
        fetch_checkpoint_stages(Ranges(data), _layout(), ROUND + 1, _root, [1])
