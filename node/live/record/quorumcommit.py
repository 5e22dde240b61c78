"""Signing a round's record and committing it once a quorum of members signed the same one
(the Committer's)."""

from __future__ import annotations

import logging
import time

from ledger.errors import CommitConflict, LedgerQuorumNotMet, LedgerSignerNotMember
from ledger.records import RoundRecord
from node import protocol as msg
from node.errors import DLX_ERRORS
from node.live.state.topology import committer_order

logger = logging.getLogger(__name__)


COMMIT_FALLBACK_S = 8.0

#: While a round waits for its quorum of record signatures, this node re-publishes its own this often.
RESIGN_EVERY_S = 10.0

#: A round waiting for the chain or for signatures says so in the log this often.
WAIT_REPORT_S = 60.0


class QuorumCommit:
    """Signing and committing a round's record (see the module docstring)."""

    def _sign(self, record: RoundRecord) -> bytes | None:
        """Sign ``record`` unless this node signed another record of the round (in any life); gossip it."""
        node = self.node
        fraud = getattr(node, "fraud", None)
        refusal = fraud.refuses_to_sign(record.round) if fraud is not None else None
        if refusal is not None:  # issue 62: never on top of a round this node holds wrong
            logger.error("round %d: not signing the record on top of a wrong round: %s", record.round,
                         refusal)
            return None
        digest = node.chain.client.record_digest(record)
        before = node.state.signed_record(record.round)
        if before is not None and before[0] != digest:
            logger.warning("round %d: this node signed another record of the round before (a restart?); "
                           "it does not sign a second one", record.round)
            return None
        signature = before[1] if before is not None else node.chain.sign_record(record)
        node.state.remember_signed(record.round, digest, signature)
        node.book.add_record_signature(record.round, digest, record, node.chain.client.address, signature)
        self._publish(record, signature)
        return signature

    def _publish(self, record: RoundRecord, signature: bytes) -> None:
        node = self.node
        message = msg.RecordSignature(record.prev_head, record.weights_root, record.contributions_root,
                                      record.train_loss_micro, record.eval_loss_micro, record.tokens,
                                      record.num_contributors, record.checkpoint_hash,
                                      bytes.fromhex(node.chain.client.address[2:]), signature)
        try:
            node.gossip(record.round, msg.RECORD, message)
        except DLX_ERRORS as exc:
            logger.warning("round %d: record signature not published: %s", record.round, exc)

    def _quorum_record(self, outer_round: int, mine: RoundRecord, quorum: int):
        """(record, signatures) of a record of the round signed by at least ``quorum`` members, ours first."""
        node = self.node
        signed = node.book.snapshot_signatures(outer_round)
        own = node.chain.client.record_digest(mine)
        for digest in sorted(signed, key=lambda d: (d != own, -len(signed[d][1]))):
            record, signatures = signed[digest]
            # Only current members count: a signer slashed since it signed (a spot check found it
            # cheating) would make the chain refuse the whole commit.
            current = {signer: sig for signer, sig in signatures.items()
                           if node.chain.is_member(node.run_id, signer)}
            # Every member's signature is submitted (each is credited), but only counted members make the
            # quorum: a joiner within its tenure signs without counting (docs/TRUST.md).
            counted = sum(1 for signer in current if node.chain.is_counted(node.run_id, signer))
            if counted >= quorum:
                return record, list(current.values())
        return None

    def _commit_with_quorum(self, outer_round: int, mine: RoundRecord, signature: bytes | None) -> bool:
        """Wait for a quorum of signatures over one record; submit it when this node's turn comes."""
        node = self.node
        quorum = node.chain.quorum_of(node.run_id)
        last_publish = last_quorum_read = time.monotonic()
        found = None

        def quorum_or_committed():
            nonlocal found, last_publish, quorum, last_quorum_read
            if signature is not None and time.monotonic() - last_publish > RESIGN_EVERY_S:
                last_publish = time.monotonic()
                self._publish(mine, signature)  # gossip is best effort: say it again until the quorum forms
            if time.monotonic() - last_quorum_read > RESIGN_EVERY_S:
                # The quorum grows and shrinks with the members in force (joins, leaves, ejections).
                last_quorum_read = time.monotonic()
                quorum = node.chain.quorum_of(node.run_id)
            found = self._quorum_record(outer_round, mine, quorum)
            return found is not None or node.chain.commit_of(node.run_id, outer_round) is not None

        while True:
            if not self._wait_reporting(quorum_or_committed,
                                        f"round {outer_round}: waiting for {quorum} member "
                                        "signatures over one record"):
                return False
            if found is None:
                return False  # another member committed it first
            try:
                return self._submit(outer_round, mine, found, quorum)
            except LedgerSignerNotMember as exc:
                logger.warning("round %d: a signer left the run before the commit (%s); waiting for current "
                               "members' signatures", outer_round, exc)
                node.chain.forget_seats(node.run_id)
            except LedgerQuorumNotMet as exc:
                logger.warning("round %d: the run's quorum grew before the commit (%s); waiting for more "
                               "signatures", outer_round, exc)
                quorum = node.chain.quorum_of(node.run_id)

    def _submit(self, outer_round: int, mine: RoundRecord, found, quorum: int) -> bool:
        """Submit a quorum-signed record when this node's turn comes; False if someone else committed
        first."""
        node = self.node
        record, signatures = found
        if record != mine:
            logger.warning(
                "round %d: the quorum signed a record other than ours (losses or checkpoint differ)",
                outer_round)
        live = node.membership.alive()
        order = [p for p in committer_order(outer_round, node.membership.placed_peers())
                 if p == node.peer_id or p in live]
        rank = order.index(node.peer_id) if node.peer_id in order else len(order)
        if self._wait(lambda: node.chain.commit_of(node.run_id, outer_round) is not None,
                      rank * COMMIT_FALLBACK_S):
            return False
        if node.stop_event.is_set():
            return False
        try:
            # Every signature held, not only the quorum's: the chain credits each signer with the round,
            # and a member whose signatures are never submitted looks silent (ejectInactive).
            node.chain.commit_round(record, signatures)
        except CommitConflict as exc:
            logger.warning("round %d: another record was committed first: %s", outer_round, exc)
            return False
        logger.info("round %d committed with %d member signatures (weights root %s, %d contributors%s)",
                    outer_round, len(signatures), record.weights_root.hex()[:12],
                    record.num_contributors,
                    f", checkpoint {record.checkpoint_hash.hex()[:12]}" if record.has_checkpoint else "")
        return True

    def _wait_reporting(self, predicate, what: str) -> bool:
        """Wait for ``predicate`` until the node stops, saying what it waits for every WAIT_REPORT_S."""
        started = time.monotonic()
        while not self.node.stop_event.is_set():
            if self._wait(predicate, WAIT_REPORT_S):
                return True
            if not self.node.stop_event.is_set():
                logger.warning("%s (%.0fs so far)", what, time.monotonic() - started)
        return False

    def _wait(self, predicate, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if predicate():
                    return True
            except DLX_ERRORS as exc:
                logger.debug("chain read failed (retrying): %s", exc)
            if time.monotonic() >= deadline or self.node.stop_event.is_set():
                return False
            time.sleep(0.5)
