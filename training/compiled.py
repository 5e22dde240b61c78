"""Compiled inner steps (``training.compile``, issue 42): torch.compile's inductor on the trainer's stage
modules.

A compiled replica's arithmetic is not eager's bit for bit (inductor fuses operations and reorders
reductions), so compiling is part of the platform: the fingerprint's ``compiled`` field names the compiler
(:func:`compiler_identity`), a compiled member declares another platform than an eager one, and a rerun of its
inner steps is bit-exact only when it runs compiled too, with the same compiler (docs/DILOCOX.md section 11,
"Compiled inner steps"). This module only says whether and how this machine compiles; training.fingerprint
puts that in the fingerprint and training.pipeline compiles the modules.
"""

from __future__ import annotations

import functools
import os
import subprocess

from training.errors import TrainingConfigError

INDUCTOR = "inductor"


@functools.cache
def _cpp_compiler() -> str:
    """``g++-12.2.0``: the C++ compiler inductor builds CPU kernels with and its version, "" if none runs."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        compiler = get_cpp_compiler()
        done = subprocess.run([compiler, "-dumpfullversion", "-dumpversion"], capture_output=True, text=True,
                              timeout=60, check=False)
    except (ImportError, OSError, RuntimeError, subprocess.TimeoutExpired):
        return ""
    words = done.stdout.split() if done.returncode == 0 else []
    return f"{os.path.basename(compiler)}-{words[0]}" if words else ""


def _triton() -> str:
    try:
        import triton
    except ImportError:
        return ""
    return f"triton-{triton.__version__}"


def compile_problem(device_type: str) -> str | None:
    """Why torch.compile cannot compile the inner steps on a ``device_type`` ("cpu", "cuda") device here, or
    None."""
    if device_type == "cpu":
        if not _cpp_compiler():
            return (
                "training.compile = true: inductor found no working C++ compiler for CPU kernels; install "
                "g++ (or set CXX) or set training.compile = false"
            )
        return None
    if not _triton():
        return ("training.compile = true: inductor needs Triton for CUDA kernels; install it or set "
                "training.compile = false")
    return None


def compiler_identity(device_type: str) -> str:
    """What decides a compiled replica's kernels besides the rest of its fingerprint:
    ``inductor;cc=g++-12.2.0`` on a CPU (inductor writes C++ that this compiler builds: another version may
    vectorise otherwise), and ``inductor;triton=triton-3.5.0`` on a GPU (Triton generates the kernels). Raises
    TrainingConfigError where this machine cannot compile (:func:`compile_problem`)."""
    problem = compile_problem(device_type)
    if problem is not None:
        raise TrainingConfigError(problem)
    tool = f"cc={_cpp_compiler()}" if device_type == "cpu" else f"triton={_triton()}"
    return f"{INDUCTOR};{tool}"


def compiler_ok(value) -> bool:
    """Whether ``value`` is a fingerprint's ``compiled`` field :func:`compiler_identity` could have written.
    """
    return isinstance(value, str) and value.startswith(f"{INDUCTOR};") and len(value) <= 200 and \
        all("!" <= c <= "~" for c in value)


def set_compile_deterministic() -> None:
    """Settings (process-wide) under which a compiled replica's bits depend on its inputs, thread count and
    fingerprint only: inductor's deterministic mode (no on-device benchmarking, whose pick among kernels could
    differ between two processes), and an error, never a silent fall back to eager kernels (another
    platform's bits under a compiled claim), where dynamo would stop compiling after too many recompilations;
    errors during compilation are raised, not suppressed."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    inductor_config.deterministic = True
    dynamo_config.suppress_errors = False
    dynamo_config.fail_on_recompile_limit_hit = True


def forget_compiled() -> None:
    """Drop every graph this process compiled (``torch._dynamo.reset``). Inductor bakes the intra-op thread
    count into its CPU kernels and dynamo does not guard on it, so a rerun under the claimant's thread count
    must not reuse a graph compiled under another (nor may training reuse the rerun's afterwards); inductor's
    on-disk cache keys on the thread count, so compiling again is mostly a cache read."""
    import torch._dynamo

    torch._dynamo.reset()


def compile_modules(modules) -> None:
    """Compile each module's forward in place (``nn.Module.compile``: the state dict keeps its names); the
    backward is compiled with it (AOTAutograd). Each compiles at its first call, for static shapes
    (``dynamic=False``): with dynamo's automatic dynamic shapes, the graph a shape gets would depend on the
    shapes the process saw before (a claimant that evaluated first could train on a dynamic-shape graph, its
    verifier on a static one)."""
    for module in modules:
        module.compile(dynamic=False)

