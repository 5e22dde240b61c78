"""A node's disk fills mid-run and is freed again: real anvil, real node processes, a real tmpfs.

The second node's whole data directory (archive, checkpoints, blobs, state.json, signed-message log)
is a tmpfs of 64 MiB (tests/tinyfs.py; its log file is a link out of it, so what it says about
the full disk can be read). Once the run has committed a round the test fills that tmpfs, waits for
the node to say that its disk is full and what it paused, deletes the filler and checks that the
node never exited, caught up, and that every round was committed once and in order (issue 45: a
full disk crashed a node of the hour-long soak).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys

import pytest
from node_fixtures import KEEP_ALL, TINY, assert_chain_roots, node_log, node_state, run_logs, wait_for
from tinyfs import fill, tiny_filesystem


def _recorded(slot) -> set[int]:
    try:
        return {int(r) for r in node_state(slot).get("weights_roots", {})}
    except (OSError, ValueError):
        return set()


@pytest.mark.timeout(600)
def test_a_node_whose_disk_fills_pauses_then_catches_up_and_every_round_commits_once(make_run, tmp_path):
    run = make_run(replicas=2, stages=2, split=False,
                   settings=TINY + KEEP_ALL + ["rounds=0", "join_timeout=60"])
    slot = run.nodes[1]
    kept = tmp_path / "r1-setup"
    shutil.copytree(slot.data_dir, kept)  # what setup wrote (identity key, node.toml), hidden by the mount
    logs = tmp_path / "r1-logs"
    logs.mkdir()
    with tiny_filesystem(slot.data_dir, "64m"):
        shutil.copytree(kept, slot.data_dir, dirs_exist_ok=True)
        (slot.data_dir / "node-1.log").symlink_to(logs / "node-1.log")
        run.start()
        client = run.client()
        wait_for(lambda: (client.last_round(run.run_id) or -1) >= 1 and 1 in _recorded(slot), 240,
                 "round 1 committed and recorded by the node on the small disk", run, none_exits=True)

        filler = fill(slot.data_dir)
        full_from = client.last_round(run.run_id)
        # Some write the node needs (the archive, every round) is paused, not only a status file skipped.
        wait_for(lambda: " paused; tried again " in node_log(slot), 240, "the node pauses a write for space",
                 run, none_exits=True)
        filler.unlink()  # the operator frees space

        target = full_from + 2  # two rounds past the full disk: caught up, not only resumed
        # every node, not only the one whose disk was full: stopped right after the chain commits, the
        # other node may be one poll behind (CI saw r0 without the last round's root)
        wait_for(lambda: client.last_round(run.run_id) >= target
                 and all(set(range(target + 1)) <= _recorded(s) for s in run.nodes), 300,
                 f"rounds through {target} committed and recorded by every node", run,
                 none_exits=True)
        # stopped as an operator does; a loaded machine may take a while (no SIGKILL at 20 s)
        for s in run.nodes:
            s.process.send_signal(signal.SIGTERM)
        codes = [s.process.wait(timeout=240) for s in run.nodes]
        usage = subprocess.run(["du", "-ak", str(slot.data_dir)], capture_output=True, text=True).stdout
        assert codes == [0, 0], run_logs(run) + usage

        history = client.history(run.run_id)
        rounds = [c.commit.round for c in history.commits]
        assert rounds == list(range(len(rounds))), rounds  # in order, none twice, none skipped
        assert_chain_roots(run, history.commits[:target + 1])
        log = node_log(slot)
        assert "chain step crashed" not in log and "Traceback" not in log, log[-5000:]
        full = [line for line in log.splitlines() if " is full " in line]
        assert full and all(f"disk of {slot.data_dir}" in line for line in full), full
        assert "has space again" in log, log[-5000:]

        audit = subprocess.run(
            [sys.executable, "-m", "node.cli", "audit", "--rpc", run.url, "--run", str(run.run_id),
             "--deployment", str(run.workdir / "deployment.json"),
             *[arg for s in run.nodes for arg in ("--archive", str(s.data_dir))]],
            capture_output=True, text=True, timeout=180, check=False)
        assert audit.returncode == 0 and "PASSED" in audit.stdout, audit.stdout[-3000:] + audit.stderr[-3000:]
        run.stop()
