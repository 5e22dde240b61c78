"""``dlx-node demo`` and ``start`` stop cleanly on SIGTERM and SIGINT: real processes, no leftovers.

Each demo test runs the demo as a subprocess, records the processes it started (its descendants in /proc,
with their start times so a reused PID is never mistaken for ours), signals the demo alone and checks
that it exits in bounded time with the documented code and that none of those processes is left.
(Not tested yet, because it fails: a restart after a stop that caught rounds finished but not committed
does not resume; issue 15 item 4's report has the logs.)
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ledger.chain import connect_rpc
from ledger.anvil import AnvilProcess
from ledger.client import LedgerClient
from ledger.errors import ChainUnavailable

DEMO = [sys.executable, "-m", "node.cli", "demo", "--preset", "tiny", "--inner-steps", "4",
        "--checkpoint-every", "1", "--replicas", "2", "--stages", "1"]
#: Bound on the demo's own orderly stop: nodes 20 s, then anvil 10 s, with room for a loaded machine.
STOP_BOUND = 90


def _proc_start(pid: int) -> tuple[str, str] | None:
    """(state, start time in clock ticks) of a process, None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return fields[0], fields[19]


def _descendants(pid: int) -> dict[int, str]:
    """Every live descendant of ``pid``: {pid: start time}."""
    found: dict[int, str] = {}
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                info = _proc_start(child)
                if info is not None and child not in found:
                    found[child] = info[1]
                    todo.append(child)
    return found


def _still_running(processes: dict[int, str]) -> list[int]:
    left = []
    for pid, started in processes.items():
        info = _proc_start(pid)
        if info is not None and info[1] == started and info[0] != "Z":
            left.append(pid)
    return left


def _wait_for(what: str, condition, timeout: float, proc: subprocess.Popen, log: Path):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert proc.poll() is None, \
            f"demo exited ({proc.returncode}) before {what}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout}s:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


def _start_demo(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, Path, Path]:
    out = tmp_path / "demo"
    log = tmp_path / "demo.out"
    with open(log, "wb") as sink:
        proc = subprocess.Popen([*DEMO, "--out", str(out), *extra], stdout=sink, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
    return proc, out, log


def _cleanup(proc: subprocess.Popen, started: dict[int, str]) -> None:
    """Kill only what this test started and what is still running (after a failed assertion)."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)
    for pid in _still_running(started):
        os.kill(pid, signal.SIGKILL)


def _node_dirs(out: Path) -> list[Path]:
    return sorted(p.parent for p in out.glob("*/node.toml"))


def _check_node_files(out: Path) -> list[dict]:
    """Every node's state.json and status.json parse; the status says it stopped."""
    states = []
    for node in _node_dirs(out):
        status = json.loads((node / "status.json").read_text())
        assert status["state"] == "stopped", (node, status)
        if (node / "state.json").exists():
            states.append(json.loads((node / "state.json").read_text()))
    return states


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_demo_keep_stops_its_chain_on_sigterm(tmp_path):
    proc, out, log = _start_demo(tmp_path, "--rounds", "2", "--keep", "--timeout", "300")
    started: dict[int, str] = {}
    try:
        _wait_for("keep message", lambda: "the chain stays up" in log.read_text(), 360, proc, log)
        anvil_pid = int(re.search(r"chain: anvil \(pid (\d+)\)", log.read_text()).group(1))
        started = _descendants(proc.pid)
        assert anvil_pid in started, (anvil_pid, started)
        assert os.getpgid(anvil_pid) != os.getpgid(proc.pid)  # a terminal's Ctrl-C goes to the demo only
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=STOP_BOUND) == 0, log.read_text()[-3000:]
        print(f"demo --keep: SIGTERM to exit {time.monotonic() - t0:.1f}s")
        assert _still_running(started) == []
        states = _check_node_files(out)
        assert len(states) == 2 and all(s["last_finished"] == 1 for s in states)
        json.loads((out / "chain-state.json").read_text())  # anvil dumped its chain on the way out
        assert len(json.loads((out / "summary.json").read_text())["rounds"]) == 2
    finally:
        _cleanup(proc, started)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_demo_stopped_mid_run_by_sigint_leaves_nothing(tmp_path):
    proc, out, log = _start_demo(tmp_path, "--rounds", "3", "--timeout", "400")
    started: dict[int, str] = {}
    try:
        def committed_round_zero():
            nodes = _node_dirs(out)
            statuses = []
            for node in nodes:
                try:
                    statuses.append(json.loads((node / "status.json").read_text()))
                except (OSError, ValueError):
                    return False
            return len(statuses) == 2 and any(s.get("last_commit", -1) >= 0 for s in statuses)

        _wait_for("a committed round", committed_round_zero, 360, proc, log)
        started = _descendants(proc.pid)
        assert len(started) >= 3, started  # anvil and two nodes
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=STOP_BOUND) == 130, log.read_text()[-3000:]
        print(f"demo mid-run: SIGINT to exit {time.monotonic() - t0:.1f}s")
        assert "stopping the nodes, then the chain" in log.read_text()
        assert _still_running(started) == []
        _check_node_files(out)
        rpc_url = json.loads((out / "deployment.json").read_text())["rpc_url"]
        with pytest.raises(ChainUnavailable):  # the chain went down with the demo
            connect_rpc(rpc_url)
        json.loads((out / "chain-state.json").read_text())
    finally:
        _cleanup(proc, started)


def _start_node(config: Path, log: Path, *overrides: str) -> subprocess.Popen:
    sets = [arg for o in overrides for arg in ("--set", o)]
    with open(log, "ab") as sink:
        return subprocess.Popen([sys.executable, "-m", "node.cli", "start", "--no-progress", "--yes",
                                 "--config", str(config), *sets], stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _one_life(slot, log: Path, overrides: tuple[str, ...], sig: int, before: int) -> float:
    """Start the node, wait for a commit past ``before``, signal it; it and its children stop. Seconds to
    exit."""
    node = _start_node(slot.config_path, log, *overrides)
    started: dict[int, str] = {}
    try:
        def committed_past_before():
            status = slot.status()
            return status.get("pid") == node.pid and status.get("last_commit", -1) > before

        _wait_for(f"a commit after round {before}", committed_past_before, 300, node, log)
        started = _descendants(node.pid)
        assert started, "the node's anvil is not its child"
        t0 = time.monotonic()
        node.send_signal(sig)
        assert node.wait(timeout=STOP_BOUND) == 0, log.read_text()[-3000:]
        seconds = time.monotonic() - t0
        assert _still_running(started) == []
        assert slot.status()["state"] == "stopped"
        assert json.loads((slot.data_dir / "state.json").read_text())["last_finished"] > before
        return seconds
    finally:
        _cleanup(node, started)


@pytest.mark.timeout(300)
def test_start_owning_its_anvil_stops_it_on_sigterm(tmp_path):
    """A node with ledger.backend='anvil' stops its own chain on SIGTERM; the chain's state survives."""
    from node.commands.launcher import LocalRun

    run = LocalRun(tmp_path / "run", replicas=1, stages=1, split=False, attest_quorum=1,
                   allow_weak_quorum=True, settings=["model.preset=tiny", "diloco.inner_steps=4",
                                                     "training.batch_size=4", "rounds=0",
                             "round_timeout=60", "checkpoint_every=1"])
    run.setup()
    # dumps the deployed contracts and the run to chain-state.json; the node now owns the chain
    run.anvil.stop()
    run.anvil = None
    slot = run.nodes[0]
    chain_state = run.workdir / "chain-state.json"
    own_chain = ("ledger.backend=anvil", f"ledger.anvil_state_file={chain_state}")
    seconds = _one_life(slot, slot.data_dir / "node.log", own_chain, signal.SIGTERM, -1)
    print(f"start with its own anvil: SIGTERM to exit {seconds:.1f}s")
    with AnvilProcess(state_file=chain_state) as anvil:
        client = LedgerClient(connect_rpc(anvil.url, wait=10), None, run.registry, run.ledger)
        rounds = [c.commit.round for c in client.history(run.run_id).commits]
    assert rounds and rounds == list(range(len(rounds))), rounds


@pytest.mark.timeout(120)
def test_a_launcher_killed_outright_takes_its_children_with_it(tmp_path):
    """SIGKILL cannot be handled; the children (anvil here, nodes likewise) get SIGTERM from the kernel."""
    script = ("import sys, time; from ledger.anvil import AnvilProcess; a = AnvilProcess(); a.start(); "
              "print(a.url, flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    started: dict[int, str] = {}
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("http"), url
        started = _descendants(proc.pid)
        assert started, "anvil is not the launcher's child"
        connect_rpc(url)
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 60
        while _still_running(started) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _still_running(started) == []
    finally:
        _cleanup(proc, started)


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler installed for ``sig`` (its SigCgt mask in /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next(int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(mask & (1 << (sig - 1)))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_start_stopped_while_it_loads_exits_0_without_joining(tmp_path, sig):
    """A signal during start-up (torch, libp2p and web3 still loading) stops ``start`` cleanly, exit 0.

    The signal is sent the moment the process catches SIGTERM, which is now the first line of the
    command, seconds before the heavy imports are done; before, the handler came only with the
    node, and a launcher stopping a node that had just been started saw it die of the signal (-15).
    """
    init = subprocess.run([sys.executable, "-m", "node.cli", "init", "--data-dir", str(tmp_path / "n"),
                           "--dev-account", "1"], capture_output=True, text=True, timeout=240)
    assert init.returncode == 0, init.stderr
    log = tmp_path / "start.log"
    node = _start_node(tmp_path / "n" / "node.toml", log)
    try:
        deadline = time.monotonic() + 240
        while not _catches(node.pid, signal.SIGTERM):
            assert node.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "start never installed its SIGTERM handler"
            time.sleep(0.002)
        node.send_signal(sig)
        assert node.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()
    text = log.read_text()
    assert "stopped during start-up" in text and "Traceback" not in text, text[-3000:]
    assert not (tmp_path / "n" / "state.json").exists()  # nothing of a run was started
