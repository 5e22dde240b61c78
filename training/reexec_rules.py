"""The parts of a re-execution spot check that need no rerun (training/reexec.py reruns): what a
contribution's round reads (:func:`data_commitment`, :func:`round_meta`), where a replica's start state must
come from (:func:`start_global_round`, :func:`check_state_chain`, :func:`restart_state_reason`) and who checks
whom (:func:`sample_replicas`). training.reexec re-exports every name.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence

import msgpack
import torch

from training.codec_wire import MSGPACK_ERRORS, header_steps
from training.config import DilocoConfig, ModelConfig, TrainingConfig
from training.data import Corpus, round_batches, windows_key
from training.errors import ReplicaStateError
from training.fingerprint import EXACT, PlatformFingerprint
from training.hashing import stage_weights_hash, tensor_le_bytes
from training.muon import optimizer_prefixes
from training.platform import process_platform
from training.replica_state import RoundMeta, parse_stage_state
from training.schedule import pending_after_round

DATA_MAGIC = b"dlx-round-data-v1"
SAMPLE_MAGIC = b"dlx-reexec-sample-v1"
STATE_MISMATCH = "state_mismatch"  # the served state is not the committed one, or not where the chain leads


# ----------------------------------------------------------------------------- what the round reads


def data_commitment(
    corpus: Corpus, training_cfg: TrainingConfig, model_cfg: ModelConfig, diloco_cfg: DilocoConfig,
    replica: int, outer_round: int, steps: int | None = None, data_key: bytes | None = None,
) -> bytes:
    """sha256 of the token ids the inner steps of ``(replica, outer_round)`` consume.

    ``sha256(b"dlx-round-data-v1" || corpus sha256 (32 bytes) || u64 run_seed || u64 replica
    || u64 round || u64 n || u64 batch || u64 block || for k in 0..n-1: x_k || y_k)``,
    integers little-endian, ``x_k``, ``y_k`` the int64 token ids of step ``k`` (row-major, LE);
    ``n = steps``: H by default, a time-bounded run's declared count (batch ``k`` of a round does not
    depend on ``n``: :func:`training.data.window_offsets`). In a run whose windows are keyed by account
    (``training.data_windows = "account"``) the 20 bytes of ``data_key`` (the replica's key:
    :func:`training.data.windows_key`) stand in place of ``u64 replica``.
    """
    steps = diloco_cfg.inner_steps if steps is None else steps
    batch, block = training_cfg.batch_size, model_cfg.block_size
    key = windows_key(training_cfg, replica, data_key)
    digest = hashlib.sha256(DATA_MAGIC + bytes.fromhex(corpus.sha256))
    if isinstance(key, bytes):
        digest.update(struct.pack("<Q", training_cfg.seed) + key
                      + struct.pack("<4Q", outer_round, steps, batch, block))
    else:
        digest.update(struct.pack("<6Q", training_cfg.seed, replica, outer_round, steps, batch, block))
    for x, y in round_batches(corpus, training_cfg.seed, key, outer_round, steps, batch, block):
        digest.update(tensor_le_bytes(x))
        digest.update(tensor_le_bytes(y))
    return digest.digest()


def round_meta(
    outer_round: int, replica: int, model_cfg: ModelConfig, diloco_cfg: DilocoConfig, *, run_rounds: int,
    num_stages: int, micro_batches: int = 0, threads: int | None = None,
    platform: PlatformFingerprint | None = None,
) -> RoundMeta:
    """The :class:`RoundMeta` a node records for ``(replica, outer_round)``.

    ``run_rounds``: the run's rounds (0 = open-ended, no lr decay horizon), as
    :meth:`node.live.worker.replica.ReplicaWorker.train_round` uses it; ``micro_batches``:
    the pipeline's count if this replica is split over processes, else 0;
    ``threads``: default ``torch.get_num_threads()``; ``platform``: default the
    fingerprint of this process's training platform now (the one its trainer was built
    for, :func:`training.platform.process_platform`).
    """
    del model_cfg  # the shapes come from the state itself; kept for a stable signature
    return RoundMeta(
        outer_round=outer_round, replica=replica, num_stages=num_stages, inner_steps=diloco_cfg.inner_steps,
        lr_total_steps=run_rounds * diloco_cfg.inner_steps if run_rounds > 0 else 0,
        threads=threads or torch.get_num_threads(), micro_batches=micro_batches,
        platform=platform if platform is not None else process_platform().fingerprint(),
    )


def claimed_steps(payload: bytes) -> int | None:
    """The inner steps a contribution's payload declares (None: none, or not a contribution at all).

    A sliced claim (the msgpack array of the slice blobs its bundle proves) declares the count every one
    of its slices declares; slices that declare different counts, or none, declare nothing valid.
    """
    steps = header_steps(payload)
    if steps is not None:
        return steps
    try:
        blobs = msgpack.unpackb(bytes(payload), raw=False, max_bin_len=len(payload), max_array_len=1 << 16)
    except MSGPACK_ERRORS:
        return None
    if not isinstance(blobs, list) or not blobs or not all(isinstance(blob, bytes) for blob in blobs):
        return None
    counts = {header_steps(blob) for blob in blobs}
    return counts.pop() if len(counts) == 1 else None


def steps_in_range(diloco_cfg: DilocoConfig, steps: int | None) -> bool:
    """True if ``steps`` is a count the run allows a contribution to declare (`min_inner_steps` to H)."""
    return steps is not None and diloco_cfg.min_inner_steps <= steps <= diloco_cfg.inner_steps


def start_global_round(diloco_cfg: DilocoConfig, outer_round: int) -> int:
    """The round whose global weights every replica holds when round ``outer_round`` starts (-1: the initial
    ones).

    Rounds are applied in order, and when a round's actions are done all but
    :func:`~training.schedule.pending_after_round` of them are: ``t - 2`` with the
    one-step delay, ``t - 1`` without. This holds for a replica that caught up after
    a restart too, whose engine counters lag (rounds it absorbed without having
    encoded them do not move ``last_applied``), so the check uses the schedule,
    not the counters.
    """
    return max(-1, outer_round - 1 - pending_after_round(diloco_cfg))


def check_state_chain(expected_stage_hashes: Sequence[bytes], claimed_stage_hashes: Sequence[bytes]) -> str:
    """:data:`EXACT` if round t+1's envelopes bind the start state round t's rerun produced, else
    :data:`STATE_MISMATCH`."""
    return EXACT if list(expected_stage_hashes) == list(claimed_stage_hashes) else STATE_MISMATCH


#: How far a restarted replica's round-start snapshot may sit from the global weights it was rebuilt
#: from: catching up applies each round's global delta to both (``absorb_round``), and float32
#: ``old + (new - old)`` is ``new`` only to within rounding.
RESTART_RTOL, RESTART_ATOL = 1e-5, 1e-6


def restart_state_reason(
    state_parts: Sequence[bytes],
    claimed_stage_hashes: Sequence[bytes],
    committed_weights: Mapping[int, Mapping[int, bytes]] | None = None,
    global_round: int | None = None,
) -> str | None:
    """None if the parts are a start state rebuilt from the public record alone, else why not.

    A replica that restarted (a crash, a stop) enters from a chain-verified
    checkpoint (:meth:`~training.diloco.StageEngine.rebase`): live weights =
    round start = the global weights, a fresh inner optimizer, a zero
    error-feedback residual, nothing pending. Such a state does not follow
    from the replica's previous one, but it follows from the record, which is
    all the chain check asks. Every part must hash to its claim, hold no inner-optimizer
    state (AdamW's or Muon's), no pending or transmitted snapshots, a zero residual, weights equal
    to the round-start snapshot and that snapshot within rounding of the
    global weights, which must be the record's of ``global_round``
    (:func:`start_global_round`; ``committed_weights``: round -> stage -> hash,
    where known).
    """
    if len(state_parts) != len(claimed_stage_hashes):
        return f"{len(state_parts)} state parts for {len(claimed_stage_hashes)} claims"
    for data, claimed in zip(state_parts, claimed_stage_hashes):
        try:
            part = parse_stage_state(data)
        except ReplicaStateError as exc:
            return f"served state is malformed: {exc}"
        stage = part.stage_index
        if part.state_hash() != claimed:
            return f"stage {stage}: served state is not the committed one"
        groups = {name.split("/", 1)[0] for name in part.tensors}
        carried = sorted(
            g
            for g in groups
            if g.startswith((*optimizer_prefixes(), "round_end.", "own_decoded.", "sent.", "encoder."))
            or g == "others_previous"
        )
        if carried:
            return f"stage {stage}: carries state a restart does not have ({', '.join(carried[:4])})"
        residual = part.group("residual")
        if any(bool(t.any()) for t in residual.values()):
            return f"stage {stage}: error-feedback residual is not zero"
        params, start, global_weights = part.group("param"), part.group("round_start"), part.group("global")
        if set(params) != set(start) or set(start) != set(global_weights) or not params:
            return f"stage {stage}: weight groups do not name the same tensors"
        if any(not torch.equal(params[n], start[n]) for n in params):
            return f"stage {stage}: live weights differ from the round-start snapshot"
        if any(not torch.allclose(start[n], global_weights[n], rtol=RESTART_RTOL, atol=RESTART_ATOL)
               for n in start):
            return f"stage {stage}: round-start weights are not the global weights"
        committed = (committed_weights or {}).get(global_round, {}).get(stage)
        if committed is not None and stage_weights_hash(global_weights) != committed:
            return f"stage {stage}: global weights are not round {global_round}'s on record"
    return None


# ----------------------------------------------------------------------------- who checks whom


def sample_score(previous_record_hash: bytes, verifier: bytes, outer_round: int, replica: int) -> float:
    """The uniform number in [0, 1) that decides whether ``verifier`` re-executes ``replica`` in
    ``outer_round``.

    ``int(sha256(b"dlx-reexec-sample-v1" || u32 len(record) || record || u32 len(verifier)
    || verifier || u64 round || u64 replica)[:8], big-endian) / 2**64``. The record hash is
    round ``outer_round``'s own attested record (it exists only once the round closed with
    the contribution in it), the verifier its peer id bytes: unpredictable to the member
    while it trains, and anyone can recompute it.
    """
    digest = hashlib.sha256(SAMPLE_MAGIC)
    digest.update(struct.pack("<I", len(previous_record_hash)) + previous_record_hash)
    digest.update(struct.pack("<I", len(verifier)) + verifier)
    digest.update(struct.pack("<QQ", outer_round, replica))
    return int.from_bytes(digest.digest()[:8], "big") / 2**64


def sample_replicas(
    previous_record_hash: bytes, verifier: bytes, outer_round: int, replicas: Sequence[int], rate: float,
    *, own_replica: int | None = None,
) -> list[int]:
    """The replicas ``verifier`` re-executes in ``outer_round``: those with :func:`sample_score` < ``rate``.

    Each (verifier, replica) pair is drawn independently with probability
    ``rate``; a verifier never checks its own replica.
    """
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"reexec sampling rate={rate}: must be in [0, 1]")
    return [
        replica
        for replica in sorted(replicas)
        if replica != own_replica
        and sample_score(previous_record_hash, verifier, outer_round, replica) < rate
    ]
