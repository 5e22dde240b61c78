"""A node's round machinery, assembled as the node assembles it, in one process: no libp2p, no chain.

The parts are the real ones (node/live/assembly.py: coordinator, exchange and pool, inbox,
heartbeat, spot checks, contributor, finisher, entry, the worker with a tiny model) and so is
:meth:`node.live.node.Node.run`; only the boundary is faked: the host (a blob store and a topic
that loops nothing back) and the chain (a fresh run), and the committer, which would take the
rounds to that chain.
"""

from __future__ import annotations

import hashlib
import queue
import threading
from pathlib import Path

import pytest

from ledger.account import dev_account
from ledger.chain import PYEVM_CHAIN_ID
from ledger.contribution_binding import recover_contributor, sign_contribution
from node import protocol as msg
from node.config import load_config
from node.live.assembly import HONEST, NodeParts
from node.live.node import Node
from node.live.state.topology import Seat

TINY = ["model.preset=tiny", "diloco.inner_steps=2", "training.batch_size=2", "round_timeout=30",
        "diloco.num_replicas=1", "quorum=1", "checkpoint_every=2", "join_timeout=5"]


class FakeHost:
    """The libp2p host's face: a blob store in memory, a topic whose messages are kept (not delivered)."""

    def __init__(self, peer_id: str) -> None:
        self.peer_id = peer_id
        self.listen_addrs = [f"/ip4/127.0.0.1/tcp/1/p2p/{peer_id}"]
        self.blobs: dict[str, bytes] = {}
        self.published: list[bytes] = []
        self.announcements: list[tuple[str, str]] = []  # ("announce" | "stop", digest), in order
        self._lock = threading.Lock()

    def provide_blob(self, source, announce: bool = True, timeout: float = 30.0, link: bool = False) -> str:
        data = bytes(source) if isinstance(source, (bytes, bytearray, memoryview)) \
            else Path(source).read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        with self._lock:
            self.blobs[digest] = data
            if announce:
                self.announcements.append(("announce", digest))
        return digest

    def provide_packed(self, path, cuts, compress=False) -> str:  # a start state: pieces in the real host
        return self.provide_blob(path, announce=False)

    def has_blob(self, digest: str) -> bool:
        return digest in self.blobs

    def provide_alias(self, key: str, digest: str) -> None:  # a chunked run's published stage state
        with self._lock:
            self.blobs[key] = self.blobs[digest]

    def remove_blob(self, digest: str) -> bool:
        return self.blobs.pop(digest, None) is not None

    def stop_announcing(self, digest: str, timeout: float = 5.0) -> None:
        with self._lock:
            self.announcements.append(("stop", digest))

    def fetch_blob(self, digest: str, dest, providers=None, timeout=None) -> Path:
        from p2p.errors import BlobNotFound

        if digest not in self.blobs:
            raise BlobNotFound(f"blob {digest[:16]}: nobody here has it")
        Path(dest).write_bytes(self.blobs[digest])
        return Path(dest)

    def fetch_blob_range(self, digest: str, offset: int, length: int, provider: str, timeout=None) -> bytes:
        return self.blobs[digest][offset:offset + length]

    def publish(self, topic: str, data: bytes, timeout: float = 10.0) -> bool:
        with self._lock:
            self.published.append(data)
        return True

    def subscribe(self, topic: str, validator=None, timeout: float = 10.0, keep_for_sync=None) -> queue.Queue:
        return queue.Queue()

    def resync(self, topic: str, timeout: float = 10.0) -> int:
        return 0

    def connect(self, addr: str, timeout: float = 10.0) -> str:
        raise AssertionError("no bootstrap peers in this test")

    def peers(self, timeout: float = 5.0) -> list[str]:
        return []

    def transfer_stats(self) -> dict:
        return {}

    def connection_paths(self, timeout: float = 5.0) -> dict:
        return {}

    def close(self, timeout: float = 10.0) -> None:
        pass


class FakeChain:
    """The chain's face as a fresh run shows it to a joining node: nothing committed yet; then every round
    the fake committer takes counts as committed (a run with a round limit ends on its last commit)."""

    account = dev_account(1, PYEVM_CHAIN_ID)  # signs this node's contributions (a version-3 run: issue 62)
    account_bytes = bytes.fromhex(account.address[2:])
    ledger = "0x" + "22" * 20  # the EIP-712 domain's ledger: none is deployed

    def __init__(self) -> None:
        self.committed = -1

    def sign_contribution(self, claim) -> bytes:
        return sign_contribution(self.account, claim, PYEVM_CHAIN_ID, self.ledger)

    def contributor_of(self, claim, signature: bytes) -> str:
        return recover_contributor(claim, signature, PYEVM_CHAIN_ID, self.ledger)

    def last_round(self, run_id: int) -> int:
        return self.committed

    def quorum_of(self, run_id: int) -> int:
        return 1

    def own_seat_status(self, run_id: int) -> str:
        return "active"

    def run_info(self, run_id: int):
        return None  # a run without per-round values (issue 62): no committed schedule to prove against

    def declared_platforms(self, run_id: int, peer_ids, fresh: bool = False) -> dict[str, bytes]:
        return {}  # no seat declared a platform: the spot checks route nothing and hold no claim to one

    def contribution_cases(self, run_id: int, from_block: int) -> tuple[list[dict], int]:
        return [], 0  # nobody opens a case (the case defender's poll; a version-3 run's node reads it)

    def availability_challenges(self, run_id: int, from_block: int) -> tuple[list[dict], int]:
        # nobody challenges a round (the answerer's poll; a chunked run's node reads it)
        return [], from_block

    def close(self) -> None:
        pass


class FakeCommitter:
    """Takes finished rounds (the chain side is tested with a real chain in the e2e tests)."""

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self.submitted: list[int] = []
        self.handled_through = -1

    def submit(self, outer_round: int) -> None:
        self.submitted.append(outer_round)
        self.handled_through = outer_round
        self.ctx.chain.committed = max(self.ctx.chain.committed, outer_round)

    def drain(self, timeout: float) -> bool:
        return True

    def close(self) -> None:
        pass


class OfflineParts(NodeParts):
    """The node's parts with the host and the chain faked (step 1 of the assembly)."""

    def connect(self) -> Seat:
        self.reporter.set_state("joining")
        self.chain = FakeChain()
        self.host = FakeHost(self.peer_id)
        self.reporter.listening(self.host.listen_addrs)
        return Seat((0, 0), 0)


def offline_node(tmp_path, exchange: str = "full", rounds: int = 3) -> Node:
    import dataclasses

    cfg = load_config(None, [*TINY, f"rounds={rounds}", f"diloco.exchange={exchange}",
                             f"data_dir={tmp_path}"])
    parts = OfflineParts(cfg, stop=threading.Event(),
                         kinds=dataclasses.replace(HONEST, committer=FakeCommitter))
    return Node(cfg, parts=parts)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("exchange", ["full", "sliced"])
def test_a_node_runs_its_rounds_with_the_host_and_chain_faked(tmp_path, exchange):
    """Node.run assembles, enters at round 0 and finishes every round: each closed with its own
    contribution, sealed in the archive, attested (with the shard on checkpoint rounds) and handed
    to the committer; the state of rounds before the last ROUNDS_KEPT is forgotten."""
    from p2p.envelope import decode_envelope

    node = offline_node(tmp_path, exchange, rounds=5)
    progress = node.run()
    parts = node.parts
    assert progress.last_finished == 4 and progress.state == "stopped"
    assert parts.committer.submitted == [0, 1, 2, 3, 4]
    assert parts.station.placement().replica == 0 and parts.station.first_round == 0
    assert isinstance(parts.exchange, HONEST.exchanges[exchange])
    stages = list(range(node.cfg.pipeline.num_stages))
    assert parts.station.held_stages() == tuple(stages)  # a cluster of one holds every stage
    for outer_round in range(5):
        sealed = parts.archive.sealed(outer_round)
        assert [(c.stage, c.replica, c.peer_id) for c in sealed] == [(s, 0, node.peer_id) for s in stages]
    assert [entry[1] for entry in parts.coordinator.accepted(4, 0).contributions] == [node.peer_id]
    for stage in stages:
        attestations = parts.book.snapshot_attestations(4, stage)
        assert set(attestations) == {node.peer_id}
        assert attestations[node.peer_id].weights_hash == parts.rounds.stage_hashes[4][stage]
    published = [decode_envelope(data, 1 << 24) for data in parts.messenger.host.published]
    for kind in (msg.ANNOUNCE, msg.CLOSE, msg.ATTESTATION):  # (hellos: once a second, the run may be quicker)
        assert any(env.kind == kind for env in published), kind
    if exchange == "sliced":  # this node aggregated every slice itself
        assert any(env.kind == msg.PARTIAL_ANNOUNCE for env in published)
    # Checkpoint rounds (checkpoint_every = 2): round 1's shard is written and served.
    shard = tmp_path / "checkpoints" / "shard-00000001-stage0.safetensors"
    assert shard.exists() and hashlib.sha256(shard.read_bytes()).hexdigest() in parts.messenger.host.blobs
    # After round 4: rounds before 4 - ROUNDS_KEPT = 1 forgotten, in every room; stage hashes kept longer.
    assert sorted(parts.rounds.trained) == [1, 2, 3, 4]
    assert parts.coordinator.accepted(0, 0) is None and parts.coordinator.accepted(1, 0) is not None
    assert not parts.book.snapshot_attestations(0, 0) and sorted(parts.rounds.stage_hashes) == [0, 1, 2, 3, 4]
    assert not parts.rounds.evals.keys() - {1, 2, 3, 4} and not parts.rounds.prefetched
    # Its own contributions to the forgotten round 0 are served and no longer announced; round 4's still are.
    host = parts.messenger.host
    last = {digest: event for event, digest in host.announcements}
    for outer_round, announced in ((0, False), (4, True)):
        own = [c.envelope_hash.hex() for c in parts.archive.sealed(outer_round)]
        assert own and all(d in host.blobs for d in own)
        if announced:  # (announced by a background thread: it may still be queued)
            assert all(last.get(d) in ("announce", None) for d in own)
        else:
            assert all(last.get(d) in ("stop", None) for d in own)


@pytest.mark.timeout(300)
def test_the_round_machinery_is_deterministic(tmp_path):
    """Two offline nodes with the same settings compute the same stage weights, round by round."""
    hashes = []
    for index in range(2):
        node = offline_node(tmp_path / f"n{index}", rounds=2)
        node.run()
        hashes.append({r: dict(h) for r, h in node.parts.rounds.stage_hashes.items()})
    assert hashes[0] == hashes[1] and set(hashes[0]) == {0, 1}


@pytest.mark.timeout(300)
def test_a_time_bounded_node_finishes_rounds_behind_the_next_ones_training(tmp_path):
    """In the main loop a round's seal and attestation run on the round lane while the next round trains
    (RoundFinisher.finish, overlap_tail), and a time-bounded round's count comes from the round clock: every
    round is still sealed, attested and handed to the committer in order, and each period's record holds the
    steps its round declared, within the run's range, and its CPU seconds."""
    import dataclasses
    import json

    cfg = load_config(None, [*TINY, "rounds=4", "diloco.inner_steps=6", "diloco.round_budget_s=0.05",
                             "diloco.min_inner_steps=2", "diloco.overlap_steps=0", f"data_dir={tmp_path}"])
    parts = OfflineParts(cfg, stop=threading.Event(),
                         kinds=dataclasses.replace(HONEST, committer=FakeCommitter))
    node = Node(cfg, parts=parts)
    progress = node.run()
    assert progress.last_finished == 3 and parts.committer.submitted == [0, 1, 2, 3]
    for outer_round in range(4):
        assert parts.archive.sealed(outer_round)
    assert set(parts.book.snapshot_attestations(3, 0)) == {node.peer_id}
    records = [json.loads(line) for line in (tmp_path / "timing.jsonl").read_text().splitlines()]
    periods = [r for r in records if r["kind"] == "period"]
    finishes = {r["round"]: r for r in records if r["kind"] == "finish"}
    assert [p["round"] for p in periods] == [0, 1, 2, 3] and sorted(finishes) == [0, 1, 2, 3]
    assert all(2 <= p["steps"] <= 6 for p in periods)
    assert all(p["inner_cpu_s"] > 0 for p in periods) and all(p["process_cpu_s"] > 0 for p in periods[1:])
    # Every round here is finished by the loop's applies: each tail ran on the lane, none on this thread.
    assert all(f["tail_overlapped_s"] > 0 and f["tail_overlapped_s"] == f["tail_s"]
               for f in finishes.values())
