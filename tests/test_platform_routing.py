"""Version-2 platform declarations and routing by emulation (issue 42, docs/DILOCOX.md section 11).

A declaration is 31 bytes of the platform's family (CPU model, torch build, device, precision, ...) and one
byte of instruction sets (the one the member trains under, the highest its CPU has), so routing can tell from
the chain alone which verifiers rerun a claim bit-exactly: the same platform, or the same family on a CPU that
has the claimant's instruction set (it reruns under the claimant's kernels). Pure functions, tested without a
network; the one subprocess is a real process under another ``ATEN_CPU_CAPABILITY``.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import random
import subprocess
import sys

import pytest

from node.live.checks.routing import draw_checks, routed_verifiers
from training.declaration import (
    EXACT_ONLY,
    NO_PLATFORM,
    can_judge,
    declared_platform_problem,
    declares,
    family_hash,
    platform_declaration,
    platform_hash,
    read_declaration,
)
from training.fingerprint import PlatformFingerprint
from training.claimant_kernels import capability_to_emulate
from training.reexec import sample_replicas

MODEL, OTHER = "Some CPU Model @ 2.00GHz", "Another CPU Model @ 3.00GHz"


def cpu(capability: str, device_name: str = MODEL, **changes) -> PlatformFingerprint:
    base = PlatformFingerprint(device_type="cpu", device_name=device_name, capability=capability,
                               precision="fp32", torch="2.13.0+cpu", cuda="", cudnn="", deterministic=False,
                               cudnn_deterministic=False, tf32=False)
    return dataclasses.replace(base, **changes)


GPU = PlatformFingerprint(device_type="cuda", device_name="NVIDIA H100", capability="sm_90", precision="bf16",
                          torch="2.13.0", cuda="12.8", cudnn="91000", deterministic=True,
                          cudnn_deterministic=True, tf32=False)


def test_a_declaration_holds_the_family_and_the_instruction_sets():
    avx2 = platform_declaration(cpu("AVX2"), "AVX512")
    assert len(avx2) == 32 and avx2[:31] == family_hash(cpu("AVX2")) == family_hash(cpu("DEFAULT"))
    assert avx2[31] == 0x32  # native AVX512 (3), trained AVX2 (2)
    read = read_declaration(avx2)
    assert (read.trained, read.native, read.emulatable) == (2, 3, True)
    assert platform_declaration(cpu("AVX2"))[31] == platform_declaration(cpu("AVX2"), "DEFAULT")[31] == 0x22
    assert platform_declaration(cpu("AVX2"), "NEON")[31] == 0x22  # a native outside the levels adds nothing
    for changed in (cpu("AVX2", OTHER), cpu("AVX2", precision="bf16"), cpu("AVX2", torch="2.12.0+cpu")):
        assert family_hash(changed) != family_hash(cpu("AVX2"))
    # Not emulatable: the capability is part of the family, and only an equal declaration judges it
    for platform in (GPU, cpu("SVE256")):
        declared = platform_declaration(platform, "AVX512")
        assert declared[31] == EXACT_ONLY << 4 | EXACT_ONLY and not read_declaration(declared).emulatable
    assert family_hash(cpu("SVE256")) != family_hash(cpu("NEON"))

    # Both versions name the platform; neither names another one (the native is no part of a claim)
    for claimed in (cpu("AVX2"), cpu("DEFAULT"), GPU):
        assert declares(platform_declaration(claimed, "AVX512"), claimed) and declares(platform_hash(claimed),
                                                                                       claimed)
        assert declared_platform_problem(claimed, platform_declaration(claimed, "AVX512")) is None
        assert declared_platform_problem(claimed, platform_hash(claimed)) is None
    assert not declares(avx2, cpu("DEFAULT")) and not declares(avx2, cpu("AVX512"))
    assert not declares(avx2, cpu("AVX2", OTHER)) and not declares(NO_PLATFORM, cpu("AVX2"))
    why = declared_platform_problem(cpu("DEFAULT"), avx2)
    assert "the same CPU model and build under AVX2" in why and avx2.hex()[:16] in why
    why = declared_platform_problem(cpu("AVX2", OTHER), avx2)
    assert OTHER in why and "same CPU model" not in why


def test_bytes_that_are_no_version_2_declaration_are_read_as_such_never_a_crash():
    assert read_declaration(NO_PLATFORM) is None and read_declaration(b"\x22" * 31) is None
    for last in (0x00, 0x23, 0x40, 0x3F, 0xF3, 0xAA):  # a zero code, native below trained, unknown, mixed
        assert read_declaration(b"\x11" * 31 + bytes([last])) is None
    rng = random.Random(42)
    for _ in range(2000):
        junk = rng.randbytes(rng.choice((31, 32, 32, 32, 33)))
        read_declaration(junk)
        assert can_judge(junk, NO_PLATFORM) is False
        assert can_judge(junk, junk) is (len(junk) == 32 and junk != NO_PLATFORM)
        why = declared_platform_problem(cpu("AVX2"), junk)
        assert why is not None and ("32-byte" in why) == (len(junk) != 32)


def test_routing_agrees_with_the_rerun_a_verifier_would_make():
    """can_judge(verifier's declaration, claimant's) exactly when the verifier's rerun has the claimant's
    fingerprint (compare_rerun's bit-exact rule: its own kernels, or the claimant's by
    capability_to_emulate) and the same precision; never for another CPU model, build or a GPU."""
    levels = ("DEFAULT", "AVX2", "AVX512")
    platforms = [cpu(capability, name, precision=precision, torch=build)
                 for capability, name, precision, build in itertools.product(
                     levels, (MODEL, OTHER), ("fp32", "bf16"), ("2.13.0+cpu", "2.12.0+cpu"))] + [GPU,
                                                                                                 cpu("NEON")]
    checked = 0
    for claim, here in itertools.product(platforms, platforms):
        for native in levels:
            if here.device_type != "cpu" or here.capability not in levels \
                    or levels.index(native) < levels.index(
                    here.capability):
                continue
            emulated = capability_to_emulate(claim, here, native)
            rerun = dataclasses.replace(here, capability=emulated.upper() if emulated else here.capability)
            exact = rerun == claim
            assert can_judge(platform_declaration(here, native), platform_declaration(claim)) == exact, \
                (claim, here)
            checked += 1
        assert can_judge(platform_declaration(GPU), platform_declaration(claim)) == (claim == GPU)
        # version 1: equality only
        assert can_judge(platform_hash(here), platform_hash(claim)) == (here == claim)
        assert not can_judge(platform_hash(here), platform_declaration(claim))
        assert not can_judge(platform_declaration(here, "AVX512"), platform_hash(claim))
    assert checked > 500


# ----------------------------------------------------------------------------- the routed draw

DECLARED = {
    "peer-0": platform_declaration(cpu("AVX2"), "AVX2"),  # the claimant
    "peer-1": platform_declaration(cpu("AVX512"), "AVX512"),  # same model, a CPU with more: emulates AVX2
    "peer-2": platform_declaration(cpu("DEFAULT"), "DEFAULT"),  # same model, AVX2 masked (a VM): cannot
    "peer-3": platform_declaration(cpu("AVX2", OTHER), "AVX2"),  # another CPU model
    "peer-4": platform_declaration(cpu("AVX2", precision="bf16"), "AVX2"),  # another precision
    "peer-5": platform_hash(cpu("AVX2")),  # a version-1 declaration of peer-0's platform
    "peer-6": NO_PLATFORM,
}


def _signers(n: int) -> dict[int, set[str]]:
    return {replica: {f"peer-{replica}"} for replica in range(n)}


def test_a_verifier_of_the_same_model_and_build_that_can_emulate_the_claim_is_routed():
    signers = _signers(7)
    assert routed_verifiers(0, signers, DECLARED) == ["peer-1"]  # not peer-2 (lacks AVX2), 3, 4 or 5
    # DEFAULT: both of its model emulate it
    assert routed_verifiers(2, signers, DECLARED) == ["peer-0", "peer-1"]
    assert routed_verifiers(1, signers, DECLARED) == []  # nobody else has AVX512
    for replica in (3, 4, 5, 6):
        assert routed_verifiers(replica, signers, DECLARED) == []
    rounds, by_routed, everyone = 1000, {r: 0 for r in range(7)}, {r: 0 for r in range(7)}
    for outer_round in range(rounds):
        record = outer_round.to_bytes(32, "big")
        for verifier in range(7):
            for check in draw_checks(record, f"peer-{verifier}", outer_round, signers, DECLARED, 1.0,
                                     verifier):
                assert check.replica != verifier
                everyone[check.replica] += 1
                if f"peer-{verifier}" in routed_verifiers(check.replica, signers, DECLARED):
                    by_routed[check.replica] += 1
                elif check.same_platform:
                    raise AssertionError(f"peer-{verifier} routed to replica {check.replica} it cannot judge")
    assert by_routed[0] == rounds  # peer-1 alone emulates peer-0's AVX2: every round
    assert 0.9 * rounds < by_routed[2] < 1.1 * rounds  # about one per round by peer-0 or peer-1
    for replica in (1, 3, 4, 5, 6):  # the plain draw only: 6 verifiers at 1/6 each
        assert by_routed[replica] == 0 and 0.85 * rounds < everyone[replica] < 1.15 * rounds


def test_one_family_under_one_instruction_set_routes_nothing_beyond_the_plain_draw():
    signers = _signers(5)
    declared = {f"peer-{i}": platform_declaration(cpu("AVX2"), "AVX2") for i in range(5)}
    for outer_round in range(40):
        record = bytes([outer_round]) * 32
        for verifier in range(5):
            drawn = draw_checks(record, f"peer-{verifier}", outer_round, signers, declared, 1.0, verifier)
            plain = sample_replicas(record, f"peer-{verifier}".encode(), outer_round, range(5), 1.0 / 4,
                                    own_replica=verifier)
            assert [d.replica for d in drawn] == plain and not any(d.same_platform for d in drawn)


def test_the_routed_draw_is_the_same_whatever_order_signers_and_declarations_were_heard_in():
    signers = {0: {"peer-0", "peer-6"}, 1: {"peer-1"}, 2: {"peer-2", "peer-4"}, 3: {"peer-3", "peer-5"}}
    rng = random.Random(11)
    for outer_round in range(25):
        record = rng.randbytes(32)
        for own, peers in signers.items():
            for verifier in sorted(peers):
                expected = draw_checks(record, verifier, outer_round, signers, DECLARED, 1.0, own)
                for _ in range(3):
                    heard_signers = {replica: set(rng.sample(sorted(members), len(members)))
                                     for replica, members in rng.sample(sorted(signers.items()),
                                                                        len(signers))}
                    heard = dict(rng.sample(sorted(DECLARED.items()), len(DECLARED)))
                    assert draw_checks(record, verifier, outer_round, heard_signers, heard, 1.0,
                                       own) == expected
    # replica 2's signers declared DEFAULT and bf16: peer-0 and peer-1 emulate the DEFAULT one
    assert routed_verifiers(2, signers, DECLARED) == ["peer-0", "peer-1"]


def test_a_node_under_a_lower_instruction_set_declares_it_and_its_cpu_s_own():
    """Real processes of this machine under two instruction sets (``ATEN_CPU_CAPABILITY=default`` and the
    CPU's own) declare one family, each its own trained level and both this CPU's native level, so each is
    routed to the other (each reruns the other's claims under its kernels)."""
    import torch

    from node.config import load_config
    from node.platforms import own_platforms
    from training.fingerprint import fingerprint
    from training.claimant_kernels import native_cpu_capability

    native = native_cpu_capability()
    if native == "DEFAULT":
        pytest.skip("this CPU has no instruction set above DEFAULT to compare with")
    here, legacy_here = own_platforms(load_config(None, ["training.device=cpu"]).training)
    assert legacy_here == platform_hash(fingerprint(torch.device("cpu"), "fp32"))
    ours = str(torch.backends.cpu.get_cpu_capability())
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    if ours != "DEFAULT":  # this process runs the CPU's own (or a middle) level: the other one runs DEFAULT
        env["ATEN_CPU_CAPABILITY"] = "default"
    script = (
        "import json, torch; from node.config import load_config; from node.platforms import own_platforms; "
        "print(json.dumps([str(torch.backends.cpu.get_cpu_capability())] + [d.hex() for d in "
        "own_platforms(load_config(None, ['training.device=cpu']).training)]))")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                         check=True)
    theirs, other, other_legacy = json.loads(out.stdout.strip().splitlines()[-1])
    other, other_legacy = bytes.fromhex(other), bytes.fromhex(other_legacy)
    assert theirs != ours and "DEFAULT" in (theirs, ours)
    assert other[:31] == here[:31] and other != here and other_legacy != legacy_here
    mine, its = read_declaration(here), read_declaration(other)
    assert mine.native == its.native == {"AVX2": 2, "AVX512": 3}[native]
    assert {mine.trained, its.trained} == {1, {"AVX2": 2, "AVX512": 3}[theirs if ours == "DEFAULT" else ours]}
    assert can_judge(here, other) and can_judge(other, here)
