"""A reproducible run's claims rerun and judged in this process: run by tests/test_reproducible.py in children
under several ``ATEN_CPU_CAPABILITY`` values, thread counts and ``MKL_CBWR`` settings, which compare what they
print.

    python tests/repro_probe.py RUN.pkl THREADS     # prints one JSON object
    python tests/repro_probe.py - THREADS           # the fresh inner steps only
    python tests/repro_probe.py RUN.pkl THREADS --reruns-only   # the spot checks only
    python tests/repro_probe.py - THREADS --v3-only  # kernel version 3's fresh steps and codec only

``RUN.pkl`` (written by the test): the run's config overrides and, per round, the start states, claims and
contributions of the test's claimants. Printed: the capability and threads, the weights hash of two fresh
inner steps of each (preset, optimizer) of :data:`FRESH` in the reproducible mode on ``THREADS`` threads with
kernel versions 1 and 2 (``training.reproducible_kernels``; and of GPT-2 in the normal mode), the payloads'
hash of each encoder on fixed inputs in the reproducible codec
(and of "v2" in the normal one; training/exact_probe.py), and every spot check's verdict, rule and whether
its next state chains into the claimant's next round, each rerun as the audit reruns it (``rerun_by_rule``:
here; a reproducible run needs no child for the claimant's kernels).
"""

from __future__ import annotations

import json
import pickle
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from training.exact_probe import ENCODERS, FRESH, codec_bytes, fresh_steps  # noqa: E402


def main(run_path: str, threads: int, fresh: bool = True, v3_only: bool = False) -> dict:
    torch.set_num_threads(threads)
    from node.config import load_config
    from training.data import corpus_from_config
    from node.tools.audit_reexec import rerun_by_rule
    from training.reexec import check_state_chain

    out: dict = {"capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
                 "checks": []}
    if fresh and v3_only:  # what a child on another MKL path is compared on (versions 1 and 2 take its root)
        out.update({"fresh_v3": {f"{p}/{o}": fresh_steps(p, o, kernels=3) for p, o in FRESH},
                    "codec": {encoder: codec_bytes(encoder) for encoder in ENCODERS}})
    elif fresh:
        out.update({"fresh": {f"{p}/{o}": fresh_steps(p, o) for p, o in FRESH},
                    "fresh_v2": {f"{p}/{o}": fresh_steps(p, o, kernels=2) for p, o in FRESH},
                    "fresh_v3": {f"{p}/{o}": fresh_steps(p, o, kernels=3) for p, o in FRESH},
                    "normal": fresh_steps("tiny", "adamw", reproducible=False),
                    "codec": {encoder: codec_bytes(encoder) for encoder in ENCODERS},
                    "codec_v2": {encoder: codec_bytes(encoder, kernels=2) for encoder in ENCODERS},
                    "codec_normal": codec_bytes("v2", exact=False)})
    if run_path == "-":
        return out
    run = pickle.loads(Path(run_path).read_bytes())
    cfg = load_config(None, run["overrides"])
    corpus = corpus_from_config(cfg.training, cfg.model)
    records = run["records"]
    started = time.perf_counter()
    for index, record in enumerate(records):
        previous = records[index - 1]["contributions"] if index > 0 else None
        for replica, parts in sorted(record["states"].items()):
            check = rerun_by_rule(  # as `dlx-node audit --reexecute` reruns a claim
                parts, record["claims"][replica], corpus, cfg.model, cfg.training, cfg.diloco,
                cfg.compression, outer_round=record["round"], replica=replica, run_rounds=len(records),
                previous_contributions=previous)
            chain = None
            if index + 1 < len(records) and check.next_state_hashes is not None:
                claimed = [claim.state_hash for claim in records[index + 1]["claims"][replica]]
                chain = check_state_chain(check.next_state_hashes, claimed)
            out["checks"].append({"round": record["round"], "replica": replica, "verdict": check.verdict,
                                  "rule": check.rule, "how": check.how, "chain": chain})
    out["rerun_s"] = round(time.perf_counter() - started, 1)  # the reruns alone, as the audit's
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]), fresh="--reruns-only" not in sys.argv[3:],
                          v3_only="--v3-only" in sys.argv[3:])))
