"""Committed factors held to the run's values on chain (issue 62; docs/FRAUD_PROOF.md, "The run's values",
"The binding"): what the live prover (node/live/fraud/prover.py) proves of a round whose factors the run does
not allow, whatever its chunks.

Since issue 62 a fraud-provable run binds its per-round values at ``createRun`` (``RunParams``: the outer
schedule's root, the Nesterov flag, the norm clip, ``maxContributions``, ``innerSteps``, the genesis root)
and each listed contribution is signed by a member. A colluding quorum can commit a round stepped with another
lr, mu or Nesterov flag, or another clip, or steps past H, or more contributions than allowed, or a
contribution nobody signed, each with weights consistent with its factors: every chunk is then the step of the
committed factors, and what proves the round wrong is the factors themselves, held to the run:

- a **values proof** (``proveWrongAggregation`` of chunk 0 with the factors and the run's schedule leaf and no
  leaf of the chunk: the contract finds the round wrong before it reads one) for another lr, mu or Nesterov
  flag, or factors that are not canonical, of another version than the run's or listing more contributions
  than ``maxContributions`` in a chunked (version-2) run;
- the **scales' proof** (``proveWrongNorm``, ``contribution = SCALES``: the factors alone) in a normed run for
  factors that are not canonical, of another version or listing too many, another norm clip, declared steps
  past H, or a binding that does not hold (a signature that does not recover to the account listed beside it,
  one account twice; an account that held no seat in the round is seen only by the contract's view, which the
  prover asks: node/live/fraud/factors.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from ledger.chunkproof import (AggregationProof, Factors, StageLeaf, StageState, build_proof, genesis_record,
                               tree_path)
from ledger.contribution_binding import ContributionClaim, recover_contributor
from ledger.errors import LedgerInputError
from ledger.runparams import MAX_RANK

#: A fault the values proof shows (proveWrongAggregation over the factors alone).
CHUNK = "values"
#: A fault the scales' proof shows (proveWrongNorm, SCALES: a normed run only).
NORM = "scales"
#: RunParams.commitments of a normed run (version 3).
NORMED = 3
#: A payload piece's header (u8 codec, u32 count), then a low-rank piece's u8 rank (training/chunks.py).
PIECE_HEADER = 5
LOWRANK = 2


@dataclass(frozen=True)
class RunValues:
    """What a run binds on chain that its rounds' factors are held to (``ledger.runparams.RunInfo``'s issue-62
    fields, the run's schedule, and the EIP-712 domain the binding is signed under)."""

    run_id: int
    version: int  # RunParams.commitments
    schedule: object | None  # ledger.runvalues.Schedule; None: a run created without one (not checked)
    nesterov: bool
    norm_clip_bits: int
    inner_steps: int
    max_contributions: int
    genesis_root: bytes
    chain_id: int = 0
    ledger_address: str = ""
    max_rank: int = MAX_RANK  # RunParams.maxRank: a listed low-rank piece of a higher rank does not decode

    @classmethod
    def of(cls, info, schedule, *, chain_id: int = 0, ledger_address: str = "") -> RunValues:
        """The values of the run ``info`` (a RunInfo) with its ``schedule`` (None where it binds none)."""
        bound = bool(getattr(info, "schedule_rounds", 0))
        return cls(info.run_id, info.commitments, schedule if bound else None, bool(info.nesterov),
                   info.norm_clip_bits, info.inner_steps, info.max_contributions or 2**16 - 1,
                   bytes(info.genesis_root), chain_id, ledger_address, info.max_rank or MAX_RANK)

    @property
    def bound(self) -> bool:
        """Whether the run binds its per-round values (a schedule on chain)."""
        return self.schedule is not None


def factors_fault(values: RunValues, factors: Factors | bytes, outer_round: int,
                  stage: int) -> tuple[str, str] | None:
    """``(kind, why)``: the first way the committed ``factors`` (decoded, or their bytes where they do not
    decode) of ``stage`` in round ``outer_round`` are not what the run allows, and the proof that shows it
    (:data:`CHUNK` or :data:`NORM`); None if none seen here. The order is the contract's: canonical and
    version first, then the count, then the schedule and flag (values proof), then the clip, the steps and the
    binding (scales' proof)."""
    normed = values.version == NORMED
    if isinstance(factors, bytes):
        return (NORM if normed else CHUNK), "factors are not canonical version-3 factors" if normed \
            else "factors are not canonical"
    if (factors.norms is not None) != normed:
        if normed:
            return NORM, "factors are version 2 (no norm commitment) in a version-3 run"
        return CHUNK, f"factors are version 3 (a norm commitment) in a version-{values.version} run"
    listed = len(factors.scale_bits)
    if listed > values.max_contributions:
        return (NORM if normed else CHUNK), \
            f"factors list {listed} contributions, more than the run's {values.max_contributions}"
    if values.bound:
        lr, mu = values.schedule.of_round(outer_round)
        if (factors.lr_bits, factors.mu_bits) != (lr, mu):
            return CHUNK, (f"factors' lr/mu bits {factors.lr_bits:#010x}/{factors.mu_bits:#010x} are not the "
                           f"run's schedule's {lr:#010x}/{mu:#010x} for round {outer_round}")
        if factors.nesterov != values.nesterov:
            return CHUNK, f"factors' Nesterov flag {factors.nesterov} is not the run's {values.nesterov}"
    norms = factors.norms
    if norms is None:
        return None
    if values.bound and norms.clip_bits != values.norm_clip_bits:
        return NORM, f"factors' normClip bits {norms.clip_bits:#018x} are not the run's " \
                     f"{values.norm_clip_bits:#018x}"
    if any(step > values.inner_steps for step in norms.steps):
        return NORM, f"factors declare {max(norms.steps)} steps, past the run's {values.inner_steps}"
    return _binding_fault(values, factors, outer_round, stage)


def _binding_fault(values: RunValues, factors: Factors, outer_round: int,
                   stage: int) -> tuple[str, str] | None:
    norms = factors.norms
    if not norms.bound:
        return NORM, "factors list contributions without their binding (no member signed them)"
    if len(set(norms.contributors)) != len(norms.contributors):
        return NORM, "factors list one member's account twice"
    if not values.ledger_address:
        return None
    for j, (account, signature) in enumerate(zip(norms.contributors, norms.signatures, strict=True)):
        claim = ContributionClaim(values.run_id, outer_round, stage, factors.payload_roots[j], norms.roots[j],
                                  norms.steps[j] if norms.steps else 0)
        try:
            signer = recover_contributor(claim, signature, values.chain_id, values.ledger_address)
        except LedgerInputError:
            signer = None
        if signer != account:
            return NORM, f"factors list contribution {j} with a signature not by its contributor {account}"
    return None


def values_proof(prev_record, record, prev_leaves: list[bytes], leaves: list[bytes], stage: int,
                 factors: bytes, schedule=None) -> AggregationProof:
    """The chunk proof that round ``record``'s factors of ``stage`` are not the run's (the :data:`CHUNK` kind
    of :func:`factors_fault`): chunk 0 with the committed ``factors`` and the run's schedule leaf, no tensor
    leaf and no piece (the contract finds the round wrong before it reads them). ``prev_record`` None: round
    0, whose ``prev_leaves`` are the run's genesis stage leaves (node.commitments.values.genesis_states)."""
    schedule_leaf, schedule_path = schedule.opening(record.round) if schedule is not None else (b"", [])
    return AggregationProof(
        prev_record=genesis_record(record.run_id) if prev_record is None else prev_record.fields(),
        record=record.fields(), stage=stage, chunk=0,
        prev_stage_leaf=prev_leaves[stage], prev_stage_path=tree_path(list(prev_leaves), stage),
        stage_leaf=leaves[stage], stage_path=tree_path(list(leaves), stage), factors=factors,
        prev_weights=b"", prev_weights_path=[], prev_momentum=b"", prev_momentum_path=[],
        new_weights=b"", new_weights_path=[], new_momentum=b"", new_momentum_path=[], pieces=[],
        piece_paths=[], schedule_leaf=schedule_leaf, schedule_path=schedule_path)


def piece_past_rank(pieces: list[bytes], max_rank: int) -> int | None:
    """The first chunk whose piece is a low-rank piece of rank 0 or past ``max_rank`` (the run's
    ``maxRank``): the contract's decoder refuses it (``ProverCommon.wellFormedPiece``), so a round listing the
    contribution is wrong at that chunk whatever its weights; None if every piece keeps the rank."""
    for chunk, piece in enumerate(pieces):
        if len(piece) > PIECE_HEADER and piece[0] == LOWRANK and not 1 <= piece[PIECE_HEADER] <= max_rank:
            return chunk
    return None


def rank_proof(prev_record, record, prev_leaves: list[bytes], leaves: list[bytes], prev, committed: tuple,
               factors: Factors, pieces: list, chunk: int, schedule=None) -> AggregationProof:
    """The chunk proof of ``chunk`` of round ``record`` whose committed ``factors`` list a contribution whose
    piece there does not decode (:func:`piece_past_rank`): ``prev`` this node's state of round t - 1 (the
    committed one; the genesis state for round 0, ``prev_record`` None), ``committed`` the round's committed
    ``(weight leaves, momentum leaves)`` (fetched from an attester), ``pieces`` each listed contribution's
    pieces in the factors' order, None for one not held here: the contract reads the pieces in order and
    stops at the first that does not decode, so those after it are sent empty."""
    stage = prev.stage
    shaped = [held if held is not None else [b""] * len(committed[0]) for held in pieces]
    state = StageState(stage, list(committed[0]), list(committed[1]), factors, shaped)
    stages = [StageLeaf.decode(leaf) for leaf in leaves]
    return build_proof(prev_record, record, [StageLeaf.decode(leaf) for leaf in prev_leaves], stages, prev,
                       state, chunk, schedule)
