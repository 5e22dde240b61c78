"""The reward pool's actors in the trust fuzzer (tests/trust_pool.py, issue 77), step by step on py-evm:
funders, claimers (owners, others in their place, again after being paid), a sweeper, the re-entrant token and
the re-entrant receiver act on the machine's run and R1-R5 hold after each move; the coalition's claims of its
captured run, once its lied round is overturned and its attesters convicted, are all refused."""

from __future__ import annotations

import logging
import random

import pytest

from tests.trust_machine import TrustMachine
from tests.trust_params import COALITION, HONEST
from tests.trust_pool import FUNDERS, PoolMoves


class _Seeded:
    """A stand-in for hypothesis' ``data``: a seeded choice of a sampled_from's elements, an integer range's
    values or a boolean."""

    def __init__(self, seed: int) -> None:
        self.random = random.Random(seed)

    def draw(self, strategy):
        inner = getattr(strategy, "wrapped_strategy", strategy)
        elements = getattr(inner, "elements", None)
        if isinstance(elements, (list, tuple)):
            return self.random.choice(elements)
        if hasattr(inner, "start") and hasattr(inner, "end"):
            return self.random.randint(inner.start, inner.end)
        return self.random.choice([False, True])


def _counts() -> dict:
    return {name: getattr(PoolMoves, name) for name in ("pool_claims_paid", "pool_claims_refused",
                                                        "pool_reentries_refused", "pool_funds",
                                                        "pool_convicted_refused")}


@pytest.mark.timeout(900)
def test_the_pool_actors_keep_r1_to_r5_on_the_machines_run():
    logging.getLogger("node").setLevel(logging.CRITICAL)
    machine = TrustMachine()
    machine.deploy_run(pools=True)
    for _ in range(3):
        assert machine.commit(HONEST[0], machine.honest_record(), list(HONEST) + list(COALITION))
    before = _counts()
    data = _Seeded(7)
    machine.token_reenters("fund")  # R5: refused by the lock
    machine.the_model_holds()
    for step in range(8):
        if step % 4 == 3:
            machine.funder_funds(data, 10**15, FUNDERS[step % 2])
        else:
            machine.member_claims(data)
        machine.the_model_holds()
    after = _counts()
    assert after["pool_claims_paid"] > before["pool_claims_paid"]
    assert after["pool_claims_refused"] > before["pool_claims_refused"]
    assert after["pool_reentries_refused"] > before["pool_reentries_refused"]
    assert after["pool_funds"] > before["pool_funds"]


@pytest.mark.slow  # a whole walk first (a minute or two under load)
@pytest.mark.timeout(900)
def test_the_coalition_claims_nothing_of_its_overturned_run():
    logging.getLogger("node").setLevel(logging.CRITICAL)
    machine = TrustMachine()
    machine.deploy_run(pools=True)
    machine.coalition_commits_a_lied_sum(("chunk", 1, 5, 1), ["truthful"] * 12)
    case = machine.lied_rounds[-1]
    # round 1 overturned, its attesters slashed
    assert machine.client(HONEST[0]).invalid_from(case.run_id) == 1
    before = _counts()
    data = _Seeded(3)
    for _ in range(6):
        machine.coalition_claims_its_captured_round(data)
        machine.the_model_holds()
    after = _counts()
    assert after["pool_claims_paid"] == before["pool_claims_paid"]
    assert after["pool_convicted_refused"] > before["pool_convicted_refused"]


@pytest.mark.timeout(900)
def test_the_steered_claims_pay_once_final_and_refuse_before_and_after_a_conviction():
    """The moves that draw paying claims (bench/fuzz_pool_mutations.py --machine trust weighs them up): a
    member's own claim once its round is final pays; a claim of the newest round at once is refused as not
    final; a coalition attester that equivocated is slashed and its claim of the round refused as
    convicted."""
    logging.getLogger("node").setLevel(logging.CRITICAL)
    machine = TrustMachine()
    machine.deploy_run(pools=True)
    assert machine.commit(HONEST[0], machine.honest_record(), list(HONEST) + list(COALITION))
    before = _counts()
    data = _Seeded(11)
    machine.member_claims_once_final(data)
    machine.the_model_holds()
    assert _counts()["pool_claims_paid"] == before["pool_claims_paid"] + 1
    assert machine.commit(HONEST[0], machine.honest_record(), list(HONEST) + list(COALITION))
    refused = PoolMoves.pool_claims_refused
    machine.member_claims_at_once(data)  # round 1, just committed
    machine.the_model_holds()
    assert PoolMoves.pool_claims_refused == refused + 1
    convicted = PoolMoves.pool_convicted_refused
    machine.coalition_attester_equivocates_and_claims(data)
    machine.the_model_holds()
    assert PoolMoves.pool_convicted_refused == convicted + 1
    assert any(machine.status(i) == "slashed" for i in COALITION)
