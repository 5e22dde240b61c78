"""The README's main job, `dlx-node demo`, runs end to end (small settings) and reports from the chain."""

import json
import subprocess
import sys

import pytest


def _check_summary(stdout: str, out) -> None:
    """What the demo reports from the chain once its nodes end (stdout and summary.json)."""
    assert "2 rounds committed on chain" in stdout, stdout[-3000:]
    assert "AllReduce of fp32 gradients every step would have sent" in stdout
    summary = json.loads((out / "summary.json").read_text())
    # The demo runs new runs' codec (issue 66: encoder v2, clipped low-bit scales, no error feedback;
    # tests/test_new_run_codec.py), named in its run document, and commits the default version-3 roots
    # (diloco.commitments "auto": its clip scales provable on chain).
    document = json.loads((out / "run.json").read_text())
    codec = document["compression"]
    assert (codec["encoder"], codec["quant_scale"], codec["error_feedback"]) == ("v2", "mse", False)
    assert document["diloco"]["commitments"] == "normed"
    assert [r["round"] for r in summary["rounds"]] == [0, 1]
    # A staked run whose every record carries the signatures of k = 2 distinct members.
    assert summary["attest_quorum"] == 2 and summary["stake_wei"] > 0
    assert summary["unbonding_blocks"] >= 128  # the floor: accusation deadline + dispute window, never 0
    assert all(len(set(r["attesters"])) >= 2 for r in summary["rounds"]), summary["rounds"]
    # Both stages of at least one replica each round; the 2x2 protocol test asserts all four.
    assert all(r["contributors"] >= 2 for r in summary["rounds"])
    assert summary["checkpoints"] and summary["latest_checkpoint_file"]
    assert summary["disputes"] == 0
    # (issue 77) the demo opens a small reward pool; each member's earnings come from the chain, its
    # contributions proven by the stage leaves and factors the nodes kept for every committed round
    rewards = summary["rewards"]
    assert rewards["per_round_amount"] == 10**16 and rewards["funded_amount"] == 2 * 10**16
    assert (rewards["unit"], rewards["symbol"]) == ("wei", "ETH")  # the demo's pool is in ETH
    assert rewards["rounds_with_factors"] == [0, 1], rewards
    assert len(rewards["members"]) == 4 and all(m["contributions"] >= 1 for m in rewards["members"]), rewards
    assert 0 < sum(m["earned_amount"] for m in rewards["members"]) <= rewards["funded_amount"]
    assert f"reward pool {rewards['pool']}" in stdout
    assert 0 < summary["pseudo_gradient_bytes"] < summary["allreduce_bytes_equivalent"]
    # The centralized reference on the same tokens is trained and printed beside the run's loss.
    reference = summary["centralized_reference_eval_loss"]
    assert 0 < reference < summary["rounds"][0]["eval_loss"] + 1.0
    # Trained with the run's inner optimizer (training.config.DEFAULT_OPTIMIZER: AdamW), and named so.
    assert summary["optimizer"] == "adamw" and "centralized data-parallel AdamW on the same tokens" in stdout
    # ... and with the other (Muon): the strongest of the two is what the run is read against (issue 66).
    losses = summary["centralized_reference_eval_losses"]
    assert set(losses) == {"adamw", "muon"} and losses["adamw"] == reference
    best = min(losses, key=losses.get)
    assert summary["strongest_centralized"] == {"optimizer": best, "eval_loss": losses[best]}
    if best == "muon":
        assert f"the strongest centralized run on the same tokens, data-parallel Muon: {losses[best]:.4f}" \
            in stdout
    # ... and what that gap means: this run's size, beside the training benchmark's figure read from its JSON.
    assert "this demo is 2 short rounds of H=4" in stdout
    assert summary["benchmark"]["path"].endswith("bench/results/diloco.json") \
        and "missing" not in summary["benchmark"]
    # the benchmark's, from its JSON
    named = {"adamw": "AdamW", "muon": "Muon"}[summary["benchmark"]["optimizer"]]
    assert f"DiLoCoX is {100 * summary['benchmark']['loss_vs_ddp']:+.1f}% against centralized {named}" \
        in stdout


@pytest.mark.timeout(600)
def test_demo_runs_reports_from_the_chain_and_keep_serves_the_printed_pull_command(tmp_path):
    """The demo trains, reports from the chain (summary, reference); with --keep the nodes end, a seeder
    serves their archives, and the pull command the demo prints works. (One demo run: it is the suite's
    costliest.)"""
    import shlex
    import signal

    out = tmp_path / "demo"
    demo = subprocess.Popen(
        [sys.executable, "-m", "node.cli", "demo", "--preset", "tiny", "--rounds", "2", "--inner-steps", "4",
         "--checkpoint-every", "1", "--out", str(out), "--timeout", "300", "--keep"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        for line in demo.stdout:
            lines.append(line)
            if line.startswith("watch the run in a browser"):
                lines.append(next(demo.stdout))
                break
        text = "".join(lines)
        _check_summary(text, out)
        assert "a seeder serves the nodes' checkpoints" in text, text[-3000:]
        pull = next(lines[i + 1] for i, line in enumerate(lines)
                    if line.startswith("pull the latest checkpoint the chain vouches for")).strip()
        explorer = lines[-1].strip()
        assert pull.startswith("dlx-node pull 'dlx://") and "&peer=/ip4/127.0.0.1/tcp/" in pull
        assert explorer.startswith("dlx-node explorer --rpc http://127.0.0.1:") and "--deployment" in explorer
        # The exact printed command, with no --archive: the checkpoint comes over libp2p from the seeder.
        args = shlex.split(pull)[1:]
        done = subprocess.run([sys.executable, "-m", "node.cli", *args], capture_output=True, text=True,
                              timeout=240, check=False)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        model = out / "model"
        assert (model / "config.json").is_file() and list(model.glob("*.safetensors"))
        assert "round 1" in done.stdout + done.stderr
        # The demo closed the dispute windows on its idle chain: the plain pull takes round 1 as final.
        assert "--pending" not in pull and "mined" in text and "rounds are final" in text, text[-3000:]
        # ... and the members' earnings are final and claimable then
        final = text[text.index("now that its rounds are final"):]
        assert "reward pool" in final and "not final yet" not in final, final
        assert "NOT final" not in done.stdout, done.stdout[-2000:]
    finally:
        demo.send_signal(signal.SIGINT)
        try:
            code = demo.wait(timeout=90)
        except subprocess.TimeoutExpired:
            demo.kill()
            raise
    assert code == 0, "".join(lines)[-2000:]
    # The demo refuses to reuse a non-empty directory (it always starts a fresh chain).
    again = subprocess.run([sys.executable, "-m", "node.cli", "demo", "--out", str(out)],
                           capture_output=True, text=True, timeout=120, check=False)
    assert again.returncode == 2 and "not empty" in again.stderr
