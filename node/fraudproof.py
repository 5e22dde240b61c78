"""The fraud proof's building blocks (issue 43; docs/FRAUD_PROOF.md): a stage's chunked commitment from an
aggregation, and the proof of the first chunk where a committed round differs from this node's own.

training/chunks.py makes the leaves (torch), ledger/chunkproof.py the trees, the stage leaf and the proof's
bytes (no torch); this module puts an aggregation and its inputs into those. Which of them a run uses is its
commitment scheme's choice (node/commitments/).
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
from eth_abi.exceptions import DecodingError

from ledger.chunkproof import Factors, Norms, StageLeaf, StageState, build_proof, first_difference, tree_root
from ledger.contribution_binding import ContributionClaim
from ledger.errors import LedgerInputError
from ledger.normproof import SumTree, clip_scales, first_wrong_sum, scale_proof, sum_proof
from training.chunks import CHUNK_ELEMENTS, float32_bits, float64_bits, payload_pieces, stage_layout, \
    tensor_leaves
from training.codec_wire import decode_declared
from training.config import DilocoConfig
from training.robust import ContributionReport
from training.schedule import outer_lr, outer_momentum
from training.spilled import shapes_of


def parse_stage_leaf(data: bytes, stage: int) -> StageLeaf:
    """The stage leaf ``data`` (an attestation's or a checkpoint's) of stage ``stage``, or
    LedgerInputError."""
    try:
        leaf = StageLeaf.decode(bytes(data))
    except (DecodingError, TypeError, ValueError) as exc:  # eth_abi's errors: no base class shared with ours
        raise LedgerInputError(f"stage leaf of stage {stage} does not decode: {type(exc).__name__}") from None
    if leaf.stage != stage or leaf.encode() != bytes(data):
        raise LedgerInputError(
            f"stage leaf names stage {leaf.stage} (or is not canonical), not stage {stage}")
    return leaf


def round_factors_bits(diloco_cfg: DilocoConfig, outer_round: int) -> tuple[int, int]:
    """``(lr, mu)`` of ``outer_round`` as the float32 bit patterns the outer step multiplies by."""
    return float32_bits(outer_lr(diloco_cfg, outer_round)), \
        float32_bits(outer_momentum(diloco_cfg, outer_round))


def initial_state(stage: int, weights: Mapping[str, torch.Tensor],
                  momentum: Mapping[str, torch.Tensor]) -> StageState:
    """The state of a stage before any round: its weights and momentum, no factors."""
    return StageState(stage, tensor_leaves(weights), tensor_leaves(momentum),
                      Factors(0, 0, False, (), (), ()), [])


def stage_state_of(
    stage: int,
    new_global: Mapping[str, torch.Tensor],
    new_momentum: Mapping[str, torch.Tensor],
    reports: Sequence[ContributionReport],
    contributions: Sequence[bytes],
    diloco_cfg: DilocoConfig,
    outer_round: int,
    *,
    envelopes: Sequence[bytes] | None = None,
    decode_args: Mapping | None = None,
    norms: Callable,
    bindings: Sequence[tuple[str, bytes] | None] | None = None,
) -> StageState:
    """The chunked commitment of one stage after a round that aggregated ``contributions`` (canonical order)
    into ``new_global`` and ``new_momentum``, ``reports`` the aggregation's (one per contribution).

    ``envelopes``: each contribution's envelope digest (the contributions root's leaves); None: the sha256
    of its bytes (tests, simulations). ``decode_args``: as the aggregation decoded (stage_index, outer_round,
    refuse_raw). ``norms``: the run's scheme's ``stage_norms`` (node/commitments/), the factors' norm
    commitment of the accepted contributions and their sum trees, or ``(None, [])``. ``bindings``: each
    contribution's ``(contributor, signature)`` as it came with it (ledger/contribution_binding.py), copied
    into a version-3 commitment for the accepted ones (None: none, then the round is unbound: provably wrong
    on chain). Callers go through the scheme (``CommitmentScheme.stage_state_of``,
    ``node.commitments.stage_state``).
    """
    shapes = shapes_of(new_global)  # a state kept in a file (training/stage_engine_outer.py): not read for it
    envelopes = list(envelopes) if envelopes is not None else [hashlib.sha256(c).digest()
                                                               for c in contributions]
    accepted = [report for report in reports if report.accepted]
    pieces = [payload_pieces(contributions[r.index], shapes, **dict(decode_args or {})) for r in accepted]
    lr, mu = round_factors_bits(diloco_cfg, outer_round)
    committed_norms, trees = norms([contributions[r.index] for r in accepted], shapes, diloco_cfg,
                                   decode_args)
    if committed_norms is not None and bindings is not None and all(bindings[r.index] for r in accepted):
        committed_norms = dataclasses.replace(committed_norms,
                                              contributors=tuple(bindings[r.index][0] for r in accepted),
                                              signatures=tuple(bindings[r.index][1] for r in accepted))
    factors = Factors(lr, mu, bool(diloco_cfg.nesterov), tuple(envelopes[r.index] for r in accepted),
                      tuple(tree_root(leaves) for leaves in pieces),
                      tuple(float64_bits(r.scale) for r in accepted), committed_norms)
    return StageState(stage, tensor_leaves(new_global), tensor_leaves(new_momentum), factors, pieces, trees)


def chunk_square_sums(tensors: Mapping[str, torch.Tensor]) -> list[int]:
    """The exact sum of squares of each chunk of a stage's decoded (unclipped) contribution, in units of
    2**-298 (ledger/normproof.py), chunk ``i`` over the elements its payload piece decodes to: the integers
    ``ledger.normproof.square_sum`` gives chunk by chunk (tests/test_chunk_commitments.py), without a Python
    step per element. LedgerInputError for a non-finite value."""
    shapes = {name: tuple(value.shape) for name, value in tensors.items()}
    sums: list[int] = []
    # a tensor's chunks are consecutive
    for name in dict.fromkeys(place.name for place in stage_layout(shapes)):
        flat = tensors[name].detach().to(torch.float32).reshape(-1).contiguous().numpy()
        sums += _tensor_square_sums(flat)
    return sums


#: Base-256 digits of one chunk's sum: a square is m**2 2**(2e - 2) units (m < 2**24, 1 <= e <= 254), so a
#: chunk of CHUNK_ELEMENTS (64) squares sums below 2**(506 + 48 + 6) < 256**71.
_DIGITS = 72


#: Elements whose chunks' sums are worked out at once (a whole number of chunks): about a dozen int64 and
#: float64 work arrays of this length (8 MiB each), whatever the tensor's size (a llama-124m embedding of
#: 24.6 M elements made them 2.4 GB at once).
_BLOCK_ELEMENTS = CHUNK_ELEMENTS * 16384


def _tensor_square_sums(values: np.ndarray) -> list[int]:
    """Each CHUNK_ELEMENTS-long chunk's exact sum of squares of the float32 ``values`` (the last chunk may be
    short), a block of whole chunks at a time (each chunk's sum depends on its own elements only)."""
    sums: list[int] = []
    for start in range(0, len(values), _BLOCK_ELEMENTS):
        sums += _block_square_sums(values[start:start + _BLOCK_ELEMENTS])
    return sums


def _block_square_sums(values: np.ndarray) -> list[int]:
    """:func:`_tensor_square_sums` of one block. Each square is ``m**2 2**(2e - 2)``: split as
    ``(m**2 << (2e - 2) % 8) << 8 q`` (q = (2e - 2) // 8), the first factor below 2**55. Per chunk and q,
    those are added in two 28-bit halves by ``np.bincount`` (float64, exact: at most 64 terms below 2**28
    each), then each chunk's digits (one per q) are carried in base 256 and read as one integer."""
    bits = values.astype("<f4", copy=False).view(np.uint32).astype(np.int64)
    biased = bits >> 23 & 0xFF
    if (biased == 0xFF).any():
        bad = float(values[np.flatnonzero(biased == 0xFF)[0]])
        raise LedgerInputError(f"a non-finite value ({bad!r}) has no sum of squares")
    mantissa = np.where(biased > 0, bits & 0x7FFFFF | 0x800000, bits & 0x7FFFFF)  # a subnormal's e is 1
    shift = 2 * np.maximum(biased, 1) - 2
    terms = mantissa * mantissa << (shift & 7)
    chunks = -(-len(bits) // CHUNK_ELEMENTS)
    keys = np.arange(len(bits)) // CHUNK_ELEMENTS * _DIGITS + (shift >> 3)
    low = np.bincount(keys, weights=terms & (2**28 - 1), minlength=chunks * _DIGITS).astype(np.int64)
    high = np.bincount(keys, weights=terms >> 28, minlength=chunks * _DIGITS).astype(np.int64)
    digits = (low + (high << 28)).reshape(chunks, _DIGITS)
    for q in range(_DIGITS - 1):
        digits[:, q + 1] += digits[:, q] >> 8
        digits[:, q] &= 0xFF
    data = digits.astype(np.uint8).tobytes()
    return [int.from_bytes(data[c * _DIGITS:(c + 1) * _DIGITS], "little") for c in range(chunks)]


def stage_norms(accepted: Sequence[bytes], shapes: Mapping[str, tuple[int, ...]], diloco_cfg: DilocoConfig,
                decode_args: Mapping | None = None) -> tuple[Norms, list[SumTree]]:
    """The version-3 norm commitment of a stage's accepted contributions (their bytes, in the factors' order)
    and each one's sum tree: what the norm rule's scales follow from (docs/FRAUD_PROOF.md)."""
    trees, steps = [], []
    for blob in accepted:
        declared, tensors = decode_declared(blob, shapes, **dict(decode_args or {}))
        trees.append(SumTree.of(chunk_square_sums(tensors)))
        steps.append(declared)
    steps = tuple(steps) if diloco_cfg.budgeted else ()
    norms = Norms(float64_bits(float(diloco_cfg.norm_clip)), steps, tuple(tree.root for tree in trees),
                  tuple(tree.total for tree in trees))
    return norms, trees


def contribution_claim(blob: bytes, shapes: Mapping[str, tuple[int, ...]], diloco_cfg: DilocoConfig, *,
                       run_id: int, outer_round: int, stage: int,
                       decode_args: Mapping | None = None) -> ContributionClaim:
    """What a contributor signs of its contribution ``blob`` to ``stage`` (issue 62): its payload root and
    sum-tree root as a version-3 factors list them, and its declared steps in a run bounded by time."""
    (norms, _trees) = stage_norms([blob], shapes, diloco_cfg, decode_args)
    # cut as they are hashed (training.chunks.CutPayload), never a list: a low-rank piece carries a row of Q
    # per element, so every piece of a llama-60m stage's contribution at once was 1.1 GB (issue 75)
    pieces = payload_pieces(blob, shapes, **dict(decode_args or {}))
    return ContributionClaim(run_id, outer_round, stage, tree_root(pieces), norms.roots[0],
                             norms.steps[0] if norms.steps else 0)


def proof_of_difference(prev_record, record, prev_stages, committed_stages, prev: StageState,
                        mine: StageState, committed: StageState):
    """``(proof, why)``: the proof of the first chunk where the committed state of a stage differs from this
    node's own (``mine``, derived from the same inputs), or None with the reason no proof applies.

    ``committed`` is the state the round's committers published (its leaves under the record's root);
    a difference in the factors alone (another clip scale or set left out) is not provable by a chunk
    (docs/FRAUD_PROOF.md, "Known gaps").
    """
    if mine.leaf() == committed.leaf():
        return None, "the committed stage is this node's own"
    if mine.factors != committed.factors:
        return None, \
            "the committed factors differ from this node's (a clip scale or the set left out): not provable"
    chunk = first_difference(mine, committed)
    if chunk is None:
        return None, "the committed leaves equal this node's"
    return build_proof(prev_record, record, prev_stages, committed_stages, prev, committed, chunk), \
        f"chunk {chunk}"


def norm_proof_of_difference(record, stage_leaves: Sequence[bytes], stage: int, committed: Factors,
                             trees: Sequence[SumTree], own: StageState, committed_weights):
    """``(proof, why)``: the norm proof (ledger/normproof.py) of a version-3 round whose committed factors
    (``committed``, with its sum ``trees``, as the committers published them; None: not had) differ from this
    node's (``own``),
    or None with the reason no norm proof applies. ``committed_weights``: a callable giving the round's
    committed weight leaves (a sum proof places its chunk by one), or None if they are not had.

    First the factors' version: version-2 factors (no norm commitment) in a version-3 run are wrong on their
    face (the ledger holds the run's version, ``RunParams.commitments``), and any norm proof over them proves
    it; then the scales against the rule of the committed sums; then the first committed contribution whose
    pieces are this node's own (the same envelope and payload root) and whose committed sum tree or total is
    not this node's (:func:`wrong_sum_contribution`). Without the committed ``trees``, a committed tree whose
    root is this node's is this node's own; any other is not had here (the live prover then walks it through
    availability challenges: node.live.fraud.walks.SumWalk).
    """
    norms = committed.norms
    if norms is None:
        return (scale_proof(record, list(stage_leaves), stage, committed.encode()),
                "factors are version 2 (no norm commitment) in a version-3 run")
    rule = [float64_bits(scale) for scale in clip_scales(norms.sums, _double(norms.clip_bits), norms.steps)]
    if tuple(rule) != committed.scale_bits:
        index = next(j for j, (a, b) in enumerate(zip(rule, committed.scale_bits, strict=True)) if a != b)
        return (scale_proof(record, list(stage_leaves), stage, committed.encode()),
                f"clip scale {index} is not the norm rule of the committed sums")
    found = wrong_sum_contribution(committed, own)
    if found is None:
        return None, \
            ("the committed factors differ elsewhere (the set left out, or a contribution's pieces): "
             "not provable")
    j, i = found
    # A committed tree whose root is this node's is this node's tree (only the committed total can differ).
    tree = trees[j] if trees is not None else own.sum_trees[i] if own.sum_trees[i].root == norms.roots[j] \
        else None
    if tree is None:
        return None, "the scales follow from the committed sums, and the committed sum trees are not had"
    chunk = first_wrong_sum(own.sum_trees[i].sums, tree)
    weights = committed_weights()
    if weights is None:
        return None, f"contribution {j}'s sum is wrong but the committed weights are not had"
    chunk = 0 if chunk is None else chunk
    return (sum_proof(record, list(stage_leaves), stage, committed.encode(), weights, own.payload_leaves[i],
                      tree, j, chunk), f"contribution {j}'s sum of squares at chunk {chunk}")


def wrong_sum_contribution(committed: Factors, own: StageState) -> tuple[int, int] | None:
    """``(j, i)``: the first contribution ``j`` of the ``committed`` version-3 factors whose pieces are this
    node's own (its contribution ``i``: the same envelope and payload root) and whose committed sum tree root
    or total is not this node's, or None if there is none (then no sum proof applies)."""
    norms = committed.norms
    if norms is None or own.factors.norms is None or not own.sum_trees:
        return None
    mine = {envelope: index for index, envelope in enumerate(own.factors.envelopes)}
    for j, envelope in enumerate(committed.envelopes):
        i = mine.get(envelope)
        if i is None or own.factors.payload_roots[i] != committed.payload_roots[j]:
            continue
        if norms.roots[j] != own.sum_trees[i].root or norms.sums[j] != own.sum_trees[i].total:
            return j, i
    return None


def _double(bits: int) -> float:
    return struct.unpack(">d", bits.to_bytes(8, "big"))[0]
