"""A node's and a spot check's rerun child's peak memory per phase, one process at a time (issue 75: "host
RAM per node bounded"; docs/SCALE.md, "Memory per held parameter").

    nice -n 15 python bench/bench_stage_memory.py [--presets llama-20m,llama-124m] [--node-stages 0,1]
        [--child llama-20m] [--job DIR] [--inner-steps 4] [--rounds 3] [--workdir /tmp/dlx-stagemem]
        [--baseline OLD.json --baseline-commit C] [--outer-state disk|ram] [--compare-outer-state llama-20m]

bench/bench_scale_system.py measures a whole demo's nodes (four nodes and their children beside each other
on a loaded machine); this script measures what one of them holds, phase by phase, alone:

- ``node``: one stage of a 2-stage replica as a node holds it (the demo's settings: vocabulary 32,000,
  sequences of 128, batches of 2, the new-run codec, one-step delay), through ``--rounds`` rounds in the
  node's order (node/live/worker/contributor.py): the start state's capture (copies spilled to a file,
  training/spilled.py), its write (``StartStateCapture.write``), the inner steps, the apply of the previous
  round (the stage's own contribution and another replica's), the prepare and the encode of this round's,
  and the finisher's heap trim; each in a fresh child process per stage; the engine's outer state (global
  weights, momentum, snapshots, residual) in files as the node keeps it by default (``--outer-state disk``,
  ``storage.outer_state``: training/stage_engine_outer.py) or in RAM (``ram``); ``--compare-outer-state``
  measures the listed presets' node stages the other way too (``nodes_outer_state_<other>``);
- ``child``: a spot check's rerun child (``node.live.checks.spotcheck.run_job``, what the rerun worker runs)
  on a real job: replica 0's round 1 of the same run (two stages, both replicas' round-0 contributions as the
  previous round), built first in a separate process by reruns of the same code (the claims are what an
  honest node sends: the verdict must be ``exact``).

Each phase's peak is the kernel's peak resident set (``VmHWM``, reset at each phase's start by writing 5 to
``/proc/self/clear_refs``), so a phase's figure is exact, not sampled; it is reported above the process's
resident set before the model was built (imports, the interpreter), in bytes and in bytes per parameter the
process holds (a node: its stage; the child: the whole replica); each phase's wall seconds summed over the
rounds (``seconds``: on a shared machine, a rough figure). ``--baseline`` keeps an earlier commit's
run of this script in the result as the before. Writes bench/results/stage_memory.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.benchio import default_out, write_result  # noqa: E402

VOCAB, SEQ, BATCH, STAGES, REPLICAS = 32000, 128, 2, 2, 2


def _status(key: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


class Phases:
    """Peak resident bytes per phase: ``VmHWM`` reset at each phase's start (``clear_refs`` 5)."""

    def __init__(self) -> None:
        self.peaks: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self.stack: list[str] = []
        self.base = _status("VmRSS")
        self.since = time.perf_counter()

    def _close(self) -> None:
        now = time.perf_counter()
        if self.stack:
            name = self.stack[-1]
            self.peaks[name] = max(self.peaks.get(name, 0), _status("VmHWM"))
            self.seconds[name] = self.seconds.get(name, 0.0) + now - self.since
        self.since = now
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")

    def enter(self, name: str) -> None:
        self._close()
        self.stack.append(name)

    def leave(self) -> None:
        self._close()
        self.stack.pop()

    def run(self, name: str, executor, function):
        """``function()`` counted under ``name``, on ``executor``'s thread (None: this one), waited for."""
        self.enter(name)
        try:
            return function() if executor is None else executor.submit(function).result()
        finally:
            self.leave()

    def wrap(self, owner, attribute: str, name: str) -> None:
        """Count every call of ``owner.attribute`` under ``name``."""
        function = getattr(owner, attribute)

        def counted(*args, **kwargs):
            self.enter(name)
            try:
                return function(*args, **kwargs)
            finally:
                self.leave()

        setattr(owner, attribute, counted)

    def report(self, parameters: int) -> dict:
        phases = {name: {"peak_rss_bytes": peak, "above_base_bytes": peak - self.base,
                         "bytes_per_parameter": round((peak - self.base) / parameters, 1),
                         "seconds": round(self.seconds.get(name, 0.0), 2)}
                  for name, peak in self.peaks.items()}
        top = max(self.peaks.values())
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return {"cpu_seconds": round(usage.ru_utime + usage.ru_stime, 1),
                "parameters": parameters, "base_rss_bytes": self.base, "peak_rss_bytes": top,
                "peak_bytes_per_parameter": round((top - self.base) / parameters, 1), "phases": phases}


def _settings(preset: str, inner_steps: int, rounds: int, data_dir: Path) -> list[str]:
    from training.config_compression import new_run_compression_settings

    return [f"model.preset={preset}", f"model.vocab_size={VOCAB}", f"model.block_size={SEQ}",
            f"training.batch_size={BATCH}", f"diloco.inner_steps={inner_steps}", f"rounds={rounds}",
            f"pipeline.num_stages={STAGES}", f"diloco.num_replicas={REPLICAS}", f"data_dir={data_dir}",
            *new_run_compression_settings()]


def inner_steps(module, optimizer, stage: int, tokens, hidden, steps: int) -> None:
    """``steps`` forward, backward and AdamW steps of the stage (stage 0's backward from a fixed output
    gradient, as the pipeline hands one down; the last stage's from the loss)."""
    import torch

    from training.model import lm_loss

    for _ in range(steps):
        if stage == 0:
            out = module(tokens)
            out.backward(torch.ones_like(out) * 1e-3)
            del out
        else:
            lm_loss(module(hidden), tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def measure_node(preset: str, stage: int, steps: int, rounds: int, workdir: Path, outer_state: str) -> dict:
    """One stage through ``rounds`` rounds in the node's order, in this process (``outer_state``: "disk" or
    "ram", the node's ``storage.outer_state``)."""
    import torch

    from node.arenas import limit_arenas, map_large_blocks, trim_heap
    from node.config import load_config
    from training.butterfly import slice_for_exchange
    from training.compression import encode_contribution
    from training.pipeline import make_inner_optimizer
    from training.reexec import round_meta
    from training.replica_capture import StartStateCapture, capture_trainer_part
    from training.stage_engine import StageEngine
    from training.stages import StageModule, split_stages

    limit_arenas()  # as dlx-node start does (node/cli.py)
    map_large_blocks()
    torch.set_num_threads(1)
    cfg = load_config(None, _settings(preset, steps, rounds, workdir))
    generator = torch.Generator().manual_seed(stage)
    phases = Phases()
    module = StageModule(cfg.model, split_stages(cfg.model.n_layer, STAGES)[stage], seed=0)
    params = dict(module.named_parameters())
    parameters = sum(p.numel() for p in params.values())
    # Another replica's contributions, one a round (made before the measured part: small blobs).
    others = []
    for outer_round in range(rounds):
        noise = {name: torch.randn(p.shape, generator=generator) * 1e-3 for name, p in params.items()}
        others.append(encode_contribution(noise, cfg.compression, stage_index=stage,
                                          outer_round=outer_round)[0])
        del noise
    gc.collect()
    trim_heap()
    optimizer = make_inner_optimizer(module, cfg.training)
    engine = StageEngine(stage, params, cfg.diloco, cfg.compression, exact=cfg.training.codec_kernels)
    slice_for_exchange(engine, cfg.diloco)
    spill = workdir / f"spill-{stage}"
    spill.mkdir(parents=True, exist_ok=True)
    engine.spill_dir = spill  # as the node sets it (node/live/worker/contributor.py)
    if outer_state == "disk":  # as the node does when it builds its engines (node/live/worker/replica.py)
        engine.keep_outer_state_in(workdir / f"outer-{stage}")
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    hidden = torch.randn(BATCH, SEQ, cfg.model.n_embd, generator=generator)
    own = {}
    # Each phase on the thread the node runs it on (node/live/worker/contributor.py: the training thread,
    # the lane, the finisher), one after the other, so that each phase's peak is its own: the threads'
    # transients land in glibc's arenas as the node's do (dlx-node limits them to two, node/arenas.py).
    lane, finisher = ThreadPoolExecutor(1), ThreadPoolExecutor(1)
    for outer_round in range(rounds):
        meta = round_meta(outer_round, 0, cfg.model, cfg.diloco, run_rounds=rounds, num_stages=STAGES,
                          micro_batches=1, threads=1)
        capture = phases.run("start_state_capture", None, lambda: StartStateCapture(
            meta, lambda _stage: engine, {stage: capture_trainer_part(module, optimizer, spill)}))

        def write(capture=capture) -> None:
            for path in capture.write(workdir / "states").values():
                path.unlink()

        phases.run("start_state_write", lane, write)
        del capture
        phases.run("inner_steps", None, lambda: inner_steps(module, optimizer, stage, tokens, hidden,
                                                            cfg.diloco.inner_steps))
        if outer_round >= 1:
            payloads = [own.pop(outer_round - 1), others[outer_round - 1]]

            def apply(previous=outer_round - 1, payloads=payloads) -> None:
                prepared = engine.prepare_aggregation(previous, payloads)
                engine.apply_round(previous, payloads, prepared=prepared)
                del prepared
                gc.collect()
                trim_heap()  # as the finisher does once a round is done (node/live/round/finisher.py)

            phases.run("apply", finisher, apply)
            del payloads
        phases.run("prepare_encode", None, lambda: engine.prepare_encode(outer_round))
        own[outer_round] = phases.run("encode", lane, lambda: engine.encode_contribution(outer_round)[0])
    lane.shutdown()
    finisher.shutdown()
    gc.collect()
    trim_heap()
    held = _status("VmRSS") - phases.base
    return {**phases.report(parameters), "outer_state": outer_state, "held_after_rounds_bytes": held,
            "held_bytes_per_parameter": round(held / parameters, 1)}


def build_job(preset: str, inner_steps: int, rounds: int, workdir: Path) -> Path:
    """Replica 0's round 1 as a spot check's job, its claims made by reruns of the same code (honest)."""
    from node.config import load_config
    from node.live.checks.spotcheck import SpotCheckJob
    from training.data import corpus_from_config
    from training.reexec import NO_APPLY, data_commitment, reexecute, round_meta
    from training.replica_capture import initial_replica_state

    cfg = load_config(None, _settings(preset, inner_steps, rounds, workdir))
    corpus = corpus_from_config(cfg.training, cfg.model)

    def rerun(state, previous=None):
        return reexecute(state, corpus, cfg.model, cfg.training, cfg.diloco, cfg.compression,
                         previous_contributions=previous, threads=1)

    round0 = {}
    for replica in range(REPLICAS):
        meta = round_meta(0, replica, cfg.model, cfg.diloco, run_rounds=rounds, num_stages=STAGES, threads=1)
        done = rerun(initial_replica_state(meta, cfg.model, cfg.training, cfg.diloco, cfg.compression))
        round0[replica] = (done.payloads, done.next_state if replica == 0 else None)
        del done
        gc.collect()
    start = round0[0][1]  # replica 0's start state of round 1
    previous = {stage: [round0[r][0][stage] for r in range(REPLICAS)] for stage in range(STAGES)}
    done = rerun(start, previous)
    data = data_commitment(corpus, cfg.training, cfg.model, cfg.diloco, 0, 1)
    claims = [(part.stage_index, part.state_hash(), data, done.payloads[part.stage_index],
               done.applied_hashes.get(part.stage_index, NO_APPLY)) for part in start.stages]
    job = workdir / f"job-{preset}"
    shutil.rmtree(job, ignore_errors=True)
    SpotCheckJob(cfg.to_dict(), 1, 0, claims, [part.to_bytes() for part in start.stages],
                 previous=previous).write(job)
    return job


def measure_child(job: Path) -> dict:
    """``node.live.checks.spotcheck.run_job`` of ``job`` in this process, phase by phase."""
    import torch

    import training.reexec_rerun as rerun_module
    import training.spot_check as spot_check_module
    from node.arenas import map_large_blocks
    from node.config import config_from_dict
    from node.live.checks.spotcheck import run_job
    from training.model import count_params
    from training.stage_engine import StageEngine

    map_large_blocks()  # as the rerun worker does (node/live/checks/spotcheck.py)
    torch.set_num_threads(1)
    phases = Phases()
    phases.wrap(spot_check_module, "parse_stage_state", "parse")
    phases.wrap(rerun_module, "restore_replica", "restore")
    phases.wrap(rerun_module.RoundRerun, "train", "inner_steps")
    phases.wrap(rerun_module.RoundRerun, "apply", "apply")
    phases.wrap(StageEngine, "encode_contribution", "encode")
    phases.wrap(rerun_module, "capture_replica_state", "next_state")
    phases.enter("other")
    result = run_job(job)
    phases.leave()
    if result["verdict"] != "exact":
        raise SystemExit(f"the rerun's verdict is {result['verdict']} ({result['reason']}), not exact")
    doc = json.loads((job / "job.json").read_text())
    parameters = count_params(config_from_dict(doc["config"]).model)
    return {**phases.report(parameters), "verdict": result["verdict"],
            "state_bytes": sum((job / name).stat().st_size for name in doc["states"])}


def _child(argv: list[str]) -> int:
    kind, preset, stage, inner_steps, rounds, workdir, *outer_state = argv
    workdir = Path(workdir)
    if kind == "node":
        out = measure_node(preset, int(stage), int(inner_steps), int(rounds), workdir, outer_state[0])
    elif kind == "build":
        out = {"job": str(build_job(preset, int(inner_steps), int(rounds), workdir))}
    else:
        out = measure_child(Path(stage))
    print(json.dumps(out))
    return 0


def _in_child(*args) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", *map(str, args)], capture_output=True,
                          text=True, check=False, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise SystemExit(f"{args}: child failed\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _nodes(args, preset: str, workdir: Path, outer_state: str) -> dict:
    """stage -> :func:`measure_node` of each of ``--node-stages``, one child process each, one at a time."""
    nodes = {}
    for stage in [s for s in args.node_stages.split(",") if s]:
        started = time.monotonic()
        nodes[stage] = _in_child("node", preset, stage, args.inner_steps, args.rounds, workdir, outer_state)
        nodes[stage]["seconds"] = round(time.monotonic() - started, 1)
        print(preset, "node stage", stage, outer_state, json.dumps(nodes[stage]), flush=True)
    return nodes


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        return _child(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="llama-20m")
    parser.add_argument("--node-stages", default="0,1", help="stages to measure as a node ('' for none)")
    parser.add_argument("--child", dest="rerun_child", default="",
                        help="presets whose rerun child is measured too (a job built first)")
    parser.add_argument("--inner-steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", default="/tmp/dlx-stagemem")
    parser.add_argument("--job", default="", help="an already built job directory (skips the build)")
    parser.add_argument("--baseline", default="",
                        help="a JSON this script wrote on an earlier commit: kept in this one as the before")
    parser.add_argument("--baseline-commit", default="", help="the commit --baseline ran on")
    parser.add_argument("--outer-state", choices=("disk", "ram"), default="disk",
                        help="where a node's engine keeps its outer state (storage.outer_state)")
    parser.add_argument("--compare-outer-state", default="",
                        help="presets whose node stages are measured with the other --outer-state too")
    parser.add_argument("--out", default=default_out(__file__))
    args = parser.parse_args()
    load = list(os.getloadavg())
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    results = {}
    for preset in [p for p in args.presets.split(",") if p]:
        entry = {"nodes": _nodes(args, preset, workdir, args.outer_state)}
        if preset in args.compare_outer_state.split(","):
            other = "ram" if args.outer_state == "disk" else "disk"
            entry[f"nodes_outer_state_{other}"] = _nodes(args, preset, workdir, other)
        if preset in args.rerun_child.split(","):
            job = args.job or _in_child("build", preset, 0, args.inner_steps, args.rounds, workdir)["job"]
            started = time.monotonic()
            entry["child"] = _in_child("rerun", preset, job, args.inner_steps, args.rounds, workdir)
            entry["child"]["seconds"] = round(time.monotonic() - started, 1)
            print(preset, "child", json.dumps(entry["child"]), flush=True)
        results[preset] = entry
    doc = {"benchmark": "stage_memory", "settings": vars(args), "results": results}
    if args.baseline:
        before = json.loads(Path(args.baseline).read_text())
        doc["baseline"] = {"commit": args.baseline_commit or before["recorded"].get("commit"),
                           "load_average": before["recorded"].get("load_average"),
                           "results": before["results"]}
    write_result(args.out, doc, load)
    return 0


if __name__ == "__main__":
    sys.exit(main())
