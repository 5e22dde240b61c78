"""Unit tests of node/'s pure pieces: topology, payloads, archive, checkpoints, round book."""

from __future__ import annotations

import hashlib
import threading
import time

import msgpack
import pytest
import torch

from node import protocol as msg
from node.config import load_config
from node.errors import ConfigError, NodeError, StateError
from node.live.state.roundbook import Announced, RoundBook
from node.live.state.topology import Declaration, Seat, assign_stages, canonical_order, committer_order
from node.runconfig import canonical_json, config_hash, parse_run_document, run_document
from node.store.archive import Archive, ArchivedContribution
from node.store.checkpoint import (
    Checkpoint,
    RunLayout,
    build_checkpoint,
    checkpoint_problems,
    parse_checkpoint,
    read_checkpoint,
    stage_problems,
    write_checkpoint,
)


# ---------------------------------------------------------------- topology
def seat(index: int, block: int = 0) -> Seat:
    return Seat((block or 10 + index, 0), index)


def test_single_node_clusters_hold_every_stage_and_are_numbered_by_their_seat():
    decls = [Declaration("peerB", "alpha", 1, seat(1)), Declaration("peerA", "zeta", 1, seat(0))]
    placed = assign_stages(decls, num_stages=3)
    assert placed["peerA"].replica == 0 and placed["peerB"].replica == 1  # seat order, not name order
    assert placed["peerA"].stages == (0, 1, 2) and placed["peerA"].rank == 0


def test_split_cluster_members_take_stages_by_peer_id_and_incomplete_clusters_wait():
    decls = [Declaration("p2", "c0", 2, seat(1)), Declaration("p1", "c0", 2, seat(0)),
             Declaration("q1", "c1", 2, seat(2))]
    placed = assign_stages(decls, num_stages=2)
    assert placed["p1"].stages == (0,) and placed["p2"].stages == (1,) and placed["p2"].rank == 1
    assert placed["p1"].replica == placed["p2"].replica == 0
    assert "q1" not in placed  # its cluster declared 2 members, only one is here
    # Members disagreeing on the cluster size: the earliest-joined member's size counts.
    placed = assign_stages([Declaration("x1", "c", 1, seat(1)), Declaration("x2", "c", 2, seat(0))], 2)
    assert "x1" not in placed and "x2" not in placed  # x2 joined first and declared 2: incomplete
    placed = assign_stages([Declaration("x1", "c", 1, seat(0)), Declaration("x2", "c", 2, seat(1))], 2)
    assert placed["x1"].stages == (0, 1) and "x2" not in placed
    with pytest.raises(NodeError, match="num_stages=0"):
        assign_stages(decls, 0)


def test_a_newcomer_cluster_never_shifts_a_replica_index_nor_squats_a_seat():
    founders = [Declaration("a", "m-cluster", 1, seat(0)), Declaration("b", "z-cluster", 1, seat(1))]
    before = assign_stages(founders, 2)
    assert [before[p].replica for p in ("a", "b")] == [0, 1]
    # A cluster whose name sorts first, joined later: it takes its own seat's index.
    after = assign_stages([*founders, Declaration("c", "0-first", 1, seat(2))], 2)
    assert [after[p].replica for p in ("a", "b", "c")] == [0, 1, 2]
    # A late peer declaring a formed cluster's name gets no seat and changes nothing.
    squat = assign_stages([*founders, Declaration("0-early-id", "m-cluster", 1, seat(3))], 2)
    assert "0-early-id" not in squat and squat["a"] == before["a"]


def test_assignment_is_the_same_whatever_order_peers_learn_it_in():
    decls = [Declaration(f"p{i}", f"c{i % 3}", 1 if i % 3 else 2, seat(i)) for i in range(7)]
    assert assign_stages(decls, 2) == assign_stages(list(reversed(decls)), 2)


def test_committer_rotation_is_deterministic_and_rotates():
    peers = ["a", "b", "c", "d"]
    assert committer_order(5, peers) == committer_order(5, list(reversed(peers)))
    assert sorted(committer_order(5, peers)) == peers
    firsts = {committer_order(r, peers)[0] for r in range(40)}
    assert len(firsts) > 1
    assert committer_order(0, []) == []
    assert canonical_order([(1, 0, "b", b"x"), (0, 1, "a", b"y"), (0, 0, "z", b"z")])[0] == (0, 0, "z", b"z")


# ---------------------------------------------------------------- payloads
def test_payloads_round_trip_and_reject_malformed_input():
    hello = msg.Hello("c0", 1, b"\x01" * 20, ["/ip4/127.0.0.1/tcp/1"], 3, 2)
    assert msg.decode_payload(msg.HELLO, msg.encode_payload(hello)) == hello
    close = msg.Close([[0, "peer", b"\x02" * 32, 10]])
    assert msg.decode_payload(msg.CLOSE, msg.encode_payload(close)) == close
    bad = [
        (msg.HELLO, msgpack.packb({"cluster": "c"})),  # missing keys
        (msg.HELLO, msg.encode_payload(msg.Hello("c0", 1, b"\x01" * 19, [], 0, 0))),  # short account
        (msg.ANNOUNCE, msgpack.packb({"envelope_hash": b"x", "size": 1})),  # short hash
        (msg.ANNOUNCE, msgpack.packb({"envelope_hash": "str", "size": 1})),  # wrong type
        (msg.CLOSE, msgpack.packb({"contributions": [[0, "p", b"\x00" * 32]]})),  # short entry
        (msg.ATTESTATION, b"\xc1"),  # not msgpack
        (msg.ANNOUNCE, b"\x00" * (msg.MAX_GOSSIP_PAYLOAD + 1)),  # oversized
        ("contribution", b""),  # not a gossip kind
    ]
    for kind, data in bad:
        with pytest.raises(msg.ProtocolError):
            msg.decode_payload(kind, data)


# ---------------------------------------------------------------- archive
def test_archive_seals_rounds_canonically_drops_late_envelopes_and_prunes(tmp_path):
    archive = Archive(tmp_path, run_id=7)
    e1, e2, late = b"envelope-1", b"envelope-2", b"late"
    h1, h2 = archive.put(0, e1), archive.put(0, e2)
    archive.put(0, late)
    assert archive.put(0, e1) == h1 == hashlib.sha256(e1).digest()  # idempotent
    archive.seal_round(0, [ArchivedContribution(1, 0, "p", h2), ArchivedContribution(0, 1, "q", h1)])
    sealed = archive.sealed(0)
    assert [c.stage for c in sealed] == [0, 1]
    assert archive.get(0, h1) == e1 and archive.find(h2) is not None
    with pytest.raises(StateError):
        archive.get(0, hashlib.sha256(late).digest())  # not aggregated: dropped at sealing
    with pytest.raises(StateError, match="missing"):
        archive.seal_round(1, [ArchivedContribution(0, 0, "p", b"\x00" * 32)])
    for r in (1, 2, 3):
        archive.seal_round(r, [ArchivedContribution(0, 0, "p", archive.put(r, b"e%d" % r))])
    pruned = archive.prune(2)
    assert sorted(pruned) == [0, 1] and sorted(pruned[0]) == sorted([h1, h2]) and archive.rounds() == [2, 3]
    assert archive.prune(0) == {}
    (archive.dir / "round-00000003" / "round.json").write_text("{not json")
    with pytest.raises(StateError, match="corrupt"):
        archive.sealed(3)


# ---------------------------------------------------------------- checkpoints
def _layout() -> RunLayout:
    from node.config import load_config
    from node.runconfig import run_document

    # A hashed (version-1) run: a chunked run's checkpoints are tests/test_fraud_live.py's.
    document = run_document(
        load_config(None, ["model.preset=tiny", "pipeline.num_stages=2", "diloco.commitments=hashed"]))
    return RunLayout.of_document(1, b"\x07" * 32, document)


def _stage_state(layout: RunLayout, stage: int, value: float):
    shapes = layout.stage_shapes[stage]
    return ({n: torch.full(shape, value) for n, shape in shapes.items()},
            {n: torch.full(shape, value / 10) for n, shape in shapes.items()})


def test_checkpoint_bytes_are_deterministic_and_verified(tmp_path):
    from training.hashing import stage_weights_hash, weights_root

    layout = _layout()
    states = {0: _stage_state(layout, 0, 1.0), 1: _stage_state(layout, 1, 2.0)}
    full = build_checkpoint(layout, 4, states)
    assert full.to_bytes() == build_checkpoint(layout, 4, dict(reversed(states.items()))).to_bytes()
    root = weights_root([stage_weights_hash(states[s][0]) for s in (0, 1)])
    assert checkpoint_problems(full, layout, 4, root) == []
    path = tmp_path / "c.safetensors"
    digest = write_checkpoint(path, full)
    again = read_checkpoint(path, digest)
    assert again.round == 4 and set(again.stage_hashes) == {0, 1}
    assert torch.equal(again.weights["lm_head.weight"], states[1][0]["lm_head.weight"])
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    with pytest.raises(StateError, match="content hash mismatch"):
        parse_checkpoint(bytes(data), digest)
    with pytest.raises(StateError, match="not a valid safetensors"):
        parse_checkpoint(b"garbage")
    with pytest.raises(StateError, match="lacks"):
        again.stage_state(["transformer.h.99.ln_1.weight"])


def test_checkpoint_against_the_run_refuses_doctored_metadata_and_tensors():
    """Issue 28: a checkpoint is the run's only if its metadata is the run document's and its tensors hash to
    the attested root; a stage shard only if its tensors are the stage's and hash to the agreed hash."""
    from training.hashing import stage_weights_hash, weights_root

    layout = _layout()
    states = {0: _stage_state(layout, 0, 1.0), 1: _stage_state(layout, 1, 2.0)}
    root = weights_root([stage_weights_hash(states[s][0]) for s in (0, 1)])
    honest = build_checkpoint(layout, 4, states)
    doctored_config = dict(honest.model_config, n_head=8)
    forged = Checkpoint(1, 4, doctored_config, honest.config_hash, honest.stage_hashes, honest.weights,
                        honest.momentum)
    assert any("model config" in p for p in checkpoint_problems(forged, layout, 4, root))
    assert any("round is 4" in p for p in checkpoint_problems(honest, layout, 5, root))
    other = dict(states)
    other[0] = ({n: t + 1 for n, t in states[0][0].items()}, states[0][1])
    assert any("weights root" in p for p in checkpoint_problems(build_checkpoint(layout, 4, other), layout, 4,
                                                                root))
    extra = Checkpoint(1, 4, honest.model_config, honest.config_hash, honest.stage_hashes,
                       {**honest.weights, "backdoor": torch.zeros(1)}, honest.momentum)
    assert any("the run has not" in p for p in checkpoint_problems(extra, layout, 4, root))
    agreed = stage_weights_hash(states[0][0])
    assert stage_problems(layout, 0, *states[0], agreed) == []
    assert "agreed" in stage_problems(layout, 0, *other[0], agreed)[0]
    wrong_shape = {n: t[..., :1] for n, t in states[0][1].items()}
    assert "float32" in stage_problems(layout, 0, states[0][0], wrong_shape, agreed)[0]
    assert "lack" in stage_problems(layout, 1, states[0][0], states[0][1], None)[0]


# ---------------------------------------------------------------- round book
def test_round_book_wait_wakes_on_new_messages():
    book = RoundBook()
    item = Announced("p", 0, b"\x01" * 32, 5)
    threading.Timer(0.2, book.add_announce, args=(3, 0, item)).start()
    started = time.monotonic()
    got = book.wait_for(lambda: book.snapshot_announces(3, 0) or None, timeout=5)
    assert got == {"p": item} and time.monotonic() - started < 2
    assert book.wait_for(lambda: None, timeout=0.2) is None
    book.forget_before(4)
    assert book.snapshot_announces(3, 0) == {}


# ---------------------------------------------------------------- run document
def test_run_document_pins_the_math_not_the_node(tmp_path):
    a = run_document(load_config(None, ["p2p.listen_port=4001", "data_dir=/x"]))
    b = run_document(load_config(None, ["p2p.listen_port=5001", "data_dir=/y", "round_timeout=9"]))
    c = run_document(load_config(None, ["diloco.outer_lr=0.5"]))
    assert config_hash(a) == config_hash(b) != config_hash(c)
    data = canonical_json(a)
    assert parse_run_document(data, config_hash(a)) == a
    with pytest.raises(ConfigError, match="does not match"):
        parse_run_document(data, config_hash(c))
    text = tmp_path / "corpus.txt"
    text.write_text("hello " * 1000)
    d = run_document(load_config(None, [f"training.data_path={text}"]))
    assert d["training"]["data_sha256"] == hashlib.sha256(text.read_bytes()).hexdigest()
    with pytest.raises(ConfigError, match="cannot read"):
        run_document(load_config(None, [f"training.data_path={tmp_path / 'missing.txt'}"]))


def test_hellos_slow_down_as_peers_grow_but_stay_inside_the_liveness_window():
    from node.live.peers.heartbeat import HEARTBEAT_S, hello_every
    from node.live.state.roundbook import PEER_TTL_S

    assert hello_every(0) == hello_every(3) == HEARTBEAT_S  # small runs: once a second, as before
    assert hello_every(7) == 2.0 and hello_every(15) == 4.0  # the run's hellos stay ~4 a second
    assert all(hello_every(n) <= hello_every(n + 1) for n in range(200))
    assert hello_every(10_000) * 4 <= PEER_TTL_S  # a live peer is heard several times per TTL


def test_the_warm_up_import_never_raises_into_its_thread(monkeypatch):
    # A node that exits with its one-line error while the warm-up thread still imports (torch torn down
    # under it at interpreter exit) must not print a thread traceback after that line (tests/test_cli.py).
    import builtins

    from node.live.worker.replica import warm_up_imports

    real_import = builtins.__import__

    def torn_down(name, *args, **kwargs):
        if name == "torch._dynamo":
            raise AttributeError("module 'torch' has no attribute '_C' (interpreter shutting down)")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", torn_down)
    warm_up_imports()  # returns: the trainer imports it again, and reports
