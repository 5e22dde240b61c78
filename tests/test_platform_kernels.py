"""Which CPU kernels a rerun uses: the claimant's, where this CPU has them (issue 42)."""

from __future__ import annotations

import dataclasses

import torch

from training.platform import (
    EXACT,
    MISMATCH,
    RULE_SAME_PLATFORM,
    capability_to_emulate,
    compare_rerun,
    fingerprint,
)


def cpu(capability: str, **changes):
    here = fingerprint(torch.device("cpu"), "fp32")
    return dataclasses.replace(here, capability=capability, **changes)


def test_a_lower_capability_of_this_cpu_model_is_emulated():
    assert capability_to_emulate(cpu("DEFAULT"), cpu("AVX2")) == "default"
    assert capability_to_emulate(cpu("AVX2"), cpu("AVX512")) == "avx2"
    assert capability_to_emulate(cpu("DEFAULT"), cpu("AVX512")) == "default"


def test_nothing_to_emulate_for_the_same_kernels_a_higher_level_another_cpu_or_build():
    assert capability_to_emulate(cpu("AVX2"), cpu("AVX2")) is None  # already the claimant's kernels
    assert capability_to_emulate(cpu("AVX512"), cpu("AVX2")) is None  # this CPU lacks them
    assert capability_to_emulate(cpu("DEFAULT", device_name="Other CPU"), cpu("AVX2")) is None
    assert capability_to_emulate(cpu("DEFAULT", torch="0.0.0"), cpu("AVX2")) is None
    assert capability_to_emulate(cpu("NEON"), cpu("AVX2")) is None  # not an x86 level
    assert capability_to_emulate(None, cpu("AVX2")) is None  # a state from before fingerprints
    gpu = dataclasses.replace(cpu("DEFAULT"), device_type="cuda")
    assert capability_to_emulate(gpu, cpu("AVX2")) is None


def test_under_the_emulated_kernels_the_same_platform_rule_applies():
    """A rerun under the claimant's capability has the claimant's fingerprint: bit-exact is demanded, so a
    distance a cross-platform tolerance would let through (a 1% cheat's, 3.4e-4 at tiny) is a mismatch."""
    claimed = cpu("DEFAULT")
    judged = compare_rerun(claimed, claimed, 3.4e-4, claimed_threads=1, rerun_threads=1)
    assert judged.rule == RULE_SAME_PLATFORM and judged.verdict == MISMATCH
    assert compare_rerun(claimed, claimed, 0.0, claimed_threads=1, rerun_threads=1).verdict == EXACT
