"""A member leaves for good, then a newcomer ``dlx-node join``s: its contributions are closed.

Real node processes on loopback, a real anvil: three one-node replicas train; one is stopped and leaves
the run (``dlx-node leave``); a fresh node joins from an empty directory with the run link. The two
members that stayed had heard the leaver's hellos, the joiner never did: before placement came from
chain seats (node/live/state/topology.py, ``place_members``), the two views put the joiner on different
replicas, every one of its announcements was refused, and no round ever closed with it (the 35-minute
soak of bench/bench_soak.py). No delay is needed: the fault is in what each node heard, not in the links.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys

import pytest
from node_fixtures import TINY, node_log, run_logs, wait_for

from ledger.account import dev_account

#: A close's line in a coordinator's log: the replicas it closed with.
CLOSED = re.compile(r"round \d+ stage \d+ closed with replicas \[([\d, ]*)\]")
#: Rounds with the joiner's contribution committed before the test stops (after its entry round).
ROUNDS_WITH_JOINER = 3


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_newcomer_after_a_member_left_for_good_is_in_the_closes_of_the_rounds_after_its_entry(make_run,
                                                                                                tmp_path):
    run = make_run(replicas=3, stages=1, split=False, stake_wei=10**18,
                   settings=[*TINY, "rounds=0", "join_timeout=5", "checkpoint_every=2", "quorum=2"])
    run.start()
    client = run.client()
    stayers, leaver = run.nodes[:2], run.nodes[2]

    def committed_with(count: int, after: int = -1) -> list[int]:
        return [c.commit.round for c in client.history(run.run_id, with_registrations=False).commits
                if c.commit.num_contributors == count and c.commit.round > after]

    wait_for(lambda: len(committed_with(3)) >= 2 and client.latest_checkpoint(run.run_id) is not None, 400,
             "two rounds of all three founders and a checkpoint", run)
    # The leaver goes for good: stopped, then out of the run on chain (its seat ends).
    run.kill(leaver, signal.SIGTERM)
    leaver.process.wait(timeout=120)
    done = subprocess.run([sys.executable, "-m", "node.cli", "leave", "--config", str(leaver.config_path),
                           "--yes"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    left_at = client.last_round(run.run_id)
    seat = client.member(run.run_id, dev_account(leaver.account, run.chain_id).address)
    assert seat is not None and not seat.active, seat

    joiner_dir, log = tmp_path / "joiner", tmp_path / "join.log"
    joiner = subprocess.Popen(
        [sys.executable, "-m", "node.cli", "--log-file", str(log), "join", run.link(), "--data-dir",
         str(joiner_dir), "--dev-account", "5", "--yes", "--no-progress", "--set", "torch_threads=1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        def joiner_in_closes() -> bool:
            assert joiner.poll() is None, f"dlx-node join exited with {joiner.returncode}\n" + run_logs(run)
            assert all(s.process.poll() is None for s in stayers), "a member exited\n" + run_logs(run)
            return len(committed_with(3, after=left_at)) > ROUNDS_WITH_JOINER  # one may hold the leaver's

        wait_for(joiner_in_closes, 600, f"{ROUNDS_WITH_JOINER} rounds closed with the joiner", run)
        status = json.loads((joiner_dir / "status.json").read_text())
    finally:
        if joiner.poll() is None:
            joiner.send_signal(signal.SIGTERM)
        output = joiner.communicate(timeout=120)[0].decode(errors="replace")
    run.stop_nodes()
    assert joiner.returncode == 0, output + "\n" + log.read_text(errors="replace")

    # Every view placed the joiner where it placed itself: its contribution is in the archived record of
    # the rounds after its entry, on its replica, and the stayers' closes name that replica.
    replica, peer_id = status["placement"]["replica"], status["peer_id"]
    entered = int(re.search(r"first contribution of this process: round (\d+)", log.read_text()).group(1))
    with_joiner = []
    for outer_round in committed_with(3, after=left_at):
        recorded = json.loads(
            (stayers[0].data_dir / "archive" / f"run-{run.run_id}" / f"round-{outer_round:08d}"
             / "recorded.json").read_text())
        if [replica, peer_id] in [[r, p] for _s, r, p, _h in recorded["contributions"]]:
            with_joiner.append(outer_round)
    assert len(with_joiner) >= ROUNDS_WITH_JOINER and min(with_joiner) >= entered, with_joiner
    closed = {int(r) for slot in stayers for line in CLOSED.findall(node_log(slot)) for r in line.split(",")
              if r.strip()}
    assert replica in closed, closed
    history = client.history(run.run_id)
    rounds = [c.commit.round for c in history.commits]
    assert rounds == list(range(len(rounds))) and not history.disputes
