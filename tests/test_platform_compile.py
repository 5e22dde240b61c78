"""``training.compile`` enters the platform (issue 42, docs/DILOCOX.md section 11, "Compiled inner steps").

A compiled replica's bits are not eager's, so a compiled member claims and declares another platform: the
fingerprint's ``compiled`` field, left out when eager so every eager fingerprint, declaration, start state and
run document keeps its bytes. Pure functions here; tests/test_training_compile.py compiles for real.
"""

from __future__ import annotations

import dataclasses

import pytest

from node.live.checks.routing import draw_checks, routed_verifiers
from node.runconfig import config_hash, run_document
from training.config import TrainingConfig
from training.declaration import EXACT_ONLY, can_judge, declares, platform_declaration, platform_hash
from training.errors import PlatformError, TrainingConfigError
from training.fingerprint import (
    RULE_CROSS_PLATFORM, RULE_SAME_PLATFORM, MISMATCH, PlatformFingerprint, compare_rerun, parse_fingerprint,
)
from training.claimant_kernels import capability_to_emulate, kernels_to_emulate
from training.reexec import rerun_compiled

CPU = PlatformFingerprint(device_type="cpu", device_name="Some CPU Model @ 2.00GHz", capability="AVX2",
                          precision="fp32", torch="2.13.0+cpu", cuda="", cudnn="", deterministic=False,
                          cudnn_deterministic=False, tf32=False)
GPU = PlatformFingerprint(device_type="cuda", device_name="NVIDIA H100", capability="sm_90", precision="bf16",
                          torch="2.13.0", cuda="12.8", cudnn="91000", deterministic=True,
                          cudnn_deterministic=True, tf32=False)
CPU_COMPILED = dataclasses.replace(CPU, compiled="inductor;cc=g++-12.2.0")
GPU_COMPILED = dataclasses.replace(GPU, compiled="inductor;triton=triton-3.5.0")

#: What the code before ``compiled`` existed (main at ef68df3) gave for CPU and GPU: the version-1 hash and
#: the version-2 declaration with native AVX512. Pinned: an eager platform's declarations must not move.
BEFORE = {
    "cpu": ("f21ea6f3960749e7d1c1da0c74ac26ce84b63fa2c603fc7c5384c49a3134aeba",
            "5a701a941fd0adace3adebeb40889d3938b146a21f5e4e0d4d2f7a66e3071632"),
    "cuda": ("fa91118e6a4a3773079320c85982f742b5a9870a3a1e9cd4466b9606451d3af7",
             "c4c23159de919597103c02ad3ac0c14be34fca9becf01cbfc9aaa951afafe6ff"),
}


def test_eager_fingerprints_keep_their_documents_and_declarations():
    for platform in (CPU, GPU):
        assert "compiled" not in platform.document()
        assert (platform_hash(platform).hex(), platform_declaration(platform, "AVX512").hex()) == \
            BEFORE[platform.device_type]
        assert parse_fingerprint(platform.document()) == platform


@pytest.mark.parametrize("eager,compiled", [(CPU, CPU_COMPILED), (GPU, GPU_COMPILED)])
def test_a_compiled_platform_is_another_platform(eager, compiled):
    assert compiled.document()["compiled"] == compiled.compiled
    assert parse_fingerprint(compiled.document()) == compiled
    assert "compiled" in compiled.describe()
    assert platform_hash(compiled) != platform_hash(eager)
    assert platform_declaration(compiled)[:31] != platform_declaration(eager)[:31]  # another family
    assert not declares(platform_declaration(eager), compiled) \
        and not declares(platform_declaration(compiled), eager)


@pytest.mark.parametrize("value", ["", "inductor", "eager;x", "inductor;cc=g++ 12", "inductor;" + "x" * 200,
                                   True])
def test_a_malformed_compiled_field_is_refused(value):
    with pytest.raises(PlatformError, match="compiled"):
        parse_fingerprint({**CPU.document(), "compiled": value})


def test_a_compiled_cpu_platform_is_judged_by_an_equal_declaration_only():
    declared = platform_declaration(CPU_COMPILED, "AVX512")
    assert declared[31] == EXACT_ONLY << 4 | EXACT_ONLY  # inductor's kernels: no emulation by instruction set
    assert can_judge(declared, declared)
    for other in (CPU, dataclasses.replace(CPU, capability="AVX512"),
                  dataclasses.replace(CPU_COMPILED, capability="AVX512"),
                  dataclasses.replace(CPU_COMPILED, compiled="inductor;cc=g++-13.1.0")):
        assert not can_judge(platform_declaration(other, "AVX512"), declared), other
        assert not can_judge(declared, platform_declaration(other, "AVX512")), other
    here = dataclasses.replace(CPU, capability="AVX512")
    assert capability_to_emulate(CPU_COMPILED, here, "AVX512") is None
    assert kernels_to_emulate(CPU_COMPILED, here, "AVX512") is None
    assert kernels_to_emulate(CPU, here, "AVX512") is not None  # the eager claim is emulated, as before


def test_eager_verifiers_are_never_routed_a_compiled_claim():
    signers = {0: {"compiled-a"}, 1: {"eager-b"}, 2: {"eager-c"}, 3: {"compiled-d"}}
    compiled, eager = platform_declaration(CPU_COMPILED, "AVX2"), platform_declaration(CPU, "AVX2")
    declared = {"compiled-a": compiled, "compiled-d": compiled, "eager-b": eager, "eager-c": eager}
    assert routed_verifiers(0, signers, declared) == ["compiled-d"]
    assert routed_verifiers(1, signers, declared) == ["eager-c"]
    # whatever the draw, an eager verifier's check of replica 0 is never "same platform"
    for outer_round in range(64):
        for verifier in ("eager-b", "eager-c"):
            own = next(r for r, peers in signers.items() if verifier in peers)
            checks = draw_checks(bytes(32), verifier, outer_round, signers, declared, 1.0, own)
            assert all(not c.same_platform for c in checks if c.replica in (0, 3))


def test_an_eager_rerun_of_a_compiled_claim_is_never_held_bit_exact():
    verdict = compare_rerun(CPU_COMPILED, CPU, 0.5, claimed_threads=1, rerun_threads=1)
    assert verdict.rule == RULE_CROSS_PLATFORM and verdict.verdict == MISMATCH  # fp32: beyond 1e-2
    same = compare_rerun(CPU_COMPILED, CPU_COMPILED, 1e-9, claimed_threads=1, rerun_threads=1)
    assert same.rule == RULE_SAME_PLATFORM and same.verdict == MISMATCH  # same platform: any difference
    bf16 = compare_rerun(GPU_COMPILED, GPU, 0.5, claimed_threads=1, rerun_threads=1)
    # bf16 across platforms: never convicts
    assert bf16.rule == RULE_CROSS_PLATFORM and bf16.verdict != MISMATCH


def test_a_rerun_compiles_only_a_compiled_claim():
    assert not rerun_compiled(None, "cpu")
    assert not rerun_compiled(CPU, "cpu")
    assert rerun_compiled(CPU_COMPILED, "cpu")  # this machine has a C++ compiler (inductor's CPU kernels)


def test_compile_is_a_node_setting_off_by_default_outside_the_run_document():
    from node.config import NodeConfig

    assert TrainingConfig().compile is False
    eager, compiled = NodeConfig(), NodeConfig()
    compiled.training = dataclasses.replace(compiled.training, compile=True)
    assert "compile" not in run_document(eager)["training"]
    assert config_hash(run_document(compiled)) == config_hash(run_document(eager))
    with pytest.raises(TrainingConfigError, match="training.compile"):
        TrainingConfig(compile="yes")


def test_a_cluster_split_over_nodes_refuses_compile_at_load_time():
    from node.config import ConfigError, config_from_dict

    table = {"cluster_size": 2, "pipeline": {"num_stages": 2}, "training": {"compile": True}}
    with pytest.raises(ConfigError, match="training.compile"):
        config_from_dict(table)
    table["training"]["compile"] = False
    assert config_from_dict(table).training.compile is False
