"""Whether a round of the run can still be challenged or proven on chain (the node's retention and its
published states follow it: node/store/retention.py, node/live/fraud/chunkstate.py)."""

from __future__ import annotations

import logging

from ledger.errors import LedgerError
from node.errors import DLX_ERRORS

logger = logging.getLogger(__name__)


class DisputeWindow:
    """Whether a round of the run can still be challenged or proven on chain: until its proof window closes
    (TrainingLedger.proofWindowOf: its dispute window, extended while an availability game on it can go on,
    issue 62). Until then a node keeps its state of the round, or a late step of a game on a right round
    would go unanswered and overturn it, slashing honest attesters (docs/FRAUD_PROOF.md, "The node"). A round
    not committed yet, or one the chain could not be asked about, is open: keeping a state longer costs
    memory, dropping it early can cost a right round."""

    def __init__(self, chain, run_id: int) -> None:
        self.chain = chain
        self.run_id = run_id

    def open(self, outer_round: int) -> bool:
        try:
            if self.chain.commit_record(self.run_id, outer_round) is None:
                return True
            _opens, closes = self.chain.proof_window_of(self.run_id, outer_round)
            return self.chain.block_number() < closes
        except (*DLX_ERRORS, LedgerError) as exc:
            logger.debug("round %d: proof window not read (its state is kept): %s", outer_round, exc)
            return True

    def own_open(self, outer_round: int) -> bool:
        """Whether round ``outer_round`` itself can still be disputed or have an availability game on it: its
        own window (its dispute window, its open disputes' deadline, its games), which ends where the next
        round's proof window opens (TrainingLedger.proofWindowOf). Open while the next round is not committed,
        or the chain could not be asked (node/store/retention.py keeps the round's archive until then)."""
        try:
            if self.chain.commit_record(self.run_id, outer_round + 1) is None:
                return True
            opens, _closes = self.chain.proof_window_of(self.run_id, outer_round + 1)
            return self.chain.block_number() < opens
        except (*DLX_ERRORS, LedgerError) as exc:
            logger.debug("round %d: its window not read (its files are kept): %s", outer_round, exc)
            return True

    def forget(self, outer_round: int) -> None:
        """Nothing is cached: a game can extend a round's window at any time until it closes."""
