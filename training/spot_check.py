"""Checking one replica's contribution to a round against a rerun (:mod:`training.reexec` describes the spot
check): the served state, the data commitment, the rerun and the verdict."""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from training.config import DilocoConfig, ModelConfig, TrainingConfig
from training.config_compression import CompressionConfig
from training.data import Corpus
from training.errors import ReexecError, ReplicaStateError
from training.fingerprint import (
    CROSS_PLATFORM_TOLERANCE,
    EXACT,
    MISMATCH,
    RULE_CROSS_PLATFORM,
    UNDECIDED,
    WITHIN_TOLERANCE,
    compare_rerun,
)
from training.hashing import stage_weights_hash
from training.reexec_distance import distance_for
from training.reexec_rerun import Reexecution, reexecute
from training.reexec_rules import (
    STATE_MISMATCH,
    claimed_steps,
    data_commitment,
    start_global_round,
    steps_in_range,
)
from training.replica_state import ReplicaStartState, parse_stage_state
from training.stages import split_stages, stage_param_shapes

logger = logging.getLogger(__name__)

# EXACT, WITHIN_TOLERANCE, MISMATCH: training.fingerprint's (the rerun's comparison).
DATA_MISMATCH = "data_mismatch"  # the data commitment is not the round's data
# Built on another result of round t-1 than the record's (its bound applied hash is not what the rerun's
# apply gives): a forked member's round, left out of the aggregate by the holders, never a cheat to accuse.
OTHER_RESULT = "other_result"
#: ``applied_hash`` of a round whose training applied nothing before its encode (node.protocol.NO_APPLY).
NO_APPLY = bytes(32)

# Relative L2 distance accepted between decoded pseudo-gradients of float32 contributions when
# the rerun is not bit-exact (another thread count or platform). Measured on the mini model
# (H = 20, bench/results/reexec.json): honest reruns on 2 threads of contributions trained on 1
# reach 3.0e-3 (quantization steps flip); the cheats of the issue start at 4.9e-2 (a 1%
# perturbation of the update norm; docs/DILOCOX.md section 11). bf16: CROSS_PLATFORM_TOLERANCE.
DEFAULT_TOLERANCE = CROSS_PLATFORM_TOLERANCE["fp32"]


def verdict(distance: float, tolerance: float) -> str:
    """:data:`EXACT` (bit-exact), :data:`WITHIN_TOLERANCE` or :data:`MISMATCH` under a plain tolerance
    (:func:`training.fingerprint.compare_rerun` is the rule a spot check applies)."""
    if distance == 0.0:
        return EXACT
    return WITHIN_TOLERANCE if distance <= tolerance else MISMATCH


@dataclass(frozen=True)
class ContributionClaim:
    """What one stage's signed envelope of ``(replica, outer_round)`` states."""

    stage_index: int
    state_hash: bytes  # stage_state_hash of the start state the replica committed to
    data_commitment: bytes
    payload: bytes
    applied_hash: bytes = NO_APPLY  # the result of round t-1 its training applied before the encode


@dataclass
class SpotCheck:
    """The outcome of checking one replica's contribution to one round."""

    outer_round: int
    replica: int
    # EXACT | WITHIN_TOLERANCE | UNDECIDED | MISMATCH | STATE_MISMATCH | DATA_MISMATCH | OTHER_RESULT
    verdict: str
    reason: str
    distances: dict[int, float] = field(default_factory=dict)  # stage -> contribution_distance
    # per stage: what round t+1's envelopes must bind (EXACT only)
    next_state_hashes: list[bytes] | None = None
    reexec_seconds: float = 0.0
    # The stages whose own claim fails (a split replica's stages have different signers; empty: honest,
    # or a failure no single stage's claim shows, e.g. states of different rounds).
    failed_stages: tuple[int, ...] = ()
    rule: str = ""  # training.fingerprint.RULE_*: how the rerun was judged ("" if it never ran)
    # Where it ran, for a report: "exact" (the claimant's platform), "emulated" (a child under the claimant's
    # ATen CPU capability), "tolerance" (another platform), "" (not said; node.tools.audit_reexec sets it)
    how: str = ""

    @property
    def honest(self) -> bool:
        return self.verdict in (EXACT, WITHIN_TOLERANCE)

    @property
    def undecided(self) -> bool:
        """Another platform's rerun that can neither pass nor convict it (training.fingerprint.UNDECIDED)."""
        return self.verdict == UNDECIDED


def verify_contribution(
    state_parts: Sequence[bytes],
    claims: Sequence[ContributionClaim],
    corpus: Corpus,
    model_cfg: ModelConfig,
    training_cfg: TrainingConfig,
    diloco_cfg: DilocoConfig,
    compression_cfg: CompressionConfig,
    *,
    outer_round: int,
    replica: int,
    run_rounds: int,
    previous_contributions: Mapping[int, Sequence[bytes]] | None = None,
    committed_weights: Mapping[int, Mapping[int, bytes]] | None = None,
    previous_excluded: Mapping[int, Mapping[int, str]] | None = None,
    previous_dropped: Collection[int] = (),
    tolerance: float | None = None,
    threads: int | None = None,
    previous_partials: Mapping[int, Sequence[bytes]] | None = None,
    processes: int = 1,
    data_key: bytes | None = None,
) -> SpotCheck:
    """Check the contributions of ``(replica, outer_round)`` against a rerun (:mod:`training.reexec`'s module
    docstring).

    ``state_parts``: the served start-state bytes of every stage (stage order);
    ``claims``: one per stage, from the signed envelopes. Order of the checks:
    the served state parses and hashes to the committed one, its metadata is
    this round's, its global weights are the committed ones (``committed_weights``:
    round -> stage -> ``stage_weights_hash`` on the record, round -1 the initial
    weights; a round not in it is not checked), the data commitment is the
    round's data, then the rerun runs and each claim's ``applied_hash`` must be the result of
    round t-1 its apply gave (else :data:`OTHER_RESULT`: built on another result, not a cheat), then the
    rerun's payloads are compared stage by stage (the
    worst stage decides) under :func:`training.fingerprint.compare_rerun`: bit-exact on
    the claimant's platform, else the three zones (passed up to the pass bound, mismatch beyond
    ``tolerance``, default the claimant's precision's cross-platform tolerance, undecided between).
    The verdict's ``rule`` and ``reason`` say which applied.
    In a sliced run each claim's payload is the msgpack array of the claimant's slice blobs
    (:func:`sliced_contribution_distance`) and ``previous_partials`` replaces ``previous_contributions``.
    ``processes``: the processes this verifier may rerun on (a cluster's claim of N <= ``processes`` ranks is
    rerun on N ranks, bit for bit: training/cluster_rerun.py).
    ``data_key``: in a run whose windows are keyed by account (``training.data_windows = "account"``), the
    contributor's 20-byte key (its replica's first-stage member's account, :func:`reexecute`), by which the
    data commitment and the rerun's batches are drawn.
    """
    claims = _one_claim_per_stage(state_parts, claims)
    state = _served_state(state_parts, claims, diloco_cfg, outer_round, replica, run_rounds,
                          committed_weights)
    if isinstance(state, SpotCheck):
        return state
    declared = _declared_steps(claims, diloco_cfg, outer_round, replica)
    if isinstance(declared, SpotCheck):
        return declared
    expected_data = data_commitment(corpus, training_cfg, model_cfg, diloco_cfg, replica, outer_round,
                                    declared, data_key)
    wrong_data = [claim.stage_index for claim in claims if claim.data_commitment != expected_data]
    if wrong_data:
        return _failed(outer_round, replica, DATA_MISMATCH, "the data commitment is not this round's batches",
                       wrong_data)
    try:
        rerun = reexecute(state, corpus, model_cfg, training_cfg, diloco_cfg, compression_cfg,
                          previous_contributions=previous_contributions, previous_excluded=previous_excluded,
                          previous_dropped=previous_dropped, threads=threads,
                          previous_partials=previous_partials, declared_steps=declared,
                          processes=processes, consume=True,  # the state parsed here, for this rerun
                          data_key=data_key)
    except ReplicaStateError as exc:
        return _failed(outer_round, replica, STATE_MISMATCH, f"state does not fit the run's model: {exc}")
    bound = rerun.applied_hashes
    elsewhere = [c.stage_index for c in claims if c.applied_hash != bound.get(c.stage_index, NO_APPLY)]
    if elsewhere:
        # Not a cheat: the round was trained on another result of round t-1 (the claimant's fork),
        # which the holders leave out of the aggregate (node.binding.other_result_exclusions).
        return _failed(outer_round, replica, OTHER_RESULT,
                       f"stage(s) {elsewhere}: built on another result of round {outer_round - 1} than the "
                       "record's (its bound applied hash is not what the rerun's apply gives)", elsewhere)
    return _judged(claims, rerun, state.meta, model_cfg, diloco_cfg, outer_round, replica, tolerance,
                   training_cfg.reproducible)


def _failed(outer_round: int, replica: int, kind: str, reason: str, stages=()) -> SpotCheck:
    logger.info("spot check of replica %d round %d: %s (%s)", replica, outer_round, kind, reason)
    return SpotCheck(outer_round, replica, kind, reason, failed_stages=tuple(sorted(stages)))


def _one_claim_per_stage(state_parts: Sequence[bytes],
                         claims: Sequence[ContributionClaim]) -> list[ContributionClaim]:
    """The claims in stage order, one per stage and one state part each (else :class:`ReexecError`)."""
    num_stages = len(claims)
    if (not claims or sorted(c.stage_index for c in claims) != list(range(num_stages))
            or len(state_parts) != num_stages):
        raise ReexecError(
            f"need one claim and one state part per stage, got {len(claims)} and {len(state_parts)}"
        )
    return sorted(claims, key=lambda c: c.stage_index)


def _served_state(
    state_parts: Sequence[bytes],
    claims: Sequence[ContributionClaim],
    diloco_cfg: DilocoConfig,
    outer_round: int,
    replica: int,
    run_rounds: int,
    committed_weights: Mapping[int, Mapping[int, bytes]] | None,
) -> ReplicaStartState | SpotCheck:
    """The served start state, checked against the commitments (hash, metadata, global weights on record),
    or the failed :class:`SpotCheck`."""
    parts = []
    for data, claim in zip(state_parts, claims):
        try:
            parts.append(parse_stage_state(data))
        except ReplicaStateError as exc:
            return _failed(
                outer_round,
                replica,
                STATE_MISMATCH,
                f"stage {claim.stage_index}: served state is malformed: {exc}",
                [claim.stage_index],
            )
        if parts[-1].stage_index != claim.stage_index or parts[-1].state_hash() != claim.state_hash:
            return _failed(
                outer_round,
                replica,
                STATE_MISMATCH,
                f"stage {claim.stage_index}: served state is not the committed one",
                [claim.stage_index],
            )
    expected_horizon = run_rounds * diloco_cfg.inner_steps if run_rounds > 0 else 0
    wrong_meta = [
        claim.stage_index
        for part, claim in zip(parts, claims)
        if (part.meta.outer_round, part.meta.replica, part.meta.inner_steps, part.meta.lr_total_steps)
        != (outer_round, replica, diloco_cfg.inner_steps, expected_horizon)
    ]
    if wrong_meta:
        return _failed(
            outer_round,
            replica,
            STATE_MISMATCH,
            f"stage(s) {wrong_meta}: state metadata is not round {outer_round} of replica {replica}",
            wrong_meta,
        )
    try:
        state = ReplicaStartState(tuple(parts))
    except ReplicaStateError as exc:
        return _failed(outer_round, replica, STATE_MISMATCH, f"served state is malformed: {exc}")
    applied = start_global_round(diloco_cfg, outer_round)
    for part in parts:
        committed = (committed_weights or {}).get(applied, {}).get(part.stage_index)
        if committed is not None and stage_weights_hash(part.group("global")) != committed:
            return _failed(outer_round, replica, STATE_MISMATCH,
                           f"stage {part.stage_index}: global weights are not round {applied}'s on record",
                           [part.stage_index])
    return state


def _declared_steps(claims: Sequence[ContributionClaim], diloco_cfg: DilocoConfig, outer_round: int,
                    replica: int) -> int | None | SpotCheck:
    """The inner steps a time-bounded run's claims declare (None with fixed H), or the failed check."""
    if not diloco_cfg.budgeted:
        return None
    # The stages of one replica train the same steps (the pipeline agrees on the count) and declare it;
    # the rerun trains exactly that many.
    counts = {claim.stage_index: claimed_steps(claim.payload) for claim in claims}
    bad = [stage for stage, count in counts.items() if not steps_in_range(diloco_cfg, count)]
    if bad:
        return _failed(outer_round, replica, MISMATCH, f"stage(s) {bad}: declared inner steps "
                       f"{[counts[s] for s in bad]} outside the run's [{diloco_cfg.min_inner_steps}, "
                       f"{diloco_cfg.inner_steps}]", bad)
    if len(set(counts.values())) != 1:
        return _failed(outer_round, replica, MISMATCH, f"the stages declare different inner steps {counts}")
    return next(iter(counts.values()))


def _judged(claims: Sequence[ContributionClaim], rerun: Reexecution, meta, model_cfg: ModelConfig,
            diloco_cfg: DilocoConfig, outer_round: int, replica: int, tolerance: float | None,
            reproducible: bool = False) -> SpotCheck:
    """The rerun's payloads against the claims, stage by stage, the worst stage deciding
    (:func:`training.fingerprint.compare_rerun`; ``meta``: the claimant's platform and threads)."""
    specs = split_stages(model_cfg.n_layer, len(claims))
    distance = distance_for(diloco_cfg)
    distances = {
        claim.stage_index: distance(
            claim.payload, rerun.payloads[claim.stage_index],
            stage_param_shapes(model_cfg, specs[claim.stage_index]),
            stage_index=claim.stage_index, outer_round=outer_round,
        )
        for claim in claims
    }
    worst = max(distances.values())
    judged = compare_rerun(meta.platform, rerun.platform, worst, claimed_threads=meta.threads,
                           rerun_threads=rerun.threads, tolerance=tolerance, reproducible=reproducible)
    outcome = judged.verdict
    # The next state only chains bit-exactly from a bit-exact rerun on the claimant's platform: payloads
    # may agree to the bit across platforms while the weights behind them do not.
    chains = outcome == EXACT and judged.rule != RULE_CROSS_PLATFORM
    next_hashes = rerun.next_state.stage_hashes() if chains and rerun.next_state is not None else None
    if outcome == MISMATCH:
        logger.info("spot check of replica %d round %d: mismatch, %s", replica, outer_round, judged.reason)
    # Each stage judged under the same rule as the whole (its own distance): the stages that fail alone.
    failing = tuple(stage for stage, distance in sorted(distances.items())
                    if compare_rerun(meta.platform, rerun.platform, distance, claimed_threads=meta.threads,
                                     rerun_threads=rerun.threads, tolerance=tolerance,
                                     reproducible=reproducible).verdict == MISMATCH)
    return SpotCheck(outer_round, replica, outcome, f"{judged.rule}: {judged.reason}", distances, next_hashes,
                     rerun.seconds, failing, judged.rule)
