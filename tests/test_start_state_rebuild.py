"""A node's own start states rebuilt when asked (``storage.start_states = "rebuild"``,
node/live/checks/staterebuild.py): real start states of a chain of rounds of ``tiny`` (each round's rerun
gives the next round's state, as a node's chain check compares them), served by a real libp2p host whose
blob store keeps one every few rounds; the others are replayed in the real child process when a peer asks
and must be the very bytes bound, or nothing is served."""

from __future__ import annotations

import hashlib
import threading
from types import SimpleNamespace

import pytest
from waiting import wait_until

from node.config import load_config
from node.live.checks.heldstates import HeldStates
from node.live.checks.staterebuild import ReplayRound, StateReplay
from training.data import corpus_from_config
from training.reexec import reexecute, round_meta
from training.replica_capture import initial_replica_state

ROUNDS = 8
EVERY = 3


def _state_chain(tmp_path):
    """(cfg, each round's start-state bytes, each round's payload) of one replica alone for ROUNDS rounds."""
    cfg = load_config(None, ["model.preset=tiny", "diloco.inner_steps=1", "training.batch_size=2", "rounds=0",
                             "pipeline.num_stages=1", f"data_dir={tmp_path}"])
    corpus = corpus_from_config(cfg.training, cfg.model)
    meta = round_meta(0, 0, cfg.model, cfg.diloco, run_rounds=0, num_stages=1, threads=1)
    state = initial_replica_state(meta, cfg.model, cfg.training, cfg.diloco, cfg.compression)
    states, payloads = [state.stages[0].to_bytes()], []
    for outer_round in range(ROUNDS - 1):
        previous = {0: [payloads[-1]]} if outer_round > 0 else None
        rerun = reexecute(state, corpus, cfg.model, cfg.training, cfg.diloco, cfg.compression,
                          previous_contributions=previous)
        payloads.append(rerun.payloads[0])
        state = rerun.next_state
        states.append(state.stages[0].to_bytes())
    return cfg, states, payloads


@pytest.mark.timeout(600)
def test_a_node_keeps_one_start_state_in_three_and_rebuilds_the_others_bit_for_bit_when_asked(tmp_path):
    from p2p.config import P2PConfig
    from p2p.host import P2PHost
    from p2p.identity import Identity

    cfg, truth, payloads = _state_chain(tmp_path)
    assert len(set(truth)) == ROUNDS  # every round's state differs
    wrong: set[int] = set()  # rounds whose replay is given another round t-1 (a damaged archive)

    def round_inputs(outer_round: int) -> ReplayRound:
        if outer_round == 0:
            return ReplayRound()
        other = payloads[outer_round - 2] if outer_round in wrong else payloads[outer_round - 1]
        return ReplayRound(previous={0: [other]})

    server = P2PHost.start(P2PConfig(gossip_resync_interval=0), Identity.generate(),
                           data_dir=tmp_path / "server")
    client = P2PHost.start(P2PConfig(bootstrap=server.listen_addrs, gossip_resync_interval=0),
                           Identity.generate(), data_dir=tmp_path / "client")
    states = HeldStates(server, tmp_path / "work", tmp_path / "evidence", num_stages=1, stop=None)
    states.rebuild_others(EVERY, StateReplay(cfg.to_dict(), tmp_path / "work", round_inputs))
    try:
        digests = {}
        for outer_round, data in enumerate(truth):  # as the node's contributor serves them
            if states.keeps(outer_round, 1):
                path = states.writing_dir / f"state-{outer_round}.part"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
                served = states.serve(outer_round, {0: path}, 0)
            else:  # hashed, never written
                served = states.serve_hashes(outer_round, {0: hashlib.sha256(data).digest()})
            digests[outer_round] = served[0].hex()
            assert digests[outer_round] == hashlib.sha256(data).hexdigest()  # what the envelope binds

        def held(outer_round: int) -> bool:  # a kept state packed, a rebuilt one linked as it is
            digest = digests[outer_round]
            return server.store.packed(digest) is not None or server.store.has(digest)

        # one in three kept (rounds 0, 3, 6), every one still served by hash
        assert [r for r in range(ROUNDS) if held(r)] == [0, 3, 6]
        assert all(states.knows(d) for d in digests.values()) and not states.knows("ab" * 32)

        # a verifier's fetch of round 5's (a spot check of it) is answered by a replay of rounds 3 and 4 (its
        # first ask may outwait the blob protocol's stall timeout while the child starts: it asks again)
        wait_until(lambda: server.peer_id in client.peers(), 60, "the peer connected")
        verifier = HeldStates(client, tmp_path / "verifier", tmp_path / "evidence-v", num_stages=1,
                              stop=threading.Event())
        envelope = SimpleNamespace(stage=0, sender_peer_id=server.peer_id)
        [fetched] = verifier.fetch_files([envelope], [bytes.fromhex(digests[5])], tmp_path / "job")
        assert fetched.read_bytes() == truth[5] and held(5)
        # and one asked directly: round 2's, from round 0's over two rounds; the same bytes and hash
        assert states.rebuild(digests[2]) and server.read_blob(digests[2]) == truth[2]
        assert states.rebuild(digests[5])  # held already: nothing replayed

        # a replay that does not give the bound state is not served (here: a damaged round 6 input)
        wrong.add(6)
        assert not states.rebuild(digests[7]) and not held(7) and states.rebuild_failures == 1
        assert not states.rebuild(digests[7])  # not tried again at once

        # the retention: the newest kept state at or before the floor stays (rounds from it are rebuilt
        # from it), the archive is kept from the round before it, and rebuilt copies go at the 2nd pruning
        assert states.forget_before(5) == [0, 1, 2]
        assert states.served_rounds() == list(range(3, ROUNDS)) and states.archive_floor(5) == 2
        assert held(3) and held(5)
        states.forget_before(5)
        assert not held(5) and held(3) and held(6)
        assert not states.knows(digests[1])
    finally:
        states.close()
        client.close()
        server.close()


def test_storage_start_states_loads_validates_and_keeps_the_old_setting(tmp_path):
    from node.config import ConfigError

    default = load_config(None, []).storage
    assert (default.start_states, default.start_state_every) == ("rebuild", 8)
    keep = load_config(None, ["storage.start_states=keep"]).storage
    assert keep.start_states == "keep"
    with pytest.raises(ConfigError, match="storage.start_states='some'"):
        load_config(None, ["storage.start_states=some"])
    with pytest.raises(ConfigError, match="storage.start_state_every=0"):
        load_config(None, ["storage.start_state_every=0"])


def test_a_start_state_kept_by_its_hash_alone_hashes_as_its_written_bytes(tmp_path):
    """A round the node does not keep is hashed without being written (StartStateCapture.hashes): the hash
    its envelope binds is the sha256 of the bytes a write gives, which a rebuild must give again."""
    from training.replica_capture import StartStateCapture, capture_trainer_part
    from training.replica_restore import restore_replica

    cfg = load_config(None, ["model.preset=tiny", "diloco.inner_steps=1", "training.batch_size=2",
                             "pipeline.num_stages=1", f"data_dir={tmp_path}"])
    meta = round_meta(0, 0, cfg.model, cfg.diloco, run_rounds=0, num_stages=1, threads=1)
    state = initial_replica_state(meta, cfg.model, cfg.training, cfg.diloco, cfg.compression)
    trainer, engines = restore_replica(state, cfg.model, cfg.training, cfg.diloco, cfg.compression)
    part = capture_trainer_part(trainer.stage_modules[0], trainer.optimizers[0])
    capture = StartStateCapture(meta, lambda stage: engines[stage], {0: part})
    [written] = capture.write(tmp_path / "states").values()
    assert capture.hashes() == {0: hashlib.sha256(written.read_bytes()).digest()}
    assert written.read_bytes() == state.stages[0].to_bytes()


def test_the_host_loop_asks_about_a_rebuildable_state_without_waiting_for_a_pruning(tmp_path):
    """A pruning holds the served list while it asks the host's event loop to forget each blob; the loop's
    question "is this a state you rebuild?" must not wait for that list, or neither ever finishes (a node of
    the mini retention bench stopped so at round 89)."""
    from p2p.blobstore import BlobStore

    class Host:  # the blob store's face HeldStates uses; remove_blob stands for the loop's call
        def __init__(self) -> None:
            self.store = BlobStore(tmp_path / "blobs", max_blob_bytes=1 << 20)

        def set_blob_rebuilder(self, rebuilder) -> None:
            self.store.set_rebuilder(rebuilder)

        def has_blob(self, digest: str) -> bool:
            return self.store.has(digest)

        def provide_blob(self, data: bytes, announce: bool = True) -> str:
            return self.store.put_bytes(data)

        def remove_blob(self, digest: str) -> bool:
            # the loop answers a request before it runs this call: it asks the store about a rebuilt state
            asked = threading.Thread(target=self.store.rebuildable, args=(digest,))
            asked.start()
            asked.join(timeout=60)
            assert not asked.is_alive(), "the loop waited for the pruning's lock"
            return self.store.remove(digest)

    host = Host()
    states = HeldStates(host, tmp_path / "work", tmp_path / "evidence", num_stages=1, stop=None)
    states.rebuild_others(4, replay=None)
    for outer_round in range(6):
        if states.keeps(outer_round, 1):
            states.serve(outer_round, {0: b"kept state %d" % outer_round}, 0)
        else:
            states.serve_hashes(outer_round, {0: hashlib.sha256(b"state %d" % outer_round).digest()})
    assert host.store.rebuildable(hashlib.sha256(b"state 5").hexdigest())
    assert states.forget_before(5) == [0, 1, 2, 3]  # round 4's kept state stays: 5 is rebuilt from it
    assert not host.store.rebuildable(hashlib.sha256(b"state 1").hexdigest())


def test_a_verifier_asks_again_once_the_claimant_is_seen_rebuilding_and_never_when_it_refuses_at_once(
        tmp_path, monkeypatch):
    """The fetch of a claimant's start state (HeldStates.fetch_files): a first ask that fails after waiting
    (the claimant was replaying) is asked again, and so is any later failure (a piece asked for during the
    replay is refused quickly after it: a check of the mini retention bench was left undone so); a first
    ask refused at once (the state is not there) ends the fetch, as before."""
    import time

    from node.live.checks import heldstates
    from p2p.errors import P2PError

    monkeypatch.setattr(heldstates, "SLOW_REFUSAL_S", 0.2)
    monkeypatch.setattr(heldstates, "REFETCH_AFTER_S", 0.05)

    class Host:  # each ask's outcome in turn: ("slow" | "quick", error) or the bytes
        def __init__(self, outcomes) -> None:
            self.outcomes, self.asks = list(outcomes), 0

        def fetch_blob(self, digest, dest, providers, timeout):
            self.asks += 1
            outcome = self.outcomes.pop(0)
            if outcome == "slow":
                time.sleep(0.3)
            if outcome in ("slow", "quick"):
                raise P2PError(f"{outcome} refusal")
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(outcome)

    envelope = SimpleNamespace(stage=0, sender_peer_id="claimant")
    rebuilding = Host(["slow", "quick", b"the state"])
    states = HeldStates(rebuilding, tmp_path / "a", tmp_path / "ev", num_stages=1, stop=threading.Event())
    [path] = states.fetch_files([envelope], [b"\1" * 32], tmp_path / "job-a")
    assert path.read_bytes() == b"the state" and rebuilding.asks == 3
    refusing = Host(["quick", b"never asked"])
    states = HeldStates(refusing, tmp_path / "b", tmp_path / "ev", num_stages=1, stop=threading.Event())
    with pytest.raises(P2PError, match="quick refusal"):
        states.fetch_files([envelope], [b"\1" * 32], tmp_path / "job-b")
    assert refusing.asks == 1
