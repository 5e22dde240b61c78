"""The claimant's kernels here: which ATen CPU capability and BLAS kernels a verifier runs to rerun a replica
bit for bit on the kernels the replica declared (its :class:`training.fingerprint.PlatformFingerprint`;
docs/GPU.md)."""

from __future__ import annotations

import os

import torch

from training.errors import PlatformError
from training.fingerprint import PlatformFingerprint, blas_environment

#: ATen's x86 CPU capabilities (``torch.backends.cpu.get_cpu_capability()``) by level: a CPU that has one
#: runs every lower one, chosen at process start by ``ATEN_CPU_CAPABILITY=<name in lower case>``.
CPU_CAPABILITY_LEVELS = {"DEFAULT": 0, "AVX2": 1, "AVX512": 2}


CAPABILITY_ENV = "ATEN_CPU_CAPABILITY"


def native_cpu_capability() -> str:
    """The highest ATen CPU capability this CPU has (what torch picks without ``ATEN_CPU_CAPABILITY``), from
    the CPU's flags (x86 Linux: ``/proc/cpuinfo``; ATen's AVX512 needs avx512f, bw, vl and dq), and never
    below this process's own. Elsewhere (ARM, no /proc) this process's capability."""
    ours = str(torch.backends.cpu.get_cpu_capability())
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        return ours
    native = "AVX512" if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags else \
        "AVX2" if {"avx2", "fma"} <= flags else "DEFAULT" if flags else ours
    levels = CPU_CAPABILITY_LEVELS
    if ours not in levels or levels[ours] > levels[native]:
        return ours
    return native


def capability_to_emulate(claimed: PlatformFingerprint | None, here: PlatformFingerprint,
                          native: str | None = None) -> str | None:
    """The ``ATEN_CPU_CAPABILITY`` under which a rerun on this machine uses the claimant's own CPU kernels, or
    None when there is none to choose (issue 42).

    The inner steps are bit-exact only under the claimant's kernels (torch's vectorised GELU, softmax,
    LayerNorm and AdamW round differently per instruction set; docs/DILOCOX.md section 11). A float32 or
    bfloat16 CPU claim made on this CPU model with this torch build, under a capability other than this
    process's but one this CPU has (``native``: the CPU's highest, default ``here``'s capability; an auditor
    started under ``ATEN_CPU_CAPABILITY=default`` passes :func:`native_cpu_capability` and so reruns an AVX2
    claim under AVX2), can be rerun under that capability: its fingerprint is then the claimant's, and
    :func:`compare_rerun` demands the bit-exact rerun instead of a tolerance (bench/results/reexec_isa.json).
    """
    if claimed is None or claimed.compiled or claimed.device_type != "cpu" or here.device_type != "cpu":
        return None
    if (
        claimed.capability == here.capability
        or claimed.device_name != here.device_name
        or claimed.torch != here.torch
    ):
        return None
    top = native if native is not None and CPU_CAPABILITY_LEVELS.get(native, -1) >= CPU_CAPABILITY_LEVELS.get(
        here.capability, -1) else here.capability
    level, ours = CPU_CAPABILITY_LEVELS.get(claimed.capability), CPU_CAPABILITY_LEVELS.get(top)
    if level is None or ours is None or level > ours:
        return None
    return claimed.capability.lower()


def kernels_to_emulate(claimed: PlatformFingerprint | None, here: PlatformFingerprint,
                       native: str | None = None) -> dict[str, str | None] | None:
    """The environment a child of this process needs to rerun a CPU claim under the claimant's own kernels,
    or None where this process's own are the claimant's or none can be chosen here.

    Two things choose them besides the CPU model and the torch build (which must be equal): ATen's
    instruction set (:func:`capability_to_emulate`) and the math libraries' code path (the fingerprint's
    ``blas``, :data:`BLAS_DISPATCH_ENV`). The result maps variable names to the value the child must see,
    or to None for a variable it must not have; apply it with :func:`emulated_environment`.
    """
    if claimed is None or claimed.device_type != "cpu" or here.device_type != "cpu":
        return None
    if claimed.compiled or claimed.device_name != here.device_name or claimed.torch != here.torch:
        # a compiled claim: inductor's own kernels, not shown to follow these settings bit for bit
        return None
    if claimed.capability == here.capability and claimed.blas == here.blas:
        return None
    settings: dict[str, str | None] = {}
    if claimed.capability != here.capability:
        capability = capability_to_emulate(claimed, here, native)
        if capability is None:
            return None
        settings[CAPABILITY_ENV] = capability
    if claimed.blas != here.blas:
        try:
            settings.update(blas_environment(claimed.blas))
        except PlatformError:
            return None
    return settings


def emulated_environment(settings: dict[str, str | None], environ=None) -> dict[str, str]:
    """A copy of ``environ`` (default: this process's) with ``settings`` (:func:`kernels_to_emulate`) applied.
    """
    env = dict(os.environ if environ is None else environ)
    for name, value in settings.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def describe_kernels(settings: dict[str, str | None]) -> str:
    """``ATEN_CPU_CAPABILITY=avx2, MKL_CBWR=COMPATIBLE``: the variables ``settings`` sets (unset ones left
    out), or "this process's kernels" where it sets none."""
    shown = [f"{name}={value}" for name, value in sorted(settings.items()) if value is not None]
    return ", ".join(shown) or "the libraries' own dispatch"
