"""The rerun of a simulated run's contribution as the audit and the spot checks do it, for the engine
tests."""

from __future__ import annotations

from training.fingerprint import EXACT, MISMATCH
from training.reexec import check_state_chain, verify_contribution


def rerun_checker(sim, records: list, partials: dict):
    """``check(replica, outer_round)``: ``verify_contribution`` of that replica's claim of that round from its
    recorded start state, with what the exchange needs of the round before (the sliced exchange's partials, or
    the full exchange's contributions)."""

    def check(replica: int, outer_round: int):
        record = records[outer_round]
        previous = {"previous_partials": partials.get(outer_round - 1)} if sim.diloco.exchange == "sliced" \
            else {
            "previous_contributions": records[outer_round - 1].contributions if outer_round > 0 else None}
        return verify_contribution([p.to_bytes() for p in record.states[replica].stages],
                                   record.claims[replica], sim.corpus, sim.model, sim.training, sim.diloco,
                                   sim.compression, outer_round=outer_round, replica=replica,
                                   run_rounds=sim.rounds, **previous)

    return check


def assert_honest_exact_and_cheat_caught(check, records: list, honest: int, cheat: int, rounds: int) -> None:
    """Every round of the honest replica reruns bit-exactly, its round-1 rerun's next state is the one its
    round-2 claim starts from, and the cheat's round-1 contribution is a mismatch."""
    for outer_round in range(rounds):
        result = check(honest, outer_round)
        assert result.verdict == EXACT, result.reason
        assert set(result.distances.values()) == {0.0}
    chained = check(honest, 1).next_state_hashes
    assert check_state_chain(chained, [c.state_hash for c in records[2].claims[honest]]) == EXACT
    assert check(cheat, 1).verdict == MISMATCH
