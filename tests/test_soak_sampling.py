"""bench/soak_sampling.py's growth figures from a soak's samples and its nodes' probe files (no run needed)."""

from __future__ import annotations

import json

from bench.soak_sampling import memory_growth, object_growth

RUN_S = 3600.0
STARTED = 1000.0


def _samples(restart_at: float | None = None) -> list[dict]:
    out = []
    for at in range(0, int(RUN_S) + 1, 60):
        pid = 8 if restart_at is not None and at >= restart_at else 7
        out.append({"at_s": float(at), "nodes": {"n1": {"pid": pid, "rss_mib": 400 + at / 600}}})
    return out


def _deep(path, walks: list[tuple[float, dict]]) -> None:
    with open(path, "w") as out:
        for at, containers in walks:
            out.write(json.dumps({"time": STARTED + at, "pass_s": 1.5, "types": {"dict": 100 + int(at)},
                                  "instances": {"p2p.X": 1}, "containers": containers}) + "\n")


def test_object_growth_names_what_grew_from_the_quarter_to_the_end(tmp_path):
    _deep(tmp_path / "deep-7.jsonl", [(300, {"p2p.X.seen": 50}), (900, {"p2p.X.seen": 10, "p2p.X.gone": 5}),
                                      (2100, {"p2p.X.seen": 20}), (3600, {"p2p.X.seen": 40, "p2p.X.gone": 1})])
    with open(tmp_path / "deep-7.jsonl", "a") as out:
        out.write('{"time": 4000, "types": {"dic')  # a walk cut off by the node's kill: skipped
    samples = _samples()
    growth = memory_growth(samples, RUN_S)
    assert growth["n1"]["rss_mib"]["quarter_to_end"] == 4.5
    found = object_growth(samples, growth, tmp_path, STARTED, RUN_S)
    # From the first walk past the quarter (900 s) to the last: the walk before the quarter is warm-up.
    assert found == {"n1": {"span_s": 2700, "pass_s": 1.5, "types": {"dict": 2700}, "instances": {},
                            "containers": {"p2p.X.seen": 30}}}


def test_object_growth_skips_a_node_with_another_life_or_no_walks(tmp_path):
    samples = _samples(restart_at=2000)
    assert memory_growth(samples, RUN_S) == {}  # restarted past the quarter: two lives, no growth figure
    assert object_growth(samples, ["n1"], tmp_path, STARTED, RUN_S) == {}  # no deep-8.jsonl
    assert object_growth(_samples(), ["n1"], None, STARTED, RUN_S) == {}  # the soak ran --no-probe
