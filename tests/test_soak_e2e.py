"""The protocol under delay, on every slow-suite run: a short soak on the emulated internet (tests/netlab.py).

Four nodes in three sites of their own network namespaces (a relay, a split cluster of two, and a node
behind NAT), 50-150 ms one-way between sites with 5 ms of jitter, rates of 50 Mbit/s to 1 Gbit/s drawn per
link, the chain 20 ms away; a real anvil and real node processes (bench/bench_soak.py without churn, the
nodes ending the run themselves after a few rounds). Skips, with the reason, where namespaces, nft, tc,
TUN devices or gcc are not there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from netlab import unavailable_reason  # noqa: E402

ROUNDS = 3


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_short_soak_with_delay_and_nat_commits_every_round_once(tmp_path):
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"cannot build the network emulator here: {reason}")
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_soak.py"), "--no-churn", "--rounds", str(ROUNDS),
         "--split-clusters", "1", "--single-clusters", "2", "--nat", "1", "--delay-ms", "50", "150",
         "--inner-steps", "4", "--sample-s", "5", "--workdir", str(tmp_path / "soak"), "--out", str(out)],
        capture_output=True, text=True, timeout=540, env=dict(os.environ), cwd=ROOT)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(out.read_text())
    assert result["emulator"]["nat_sites"] == ["c1"] and result["nodes"] == 4, result["placement"]
    # The emulator did delay: every echo to the relay took at least the round trip asked of it.
    for site, rtt in result["emulator"]["rtt_to_relay_ms"].items():
        assert rtt["measured"] and min(rtt["measured"]) >= rtt["configured"], (site, rtt)
    assert result["rounds_in_order_once"] and result["rounds"] == ROUNDS, result["contributors_per_round"]
    # Every node contributed to every round, the NATed one too (a record counts one contribution per
    # node and stage it trains: 1 + 1 + 2).
    assert result["contributors_per_round"] == [4] * ROUNDS, result["rounds_short"]
    assert not result["tracebacks"], result["traceback_heads"]
    assert not result["unexpected_exits"], result["unexpected_exits"]
    assert result["audit"]["verdict"] == "PASSED", result["audit"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
