"""A chunked run's published stage states written only when a peer asks (``storage.start_states = "rebuild"``,
node/live/fraud/stateserve.py): real ChunkedStates on real py-libp2p hosts, real stage states. A peer's fetch
under the state's alias gets the very bytes the node bound when it published (the stage shard of its weights
and momentum, as written before), nothing being on disk until then; many askers at once cost one write; a
spilled round's state is written first and read back whole; a key never published, or of a round whose window
closed, is refused at once; a held state that no longer gives the bound bytes is never served."""

from __future__ import annotations

import hashlib
import threading
from types import SimpleNamespace

import pytest
import torch
from waiting import wait_until

from node.config import load_config
from node.fraudproof import initial_state
from node.live.fraud.chunkstate import PUBLISHED_ROUNDS, ChunkedStates, state_key
from node.live.fraud.stateserve import tensors_of_leaves
from node.store.checkpoint import Checkpoint, RunLayout
from p2p.errors import BlobNotFound
from training.chunks import tensor_leaves

SHAPES = {"a.weight": (48, 40), "a.bias": (40,), "b.scale": ()}
CONFIG_HASH = b"\x07" * 32


class _Window:
    """A dispute window open for every round after ``closed_through`` (the chain's blocks, by hand here)."""

    def __init__(self) -> None:
        self.closed_through = -1

    def open(self, outer_round: int) -> bool:
        return outer_round > self.closed_through

    def forget(self, outer_round: int) -> None:
        pass


def _tensors(outer_round: int, scale: float = 1.0) -> dict:
    generator = torch.Generator().manual_seed(outer_round)
    return {name: torch.randn(shape, generator=generator) * scale for name, shape in SHAPES.items()}


def _expected(outer_round: int) -> bytes:
    """The stage shard a node wrote when it published round ``outer_round`` (the bytes before issue 75)."""
    return Checkpoint(1, outer_round, {"preset": "test"}, CONFIG_HASH, {}, _tensors(outer_round),
                      _tensors(outer_round + 1000, 0.1)).to_bytes()


def test_leaves_give_back_the_tensors_they_were_cut_from():
    weights = {**_tensors(3), "c.wide": torch.randn(3, 70), "d.cube": torch.randn(2, 3, 65)}
    shapes = {name: tuple(t.shape) for name, t in weights.items()}
    back = tensors_of_leaves(tensor_leaves(weights), shapes)
    assert set(back) == set(weights) and all(torch.equal(back[n], weights[n]) for n in weights)
    assert tensors_of_leaves([], {}) == {}


@pytest.fixture
def published(tmp_path):
    """A node's ChunkedStates publishing rounds 0-5 on a real host ``a``, a real peer ``b`` fetching."""
    from p2p.config import P2PConfig
    from p2p.host import P2PHost
    from p2p.identity import Identity

    cfg = load_config(None, ["pipeline.num_stages=1", "diloco.commitments=chunked"])
    assert cfg.storage.start_states == "rebuild"  # the default
    layout = RunLayout(1, CONFIG_HASH, {"preset": "test"}, (SHAPES,), chunked=True)
    a = P2PHost.start(P2PConfig(gossip_resync_interval=0), Identity.generate(), data_dir=tmp_path / "a")
    b = P2PHost.start(P2PConfig(bootstrap=a.listen_addrs, gossip_resync_interval=0), Identity.generate(),
                      data_dir=tmp_path / "b")
    window = _Window()
    states = ChunkedStates(cfg=cfg, host=a, layout=layout, config_hash=CONFIG_HASH, window=window,
                           spill_dir=tmp_path / "chunk-states")
    leaves = {}
    try:
        for outer_round in range(6):  # as the finisher records each round's state
            weights, momentum = _tensors(outer_round), _tensors(outer_round + 1000, 0.1)
            state = initial_state(0, weights, momentum)
            states.replace(outer_round, 0, state)
            leaves[outer_round] = state.leaf()
            states.publish(outer_round, 0, state.leaf().encode(), weights, momentum)
        wait_until(lambda: b.peer_id in a.peers() and a.peer_id in b.peers(), 60, "a and b connected")
        yield SimpleNamespace(a=a, b=b, states=states, leaves=leaves, window=window, layout=layout)
    finally:
        b.close()
        a.close()


def _key(world, outer_round: int) -> str:
    return state_key(world.leaves[outer_round].encode())


def test_a_published_state_is_written_only_when_asked_and_is_the_bytes_bound(published):
    world, a = published, published.a
    assert world.states.on_ask is not None and world.states.on_ask.pending_rounds() == list(range(6))
    assert world.states._published == {} and a.store.list() == [] and not list(a.store.packed_dir.glob("*"))
    expected = _expected(4)
    assert a.store.served_packed(_key(world, 4)) is None  # nothing on disk
    data = world.b.fetch_alias(_key(world, 4), a.peer_id, len(expected) + 1, timeout=60)
    assert data == expected
    digest = hashlib.sha256(expected).hexdigest()
    assert world.states._published[4][0] == digest and a.store.packed(digest) is not None
    assert world.states.on_ask.pending_rounds() == [0, 1, 2, 3, 5] and world.states.on_ask.written == 1
    # what a prover reads: the state under the committed leaf, checked against its roots
    fetched = ChunkedStates(cfg=load_config(None, ["pipeline.num_stages=1"]), host=world.b,
                            layout=world.layout, config_hash=CONFIG_HASH)
    weights, momentum = fetched.committed_state(2, 0, world.leaves[2], [a.peer_id])
    assert (weights, momentum) == (tensor_leaves(_tensors(2)), tensor_leaves(_tensors(1002, 0.1)))


def test_many_askers_at_once_cost_one_write_and_all_get_the_bytes(published):
    world = published
    expected, got = _expected(3), []

    def ask() -> None:
        got.append(world.b.fetch_alias(_key(world, 3), world.a.peer_id, len(expected) + 1, timeout=60))

    askers = [threading.Thread(target=ask) for _ in range(6)]
    for thread in askers:
        thread.start()
    for thread in askers:
        thread.join(timeout=120)
    assert got == [expected] * 6 and world.states.on_ask.written == 1


def test_bad_requests_are_refused_at_once(published):
    world = published
    with pytest.raises(BlobNotFound):  # a key this node never published (another stage, another leaf)
        world.b.fetch_alias("ab" * 32, world.a.peer_id, 1 << 20, timeout=30)
    world.window.closed_through = 1  # rounds 0 and 1: their windows closed
    world.states.forget_before(2 + PUBLISHED_ROUNDS + 1)  # rounds 0-2 leave memory
    assert world.states.on_ask.pending_rounds() == [3, 4, 5]  # round 2: written as it was spilled
    for outer_round in (0, 1):
        with pytest.raises(BlobNotFound):
            world.b.fetch_alias(_key(world, outer_round), world.a.peer_id, 1 << 20, timeout=30)
    assert world.states.on_ask.written == 1 and world.states.on_ask.failures == 0


def test_a_spilled_round_is_written_first_and_read_back_whole(published):
    world = published
    world.states.forget_before(2 + PUBLISHED_ROUNDS + 1)  # rounds 0-2 leave memory (their windows open)
    assert world.states.in_memory() == [3, 4, 5] and world.states.on_ask.pending_rounds() == [3, 4, 5]
    for outer_round in range(3):
        digest = world.states._published[outer_round][0]
        assert world.a.read_blob(digest) == _expected(outer_round)
        spilled = world.states.state(outer_round, 0)  # thin on disk, its leaves from the written blob
        assert spilled.leaf() == world.leaves[outer_round]
        assert spilled.weight_leaves == tensor_leaves(_tensors(outer_round))
    expected = _expected(1)
    assert world.b.fetch_alias(_key(world, 1), world.a.peer_id, len(expected) + 1, timeout=60) == expected


def test_a_held_state_that_is_not_the_bound_one_is_never_served(published):
    world = published
    other = initial_state(0, _tensors(77), _tensors(78))  # a re-base replaced the round's state
    world.states.replace(5, 0, other)
    with pytest.raises(BlobNotFound):
        world.b.fetch_alias(_key(world, 5), world.a.peer_id, 1 << 20, timeout=30)
    assert world.states.on_ask.failures == 1 and 5 not in world.states._published
    assert world.states.on_ask.pending_rounds() == [0, 1, 2, 3, 4, 5]  # still bound: not served


def test_an_asker_refused_while_another_state_is_written_asks_again_and_gets_it(published):
    """Two provers ask for two rounds at once while each write takes a while (a large stage's): the second
    waits for the first write, is refused after ``wait_s``, asks again (ChunkedStates.committed_state:
    fetch_published) and gets its state; nothing is written twice."""
    import time

    world = published
    on_ask = world.states.on_ask
    held = on_ask.state_of

    def slowly(outer_round: int, stage: int):
        time.sleep(7.0)  # a write of several seconds
        return held(outer_round, stage)

    on_ask.state_of, on_ask.wait_s = slowly, 6.0
    prover = ChunkedStates(cfg=load_config(None, ["pipeline.num_stages=1"]), host=world.b,
                           layout=world.layout, config_hash=CONFIG_HASH)
    got: dict = {}

    def ask(outer_round: int) -> None:
        leaf = world.leaves[outer_round]
        got[outer_round] = prover.committed_state(outer_round, 0, leaf, [world.a.peer_id])

    askers = [threading.Thread(target=ask, args=(r,)) for r in (1, 2)]
    for thread in askers:
        thread.start()
    for thread in askers:
        thread.join(timeout=120)
    for outer_round in (1, 2):
        assert got[outer_round] == (tensor_leaves(_tensors(outer_round)),
                                    tensor_leaves(_tensors(outer_round + 1000, 0.1)))
    assert on_ask.written == 2 and on_ask.failures == 0
