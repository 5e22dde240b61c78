"""A chunked run's stage states wait for their dispute window on disk, not in memory
(node/live/fraud/chunkstate.py).

A node keeps its state of every round until the round's dispute window closes on chain (``disputeBlocks``
after its commit): 64 blocks, 20-25 rounds on the soak's anvil, where a round took 2.5-3.2 blocks. Each state
holds the stage's weights and momentum chunked and every accepted contribution's payload pieces; kept in
memory for the whole window, they were most of the RSS growth of the 60-minute soak (tracemalloc on a 4-node
run on the network lab: training/chunks.py's allocations +9 MiB in six minutes on a one-node replica, the
largest growth there; docs/P2P.md, "What the soak found"). Now only the last PUBLISHED_ROUNDS rounds stay in
memory; older ones still open are written to the spill directory and read back when a challenge asks. Unit
tests: real StageStates, a window whose rounds stay open until the test closes them, a stand-in for the p2p
host.
"""

from __future__ import annotations

import dataclasses
import hashlib
from types import SimpleNamespace

import torch

from ledger.chunkproof import Factors, StageState
from node.commitments import scheme_named
from node.live.fraud.chunkstate import PUBLISHED_ROUNDS, ChunkedStates
from p2p.errors import BlobNotFound
from training.chunks import tensor_leaves

ROUNDS = 30


class _Window:
    """A dispute window that stays open for every round until ``close`` (the chain's blocks, here by hand)."""

    def __init__(self) -> None:
        self.closed_through = -1

    def open(self, outer_round: int) -> bool:
        return outer_round > self.closed_through

    def forget(self, outer_round: int) -> None:
        pass


class _Host:
    def remove_blob(self, digest: str) -> None:
        pass


def _state(outer_round: int, stage: int) -> StageState:
    generator = torch.Generator().manual_seed(1000 * outer_round + stage)
    weights = {"w": torch.randn(48, 40, generator=generator), "b": torch.randn(40, generator=generator)}
    momentum = {name: tensor * 0.5 for name, tensor in weights.items()}
    envelopes = tuple(hashlib.sha256(f"envelope {outer_round} {i}".encode()).digest() for i in range(3))
    pieces = [[f"piece {outer_round} {i} {j}".encode() * 8 for j in range(20)] for i in range(3)]
    factors = Factors(0x3C23D70A, 0x3F666666, True, envelopes,
                      tuple(hashlib.sha256(b"".join(p)).digest() for p in pieces), (0x3FF0000000000000,) * 3)
    return StageState(stage, tensor_leaves(weights), tensor_leaves(momentum), factors, pieces)


def _states(tmp_path, spill: bool, window=None) -> ChunkedStates:
    cfg = SimpleNamespace(commitment_scheme=scheme_named("chunked"))  # all a state's keeping reads of it
    return ChunkedStates(cfg=cfg, host=_Host(), layout=None, config_hash=b"", window=window or _Window(),
                         spill_dir=tmp_path / "chunk-states" if spill else None)


def _run(states: ChunkedStates) -> dict:
    """Rounds 0..ROUNDS-1 of a one-node replica (both stages), each followed by the finisher's forget_before;
    returns the states it made and the rounds held in memory after each round."""
    made, held = {}, []
    for outer_round in range(ROUNDS):
        for stage in (0, 1):
            made[outer_round, stage] = _state(outer_round, stage)
            states.replace(outer_round, stage, made[outer_round, stage])
        states.forget_before(outer_round)
        held.append(len(states.in_memory()))
    return {"made": made, "held": held}


def test_states_of_open_rounds_leave_memory_after_published_rounds_and_are_read_back_as_they_were(tmp_path):
    states = _states(tmp_path, spill=True)
    run = _run(states)
    assert max(run["held"]) <= PUBLISHED_ROUNDS + 1, run["held"]
    assert states.in_memory() == list(range(ROUNDS - PUBLISHED_ROUNDS - 1, ROUNDS))
    for (outer_round, stage), state in run["made"].items():  # every window is still open: every state is held
        back = states.state(outer_round, stage)
        assert back == state and back.leaf() == state.leaf(), (outer_round, stage)


def test_without_a_spill_directory_every_open_rounds_state_stays_in_memory(tmp_path):
    """What the soak's nodes did: one more round in memory for every round while the windows stay open."""
    run = _run(_states(tmp_path, spill=False))
    assert run["held"] == list(range(1, ROUNDS + 1))


def test_a_closed_window_drops_the_spilled_state_and_its_file(tmp_path):
    window = _Window()
    states = _states(tmp_path, spill=True, window=window)
    _run(states)
    spilled = sorted((tmp_path / "chunk-states").glob("*.state"))
    assert len(spilled) == 2 * (ROUNDS - PUBLISHED_ROUNDS - 1)
    window.closed_through = 9
    states.forget_before(ROUNDS)
    assert states.state(9, 0) is None and states.state(9, 1) is None and states.state(10, 0) is not None
    # Rounds 10 .. ROUNDS - PUBLISHED_ROUNDS - 1 wait on disk now (the last of them spilled by this call).
    assert len(list((tmp_path / "chunk-states").glob("*.state"))) == 2 * (ROUNDS - PUBLISHED_ROUNDS - 10)


def test_a_replaced_state_of_a_spilled_round_is_the_one_held(tmp_path):
    """A re-base on the record replaces this node's state of a round (node/live/record/forkrepair.py)."""
    states = _states(tmp_path, spill=True)
    _run(states)
    other = _state(99, 0)
    states.replace(3, 0, other)
    assert states.state(3, 0) == other
    states.forget_before(ROUNDS)  # spilled again, the new one
    assert 3 not in states.in_memory() and states.state(3, 0) == other


def test_an_earlier_lifes_spilled_states_are_not_taken(tmp_path):
    """A restarted node re-derives what it attests; files of its earlier life are removed, never read as its
    own."""
    first = _states(tmp_path, spill=True)
    _run(first)
    second = _states(tmp_path, spill=True)
    assert second.state(3, 0) is None
    assert not list((tmp_path / "chunk-states").glob("*.state"))


def test_a_spilled_file_changed_on_disk_is_refused_before_it_is_read(tmp_path):
    """A spilled state is unpickled only if this process wrote it as it is: a file someone changed or put in
    the data directory (pickle would run its code) is refused, and the state is answered as not held."""
    import pickle

    states = _states(tmp_path, spill=True)
    run = _run(states)
    path = tmp_path / "chunk-states" / "round-00000003-stage-0.state"
    original = path.read_bytes()
    path.write_bytes(original[:32] + pickle.dumps(_state(42, 0)))  # a well-formed pickle, not this process's
    assert states.state(3, 0) is None
    path.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    assert states.state(3, 0) is None
    path.write_bytes(b"")
    assert states.state(3, 0) is None
    path.write_bytes(original)
    assert states.state(3, 0) == run["made"][3, 0]


class _BlobHost:
    """The p2p host's blob store as the states use it: blobs in files named by their sha256."""

    def __init__(self, root) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def provide_blob(self, blob: bytes, announce: bool = True) -> str:
        digest = hashlib.sha256(blob).hexdigest()
        (self.root / digest).write_bytes(blob)
        return digest

    def provide_alias(self, alias: str, digest: str) -> None:
        pass

    def provide_packed(self, path, cuts, compress=False) -> str:
        return self.provide_blob(path.read_bytes())  # a real store shares the pieces

    def has_blob(self, digest: str) -> bool:
        return (self.root / digest).is_file()

    def read_blob(self, digest: str) -> bytes:
        if not self.has_blob(digest):
            raise BlobNotFound(digest)
        return (self.root / digest).read_bytes()

    def blob_path(self, digest: str):
        return self.root / digest

    def remove_blob(self, digest: str) -> bool:
        existed = self.has_blob(digest)
        (self.root / digest).unlink(missing_ok=True)
        return existed


def _published_run(tmp_path, window=None, publish=True):
    """Like :func:`_run`, each state also published as the finisher does (ChunkedStates.publish)."""
    host = _BlobHost(tmp_path / "blobs")
    cfg = SimpleNamespace(commitment_scheme=scheme_named("chunked"))
    layout = SimpleNamespace(run_id=7, model_config={"preset": "test"})
    states = ChunkedStates(cfg=cfg, host=host, layout=layout, config_hash=b"\x01" * 32,
                           window=window or _Window(), spill_dir=tmp_path / "chunk-states")
    made = {}
    for outer_round in range(ROUNDS):
        for stage in (0, 1):
            generator = torch.Generator().manual_seed(1000 * outer_round + stage)
            weights = {"w": torch.randn(48, 40, generator=generator),
                       "b": torch.randn(40, generator=generator)}
            momentum = {name: tensor * 0.5 for name, tensor in weights.items()}
            made[outer_round, stage] = _state(outer_round, stage)
            states.replace(outer_round, stage, made[outer_round, stage])
            if publish:
                states.publish(outer_round, stage, made[outer_round, stage].leaf().encode(), weights,
                               momentum)
        states.forget_before(outer_round)
    return states, host, made


def test_a_spilled_state_refers_to_its_published_state_instead_of_repeating_weights_and_momentum(tmp_path):
    """The weights and momentum a node publishes of a round are on disk once: the spilled state names the
    published blob, and is whole again when a challenge reads it (every chunk answerable)."""
    _published_run(tmp_path / "whole", publish=False)  # the same states, not published: spilled whole
    whole_sizes = {p.name: p.stat().st_size for p in (tmp_path / "whole" / "chunk-states").glob("*.state")}
    states, _host, made = _published_run(tmp_path / "thin")
    thin_sizes = {p.name: p.stat().st_size for p in (tmp_path / "thin" / "chunk-states").glob("*.state")}
    assert len(thin_sizes) == 2 * (ROUNDS - PUBLISHED_ROUNDS - 1)
    leaves = sum(len(leaf) for leaf in made[3, 0].weight_leaves) * 2  # weights and momentum
    for name, size in thin_sizes.items():
        assert size < whole_sizes[name] - leaves + 1024, (name, size, whole_sizes[name], leaves)
    for (outer_round, stage), state in made.items():
        back = states.state(outer_round, stage)
        assert back == state and back.leaf() == state.leaf(), (outer_round, stage)


def test_the_last_open_round_is_answered_after_older_ones_close_and_a_lost_published_state_is_not_served(
        tmp_path):
    """A challenge in the last block of round 9's window: rounds before it are pruned, round 9 is still whole;
    a published blob gone or changed is answered as a state not held (never wrong leaves)."""
    window = _Window()
    states, host, made = _published_run(tmp_path, window)
    window.closed_through = 8
    states.forget_before(ROUNDS)
    assert states.state(8, 0) is None and states.state(9, 0) == made[9, 0]
    assert states.state(9, 0).weight_leaves[-1] == made[9, 0].weight_leaves[-1]
    digest = states._published[10][0]
    path = host.blob_path(digest)
    blob = path.read_bytes()
    path.write_bytes(blob[:-4] + bytes(4))  # changed on disk
    assert states.state(10, 0) is None
    host.remove_blob(digest)
    assert states.state(10, 0) is None
    published_9 = states._published[9][0]
    window.closed_through = 9
    states.forget_before(ROUNDS)  # round 9's window closed: its spilled state and its published blob go
    assert states.state(9, 0) is None and not host.has_blob(published_9)


def _normed_state(outer_round: int, stage: int) -> StageState:
    """A version-3 state: :func:`_state` with a norm commitment and a sum tree per accepted contribution."""
    from ledger.chunkproof import Norms
    from ledger.normproof import SumTree

    base = _state(outer_round, stage)
    generator = torch.Generator().manual_seed(7 + 1000 * outer_round + stage)
    chunks = len(base.weight_leaves)
    trees = [SumTree.of([int(v) for v in torch.randint(0, 2**62, (chunks,), generator=generator)])
             for _ in base.factors.envelopes]
    norms = Norms(0x3FF0000000000000, (), tuple(t.root for t in trees), tuple(t.total for t in trees))
    factors = dataclasses.replace(base.factors, norms=norms)
    return dataclasses.replace(base, factors=factors, sum_trees=trees)


def test_a_spilled_normed_state_refers_to_its_published_sum_trees_and_refuses_a_changed_copy(tmp_path):
    """A version-3 stage's sum trees (a hash and a 96-byte sum per node, about two nodes per 64 elements of
    each accepted contribution) are published beside its state (its norm state, ``norms_key(leaf)``); the
    spilled state names that blob instead of repeating them, and is whole again when a challenge reads it.
    A published copy changed on disk is not served as the state's."""
    from ledger.normproof import encode_norm_state
    from node.commitments.chunked import norms_key

    files = {}
    for publish in (False, True):
        host = _BlobHost(tmp_path / f"blobs-{publish}")
        cfg = SimpleNamespace(commitment_scheme=scheme_named("normed"))
        states = ChunkedStates(cfg=cfg, host=host, layout=None, config_hash=b"", window=_Window(),
                               spill_dir=tmp_path / f"spill-{publish}")
        made = {}
        for outer_round in range(12):
            made[outer_round] = _normed_state(outer_round, 0)
            states.replace(outer_round, 0, made[outer_round])
            if publish:
                leaf = made[outer_round].leaf().encode()
                states.publish_part(outer_round, 0, norms_key(leaf),
                                    encode_norm_state(made[outer_round].factors.encode(),
                                                      made[outer_round].sum_trees))
            states.forget_before(outer_round)
        files[publish] = {p.name: p.stat().st_size for p in (tmp_path / f"spill-{publish}").glob("*.state")}
        for outer_round, state in made.items():
            back = states.state(outer_round, 0)
            assert back == state and back.sum_trees == state.sum_trees, outer_round
    assert files[True].keys() == files[False].keys() and files[True]
    trees = sum(len(h) + len(s) for tree in made[3].sum_trees for h, s in zip(tree.hashes, tree.sum_levels))
    for name, size in files[True].items():
        assert size < files[False][name] - trees + 1024, (name, size, files[False][name], trees)
    digest = states._published_norms[3][0]
    path = host.blob_path(digest)
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 1  # one sum changed on disk: its tree's root is not the committed one
    path.write_bytes(bytes(blob))
    assert states.state(3, 0) is None and states.state(4, 0) == made[4]
