"""The sampling profile of a node's threads by component (node/live/costprofile.py, issue 75)."""

from __future__ import annotations

import json
import threading
import time

from node.live import costprofile
from node.live.costprofile import IDLE, OTHER, CostProfiler, classify


def test_classify_innermost_component_wins():
    # the codec calling the hashing module: the hashing counts
    stack = [
        ("/repo/training/hashing.py", "sha256_chunks"),
        ("/repo/training/codec/v2.py", "encode"),
        ("/repo/node/live/node.py", "_encode"),
    ]
    assert classify(stack) == "hashing"
    assert classify(stack[1:]) == "codec"
    assert (
        classify([("/venv/web3/manager.py", "request_blocking"), ("/repo/node/live/record/x.py", "f")])
        == "chain"
    )
    assert classify([("/repo/somewhere/else.py", "f")]) == OTHER


def test_classify_waits_and_enclosing_components():
    assert classify([("/usr/lib/python3.11/threading.py", "wait"), ("/repo/training/llama.py", "f")]) == IDLE
    assert classify([("/repo/p2p/host.py", "sleep")]) == IDLE
    assert classify([]) == IDLE
    # a spot check's rerun trains: it is the spot check's time, not the node's inner steps
    rerun = [("/repo/training/llama.py", "forward"), ("/repo/node/live/checks/rerun.py", "rerun")]
    assert classify(rerun) == "spot_checks"
    capture = [
        ("/repo/training/hashing.py", "digest"),
        ("/repo/node/live/worker/contributor.py", "_capture_start_state"),
    ]
    assert classify(capture) == "start_state"


def test_profiler_counts_a_busy_thread_and_writes_its_file(tmp_path):
    stop = threading.Event()

    def busy() -> None:  # a frame of this test file: "other"
        while not stop.is_set():
            sum(range(1000))

    worker = threading.Thread(target=busy, daemon=True)
    worker.start()
    profiler = CostProfiler(tmp_path / costprofile.FILE_NAME, interval=0.01)
    try:
        for _ in range(20):
            profiler.sample()
            time.sleep(0.001)
    finally:
        stop.set()
        worker.join()
    profiler.write()
    document = json.loads((tmp_path / costprofile.FILE_NAME).read_text())
    assert document["samples"] == 20
    assert document["thread_seconds"].get(OTHER, 0) > 0


def test_start_from_env_is_off_by_default(tmp_path, monkeypatch):
    monkeypatch.delenv(costprofile.ENV, raising=False)
    assert costprofile.start_from_env(tmp_path) is None
    monkeypatch.setenv(costprofile.ENV, "1")
    monkeypatch.setenv(costprofile.ENV_INTERVAL, "0.01")
    profiler = costprofile.start_from_env(tmp_path)
    assert profiler is not None
    time.sleep(0.1)
    profiler.close()
    assert json.loads((tmp_path / costprofile.FILE_NAME).read_text())["samples"] >= 1
