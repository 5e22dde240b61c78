"""A running node prunes its kept reward sources where its run has a pool (issue 77;
node/live/record/rewardprune.py, ledger/poolfind.py), on py-evm and anvil: the run's pools found from the
chain's PoolCreated events (an impostor emitting one, and a RewardPool of another ledger, refused), a pass
bounded to a few rounds going round-robin, through the node's own NodeChain and lock, nothing changed
without a pool, and a committer with a round always waiting still going round its kept rounds."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from ledger.account import dev_account
from ledger.events import EventDecoder
from ledger.poolfind import PoolFinder
from ledger.rewards import RewardPoolClient
from ledger.tx import TransactionSender
from node.live.chain.onchain import NodeChain
from node.live.record.rewardprune import PassSchedule, RewardSourcePruner
from node.store.rewardsources import REWARD_SOURCES_DIR, write_leaves, write_stage
from tests.ledger_fixtures import FAST_RETRY, deploy, mine
from tests.reward_fixtures import params, reward_run

import contracts


def _keep(directory, rr, r: int) -> None:
    entry, folder = rr.rounds[r], directory / REWARD_SOURCES_DIR
    for stage, (leaf, factors) in enumerate(zip(entry.leaves, entry.factors, strict=True)):
        write_stage(folder, r, stage, leaf, factors)
    write_leaves(folder, r, entry.leaves)


def _emits_pool_created(run_id: int) -> str:
    """Init code that emits RewardPool's PoolCreated topic with ``run_id`` and deploys no code."""
    topic = EventDecoder(contracts.artifact("RewardPool")["abi"]).topic("PoolCreated")
    return "0x7f" + run_id.to_bytes(32, "big").hex() + "7f" + topic.removeprefix("0x") + "60006000a200"


def _node_pruner(rr, directory, rounds_a_pass: int = 4) -> RewardSourcePruner:
    """The pruner a node of the run builds (RewardSourcePruner.for_node) over a NodeChain of member 1."""
    chain = NodeChain(rr.deployment.client(1))
    normed = SimpleNamespace(proves_factors=True)
    cfg = SimpleNamespace(commitment_scheme=normed, path=lambda p: directory / p)
    pruner = RewardSourcePruner.for_node(cfg, chain, rr.run_id)
    assert pruner.lock is chain.rpc_lock
    pruner.rounds_a_pass = rounds_a_pass
    return pruner


def test_the_runs_pools_are_found_from_the_chain_and_impostors_refused(chain_w3):
    rr = reward_run(deploy(chain_w3), pool=None)
    client = rr.deployment.client(1)
    finder = PoolFinder(chain_w3, rr.deployment.ledger, rr.run_id, 0, 3, client.sender.rpc)
    assert finder.scan() == []  # a RewardPool without a pool of the run: no PoolCreated
    sender = TransactionSender(chain_w3, dev_account(0, chain_w3.eth.chain_id), retry=FAST_RETRY)
    receipt = sender.send({"value": 0, "data": _emits_pool_created(rr.run_id)}, "impostor")
    impostor = receipt["contractAddress"]
    other_ledger = deploy(chain_w3).ledger  # a genuine RewardPool, but of another ledger
    foreign = RewardPoolClient.deploy(chain_w3, dev_account(0, chain_w3.eth.chain_id), other_ledger,
                                      retry=FAST_RETRY)
    rr.pool(1).create_pool(rr.run_id, params(), 10 * params().amount_per_round)
    mine(chain_w3, 7)  # the scan goes 3 blocks a request
    assert finder.scan() == [rr.pool_address]
    assert "no code" in finder.refused[chain_w3.to_checksum_address(impostor)]
    assert finder.problem(foreign) == f"it pays from ledger {other_ledger}, not {rr.deployment.ledger}"
    head = chain_w3.eth.block_number
    assert finder.scanned_to == head and finder.scan() == [rr.pool_address]  # nothing scanned twice


def test_a_node_prunes_its_sources_in_bounded_passes_where_the_run_has_a_pool(chain_w3, tmp_path):
    rr = reward_run(deploy(chain_w3), pool=None)
    for r in range(3):
        rr.commit([[(1, 50)], [(2, 50)]], signers=(1, 2), label=f"r{r}")
        _keep(tmp_path, rr, r)
    rr.mine_to_final(2)
    pruner = _node_pruner(rr, tmp_path, rounds_a_pass=1)
    names = sorted(p.name for p in (tmp_path / REWARD_SOURCES_DIR).iterdir())
    assert pruner.after_round() == [] and pruner.after_round() == []  # no pool: nothing changes
    assert sorted(p.name for p in (tmp_path / REWARD_SOURCES_DIR).iterdir()) == names
    rr.pool(1).create_pool(rr.run_id, params(), 10 * params().amount_per_round)  # its first round: 3
    rr.commit([[(1, 50)], [(2, 50)]], signers=(1, 2), label="r3")
    _keep(tmp_path, rr, 3)
    rr.mine_to_final(3)
    mine(chain_w3, 1)
    # rounds 0-2 are before the pool (pay nothing; round 3 final, so no case reads them): one round a pass
    passes = [pruner.after_round() for _ in range(4)]
    assert [len(removed) for removed in passes] == [3, 3, 3, 0], passes
    assert {name[:14] for removed in passes for name in removed} == {f"round-0000000{r}" for r in range(3)}
    assert pruner.kept_rounds() == [3] and pruner.removed == 9
    # round 3: both members claim it, but a case of round 4 would read its files: kept until round 4 is final
    rr.claim(1, 3, 0)
    rr.claim(2, 3, 1)
    assert pruner.after_round() == []  # round 4 not committed: a case of it would read round 3's files
    assert pruner.kept_rounds() == [3]
    rr.commit([[(1, 50)], [(2, 50)]], signers=(1, 2), label="r4")  # this node kept nothing of round 4
    rr.mine_to_final(4)
    mine(chain_w3, 1)
    assert len(pruner.after_round()) == 3 and pruner.kept_rounds() == []


def test_a_node_pass_survives_a_chain_that_fails(chain_w3, tmp_path, caplog):
    """A chain error skips the pass (logged) and keeps the files."""
    rr = reward_run(deploy(chain_w3), pool=params())
    rr.commit([[(1, 50)], [(2, 50)]], signers=(1, 2))
    _keep(tmp_path, rr, 0)
    pruner = _node_pruner(rr, tmp_path)

    class Down:
        def __getattr__(self, name):
            from ledger.errors import ChainUnavailable

            raise ChainUnavailable("the RPC is down")

    pruner.reader = Down()
    assert pruner.after_round() == [] and pruner.kept_rounds() == [0]
    assert "not pruned this round" in caplog.text
    assert isinstance(pruner.lock, type(threading.Lock()))


def test_the_passes_a_committer_owes_are_made_with_a_round_always_waiting():
    """PassSchedule: a pass as soon as no round waits, else one every ``waits_at_most`` rounds handled,
    looking at what they earned (the committer passed only when idle: one a round behind made none)."""
    schedule = PassSchedule(waits_at_most=3)
    assert [schedule.handled(idle=False) for _ in range(7)] == [0, 0, 3, 0, 0, 3, 0]
    assert schedule.handled(idle=True) == 2 and schedule.handled(idle=True) == 1


def test_a_busy_committer_still_prunes_a_claimed_round_while_the_kept_rounds_grow(chain_w3, tmp_path):
    """The committer's passes with a round always waiting, as tests/test_rewards_prune_e2e.py's nodes ran on
    an idle machine (1.5 s rounds): the kept rounds grow one a round (nothing else is claimed), the
    round-robin goes round them anyway, and round 0, claimed once round 1 is final, goes."""
    rr = reward_run(deploy(chain_w3), pool=params())
    schedule, pruner, gone_at = PassSchedule(waits_at_most=2), None, None
    for r in range(12):
        rr.commit([[(1, 50)], [(2, 50)]], signers=(1, 2), label=f"r{r}")
        _keep(tmp_path, rr, r)
        if r == 4:  # the pass at round 3 wrapped round to round 1: round 0 is claimed behind the cursor
            rr.mine_to_final(1)
            rr.claim(1, 0, 0)
            rr.claim(2, 0, 1)
        if owed := schedule.handled(idle=False):
            pruner = pruner or _node_pruner(rr, tmp_path, rounds_a_pass=2)
            removed = pruner.after_round(owed)
            if any(name.startswith("round-00000000-") for name in removed):
                gone_at = r
    # a pass every 2 rounds over 4 kept rounds: [0, 1], [2, 3, 0, 1], [2, 3, 4, 5], [6, 7, 0, 1]
    assert gone_at == 7 and 0 not in pruner.kept_rounds(), (gone_at, pruner.kept_rounds())
    assert pruner.kept_rounds() == list(range(1, 12)) and pruner.removed == 3, pruner.kept_rounds()
