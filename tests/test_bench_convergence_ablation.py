"""bench/bench_convergence_ablation.py's summary and split (issue 66) and the results page's fitted trend with
size: every gap is taken against DDP at the same seed; the fit says where it reaches +2% only if it falls."""

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from results_convergence import ablation, ablation_trend, fit_trend  # noqa: E402

from bench.bench_convergence_ablation import (  # noqa: E402
    CELLS, check_budget, from_convergence, methods, read_rows, row_key, save, split, summarize)


def _row(cell: str, seed: int, loss: float) -> dict:
    return {"case": "gpt2-mini", "rounds": 6, "cell": cell, "seed": seed, "tokens": 307_200,
            "num_params": 867_072, "held_out_loss": loss, "bytes_per_token": 4.0 if cell == "ddp" else 0.004}


ROWS = [_row("ddp", 0, 2.0), _row("ddp", 1, 2.2), _row("sync", 0, 2.04), _row("sync", 1, 2.2),
        _row("delay", 0, 2.06), _row("delay", 1, 2.2), _row("compression", 0, 2.1),
        _row("compression", 1, 2.31),
        _row("both", 0, 2.12), _row("both", 1, 2.31), _row("both-efd0.8", 0, 2.1)]


def test_each_gap_is_against_ddp_at_the_same_seed_and_the_split_adds_up():
    summary = {s["cell"]: s for s in summarize(ROWS)}
    assert summary["sync"]["gaps_vs_ddp"] == pytest.approx([0.02, 0.0])
    assert summary["sync"]["mean_gap_vs_ddp"] == pytest.approx(0.01)
    assert summary["compression"]["spread"] == pytest.approx(0.21)
    assert summary["compression"]["gap_spread"] == pytest.approx(0.0)
    assert summary["both-efd0.8"]["seeds"] == [0]
    assert summary["both"]["fewer_bytes_than_ddp"] == pytest.approx(1000)
    (parts,) = split(list(summary.values()))
    assert parts["diloco_own"] == pytest.approx(0.01) and parts["delay"] == pytest.approx(0.005)
    assert parts["compression"] == pytest.approx(0.04)
    total = parts["diloco_own"] + parts["delay"] + parts["compression"] + parts["interaction"]
    assert total == pytest.approx(parts["diloco_x"])
    page = "\n".join(ablation({"summary": list(summary.values()), "split": [parts]}))
    assert "the compression +4.00%" in page and "+ compression only (no delay)" in page


def test_no_split_without_every_cell_and_the_method_cells_change_one_setting():
    assert split(summarize([r for r in ROWS if r["cell"] != "delay"])) == []
    assert CELLS["both-efd0.8"] == ("diloco_x", {}, {"error_feedback_decay": 0.8})
    assert CELLS["delay-eager"] == ("diloco_x", {"delay_correction": "eager"}, {"enabled": False})


def test_the_fit_reaches_the_goal_only_where_it_falls():
    falling = [(10 ** 5, 0.06), (10 ** 6, 0.04), (10 ** 7, 0.02)]
    fit = fit_trend(falling)
    assert fit["slope"] == pytest.approx(-0.02) and fit["slope_se"] == pytest.approx(0.0, abs=1e-12)
    assert math.log10(fit["reaches_goal_at"]) == pytest.approx(7.0)
    rising = fit_trend([(10 ** 5, 0.03), (2 * 10 ** 5, 0.06), (4 * 10 ** 5, 0.05)])
    assert rising["slope"] > 0 and rising["reaches_goal_at"] is None and rising["slope_se"] > 0
    assert fit_trend([(10 ** 5, 0.03)]) is None and fit_trend(falling[:2])["slope_se"] is None


def test_a_method_wins_only_with_a_gain_at_every_seed_beyond_the_spread():
    """Gains are paired by seed against the base cell; the spread is the larger of the two cells' gap
    spreads; one seed is never a win."""
    rows = [r for r in ROWS if r["cell"] != "both-efd0.8"]
    rows += [_row("both-qmse", 0, 2.06), _row("both-qmse", 1, 2.255),  # gains 3 and 2.5 points
             _row("both-v2", 0, 2.11), _row("both-v2", 1, 2.25),  # gains 0.5 and 2.73
             _row("both-noef", 0, 2.0), _row("both-noef", 1, 2.33),  # a loss at seed 1
             _row("both-efd0.8", 0, 2.0)]  # one seed
    found = {m["cell"]: m for m in methods(summarize(rows))}
    assert set(found) == {"both-qmse", "both-v2", "both-noef", "both-efd0.8"}
    qmse = found["both-qmse"]
    assert qmse["gains"] == pytest.approx([0.03, 0.025]) and qmse["base"] == "both"
    assert qmse["wins_beyond_spread"] and found["both-qmse"]["spread"] == pytest.approx(0.01)
    # v2's own gap spread (5.5% and 2.27%) is the larger, and above its mean gain (0.5 and 2.73 points)
    assert found["both-v2"]["spread"] == pytest.approx(2.11 / 2.0 - 2.25 / 2.2)
    assert not found["both-v2"]["wins_beyond_spread"] and found["both-v2"]["mean_gain"] > 0
    assert not found["both-noef"]["wins_beyond_spread"] and not found["both-efd0.8"]["wins_beyond_spread"]
    page = "\n".join(ablation({"summary": summarize(rows), "split": [], "methods": list(found.values())}))
    assert "| gpt2-mini | 307,200 | `both-qmse` | `both` | 0, 1 | +3.00, +2.50 | +2.75 |" in page
    assert "**yes**" in page


def test_the_split_takes_the_seeds_every_cell_ran_and_a_seed_without_ddp_is_no_gap():
    """A cell run at a third seed does not move the split (its other cells lack that seed), and a seed
    without its DDP run gives no gap, so no method is paired on it."""
    rows = ROWS + [_row("both", 2, 2.5), _row("sync", 2, 2.0), _row("both-qmse", 0, 2.06),
                   _row("both-qmse", 1, 2.255), _row("both-qmse", 2, 2.0)]
    summary = summarize(rows)
    (parts,) = split(summary)
    (before,) = split(summarize(ROWS))
    assert parts["seeds"] == [0, 1] and parts == {**before, "seeds": [0, 1]}
    both = next(s for s in summary if s["cell"] == "both")
    assert both["seeds"] == [0, 1, 2] and both["gap_seeds"] == [0, 1]
    (qmse,) = [m for m in methods(summary) if m["cell"] == "both-qmse"]
    assert qmse["seeds"] == [0, 1] and qmse["gains"] == pytest.approx([0.03, 0.025])


def test_two_budgets_of_one_case_stay_apart():
    """Rows of one case at two budgets (rounds, hence tokens) are summarized, split and paired each against
    the DDP of its own budget; a row of another token count for a group is refused."""
    longer = [{**r, "rounds": 30, "tokens": 1_536_000,
               "held_out_loss": r["held_out_loss"] - (0.5 if r["cell"] == "ddp" else 0.45)} for r in ROWS]
    summary = summarize(ROWS + longer)
    by = {(s["rounds"], s["cell"]): s for s in summary}
    assert by[6, "sync"]["gaps_vs_ddp"] == pytest.approx([0.02, 0.0])
    assert by[30, "sync"]["gaps_vs_ddp"] == pytest.approx([1.59 / 1.5 - 1, 1.75 / 1.7 - 1])
    assert by[30, "both"]["tokens"] == 1_536_000 and by[6, "both"]["seeds"] == [0, 1]
    short, full = split(summary)
    assert (short["rounds"], full["rounds"]) == (6, 30) and short == split(summarize(ROWS))[0]
    assert full["diloco_x"] == pytest.approx((1.67 / 1.5 + 1.86 / 1.7) / 2 - 1)
    paired = {(m["rounds"], m["cell"]): m for m in methods(summary)}
    assert paired[30, "both-efd0.8"]["gains"] == pytest.approx([1.67 / 1.5 - 1.65 / 1.5])
    page = "\n".join(ablation({"summary": summary, "split": [short, full], "methods": []}))
    assert "`gpt2-mini` at 307,200 tokens" in page and "`gpt2-mini` at 1,536,000 tokens" in page
    keyed = {row_key(r): {**r, "optimizer": "muon"} for r in ROWS}
    check_budget(keyed, "gpt2-mini", 6, "muon", 307_200)
    check_budget(keyed, "gpt2-mini", 30, "adamw")  # another budget: a group of its own
    check_budget(keyed, "gpt2-mini", 6, "adamw", 614_400)  # another optimizer: a group of its own
    with pytest.raises(SystemExit, match="rows of \\[307200\\] tokens, not 614400"):
        check_budget(keyed, "gpt2-mini", 6, "muon", 614_400)


def test_the_convergence_rows_join_as_the_seed_0_cells_of_the_full_budget():
    """bench/results/convergence.json's muon rows of a case become its ddp, sync and both cells at seed 0 (the
    other variants and cases are left), naming their source; a row of another H is refused."""
    runs = json.loads((ROOT / "bench" / "results" / "convergence.json").read_text())["runs"]
    rows = from_convergence(runs, "gpt2-mini")
    assert sorted(r["cell"] for r in rows) == ["both", "ddp", "sync"]
    assert {(r["seed"], r["rounds"], r["tokens"], r["optimizer"]) for r in rows} == {
        (0, 30, 1_536_000, "muon")}
    both = next(r for r in rows if r["cell"] == "both")
    source = next(r for r in runs
                  if (r["case"], r["mode"], r["variant"]) == ("gpt2-mini", "diloco_x", "muon"))
    assert both["held_out_loss"] == source["held_out_loss"] and both["source"].endswith("convergence.json")
    (summary,) = [s for s in summarize(rows) if s["cell"] == "both"]
    assert summary["mean_gap_vs_ddp"] == pytest.approx(source["held_out_loss"] / next(
        r["held_out_loss"] for r in rows if r["cell"] == "ddp") - 1)
    assert summary["seeds_from_convergence"] == [0]
    page = "\n".join(ablation({"summary": summarize(rows + ROWS), "split": []}))
    assert "| gpt2-mini | 1,536,000 | + both (DiLoCoX) | 0* |" in page and "`*`: that seed's row" in page
    assert "| gpt2-mini | 307,200 | + both (DiLoCoX) | 0, 1 |" in page
    with pytest.raises(SystemExit, match="H 25"):
        from_convergence([{**source, "inner_steps": 25}], "gpt2-mini")
    older = {k: v for k, v in source.items() if k not in ("inner_steps", "rounds")}
    with pytest.raises(SystemExit, match="names no H or rounds"):
        from_convergence([older], "gpt2-mini")


def test_the_trend_with_size_needs_three_llama_sizes_at_one_budget():
    """The ablation's gap against size is fitted per number of rounds over the Llama cases only (gpt2-mini
    and a budget with two sizes give no sentence), each size's gap the mean over its seeds."""
    def rows(case, params, gap_sync, gap_both, rounds=6):
        base = {"case": case, "rounds": rounds, "tokens": 1000, "num_params": params, "bytes_per_token": 1.0}
        return [{**base, "cell": "ddp", "seed": 0, "held_out_loss": 2.0},
                {**base, "cell": "sync", "seed": 0, "held_out_loss": 2.0 * (1 + gap_sync)},
                {**base, "cell": "both", "seed": 0, "held_out_loss": 2.0 * (1 + gap_both)}]
    data = (rows("llama-xs", 10 ** 5, 0.0, 0.06) + rows("llama-s", 10 ** 6, 0.01, 0.04)
            + rows("llama-l", 10 ** 7, 0.02, 0.02) + rows("gpt2-mini", 10 ** 8, 0.5, 0.5)
            + rows("llama-xs", 10 ** 5, 0.0, 0.06, 10) + rows("llama-l", 10 ** 7, 0.0, 0.02, 10))
    (sentence,) = ablation_trend(summarize(data))
    assert sentence.startswith("Gap with size at 6 rounds")
    assert "0.10M +6.00% -> 1.00M +4.00% -> 10.00M +2.00%" in sentence
    assert ("DiLoCoX +6.00% at 0.10M, slope -2.00 +- 0.00 points per 10x parameters (3 sizes), reaching +2% "
            "at about 10M parameters") in sentence
    assert "sync DiLoCo +0.00% at 0.10M, slope +1.00" in sentence and "+50.00%" not in sentence


def test_two_inner_optimizers_of_one_case_and_budget_stay_apart():
    """AdamW rows of a case and budget are summarized, split and paired against AdamW's DDP, Muon's (rows
    that name no optimizer: written before it was part of the key) against Muon's; the page names AdamW's."""
    adamw = [{**r, "optimizer": "adamw",
              "held_out_loss": r["held_out_loss"] + (0.1 if r["cell"] == "ddp" else 0.2)} for r in ROWS]
    summary = summarize(ROWS + adamw)
    by = {(s["optimizer"], s["cell"]): s for s in summary}
    assert by["muon", "sync"]["gaps_vs_ddp"] == pytest.approx([0.02, 0.0])
    assert by["adamw", "sync"]["gaps_vs_ddp"] == pytest.approx([2.24 / 2.1 - 1, 2.4 / 2.3 - 1])
    muon_split, adamw_split = split(summary)
    assert (muon_split["optimizer"], adamw_split["optimizer"]) == ("muon", "adamw")
    assert muon_split == split(summarize(ROWS))[0]
    paired = {(m["optimizer"], m["cell"]): m for m in methods(summary)}
    assert paired["adamw", "both-efd0.8"]["gains"] == pytest.approx([2.32 / 2.1 - 2.3 / 2.1])
    page = "\n".join(ablation({"summary": summary, "split": [muon_split, adamw_split], "methods": []}))
    assert "`gpt2-mini (AdamW)` at 307,200 tokens" in page and "`gpt2-mini` at 307,200 tokens" in page


def _save_rows(path: str, seed_base: int, count: int) -> None:
    for k in range(count):
        row = {**ROWS[0], "cell": "both", "seed": seed_base + k, "optimizer": "muon"}
        save(Path(path), [row], "tinyshakespeare", [0.0, 0.0, 0.0])


def test_runs_side_by_side_keep_each_others_rows(tmp_path):
    """Two processes adding rows to one --out at the same time (each read the file before the other wrote):
    the lock and the re-read keep every row of both, and a row replaces only its own key."""
    import multiprocessing

    path = tmp_path / "ablation.json"
    save(path, [{**ROWS[0], "optimizer": "muon"}], "tinyshakespeare", [0.0, 0.0, 0.0])
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_save_rows, args=(str(path), base, 12)) for base in (100, 200)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
        assert worker.exitcode == 0
    rows = read_rows(path)
    assert len(rows) == 25 and ("gpt2-mini", 6, "ddp", 0, "muon") in rows
    assert {key[3] for key in rows if key[2] == "both"} == set(range(100, 112)) | set(range(200, 212))
    written = json.loads(path.read_text())
    assert written["data"] == "tinyshakespeare" and len(written["rows"]) == 25
    with pytest.raises(SystemExit, match="rows of \\[307200\\] tokens, not 614400"):
        save(path, [{**ROWS[1], "tokens": 614_400}], "tinyshakespeare", [0.0, 0.0, 0.0])
    assert len(read_rows(path)) == 25


def test_the_goal_section_says_met_or_missed_by_how_many_points():
    from results_convergence import diloco_goal

    result = json.loads((ROOT / "bench" / "results" / "diloco_goal.json").read_text())
    page = "\n".join(diloco_goal(result))
    assert "Case `llama-l`" in page and "error feedback off" in page and "nanoGPT" not in page
    x, sync = result["summary"]["diloco_x"], result["summary"]["diloco"]
    assert f"**missed by {100 * (x['loss_vs_ddp'] - 0.02):.2f} points**" in page
    assert f"**missed by {100 * (sync['loss_vs_ddp'] - 0.01):.2f} points**" in page
    closer = {**result, "summary": {**result["summary"], "diloco_x": {**x, "loss_vs_ddp": 0.015},
                                    "diloco": {**sync, "loss_vs_ddp": 0.0099}}}
    text = "\n".join(diloco_goal(closer))
    assert "within 2% of DDP: +1.50%, met" in text and "within 1% of DDP: +0.99%, met" in text
    assert "missed" not in text


def test_merge_adds_the_rows_of_runs_that_wrote_elsewhere(tmp_path):
    """--merge: rows another run wrote to its own --out join the main file (a row of the same key replaced),
    through the same lock and budget check; nothing is trained."""
    import subprocess

    main, other = tmp_path / "main.json", tmp_path / "other.json"
    save(main, [{**r, "optimizer": "muon"} for r in ROWS[:4]], "tinyshakespeare", [0.0, 0.0, 0.0])
    save(other, [{**ROWS[3], "held_out_loss": 9.0}, {**ROWS[4], "optimizer": "adamw"}], "tinyshakespeare",
         [0.0, 0.0, 0.0])
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_convergence_ablation.py"), "--out",
                           str(main), "--merge", str(other)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = read_rows(main)
    assert len(rows) == 5 and rows[row_key(ROWS[3])]["held_out_loss"] == 9.0
    assert row_key({**ROWS[4], "optimizer": "adamw"}) in rows
