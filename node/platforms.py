"""A member's declared platform (issue 42, docs/DILOCOX.md section 11): what a node declares when it joins a run,
and the check that holds a contribution's claimed platform to its signer's declaration.

Shared by the live spot checks (:mod:`node.live.verifier`), the commands that join a run and the audit
(:mod:`node.tools.audit_reexec`), which imports neither the live node nor the commands.
"""

from __future__ import annotations

from training.errors import TrainingError
from training.platform import declared_platform_problem, platform_hash, prepare_platform
from training.replica_state import parse_stage_state


def own_platform(training_cfg) -> bytes:
    """The platform this node declares when it joins a run: :func:`training.platform.platform_hash` of the
    fingerprint of training on ``training.device`` in ``training.precision`` in this process (resolved as the
    trainer resolves them: :func:`training.platform.prepare_platform`)."""
    return platform_hash(prepare_platform(training_cfg.device, training_cfg.precision).fingerprint())


def undeclared_claim(claims: list[tuple[int, str, bytes]], declared: dict[str, bytes]) -> tuple[int, str] | None:
    """(stage, why) of the first claim whose platform is not the one its signer declared when it joined, or None.

    ``claims``: (stage, signer peer id, the start-state part its envelope binds), stage order; ``declared``:
    peer id -> declared platform (a signer absent from it has no declaration to be held to). The claimed
    platform is the fingerprint the start state records (:func:`training.platform.declared_platform_problem`).
    A part that does not parse is left to the rerun, which judges it (a state mismatch).
    """
    for stage, peer, part in claims:
        try:
            claimed = parse_stage_state(part).meta.platform
        except (TrainingError, ValueError):
            return None
        why = declared_platform_problem(claimed, declared.get(peer))
        if why is not None:
            return stage, f"declared platform: stage {stage}'s signer {why}"
    return None
