"""Issue 77's adversaries against the reward pool, on py-evm and a real anvil (docs/REWARDS.md, "What a
dropping coalition earns", "What junk-contribution sybils earn"): a coalition quorum that delays an honest
member's contribution to a later round, or re-signs it as its own, and an operator that splits its stake into
many seats. Each test states what the adversary earns, measured by the pool's RewardClaimed amounts."""

from __future__ import annotations

import pytest

from ledger import errors
from ledger.rewards import attester_share, contribution_share
from tests.ledger_fixtures import deploy
from tests.reward_fixtures import AMOUNT, INNER_STEPS, MAX_CONTRIBUTIONS, STAGES, params, reward_run
from tests.test_rewards import assert_books, paid_to

SLOT = contribution_share(params(), STAGES, INNER_STEPS, MAX_CONTRIBUTIONS, None)


def test_delaying_an_honest_contribution_earns_the_coalition_nothing(chain_w3):
    """Coalition 1, 2 leaves honest 3's round-1 contribution out and lists 3 again only in round 2: the
    coalition earns one slot a round either way; 3 loses its round-1 slot (back to the pool at the sweep), and
    3's round-1 signature cannot be replayed in round 2 (the claim signs its round)."""
    rr = reward_run(deploy(chain_w3), pool=params())
    rr.commit([[(1, None), (2, None), (3, None)], []], signers=(1, 2, 3))
    rr.commit([[(1, None), (2, None)], []], signers=(1, 2), label="delayed")
    rr.commit([[(1, None), (2, None), (3, None)], []], signers=(1, 2), label="late")
    rr.mine_to_final(2)
    for r in (0, 1, 2):
        for index in (1, 2):
            assert paid_to(rr.w3, rr.claim(index, r, 0), rr.address(index)) == SLOT  # never more
    assert paid_to(rr.w3, rr.claim(3, 2, 0), rr.address(3)) == SLOT
    stale = rr.factors(1, 0, [(1, None), (2, None), (3, None)])  # 3's round-1 signature ...
    late = rr.rounds[2]
    with pytest.raises((errors.RewardNotListed, errors.RewardBadStage, errors.RewardBadRecord)):
        rr.pool(3).claim_contribution(late.record, late.leaves, 0, stale, 2)  # ... under round 2's leaf
    assert rr.pool(0).round_of(rr.run_id, 1)["paid"] == 2 * SLOT
    assert_books(rr)


def test_re_signing_an_honest_contribution_as_ones_own_pays_one_slot_at_most(chain_w3):
    """Coalition member 1 lists honest 3's work twice over as its own (its own account and signature on each
    entry): it is paid one slot of the stage, as with one contribution, and the second entry is refused as
    claimed; an entry naming 3 but signed by 1 pays nobody."""
    rr = reward_run(deploy(chain_w3), pool=params())
    rr.commit([[(1, None), (1, None), (2, None)], [(1, None), (3, None)]], signers=(1, 2),
              signer_of={3: 1})
    rr.mine_to_final(0)
    assert paid_to(rr.w3, rr.claim(1, 0, 0, position=0), rr.address(1)) == SLOT
    with pytest.raises(errors.RewardAlreadyClaimed):
        rr.claim(1, 0, 0, position=1)
    with pytest.raises(errors.RewardNotListed):
        rr.claim(3, 0, 1)  # 3's entry signed by 1: not 3's signature
    with pytest.raises(errors.RewardNotListed):
        rr.claim(3, 0, 1, as_index=1)  # nor can 1 take it: the entry names 3
    assert paid_to(rr.w3, rr.claim(1, 0, 1), rr.address(1)) == SLOT  # its own entry of stage 1
    assert rr.pool(0).round_of(rr.run_id, 0)["paid"] == 2 * SLOT
    assert_books(rr)


def test_splitting_a_stake_into_many_seats_pays_per_listed_share_never_past_the_budgets(chain_w3):
    """One operator's four seats (members 5-8, each staking the run's minimum) against one seat (member 1):
    pay does not follow stake; each seat earns one slot per listed contribution and one attester share per
    listed signature, so the four earn four times one seat's only while four contributions and signatures are
    listed, and together never more than the stage's contributor budget and the attesters' budget."""
    rr = reward_run(deploy(chain_w3, min_stake=10**15), members=(1, 5, 6, 7, 8), pool=params(),
                    min_stake=10**15)
    rr.commit([[(5, None), (6, None), (7, None), (8, None)], [(1, None)]], signers=(5, 6, 7, 8))
    rr.mine_to_final(0)
    seat_share = attester_share(rr.params, 4)
    earned = 0
    for index in (5, 6, 7, 8):
        earned += paid_to(rr.w3, rr.claim(index, 0, 0), rr.address(index))
        earned += paid_to(rr.w3, rr.claim_attestation(index, 0), rr.address(index))
    alone = paid_to(rr.w3, rr.claim(1, 0, 1), rr.address(1))
    assert alone == SLOT and earned == 4 * SLOT + 4 * seat_share
    contributors = AMOUNT * (10_000 - rr.params.attester_bps) // 10_000 // STAGES
    assert 4 * SLOT <= contributors and 4 * seat_share <= AMOUNT * rr.params.attester_bps // 10_000
    assert_books(rr)
