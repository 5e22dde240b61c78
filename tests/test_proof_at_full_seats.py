"""The proof's gas bound holds at a run's largest quorum (issue 79, point 4), on py-evm and on anvil.

A proof slashes every attester of the wrong round, so its gas grows with the attesters; the bound that
createRun checks (``LedgerCore.proofCost``) counted 32 of them. With ~1,234 staked seats a commit still fit a
30M block (~17.3M gas) while the proof of that round did not (~30M): a coalition that filled the run's seats
and signed a wrong round with all of them made it unprovable. A run now holds at most ``maxSeats()`` = 256
active members (``joinRun``: ``LedgerRunFull``), and a round's attesters are members active at its commit.

The adversary fills every seat, signs a wrong round with all 256, and tries a 257th seat; the honest prover's
chunk proof of that round lands, and its gas is measured against the same proof at 2 attesters: each further
attester costs at most ``PROOF_GAS_PER_ATTESTER``, so the worst proof at 256 attesters is at most
``proof_gas_bound`` (10M + 7.2M), well inside a 30M block.
"""

from __future__ import annotations

import pytest

from ledger import errors
from ledger.runparams import (DEFAULT_MAX_CONTRIBUTIONS, DEFAULT_MAX_RANK, MAX_SEATS, PROOF_GAS_PER_ATTESTER,
                              PROOF_MAX_GAS, PROOF_SEATS_GAS, proof_gas_bound)
from tests.chain_backends import chain
from tests.fraud_fixtures import _register, changed, commit, fill_seats
from tests.ledger_fixtures import chain_w3, deploy  # noqa: F401 (chain_w3: the py-evm / anvil fixture)
from tests.test_fraud_clock import WINDOWS, round_  # noqa: F401 (round_: fixture)

STAKE = 10**17  # 256 seats of it, and a registry stake each, from a dev account's funds
BLOCK_GAS = 30_000_000
CHUNK = 1  # round 1 changed one element of chunk 1
#: Filling 256 seats takes ~12 s on anvil and minutes on py-evm (a 2-core machine under load): py-evm's
#: cases run under ``slow``, anvil's full-seat seat test by default.
PYEVM_SLOW = [pytest.param("pyevm", marks=pytest.mark.slow), "anvil"]


def _proof_gas(committed) -> int:
    prover = committed.prover()
    proof = committed.proof(CHUNK)
    prover.commit_proof(proof)
    receipt = prover.prove_wrong_aggregation(proof)
    assert prover.invalid_from(committed.run_id) == 1
    return receipt["gasUsed"]


def test_the_contract_and_the_node_agree_on_the_seat_cap(chain_w3):
    reader = deploy(chain_w3).client(0)
    assert reader.ledger_contract.functions.maxSeats().call() == MAX_SEATS
    assert PROOF_SEATS_GAS == (MAX_SEATS - 32) * PROOF_GAS_PER_ATTESTER
    # the worst proof a createRun may allow, at the largest quorum, leaves most of a block free
    assert proof_gas_bound(DEFAULT_MAX_CONTRIBUTIONS, DEFAULT_MAX_RANK) <= PROOF_MAX_GAS + PROOF_SEATS_GAS
    assert PROOF_MAX_GAS + PROOF_SEATS_GAS <= 0.6 * BLOCK_GAS


@pytest.mark.slow
@pytest.mark.parametrize("backend", PYEVM_SLOW)
def test_a_wrong_round_signed_by_every_seat_is_proven_inside_a_block(request, backend, round_):
    chain_w3 = chain(request, backend)
    wrong = changed(round_.honest, CHUNK, 17)
    small = commit(deploy(chain_w3, min_stake=STAKE), round_, wrong, stake=STAKE, **WINDOWS)
    base = _proof_gas(small)  # the same proof at 2 attesters

    deployment = deploy(chain_w3, min_stake=STAKE)
    seats = tuple(range(1, MAX_SEATS + 1))
    full = commit(deployment, round_, wrong, stake=STAKE, seats=MAX_SEATS, signers=seats, **WINDOWS)
    reader = full.prover()
    run = reader.run_struct(full.run_id)
    assert run["memberCount"] == MAX_SEATS
    # the adversary's 257th seat is refused; the prover (dev account 6) is a member already
    late = MAX_SEATS + 1
    _register(deployment, (late,), STAKE)
    with pytest.raises(errors.LedgerRunFull) as refused:
        deployment.client(late).join_run(full.run_id, stake=STAKE)
    assert refused.value.values == {"runId": full.run_id, "seats": MAX_SEATS}

    gas = _proof_gas(full)
    for index in (1, 2, 128, MAX_SEATS):
        assert reader.member(full.run_id, deployment.client(index).address).status == "slashed"
    per_attester = (gas - base) / (MAX_SEATS - 2)
    assert 0 < per_attester <= PROOF_GAS_PER_ATTESTER, (gas, base, per_attester)
    assert gas <= BLOCK_GAS // 2, gas
    print(f"proof gas: {base:,} at 2 attesters, {gas:,} at {MAX_SEATS} ({per_attester:,.0f} per attester)")


@pytest.mark.parametrize("backend", PYEVM_SLOW)
def test_a_seat_frees_when_a_member_leaves(request, backend):
    """The cap is MAX_SEATS active members, checked at each join; a leaver (unbonding) no longer holds a
    seat. The run is filled to the cap from a run of 3 founders."""
    chain_w3 = chain(request, backend)
    deployment = deploy(chain_w3)
    run = deployment.member_run((1, 2, 3), quorum=2)
    extra = tuple(range(4, MAX_SEATS + 1))
    _register(deployment, extra + (MAX_SEATS + 1, MAX_SEATS + 2), 0)
    fill_seats(deployment, run.run_id, extra, 0)
    late = deployment.client(MAX_SEATS + 1)
    with pytest.raises(errors.LedgerRunFull):
        late.join_run(run.run_id)
    deployment.client(3).leave_run(run.run_id)
    late.join_run(run.run_id)
    assert late.run_struct(run.run_id)["memberCount"] == MAX_SEATS
    with pytest.raises(errors.LedgerRunFull):  # full again
        deployment.client(MAX_SEATS + 2).join_run(run.run_id)


def test_the_nodes_reward_check_counts_the_attesters_beyond_the_proofs_32():
    """node/provergas.py: a quorum above the 32 attesters the proof's bound counts adds their slashes to the
    prover's gas, and each attester's half stake must pay its own slash at the spiked price."""
    from ledger.runparams import PROOF_BASE_ATTESTERS, RunParams
    from node.provergas import ProverCost, prover_cost

    params = RunParams(config_hash=b"\1" * 32, num_stages=1, inner_steps=1, min_stake=10**18, quorum=40)
    base = prover_cost(RunParams(config_hash=b"\1" * 32, num_stages=1, inner_steps=1, min_stake=10**18,
                                 quorum=PROOF_BASE_ATTESTERS), 10**9)
    cost = prover_cost(params, 10**9)
    assert cost.proof_gas - base.proof_gas == 8 * PROOF_GAS_PER_ATTESTER
    # a stake whose half does not pay one attester's slash at the spiked price: never covered, whatever k
    price = 10**12
    stake = 2 * PROOF_GAS_PER_ATTESTER * 10 * price - 2
    tiny = ProverCost(steps=1, proof_gas=0, price=price, quorum=10_000, stake=stake, bond=0)
    assert tiny.reward >= tiny.cost and not tiny.covered
    assert tiny.stake_needed >= 2 * tiny.seat_cost
