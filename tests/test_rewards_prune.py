"""A node's kept reward sources pruned once no claim can use them (issue 77; node/store/rewardsources.py
prune_sources, docs/REWARDS.md "Where a contribution's proof comes from"), on py-evm and anvil: a stage's file
once everything it lists is claimed or forfeited, a round's leaves once all its stages went, every file of a
swept round, and nothing of a round still owed or not committed."""

from __future__ import annotations

from ledger.rewards import contribution_share
from node.store.rewardsources import (
    REWARD_SOURCES_DIR,
    prune_sources,
    read_sources,
    write_leaves,
    write_stage,
)
from tests.ledger_fixtures import deploy, mine
from tests.reward_fixtures import INNER_STEPS, STAGES, params, reward_run


def _keep(directory, rr, r: int) -> None:
    """What a node that held every stage and committed round ``r`` keeps of it."""
    entry, folder = rr.rounds[r], directory / REWARD_SOURCES_DIR
    for stage, (leaf, factors) in enumerate(zip(entry.leaves, entry.factors, strict=True)):
        write_stage(folder, r, stage, leaf, factors)
    write_leaves(folder, r, entry.leaves)


def _names(directory) -> set[str]:
    return {path.name for path in (directory / REWARD_SOURCES_DIR).iterdir()}


def test_sources_are_pruned_once_no_claim_can_use_them(chain_w3, tmp_path):
    rr = reward_run(deploy(chain_w3), pool=params())
    rr.commit([[(1, 50), (2, 50)], [(3, 50)]], signers=(1, 2))
    rr.commit([[(1, 50)], [(4, 50), (5, 0)]], signers=(1, 2), label="r1")  # 5 declared no step: pays nothing
    rr.commit([[(2, 50)], [(3, 50)]], signers=(1, 2), label="r2")
    assert contribution_share(rr.params, STAGES, INNER_STEPS, 2, 0) == 0
    folder = REWARD_SOURCES_DIR
    for r in range(3):
        _keep(tmp_path, rr, r)
    (tmp_path / folder / "round-00000009-stage-0.json").write_text("{}")  # a round not committed: kept
    pool, reader = rr.pool(0), rr.run.reader
    assert prune_sources(tmp_path, pool, reader, rr.run_id) == []  # nothing claimed yet
    rr.mine_to_final(2)
    for index, r, stage in ((1, 0, 0), (2, 0, 0), (3, 0, 1), (1, 1, 0)):
        rr.claim(index, r, stage)
    removed = prune_sources(tmp_path, pool, reader, rr.run_id)
    # round 0: every contribution claimed, so its stage files and leaves; round 1: stage 0 (claimed) only,
    # stage 1 still owes member 4 (member 5's share is zero); round 2: nothing claimed
    assert sorted(removed) == ["round-00000000-leaves.json", "round-00000000-stage-0.json",
                               "round-00000000-stage-1.json", "round-00000001-stage-0.json"]
    assert _names(tmp_path) == {"round-00000001-leaves.json", "round-00000001-stage-1.json",
                                "round-00000002-leaves.json", "round-00000002-stage-0.json",
                                "round-00000002-stage-1.json", "round-00000009-stage-0.json"}
    # what is left still proves member 4's claim
    leaves, factors = read_sources([tmp_path], reader, rr.run_id)[1]
    assert leaves == rr.rounds[1].leaves and factors == [None, rr.rounds[1].factors[1]]
    assert prune_sources(tmp_path, pool, reader, rr.run_id) == []  # the same again: nothing more
    # round 1's claim window closes and it is swept: nobody can claim it now, so all of it goes
    opened = pool.round_of(rr.run_id, 1)["openedAt"]
    mine(chain_w3, max(0, opened + rr.params.claim_blocks - chain_w3.eth.block_number))
    pool.sweep(rr.run_id, 1)
    assert sorted(prune_sources(tmp_path, pool, reader, rr.run_id)) == [
        "round-00000001-leaves.json", "round-00000001-stage-1.json"]
    assert _names(tmp_path) == {"round-00000002-leaves.json", "round-00000002-stage-0.json",
                                "round-00000002-stage-1.json", "round-00000009-stage-0.json"}


def test_a_round_before_the_pool_is_pruned_once_no_case_can_read_it(chain_w3, tmp_path):
    """A round before the pool's first pays nothing, but a contribution case of it or of the next round
    reads its files (node/commands/challenge.py): they go only once the next round is final."""
    rr = reward_run(deploy(chain_w3), pool=None)
    rr.commit([[(1, None)], [(2, None)]], signers=(1, 2))
    assert prune_sources(tmp_path, rr.pool(1), rr.run.reader, rr.run_id) == []  # no rewards/ folder
    _keep(tmp_path, rr, 0)
    rr.pool(1).create_pool(rr.run_id, params(), 10 * params().amount_per_round)  # first round 1: 0 unpaid
    assert prune_sources(tmp_path, rr.pool(1), rr.run.reader, rr.run_id) == []  # round 1 not committed yet
    rr.commit([[(1, None)], [(2, None)]], signers=(1, 2), label="r1")
    assert not rr.is_final(1) and prune_sources(tmp_path, rr.pool(1), rr.run.reader, rr.run_id) == []
    rr.mine_to_final(1)
    mine(chain_w3, 1)
    assert len(prune_sources(tmp_path, rr.pool(1), rr.run.reader, rr.run_id)) == 3


def test_a_claimed_round_waits_for_the_next_round_and_every_pool(chain_w3, tmp_path):
    """Round 0 claimed in full: its files stay while round 1 can still be proven wrong (a case of round 1
    reads round 0's), and while a second pool of the run (in another RewardPool contract) still owes it."""
    from ledger.account import dev_account
    from ledger.rewards import RewardPoolClient
    from tests.ledger_fixtures import FAST_RETRY

    rr = reward_run(deploy(chain_w3), pool=params())
    second = RewardPoolClient.deploy(chain_w3, dev_account(0, chain_w3.eth.chain_id), rr.deployment.ledger,
                                     retry=FAST_RETRY)
    other = RewardPoolClient(chain_w3, dev_account(1, chain_w3.eth.chain_id), second, retry=FAST_RETRY)
    other.create_pool(rr.run_id, params(), 10 * params().amount_per_round)
    rr.commit([[(1, 50)], [(2, 50)]], signers=(1, 2))
    _keep(tmp_path, rr, 0)
    rr.mine_to_final(0)
    rr.claim(1, 0, 0)
    rr.claim(2, 0, 1)
    reader = rr.run.reader
    assert prune_sources(tmp_path, rr.pool(0), reader, rr.run_id) == []  # round 1 not committed
    rr.commit([[(1, 50)], [(2, 50)]], signers=(1, 2), label="r1")
    rr.mine_to_final(1)
    mine(chain_w3, 1)
    assert prune_sources(tmp_path, [rr.pool(0), other], reader, rr.run_id) == []  # the second pool owes it
    assert len(_names(tmp_path)) == 3
    assert len(prune_sources(tmp_path, rr.pool(0), reader, rr.run_id)) == 3  # the first pool alone: done
