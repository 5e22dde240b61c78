"""The demo's summary says what its loss gap means, with the training benchmark's figure read at run time."""

import json

from node.commands.demosummary import BENCHMARK_RESULT, benchmark_figure, format_summary


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
