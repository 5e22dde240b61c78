"""The calibration of bench/bench_gpu.py (``--calibrate``): honest and cheating rerun distances per precision
and device, and their summary under the platform rule (training.fingerprint.compare_rerun)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import time

import torch

from training.config import PRECISIONS, DilocoConfig, ModelConfig, TrainingConfig
from training.config_compression import CompressionConfig
from training.data import corpus_from_config
from training.fingerprint import CROSS_PLATFORM_TOLERANCE, TOLERANCE_PASS_BOUND, compare_rerun, fingerprint
from training.reexec import contribution_distance, reexecute
from training.reexec_sim import PerturbedReplica, SimConfig, SimReplica, run_with_states
from training.replica_state import ReplicaStartState
from training.stages import split_stages, stage_param_shapes

#: Fingerprints standing for "the claimant's platform is not the verifier's" in the calibration's summary.
CPU_HERE = fingerprint(torch.device("cpu"), "fp32")
CPU_OTHER = dataclasses.replace(CPU_HERE, device_name="another platform")
CPU_HERE16, CPU_OTHER16 = (dataclasses.replace(f, precision="bf16") for f in (CPU_HERE, CPU_OTHER))


def _with_precision(state: ReplicaStartState, precision: str) -> ReplicaStartState:
    """The same start state, as if the claimant had trained in ``precision`` (the rerun follows the state)."""
    return ReplicaStartState(tuple(
        dataclasses.replace(part, meta=dataclasses.replace(
            part.meta, platform=dataclasses.replace(part.meta.platform, precision=precision)))
        for part in state.stages))


def _rerun_distance(record, replica, previous, sim: SimConfig, *, device: str, threads: int,
                    precision: str | None = None) -> tuple[float, float]:
    """(largest stage distance, seconds) of rerunning ``replica``'s round of ``record``."""
    state = record.states[replica]
    if precision is not None:
        state = _with_precision(state, precision)
    training = dataclasses.replace(sim.training, device=device)
    started = time.perf_counter()
    rerun = reexecute(state, sim.corpus, sim.model, training, sim.diloco, sim.compression,
                      previous_contributions=previous, threads=threads)
    specs = split_stages(sim.model.n_layer, sim.num_stages)
    distance = max(
        contribution_distance(claim.payload, rerun.payloads[claim.stage_index],
                              stage_param_shapes(sim.model, specs[claim.stage_index]),
                              stage_index=claim.stage_index, outer_round=record.outer_round)
        for claim in record.claims[replica])
    return distance, time.perf_counter() - started


def calibrate(args: argparse.Namespace) -> dict:
    """Honest and cheating rerun distances per precision (module docstring)."""
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    model = ModelConfig(preset=args.preset)
    rows = []
    for claimant_device in devices:
        for precision in PRECISIONS:
            for seed in range(args.seeds):
                training = TrainingConfig(seed=seed, batch_size=args.batch_size,
                                          warmup_steps=args.warmup_steps, device=claimant_device,
                                          precision=precision)
                corpus = corpus_from_config(training, model)
                sim = SimConfig(corpus, model, training,
                                DilocoConfig(inner_steps=args.inner_steps, num_replicas=2),
                                CompressionConfig(min_compress_numel=args.min_compress_numel), args.stages,
                                args.rounds)
                torch.set_num_threads(1)  # claimants train on 1 thread; reruns on 1 (same) and 2 (other)
                started = time.perf_counter()
                records = run_with_states([SimReplica(0, sim), PerturbedReplica(1, sim)], sim)
                print(f"claimant {claimant_device} {precision} seed {seed}: {args.rounds} rounds in "
                      f"{time.perf_counter() - started:.0f}s", flush=True)
                for record in records:
                    previous = records[record.outer_round - 1].contributions if record.outer_round else None
                    reruns = [("same", claimant_device, 1, None), ("threads", claimant_device, 2, None)]
                    reruns += [("device", other, 1, None) for other in devices if other != claimant_device]
                    reruns.append(("precision", claimant_device, 1, "fp32" if precision == "bf16"
                                   else "bf16"))
                    for kind, device, threads, swapped in reruns:
                        for replica, role in ((0, "honest"), (1, "cheat")):
                            if role == "cheat" and kind in ("same", "precision"):
                                # the cheat is judged across platforms (its worst case); "same" is exact
                                continue
                            distance, seconds = _rerun_distance(record, replica, previous, sim, device=device,
                                                                threads=threads, precision=swapped)
                            rows.append({"claimant_device": claimant_device, "precision": precision,
                                         "seed": seed, "round": record.outer_round, "role": role,
                                         "rerun": kind, "rerun_device": device, "rerun_threads": threads,
                                         "rerun_precision": swapped or precision, "distance": distance,
                                         "seconds": seconds})
                            print(f"  round {record.outer_round} {role:<6} rerun {kind:<9} on {device} "
                                  f"{threads}t {swapped or precision}: {distance:.3g}", flush=True)
    return {"args": vars(args), "model_params": sum(math.prod(s) for s in _shapes(model)),
            "summary": summarize_calibration(rows), "rows": rows}


def summarize_calibration(rows: list[dict]) -> dict:
    """Per precision: the largest honest distance of each kind of rerun, the cheats', and the tolerance
    rule."""
    summary = {}
    for precision in PRECISIONS:
        mine = [r for r in rows if r["precision"] == precision]

        def worst(role, kinds):
            values = [r["distance"] for r in mine if r["role"] == role and r["rerun"] in kinds]
            return max(values) if values else None

        cheats = [r["distance"] for r in mine if r["role"] == "cheat"]
        honest_cross = [v for v in (worst("honest", ("threads",)), worst("honest", ("device",)))
                        if v is not None]
        # The rule docs/GPU.md states: 3x the largest honest cross-platform distance seen, which must stay
        # below the smallest cheat distance for the tolerance to separate them.
        suggested = 3 * max(honest_cross) if honest_cross else None
        summary[precision] = {
            "same_platform_max": worst("honest", ("same",)),
            "other_threads_max": worst("honest", ("threads",)),
            "other_device_max": worst("honest", ("device",)),
            "other_precision_max": worst("honest", ("precision",)),
            "cheat_min": min(cheats) if cheats else None,
            "cheats_below_tolerance": sum(1 for d in cheats if d <= CROSS_PLATFORM_TOLERANCE[precision]),
            "cheats": len(cheats),
            # issue 42's three zones (training.fingerprint.compare_rerun) for a claim on another platform:
            # every cheat row is a rerun on other threads or another device, judged as such
            "rule_pass_bound": TOLERANCE_PASS_BOUND[precision],
            "rule_cheats": _zones([r["distance"] for r in mine if r["role"] == "cheat"], precision),
            "rule_honest_cross": _zones([r["distance"] for r in mine if r["role"] == "honest"
                                         and r["rerun"] in ("threads", "device")], precision),
            # None: no mismatch bound across platforms (bf16, training/fingerprint.py)
            "tolerance_in_force": (CROSS_PLATFORM_TOLERANCE[precision]
                                   if math.isfinite(CROSS_PLATFORM_TOLERANCE[precision]) else None),
            "suggested_tolerance": suggested,
            "suggested_separates": None if suggested is None or not cheats else suggested < min(cheats),
            "measured_devices": sorted({r["rerun_device"] for r in mine} | {r["claimant_device"]
                                                                                for r in mine}),
        }
    return summary


def _zones(distances: list[float], precision: str) -> dict[str, int]:
    """How many of ``distances`` the three zones pass, leave undecided, or call a mismatch (another
    platform)."""
    verdicts = [compare_rerun(CPU_OTHER, CPU_HERE, d, claimed_threads=1, rerun_threads=1).verdict
                if precision == "fp32" else compare_rerun(CPU_OTHER16, CPU_HERE16, d, claimed_threads=1,
                                                          rerun_threads=1).verdict for d in distances]
    return {name: verdicts.count(name) for name in ("exact", "within_tolerance", "undecided", "mismatch")}


def _shapes(model: ModelConfig):
    for spec in split_stages(model.n_layer, 1):
        yield from stage_param_shapes(model, spec).values()
