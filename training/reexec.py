"""Re-execution spot checks: rerun another replica's round and compare it with what it signed (issue 13).

A contribution of replica ``i`` to round ``t`` binds (in its signed envelope)
the hash of the replica's start state (:mod:`training.replica_state`) and a
commitment to the round's data (:func:`data_commitment`). A verifier that
samples it (:func:`sample_replicas`) fetches the start state, checks both
bindings, and reruns the round exactly as the node runs it::

    restore trainer + engines from the start state        # training.replica_restore.restore_replica
    for action in round_actions(diloco, t):               # training.schedule, as node/live/node.py
        train:  H inner AdamW steps on round_batches(seed, i, t, k), lr = inner_lr(t*H + k)
        apply:  finish_round(t-1, the public contributions of round t-1)
        encode: skip_to(t); encode_contribution(t)         # error feedback, codec: the node's code
    compare the payloads with the signed ones             # contribution_distance -> verdict

A replica split over several processes (one stage per node, GPipe micro-batches)
is re-executed whole in one process: ``LocalReplicaTrainer.train_step`` with the
pipeline's ``micro_batches`` runs the one inner step (:func:`training.pipeline.inner_step`) with the
pipeline's arithmetic (per-micro-batch losses, gradients accumulated in
micro-batch order and divided by their count, clipping on the summed squared
norms), so the chained rerun is bit-exact with the split one
(``tests/test_training_reexec.py``).

Bit-exact on the same platform with the same intra-op thread count (the start
state records both; the rerun uses the claimant's thread count and precision on
the verifier's own device), and then demanded: any difference is a mismatch. On
another platform (another device, GPU model, library version, precision flags) or
thread count the float reductions run in another order: the payloads then differ
slightly and the check falls back to the relative L2 distance of the decoded
pseudo-gradients in three zones: passed, undecided (no verdict: needs a verifier of the
claimant's platform) or a mismatch (:func:`training.fingerprint.compare_rerun`; docs/DILOCOX.md
section 11, docs/GPU.md).

The rerun also yields the replica's start state of round ``t+1``; its hash
must equal the one the replica's round ``t+1`` contribution binds (chaining:
the private parts of the state, error-feedback residual and AdamW moments,
are checked through the transition they must follow), unless that state is
one a restart rebuilds from the record alone (:func:`restart_state_reason`).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from training.butterfly import average_of_partials
from training.compiled import compile_problem, forget_compiled
from training.config import DilocoConfig, ModelConfig, TrainingConfig
from training.config_compression import CompressionConfig
from training.data import Corpus, round_batches
from training.diloco import step_with_average
from training.errors import ReexecError, ReplicaStateError
from training.fingerprint import (
    CROSS_PLATFORM_TOLERANCE,
    EXACT,
    MISMATCH,
    RULE_CROSS_PLATFORM,
    UNDECIDED,
    WITHIN_TOLERANCE,
    PlatformFingerprint,
    compare_rerun,
)
from training.hashing import stage_weights_hash
from training.platform import resolve_device
from training.reexec_distance import contribution_distance, sliced_contribution_distance
from training.reexec_rules import (
    RESTART_ATOL, RESTART_RTOL, STATE_MISMATCH, check_state_chain, data_commitment, restart_state_reason,
    claimed_steps, round_meta, sample_replicas, sample_score, start_global_round, steps_in_range,
)
from training.replica_state import ReplicaStartState, parse_stage_state
from training.replica_restore import restore_replica
from training.replica_capture import capture_replica_state
from training.schedule import APPLY, ENCODE, TRAIN, inner_lr, round_actions, set_lr
from training.stages import split_stages, stage_param_shapes

logger = logging.getLogger(__name__)

#: training.reexec_rules' and training.reexec_distance's names are re-exported: callers import the spot check
#: from here.
__all__ = [
    "RESTART_ATOL", "RESTART_RTOL", "STATE_MISMATCH", "check_state_chain", "data_commitment",
    "restart_state_reason", "round_meta", "sample_replicas", "sample_score", "start_global_round", "DATA_MISMATCH",
    "OTHER_RESULT", "NO_APPLY", "DEFAULT_TOLERANCE", "Reexecution", "reexecute", "contribution_distance",
    "sliced_contribution_distance", "verdict", "ContributionClaim", "SpotCheck", "verify_contribution",
    "claimed_steps", "steps_in_range",
]



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


# ----------------------------------------------------------------------------- the rerun


@dataclass
class Reexecution:
    """What rerunning ``(replica, outer_round)`` produced."""

    outer_round: int
    replica: int
    payloads: dict[int, bytes]  # stage -> contribution bytes
    next_state: ReplicaStartState | None  # start state of round t+1 (None if round t-1 was not applied)
    train_seconds: float
    encode_seconds: float
    threads: int
    platform: PlatformFingerprint | None = None  # where the rerun's inner steps ran
    # stage -> the stage hash of round t-1 the rerun applied before encoding (what an honest contribution
    # binds as ``applied_hash``); empty when the schedule applies nothing before the encode
    applied_hashes: dict[int, bytes] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.train_seconds + self.encode_seconds


def reexecute(
    state: ReplicaStartState,
    corpus: Corpus,
    model_cfg: ModelConfig,
    training_cfg: TrainingConfig,
    diloco_cfg: DilocoConfig,
    compression_cfg: CompressionConfig,
    *,
    previous_contributions: Mapping[int, Sequence[bytes]] | None = None,
    previous_excluded: Mapping[int, Mapping[int, str]] | None = None,
    previous_dropped: Collection[int] = (),
    threads: int | None = None,
    previous_partials: Mapping[int, Sequence[bytes]] | None = None,
    declared_steps: int | None = None,
) -> Reexecution:
    """Rerun round ``state.meta.outer_round`` of ``state.meta.replica`` from ``state`` (module docstring).

    ``declared_steps``: in a run whose rounds are bounded by time (``diloco.round_budget_s``), the
    inner steps the contribution declares (required there): the rerun trains exactly that many and
    encodes them declared, so a contribution that declares more (or fewer) steps than it trained
    does not reproduce.

    ``previous_contributions``: stage -> the contributions of round t-1 in
    canonical order (what the round's apply(t-1) aggregated; public, archived by
    every node). Needed when the schedule applies round t-1 before encoding
    round t (lookahead, eager, ``overlap_steps > 0``) and to obtain the next
    start state; with the default "rebase" and no overlap it may be omitted and
    only the payloads come back. ``previous_excluded``: stage -> the canonical indices
    of round t-1 that screening left out (the sealed round's ``excluded``; the
    engine re-derives every other exclusion itself). ``previous_dropped``: the stages
    whose round t-1 close does not hold this replica's contribution (a straggler's:
    the node put its transmitted update back into the residual when it applied
    round t-1, and so does the rerun). ``threads``: intra-op threads for the rerun,
    default the claimant's (``state.meta.threads``), which makes it bit-exact.
    ``previous_partials``: in a sliced run (``diloco.exchange = "sliced"``), stage -> the A partial
    blobs of round t-1 in slice order (what every holder applied, docs/PROTOCOL.md "Sliced
    exchange"), in place of ``previous_contributions``.
    The inner steps run on ``training_cfg.device`` (the verifier's) in the claimant's
    precision (``state.meta.platform``; float32 for a state that records none), compiled if the claimant's
    were (:func:`rerun_compiled`), whatever the verifier's own ``training.compile``.
    """
    meta = state.meta
    if meta.inner_steps != diloco_cfg.inner_steps:
        raise ReexecError(
            f"start state has H={meta.inner_steps}, the run's diloco.inner_steps={diloco_cfg.inner_steps}"
        )
    outer_round, steps = meta.outer_round, meta.inner_steps
    if diloco_cfg.budgeted:
        if declared_steps is None:
            raise ReexecError(f"round {outer_round}: a time-bounded run's rerun needs the declared inner steps")
        try:
            diloco_cfg.check_declared_steps(declared_steps)
        except ValueError as exc:
            raise ReexecError(f"round {outer_round}: {exc}") from None
    elif declared_steps not in (None, steps):
        raise ReexecError(f"round {outer_round}: a fixed-H run trains H={steps} steps, not {declared_steps}")
    trained = declared_steps if declared_steps is not None else steps
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads or meta.threads)
    precision = meta.platform.precision if meta.platform is not None else "fp32"
    compiled = rerun_compiled(meta.platform, training_cfg.device)
    if compiled:
        forget_compiled()  # graphs compiled under another thread count (training/compiled.py)
    try:
        trainer, engines = restore_replica(state, model_cfg, replace(training_cfg, precision=precision,
                                                                     compile=compiled),
                                           diloco_cfg, compression_cfg)
        batches = round_batches(corpus, training_cfg.seed, meta.replica, outer_round, trained,
                                training_cfg.batch_size, model_cfg.block_size)
        horizon = meta.lr_total_steps or None
        payloads: dict[int, bytes] = {}
        applied_hashes: dict[int, bytes] = {}
        train_seconds = encode_seconds = 0.0
        applied_previous = outer_round == 0
        for action in round_actions(diloco_cfg, outer_round, steps=trained):
            started = time.perf_counter()
            if action.kind == TRAIN:
                for step in range(action.first_step, action.end_step):
                    set_lr(trainer.optimizers, inner_lr(training_cfg, outer_round * steps + step, horizon))
                    x, y = batches[step]
                    trainer.train_step(x, y, meta.micro_batches or 1)
                train_seconds += time.perf_counter() - started
            elif action.kind == APPLY:
                if action.outer_round == outer_round:
                    # No delay: round t itself is applied after its encode, from round t's close,
                    # which the rerun is not given; the payloads are done, the next state unknown.
                    applied_previous = False
                    continue
                if previous_contributions is None and previous_partials is None:
                    if not payloads:
                        raise ReexecError(
                            f"round {outer_round}: the schedule applies round {outer_round - 1} before encoding; "
                            "pass previous_contributions"
                        )
                    continue
                for engine in engines:  # as node.live.node applies a round, then hears its own was left out
                    if previous_partials is not None:  # as node.live.replica.ReplicaWorker.apply_partials
                        _apply_partials(engine, action.outer_round, previous_partials[engine.stage_index],
                                        diloco_cfg, compression_cfg)
                    else:
                        engine.finish_round(action.outer_round, list(previous_contributions[engine.stage_index]),
                                            excluded=(previous_excluded or {}).get(engine.stage_index))
                    if engine.stage_index in previous_dropped and engine.transmitted(action.outer_round):
                        engine.contribution_dropped(action.outer_round)
                    if not payloads:  # applied before the encode: the contribution binds this result
                        applied_hashes[engine.stage_index] = engine.weights_hash()
                applied_previous = True
                encode_seconds += time.perf_counter() - started
            elif action.kind == ENCODE:
                for engine in engines:  # as node.live.replica.ReplicaWorker.encode
                    engine.skip_to(outer_round)
                    payloads[engine.stage_index], _ = engine.encode_contribution(outer_round, declared_steps)
                encode_seconds += time.perf_counter() - started
        next_state = None
        if applied_previous:
            next_state = capture_replica_state(replace(meta, outer_round=outer_round + 1), trainer, engines)
        return Reexecution(outer_round, meta.replica, payloads, next_state, train_seconds, encode_seconds,
                           torch.get_num_threads(), trainer.platform.fingerprint(), applied_hashes)
    finally:
        torch.set_num_threads(previous_threads)
        if compiled:
            forget_compiled()


def rerun_compiled(claimed: PlatformFingerprint | None, device: str) -> bool:
    """Whether a rerun of a claim made on ``claimed`` runs its inner steps compiled: as the claimant did
    (``training.compile``, training/compiled.py). A compiled claim on a verifier that cannot compile for
    ``device`` is rerun eagerly: its fingerprint is then another platform's, and the rerun is judged as any
    other platform's (:func:`training.fingerprint.compare_rerun`), never bit-exactly."""
    if claimed is None or not claimed.compiled:
        return False
    problem = compile_problem(resolve_device(device).type)
    if problem is not None:
        logger.warning("a compiled claim (%s) is rerun eagerly here: %s", claimed.compiled, problem)
        return False
    return True


def _apply_partials(engine, outer_round: int, partials: Sequence[bytes], diloco_cfg: DilocoConfig,
                    compression_cfg: CompressionConfig) -> None:
    """The sliced exchange's apply of ``outer_round``: the average assembled from its partials, the outer step."""
    average = average_of_partials(list(partials), engine.compressor.plan, stage_index=engine.stage_index,
                                  outer_round=outer_round, refuse_raw=compression_cfg.enabled)
    aggregation = step_with_average(engine.global_weights, engine.momentum, average, diloco_cfg, outer_round)
    engine.finish_round(outer_round, [], aggregation=aggregation)


# ----------------------------------------------------------------------------- comparing

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
    verdict: str  # EXACT | WITHIN_TOLERANCE | UNDECIDED | MISMATCH | STATE_MISMATCH | DATA_MISMATCH | OTHER_RESULT
    reason: str
    distances: dict[int, float] = field(default_factory=dict)  # stage -> contribution_distance
    next_state_hashes: list[bytes] | None = None  # per stage: what round t+1's envelopes must bind (EXACT only)
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
) -> SpotCheck:
    """Check the contributions of ``(replica, outer_round)`` against a rerun (module docstring).

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
    """
    def failed(kind: str, reason: str, stages=()) -> SpotCheck:
        logger.info("spot check of replica %d round %d: %s (%s)", replica, outer_round, kind, reason)
        return SpotCheck(outer_round, replica, kind, reason, failed_stages=tuple(sorted(stages)))

    num_stages = len(claims)
    if (not claims or sorted(c.stage_index for c in claims) != list(range(num_stages))
            or len(state_parts) != num_stages):
        raise ReexecError(
            f"need one claim and one state part per stage, got {len(claims)} and {len(state_parts)}"
        )
    claims = sorted(claims, key=lambda c: c.stage_index)
    parts = []
    for data, claim in zip(state_parts, claims):
        try:
            parts.append(parse_stage_state(data))
        except ReplicaStateError as exc:
            return failed(STATE_MISMATCH, f"stage {claim.stage_index}: served state is malformed: {exc}",
                          [claim.stage_index])
        if parts[-1].stage_index != claim.stage_index or parts[-1].state_hash() != claim.state_hash:
            return failed(STATE_MISMATCH, f"stage {claim.stage_index}: served state is not the committed one",
                          [claim.stage_index])
    expected_horizon = run_rounds * diloco_cfg.inner_steps if run_rounds > 0 else 0
    wrong_meta = [claim.stage_index for part, claim in zip(parts, claims)
                  if (part.meta.outer_round, part.meta.replica, part.meta.inner_steps, part.meta.lr_total_steps)
                  != (outer_round, replica, diloco_cfg.inner_steps, expected_horizon)]
    if wrong_meta:
        return failed(STATE_MISMATCH, f"stage(s) {wrong_meta}: state metadata is not round {outer_round} of "
                      f"replica {replica}", wrong_meta)
    try:
        state = ReplicaStartState(tuple(parts))
    except ReplicaStateError as exc:
        return failed(STATE_MISMATCH, f"served state is malformed: {exc}")
    meta = state.meta  # the claimant's platform and threads (every stage's part records the same: ReplicaStartState)
    applied = start_global_round(diloco_cfg, outer_round)
    for part in parts:
        committed = (committed_weights or {}).get(applied, {}).get(part.stage_index)
        if committed is not None and stage_weights_hash(part.group("global")) != committed:
            return failed(STATE_MISMATCH,
                          f"stage {part.stage_index}: global weights are not round {applied}'s on record",
                          [part.stage_index])
    declared = None
    if diloco_cfg.budgeted:
        # The stages of one replica train the same steps (the pipeline agrees on the count) and declare it;
        # the rerun trains exactly that many.
        counts = {claim.stage_index: claimed_steps(claim.payload) for claim in claims}
        bad = [stage for stage, count in counts.items() if not steps_in_range(diloco_cfg, count)]
        if bad:
            return failed(MISMATCH, f"stage(s) {bad}: declared inner steps {[counts[s] for s in bad]} outside "
                          f"the run's [{diloco_cfg.min_inner_steps}, {diloco_cfg.inner_steps}]", bad)
        if len(set(counts.values())) != 1:
            return failed(MISMATCH, f"the stages declare different inner steps {counts}")
        declared = next(iter(counts.values()))
    expected_data = data_commitment(corpus, training_cfg, model_cfg, diloco_cfg, replica, outer_round, declared)
    wrong_data = [claim.stage_index for claim in claims if claim.data_commitment != expected_data]
    if wrong_data:
        return failed(DATA_MISMATCH, "the data commitment is not this round's batches", wrong_data)
    try:
        rerun = reexecute(state, corpus, model_cfg, training_cfg, diloco_cfg, compression_cfg,
                          previous_contributions=previous_contributions, previous_excluded=previous_excluded,
                          previous_dropped=previous_dropped, threads=threads, previous_partials=previous_partials,
                          declared_steps=declared)
    except ReplicaStateError as exc:
        return failed(STATE_MISMATCH, f"state does not fit the run's model: {exc}")
    elsewhere = [c.stage_index for c in claims if c.applied_hash != rerun.applied_hashes.get(c.stage_index, NO_APPLY)]
    if elsewhere:
        # Not a cheat: the round was trained on another result of round t-1 (the claimant's fork),
        # which the holders leave out of the aggregate (node.binding.other_result_exclusions).
        return failed(OTHER_RESULT, f"stage(s) {elsewhere}: built on another result of round {outer_round - 1} "
                      "than the record's (its bound applied hash is not what the rerun's apply gives)", elsewhere)
    specs = split_stages(model_cfg.n_layer, num_stages)
    distance = (functools.partial(sliced_contribution_distance, diloco_cfg=diloco_cfg)
                if diloco_cfg.exchange == "sliced" else contribution_distance)
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
                           rerun_threads=rerun.threads, tolerance=tolerance)
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
                                     rerun_threads=rerun.threads, tolerance=tolerance).verdict == MISMATCH)
    return SpotCheck(outer_round, replica, outcome, f"{judged.rule}: {judged.reason}", distances, next_hashes,
                     rerun.seconds, failing, judged.rule)
