"""The host-wide admission of spot-check reruns by memory (node/live/checks/admission.py): real processes
holding reservations across the host-wide lock, the host's memory as /proc/meminfo says it (or, where a
test needs a host of a given size, a meminfo reader of its own: the one boundary replaced), and the rerun
worker ending a child that keeps a large heap."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from node.errors import NodeError
from node.live.checks import spotcheck
from node.live.checks.admission import (DIRECTORY_ENV, RERUN_BYTES_PER_STATE_BYTE, HostMemoryBusy,
                                        RerunAdmission, read_meminfo, rerun_need, resident_bytes)
from node.live.checks.spotcheck import RerunWorker, SpotCheckJob

GIB = 1 << 30
ROOT = Path(__file__).resolve().parents[1]


def _host(total: int, available: int):
    return lambda: (total, available)


def _holder(directory: Path, need: int, child: str = "none") -> subprocess.Popen:
    """Another node's process on this host: admits a rerun of ``need`` bytes, says so, holds it until its
    stdin closes (or it is killed)."""
    code = (
        "import os, sys\n"
        "from node.live.checks.admission import RerunAdmission\n"
        f"r = RerunAdmission(meminfo=lambda: ({64 * GIB}, {64 * GIB})).admit({need}, 5)\n"
        f"r.set_child(os.getpid() if {child!r} == 'self' else None)\n"
        "print('admitted', flush=True)\n"
        "sys.stdin.read()\n"
        "r.release()\n"
    )
    env = {**os.environ, DIRECTORY_ENV: str(directory), "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "admitted"
    return proc


def test_read_meminfo_reads_this_host_and_refuses_a_file_that_does_not_say(tmp_path):
    total, available = read_meminfo()
    assert 0 < available <= total
    bad = tmp_path / "meminfo"
    for text in ("", "MemTotal: 100 kB\n", "MemTotal: 100 kB\nMemAvailable: lots kB\n",
                 "MemTotal: 100 MB\nMemAvailable: 50 MB\n"):
        bad.write_text(text)
        with pytest.raises(NodeError):
            read_meminfo(bad)


def test_need_grows_with_the_state():
    assert rerun_need(0) > 0
    assert rerun_need(GIB) - rerun_need(0) == int(RERUN_BYTES_PER_STATE_BYTE * GIB)
    assert 1.5 <= RERUN_BYTES_PER_STATE_BYTE <= 2  # measured 1.6 (bench/results/stage_memory.json)


def test_another_process_reservation_holds_a_rerun_back_until_it_ends(tmp_path):
    admission = RerunAdmission(tmp_path / "adm", meminfo=_host(16 * GIB, 4 * GIB), poll_s=0.05)
    holder = _holder(tmp_path / "adm", 3 * GIB)
    try:
        with pytest.raises(HostMemoryBusy, match=r"3\.00 GiB reserved by other reruns"):
            admission.admit(2 * GIB, timeout=0.3)
        small = admission.admit(GIB // 2, timeout=0.3)  # what is left beside the reservation is admitted
        small.release()
        holder.stdin.close()  # the other rerun ends: its reservation goes with it
        assert holder.wait(timeout=30) == 0
        admission.admit(2 * GIB, timeout=5).release()
    finally:
        holder.kill()


def test_a_killed_holders_reservation_is_dropped_by_the_next_reader(tmp_path):
    admission = RerunAdmission(tmp_path / "adm", meminfo=_host(16 * GIB, 4 * GIB), poll_s=0.05)
    holder = _holder(tmp_path / "adm", 3 * GIB)
    holder.kill()
    holder.wait(timeout=30)
    reservation = admission.admit(3 * GIB, timeout=5)
    assert [p.name for p in (tmp_path / "adm").glob("*.json")] == [reservation.path.name]
    reservation.release()


def test_a_child_resident_memory_counts_as_taken(tmp_path):
    directory = tmp_path / "adm"
    holder = _holder(directory, 2 * GIB, child="self")
    try:
        rss = resident_bytes(holder.pid)
        assert rss is not None and rss > 0
        admission = RerunAdmission(directory, meminfo=_host(16 * GIB, 4 * GIB))
        reserved = admission.reserved()
        assert 2 * GIB - rss - (64 << 20) <= reserved < 2 * GIB
    finally:
        holder.kill()


def test_a_need_above_the_host_is_refused_at_once_and_a_stop_ends_the_wait(tmp_path):
    admission = RerunAdmission(tmp_path / "adm", meminfo=_host(8 * GIB, 4 * GIB), poll_s=0.05)
    started = time.monotonic()
    with pytest.raises(HostMemoryBusy, match="8.0 GiB in all"):
        admission.admit(9 * GIB, timeout=600)
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    with pytest.raises(HostMemoryBusy):
        admission.admit(5 * GIB, timeout=600, stop=stop)
    assert time.monotonic() - started < 60  # neither waited out its 600 s


def test_a_directory_of_another_user_is_refused(tmp_path):
    if os.getuid() == 0:  # root gives a directory of its own to another user
        directory = tmp_path / "adm"
        directory.mkdir()
        os.chown(directory, 65534, 65534)
    else:  # any other user meets one that exists already: root's
        directory = Path("/")
    with pytest.raises(NodeError, match="belongs to another user"):
        RerunAdmission(directory, meminfo=_host(8 * GIB, 4 * GIB)).admit(GIB, timeout=1)


def test_the_worker_ends_a_child_that_keeps_a_large_heap(tmp_path, monkeypatch):
    """With the limit at 0 bytes every child is "large": each job runs in a new child, the verdicts
    unchanged."""
    from test_spotchecks import _honest_job

    cfg, state, claims = _honest_job(tmp_path)
    job = tmp_path / "job"
    SpotCheckJob(cfg.to_dict(), 0, 0, claims, [p.to_bytes() for p in state.stages]).write(job)
    worker = RerunWorker(tmp_path / "worker.log")
    pids = []
    try:
        assert worker.run(job, timeout=300, on_start=pids.append).verdict == "exact"
        monkeypatch.setattr(spotcheck, "RETIRE_RSS_BYTES", 0)
        (job / "result.json").unlink()
        assert worker.run(job, timeout=300, on_start=pids.append).verdict == "exact"
        assert pids[1] == pids[0]  # it ran in the child the first job left (small then): kept
        assert resident_bytes(pids[1]) is None  # "large" now: ended after its job
        (job / "result.json").unlink()
        assert worker.run(job, timeout=300, on_start=pids.append).verdict == "exact"
        assert pids[2] != pids[1]
    finally:
        worker.close()
