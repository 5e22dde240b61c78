"""What decides the bits of a replica's inner steps, and how a rerun on another machine is judged (issue 32).

Device and precision are decided at the edge (training/platform.py); this module describes the platform a
replica trained on (:class:`PlatformFingerprint`, :func:`fingerprint`) and judges a rerun against it.

Re-execution (training/reexec.py) reruns another member's inner steps, which do
depend on the hardware. A start state records the claimant's
:class:`PlatformFingerprint`; :func:`compare_rerun` picks the rule:

* same fingerprint and the same intra-op thread count: the rerun must reproduce
  the payloads bit for bit (any difference is a mismatch). A verifier gets there for a CPU
  claimant of its own CPU model under another instruction set its CPU has by rerunning under the
  claimant's ``ATEN_CPU_CAPABILITY`` (:func:`capability_to_emulate`: "emulated");
* otherwise (another CPU model, a GPU, another library build or thread count): the relative L2
  distance of the decoded pseudo-gradients, judged in three zones (issue 42): at most
  :data:`TOLERANCE_PASS_BOUND` passes, beyond :data:`CROSS_PLATFORM_TOLERANCE` (the largest
  distance an honest rerun on another platform was ever measured at, with margin; none in bf16,
  where honest and cheating distances across platforms overlap) is a mismatch,
  and anything between is :data:`UNDECIDED`: no verdict, nobody accused, the check needs a
  verifier of the claimant's platform (the audit says so and is INCOMPLETE).

A fingerprint is what the claimant says about itself: a cheater can claim a platform the
verifier does not have and so always gets the tolerance rule. The pass bound is therefore set
below the smallest distance of the cheats re-execution must catch (a 1% perturbation of the
update: 3.4e-4 at its smallest, bench/results/gpu_calibration.json), so claiming another platform
never passes such a cheat, it only leaves it undecided; and the spot checks and ``dlx-node audit`` hold a
claimed platform to the one the member declared on chain when it joined (training/declaration.py:
:func:`platform_declaration`, :func:`declared_platform_problem`; docs/DILOCOX.md section 11).
"""

from __future__ import annotations

import math
import os
import platform as host_platform
from dataclasses import asdict, dataclass, fields

import torch

from training.compiled import compiler_identity, compiler_ok
from training.config import PRECISIONS, check_precision
from training.errors import PlatformError

# Verdicts of a re-execution (training.reexec re-exports them).
EXACT = "exact"  # payload bytes identical
WITHIN_TOLERANCE = "within_tolerance"  # decoded pseudo-gradients within the tolerance
MISMATCH = "mismatch"  # the rerun does not reproduce the contribution
# Another platform's rerun lies between the pass bound and the cross-platform tolerance: a small cheat
# and an honest rerun on other kernels cannot be told apart here, so no verdict (nobody accused, not passed).
UNDECIDED = "undecided"

# Rules of compare_rerun.
RULE_SAME_PLATFORM = "same-platform-bit-exact"
RULE_CROSS_PLATFORM = "cross-platform-tolerance"
RULE_UNRECORDED = "unrecorded-platform-tolerance"  # a start state from before fingerprints (float32 CPU runs)
# A run with training.reproducible: its inner steps (training/exact_mode.py) and its codec's encode
# (training/exact_codec.py) give the same bits under every instruction set, thread count, math-library path
# and CPU model, so a rerun on any CPU must reproduce the payloads bit for bit (docs/REPRODUCIBLE.md).
RULE_REPRODUCIBLE = "reproducible-bit-exact"

#: Relative L2 distance between decoded pseudo-gradients beyond which a rerun on another platform is a
#: mismatch, by the claimant's precision. float32: the value re-execution has used since issue 13 (honest
#: reruns on another thread count reach 3.0e-3, the 1%-perturbation cheat starts at 4.9e-2;
#: bench/results/reexec.json; CPU <-> H200 honest reruns at most 9.0e-7: bench/results/gpu_calibration.json).
#: bfloat16: none. On an H200 and this CPU (bench/bench_gpu.py --calibrate, docs/GPU.md "Calibration")
#: honest bf16 reruns on the other device lie up to 0.159 from the claim and on another CPU thread count
#: up to 7.6e-3, while 1% cheats start at 5.6e-3: the ranges overlap, so every finite bound either
#: accuses honest members or passes cheats. A bf16 claim rerun on another platform is passed (within
#: :data:`TOLERANCE_PASS_BOUND`) or undecided, never a mismatch: only a verifier of the claimant's own
#: platform, which demands the same bits, convicts it.
CROSS_PLATFORM_TOLERANCE = {"fp32": 1e-2, "bf16": math.inf}

#: The largest distance a rerun on another platform passes at (the three zones of :func:`compare_rerun`):
#: below the smallest 1%-perturbation cheat measured in either precision (3.4e-4 in fp32, 3.4e-3 in
#: bf16: bench/results/gpu_calibration.json, bench/results/reexec_isa.json), above the honest
#: cross-capability and cross-thread distances of most rounds (1e-7 to 1e-5 at llama-tiny; a codec bin
#: flip gives up to 2.6e-3: those rounds are undecided).
TOLERANCE_PASS_BOUND = {"fp32": 1e-4, "bf16": 1e-4}

_MAX_FIELD = 200


# ----------------------------------------------------------------------------- fingerprint


@dataclass(frozen=True)
class PlatformFingerprint:
    """What decides the bits of a replica's inner steps besides its inputs and thread count.

    ``device_type`` "cpu" or "cuda"; ``device_name`` the GPU's name or the CPU's model;
    ``capability`` the CUDA compute capability (``sm_90``) or torch's CPU instruction set
    (``AVX2``, ``AVX512``); library versions; the deterministic-algorithm flags.
    """

    device_type: str
    device_name: str
    capability: str
    precision: str
    torch: str
    cuda: str  # "" on a CPU
    cudnn: str  # "" on a CPU
    deterministic: bool  # torch.are_deterministic_algorithms_enabled()
    cudnn_deterministic: bool
    tf32: bool  # TF32 matrix products allowed (CUDA)
    # The CPU math libraries' code path where the environment chose one (blas_dispatch): "" for their own
    # dispatch, the only value before this field existed. Left out of the document when "", so every
    # fingerprint, declaration and start state made before it keeps its bytes.
    blas: str = ""

    # The compiler of a replica whose inner steps run through torch.compile (``training.compile``,
    # :func:`compiler_identity`: ``inductor;cc=...`` or ``inductor;triton=...``), "" for eager, the only value
    # before this field existed. Left out of the document when "", like ``blas``: an eager fingerprint,
    # declaration and start state keep their bytes, and a compiled one is another platform (docs/DILOCOX.md
    # section 11, "Compiled inner steps").
    compiled: str = ""

    # A node that is a cluster (training/cluster_engine.py): the stage trained by N processes under FSDP2,
    # ``fsdp2;ranks=N`` (:func:`training.cluster_plan.cluster_identity`), "" for one process, the only value
    # before this field existed, left out of the document like ``blas``. Its inner steps (a reduce-scatter
    # over N ranks) and its codec (the byte budget split N ways) depend on N: another N is another platform,
    # judged by the tolerance rule, never bit for bit (docs/CLUSTER.md, "Re-execution").
    cluster: str = ""

    def document(self) -> dict:
        document = asdict(self)
        for name in OPTIONAL_FIELDS:
            if not document[name]:
                del document[name]
        return document

    def describe(self) -> str:
        libs = f"torch {self.torch}" + (
            f", CUDA {self.cuda}, cuDNN {self.cudnn}" if self.device_type == "cuda" else ""
        )
        blas = f", {self.blas}" if self.blas else ""
        compiled = f", compiled ({self.compiled})" if self.compiled else ""
        cluster = f", cluster ({self.cluster})" if self.cluster else ""
        where = f"{self.device_type} {self.device_name} ({self.capability}{blas})"
        return f"{where} {self.precision}{compiled}{cluster}, {libs}"


#: Fingerprint fields a document leaves out at their default "" (added after the first fingerprints).
OPTIONAL_FIELDS = ("blas", "compiled", "cluster")


def cpu_model_name(cpuinfo: str) -> str:
    """The CPU model a Linux ``/proc/cpuinfo`` names, or "" where it names none.

    x86: its first ``model name``. An aarch64 kernel writes no model name, only each core's ``CPU
    implementer`` and ``CPU part`` (MIDR_EL1's fields: 0x41 0xd40 is an Arm Neoverse V1, 0x41 0xd0c a Neoverse
    N1): the name is ``arm64`` and every distinct implementer:part, sorted (a big.LITTLE CPU has two). Without
    it every ARM CPU had the model ``aarch64`` (``platform.machine()``), so two ARM core types with the same
    ATen capability had equal fingerprints and a rerun between them was held to bit-exactness, though their
    math libraries may pick other kernels per core (issue 42; docs/DILOCOX.md section 11, "ARM, under
    emulation").
    """
    cores, implementer = set(), None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "model name" and value:
            return value
        if key == "CPU implementer":
            implementer = value
        elif key == "CPU part" and implementer is not None:
            cores.add(f"{implementer}:{value}")
    return "arm64 " + "+".join(sorted(cores)) if cores else ""


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
            name = cpu_model_name(cpuinfo.read())
        if name:
            return name
    except OSError:
        pass
    return host_platform.processor() or host_platform.machine() or "unknown"


#: Environment variables that choose the code path of the math libraries torch's CPU kernels call, read
#: once when the library starts: MKL's conditional-numerical-reproducibility branch (``MKL_CBWR``; on this
#: AMD EPYC every branch but ``COMPATIBLE`` falls back to MKL's own dispatch, and ``COMPATIBLE`` gives other
#: sgemm bits, docs/DILOCOX.md section 11), MKL's instruction cap and CPU-type override, oneDNN's ISA cap
#: and its implicit down-conversion of float32 math. Two processes of one CPU model and torch build that
#: differ in them compute other bits, so they are part of the platform.
BLAS_DISPATCH_ENV = (
    "DNNL_DEFAULT_FPMATH_MODE",
    "DNNL_MAX_CPU_ISA",
    "MKL_CBWR",
    "MKL_DEBUG_CPU_TYPE",
    "MKL_ENABLE_INSTRUCTIONS",
    "ONEDNN_DEFAULT_FPMATH_MODE",
    "ONEDNN_MAX_CPU_ISA",
)


def _blas_value_ok(value: str) -> bool:
    return bool(value) and all("!" <= c <= "~" and c != ";" for c in value)


def blas_dispatch(environ=None) -> str:
    """``NAME=value`` of each :data:`BLAS_DISPATCH_ENV` variable set (non-empty) in ``environ`` (default: this
    process's), sorted, joined by ``;``; "" where none is set (the libraries' own dispatch). Raises
    PlatformError for a value no fingerprint can carry (a space, ``;``, non-ASCII, over 200 characters)."""
    environ = os.environ if environ is None else environ
    found = []
    for name in BLAS_DISPATCH_ENV:
        value = environ.get(name, "").strip()
        if not value:
            continue
        if not _blas_value_ok(value):
            raise PlatformError(
                f"{name}={value!r}: the value may hold printable ASCII without spaces or ';' only"
            )
        found.append(f"{name}={value}")
    blas = ";".join(found)
    if len(blas) > _MAX_FIELD:
        raise PlatformError(f"{blas[:60]}...: the math-library settings exceed {_MAX_FIELD} characters")
    return blas


def blas_environment(blas: str) -> dict[str, str | None]:
    """The :data:`BLAS_DISPATCH_ENV` settings a child needs to run with the code path ``blas`` names (the
    value of a fingerprint's ``blas``): each variable ``blas`` sets to its value, every other one to None
    (unset). Raises PlatformError for a ``blas`` that :func:`blas_dispatch` could not have written."""
    settings: dict[str, str | None] = dict.fromkeys(BLAS_DISPATCH_ENV)
    for item in blas.split(";") if blas else ():
        name, sep, value = item.partition("=")
        if not sep or name not in settings or settings[name] is not None or not _blas_value_ok(value):
            raise PlatformError(f"platform fingerprint blas={blas!r}: {item!r} is not NAME=value of "
                                f"{', '.join(BLAS_DISPATCH_ENV)}")
        settings[name] = value
    if blas and ";".join(f"{n}={v}" for n, v in settings.items() if v is not None) != blas:
        raise PlatformError(f"platform fingerprint blas={blas!r}: not in canonical (sorted) order")
    return settings


def fingerprint(device: torch.device, precision: str, compiled: bool = False,
                cluster: str = "") -> PlatformFingerprint:
    """The :class:`PlatformFingerprint` of training on ``device`` in ``precision`` in this process, now;
    ``compiled``: through torch.compile (its ``compiled`` field names the compiler,
    :func:`compiler_identity`); ``cluster``: a node of N processes' ``fsdp2;ranks=N``
    (:func:`training.cluster_plan.cluster_identity`)."""
    check_precision(precision)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        name, capability = torch.cuda.get_device_name(device), f"sm_{major}{minor}"
        cuda, cudnn = str(torch.version.cuda or ""), str(torch.backends.cudnn.version() or "")
        tf32 = bool(torch.backends.cuda.matmul.allow_tf32)
    elif device.type == "cpu":
        name, capability = _cpu_name(), str(torch.backends.cpu.get_cpu_capability())
        cuda = cudnn = ""
        tf32 = False
    else:
        raise PlatformError(f"device {device}: only cpu and cuda are supported")
    return PlatformFingerprint(
        device_type=device.type, device_name=name[:_MAX_FIELD], capability=capability[:_MAX_FIELD],
        precision=precision, torch=torch.__version__[:_MAX_FIELD], cuda=cuda, cudnn=cudnn,
        deterministic=torch.are_deterministic_algorithms_enabled(),
        cudnn_deterministic=bool(torch.backends.cudnn.deterministic) if device.type == "cuda" else False,
        tf32=tf32, blas=blas_dispatch() if device.type == "cpu" else "",
        compiled=compiler_identity(device.type)[:_MAX_FIELD] if compiled else "",
        cluster=check_cluster(cluster),
    )


def check_cluster(value: str) -> str:
    """A fingerprint's ``cluster`` field, checked: "" or ``fsdp2;ranks=N`` with N >= 2."""
    kind, _, ranks = value.partition(";ranks=")
    if value and not (kind == "fsdp2" and ranks.isdigit() and ranks == str(int(ranks)) and int(ranks) >= 2):
        raise PlatformError(f"platform fingerprint cluster={value!r}: must be fsdp2;ranks=N with N >= 2 "
                            "(one process is written by leaving cluster out)")
    return value


def parse_fingerprint(document) -> PlatformFingerprint:
    """A fingerprint from a start state's header, checked strictly (exact keys and types, bounded strings)."""
    names = {f.name: f.type for f in fields(PlatformFingerprint)}
    if not isinstance(document, dict) or not set(names) - set(OPTIONAL_FIELDS) <= set(document) <= set(names):
        keys = sorted(document) if isinstance(document, dict) else type(document).__name__
        raise PlatformError(f"platform fingerprint has keys {keys}, expected {sorted(names)} "
                            f"({', '.join(OPTIONAL_FIELDS)} optional)")
    names = {name: kind for name, kind in names.items() if name in document}
    for name, kind in names.items():
        value = document[name]
        if kind == "bool":
            if not isinstance(value, bool):
                raise PlatformError(f"platform fingerprint {name}={value!r}: must be true or false")
        elif not isinstance(value, str) or len(value) > _MAX_FIELD:
            raise PlatformError(
                f"platform fingerprint {name}: must be a string of at most {_MAX_FIELD} characters"
            )
    if document["device_type"] not in ("cpu", "cuda"):
        raise PlatformError(
            f"platform fingerprint device_type={document['device_type']!r}: must be cpu or cuda"
        )
    if document["precision"] not in PRECISIONS:
        raise PlatformError(
            f"platform fingerprint precision={document['precision']!r}: must be one of {list(PRECISIONS)}"
        )
    if "blas" in document:
        if not document["blas"]:
            raise PlatformError(
                "platform fingerprint blas='': the libraries' own dispatch is written by leaving blas out"
            )
        blas_environment(document["blas"])
    if "compiled" in document and not compiler_ok(document["compiled"]):
        raise PlatformError(
            f"platform fingerprint compiled={document['compiled']!r}: must be inductor;NAME=version "
            "in printable ASCII (eager is written by leaving compiled out)"
        )
    if "cluster" in document:
        if not document["cluster"]:
            raise PlatformError(
                "platform fingerprint cluster='': one process is written by leaving cluster out")
        check_cluster(document["cluster"])
    return PlatformFingerprint(**document)


# ----------------------------------------------------------------------------- judging a rerun


@dataclass(frozen=True)
class RerunVerdict:
    """How a rerun compared with a claim: the verdict, the rule that produced it and why."""

    verdict: str  # EXACT | WITHIN_TOLERANCE | UNDECIDED | MISMATCH
    rule: str  # RULE_SAME_PLATFORM | RULE_CROSS_PLATFORM | RULE_UNRECORDED
    distance: float
    tolerance: float  # 0.0 under the same-platform rule; else the mismatch bound
    reason: str
    pass_bound: float = 0.0  # the largest distance that passes (0.0 under the same-platform rule)


def same_codec_platform(claimed: PlatformFingerprint | None, rerun: PlatformFingerprint) -> bool:
    """Whether a reproducible run's claim and rerun are both CPU float32 eager training on one torch version:
    the mode's inner steps and its codec's encode are then the same bits whatever the CPU model, instruction
    set, math-library path (``blas``) or thread count (a GPU's kernels and another torch version's are not
    covered: untested)."""
    if claimed is None:
        return False
    same = (claimed.torch, claimed.cluster) == (rerun.torch, rerun.cluster)  # a cluster's N decides bits too
    return same and all(side.device_type == "cpu" and side.precision == "fp32" and not side.compiled
                        for side in (claimed, rerun))


def compare_rerun(
    claimed: PlatformFingerprint | None,
    rerun: PlatformFingerprint,
    distance: float,
    *,
    claimed_threads: int,
    rerun_threads: int,
    tolerance: float | None = None,
    reproducible: bool = False,
) -> RerunVerdict:
    """Judge a rerun whose payloads lie ``distance`` from the claim (0.0: identical bytes).

    Same fingerprint and thread count: bit-exact demanded (any distance is a mismatch).
    Otherwise three zones, by the claimant's precision: :data:`EXACT` at 0, :data:`WITHIN_TOLERANCE` up to
    :data:`TOLERANCE_PASS_BOUND`, :data:`MISMATCH` beyond the cross-platform tolerance
    (:data:`CROSS_PLATFORM_TOLERANCE`; ``tolerance`` overrides it), :data:`UNDECIDED` between (module
    docstring). A start state without a fingerprint (made before they existed: float32 runs) is judged
    the same way in float32. ``reproducible``: the run's ``training.reproducible``; where
    :func:`same_codec_platform` holds, any distance is a mismatch whatever CPU, instruction set, math-library
    path or thread count either side used (no tolerance, no undecided zone); elsewhere (a GPU, another torch
    version) the rules above apply.
    """
    if reproducible and same_codec_platform(claimed, rerun):
        verdict = EXACT if distance == 0.0 else MISMATCH
        where = "claimant's platform not recorded" if claimed is None else \
            f"claimant on {claimed.describe()} ({claimed_threads} threads)"
        return RerunVerdict(verdict, RULE_REPRODUCIBLE, distance, 0.0,
                            f"reproducible run, {where}, rerun on {rerun.describe()} "
                            f"({rerun_threads} threads): fixed-order kernels, bit-exact rerun demanded, "
                            f"largest relative distance {distance:.3g}")
    if claimed is not None and claimed == rerun and claimed_threads == rerun_threads:
        verdict = EXACT if distance == 0.0 else MISMATCH
        return RerunVerdict(verdict, RULE_SAME_PLATFORM, distance, 0.0,
                            f"same platform ({rerun.describe()}, {rerun_threads} threads): bit-exact rerun "
                            f"demanded, largest relative distance {distance:.3g}")
    precision = claimed.precision if claimed is not None else "fp32"
    limit = CROSS_PLATFORM_TOLERANCE[precision] if tolerance is None else tolerance
    passes = min(TOLERANCE_PASS_BOUND[precision], limit)
    verdict = EXACT if distance == 0.0 else WITHIN_TOLERANCE if distance <= passes else \
        MISMATCH if distance > limit else UNDECIDED
    if claimed is None:
        rule, where = RULE_UNRECORDED, f"claimant's platform not recorded, rerun on {rerun.describe()}"
    else:
        rule = RULE_CROSS_PLATFORM
        what = "other threads" if claimed == rerun else f"claimant on {claimed.describe()}"
        where = f"{what} ({claimed_threads} threads), rerun on {rerun.describe()} ({rerun_threads} threads)"
    needs = ("; needs a verifier of the claimant's platform and thread count" if verdict == UNDECIDED else "")
    beyond = f"mismatch beyond {limit:.3g}" if math.isfinite(limit) else "never a mismatch across platforms"
    return RerunVerdict(verdict, rule, distance, limit,
                        f"{where}: largest relative distance {distance:.3g} (passes up to {passes:.3g}, "
                        f"{beyond}){needs}", passes)
