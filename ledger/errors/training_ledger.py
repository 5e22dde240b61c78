"""The TrainingLedger contract's custom errors (and its libraries'), one Python class each."""

from __future__ import annotations

from ledger.errors.base import ContractRevert


class LedgerRevert(ContractRevert):
    """A revert of the TrainingLedger contract."""


class LedgerNotRegistered(LedgerRevert):
    """The account joining a run is not a registered node."""


class LedgerUnknownRun(LedgerRevert):
    """No run has that id."""


class LedgerBadRunShape(LedgerRevert):
    """``numStages`` or ``innerSteps`` is zero."""


class LedgerBadQuorum(LedgerRevert):
    """A run's quorum k is zero, or its quorum fraction is above 10000 basis points."""


class LedgerBadWindow(LedgerRevert):
    """A run's accusation deadline or dispute window is shorter than the contract's minimum or above its
    maximum."""


class LedgerUnbondingTooShort(LedgerRevert):
    """A run's unbonding period is shorter than its accusation deadline plus its dispute window."""


class LedgerUnbondingTooLong(LedgerRevert):
    """A run's unbonding period is above the contract's maximum (2^32 blocks)."""


class LedgerBadInactivityRounds(LedgerRevert):
    """A run's inactivity limit (rounds a member may leave unattested) is zero."""


class LedgerZeroHash(LedgerRevert):
    """A config hash, root or evidence hash is all zero."""


class LedgerStakeTooLow(LedgerRevert):
    """``joinRun`` was sent with less than the run's minimum stake."""


class LedgerBondMismatch(LedgerRevert):
    """An accusation or dispute was sent with another value than the run's bond."""


class LedgerAlreadyMember(LedgerRevert):
    """The account already holds a seat (active or unbonding) in the run."""


class LedgerMemberSlashed(LedgerRevert):
    """The account was slashed in this run and can never join it again."""


class LedgerNotMember(LedgerRevert):
    """The caller is not a current (active) member of the run."""


class LedgerNotUnbonding(LedgerRevert):
    """``withdrawStake`` from an account that has not left the run."""


class LedgerStillUnbonding(LedgerRevert):
    """The stake cannot be withdrawn before the unbonding period ends."""


class LedgerAccusationPending(LedgerRevert):
    """The stake cannot be withdrawn while an accusation against the member is open."""


class LedgerRefundFailed(LedgerRevert):
    """Returning the stake to the member failed."""


class LedgerMemberNotInactive(LedgerRevert):
    """``ejectInactive`` of a member that attested one of the run's last ``inactivityRounds`` rounds."""


class LedgerRoundNotNext(LedgerRevert):
    """The round is not the run's next one (last committed + 1, or 0 first)."""


class LedgerRoundBeyondMax(LedgerRevert):
    """The round is at or past the run's maxRounds."""


class LedgerStaleHead(LedgerRevert):
    """The record's prevHead is not the run's current head (e.g. a replayed old signature)."""


class LedgerBadSignaturesLength(LedgerRevert):
    """The packed signatures are not a whole number of 65-byte signatures."""


class LedgerInvalidSignature(LedgerRevert):
    """A signature is malformed, malleable (high s), has a bad v or recovers nothing."""


class LedgerSignerNotMember(LedgerRevert):
    """A signature recovers to an account that is not a current member of the run."""


class LedgerSignerNotInForce(LedgerRevert):
    """A verdict signer joined at or after the accusation's block, or had left before it."""


class LedgerSignersNotAscending(LedgerRevert):
    """Signers are not in strictly ascending address order (or one signed twice)."""


class LedgerQuorumNotMet(LedgerRevert):
    """Fewer distinct member signatures than the run's quorum."""


class LedgerNotEquivocation(LedgerRevert):
    """The two records are of different runs or rounds, or are the same record."""


class LedgerDifferentSigners(LedgerRevert):
    """The two equivocation signatures come from different accounts."""


class LedgerNotBonded(LedgerRevert):
    """The account holds no stake in the run (never joined, withdrew, or already slashed)."""


class LedgerRoundNotCommitted(LedgerRevert):
    """A dispute names a round that was never committed."""


class LedgerNotCommittedRecord(LedgerRevert):
    """The record a dispute names as committed is not the one committed for its round."""


class LedgerDisputeMatchesCommit(LedgerRevert):
    """A dispute's record is the committed record."""


class LedgerDisputeOnlyMetrics(LedgerRevert):
    """A dispute's record differs from the committed one only in losses, tokens or contributor count,
    which the replay does not decide (weights root, contributions root and checkpoint hash are equal)."""


class LedgerDisputeWindowClosed(LedgerRevert):
    """The round was committed more than the run's ``disputeBlocks`` ago."""


class LedgerNotInForce(LedgerRevert):
    """The disputer was not a member in force at the round (joined after it was committed, or left before)."""


class LedgerAlreadyDisputed(LedgerRevert):
    """The member already disputed that round."""


class LedgerAccusationExists(LedgerRevert):
    """That accusation (run, accused, evidence) was already opened."""


class LedgerAccusationNotOpen(LedgerRevert):
    """No open accusation (run, accused, evidence) to resolve or expire."""


class LedgerAccusationExpired(LedgerRevert):
    """The accusation reached its deadline: it takes no verdict, only ``expireAccusation``."""


class LedgerAccusationNotExpired(LedgerRevert):
    """``expireAccusation`` before the accusation's deadline."""


class LedgerBadTenure(LedgerRevert):
    """``tenureRounds`` is 0: a joiner would count toward quorums the moment it joins."""


class LedgerDisputerNotSender(LedgerRevert):
    """A dispute's signature is not the sender's: a member's dispute is filed only by its own transaction."""


class LedgerDisputeNotOpen(LedgerRevert):
    """No open dispute case for that round (never disputed, or already upheld, overturned or lapsed)."""


class LedgerDisputeExpired(LedgerRevert):
    """The round's dispute case reached its deadline: it takes no verdict, only ``expireDispute``."""


class LedgerDisputeNotExpired(LedgerRevert):
    """``expireDispute`` before the case's deadline."""


class LedgerNotAttesters(LedgerRevert):
    """The attesters given to a round verdict are not the ones its commit recorded."""


class LedgerRunHalted(LedgerRevert):
    """A verdict overturned a round of the run: it commits nothing more."""


class LedgerAccusationTooLate(LedgerRevert):
    """The accused member's unbonding is over: it can no longer be accused (its stake's lock is bounded)."""


class LedgerAttestBeforeJoin(LedgerRevert):
    """``attest`` for a round before the member joined."""


class LedgerAttestOtherResult(LedgerRevert):
    """``attest`` with a signed record of another run, round, chain head, weights root or contributions root
    than the committed record's (only its figures and checkpoint hash may differ)."""


class LedgerNotProver(LedgerRevert):
    """``invalidateByProof`` from another account than the ledger's AggregationProver."""


class LedgerBadCommitments(LedgerRevert):
    """``commitments`` is not a version of a run's commitments the contract knows (node/commitments/ names
    them)."""


class LedgerBadRunValues(LedgerRevert):
    """A fraud-provable run's per-round values are out of range: no contribution allowed, a rank outside
    1 .. 64, or a norm clip neither 0 nor in [1, inf) (issue 62)."""


class LedgerProofTooCostly(LedgerRevert):
    """At the run's ``maxContributions`` and ``maxRank`` a fraud proof could need more gas or calldata than
    the contract's bounds (``LedgerCore.proofCost``; docs/FRAUD_PROOF.md, "Bounded proofs")."""


class LedgerBadGameSteps(LedgerRevert):
    """``maxGameSteps`` is 0: an availability game needs at least one step."""


class LedgerUnbondingBelowProofWindow(LedgerRevert):
    """``unbonding_blocks`` is shorter than the longest proof window, ``dispute_blocks + (2 max_game_steps +
    2) accusation_blocks``: a coalition could withdraw before it is proven wrong."""


class LedgerRunFull(LedgerRevert):
    """The run holds ``seats`` active members already (``TrainingLedger.maxSeats``): a fraud proof slashes
    every attester of its round, and the cap keeps the largest quorum's proof inside a block (issue 79;
    docs/FRAUD_PROOF.md, "Bounded proofs"). A seat frees when a member leaves."""
