"""bench/scale_model.py's split of a node's bytes into the spot checks' start states (taken at the layout's
rate) and the rest (taken as measured per parameter held)."""

from __future__ import annotations

import pytest

from bench.scale_model import DEFAULT_SPOT_CHECKS, START_STATE_BYTES_PER_PARAM, fit, large, measured


def _run(total: int, checks: list[int], sent: float) -> dict:
    node = {"periods": 3, "spot_checks": {"spot_checks": 0}, "bytes_sent_per_round": sent,
            "training_thread": {"inner_s_per_round": 4.0, "wall_s_per_round": 5.0}, "peak_rss_bytes": 1e9,
            "disk": {"total_bytes": 3e8}}
    nodes = [{**node, "spot_checks": {"spot_checks": c}} for c in checks]
    return {"nodes": nodes, "args": {"inner_steps": 4, "rounds": 3, "batch_size": 2},
            "parameters": {"total": total, "block_size": 128},
            "summary": {"cpu_s_per_round_by_component": {"spot_checks": 2.0}}}


def test_the_benches_spot_check_traffic_is_taken_out_and_put_back_at_the_layouts_rate():
    total, rest_per_param = 10_000_000, 13.0
    # 2 replicas x 2 stages, 4 checks over 3 rounds: 4 / (2 x 3) checks per replica per round
    rate = 4 / 6
    sent = rate * START_STATE_BYTES_PER_PARAM * total / 2 + rest_per_param * total / 2
    point = measured(_run(total, [1, 1, 1, 1], sent))
    assert point["spot_check_rate"] == pytest.approx(rate)
    assert point["exchange_bytes_per_round"] == pytest.approx(rest_per_param * total / 2)
    assert point["spot_checks_s_per_rate"] == pytest.approx(2.0 / rate)

    other = measured(_run(2 * total, [2, 2, 1, 1], 2 * sent))  # a second size for the line
    model = {q: fit([point, other], q) for q in ("exchange_bytes_per_round", "bytes_sent_per_round",
                                                 "spot_checks_s_per_rate")}
    layout = {"label": "x", "d_model": 64, "parameters": 4 * total, "replicas": 2, "stages": 2,
              "gpus_per_node": 1, "tokens_per_step": 256, "inner_steps": 10, "link_bps": 1e9}
    ledger = {"gas": {"commitRound_by_quorum": {"1": {"later": 100}, "2": {"later": 150}}}}
    row = large(model, layout, ledger)
    per_node = 2 * total
    assert row["spot_checks"] == DEFAULT_SPOT_CHECKS
    expected = DEFAULT_SPOT_CHECKS * START_STATE_BYTES_PER_PARAM * per_node
    assert row["spot_check_bytes_per_round"] == pytest.approx(expected)
    assert row["bytes_per_round"] < row["bytes_per_round_at_bench_rate"]
    heavy = large(model, {**layout, "spot_checks": 1.0}, ledger)
    assert heavy["bytes_per_round"] > row["bytes_per_round"]
    assert heavy["node_work_s_per_round"]["spot_checks"] == pytest.approx(
        row["node_work_s_per_round"]["spot_checks"] / DEFAULT_SPOT_CHECKS)


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
