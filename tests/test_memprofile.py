"""The memory probe beside the cost profile (node/live/memprofile.py, issue 75)."""

from __future__ import annotations

import json
import threading

from node.live import memprofile
from node.live.costprofile import IDLE, CostProfiler
from node.live.memprofile import MemoryProbe, repo_frames


def test_repo_frames_keeps_this_repositorys_innermost_frames_only():
    stack = [("/x/site-packages/torch/functional.py", "mm"),
             ("/r/training/codec_exact.py", "reconstruct_lowrank"),
             ("/r/training/codec_wire.py", "_decode_entry"), ("/usr/lib/python3.11/threading.py", "run"),
             ("/r/node/live/round/prefetch.py", "run")]
    assert repo_frames(stack, keep=2) == ["training/codec_exact.py:reconstruct_lowrank",
                                          "training/codec_wire.py:_decode_entry"]
    assert repo_frames(stack) == ["training/codec_exact.py:reconstruct_lowrank",
                                  "training/codec_wire.py:_decode_entry", "node/live/round/prefetch.py:run"]
    assert repo_frames([("/usr/lib/python3.11/queue.py", "get")]) == []


def test_the_probe_names_the_busy_threads_at_the_peak_and_where_the_resident_set_grew(tmp_path, monkeypatch):
    sizes = iter([100 << 20, 300 << 20, 200 << 20])
    monkeypatch.setattr(memprofile, "resident_bytes", lambda: next(sizes))
    probe = MemoryProbe(tmp_path / memprofile.FILE_NAME)
    me = threading.get_ident()
    busy = [(me, "codec", [("/r/training/codec_exact.py", "reconstruct_lowrank")]),
            (me + 1, IDLE, [("/usr/lib/python3.11/threading.py", "wait")])]
    for _ in range(3):
        probe.observe(busy, IDLE)
    probe.write()
    document = json.loads((tmp_path / memprofile.FILE_NAME).read_text())
    assert document["peak"]["rss"] == 300 << 20
    frames = [b["frames"] for b in document["peak"]["busy"]]
    assert frames == [["training/codec_exact.py:reconstruct_lowrank"]]
    assert document["peak"]["busy"][0]["thread"] == threading.current_thread().name
    assert document["growth_by_site_bytes"] == {"training/codec_exact.py:reconstruct_lowrank": 200 << 20}
    assert document["max_rss_while_component_bytes"] == {"codec": 300 << 20}


def test_the_cost_profile_feeds_the_probe_only_when_it_has_one(tmp_path):
    probe = MemoryProbe(tmp_path / memprofile.FILE_NAME)
    profiler = CostProfiler(tmp_path / "cost_profile.json", interval=0.01, memory=probe)
    profiler.sample()
    profiler.write()
    assert json.loads((tmp_path / memprofile.FILE_NAME).read_text())["peak"]["rss"] > 0
    CostProfiler(tmp_path / "other.json", interval=0.01).sample()  # no probe: nothing else to do


def test_the_probe_is_off_unless_asked(tmp_path, monkeypatch):
    monkeypatch.delenv(memprofile.ENV, raising=False)
    assert memprofile.probe_from_env(tmp_path) is None
    monkeypatch.setenv(memprofile.ENV, "1")
    assert isinstance(memprofile.probe_from_env(tmp_path), MemoryProbe)
