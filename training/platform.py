"""Where a replica trains and in which precision (issue 32).

Device and precision are node settings (``training.device``, ``training.precision``),
decided once at the edge by :func:`prepare_platform`; the model code below never
asks which device it runs on. What may differ per node and what may not
(docs/GPU.md):

* **may differ**: the inner steps. They run on the node's device (CPU or a CUDA
  GPU), in float32 or in bfloat16 autocast, eager or compiled (``training.compile``,
  training/compiled.py: the fingerprint's ``compiled``). Master weights and the inner
  AdamW state stay float32 on that device.
* **must not**: everything the record and the audit depend on. The pseudo-gradient
  leaves the device as float32 (``training.stage_engine.StageEngine`` copies the live
  weights to the host before it subtracts them from the round start); the codec,
  the robust aggregation, the outer Nesterov step and every hash run on the CPU in
  float32, in exactly the code and order they always did. Every node therefore derives
  the same weights root from the same contributions, whatever hardware its replica
  trained on, and ``dlx-node audit`` replays the outer steps bit-exactly anywhere.

How a rerun on another machine is judged (a replica's :class:`~training.fingerprint.PlatformFingerprint`,
:func:`~training.fingerprint.compare_rerun`) is training/fingerprint.py's.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

import torch

from training.compiled import compile_problem, set_compile_deterministic
from training.config import check_device_spec, check_precision
from training.errors import PlatformError
from training.exact_mode import ExactKernels
from training.fingerprint import PlatformFingerprint, fingerprint

logger = logging.getLogger(__name__)

AUTO = "auto"

#: cuBLAS needs this before its first call for deterministic matrix products
#: (https://docs.nvidia.com/cuda/cublas/index.html#results-reproducibility).
CUBLAS_WORKSPACE = ":4096:8"


# ----------------------------------------------------------------------------- device and precision


def resolve_device(spec: str) -> torch.device:
    """The torch device ``spec`` names on this machine: ``"auto"`` is the first GPU if CUDA works, else the
    CPU.

    A CUDA device this machine does not have is a :class:`PlatformError` that says what it has.
    """
    spec = check_device_spec(spec)
    if spec == AUTO:
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        built = "this torch is a CPU build" if torch.version.cuda is None else "no CUDA device is visible"
        raise PlatformError(f"training.device={spec!r}: {built} (torch {torch.__version__}); "
                            "use \"cpu\" or \"auto\"")
    index = 0 if spec == "cuda" else int(spec.split(":")[1])
    count = torch.cuda.device_count()
    if index >= count:
        raise PlatformError(
            f"training.device={spec!r}: this machine has {count} CUDA device(s) (cuda:0..cuda:{count - 1})"
        )
    return torch.device("cuda", index)


def autocast(device: torch.device, precision: str):
    """The context the forward pass (and loss) runs in: bfloat16 autocast, or nothing for float32."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def set_deterministic(device: torch.device) -> None:
    """Deterministic kernels where torch offers them, on a CUDA device (process-wide settings).

    cuBLAS workspace config (only effective before cuBLAS starts: :func:`prepare_platform`
    runs before the first model is built), ``torch.use_deterministic_algorithms(True)``,
    cuDNN deterministic and not benchmarking, and no TF32: "fp32" means float32 products.
    Not ``warn_only``: with it, torch keeps the non-deterministic kernel of an op that has
    both (memory-efficient attention, which float32 attention uses on CUDA) and only warns,
    and a same-platform rerun, which must be bit-exact, would then accuse an honest member.
    An op with no deterministic CUDA kernel at all raises instead, naming the op.
    On the CPU nothing changes: torch's CPU kernels used here are deterministic for a fixed
    thread count, which the start state records, and float32 CPU runs keep their bits.
    """
    if device.type != "cuda":
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


@dataclass(frozen=True)
class Platform:
    """A node's training device and precision, resolved, and whether its inner steps run compiled."""

    device: torch.device
    precision: str
    compiled: bool = False
    #: ``training.reproducible``: the forward pass runs the fixed-order kernels (training/exact_mode.py).
    reproducible: bool = False
    #: ``training.reproducible_kernels``: the version of its matrix products (training/exact_kernel.py).
    kernels: int = 1
    #: A node of N processes' ``fsdp2;ranks=N`` (training/cluster_replica.py), "" for one process.
    cluster: str = ""

    def autocast(self):
        """The context of the forward pass: bfloat16 autocast, the fixed-order kernels of the reproducible
        mode (:class:`~training.exact_mode.ExactKernels`), or nothing."""
        if self.reproducible:
            return ExactKernels(self.kernels)
        return autocast(self.device, self.precision)

    def fingerprint(self) -> PlatformFingerprint:
        return fingerprint(self.device, self.precision, self.compiled, self.cluster)


_PROCESS_PLATFORM: Platform | None = None


def prepare_platform(
    device: str, precision: str, compiled: bool = False, reproducible: bool = False, kernels: int = 1,
    cluster: str = "",
) -> Platform:
    """Resolve ``training.device``/``training.precision``/``training.compile`` and set the process up for it
    (call at the edge).

    Sets deterministic algorithms for CUDA (:func:`set_deterministic`) and records the
    platform as this process's training platform (:func:`process_platform`): torch's
    determinism flags are process-wide, and a node trains one replica on one device.
    ``compiled``: the inner steps run through torch.compile; raises PlatformError where it cannot compile
    here (:func:`compile_problem`), and sets inductor's deterministic mode (no on-device benchmarking, whose
    pick of a kernel could differ between two processes and so break a same-platform rerun).
    ``reproducible``: the forward pass runs the fixed-order kernels (:meth:`Platform.autocast`; float32 only),
    of version ``kernels`` (``training.reproducible_kernels``). ``cluster``: the inner steps run on N
    processes (``fsdp2;ranks=N``, training/cluster_replica.py; "" for one).
    """
    global _PROCESS_PLATFORM
    if reproducible and (precision != "fp32" or compiled):
        raise PlatformError("training.reproducible computes float32 eagerly: not in bf16, not compiled")
    resolved = Platform(
        resolve_device(device), check_precision(precision), bool(compiled), bool(reproducible), int(kernels),
        cluster)
    set_deterministic(resolved.device)
    if resolved.compiled:
        problem = compile_problem(resolved.device.type)
        if problem is not None:
            raise PlatformError(problem)
        set_compile_deterministic()
    _PROCESS_PLATFORM = resolved
    return resolved


def process_platform() -> Platform:
    """The platform the last :func:`prepare_platform` of this process set (the CPU in float32 before any)."""
    return _PROCESS_PLATFORM or Platform(torch.device("cpu"), "fp32")
