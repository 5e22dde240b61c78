"""The default retention (``storage.retention = "windows"``): a real archive, blob store and checkpoint
directory pruned by the chain's windows keep exactly what an open window needs, and a pruned node's host
still serves it to a peer (node/store/retention.py)."""

from __future__ import annotations

import hashlib

import pytest
from waiting import wait_until

from node.config import StorageConfig
from node.live.checks.heldstates import HeldStates
from node.store.archive import Archive, ArchivedContribution
from node.store.retention import (SPOT_CHECK_ROUNDS, Retention, checkpoint_files, prune_archive_before,
                                  prune_checkpoints_except, prune_shards)
from p2p.blobstore import BlobStore


class Windows:
    """The chain's proof windows as ``DisputeWindow.open`` reads them: committed rounds and the block each
    window closes at, a head block that moves; a round not committed is open."""

    def __init__(self, committed_through: int, closes: dict[int, int], head: int) -> None:
        self.committed_through, self.closes, self.head = committed_through, closes, head
        self.asked: list[int] = []

    def open(self, outer_round: int) -> bool:
        self.asked.append(outer_round)
        if outer_round > self.committed_through:
            return True
        return self.head < self.closes[outer_round]


class StoreHost:
    """A node's blob side on a real :class:`BlobStore` (what ``P2PHost.provide_blob``/``remove_blob`` do to
    it, without the DHT)."""

    def __init__(self, store: BlobStore) -> None:
        self.store = store

    def provide_blob(self, data, announce: bool = True, link: bool = False) -> str:
        return self.store.put_bytes(data) if isinstance(data, bytes) else self.store.put_file(data, link=link)

    def remove_blob(self, digest: str) -> bool:
        return self.store.remove(digest)


def _node(tmp_path, rounds: int):
    """A node's files after ``rounds`` rounds: each round's sealed envelope (served), its start state
    (served), and a checkpoint every round (full + shard, the files linked into the store)."""
    store = BlobStore(tmp_path / "blobs", max_blob_bytes=1 << 20)
    host = StoreHost(store)
    archive = Archive(tmp_path / "archive", run_id=1)
    states = HeldStates(host, tmp_path / "work", tmp_path / "evidence", num_stages=1, stop=None)
    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    for r in range(rounds):
        envelope = b"contribution of round %d" % r
        digest = archive.put(r, envelope)
        host.provide_blob(envelope)
        archive.seal_round(r, [ArchivedContribution(0, 0, "peer", digest)])
        states.serve(r, {0: b"start state of round %d" % r * 50}, 0)
        for name in (f"round-{r:08d}", f"shard-{r:08d}-stage0"):
            path = ckpt / f"{name}.safetensors"
            path.write_bytes(b"%s of round %d" % (name.encode(), r))
            host.provide_blob(path, link=True)
    return store, host, archive, states, ckpt


def _retain(retention, store, host, archive, states, ckpt, newest, committed):
    held = sorted({*archive.rounds(), *states.served_rounds()})
    floor = retention.rounds_floor(newest, committed, held)
    prune_archive_before(archive, floor, committed, host.remove_blob)
    states.forget_before(floor)
    kept, shards = retention.checkpoint_plan(ckpt, committed)  # as the finisher does (retain)
    prune_checkpoints_except(ckpt, kept, committed, host.remove_blob)
    prune_shards(shards, host.remove_blob)
    return floor


def test_windows_keep_exactly_the_open_windows_the_spot_checks_and_the_newest_final_checkpoint(tmp_path):
    store, host, archive, states, ckpt = _node(tmp_path, 40)
    # Rounds 0..35 committed; 36..39 sealed, not committed yet. Round r's window closes at block 10 r + 40;
    # head 300: rounds up to 26 are closed, 27 on open (a dispute would also keep an older one open).
    chain = Windows(committed_through=35, closes={r: 10 * r + 40 for r in range(36)}, head=300)
    retention = Retention(StorageConfig(), chain.open)
    floor = _retain(retention, store, host, archive, states, ckpt, newest=39, committed=35)
    # the windows open from 27 keep 27 and every newer round
    assert floor == 27
    assert archive.rounds() == list(range(27, 40)) and states.served_rounds() == list(range(27, 40))
    # checkpoints: the newest final full one (round 26: a joiner can start from it), the next to become final
    # (27), the newest committed (35) and the rounds not committed yet; not those of every round inside a
    # window (issue 75: nothing on chain reads them there; an auditor takes the seeders' copies)
    assert sorted(checkpoint_files(ckpt)) == [26, 27, 35, 36, 37, 38, 39]
    # the committed rounds before the newest keep their full file only: its shard repeats it
    assert sorted(p.name for p in ckpt.iterdir() if "000026" in p.name or "000027" in p.name) == \
        ["round-00000026.safetensors", "round-00000027.safetensors"]
    # the store serves exactly what is kept: every kept round's envelope, start state and checkpoint files
    kept = {hashlib.sha256(b"contribution of round %d" % r).hexdigest() for r in range(27, 40)}
    kept |= {hashlib.sha256(b"start state of round %d" % r * 50).hexdigest() for r in range(27, 40)}
    kept |= {hashlib.sha256(p.read_bytes()).hexdigest() for ps in checkpoint_files(ckpt).values() for p in ps}
    assert set(store.list()) == kept
    # the linked checkpoint files are one copy on disk (the store holds the same inode)
    shard = ckpt / "shard-00000035-stage0.safetensors"
    assert shard.stat().st_nlink == 2

    # The windows move on (head 500: every committed round closed): the newest committed round stays, and so
    # does every round not committed, with their checkpoints. No fixed span of committed rounds is kept
    # beside the windows (issue 75: 8 start states while rounds outlast the windows): a spot check's
    # accusation counts only inside the round's window.
    chain.head = 500
    floor = _retain(retention, store, host, archive, states, ckpt, newest=39, committed=35)
    assert floor == 35 and archive.rounds() == list(range(35, 40))
    assert states.served_rounds() == list(range(35, 40))
    assert sorted(checkpoint_files(ckpt)) == [35, 36, 37, 38, 39]  # 35: final and newest committed
    # a dispute on an old round (its window extended) holds that round and every newer one
    store2, host2, archive2, states2, ckpt2 = _node(tmp_path / "b", 40)
    chain2 = Windows(committed_through=35, closes={r: 0 for r in range(36)} | {12: 10_000}, head=500)
    floor = _retain(Retention(StorageConfig(), chain2.open), store2, host2, archive2, states2, ckpt2, 39, 35)
    assert floor == 12 and archive2.rounds()[0] == 12 and states2.served_rounds()[0] == 12


def test_the_newest_final_checkpoint_outlives_the_span_while_the_newer_ones_can_be_proven_wrong(tmp_path):
    store, host, archive, states, ckpt = _node(tmp_path, 40)
    own = Windows(committed_through=39, closes={r: 0 for r in range(40)}, head=100)  # no dispute open
    proofs = Windows(committed_through=39, closes={r: 50 if r <= 20 else 500 for r in range(40)}, head=100)
    retention = Retention(StorageConfig(), own.open, proofs.open)
    floor = _retain(retention, store, host, archive, states, ckpt, 39, 39)
    assert floor == 39 and archive.rounds() == [39]
    # round 20: the newest a fraud proof can no longer overturn (a joiner's start if 21..39 fall); 21: the
    # next to become final; 39: the newest committed
    assert sorted(checkpoint_files(ckpt)) == [20, 21, 39]
    assert proofs.asked[:3] == [39, 38, 37]  # asked newest first, down to the first final one


def test_the_final_checkpoint_moves_on_as_rounds_go_by_and_a_node_keeps_at_most_three_committed(tmp_path):
    """Pruned after every round as a node does, with the windows moving (each round commits two rounds after
    it is trained, its proof window closes 12 rounds after that): the final checkpoint kept moves on with the
    run, never more than two proof windows behind (issue 75: before, every newer checkpoint went before its
    window closed, so the final one stayed round 0's), and the committed rounds kept are at most three."""
    store = BlobStore(tmp_path / "blobs", max_blob_bytes=1 << 20)
    host = StoreHost(store)
    archive = Archive(tmp_path / "archive", run_id=1)
    states = HeldStates(host, tmp_path / "work", tmp_path / "evidence", num_stages=1, stop=None)
    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    chain = Windows(committed_through=-1, closes={}, head=0)
    retention = Retention(StorageConfig(), chain.open)
    finals = []
    for r in range(80):
        for name in (f"round-{r:08d}", f"shard-{r:08d}-stage0"):
            path = ckpt / f"{name}.safetensors"
            path.write_bytes(b"%s of round %d" % (name.encode(), r))
            host.provide_blob(path, link=True)
        chain.head = r  # a block a round
        chain.committed_through = r - 2
        chain.closes[r - 2] = r + 12
        _retain(retention, store, host, archive, states, ckpt, r, r - 2)
        kept = sorted(checkpoint_files(ckpt))
        committed = [k for k in kept if k <= r - 2]
        closed = [k for k in committed if chain.head >= chain.closes[k]]
        if not closed:  # no checkpoint final yet: everything stays
            assert kept == list(range(r + 1))
            continue
        finals.append(closed[-1])
        assert len(committed) <= 3 and r - closed[-1] <= 2 * 14, (r, kept)
        # every kept committed round but the newest keeps its full file only
        assert all(not (ckpt / f"shard-{k:08d}-stage0.safetensors").exists() for k in committed[:-1])
        assert all((ckpt / f"shard-{k:08d}-stage0.safetensors").exists() for k in kept[-3:])
    assert finals[0] == 0 and finals[-1] >= 80 - 2 * 14 and finals == sorted(finals)
    # the store serves exactly the files kept
    assert set(store.list()) == {hashlib.sha256(p.read_bytes()).hexdigest() for p in ckpt.iterdir()}


@pytest.mark.parametrize("one_stage", [False, True])
def test_a_one_stage_run_drops_its_newest_committed_shard_and_keeps_the_uncommitted_ones(tmp_path, one_stage):
    """Issue 75: in a one-stage run every node builds each full file from its own shard, so the newest
    committed round keeps its full file only; rounds not committed keep their shards (a committer that
    failed before its commit builds the file again from them). A run of more stages keeps the newest
    committed round's shards for the other stages' holders still assembling its file."""
    store, host, archive, states, ckpt = _node(tmp_path, 10)
    chain = Windows(committed_through=7, closes={r: 0 for r in range(10)}, head=100)  # every window closed
    kept, shards = Retention(StorageConfig(), chain.open).checkpoint_plan(ckpt, 7, one_stage=one_stage)
    assert kept == {7, 8, 9}
    prune_checkpoints_except(ckpt, kept, 7, host.remove_blob)
    prune_shards(shards, host.remove_blob)
    names = sorted(p.name for p in ckpt.iterdir())
    shards_kept = [8, 9] if one_stage else [7, 8, 9]
    assert names == sorted([f"round-{r:08d}.safetensors" for r in (7, 8, 9)]
                           + [f"shard-{r:08d}-stage0.safetensors" for r in shards_kept])
    # served while kept; a shard dropped is served no more
    assert set(store.list()) >= {hashlib.sha256(p.read_bytes()).hexdigest() for p in ckpt.iterdir()}
    dropped = hashlib.sha256(b"shard-00000007-stage0 of round 7").hexdigest()
    assert (dropped in store.list()) == (not one_stage)


def test_a_chain_that_cannot_be_asked_keeps_everything_and_all_keeps_everything(tmp_path):
    store, host, archive, states, ckpt = _node(tmp_path, 20)
    before = set(store.list())

    def unreachable(outer_round: int) -> bool:
        return True  # DisputeWindow.open answers True when the chain read fails

    assert _retain(Retention(StorageConfig(), unreachable), store, host, archive, states, ckpt, 19, 19) == 0
    assert set(store.list()) == before and archive.rounds() == list(range(20))
    chain = Windows(committed_through=19, closes={r: 0 for r in range(20)}, head=100)
    everything = Retention(StorageConfig(retention="all"), chain.open)
    assert _retain(everything, store, host, archive, states, ckpt, 19, 19) == 0
    assert set(store.list()) == before and chain.asked == []
    # keep_checkpoints and keep_rounds keep more than the windows need, never less
    more = Retention(StorageConfig(keep_checkpoints=10), chain.open)
    assert _retain(more, store, host, archive, states, ckpt, 19, 19) == 19
    assert sorted(checkpoint_files(ckpt)) == list(range(10, 20)) and archive.rounds() == [19]
    store2, host2, archive2, states2, ckpt2 = _node(tmp_path / "b", 20)
    more = Retention(StorageConfig(keep_rounds=15), chain.open)
    assert _retain(more, store2, host2, archive2, states2, ckpt2, 19, 19) == 5


def test_a_node_without_a_chain_keeps_the_spot_checks_span_and_a_chain_keeps_only_its_windows(tmp_path):
    """Without a chain to ask (no windows), the newest SPOT_CHECK_ROUNDS committed rounds stay; with one, a
    round whose window closed goes at once, however few rounds ago it was committed (rounds that outlast
    their windows, as a large model's do: issue 75)."""
    store, host, archive, states, ckpt = _node(tmp_path, 20)
    assert _retain(Retention(StorageConfig(), None), store, host, archive, states, ckpt, 19, 19) == \
        19 - SPOT_CHECK_ROUNDS + 1
    assert archive.rounds() == list(range(12, 20)) and states.served_rounds() == list(range(12, 20))
    # each round's window closes two blocks after its commit; head 40: round 18's is closed, 19's open
    chain = Windows(committed_through=19, closes={r: 2 * r + 3 for r in range(20)}, head=40)
    assert _retain(Retention(StorageConfig(), chain.open), store, host, archive, states, ckpt, 19, 19) == 19
    assert archive.rounds() == [19] and states.served_rounds() == [19]


def test_nothing_uncommitted_goes_whatever_the_windows_say(tmp_path):
    store, host, archive, states, ckpt = _node(tmp_path, 30)
    chain = Windows(committed_through=5, closes={r: 0 for r in range(30)}, head=100)
    floor = _retain(Retention(StorageConfig(), chain.open), store, host, archive, states, ckpt, 29, 5)
    assert floor == 5 and archive.rounds() == list(range(5, 30))  # 6..29 uncommitted; 5 the newest committed


@pytest.mark.timeout(120)
def test_a_pruned_node_still_serves_what_an_open_window_asks(tmp_path):
    """Real libp2p hosts: after the retention ran, a peer fetches the start state and the envelope of a
    round inside its window (a spot check of it) from the pruned node, and a pruned round is refused."""
    from p2p.config import P2PConfig
    from p2p.errors import P2PError
    from p2p.host import P2PHost
    from p2p.identity import Identity

    server = P2PHost.start(P2PConfig(gossip_resync_interval=0), Identity.generate(),
                           data_dir=tmp_path / "server")
    client = P2PHost.start(P2PConfig(bootstrap=server.listen_addrs, gossip_resync_interval=0),
                           Identity.generate(), data_dir=tmp_path / "client")
    try:
        archive = Archive(tmp_path / "server" / "archive", run_id=1)
        states = HeldStates(server, tmp_path / "server" / "work", tmp_path / "server" / "evidence",
                            num_stages=1, stop=None)
        ckpt = tmp_path / "server" / "checkpoints"
        ckpt.mkdir()
        hashes = {}
        for r in range(12):
            envelope = b"envelope %d" % r
            digest = archive.put(r, envelope)
            server.provide_blob(envelope, announce=False)
            archive.seal_round(r, [ArchivedContribution(0, 0, server.peer_id, digest)])
            hashes[r] = (digest.hex(), states.serve(r, {0: b"state %d" % r * 1000}, 0)[0].hex())
        chain = Windows(committed_through=11, closes={r: 0 for r in range(12)} | {2: 10_000}, head=50)
        retention = Retention(StorageConfig(), chain.open)
        floor = _retain(retention, server.store, server, archive, states, ckpt, 11, 11)
        assert floor == 2  # round 2's window is open (a dispute): 2 and every newer round stay
        wait_until(lambda: server.peer_id in client.peers(), 60, "the peer connected")
        for r in (2, 11):
            envelope_hash, state_hash = hashes[r]
            dest = tmp_path / f"state-{r}.part"
            client.fetch_blob(state_hash, dest, providers=[server.peer_id], timeout=30)
            assert dest.read_bytes() == b"state %d" % r * 1000
            client.fetch_blob(envelope_hash, tmp_path / f"env-{r}", providers=[server.peer_id], timeout=30)
            assert (tmp_path / f"env-{r}").read_bytes() == b"envelope %d" % r
        with pytest.raises(P2PError):  # round 1 is final and past the spot checks: gone, and says so
            client.fetch_blob(hashes[1][1], tmp_path / "gone.part", providers=[server.peer_id], timeout=10)
    finally:
        client.close()
        server.close()


def test_a_restarted_node_still_prunes_the_start_states_it_served_before(tmp_path):
    """The start states served before a restart are listed on disk (node/store/retention.py
    SERVED_STATES_FILE): a new HeldStates on the same work directory (the restarted node) forgets them when
    their rounds leave the span, and the store keeps exactly the rounds still inside it."""
    store, host, archive, states, ckpt = _node(tmp_path, 30)
    served = {r: hashlib.sha256(b"start state of round %d" % r * 50).hexdigest() for r in range(30)}
    assert set(served.values()) <= set(store.list())
    restarted = HeldStates(host, tmp_path / "work", tmp_path / "evidence", num_stages=1, stop=None)
    assert restarted.served_rounds() == list(range(30))
    chain = Windows(committed_through=29, closes={r: 0 for r in range(30)}, head=100)
    floor = _retain(Retention(StorageConfig(), chain.open), store, host, archive, restarted, ckpt, 29, 29)
    assert floor == 29
    left = set(store.list())
    assert {r for r, d in served.items() if d in left} == set(range(floor, 30))
    # and a third start sees only what is left
    again = HeldStates(host, tmp_path / "work", tmp_path / "evidence", num_stages=1, stop=None)
    assert again.served_rounds() == list(range(floor, 30))
    # a round re-served after a restart (the node re-applies it) is listed once more, and goes once
    again.serve(floor, {0: b"start state of round %d" % floor * 50}, 0)
    assert again.forget_before(floor + 1) == [floor] and served[floor] not in set(store.list())


@pytest.mark.parametrize("content", [b"{not json", b'{"v": 2, "rounds": {}}', b'{"v": 1, "rounds": [1]}',
                                     b'{"v": 1, "rounds": {"3": ["not a hash"]}}',
                                     b'{"v": 1, "rounds": {"-1": []}}'])
def test_a_damaged_served_list_is_refused_with_a_warning_and_the_node_goes_on(tmp_path, caplog, content):
    from node.store.retention import SERVED_STATES_FILE

    work = tmp_path / "work"
    work.mkdir()
    (work / SERVED_STATES_FILE).write_bytes(content)
    store = BlobStore(tmp_path / "blobs", max_blob_bytes=1 << 20)
    with caplog.at_level("WARNING"):
        states = HeldStates(StoreHost(store), work, tmp_path / "evidence", num_stages=1, stop=None)
    assert states.served_rounds() == [] and SERVED_STATES_FILE in caplog.text
    digest = states.serve(4, {0: b"state"}, 0)[0].hex()
    assert HeldStates(StoreHost(store), work, tmp_path / "evidence", 1, None).served_rounds() == [4]
    assert digest in store.list()
