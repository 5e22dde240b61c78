"""bench/scale_model.py's split of a node's bytes into the spot checks' start states (taken at the layout's
rate) and the rest (taken as measured per parameter held)."""

from __future__ import annotations

import pytest

from bench.scale_model import DEFAULT_SPOT_CHECKS, check, fit, fit_start_state, large, measured

#: Start-state bytes a check fetches per parameter of the replica in these made-up runs: round 0's (no
#: optimizer moments or snapshots yet), round 1's and any later round's (as measured: 20, 36, 40).
FIRST, SECOND, PER_PARAM = 20.0, 36.0, 40.0


def _run(total: int, checks: list[int], rest_per_param: float, counted: bool = True,
         in_flight: float = 0.0) -> dict:
    """A 2 x 2 run of 3 rounds whose nodes made ``checks`` spot checks of rounds 0, 1, ... in order (round
    0's state FIRST bytes per parameter of the replica, round 1's SECOND, a later one PER_PARAM), and sent
    that back to the others' checks plus ``rest_per_param`` per parameter held (and received as much). The
    first node received ``in_flight`` bytes a round more: a start state it was still fetching when the run
    stopped (not counted as fetched)."""
    fetched = [total * (FIRST * min(c, 1) + SECOND * (c >= 2) + PER_PARAM * max(c - 2, 0)) for c in checks]
    served = sum(fetched) / 3 / len(checks)  # every fetched byte is served by some node
    node = {"periods": 3, "bytes_sent_per_round": served + rest_per_param * total / 2,
            "training_thread": {"inner_s_per_round": 4.0, "wall_s_per_round": 5.0}, "peak_rss_bytes": 1e9,
            "disk": {"total_bytes": 3e8}}
    nodes = [{**node, "spot_checks": {"spot_checks": c},
              "bytes_received_per_round": b / 3 + rest_per_param * total / 2 + (in_flight if i == 0 else 0.0),
              **({"spot_check_state_bytes_per_round": b / 3,
                  "spot_check_state_fetches_per_round": c / 3} if counted else {})}
             for i, (c, b) in enumerate(zip(checks, fetched))]
    return {"nodes": nodes, "args": {"inner_steps": 4, "rounds": 3, "batch_size": 2},
            "parameters": {"total": total, "block_size": 128},
            "summary": {"cpu_s_per_round_by_component": {"spot_checks": 2.0}}}


def test_the_benches_spot_check_traffic_is_taken_out_and_put_back_at_the_layouts_rate():
    total, rest_per_param = 10_000_000, 13.0
    # 2 replicas x 2 stages, 4 checks over 3 rounds: 4 / (2 x 3) checks per replica per round
    rate = 4 / 6
    point = measured(_run(total, [1, 1, 1, 1], rest_per_param, in_flight=5e7))
    assert point["spot_check_rate"] == pytest.approx(rate)
    assert point["spot_check_bytes_per_check"] == pytest.approx(FIRST * total)  # round 0's only
    assert point["start_state_bytes_per_param"] == pytest.approx(FIRST)
    assert point["exchange_bytes_per_round"] == pytest.approx(rest_per_param * total / 2)
    assert point["spot_checks_s_per_rate"] == pytest.approx(2.0 / rate)

    other = measured(_run(2 * total, [3, 2, 2, 1], rest_per_param))  # a second size for the line
    model = {q: fit([point, other], q) for q in ("exchange_bytes_per_round", "spot_checks_s_per_rate")}
    model["start_state"] = fit_start_state([point, other])
    assert model["start_state"]["first"] == pytest.approx(FIRST)
    assert model["start_state"]["second"] == pytest.approx(SECOND)
    assert model["start_state"]["later"] == pytest.approx(PER_PARAM)
    assert fit_start_state([point]) is None  # every node fetched round 0's only: no later round's size
    # the bytes sent at a size are its exchange plus the start states of the checks its draw made
    third = measured(_run(3 * total, [3, 1, 2, 4], rest_per_param))
    assert check(model, third)["bytes_sent_per_round"]["error"] == pytest.approx(0.0, abs=1e-9)
    assert check(model, third)["spot_check_bytes_per_check"]["error"] == pytest.approx(0.0, abs=1e-9)
    layout = {"label": "x", "d_model": 64, "parameters": 4 * total, "replicas": 2, "stages": 2,
              "gpus_per_node": 1, "tokens_per_step": 256, "inner_steps": 10, "link_bps": 1e9}
    ledger = {"gas": {"commitRound_by_quorum": {"1": {"later": 100}, "2": {"later": 150}}}}
    row = large(model, layout, ledger)
    per_node = 2 * total
    assert row["spot_checks"] == DEFAULT_SPOT_CHECKS
    expected = DEFAULT_SPOT_CHECKS * PER_PARAM * per_node
    assert row["spot_check_bytes_per_round"] == pytest.approx(expected)
    assert row["bytes_per_round"] == pytest.approx(expected + rest_per_param * per_node)
    assert row["bytes_per_round"] < row["bytes_per_round_at_bench_rate"]
    heavy = large(model, {**layout, "spot_checks": 1.0}, ledger)
    assert heavy["bytes_per_round"] > row["bytes_per_round"]
    assert heavy["node_work_s_per_round"]["spot_checks"] == pytest.approx(
        row["node_work_s_per_round"]["spot_checks"] / DEFAULT_SPOT_CHECKS)


def test_a_run_whose_nodes_did_not_count_their_checks_bytes_has_no_split():
    point = measured(_run(10_000_000, [1, 1, 1, 1], 13.0, counted=False))
    assert point["spot_check_bytes_per_check"] is None
    assert point["exchange_bytes_per_round"] is None
    assert point["bytes_sent_per_round"] is not None  # what was measured is still there
    # bytes counted but not the checks that fetched them (a check counts when its rerun ends): the split,
    # no bytes per check
    run = _run(10_000_000, [1, 1, 1, 1], 13.0)
    for node in run["nodes"]:
        del node["spot_check_state_fetches_per_round"]
    point = measured(run)
    assert point["exchange_bytes_per_round"] == pytest.approx(13.0 * 10_000_000 / 2)
    assert point["spot_check_bytes_per_check"] is None


def test_the_retained_disk_is_the_windows_nodes_multiple_of_the_stage():
    from bench.scale_model import retained_multiple

    retention = {"ontime": {"keep_all": ["r1"], "summary": {"r0": {"disk_max_over_stage_bytes": 65.2},
                                                            "r1": {"disk_max_over_stage_bytes": 1118.0}}}}
    assert retained_multiple(retention) == 65.2  # the node keeping everything is an archive, not the rule
    assert retained_multiple({}) is None
    layout = {"label": "x", "d_model": 64, "parameters": 4_000_000, "replicas": 2, "stages": 2,
              "gpus_per_node": 1, "tokens_per_step": 256, "inner_steps": 10, "link_bps": 1e9}
    ledger = {"gas": {"commitRound_by_quorum": {"1": {"later": 100}, "2": {"later": 150}}}}
    row = large({}, layout, ledger, retained=65.2)
    assert row["disk_bytes_per_node_retained"] == 65.2 * 4 * 2_000_000
