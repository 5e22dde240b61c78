"""End to end: a chunked run's published stage states, written only when a peer asks (issue 75;
node/live/fraud/stateserve.py), from real ``dlx-node start`` processes on a real anvil.

Two one-node replicas of ``tiny`` train under the defaults (``storage.start_states = "rebuild"``). A peer of
the test's own (a real py-libp2p host) fetches a committed round's state from each node under the alias a
prover uses (``sha256(stage leaf)``, the leaf each node kept for its reward claims): both nodes serve the
same bytes, which are the stage shard of that round (the round's chain-verified checkpoint holds the same
tensors) and whose chunk roots are the leaf's; at least one of them was written only when asked (the node
says so in its log). One node is SIGKILLed and started again: it serves the states of the rounds it finishes
in its new life the same way. A key no node published (another leaf, another stage) is refused at once.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
from node_fixtures import TINY, run_logs
from waiting import wait_until

from ledger.chunkproof import StageLeaf, tree_root
from node.live.fraud.chunkstate import state_key
from node.store.checkpoint import parse_checkpoint
from p2p.errors import BlobNotFound, P2PError
from training.chunks import tensor_leaves

LIMIT = 64 << 20


def _leaf(slot, outer_round: int) -> bytes | None:
    """The stage leaf ``slot``'s node derived for the round (its reward sources, node/store/rewardsources.py).
    """
    path = Path(slot.data_dir) / "rewards" / f"round-{outer_round:08d}-stage-0.json"
    try:
        return bytes.fromhex(json.loads(path.read_text())["leaf"])
    except (OSError, ValueError, KeyError):
        return None


def _last_round(run) -> int:
    last = run.client().last_round(run.run_id)
    return -1 if last is None else last


def _fetch(asker, slot, leaf: bytes) -> bytes:
    return asker.fetch_alias(state_key(leaf), slot.peer_id, LIMIT, timeout=60)


def _check_round(asker, run, outer_round: int) -> bytes:
    """Fetch round ``outer_round``'s published state from both nodes; check it; its bytes."""
    wait_until(lambda: all(_leaf(slot, outer_round) for slot in run.nodes), 120, f"{outer_round}'s leaves")
    leaves = [_leaf(slot, outer_round) for slot in run.nodes]
    assert leaves[0] == leaves[1], (outer_round, leaves)
    served = [_fetch(asker, slot, leaves[0]) for slot in run.nodes]
    assert served[0] == served[1]  # two nodes, one state: the same bytes
    shard = parse_checkpoint(served[0])
    assert shard.round == outer_round and shard.run_id == run.run_id
    leaf = StageLeaf.decode(leaves[0])
    assert tree_root(tensor_leaves(shard.weights)) == leaf.weights_root
    assert tree_root(tensor_leaves(shard.momentum)) == leaf.momentum_root
    checkpoint = run.nodes[1].data_dir / "checkpoints" / f"round-{outer_round:08d}.safetensors"
    if checkpoint.exists():  # the round's full checkpoint (one stage: the same tensors)
        full = parse_checkpoint(checkpoint.read_bytes())
        assert all(full.weights[name].equal(tensor) for name, tensor in shard.weights.items())
        assert all(full.momentum[name].equal(tensor) for name, tensor in shard.momentum.items())
    return served[0]


def _asked_in_log(slot) -> list[str]:
    text = "\n".join(p.read_text(errors="replace") for p in Path(slot.data_dir).glob("node-*.log"))
    return [line for line in text.splitlines() if "published state" in line and "(a peer asked)" in line]


def _wait_round(run, outer_round: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while _last_round(run) < outer_round:
        assert time.monotonic() < deadline, f"round {outer_round} not committed\n" + run_logs(run)
        assert run.running(), "every node exited early:\n" + run_logs(run)
        time.sleep(1.0)


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_published_states_are_written_when_asked_and_a_restarted_node_serves_again(make_run, tmp_path):
    from p2p.config import P2PConfig
    from p2p.host import P2PHost
    from p2p.identity import Identity

    run = make_run(replicas=2, stages=1, split=False,
                   settings=TINY + ["rounds=16", "join_timeout=60", "diloco.inner_steps=40"])
    run.start()
    _wait_round(run, 2, 300)
    config = P2PConfig(bootstrap=[slot.multiaddr for slot in run.nodes], gossip_resync_interval=0)
    asker = P2PHost.start(config, Identity.generate(), data_dir=tmp_path / "asker")
    try:
        wait_until(lambda: all(s.peer_id in asker.peers() for s in run.nodes), 60, "the asker connected")
        # the newest committed rounds (still in the nodes' memory: written only when asked)
        checked = set()
        while not _asked_in_log(run.nodes[0]) or len(checked) < 2:
            newest = _last_round(run)
            assert newest < 10, "no state written when asked\n" + run_logs(run)
            if newest not in checked:
                _check_round(asker, run, newest)
                checked.add(newest)
            time.sleep(1.0)
        for bad in (b"\x00" * 32, b"a leaf of a stage no node holds"):  # never published: refused at once
            with pytest.raises(BlobNotFound):
                asker.fetch_alias(state_key(bad), run.nodes[0].peer_id, LIMIT, timeout=30)

        victim = run.nodes[0]
        run.kill(victim, signal.SIGKILL)
        killed_at = _last_round(run)
        time.sleep(2)
        run.start_node(victim)
        _wait_round(run, killed_at + 3, 420)
        wait_until(lambda: victim.peer_id in asker.peers() or _reconnect(asker, victim), 60, "reconnected")
        _check_round(asker, run, _last_round(run))  # a round of its new life
    finally:
        asker.close()
    assert run.wait(600, progress=True), run_logs(run)
    history = run.client().history(run.run_id)
    assert [c.commit.round for c in history.commits] == list(range(16)) and not history.disputes


def _reconnect(asker, slot) -> bool:
    try:
        asker.connect(slot.multiaddr)
    except (P2PError, OSError, ValueError):
        return False
    return slot.peer_id in asker.peers()
