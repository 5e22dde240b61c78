"""Errors of the ledger package.

``LedgerError`` is the root here (this package imports nothing from ``node/``). A contract revert becomes a
:class:`ContractRevert` subclass named exactly like the Solidity custom error (``LedgerRoundNotNext``
and so on), whichever backend raised it: web3 raises ``ContractCustomError`` on a JSON-RPC node such as
anvil but eth-tester raises ``TransactionFailed`` on py-evm; ``ledger.reverts.decode_revert`` maps both by the
error's 4-byte selector. The decoded arguments are in ``.values`` (a dict by parameter name).
"""

from __future__ import annotations


class LedgerError(Exception):
    """Root of the errors of ``ledger/``."""


class LedgerConfigError(LedgerError, ValueError):
    """A ``[ledger]`` setting is missing, malformed or out of range."""


class LedgerInputError(LedgerError, ValueError):
    """A value handed to the ledger client is malformed (wrong length, out of range)."""


class LedgerDecodeError(LedgerError, ValueError):
    """A log from the chain's RPC does not decode against the contract's ABI (wrong topics, bad ABI data)."""


class ChainUnavailable(LedgerError):
    """The chain's RPC endpoint cannot be reached (after retries), or a managed anvil will not start."""


class ChainWaitStopped(ChainUnavailable):
    """The caller asked to stop while waiting for an unreachable RPC (a node stopped during start-up)."""


class AccountError(LedgerError):
    """The node's Ethereum account cannot be loaded or created (keystore, password, dev key refused)."""


class RpcRejected(LedgerError):
    """The chain node refused a request outright (e.g. insufficient funds for gas, invalid transaction)."""


class DeploymentMismatch(LedgerError):
    """The configured addresses do not hold the expected dlx-node contracts on this chain."""


class TransactionTimeout(LedgerError):
    """A sent transaction was not mined in time; it may still be mined later."""


class FeeCapTooLow(TransactionTimeout):
    """The chain's base fee is above the configured fee cap (``ledger.max_fee_gwei``): nothing is mined
    until the market falls below it or the cap is raised. A TransactionTimeout: a node retries later."""


class TransactionDropped(TransactionTimeout):
    """A mined transaction left the chain in a reorg and its nonce was then taken by another transaction,
    so it cannot be broadcast again: the caller re-checks the chain and sends anew."""


class CommitConflict(LedgerError):
    """The round is already committed on chain with a different record than the node tried to commit."""

    def __init__(self, message: str, *, on_chain: object = None, attempted: object = None):
        super().__init__(message)
        self.on_chain = on_chain
        self.attempted = attempted


class AuditError(LedgerError):
    """An auditor check found the on-chain record inconsistent (broken hash chain, bytecode mismatch)."""


class ContractRevert(LedgerError):
    """A contract call reverted. Subclasses are named after the Solidity custom error.

    Attributes:
        values: The error's decoded arguments by parameter name.
        data: The raw revert data (selector + ABI-encoded arguments).
    """

    def __init__(self, message: str, *, values: dict | None = None, data: bytes = b""):
        super().__init__(message)
        self.values = dict(values or {})
        self.data = data


class UnknownRevert(ContractRevert):
    """A revert whose data matches no custom error of the dlx-node contracts (or carries no data)."""


# NodeRegistry errors.
class RegistryError(ContractRevert):
    """A revert of the NodeRegistry contract."""


class RegistryAlreadyRegistered(RegistryError):
    """The account already holds a node key."""


class RegistryKeyTaken(RegistryError):
    """The node key is already bound to another account."""


class RegistryZeroKey(RegistryError):
    """The public key is all zero."""


class RegistryBadSignatureLength(RegistryError):
    """The binding signature is not 64 bytes."""


class RegistryStakeTooLow(RegistryError):
    """``register`` was sent with less than the minimum stake."""


class RegistryNotRegistered(RegistryError):
    """``unregister`` from an account that is not registered."""


class RegistryRefundFailed(RegistryError):
    """Returning the stake to the leaving account failed."""


# TrainingLedger errors.
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
    """A run's accusation deadline or dispute window is shorter than the contract's minimum or above its maximum."""


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


class LedgerNotProver(LedgerRevert):
    """``invalidateByProof`` from another account than the ledger's AggregationProver."""


class LedgerBadCommitments(LedgerRevert):
    """``commitments`` is not a version of a run's commitments the contract knows (node/commitments/ names
    them)."""


# AggregationProver errors (the fraud proof of a wrong aggregation: docs/FRAUD_PROOF.md).
class ProverError(ContractRevert):
    """A revert of the AggregationProver contract."""


class ProverBadRecords(ProverError):
    """The two records are not of one run and consecutive rounds."""


class ProverNotCommitted(ProverError):
    """A record is not the one committed for its round (or the round is not committed)."""


class ProverBadStage(ProverError):
    """The stage index is not one of the run's stages."""


class ProverBadStagePath(ProverError):
    """A stage leaf's Merkle path does not lead to its record's weights root."""


class ProverBadStageLeaf(ProverError):
    """A stage leaf is malformed or names another stage."""


class ProverBadFactors(ProverError):
    """The factors are not the stage leaf's, or their lists (or the pieces) differ in length."""


class ProverBadChunk(ProverError):
    """The chunk index is not below the stage's chunk count."""


class ProverBadPath(ProverError):
    """A chunk leaf's Merkle path does not lead to its root at the chunk's position (``which``: 0 previous
    weights, 1 previous momentum, 2 new weights, 3 new momentum, 4 + j piece j)."""


class ProverBadLeaf(ProverError):
    """The previous round's weights or momentum leaf is malformed."""


class ProverRoundCorrect(ProverError):
    """The proof's chunk is the outer step of its committed inputs: nothing to prove."""


class ProverNotNormed(ProverError):
    """The round's factors are version 2 in a run that is not normed: no norm commitment a norm proof could open
    (version-2 factors in a normed run are a wrong round, proven)."""


class ProverBadSumPath(ProverError):
    """A sum-tree leaf or its path does not lead to the contribution's committed norm root at the chunk."""


class ProverNormCorrect(ProverError):
    """The committed scales follow from the committed sums, and the opened sum-tree chunk is right."""


class ProverBadTarget(ProverError):
    """A data-availability challenge names a contribution the round did not accept."""


class ProverBondMismatch(ProverError):
    """A challenge was sent with another amount than the run's bond."""


class ProverChallengeExists(ProverError):
    """That leaf of that round is already challenged."""


class ProverNoChallenge(ProverError):
    """No challenge has that id."""


class ProverChallengeSettled(ProverError):
    """The challenge was answered or expired already."""


class ProverChallengeDue(ProverError):
    """The challenge's deadline passed: it can only be expired now."""


class ProverChallengeNotDue(ProverError):
    """The challenge's deadline has not come: it can still be answered."""


class ProverChallengeTooLate(ProverError):
    """The round's dispute window closed: its leaves can no longer be challenged (a proof still can)."""


class LedgerWeakParams(LedgerInputError):
    """Run parameters below the security model's floor (k < 2 or quorum fraction < 1/2) without an explicit
    ``allow_weak_quorum``."""


def _descendants(base: type[ContractRevert]) -> list[type[ContractRevert]]:
    found = []
    for cls in base.__subclasses__():
        found += [cls, *_descendants(cls)]
    return found


#: Every Python class that mirrors a Solidity custom error, by the error's name: the subclasses of the three
#: contracts' bases (a Python class per ABI error, and none more, is tests/test_ledger_errors.py's check).
REVERT_CLASSES: dict[str, type[ContractRevert]] = {
    cls.__name__: cls for base in (RegistryError, LedgerRevert, ProverError) for cls in _descendants(base)
}
