"""Runs and their members: the TrainingLedger's calls that create a run, join, leave and withdraw.

:class:`RunCalls` is a mixin of :class:`ledger.client.LedgerClient` (as :class:`ledger.disputes.DisputeCalls`
is): it uses the client's transaction sender, contract and ``transact_ledger`` helper.
"""

from __future__ import annotations

import logging

from eth_utils import to_checksum_address

from ledger.attest import pack_signatures
from ledger.errors import LedgerError, LedgerInputError, LedgerWeakParams
from ledger.events import topic_address, topic_uint
from ledger.records import MEMBER_STATUSES, NO_PLATFORM, Member, RoundRecord, check_bytes32, check_uint
from ledger.runparams import (
    DEFAULT_ACCUSATION_BLOCKS,
    DEFAULT_COMMITMENTS,
    DEFAULT_DISPUTE_BLOCKS,
    DEFAULT_INACTIVITY_ROUNDS,
    DEFAULT_MAX_GAME_STEPS,
    DEFAULT_TENURE_ROUNDS,
    SAFE_MIN_QUORUM,
    SAFE_MIN_QUORUM_BPS,
    RunParams,
)

logger = logging.getLogger(__name__)

#: The fields of ``TrainingLedger.runOf``'s struct, in order.
RUN_FIELDS = (
    "commitCount", "checkpointEnd", "quorum", "quorumBps", "memberCount", "countedCount", "tenureRounds",
    "headHash", "creator", "numStages", "innerSteps", "inactivityRounds", "maxRounds", "invalidFrom",
    "unbondingBlocks", "accusationBlocks", "disputeBlocks", "commitments", "minStake", "bond", "configHash",
    "maxGameSteps",
)


class RunCalls:
    """The run and membership calls of :class:`ledger.client.LedgerClient`."""

    # Runs ----------------------------------------------------------------------------------------------
    def run_struct(self, run_id: int) -> dict:
        """``TrainingLedger.runOf(run_id)`` as a dict keyed by :data:`RUN_FIELDS`."""
        return dict(zip(RUN_FIELDS, self.sender.call(self.ledger_contract, "runOf", (run_id,)), strict=True))

    def run_values(self, run_id: int) -> dict:
        """``TrainingLedger.valuesOf(run_id)``: the run's per-round values (issue 62), RunParams.VALUES."""
        root, genesis, rounds, clip, most, rank, nesterov = self.sender.call(self.ledger_contract, "valuesOf",
                                                                             (run_id,))
        return {"schedule_root": bytes(root), "schedule_rounds": rounds, "nesterov": bool(nesterov),
                "norm_clip_bits": clip, "genesis_root": bytes(genesis), "max_contributions": most,
                "max_rank": rank}

    def create_run(
        self,
        config_hash: bytes,
        num_stages: int,
        inner_steps: int,
        config_uri: str = "",
        *,
        min_stake: int = 0,
        quorum: int = SAFE_MIN_QUORUM,
        quorum_bps: int = SAFE_MIN_QUORUM_BPS,
        bond: int | None = None,
        unbonding_blocks: int | None = None,
        accusation_blocks: int = DEFAULT_ACCUSATION_BLOCKS,
        dispute_blocks: int = DEFAULT_DISPUTE_BLOCKS,
        inactivity_rounds: int = DEFAULT_INACTIVITY_ROUNDS,
        max_rounds: int = 0,
        tenure_rounds: int = DEFAULT_TENURE_ROUNDS,
        commitments: int = DEFAULT_COMMITMENTS,
        allow_weak_quorum: bool = False,
        values: dict | None = None,
        max_game_steps: int = DEFAULT_MAX_GAME_STEPS,
        proof_fund: int = 0,
    ) -> int:
        """Create a run; return its id. Its parameters never change (:class:`ledger.runparams.RunParams`).

        Args:
            config_hash: 32-byte hash of the run's full configuration (model, data, hyperparameters, stages,
                H).
            num_stages: Pipeline stages (>= 1).
            inner_steps: Inner steps H per outer round (>= 1).
            config_uri: Where the configuration can be fetched (emitted only).
            min_stake: Wei each member stakes to join.
            quorum: k, the fewest distinct counted member signatures a commit (or a verdict) needs (>= 2
                unless ``allow_weak_quorum``).
            quorum_bps: The quorum is also at least this fraction (basis points, <= 10000) of the counted
                members: ``max(k, ceil(quorum_bps / 10000 x counted))`` (>= 5000 unless
                ``allow_weak_quorum``).
            bond: Wei an accuser or disputer deposits; None: a tenth of ``min_stake``.
            unbonding_blocks: Blocks between ``leave_run`` and the earliest ``withdraw_stake``; at least the
                longest proof window, ``dispute_blocks + (2 max_game_steps + 2) accusation_blocks`` (None:
                exactly that), at most 2^32.
            accusation_blocks: Blocks an accusation stays open before it lapses (>= 8).
            dispute_blocks: Blocks after a commit during which members in force at it may dispute it (>= 8).
            inactivity_rounds: Committed rounds a member may leave unattested before anyone may eject it
                (>= 1).
            max_rounds: Rounds 0 .. max_rounds-1 may be committed; 0 leaves the run open-ended.
            tenure_rounds: Rounds a member that joined after the first commit is in force before its
                signatures count toward quorums (>= 1; founders count at once).
            commitments: The version of the run's commitments: its commitment scheme's number (the node's
                registry, node/commitments/, maps the run document's ``diloco.commitments`` to it; default
                3, what a new fraud-provable run's "auto" resolves to). The prover holds every round's factors
                to it, so it must be the document's: a normed run's records committed with another version's
                factors are proven wrong (docs/FRAUD_PROOF.md).
            max_game_steps: Steps of one availability game (>= 1; ``ledger.runparams.game_steps_for`` of the
                largest stage's chunks).
            allow_weak_quorum: Create a run below the security model's floor (k < 2 or quorum_bps < 5000):
                one member, or a minority, then commits and slashes alone (docs/TRUST.md).
            values: The per-round values (issue 62; RunParams.VALUES by name: the schedule root and its
                rounds, Nesterov, the norm clip's bits, the genesis root, the most contributions and the
                largest rank; node/commitments/values.py derives them from a run document); None: RunParams'
                defaults.
            proof_fund: Wei sent with createRun into the run's proof fund (issue 79): a fraud proof's reward,
                min(fund, half the stake slashed), is paid from it, never from the slash (burned whole).

        Raises:
            LedgerWeakParams: k < 2 or quorum_bps < 5000 without ``allow_weak_quorum``.
            LedgerZeroHash, LedgerBadRunShape, LedgerBadQuorum, LedgerBadWindow, LedgerUnbondingTooShort,
            LedgerUnbondingTooLong, LedgerBadInactivityRounds, LedgerBadCommitments, LedgerBadRunValues,
            LedgerProofTooCostly, LedgerBadGameSteps, LedgerUnbondingBelowProofWindow: the contract's rules.
        """
        params = RunParams(
            config_hash,
            num_stages,
            inner_steps,
            min_stake=min_stake,
            quorum=quorum,
            quorum_bps=quorum_bps,
            bond=bond,
            unbonding_blocks=unbonding_blocks,
            accusation_blocks=accusation_blocks,
            dispute_blocks=dispute_blocks,
            inactivity_rounds=inactivity_rounds,
            max_rounds=max_rounds,
            tenure_rounds=tenure_rounds,
            commitments=commitments,
            **dict(values or {}),
            max_game_steps=max_game_steps,
        )
        return self.create_run_with(params, config_uri, allow_weak_quorum=allow_weak_quorum,
                                    proof_fund=proof_fund)

    def create_run_with(self, params: RunParams, config_uri: str = "", *,
                        allow_weak_quorum: bool = False, proof_fund: int = 0) -> int:
        """Create a run with ``params`` and ``proof_fund`` wei in its proof fund; return its id (see
        :meth:`create_run`)."""
        if not isinstance(params, RunParams):
            raise LedgerInputError(f"create_run_with needs RunParams, got {type(params).__name__}")
        weak = [w for w in params.weaknesses() if not w.startswith("min_stake")]
        if weak and not allow_weak_quorum:
            raise LedgerWeakParams("refusing a run below the security model's floor: " + "; ".join(weak)
                                   + " (pass allow_weak_quorum=True to accept this)")
        for what in weak:
            logger.warning("creating a weak run: %s", what)
        receipt = self.sender.transact(self.ledger_contract, "createRun", (params.fields(), config_uri),
                                       "createRun", check_uint("proof_fund", proof_fund, 2**256 - 1))
        for log in receipt["logs"]:
            event = self.ledger_events.decode(log)
            if event is not None and event.name == "RunCreated":
                return event.args["runId"]
        raise LedgerError(
            f"createRun transaction {receipt['transactionHash'].to_0x_hex()} emitted no RunCreated"
        )

    def run_count(self) -> int:
        """The number of runs (the latest run id)."""
        return self.sender.call(self.ledger_contract, "runCount")

    # Membership ----------------------------------------------------------------------------------------
    def join_run(self, run_id: int, stake: int | None = None, platform: bytes = NO_PLATFORM) -> str:
        """Join run ``run_id`` as a signing member; return the tx hash.

        Idempotent: if this account already holds an active seat, returns the MemberJoined transaction.

        Args:
            stake: Wei to stake; None sends the run's minimum stake.
            platform: The 32-byte declaration of the platform the member trains on, emitted in MemberJoined
                (a node's: ``training.declaration.platform_declaration``); the zero hash declares none, and
                then no contribution of the member can claim a platform (docs/DILOCOX.md section 11).

        Raises:
            LedgerNotRegistered: The account is not in the NodeRegistry.
            LedgerStakeTooLow, LedgerAlreadyMember (unbonding: withdraw first), LedgerMemberSlashed.
        """
        seat = self.member(run_id, self.address)
        if seat is not None and seat.active:
            logger.info("account %s is already a member of run %d", self.address, run_id)
            return self.first_tx(
                self.ledger_contract,
                self.ledger_events,
                "MemberJoined",
                [topic_uint(run_id), topic_address(self.address)],
                last=True,
            )
        if stake is None:
            stake = self.run_struct(run_id)["minStake"]
        check_uint("stake", stake, 2**128 - 1)
        check_bytes32("platform", platform)
        return self.transact_ledger("joinRun", (run_id, platform), f"joinRun(run {run_id})", stake)

    def leave_run(self, run_id: int) -> str:
        """Stop signing for ``run_id`` now and start unbonding the stake; return the tx hash."""
        return self.transact_ledger("leaveRun", (run_id,), f"leaveRun(run {run_id})")

    def withdraw_stake(self, run_id: int) -> str:
        """Take the stake back once unbonding is over and no accusation is open; return the tx hash.

        Raises:
            LedgerStillUnbonding, LedgerAccusationPending (an accusation past its deadline must be
            :meth:`expire_accusation`-ed first), LedgerNotUnbonding.
        """
        return self.transact_ledger("withdrawStake", (run_id,), f"withdrawStake(run {run_id})")

    def eject_inactive(self, run_id: int, account: str) -> str:
        """Eject active member ``account``, which attested none of the run's last ``inactivity_rounds``
        committed rounds: it stops counting toward the quorum and unbonds as if it had left. Anyone may.

        Raises:
            LedgerMemberNotInactive (``.values["missedRounds"]``), LedgerNotMember.
        """
        account = to_checksum_address(account)
        return self.transact_ledger("ejectInactive", (run_id, account),
                                    f"ejectInactive(run {run_id}, {account})")

    def quorum_of(self, run_id: int) -> int:
        """The counted signatures the run's next commit needs now: ``max(k, ceil(quorum_bps x counted))``."""
        return self.sender.call(self.ledger_contract, "quorumOf", (run_id,))

    def counted_count(self, run_id: int) -> int:
        """The active members whose signatures count toward the run's quorums now."""
        return self.run_struct(run_id)["countedCount"]

    def commitments_of(self, run_id: int) -> int:
        """The version of the run's commitments as the ledger holds it (``RunParams.commitments``: 1 hashed,
        2 chunked, 3 normed), the one the prover holds every round's factors to."""
        return self.run_struct(run_id)["commitments"]

    def attest(self, record: RoundRecord, signature: bytes, committed: RoundRecord | None = None) -> str:
        """Credit the signer of ``signature`` over ``record`` with the round committed as ``committed``
        (default: ``record`` itself): a member a submitter left out of the commit, or that signed the
        committed result with other figures or checkpoint hash, puts its own signature on chain; return the
        tx hash.

        Raises:
            LedgerRoundNotCommitted, LedgerNotCommittedRecord, LedgerAttestOtherResult (``record`` is not of
            the committed run, round, chain head and roots), LedgerNotMember, LedgerAttestBeforeJoin.
        """
        committed = record if committed is None else committed
        for what in (record, committed):
            if not isinstance(what, RoundRecord):
                raise LedgerInputError(f"attest needs a RoundRecord, got {type(what).__name__}")
        args = (committed.fields(), record.fields(), pack_signatures([signature]))
        return self.transact_ledger("attest", args, f"attest(run {record.run_id}, round {record.round})")

    def member(self, run_id: int, address: str) -> Member | None:
        """The seat of ``address`` in ``run_id`` as the contract holds it now, or None (never
        joined/withdrew)."""
        address = to_checksum_address(address)
        (node_key, stake, active_round, open_accusations, status, join_round, left_round, join_block,
         unbonding_end, counted_block, _past_join, _past_until) = self.sender.call(
            self.ledger_contract, "memberOf", (run_id, address))
        if status == 0:
            return None
        return Member(
            run_id,
            address,
            bytes(node_key),
            stake,
            unbonding_end,
            open_accusations,
            MEMBER_STATUSES[status],
            active_round=active_round,
            join_round=join_round,
            left_round=left_round,
            join_block=join_block,
            counted_block=counted_block,
        )

    def member_count(self, run_id: int) -> int:
        """The number of members currently able to sign for ``run_id``."""
        return self.run_struct(run_id)["memberCount"]
