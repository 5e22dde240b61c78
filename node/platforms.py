"""A member's declared platform (issue 42, docs/DILOCOX.md section 11): what a node declares when it joins a
run, and the check that holds a contribution's claimed platform to its signer's declaration.

Shared by the live spot checks (:mod:`node.live.checks.verifier`), the commands that join a run and the audit
(:mod:`node.tools.audit_reexec`), which imports neither the live node nor the commands.
"""

from __future__ import annotations

from pathlib import Path

from training.declaration import declared_platform_problem, platform_declaration, platform_hash
from training.errors import TrainingError
from training.claimant_kernels import native_cpu_capability
from training.cluster_plan import cluster_identity
from training.platform import prepare_platform
from training.replica_state import check_stage_state_file, parse_stage_state


def own_platforms(training_cfg, processes: int = 1) -> tuple[bytes, bytes]:
    """(what this node declares when it joins a run, the version-1 form of the same platform).

    The first is :func:`training.declaration.platform_declaration` of the fingerprint of training on
    ``training.device`` in ``training.precision`` (compiled if ``training.compile``) in this process
    (resolved as the trainer resolves them:
    :func:`training.platform.prepare_platform`), with this CPU's highest ATen capability
    (:func:`training.claimant_kernels.native_cpu_capability`: the kernels it can rerun a claim under). The
    second is :func:`training.declaration.platform_hash` of that fingerprint: what a node of this platform
    declared before version 2, accepted as its seat's declaration (``NodeChain.ensure_member``'s ``also``).
    ``processes``: ``compute.processes``; a node of N > 1 declares ``cluster = "fsdp2;ranks=N"``
    (training/cluster_replica.py).
    """
    fingerprint = prepare_platform(training_cfg.device, training_cfg.precision, training_cfg.compile,
                                   cluster=cluster_identity(processes)).fingerprint()
    native = native_cpu_capability() if fingerprint.device_type == "cpu" else None
    return platform_declaration(fingerprint, native), platform_hash(fingerprint)


def own_platform(training_cfg, processes: int = 1) -> bytes:
    """The platform this node declares when it joins a run (the first of :func:`own_platforms`)."""
    return own_platforms(training_cfg, processes)[0]


def undeclared_claim(claims: list[tuple[int, str, bytes | Path]], declared: dict[str, bytes]) -> tuple[
        int, str] | None:
    """(stage, why) of the first claim whose platform is not the one its signer declared when it joined, or
    None.

    ``claims``: (stage, signer peer id, the start-state part its envelope binds), stage order; ``declared``:
    peer id -> declared platform (a signer absent from it has no declaration to be held to). The claimed
    platform is the fingerprint the start state records
    (:func:`training.declaration.declared_platform_problem`). A part that does not parse is left to the rerun,
    which judges it (a state mismatch). A part is its bytes or the file holding them: either is checked
    whole without reading its tensors into memory (``parse_stage_state(tensors=False)``).
    """
    for stage, peer, part in claims:
        try:
            parsed = check_stage_state_file(part) if isinstance(part, Path) else \
                parse_stage_state(part, tensors=False)
            claimed = parsed.meta.platform
        except (TrainingError, ValueError):
            return None
        why = declared_platform_problem(claimed, declared.get(peer))
        if why is not None:
            return stage, f"declared platform: stage {stage}'s signer {why}"
    return None
