"""The committer's last steps of a round: read the commit back from the chain and act on what it says.

After a round is committed (node/live/record/committer.py, step 6) every node reads it back once it is final:
in a chunked run a wrong weights root is proven on chain by this node itself (node/live/fraud/prover.py); a
record whose roots differ from this node's is a fork (node/live/record/forkrepair.py: dispute if our own
result stood, re-base on the record); a commit of this node's result that did not credit it (its signature
left out, or it signed the result with other figures or checkpoint hash) is attested; a committed checkpoint
that is not the run's is disputed. Members seen signing two different records of one round are reported
(``reportEquivocation``). :class:`RecordSigners` checks gossiped record signatures (the inbox's).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ledger.errors import ChainUnavailable, LedgerError, TransactionTimeout
from ledger.records import RoundRecord
from node import protocol as msg
from node.errors import DLX_ERRORS
from node.live.chain.onchain import NodeChain

logger = logging.getLogger(__name__)


class RecordSigners:
    """Who signed a gossiped record signature: a member of the run, by its EIP-712 signature (the inbox's
    check)."""

    def __init__(self, *, chain: NodeChain, run_id: int) -> None:
        self.chain = chain
        self.run_id = run_id

    def signer(self, record: RoundRecord, account: bytes, signature: bytes) -> tuple[str, bytes]:
        """(signer, EIP-712 digest) of a gossiped record signature by a member of the run, else
        ProtocolError."""
        try:
            signer = self.chain.signer_of(record, signature)
        except LedgerError as exc:
            raise msg.ProtocolError(
                f"record signature of round {record.round} does not verify: {exc}") from None
        if signer.lower() != "0x" + account.hex():
            raise msg.ProtocolError(
                f"record of round {record.round} is signed by {signer}, not by the account "
                f"0x{account.hex()} it names")
        if not self.chain.is_member(self.run_id, signer):
            raise msg.ProtocolError(
                f"record of round {record.round} is signed by {signer}, not a member of run "
                f"{self.run_id}")
        return signer, self.chain.client.record_digest(record)


class ReadBack:
    """Reads a committed round back and acts on it (module docstring)."""

    def __init__(self, node, checkpoints, wait: Callable) -> None:
        # the committer's node.live.record.committer.CommitterContext (not imported: no cycle)
        self.node = node
        self.checkpoints = checkpoints  # node.live.record.checkpointbuild.CheckpointBuilder
        self.wait = wait  # wait(predicate, timeout) -> bool, until the node stops

    def verify(self, outer_round: int, mine: RoundRecord, signature: bytes | None) -> None:
        node = self.node
        # Final only ledger.confirmations blocks deep: a commit a reorg drops is never confirmed here.
        if not self.wait(lambda: node.chain.final_commit_of(node.run_id, outer_round) is not None,
                          node.cfg.round_timeout):
            logger.warning("round %d: no final commit on chain after %.0fs", outer_round,
                           node.cfg.round_timeout)
            return
        onchain = node.chain.final_commit_of(node.run_id, outer_round)
        node.on_confirmed(outer_round)
        if node.fraud is not None:  # a chunked run: a wrong committed root is proven on chain by anyone
            node.fraud.check(outer_round, onchain, mine)
        if (onchain.weights_root, onchain.contributions_root) != (mine.weights_root, mine.contributions_root):
            # A fork: node/live/record/forkrepair.py disputes if
            # our own result stood, and re-bases on the record.
            node.forks.diverged(outer_round, onchain, mine, signature)
            return
        node.forks.agreed(outer_round)
        self._credit_self(outer_round, onchain, mine, signature)
        wrong_checkpoint = self._wrong_checkpoint(outer_round, onchain, mine)
        if wrong_checkpoint:
            if signature is None:
                logger.error("round %d: %s; no signed record of ours to dispute with", outer_round,
                             wrong_checkpoint)
            else:
                logger.error("round %d: %s; filing a dispute", outer_round, wrong_checkpoint)
                node.chain.dispute(mine, signature)

    def _credit_self(self, outer_round: int, onchain: RoundRecord, mine: RoundRecord,
                     signature: bytes | None) -> None:
        """If the commit did not credit this node with the round, put its own signature on chain (``attest``):
        a submitter cannot make an active member look silent and ejectable (docs/TRUST.md, G2). Called once
        the committed roots are this node's: the record it signed is the committed one, or one of the same
        result whose figures or checkpoint hash it derived from other attestations or shards than the
        quorum's (one peer can make honest members hear differently), which the ledger credits alike."""
        node = self.node
        if signature is None:
            return
        attesters = node.chain.attesters_of(node.run_id, outer_round) or ()
        me = node.chain.client.address.lower()
        if any(a.lower() == me for a in attesters):
            return
        try:
            node.chain.attest(mine, signature, onchain)
            logger.info("round %d: the commit %s; attested our signature on chain", outer_round,
                        "left out this node's signature" if onchain == mine else
                        "is of our result with other figures or checkpoint than the record we signed")
        except DLX_ERRORS as exc:
            logger.warning("round %d: could not attest our signature on chain: %s", outer_round, exc)

    def _wrong_checkpoint(self, outer_round: int, onchain: RoundRecord, mine: RoundRecord) -> str | None:
        """Why the committed record's checkpoint is not the run's (None: it is, or it has none).

        A committed checkpoint other than the one this node built is disputed like a weights-root
        difference; one this node built none of is fetched and verified (a missing checkpoint is
        no wrong state: a round whose checkpoint some nodes could not verify may commit without).
        """
        if not onchain.has_checkpoint or onchain.checkpoint_hash == mine.checkpoint_hash:
            return None
        if mine.has_checkpoint:
            return (f"the committed checkpoint {onchain.checkpoint_hash.hex()[:12]} is not the one this node "
                    f"built from the agreed state ({mine.checkpoint_hash.hex()[:12]})")
        problems = self.checkpoints.committed_problems(outer_round, onchain.checkpoint_hash,
                                                       onchain.weights_root)
        if problems:
            return f"the committed checkpoint {onchain.checkpoint_hash.hex()[:12]} does not verify: " \
                + "; ".join(problems)
        return None


class EquivocationReports:
    """Members seen signing two different records of one round, reported on chain (kept through an outage)."""

    def __init__(self, node) -> None:
        self.node = node
        self._unreported: list = []  # equivocation evidence the chain could not take yet (an RPC outage)

    def report(self) -> None:
        """Slash members seen signing two different records of one round (the evidence is the two signatures).

        Evidence that met an unreachable RPC is kept and reported with a later round.
        """
        node = self.node
        self._unreported += node.book.take_record_equivocations()
        pending, self._unreported = self._unreported, []
        for item in pending:
            outer_round, signer, (record_a, sig_a), (record_b, sig_b) = item
            logger.error("round %d: member %s signed two different records; reporting it on chain",
                         outer_round, signer)
            try:
                node.chain.report_equivocation(record_a, sig_a, record_b, sig_b)
            except (ChainUnavailable, TransactionTimeout) as exc:
                logger.warning("round %d: equivocation report for %s deferred: %s", outer_round, signer, exc)
                self._unreported.append(item)
            except DLX_ERRORS as exc:
                logger.warning("round %d: equivocation report for %s not accepted: %s", outer_round, signer,
                               exc)
