"""The rerun of a simulated run's contribution as the audit and the spot checks do it, for the engine tests."""

from __future__ import annotations

from training.reexec import verify_contribution


def rerun_checker(sim, records: list, partials: dict):
    """``check(replica, outer_round)``: ``verify_contribution`` of that replica's claim of that round from its
    recorded start state, with what the exchange needs of the round before (the sliced exchange's partials, or
    the full exchange's contributions)."""

    def check(replica: int, outer_round: int):
        record = records[outer_round]
        previous = {"previous_partials": partials.get(outer_round - 1)} if sim.diloco.exchange == "sliced" else {
            "previous_contributions": records[outer_round - 1].contributions if outer_round > 0 else None}
        return verify_contribution([p.to_bytes() for p in record.states[replica].stages], record.claims[replica],
                                   sim.corpus, sim.model, sim.training, sim.diloco, sim.compression,
                                   outer_round=outer_round, replica=replica, run_rounds=sim.rounds, **previous)

    return check
