"""Which CPU kernels a rerun uses: the claimant's, where this CPU has them (issue 42)."""

from __future__ import annotations

import dataclasses

import torch

from training.fingerprint import EXACT, MISMATCH, RULE_SAME_PLATFORM, compare_rerun, fingerprint
from training.claimant_kernels import capability_to_emulate


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


#: /proc/cpuinfo of an aarch64 Linux (two Neoverse N1 cores, as an AWS Graviton2 shows them), abridged.
ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop \
asimddp ssbs
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x3
CPU part\t: 0xd0c
CPU revision\t: 1

processor\t: 1
BogoMIPS\t: 243.75
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x3
CPU part\t: 0xd0c
CPU revision\t: 1
"""


def test_an_arm_cpu_model_is_its_cores_implementer_and_part():
    """An aarch64 kernel writes no "model name": the model is the cores' MIDR implementer:part, so two ARM
    core types (whose BLAS may pick other kernels) have other fingerprints, not both "aarch64"."""
    from training.fingerprint import cpu_model_name

    assert cpu_model_name(ARM_CPUINFO) == "arm64 0x41:0xd0c"
    assert cpu_model_name(ARM_CPUINFO.replace("0xd0c", "0xd40")) == "arm64 0x41:0xd40"  # Neoverse V1
    big_little = ARM_CPUINFO.replace("CPU part\t: 0xd0c\nCPU revision\t: 1\n\nprocessor\t: 1",
                                     "CPU part\t: 0xd05\nCPU revision\t: 1\n\nprocessor\t: 1")
    assert cpu_model_name(big_little) == "arm64 0x41:0xd05+0x41:0xd0c"
    assert cpu_model_name("processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t: fpu avx2\n") \
        == "AMD EPYC 7B13"
    assert cpu_model_name("") == ""
    here = fingerprint(torch.device("cpu"), "fp32")
    assert here.device_name and here.device_name != "aarch64"
