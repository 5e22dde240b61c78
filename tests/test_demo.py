"""The README's main job, `dlx-node demo`, runs end to end (small settings) and reports from the chain."""

import json
import subprocess
import sys

import pytest


@pytest.mark.timeout(400)
def test_demo_runs_and_summarizes_from_the_chain(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "node.cli", "demo", "--preset", "tiny", "--rounds", "2", "--inner-steps", "4",
         "--checkpoint-every", "1", "--out", str(out), "--timeout", "300"],
        capture_output=True, text=True, timeout=380, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 rounds committed on chain" in proc.stdout
    assert "AllReduce of fp32 gradients every step would have sent" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    # The demo runs the default encoder (training.config.DEFAULT_ENCODER), named in its run document.
    assert json.loads((out / "run.json").read_text())["compression"]["encoder"] == "v4"
    assert [r["round"] for r in summary["rounds"]] == [0, 1]
    # A staked run whose every record carries the signatures of k = 2 distinct members.
    assert summary["attest_quorum"] == 2 and summary["stake_wei"] > 0
    assert summary["unbonding_blocks"] >= 128  # the floor: accusation deadline + dispute window, never 0
    assert all(len(set(r["attesters"])) >= 2 for r in summary["rounds"]), summary["rounds"]
    # Both stages of at least one replica each round; the 2x2 protocol test asserts all four.
    assert all(r["contributors"] >= 2 for r in summary["rounds"])
    assert summary["checkpoints"] and summary["latest_checkpoint_file"]
    assert summary["disputes"] == 0
    assert 0 < summary["pseudo_gradient_bytes"] < summary["allreduce_bytes_equivalent"]
    # The centralized reference on the same tokens is trained and printed beside the run's loss.
    reference = summary["centralized_reference_eval_loss"]
    assert 0 < reference < summary["rounds"][0]["eval_loss"] + 1.0
    assert "centralized data-parallel AdamW on the same tokens" in proc.stdout
    # ... and what that gap means: this run's size, beside the training benchmark's figure read from its JSON.
    assert "this demo is 2 short rounds of H=4" in proc.stdout
    assert summary["benchmark"]["path"].endswith("bench/results/diloco.json") and "missing" not in summary["benchmark"]
    assert f"DiLoCoX is {100 * summary['benchmark']['loss_vs_ddp']:+.1f}% against centralized AdamW" in proc.stdout
    # The demo refuses to reuse a non-empty directory (it always starts a fresh chain).
    again = subprocess.run([sys.executable, "-m", "node.cli", "demo", "--out", str(out)],
                           capture_output=True, text=True, timeout=120, check=False)
    assert again.returncode == 2 and "not empty" in again.stderr
