"""``bench/bench_reproducible.py --audit --audit-cheats``: the 1% cheat and the one-ulp cheat in one inner
step of a run with the demo's own configuration, trained under one ATen instruction set and convicted
under each of several (issue 64: "a 1% cheat and a one-ulp cheat in one inner step both convicted across
platforms").

A demo node has no fault injection, so the cheats are simulated replicas (``training.reexec_sim``, as
tests/test_reproducible.py's): the run's model, training (``training.reproducible = true``, its kernel
version), DiLoCo and compression settings are read from the demo's ``r0/node.toml``; the run has three
replicas (an honest one, the control, and one per cheat: ``diloco.num_replicas = 3``) and two rounds. In
round 0 :class:`OneStepCheat` tampers with inner step ``--audit-cheat-step`` (default the last, where no
later step amplifies the change): ``"percent"`` makes that step's update 1% larger, ``"ulp"`` moves the
first weight to the next float32 up. The run is recorded in a child under ``--audit-train`` (a pickle: the
start states, claims and contributions); then, per capability, a child reruns every round-0 claim as
``dlx-node audit --reexecute`` does (``rerun_by_rule``, in-process) and checks that the rerun's next state
is the state round 1's claims bind (the chain). Demanded: the honest claim ``exact`` and chained; each cheat
convicted: its rerun a ``mismatch``, or, where the codec's quantisation hides the change, its next state
not where the exact rerun leads (``state_mismatch``).

    python bench/repro_cheats.py record NODE_TOML STEP OUT.pkl     # a child: the run, under its capability
    python bench/repro_cheats.py rerun OUT.pkl                      # a child: prints one JSON object
"""

from __future__ import annotations

import dataclasses
import json
import math
import pickle
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from training.exact_probe import child_env  # noqa: E402
from training.reexec_sim import SimReplica  # noqa: E402

KINDS = ("honest", "percent", "ulp")  # replica index -> what it does in round 0
ROUNDS = 2


class OneStepCheat(SimReplica):
    """Tampers with inner step ``step`` of round 0: ``"percent"`` makes that step's update 1% larger,
    ``"ulp"`` moves the first weight of the first stage to the next float32 up; ``"honest"`` neither."""

    def __init__(self, replica, sim, kind: str, step: int) -> None:
        super().__init__(replica, sim)
        self.kind, self.step = kind, step

    def train(self, outer_round, first_step, end_step):
        for step in range(first_step, end_step):
            params = [p for module in self.trainer.stage_modules for p in module.parameters()]
            before = [p.detach().clone() for p in params] if self.kind == "percent" else []
            super().train(outer_round, step, step + 1)
            if (outer_round, step) != (0, self.step) or self.kind == "honest":
                continue
            with torch.no_grad():
                if self.kind == "percent":
                    for param, old in zip(params, before):
                        param.add_((param - old) * 0.01)
                else:
                    first = params[0].view(-1)
                    first[0] = torch.nextafter(first[0], torch.tensor(math.inf))


def cheat_config(node_toml: str | Path):
    """The demo's run settings with three replicas (an honest one and one per cheat)."""
    from node.config import load_config

    cfg = load_config(Path(node_toml))
    if not cfg.training.reproducible:
        raise SystemExit(f"{node_toml}: not a reproducible run (training.reproducible = false)")
    return cfg, dataclasses.replace(cfg.diloco, num_replicas=len(KINDS))


def record(node_toml: str, step: int, out: str) -> None:
    """Train the cheat run here (the caller's capability, one thread) and pickle what a rerun needs."""
    from training.data import corpus_from_config
    from training.reexec_sim import SimConfig, run_with_states

    torch.set_num_threads(1)
    cfg, diloco = cheat_config(node_toml)
    if not 0 <= step < diloco.inner_steps:
        raise SystemExit(f"--audit-cheat-step {step}: not an inner step (H = {diloco.inner_steps})")
    sim = SimConfig(corpus_from_config(cfg.training, cfg.model), cfg.model, cfg.training, diloco,
                    cfg.compression, cfg.pipeline.num_stages, rounds=ROUNDS)
    replicas = [OneStepCheat(index, sim, kind, step) for index, kind in enumerate(KINDS)]
    records = run_with_states(replicas, sim)
    run = {"node_toml": str(node_toml), "step": step,
           "records": [{"round": r.outer_round, "claims": r.claims,
                        "states": {replica: [part.to_bytes() for part in state.stages]
                                   for replica, state in r.states.items()}} for r in records]}
    Path(out).write_bytes(pickle.dumps(run))


def rerun(run_path: str) -> dict:
    """Every round-0 claim rerun as the audit reruns it, and its next state checked against round 1's."""
    from node.tools.audit_reexec import rerun_by_rule
    from training.data import corpus_from_config
    from training.reexec import check_state_chain

    torch.set_num_threads(1)
    run = pickle.loads(Path(run_path).read_bytes())
    cfg, diloco = cheat_config(run["node_toml"])
    corpus = corpus_from_config(cfg.training, cfg.model)
    first, second = run["records"]
    checks = []
    started = time.perf_counter()
    for replica, parts in sorted(first["states"].items()):
        check = rerun_by_rule(parts, first["claims"][replica], corpus, cfg.model, cfg.training, diloco,
                              cfg.compression, outer_round=0, replica=replica, run_rounds=ROUNDS,
                              previous_contributions=None)
        chain = None
        if check.next_state_hashes is not None:
            chain = check_state_chain(check.next_state_hashes,
                                      [claim.state_hash for claim in second["claims"][replica]])
        checks.append({"replica": replica, "kind": KINDS[replica], "verdict": check.verdict,
                       "rule": check.rule, "how": check.how, "chain": chain})
    return {"capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
            "rerun_s": round(time.perf_counter() - started, 1), "checks": checks}


def convicted(checks: list[dict]) -> dict[str, bool]:
    """Per kind, whether the audit's judgement is right: the honest claim exact and chained (no false
    accusation), each cheat a mismatch or a broken chain."""
    from training.fingerprint import EXACT, MISMATCH
    from training.reexec import STATE_MISMATCH

    right = {}
    for check in checks:
        if check["kind"] == "honest":
            right["honest"] = (check["verdict"], check["chain"], check["how"]) == (EXACT, EXACT, "exact")
        else:
            right[check["kind"]] = check["verdict"] == MISMATCH or check["chain"] == STATE_MISMATCH
    return right


def run_cheat_bench(repo: Path, node_toml: Path, workdir: Path, train: str, under: list[str], step: int,
                    threads: int) -> dict:
    """The cheat run recorded under ``train``, then rerun under each of ``under``; the ``cheats`` block."""
    run_path = workdir / "cheats.pkl"
    started = time.perf_counter()
    subprocess.run([sys.executable, __file__, "record", str(node_toml), str(step), str(run_path)],
                   env=child_env(repo, train, 1, None), check=True, timeout=3600, cwd=repo)
    record_s = round(time.perf_counter() - started, 1)
    print({"cheats_recorded_s": record_s}, flush=True)
    reruns = []
    for capability in under:
        started = time.perf_counter()
        done = subprocess.run([sys.executable, __file__, "rerun", str(run_path)], capture_output=True,
                              text=True, env=child_env(repo, capability, threads, None), timeout=3600,
                              cwd=repo)
        if done.returncode != 0:
            raise SystemExit(f"the cheats' rerun under {capability} failed:\n{done.stderr[-4000:]}")
        out = json.loads(done.stdout.strip().splitlines()[-1])
        reruns.append({"capability": capability, "aten": out["capability"], "threads": out["threads"],
                       "seconds": round(time.perf_counter() - started, 1), "rerun_s": out["rerun_s"],
                       "checks": out["checks"], "right": convicted(out["checks"])})
        print(reruns[-1], flush=True)
    return {"replicas": list(KINDS), "rounds": ROUNDS, "cheat_round": 0, "cheat_step": step,
            "trained_under": train, "record_seconds": record_s, "reruns": reruns,
            "honest_exact": all(row["right"].get("honest") for row in reruns),
            "every_cheat_convicted": all(row["right"].get(kind) for row in reruns for kind in KINDS[1:])}


if __name__ == "__main__":
    if sys.argv[1] == "record":
        record(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        print(json.dumps(rerun(sys.argv[2])))
