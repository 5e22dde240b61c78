"""Nobody's availability challenge blocks another's (issue 79, point 2), on py-evm and on anvil.

The attack: challenge ids omitted the challenger, so the coalition opened the honest walker's next target in a
game of its own first (or copied the walker's pending ``challengeAvailability`` from the mempool with a higher
tip): the walker's step reverted ``ProverChallengeExists``, then ``ProverChallengeTooLate`` once the window
passed, the coalition answered its own copy in the last block, and the wrong round became final with the
walker's game at 0 steps. The id now includes the challenger (``ProverAvailability.challengeAvailability``,
``ledger.proofs.challenge_id``): the copy and the walker's step land in one block, each in its own game, and
the walker's unanswered step overturns the round and pays the walker.
"""

from __future__ import annotations

import pytest

from ledger.availability import WEIGHTS, availability_answer
from ledger.proofs import challenge_id
from tests.chain_backends import fees_since, in_one_block
from tests.fraud_fixtures import changed, commit
from tests.ledger_fixtures import chain_w3, deploy, mine  # noqa: F401 (chain_w3: the py-evm / anvil fixture)
from tests.test_fraud_clock import SHAPES, STAKE, WINDOWS, round_, target  # noqa: F401 (round_: fixture)

SQUATTER = 7  # an outsider with funds: the coalition's account, or a bot copying the mempool
assert SHAPES


def _challenge_call(client, committed, chunk: int):
    return client.prover_address, bytes.fromhex(
        client._prover.encode_abi("challengeAvailability", args=(target(committed, chunk),))[2:])


@pytest.mark.parametrize("squatter_answers", [True, False], ids=["copy-answered", "copy-unanswered"])
def test_a_squatter_copying_the_walkers_step_in_its_block_cannot_stop_the_walk(chain_w3, round_,
                                                                              squatter_answers):
    committed = commit(deploy(chain_w3, min_stake=STAKE), round_, changed(round_.honest, 1, 17), stake=STAKE,
                       **WINDOWS)
    w3, run_id = chain_w3, committed.run_id
    walker, squatter = committed.prover(), committed.deployment.client(SQUATTER)
    coalition = committed.deployment.client(1)
    bond = walker.run_struct(run_id)["bond"]
    start, before = w3.eth.block_number, walker.balance()
    # the squatter's copy first (a higher tip), then the walker's own step, in one block: both land
    block = in_one_block(w3, [(SQUATTER, _challenge_call(squatter, committed, 0), bond),
                              (committed.prover_index, _challenge_call(walker, committed, 0), bond)])
    mine_id = challenge_id(run_id, 1, 0, WEIGHTS, 0, walker.address)
    copy_id = challenge_id(run_id, 1, 0, WEIGHTS, 0, squatter.address)
    assert mine_id != copy_id
    assert walker.challenge_of(mine_id)["challenger"] == walker.address
    assert walker.challenge_of(copy_id)["challenger"] == squatter.address
    assert walker.game_of(run_id, 1, 0)["steps"] == 1  # the walker's clock: its own step only
    deadline = walker.challenge_of(mine_id)["deadline"]
    assert deadline == block + WINDOWS["accusation_blocks"]
    if squatter_answers:  # the coalition answers its own copy in the last block, not the walker's step
        mine(w3, deadline - 2 - w3.eth.block_number)
        coalition.answer_challenge(copy_id, *availability_answer(committed.states[1], WEIGHTS, 0))
        assert walker.challenge_of(mine_id)["settled"] is False
    mine(w3, max(0, deadline - w3.eth.block_number))
    walker.expire_challenge(mine_id)
    assert walker.invalid_from(run_id) == 1
    for index in committed.attesters:
        assert walker.member(run_id, committed.deployment.client(index).address).stake == 0
    gas = fees_since(w3, walker.address, start)
    # its bond back, half the slash
    assert walker.balance() - before + gas == len(committed.attesters) * STAKE // 2
