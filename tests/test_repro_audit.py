"""bench/bench_reproducible.py ``--audit``'s plumbing (bench/repro_audit.py, bench/repro_cheats.py): the
full-size demo's settings, the result file's merge, and the cheats convicted by the audit's own rerun."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_reproducible import main as bench_main, merge_block  # noqa: E402
from bench.repro_audit import demo_defaults  # noqa: E402
from bench.repro_cheats import KINDS, convicted, record, rerun  # noqa: E402

TINY = {"model": {"preset": "tiny"}, "pipeline": {"num_stages": 1},
        "training": {"reproducible": True, "reproducible_kernels": 2, "batch_size": 4, "warmup_steps": 2},
        "diloco": {"inner_steps": 3, "num_replicas": 2}, "compression": {"min_compress_numel": 512}}


def test_the_full_demo_is_the_demos_own_size():
    """``--audit-full`` trains what a plain ``dlx-node demo`` trains (mini, 2 replicas, 8 rounds of H = 20
    today), read from its parser, so the bench follows the demo."""
    from node.commands.parsers import build_parser

    full = demo_defaults()
    demo = build_parser().parse_args(["demo"])
    assert full == {"audit_preset": demo.preset, "audit_replicas": demo.replicas,
                    "audit_rounds": demo.rounds, "audit_inner_steps": demo.inner_steps}
    assert (full["audit_preset"], full["audit_rounds"]) == ("mini", 8)


def test_a_block_is_merged_into_the_result_file_without_touching_the_rest(tmp_path):
    path = tmp_path / "reproducible.json"
    path.write_text(json.dumps({"timings": [1], "audit": {"old": True}}))
    merge_block(path, "audit_full", {"audits": [2]})
    assert json.loads(path.read_text()) == {"timings": [1], "audit": {"old": True},
                                            "audit_full": {"audits": [2]}}
    merge_block(path, "audit_full", {"cheats": {"x": 1}}, update=True)
    assert json.loads(path.read_text())["audit_full"] == {"audits": [2], "cheats": {"x": 1}}
    merge_block(path, "audit", {"new": True})  # replaced, not merged
    assert json.loads(path.read_text())["audit"] == {"new": True}


def test_the_cheats_alone_need_a_demo(tmp_path):
    out = str(tmp_path / "r.json")
    with pytest.raises(SystemExit, match="--audit-workdir"):
        bench_main(["--audit-cheats", "--out", out])
    with pytest.raises(SystemExit, match="no demo there"):
        bench_main(["--audit-cheats", "--audit-workdir", str(tmp_path), "--out", out])
    assert not (tmp_path / "r.json").exists()


def test_a_judgement_is_right_only_when_the_honest_claim_is_exact_and_each_cheat_caught():
    honest = {"kind": "honest", "verdict": "exact", "chain": "exact", "how": "exact"}
    hidden = {"kind": "ulp", "verdict": "exact", "chain": "exact", "how": "exact"}
    assert convicted([honest, {**hidden, "chain": "state_mismatch"}]) == {"honest": True, "ulp": True}
    assert convicted([{**honest, "how": "emulated"}, hidden]) == {"honest": False, "ulp": False}
    caught = {**hidden, "kind": "percent", "verdict": "mismatch"}
    assert convicted([{**honest, "verdict": "mismatch"}, caught]) == {"honest": False, "percent": True}


@pytest.mark.timeout(600)
def test_the_cheats_in_one_inner_step_are_convicted_and_the_honest_claim_is_exact(tmp_path):
    """bench/repro_cheats.py end to end, in this process, on a tiny reproducible run read from a node.toml
    as the bench reads the demo's: the 1% cheat and the one-ulp cheat in the last inner step of round 0."""
    from node.config import dump_toml

    toml = tmp_path / "node.toml"
    toml.write_text(dump_toml(TINY))
    run = tmp_path / "cheats.pkl"
    with pytest.raises(SystemExit, match="not an inner step"):
        record(str(toml), 3, str(run))
    record(str(toml), 2, str(run))
    out = rerun(str(run))
    assert [check["kind"] for check in out["checks"]] == list(KINDS)
    assert convicted(out["checks"]) == {kind: True for kind in KINDS}, out["checks"]
    (toml.with_name("plain.toml")).write_text(dump_toml({**TINY, "training": {"reproducible": False}}))
    with pytest.raises(SystemExit, match="not a reproducible run"):
        record(str(toml.with_name("plain.toml")), 0, str(run))
