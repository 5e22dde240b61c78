"""Opening a contribution case where the accusation quorum did not convict (issue 78; docs/FRAUD_PROOF.md
"An honest node that opens a case itself"). Off by default (``ledger.open_cases``).

When this node's spot check finds a contribution wrong it accuses its member on chain (the tribunal,
node/live/checks/tribunal.py, hands each accusation it opened to :meth:`CaseOpener.accused`). A guilty
verdict needs a quorum of members; a coalition that holds the quorum clears its own member or lets the
accusation lapse. :class:`CaseOpener` watches each accusation this node opened; once it ends without a
conviction (cleared, or lapsed: past its deadline it expires it itself) it opens a contribution case against
every contribution the accused member signed in that round, on each stage whose factors this node kept
(node/casesubject.py ``open_case``, the run's bond), and from the case's deadline on overturns the round
when every claim on it was refuted or none was made (the ledger pays the opener).

Why it is off by default, and stays so until a claim's end is bound (docs/FRAUD_PROOF.md "Not done", 1):
against a fabricated contribution it gains nothing, since its author keeps it standing with a true run of the
run's program from the committed start and the case is dismissed, the opener's bond paid to the author; and
against a contribution whose rerun differed for a reason the chain cannot see (a carried optimizer state, an
overlapping schedule's start) the opener pays its bond to the defender, or, where that contributor cannot
defend (no program file, restarted since), overturns an honest round and slashes its honest attesters.
With it off, an acquittal of an accusation this node opened is logged with the command an operator would run.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path

from ledger.errors import LedgerError
from node.casesubject import commit_case, kept_case, reveal_case
from node.errors import DLX_ERRORS, ConfigError
from ledger.stepcase import ledger_step_prover, run_stake
from node.live.chain.onchain import NodeChain

logger = logging.getLogger(__name__)

#: How often the opener reads the chain (seconds).
OPEN_EVERY_S = 5.0


@dataclass
class Accusation:
    """An accusation this node opened, watched until it is decided."""

    round: int
    accused: bytes  # the member's account (20 bytes)
    evidence_hash: bytes


@dataclass
class OpenedCase:
    """A case this node opened, watched until it is overturned or dismissed."""

    round: int
    stage: int
    key: bytes
    attesters: tuple[str, ...]
    subject: object  # ledger.stepbinding.RunSubject
    committed_at: int  # the commitment's block: opened in a later one
    opened: bool = False


class CaseOpener:
    """Opens a case where this node's accusation did not convict (module docstring)."""

    def __init__(self, *, run_id: int, chain: NodeChain, data_dir: Path, num_stages: int, enabled: bool,
                 stop: threading.Event, every_s: float = OPEN_EVERY_S) -> None:
        self.run_id = run_id
        self.chain = chain
        self.data_dir = data_dir
        self.num_stages = num_stages
        self.enabled = enabled
        self.stop = stop
        self.every_s = every_s
        self._lock = threading.Lock()
        self._watched: list[Accusation] = []
        self.opened: list[OpenedCase] = []
        self._prover = None

    def accused(self, outer_round: int, accused: bytes, evidence_hash: bytes) -> None:
        """The tribunal opened an accusation of ``accused`` for round ``outer_round`` (its court thread)."""
        with self._lock:
            self._watched.append(Accusation(outer_round, bytes(accused), bytes(evidence_hash)))

    def run(self) -> None:
        """Poll until the node stops (a thread of its own)."""
        while not self.stop.wait(self.every_s):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - an RPC's own error (web3, the transport): the thread must live on
                logger.exception("case opener: a poll failed (the next one tries again)")

    def poll(self) -> None:
        """Act on every watched accusation that ended without a conviction, and on every opened case whose
        deadline passed; nothing here raises."""
        with self._lock:
            watched = list(self._watched)
        for accusation in watched:
            try:
                done = self._follow(accusation)
            except (*DLX_ERRORS, LedgerError) as exc:
                logger.warning("round %d: the accusation of 0x%s not followed up (tried again): %s",
                               accusation.round, accusation.accused.hex(), exc)
                continue
            if done:
                with self._lock:
                    self._watched.remove(accusation)
        for case in list(self.opened):
            try:
                if self._settle(case):
                    self.opened.remove(case)
            except (*DLX_ERRORS, LedgerError) as exc:
                logger.warning("round %d stage %d: this node's case not settled (tried again): %s",
                               case.round, case.stage, exc)

    def _follow(self, accusation: Accusation) -> bool:
        """Whether the accusation is decided (and, not convicted, its cases opened or logged)."""
        client, accused = self.chain.client, "0x" + accusation.accused.hex()
        with self.chain.rpc_lock:
            state = client.accusation(self.run_id, accused, accusation.evidence_hash)
            if state is not None and state.status == "open" and client.head_block() >= state.deadline:
                client.expire_accusation(self.run_id, accused, accusation.evidence_hash)  # anyone may
                state = client.accusation(self.run_id, accused, accusation.evidence_hash)
        if state is None or state.status == "open":
            return state is None
        if state.status == "guilty":
            return True
        if not self.enabled:
            logger.warning("round %d: this node's accusation of %s ended %s, not convicted; no contribution "
                           "case opened: ledger.open_cases is off (docs/FRAUD_PROOF.md \"An honest node that "
                           "opens a case itself\": a case cannot tell a fabricated contribution from its "
                           "author's true claim until the end is bound); an operator may open one with "
                           "dlx-node challenge --round %d --contribution INDEX --open", accusation.round,
                           accused, state.status, accusation.round)
            return True
        for stage in range(self.num_stages):
            self._open(accusation, stage)
        return True

    def _open(self, accusation: Accusation, stage: int) -> None:
        """Open a case against the accused's contribution of ``stage`` in the round, if the kept factors list
        one."""
        client = self.chain.client
        with self.chain.rpc_lock:
            try:
                kept = kept_case([self.data_dir], client, self.run_id, accusation.round, stage)
            except ConfigError as exc:
                logger.info("round %d stage %d: no case opened (%s)", accusation.round, stage, exc)
                return
            norms = kept.factors_parsed().norms
            signers = [bytes.fromhex(a[2:]) for a in (norms.contributors if norms is not None else ())]
            if accusation.accused not in signers:
                return
            index = signers.index(accusation.accused)
            subject = kept.subject(index)
            prover = self._prover_contract(ledger_step_prover(client.w3, client.ledger_address))
            committed_at = commit_case(client, prover, subject)
            key = bytes(prover.functions.contributionOf(*subject.fields()[:4]).call())
            attesters = tuple(client.commit_record(self.run_id, accusation.round).attesters)
        logger.warning("round %d stage %d: committed a contribution case against 0x%s's contribution %d (its "
                       "accusation was not convicted); opened in a later block", accusation.round, stage,
                       accusation.accused.hex(), index)
        self.opened.append(OpenedCase(accusation.round, stage, key, attesters, subject, committed_at))

    def _settle(self, case: OpenedCase) -> bool:
        """Open a committed case once the chain is past its commitment's block; from the case's deadline
        overturn the round if every claim was refuted (or none made); whether the case is over for this
        node."""
        client = self.chain.client
        with self.chain.rpc_lock:
            prover = self._prover
            head = client.head_block()
            if not case.opened:  # the opening must come a block after its commitment
                if head > case.committed_at:
                    reveal_case(client, prover, case.subject, run_stake(client.w3, client.ledger_address,
                                                                         self.run_id))
                    case.opened = True
                    logger.warning("round %d stage %d: opened this node's contribution case", case.round,
                                   case.stage)
                return False
            opener, deadline, claims, refuted, ends = prover.functions.caseOf(case.key).call()[:5]
            if int(opener, 16) == 0:
                logger.warning("round %d stage %d: this node's case was dismissed: a claim on the "
                               "contribution stood, its bond paid to the defender", case.round, case.stage)
                return True
            if head < deadline:
                return False
            if claims > refuted and head >= ends:
                logger.warning("round %d stage %d: a claim on the contribution stands: this node's case is "
                               "dismissed, its bond paid to the defender", case.round, case.stage)
                return True
            if claims == refuted:
                client.sender.transact(prover, "overturnContribution", (case.key, list(case.attesters)),
                                       "overturnContribution")
                logger.warning("round %d stage %d: this node's case overturned the round (every claim "
                               "refuted or none made)", case.round, case.stage)
                return True
        return False

    def _prover_contract(self, address: str):
        import contracts

        if self._prover is None:
            self._prover = self.chain.client.w3.eth.contract(address=address,
                                                             abi=contracts.artifact("StepProver")["abi"])
        return self._prover
