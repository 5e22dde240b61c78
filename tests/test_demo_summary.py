"""The demo's summary says what its loss gap means, with the training benchmark's figure read at run time."""

import json

from node.commands.demosummary import BENCHMARK_RESULT, CONVERGENCE_RESULT, benchmark_figure, format_summary


def _summary(benchmark):
    return {
        "run_id": 1, "model_params": 867_072, "attest_quorum": 2, "members": 4, "stake_wei": 10**18,
        "unbonding_blocks": 128, "inner_steps": 20, "tokens": 163_840, "data": "a generated corpus",
        "rounds": [{"round": r, "eval_loss": 1.56, "train_loss": 1.63, "contributors": 4,
                    "attesters": ["a", "b"], "weights_root": "00" * 32} for r in range(8)],
        "centralized_reference_eval_loss": 0.95, "allreduce_bytes_equivalent": 10**9,
        "pseudo_gradient_bytes": 10**6, "bytes_sent_all_nodes": 5 * 10**7, "checkpoints": [],
        "latest_checkpoint_file": None, "disputes": 0, "workdir": "/tmp/d", "rpc_url": "http://127.0.0.1:1",
        "node_dirs": [], "benchmark": benchmark,
        "optimizer": "adamw",  # summarize() names the run's inner optimizer (cfg.training.optimizer)
    }


def _bench_result(loss_vs_ddp=0.0385, fewer=1010.4):
    return {"args": {"data": "$DLX_DATA_DIR/tinyshakespeare/input.txt", "rounds": 30, "inner_steps": 50},
            "summary": {"diloco_x": {"loss_vs_ddp": loss_vs_ddp, "fewer_bytes_than_ddp": fewer,
                                     "curve": [{"tokens": 256_000}, {"tokens": 1_536_000}]}}}


def test_the_benchmark_figure_is_read_from_its_json_and_printed_beside_the_demo_gap(tmp_path):
    path = tmp_path / "diloco.json"
    path.write_text(json.dumps(_bench_result()))
    figure = benchmark_figure(path)
    assert figure["tokens"] == 1_536_000 and figure["data"] == "tinyshakespeare" and figure["rounds"] == 30
    text = format_summary(_summary(figure))
    gap_line = text.index("centralized data-parallel AdamW on the same tokens: 0.9500 (+64.2%)")
    meaning = text.index("this demo is 8 short rounds of H=20 (163,840 tokens) on a generated corpus")
    bench = text.index("at a real budget (1,536,000 tokens of tinyshakespeare, 30 rounds of H=50) "
                       "DiLoCoX is +3.9% against centralized AdamW with 1010x fewer bytes")
    assert gap_line < meaning < bench < text.index("pseudo-gradients exchanged")
    assert str(path) in text
    # Another result gives another figure: nothing is hard-coded.
    path.write_text(json.dumps(_bench_result(loss_vs_ddp=0.0135, fewer=2000)))
    assert "DiLoCoX is +1.4% against centralized AdamW with 2000x fewer bytes" in format_summary(
        _summary(benchmark_figure(path)))


def test_a_missing_or_malformed_benchmark_result_is_named_not_fatal(tmp_path):
    missing = benchmark_figure(tmp_path / "absent.json")
    assert "not found" in missing["missing"]
    assert "not found" in format_summary(_summary(missing))
    for content in ("{not json", json.dumps({"summary": {"ddp": {}}}), json.dumps([1, 2]),
                    json.dumps(_bench_result(loss_vs_ddp=None))):
        (tmp_path / "bad.json").write_text(content)
        figure = benchmark_figure(tmp_path / "bad.json")
        assert figure["missing"].startswith("unreadable"), content
        assert "this demo is 8 short rounds" in format_summary(_summary(figure))


def test_the_committed_benchmark_result_gives_the_demo_its_figure():
    figure = benchmark_figure(BENCHMARK_RESULT)
    assert "missing" not in figure, figure
    assert figure["fewer_bytes"] > 1 and figure["tokens"] > 0


def test_the_run_is_read_against_the_strongest_centralized_run_on_its_tokens():
    """Both inner optimizers are trained on the demo's tokens; where the other one is stronger, the summary
    says so and gives the gap against it (issue 66), beside the gap against the run's own optimizer."""
    summary = _summary({})
    summary["centralized_reference_eval_losses"] = {"adamw": 0.95, "muon": 0.78}
    summary["strongest_centralized"] = {"optimizer": "muon", "eval_loss": 0.78}
    text = format_summary(summary)
    own = text.index("centralized data-parallel AdamW on the same tokens: 0.9500 (+64.2%)")
    best = text.index("the strongest centralized run on the same tokens, data-parallel Muon: 0.7800 "
                      "(+100.0% against it)")
    assert own < best < text.index("this demo is 8 short rounds")
    # The run's own optimizer the strongest: no second gap, the other optimizer named as trained.
    summary["centralized_reference_eval_losses"] = {"adamw": 0.95, "muon": 1.2}
    summary["strongest_centralized"] = {"optimizer": "adamw", "eval_loss": 0.95}
    text = format_summary(summary)
    assert "against it" not in text and "(AdamW is the strongest centralized run on the same tokens; also " \
        "trained: Muon 1.2000)" in text
    # A summary without the references (--no-reference, or an older summary.json) prints as before.
    del summary["centralized_reference_eval_losses"], summary["strongest_centralized"]
    assert "strongest" not in format_summary(summary)


def test_the_benchmark_figure_is_read_against_the_strongest_ddp_on_the_same_tokens(tmp_path):
    """The training benchmark's DiLoCoX beside the strongest DDP bench_convergence.py measured on its tokens
    (same model, data, seed and batches); a run on other tokens or another seed is never taken."""
    result = _bench_result()
    result["args"].update(preset="mini", family=None, seed=0, replicas=2, batch_size=8)
    result["summary"]["diloco_x"]["held_out_loss"] = 1.84
    path = tmp_path / "diloco.json"
    path.write_text(json.dumps(result))

    def ddp(optimizer, loss, **change):
        run = {"mode": "ddp", "family": "gpt2", "tokens": 1_536_000, "replicas": 2, "batch_per_replica": 8,
               "inner_steps": 50, "held_out_loss": loss,
               "settings": {"model": {"preset": "mini"}, "training": {"optimizer": optimizer}}}
        run.update(change)
        return run

    runs = [ddp("adamw", 1.79), ddp("muon", 1.61), ddp("muon", 1.2, tokens=3_072_000),
            ddp("muon", 1.3, settings={"model": {"preset": "mini"},
                                       "training": {"optimizer": "muon", "seed": 1}}),
            {**ddp("muon", 1.1), "mode": "diloco"}]
    convergence = tmp_path / "convergence.json"
    convergence.write_text(json.dumps({"data": "tinyshakespeare", "runs": runs}))
    figure = benchmark_figure(path, convergence)
    assert figure["strongest_ddp"] == {"path": str(convergence), "optimizer": "muon", "loss": 1.61,
                                       "loss_vs": 1.84 / 1.61 - 1}
    text = format_summary(_summary(figure))
    assert (f"against the strongest centralized run measured on those tokens (data-parallel Muon, 1.6100 in "
            f"{convergence}, from bench/bench_convergence.py) it is +14.3%") in text
    # No matching run (other data), or no such file: the figure goes without it.
    convergence.write_text(json.dumps({"data": "wikitext-2", "runs": runs}))
    assert "strongest_ddp" not in benchmark_figure(path, convergence)
    assert "strongest_ddp" not in benchmark_figure(path, tmp_path / "absent.json")
    assert "missing" not in benchmark_figure(path, tmp_path / "absent.json")


def test_the_committed_results_give_the_strongest_ddp_of_the_benchmark_tokens():
    """bench/results/diloco.json's DiLoCoX against the lowest DDP of bench/results/convergence.json on its
    tokens, as read from the two files."""
    figure = benchmark_figure(BENCHMARK_RESULT)
    best = figure["strongest_ddp"]
    convergence = json.loads(CONVERGENCE_RESULT.read_text())
    ddp = [run["held_out_loss"] for run in convergence["runs"] if run["mode"] == "ddp"
           and run["tokens"] == figure["tokens"]
           and run["settings"]["model"].get("preset") == figure["preset"]
           and run["settings"].get("training", {}).get("seed", 0) == 0]
    assert best["loss"] == min(ddp) and best["loss_vs"] == figure["loss"] / min(ddp) - 1


def test_a_centralized_reference_says_how_far_it_has_got_and_how_long_is_left():
    """Issue 80: the references ran for 40-65 minutes with no line. One line per round at most every
    ``every_s`` seconds (the last always), with the time left at the pace so far."""
    from node.commands.demosummary import ReferenceProgress

    said: list[str] = []
    now = [100.0]
    progress = ReferenceProgress("Muon", said.append, every_s=5.0, clock=lambda: now[0])
    for done, at in ((1, 110.0), (2, 112.0), (3, 130.0), (4, 190.0)):
        now[0] = at
        progress(done, 4)
    assert said == [
        "  centralized Muon: round 1/4, 10s so far, about 30s left",
        # round 2 came 2 s after round 1's line: not said
        "  centralized Muon: round 3/4, 30s so far, about 10s left",
        "  centralized Muon: round 4/4, 1m30s so far, done",
    ]
