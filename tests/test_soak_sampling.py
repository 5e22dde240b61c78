"""bench/soak_sampling.py's growth figures from a soak's samples and its nodes' probe files (no run
needed)."""

from __future__ import annotations

import importlib.util
import json
import threading
import time
from pathlib import Path

from bench.soak_sampling import memory_growth, object_growth

RUN_S = 3600.0
STARTED = 1000.0


def _probe():
    """The probe module itself, under another name (a sitecustomize may be imported already); it starts
    nothing without DLX_CHURN_PROBE in the environment."""
    spec = importlib.util.spec_from_file_location(
        "churn_probe_light", Path(__file__).resolve().parents[1] / "bench" / "churn_probe"
        / "sitecustomize.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    return probe


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
                                      (2100, {"p2p.X.seen": 20}),
                                      (3600, {"p2p.X.seen": 40, "p2p.X.gone": 1})])
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


def test_probe_figures_read_the_light_probes_heap_parts(tmp_path):
    from bench.soak_sampling import probe_figures

    release = threading.Event()
    waiting = threading.Thread(target=release.wait)  # a thread's stack, mapped and touched
    waiting.start()
    try:
        line = _probe()._light_sample()
    finally:
        release.set()
        waiting.join()
    # This process's own figures: pymalloc has arenas, and the anonymous pages by mapping add up to RssAnon.
    assert line["pymalloc"]["arenas"] >= 1 and line["pymalloc"]["allocated_bytes"] > 0
    mappings = line["mappings"]
    parts = sum(mappings[key] for key in ("brk", "arenas", "stacks", "other", "files"))
    assert abs(parts - line["rss_anon_kib"]) <= 0.05 * line["rss_anon_kib"]
    # The rest split by mapping size: the waiting thread's stack, pymalloc's arenas, the other chunks.
    assert mappings["other"] == mappings["other_stacks"] + mappings["other_pymalloc"] + mappings[
        "other_chunks"]
    assert mappings["other_stacks"] > 0 and mappings["other_pymalloc"] > 0
    assert all(size >= kib for size, kib in mappings["other_top"]) and len(mappings["other_top"]) <= 6
    path = tmp_path / "light-7.jsonl"
    # the last line cut off by a kill
    path.write_text(json.dumps(line) + "\n" + '{"time": 1, "malloc": {"in_u')
    figures = probe_figures(path)
    assert figures["py_arenas_mib"] == line["pymalloc"]["arenas"]
    assert figures["anon_brk_mib"] == round(line["mappings"]["brk"] / 1024, 1)
    assert {"anon_arenas_mib", "anon_other_mib", "anon_other_stacks_mib", "anon_other_chunks_mib",
            "malloc_in_use_mib", "py_blocks", "malloc_mmapped_mib"} <= set(figures)
    # glibc's arenas one by one (malloc_info), main first: together they are what mallinfo2 sums.
    arenas = line["malloc"]["arenas"]
    assert arenas and all(a["in_use"] > 0 and a["free"] >= 0 for a in arenas)
    assert abs(sum(a["in_use"] for a in arenas) - line["malloc"]["in_use"]) <= 0.05 * line["malloc"]["in_use"]
    assert figures["malloc_main_in_use_mib"] == round(arenas[0]["in_use"] / 1048576, 1)
    assert figures["malloc_others_in_use_mib"] == round(sum(a["in_use"] for a in arenas[1:]) / 1048576, 1)
    # a probe without them (not CPython, no /proc)
    path.write_text('{"time": 1, "pymalloc": {}, "mappings": {}}\n')
    assert "py_arenas_mib" not in probe_figures(path) and "anon_brk_mib" not in probe_figures(path)


def test_the_object_walk_leaves_a_tuple_being_built_alone():
    """The walk holds every object while it runs; a thread that resumed in the middle and resized the tuple
    it was building from a generator got a SystemError (once in the hour's soak; 78 in 30 walks here before
    the walk kept the GIL for its whole pass)."""
    probe = _probe()
    errors: list[BaseException] = []
    stop = threading.Event()

    def items():
        for i in range(200):
            if i % 20 == 0:
                time.sleep(0)  # lets the GIL go mid-build, as a formatter that reads a socket would
            yield i

    def build():
        while not stop.is_set():
            try:
                tuple(items())
            except SystemError as exc:
                errors.append(exc)

    builders = [threading.Thread(target=build, daemon=True) for _ in range(3)]
    for thread in builders:
        thread.start()
    try:
        for _ in range(8):
            assert probe._sample("walk")["types"]["tuple"] > 0
    finally:
        stop.set()
        for thread in builders:
            thread.join(timeout=30)
    assert errors == []
