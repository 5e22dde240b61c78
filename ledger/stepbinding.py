"""What binds a run claim (StepProver.claimRun, issue 78) to the ledger's record: the contribution it is about
and the state its steps start from (contracts/src/StepProverBinding.sol; docs/FRAUD_PROOF.md, "The
contribution proof").

A run claim names the contribution's payload root (a leaf of its round's committed factors, which a normed
run's contributor signed) and the stage's weights root the round starts from (round ``t - 1``'s committed
stage leaf, or the run's genesis for round 0); :func:`bind_run` builds those fields and the openings the
contract checks them with, from what a node keeps of the two rounds (records, stage leaves, factors).
"""

from __future__ import annotations

from dataclasses import dataclass

from ledger.chunkproof import genesis_record, tree_path
from ledger.errors import LedgerInputError


@dataclass(frozen=True)
class RunSubject:
    """A run claim's subject (``fields()``: the claim's five fields after its step count) and the contract's
    ``RunBinding``; ``data_key``: the account the contribution's batches are drawn with (the member the
    round's version-3 factors list for it; the zero address where they list none), the claim's ``dataKey``."""

    run_id: int
    round: int
    stage: int
    payload_root: bytes
    start_weights: bytes
    binding: tuple
    data_key: str = "0x" + "00" * 20

    def fields(self) -> tuple:
        return (self.run_id, self.round, self.stage, self.payload_root, self.start_weights)


def bind_run(record, stage_leaves: list, factors, index: int, prev_record, prev_stage_leaves: list,
             stage: int = 0) -> RunSubject:
    """The subject of a claim about contribution ``index`` of ``factors`` (the round's committed
    ``ledger.chunkproof.Factors`` of ``stage``) in ``record``'s round.

    ``stage_leaves``: every ``StageLeaf`` of ``record`` (their tree is its weightsRoot); ``prev_record`` and
    ``prev_stage_leaves`` the same of round ``t - 1`` (round 0: ``prev_record`` None and the run's genesis
    stage leaves).

    Raises:
        LedgerInputError: ``index`` is not one of the factors' contributions, or ``stage`` not a stage leaf.
    """
    roots = list(factors.payload_roots)
    if not 0 <= index < len(roots):
        raise LedgerInputError(f"contribution {index} not in the round's {len(roots)} listed contributions")
    if not 0 <= stage < min(len(stage_leaves), len(prev_stage_leaves)):
        raise LedgerInputError(f"stage {stage} not among the records' {len(stage_leaves)} stage leaves")
    leaves = [leaf.encode() for leaf in stage_leaves]
    prev_leaves = [leaf.encode() for leaf in prev_stage_leaves]
    prev_fields = genesis_record(record.run_id) if prev_record is None else prev_record.fields()
    binding = (record.fields(), leaves[stage], tree_path(leaves, stage), factors.encode(), index, prev_fields,
               prev_leaves[stage], tree_path(prev_leaves, stage))
    key = listed_contributor(binding[3], index)
    return RunSubject(record.run_id, record.round, stage, bytes(roots[index]),
                      bytes(prev_stage_leaves[stage].weights_root), binding, key)


def listed_contributor(factors: bytes, index: int) -> str:
    """The member account encoded ``factors`` list for contribution ``index`` (a version-3 round's, which
    StepProverBinding checks a run claim's ``dataKey`` against); the zero address where they list none."""
    from ledger.chunkproof import Factors

    try:
        norms = Factors.decode(factors).norms
    except LedgerInputError:
        norms = None
    listed = tuple(norms.contributors) if norms is not None else ()
    return listed[index] if index < len(listed) else RunSubject.data_key
