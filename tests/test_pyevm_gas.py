"""ledger.chain.estimate_gas_from_use, the in-process chain's gas estimate: py-evm's own answer (the least
limit that runs, within 21,000 gas) from 2 runs of the transaction (about 12 in py-evm's search); with a
tolerance too small for the first guess, from the search that follows it."""

from __future__ import annotations

from eth.estimators.gas import binary_gas_search_exact

from ledger.chain import connect_pyevm, estimate_gas_from_use
from tests.ledger_fixtures import deploy


def test_every_estimate_of_a_deployment_a_run_and_a_commit_is_the_least_limit_within_the_tolerance():
    w3 = connect_pyevm()
    chain = w3.provider.ethereum_tester.backend.chain
    seen: list[tuple[int, int, int]] = []

    def checked(state, transaction):
        runs = 0
        apply = state.apply_transaction

        def counted(tx):
            nonlocal runs
            runs += 1
            return apply(tx)

        state.apply_transaction = counted
        ours = estimate_gas_from_use(state, transaction)
        ours_runs = runs
        # A tolerance of 100 gas: the first guess (spent - 1 + 100) fails where a call forwards gas (the
        # 63/64 rule), and the search goes on.
        narrow = estimate_gas_from_use(state, transaction, tolerance=100)
        narrow_runs = runs - ours_runs
        state.apply_transaction = apply
        seen.append((ours, binary_gas_search_exact(state, transaction), ours_runs, narrow, narrow_runs))
        return ours

    chain.gas_estimator = checked
    deployment = deploy(w3)
    run = deployment.member_run((1, 2, 3), quorum=2)
    run.commit()
    assert len(seen) >= 10 and max(exact for _, exact, *_ in seen) > 1_000_000  # the ledger's deployment
    for ours, exact, runs, narrow, narrow_runs in seen:
        assert exact <= ours <= exact + 21_000, (ours, exact)
        assert runs == 2, runs  # no call here forwards over 63 x 21,000 gas: the first guess runs
        assert exact <= narrow <= exact + 100, (narrow, exact)
    assert max(narrow_runs for *_, narrow_runs in seen) > 2  # the search after a failed first guess was run
