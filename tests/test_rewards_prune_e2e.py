"""The running node prunes its own reward sources (issue 77; node/live/record/rewardprune.py), end to end:
real node processes on anvil in a normed run with a reward pool.

Each node keeps its rounds' stage leaves and factors in ``<data_dir>/rewards/`` so its contributions can be
claimed once final. The promise (node.store.rewardsources.prune_sources): a round's files go once every
contribution they list is claimed (or forfeited, or worth nothing) and the next round is final (no
contribution case of the round can be opened any more); a round still owed a claim keeps its files, and they
still prove the claim. Here the rounds go final while the nodes train (the chain mined past the proof
windows), the test claims every contribution of round 0 and none of round 1, and each node's committer,
between rounds, removes round 0's files and keeps round 1's; a member then claims round 1 with the real
command from its node directory.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from node_fixtures import TINY, node_log, run_logs, stopped_cleanly, wait_for

from ledger.account import dev_account
from ledger.rewards import RewardPoolClient
from ledger.rewardstatement import claim_call, statement
from node.store.rewardsources import REWARD_SOURCES_DIR, read_sources
from tests.ledger_fixtures import mine

ROUNDS = 400  # far more than the test needs (a tiny round takes seconds): the nodes are stopped when done
WINDOW_BLOCKS = 8  # accusation and dispute blocks: the proof windows close a few mined blocks after a commit


def _files(slot, round_: int) -> list[str]:
    """The reward source files ``slot``'s node keeps of ``round_``."""
    return sorted(p.name for p in (slot.data_dir / REWARD_SOURCES_DIR).glob(f"round-{round_:08d}-*.json"))


def _mine_until_final(client, run_id: int, round_: int, run) -> None:
    """Mine a window at a time until ``round_`` (and so every earlier round) is final."""
    for _ in range(64):
        if client.is_final(run_id, round_):
            return
        mine(client.w3, WINDOW_BLOCKS)
    raise AssertionError(f"round {round_} not final after mining\n" + run_logs(run))


def _claim_contributions(run, client, round_: int) -> int:
    """Claim every listed contribution of ``round_`` by its member, from the node directories' kept sources,
    straight through the pool (not ``dlx-node rewards --claim``, which prunes its directory itself); how
    many were paid."""
    sources = read_sources([s.data_dir for s in run.nodes], client, run.run_id)
    assert round_ in sources and all(f is not None for f in sources[round_][1]), sources.keys()
    paid = 0
    for slot in run.nodes:
        pool = RewardPoolClient(client.w3, dev_account(slot.account, run.chain_id), run.reward_pool)
        for credit in statement(pool, client, run.run_id, pool.account_address, sources).credits:
            if credit.round == round_ and credit.stage is not None:
                assert credit.state == "claimable", credit
                name, args = claim_call(client, run.run_id, credit, sources)
                pool.sender.transact(pool.contract, name, args, name)
                assert pool.claimed_of(run.run_id, round_, credit.stage, pool.account_address)
                paid += 1
    return paid


# e2e. It once failed on an idle machine (rounds of ~1.5 s ran to 266 in 420 s, round 0 never pruned): the
# committer made its pass only when no round waited, and a committer running one round behind its training
# never was idle; it now makes the passes its handled rounds earn (node/live/record/rewardprune.PassSchedule)
@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_running_nodes_prune_claimed_rounds_and_keep_what_a_claim_still_needs(make_run):
    run = make_run(replicas=2, stages=1, split=False, pool_per_round_wei=10**15,
                   accusation_blocks=WINDOW_BLOCKS, dispute_blocks=WINDOW_BLOCKS,
                   settings=TINY + [f"rounds={ROUNDS}", "join_timeout=60"])
    assert run.reward_pool
    client = run.client()
    run.start()
    wait_for(lambda: (client.last_round(run.run_id) or -1) >= 1, 420, "rounds 0 and 1 committed", run,
             none_exits=True)
    assert all(_files(slot, 0) and _files(slot, 1) for slot in run.nodes), run_logs(run)
    _mine_until_final(client, run.run_id, 1, run)
    # every contribution round 0 lists is claimed (both replicas'); round 1's none
    assert _claim_contributions(run, client, 0) == len(run.nodes)
    kept_1 = {slot.name: _files(slot, 1) for slot in run.nodes}
    # the nodes' committers prune between rounds: round 0's files go, round 1 (owed its claims) keeps its own
    wait_for(lambda: not any(_files(slot, 0) for slot in run.nodes), 420, "round 0's files pruned", run,
             none_exits=True)
    assert {slot.name: _files(slot, 1) for slot in run.nodes} == kept_1
    # ... each node's own pruner did it (node/live/record/rewardprune.py logs what it removed)
    for slot in run.nodes:
        pruned = [line for line in node_log(slot).splitlines() if "no claim or case can use any more" in line]
        assert any("round-00000000-stage-0.json" in line for line in pruned), (slot.name, pruned)
    # round 1's kept files still prove its claim: a member claims it with the command, from its own directory
    member = run.nodes[0]
    done = subprocess.run([sys.executable, "-m", "node.cli", "rewards", "--config", str(member.config_path),
                           "--pool", run.reward_pool, "--claim", "--yes"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    shown = subprocess.run([sys.executable, "-m", "node.cli", "rewards", "--config", str(member.config_path),
                            "--pool", run.reward_pool, "--json"],
                           capture_output=True, text=True, timeout=300, check=True)
    credits = json.loads(shown.stdout)["credits"]
    assert any(c["round"] == 1 and c["stage"] == 0 and c["state"] == "claimed" for c in credits), credits
    assert len(run.running()) == len(run.nodes), "a node exited:\n" + run_logs(run)
    _, rounds = stopped_cleanly(run, client)  # every node exits 0 on its stop, the record in order
    assert len(rounds) >= 3, rounds
