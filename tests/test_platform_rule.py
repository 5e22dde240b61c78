"""The platform rule of re-execution (issue 42): a 1% cheat is caught whatever platform it claims, and an
honest member on other kernels is never accused.

A short run (tiny, 2 stages, 2 rounds, H=3) is trained once in a child under ``ATEN_CPU_CAPABILITY=default``
by an honest replica and one that adds a 1% perturbation to its update (training.reexec_sim.PerturbedReplica).
Its contributions are then judged here by :func:`node.tools.audit_reexec.rerun_by_rule`, the rule
``dlx-node audit --reexecute`` applies: as recorded (the claimant's platform: rerun exactly, in a child
under the claimant's capability where this process's is another), and relabelled as trained on another CPU
model (the claimant claims a platform this verifier cannot emulate: judged by the three-zone tolerance).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from node.live.checks.spotcheck import parse_result
from node.tools.audit_reexec import how_judged, rerun_by_rule
from training.declaration import NO_PLATFORM, declared_platform_problem, platform_hash
from training.fingerprint import (
    EXACT, MISMATCH, RULE_CROSS_PLATFORM, RULE_SAME_PLATFORM, UNDECIDED, WITHIN_TOLERANCE, fingerprint,
)
from training.claimant_kernels import native_cpu_capability
from training.reexec import ContributionClaim
from training.replica_state import ReplicaStartState, parse_stage_state

ROOT = Path(__file__).resolve().parents[1]
OVERRIDES = ["model.preset=tiny", "pipeline.num_stages=2", "diloco.num_replicas=2", "diloco.inner_steps=3",
             "training.batch_size=4", "training.warmup_steps=2", "compression.min_compress_numel=512"]
HONEST, CHEAT = 0, 1
CLAIMANT = """
import pickle, sys, torch
from node.config import load_config
from training.data import corpus_from_config
from training.reexec_sim import PerturbedReplica, SimConfig, SimReplica, run_with_states
torch.set_num_threads(1)
cfg = load_config(None, sys.argv[2:])
sim = SimConfig(corpus_from_config(cfg.training, cfg.model), cfg.model, cfg.training, cfg.diloco,
                cfg.compression, cfg.pipeline.num_stages, rounds=2)
records = run_with_states([SimReplica(0, sim), PerturbedReplica(1, sim)], sim)
open(sys.argv[1], "wb").write(pickle.dumps([
    {"round": r.outer_round, "contributions": r.contributions, "claims": r.claims,
     "states": {i: [p.to_bytes() for p in s.stages] for i, s in r.states.items()}} for r in records]))
"""
OTHER_CPU = "Intel(R) Xeon(R) Platinum 8480+ (not this CPU)"


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """The run's records, trained under the DEFAULT kernels on 1 thread, and the configuration."""
    from node.config import load_config
    from training.data import corpus_from_config

    path = tmp_path_factory.mktemp("rule") / "run.pkl"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", CLAIMANT, str(path), *OVERRIDES], env=env,
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    cfg = load_config(None, OVERRIDES)
    return pickle.loads(path.read_bytes()), cfg, corpus_from_config(cfg.training, cfg.model)


def relabelled(parts: list[bytes], claims: list[ContributionClaim], **platform_changes):
    """The same start state and claims, as if the claimant had declared another platform from the start."""
    state = ReplicaStartState(tuple(parse_stage_state(p) for p in parts))
    stages = tuple(dataclasses.replace(part, meta=dataclasses.replace(
        part.meta, platform=dataclasses.replace(part.meta.platform, **platform_changes)))
                   for part in state.stages)
    new_claims = [dataclasses.replace(claim, state_hash=stages[claim.stage_index].state_hash())
                  for claim in claims]
    return [part.to_bytes() for part in stages], new_claims


def judge(default_run, outer_round: int, replica: int, **platform_changes):
    records, cfg, corpus = default_run
    record = records[outer_round]
    parts, claims = record["states"][replica], record["claims"][replica]
    if platform_changes:
        parts, claims = relabelled(parts, claims, **platform_changes)
    return rerun_by_rule(parts, claims, corpus, cfg.model, cfg.training, cfg.diloco, cfg.compression,
                         outer_round=outer_round, replica=replica, run_rounds=len(records),
                         previous_contributions=records[outer_round - 1]["contributions"] if outer_round
                         else None)


def claimed_platform(default_run, outer_round: int, replica: int):
    return parse_stage_state(default_run[0][outer_round]["states"][replica][0]).meta.platform


def test_on_the_claimants_platform_the_rerun_is_exact_or_emulated(default_run):
    """Claimed DEFAULT on this CPU model: this process reruns it itself if it runs DEFAULT, else in a child
    under ``ATEN_CPU_CAPABILITY=default``; bit-exact either way, so the 1% cheat is a mismatch (round 1: it
    applies round 0's contributions first, and its rerun chains on)."""
    outer_round = 1
    assert claimed_platform(default_run, outer_round, HONEST).capability == "DEFAULT"
    expected = "exact" if torch.backends.cpu.get_cpu_capability() == "DEFAULT" else "emulated"
    honest = judge(default_run, outer_round, HONEST)
    assert (honest.verdict, honest.rule, how_judged(honest)) == (EXACT, RULE_SAME_PLATFORM, expected), \
        honest.reason
    assert honest.next_state_hashes is not None  # an exact rerun chains into the next round
    cheat = judge(default_run, outer_round, CHEAT)
    assert (cheat.verdict, cheat.rule, how_judged(cheat)) == (MISMATCH, RULE_SAME_PLATFORM, expected), \
        cheat.reason
    assert cheat.failed_stages == (0, 1)


@pytest.mark.parametrize("outer_round", [0, 1])
def test_a_cheat_claiming_another_platform_never_passes(default_run, outer_round):
    """The cheat claims a CPU this verifier cannot emulate: judged by the tolerance, it is a mismatch or
    undecided (no verdict: it needs a verifier of that platform), never within tolerance."""
    cheat = judge(default_run, outer_round, CHEAT, device_name=OTHER_CPU)
    assert (cheat.rule, how_judged(cheat)) == (RULE_CROSS_PLATFORM, "tolerance"), cheat.reason
    assert cheat.verdict in (MISMATCH, UNDECIDED), cheat.reason
    assert not cheat.honest
    honest = judge(default_run, outer_round, HONEST, device_name=OTHER_CPU)
    assert max(cheat.distances.values()) > 100 * max(max(honest.distances.values()), 1e-9)


@pytest.mark.parametrize("outer_round", [0, 1])
def test_an_honest_member_on_other_kernels_is_not_accused(default_run, outer_round):
    """Trained under DEFAULT, rerun here under this process's kernels as another CPU model's claim: never a
    mismatch (a tiny run's honest cross-capability distance is far below the pass bound)."""
    honest = judge(default_run, outer_round, HONEST, device_name=OTHER_CPU)
    assert honest.rule == RULE_CROSS_PLATFORM and how_judged(honest) == "tolerance", honest.reason
    assert honest.verdict in (EXACT, WITHIN_TOLERANCE), honest.reason
    assert honest.next_state_hashes is None  # no chain from another platform's rerun


def test_a_claimed_platform_must_be_the_declared_one(default_run):
    """A member declares its platform on chain when it joins (the hash of its fingerprint); claiming another
    in a round (to reach the tolerance in the round it cheats) is a failure of its own, whatever the rerun
    gives."""
    fingerprint_0 = claimed_platform(default_run, 0, CHEAT)
    declared = platform_hash(fingerprint_0)
    assert len(declared) == 32 and declared != NO_PLATFORM
    # one platform for the whole run
    assert platform_hash(claimed_platform(default_run, 1, CHEAT)) == declared
    assert declared_platform_problem(claimed_platform(default_run, 1, CHEAT), declared) is None
    moved = dataclasses.replace(fingerprint_0, device_name=OTHER_CPU)
    assert platform_hash(moved) != declared
    why = declared_platform_problem(moved, declared)
    assert why is not None and OTHER_CPU in why and declared.hex()[:16] in why
    for field, value in (("capability", "AVX512"), ("torch", "9.9.9"), ("precision", "bf16")):
        assert declared_platform_problem(dataclasses.replace(fingerprint_0, **{field: value}),
                                         declared) is not None
    assert "claims no platform" in declared_platform_problem(None, declared)
    assert "declared no platform" in declared_platform_problem(fingerprint_0, NO_PLATFORM)
    assert "declared no platform" in declared_platform_problem(None, NO_PLATFORM)
    assert "32-byte" in declared_platform_problem(fingerprint_0, declared[:31])
    # no declaration could be read: nothing to hold it to
    assert declared_platform_problem(moved, None) is None


def test_the_native_capability_is_at_least_this_processs():
    from training.claimant_kernels import CPU_CAPABILITY_LEVELS, capability_to_emulate

    native, ours = native_cpu_capability(), str(torch.backends.cpu.get_cpu_capability())
    if ours in CPU_CAPABILITY_LEVELS:
        assert CPU_CAPABILITY_LEVELS[native] >= CPU_CAPABILITY_LEVELS[ours]
    here = fingerprint(torch.device("cpu"), "fp32")
    # an auditor started under DEFAULT reruns a native claim of its own CPU model under the native kernels
    lowered = dataclasses.replace(here, capability="DEFAULT")
    claim = dataclasses.replace(here, capability=native)
    assert capability_to_emulate(claim, lowered, native) == (None if native == "DEFAULT" else native.lower())
    assert capability_to_emulate(claim, lowered) is None  # without knowing the CPU's own: only lower levels


def test_an_undecided_spot_check_accuses_nobody():
    """The node's view of the child's result: undecided is neither honest nor a failure to accuse."""
    result = parse_result(
        b'{"verdict": "undecided", "reason": "r", "distances": {"0": 1e-3}, "seconds": 1.0}')
    assert result.undecided and not result.honest and not result.elsewhere
    with pytest.raises(Exception, match="verdict"):
        parse_result(b'{"verdict": "maybe", "reason": "r", "distances": {}, "seconds": 1.0}')
