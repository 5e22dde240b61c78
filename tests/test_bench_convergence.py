"""bench/bench_convergence.py's table and the results page's seed-noise section (issue 46): a run at another
seed is set beside its seed-0 row and is never a method's best (a lucky seed is no method, and no weaker DDP
baseline)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from results_convergence import seed_spread  # noqa: E402

from bench.bench_convergence import VARIANTS, seed_of, table  # noqa: E402


def _row(mode: str, variant: str, loss: float) -> dict:
    return {"case": "llama-xs", "mode": mode, "variant": variant, "family": "llama", "num_params": 127_264,
            "tokens": 192_000, "held_out_loss": loss, "bytes_per_token": 4.0 if mode == "ddp" else 0.004,
            "replicas": 2}


RUNS = [
    _row("ddp", "muon", 2.0), _row("ddp", "muon-seed1", 1.9), _row("ddp", "muon-ilr0.5", 2.1),
    _row("diloco", "muon-olr1.0-om0.7", 2.1), _row("diloco", "muon-olr1.0-om0.7-seed1", 1.9),
    _row("diloco_x", "muon", 2.2), _row("diloco_x", "muon-seed1", 2.09), _row("diloco_x", "muon-ilr2", 2.16),
]


def test_the_inner_lr_and_seed_variants_change_only_their_setting():
    assert VARIANTS["muon-ilr2"]["training"] == {"optimizer": "muon", "inner_lr": 6e-3}
    assert VARIANTS["muon-olr1.0-om0.7-ilr0.5"]["diloco"] == {"outer_lr": 1.0, "outer_momentum": 0.7}
    assert VARIANTS["muon-olr1.0-om0.7-seed2"]["training"] == {"optimizer": "muon", "seed": 2}
    assert seed_of("muon-seed1") == 1 and seed_of("muon-ilr2") == 0 and seed_of("adamw") == 0


def test_a_seed_row_is_never_the_best_nor_the_baseline():
    rows = {row["mode"]: row for row in table(RUNS)}
    assert rows["ddp"]["best_variant"] == "muon" and rows["ddp"]["held_out_loss"] == 2.0
    assert rows["diloco"]["best_variant"] == "muon-olr1.0-om0.7"
    assert abs(rows["diloco"]["gap_vs_ddp"] - 0.05) < 1e-12
    assert rows["diloco_x"]["best_variant"] == "muon-ilr2"  # a tuned inner lr can be a method's best
    assert "muon-seed1" in rows["diloco_x"]["variants"]  # still listed among the variants measured


def test_the_seed_section_gives_each_seeds_gap_and_the_spread():
    text = "\n".join(seed_spread({"runs": RUNS}))
    assert "| llama-xs | 1 | 1.9000 | 1.9000 | 2.0900 | +0.00% | +10.00% |" in text
    assert "sync DiLoCo `muon-olr1.0-om0.7` +0.00% to +5.00% (mean +2.50%, spread 5.00 points)" in text
    assert "DiLoCoX `muon` +10.00% to +10.00%" in text
    # A mode without its run at a seed: a "-" there, and the other mode's spread still given.
    partial = "\n".join(
        seed_spread({"runs": [r for r in RUNS if r["variant"] != "muon-seed1" or r["mode"] == "ddp"]}))
    assert "| llama-xs | 1 | 1.9000 | 1.9000 | - | +0.00% | - |" in partial
    assert "sync DiLoCo `muon-olr1.0-om0.7` +0.00% to +5.00%" in partial and "DiLoCoX `muon`" not in partial
    # Without DDP at the seeds there is nothing to compare.
    assert seed_spread({"runs": [r for r in RUNS if r["mode"] != "ddp"]}) == []
