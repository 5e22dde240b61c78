"""A self-proof costs the coalition its whole stake (issue 79, "self-proof halves the deterrent"), on py-evm
and on anvil.

The attack: the reward of a fraud proof was half the stake it slashed, paid from the slash. A coalition that
committed a wrong round proved it itself at once (its proof committed, then revealed in the window's first
block) and was paid half its own slash: a wrong round cost its attesters half their stake, not all of it.

The rule now (``LedgerDisputes.invalidateByProof``): the slash is burned whole (``slashedTotal`` keeps every
wei of it); the prover is paid min(the run's proof fund, half the stake slashed) from the run's proof fund,
which the creator deposits with ``createRun`` (the node deposits the prover's worst-case gas at ten times
the day's price: ``node.provergas.proof_fund_for``) or anyone tops up (``fundProofs``). No attester's stake
pays a prover. So a self-proving coalition loses its whole stake; it recovers at most the bounty, and the
bounty is its own money when it created the run, someone else's otherwise (and never more than half its
slash, so committing a wrong round to collect a bounty never pays).
"""

from __future__ import annotations

import pytest

from node.provergas import joining_warning
from tests.chain_backends import fees_since
from tests.fraud_fixtures import changed, commit
from tests.ledger_fixtures import chain_w3, deploy  # noqa: F401 (chain_w3: the py-evm / anvil fixture)
from tests.test_fraud_clock import STAKE, WINDOWS, round_  # noqa: F401 (round_: fixture)

COALITION = (1, 2)  # the wrong round's attesters; member 1 created the run
OUTSIDER = 7  # funds the proofs of a run it does not sit in
BOUNTY = STAKE // 10  # a proof fund sized to a prover's gas, far below the stakes


def _ledger_holds(reader, w3, ledger: str, stakes: int) -> None:
    """The ledger holds the stakes, the slashed and forfeited wei (burned) and the proof funds, to the wei."""
    owed = stakes + reader.slashed_total() + reader.forfeited_total() + reader.proof_fund_total()
    assert w3.eth.get_balance(ledger) == owed


@pytest.mark.parametrize("funder", ["creator", "outsider", "nobody"])
def test_a_coalition_proving_its_own_wrong_round_loses_its_whole_stake(chain_w3, round_, funder):
    deployment = deploy(chain_w3, min_stake=STAKE)
    w3 = chain_w3
    wallets = {index: w3.eth.get_balance(deployment.client(index).address) for index in COALITION}
    start = w3.eth.block_number
    committed = commit(deployment, round_, changed(round_.honest, 1, 17), stake=STAKE, prover_index=1,
                       proof_fund=BOUNTY if funder == "creator" else 0, **WINDOWS)
    run_id, coalition = committed.run_id, committed.prover()
    if funder == "outsider":
        deployment.client(OUTSIDER).fund_proofs(run_id, BOUNTY)
    fund = coalition.proof_fund_of(run_id)
    assert fund == (0 if funder == "nobody" else BOUNTY)
    slashed_before = coalition.slashed_total()
    # the coalition proves at once: round 1's window opened with its commit (round 0's is over)
    proof = committed.proof(1)
    coalition.commit_proof(proof)
    receipt = coalition.prove_wrong_aggregation(proof)
    assert coalition.invalid_from(run_id) == 1
    for index in COALITION:
        seat = coalition.member(run_id, deployment.client(index).address)
        assert seat.status == "slashed" and seat.stake == 0
    # the whole slash is burned: slashedTotal keeps both stakes, the reward came out of the fund
    assert coalition.slashed_total() - slashed_before == len(COALITION) * STAKE
    reward = min(fund, len(COALITION) * STAKE // 2)
    assert coalition.proof_fund_of(run_id) == fund - reward
    events = [coalition.ledger_events.decode(log) for log in receipt["logs"]]
    assert [e.args["reward"] for e in events if e is not None and e.name == "ProverRewarded"] == [reward]
    # the coalition's wallets over the whole episode: both stakes (and the registry's, held) gone; the gas
    # paid; the fund its creator deposited comes back as the bounty, an outsider's is a gain of the bounty
    gas = sum(fees_since(w3, deployment.client(index).address, start) for index in COALITION)
    change = sum(w3.eth.get_balance(deployment.client(index).address) - wallets[index] for index in COALITION)
    registry_stakes = len(COALITION) * deployment.min_stake
    net = change + gas + registry_stakes
    deposited = BOUNTY if funder == "creator" else 0
    assert net == -len(COALITION) * STAKE - deposited + reward
    if funder != "outsider":  # its own money or none: the self-proof nets the coalition -100% of its stake
        assert net == -len(COALITION) * STAKE
    held = sum(coalition.member(run_id, deployment.client(index).address).stake for index in range(1, 4))
    assert held == STAKE  # the honest member's
    _ledger_holds(coalition, w3, deployment.ledger, held)


def test_an_unfunded_run_warns_the_joiner_that_its_proofs_pay_nothing(chain_w3, round_):
    """The node's side: a contributor about to take a seat in a chunked run whose proof fund cannot pay a
    proof's gas is warned (a member would be the one to prove)."""
    deployment = deploy(chain_w3, min_stake=STAKE)
    committed = commit(deployment, round_, round_.honest, stake=STAKE, proof_fund=0, **WINDOWS)
    reader = committed.prover()
    info = reader.run_info(committed.run_id)
    warning = joining_warning(info, chain_w3, reader.proof_fund_of(committed.run_id))
    assert "proof fund" in warning, warning
    reader.fund_proofs(committed.run_id, 10 * STAKE)
    assert joining_warning(info, chain_w3, reader.proof_fund_of(committed.run_id)) == ""
