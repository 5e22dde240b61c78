"""Errors of the ledger package.

``LedgerError`` is the root here (this package imports nothing from ``node/``). A contract revert becomes a
:class:`ContractRevert` subclass named exactly like the Solidity custom error (``LedgerRoundNotNext``
and so on), whichever backend raised it: web3 raises ``ContractCustomError`` on a JSON-RPC node such as
anvil but eth-tester raises ``TransactionFailed`` on py-evm; ``ledger.reverts.decode_revert`` maps both by the
error's 4-byte selector. The decoded arguments are in ``.values`` (a dict by parameter name).

One module per source: :mod:`ledger.errors.base` (this package's own errors), then one per contract
(:mod:`.registry`, :mod:`.training_ledger`, :mod:`.prover`, :mod:`.rewards`); every name is importable
from here.
"""

from __future__ import annotations

from ledger.errors.base import (
    LedgerError as LedgerError,
    LedgerConfigError as LedgerConfigError,
    LedgerInputError as LedgerInputError,
    LedgerDecodeError as LedgerDecodeError,
    ChainUnavailable as ChainUnavailable,
    ChainWaitStopped as ChainWaitStopped,
    AccountError as AccountError,
    RpcRejected as RpcRejected,
    DeploymentMismatch as DeploymentMismatch,
    TransactionTimeout as TransactionTimeout,
    FeeCapTooLow as FeeCapTooLow,
    TransactionDropped as TransactionDropped,
    CommitConflict as CommitConflict,
    AuditError as AuditError,
    ContractRevert as ContractRevert,
    UnknownRevert as UnknownRevert,
    LedgerWeakParams as LedgerWeakParams,
)
from ledger.errors.registry import (
    RegistryError as RegistryError,
    RegistryAlreadyRegistered as RegistryAlreadyRegistered,
    RegistryKeyTaken as RegistryKeyTaken,
    RegistryZeroKey as RegistryZeroKey,
    RegistryBadSignatureLength as RegistryBadSignatureLength,
    RegistryStakeTooLow as RegistryStakeTooLow,
    RegistryNotRegistered as RegistryNotRegistered,
    RegistryRefundFailed as RegistryRefundFailed,
)
from ledger.errors.training_ledger import (
    LedgerRevert as LedgerRevert,
    LedgerNotRegistered as LedgerNotRegistered,
    LedgerUnknownRun as LedgerUnknownRun,
    LedgerBadRunShape as LedgerBadRunShape,
    LedgerBadQuorum as LedgerBadQuorum,
    LedgerBadWindow as LedgerBadWindow,
    LedgerUnbondingTooShort as LedgerUnbondingTooShort,
    LedgerUnbondingTooLong as LedgerUnbondingTooLong,
    LedgerBadInactivityRounds as LedgerBadInactivityRounds,
    LedgerZeroHash as LedgerZeroHash,
    LedgerStakeTooLow as LedgerStakeTooLow,
    LedgerBondMismatch as LedgerBondMismatch,
    LedgerAlreadyMember as LedgerAlreadyMember,
    LedgerMemberSlashed as LedgerMemberSlashed,
    LedgerNotMember as LedgerNotMember,
    LedgerNotUnbonding as LedgerNotUnbonding,
    LedgerStillUnbonding as LedgerStillUnbonding,
    LedgerAccusationPending as LedgerAccusationPending,
    LedgerRefundFailed as LedgerRefundFailed,
    LedgerMemberNotInactive as LedgerMemberNotInactive,
    LedgerRoundNotNext as LedgerRoundNotNext,
    LedgerRoundBeyondMax as LedgerRoundBeyondMax,
    LedgerStaleHead as LedgerStaleHead,
    LedgerBadSignaturesLength as LedgerBadSignaturesLength,
    LedgerInvalidSignature as LedgerInvalidSignature,
    LedgerSignerNotMember as LedgerSignerNotMember,
    LedgerSignerNotInForce as LedgerSignerNotInForce,
    LedgerSignersNotAscending as LedgerSignersNotAscending,
    LedgerQuorumNotMet as LedgerQuorumNotMet,
    LedgerNotEquivocation as LedgerNotEquivocation,
    LedgerDifferentSigners as LedgerDifferentSigners,
    LedgerNotBonded as LedgerNotBonded,
    LedgerRoundNotCommitted as LedgerRoundNotCommitted,
    LedgerNotCommittedRecord as LedgerNotCommittedRecord,
    LedgerDisputeMatchesCommit as LedgerDisputeMatchesCommit,
    LedgerDisputeOnlyMetrics as LedgerDisputeOnlyMetrics,
    LedgerDisputeWindowClosed as LedgerDisputeWindowClosed,
    LedgerNotInForce as LedgerNotInForce,
    LedgerAlreadyDisputed as LedgerAlreadyDisputed,
    LedgerAccusationExists as LedgerAccusationExists,
    LedgerAccusationNotOpen as LedgerAccusationNotOpen,
    LedgerAccusationExpired as LedgerAccusationExpired,
    LedgerAccusationNotExpired as LedgerAccusationNotExpired,
    LedgerBadTenure as LedgerBadTenure,
    LedgerDisputerNotSender as LedgerDisputerNotSender,
    LedgerDisputeNotOpen as LedgerDisputeNotOpen,
    LedgerDisputeExpired as LedgerDisputeExpired,
    LedgerDisputeNotExpired as LedgerDisputeNotExpired,
    LedgerNotAttesters as LedgerNotAttesters,
    LedgerRunHalted as LedgerRunHalted,
    LedgerAccusationTooLate as LedgerAccusationTooLate,
    LedgerAttestBeforeJoin as LedgerAttestBeforeJoin,
    LedgerAttestOtherResult as LedgerAttestOtherResult,
    LedgerNotProver as LedgerNotProver,
    LedgerBadCommitments as LedgerBadCommitments,
    LedgerBadRunValues as LedgerBadRunValues,
    LedgerProofTooCostly as LedgerProofTooCostly,
    LedgerBadGameSteps as LedgerBadGameSteps,
    LedgerUnbondingBelowProofWindow as LedgerUnbondingBelowProofWindow,
    LedgerRunFull as LedgerRunFull,
)
from ledger.errors.prover import (
    ProverError as ProverError,
    ProverBadRecords as ProverBadRecords,
    ProverNotCommitted as ProverNotCommitted,
    ProverBadStage as ProverBadStage,
    ProverBadStagePath as ProverBadStagePath,
    ProverBadStageLeaf as ProverBadStageLeaf,
    ProverBadFactors as ProverBadFactors,
    ProverBadChunk as ProverBadChunk,
    ProverBadPath as ProverBadPath,
    ProverBadLeaf as ProverBadLeaf,
    ProverRoundCorrect as ProverRoundCorrect,
    ProverNotNormed as ProverNotNormed,
    ProverBadSumPath as ProverBadSumPath,
    ProverNormCorrect as ProverNormCorrect,
    ProverNoGenesis as ProverNoGenesis,
    ProverBadSchedule as ProverBadSchedule,
    ProverBadTarget as ProverBadTarget,
    ProverBondMismatch as ProverBondMismatch,
    ProverChallengeExists as ProverChallengeExists,
    ProverNoAnswerer as ProverNoAnswerer,
    ProverNoChallenge as ProverNoChallenge,
    ProverChallengeSettled as ProverChallengeSettled,
    ProverChallengeDue as ProverChallengeDue,
    ProverChallengeNotDue as ProverChallengeNotDue,
    ProverChallengeTooLate as ProverChallengeTooLate,
    ProverGameTooLong as ProverGameTooLong,
    ProverProofWindowClosed as ProverProofWindowClosed,
    ProverParentOpen as ProverParentOpen,
    ProverNoClaim as ProverNoClaim,
    ProverNotClaimant as ProverNotClaimant,
    ProverRoundStands as ProverRoundStands,
    ProverNotLedger as ProverNotLedger,
    ProverNotStepProver as ProverNotStepProver,
)

from ledger.errors.step_prover import (
    ProverStepBondMismatch as ProverStepBondMismatch,
    ProverStepBadOp as ProverStepBadOp,
    ProverStepUnknownClaim as ProverStepUnknownClaim,
    ProverStepClaimClosed as ProverStepClaimClosed,
    ProverStepBadElement as ProverStepBadElement,
    ProverStepNotYourMove as ProverStepNotYourMove,
    ProverStepWrongPhase as ProverStepWrongPhase,
    ProverStepClockOut as ProverStepClockOut,
    ProverStepClockRunning as ProverStepClockRunning,
    ProverStepBadOpening as ProverStepBadOpening,
    ProverStepTreeMismatch as ProverStepTreeMismatch,
    ProverStepNotListed as ProverStepNotListed,
    ProverStepWrongStart as ProverStepWrongStart,
    ProverStepWindowClosed as ProverStepWindowClosed,
    ProverStepClaimsClosed as ProverStepClaimsClosed,
    ProverStepNotCommitted as ProverStepNotCommitted,
    ProverStepCaseOpen as ProverStepCaseOpen,
    ProverStepNoCase as ProverStepNoCase,
    ProverStepCaseRunning as ProverStepCaseRunning,
    ProverStepClaimStands as ProverStepClaimStands,
    ProverStepNoProgram as ProverStepNoProgram,
    ProverStepWrongProgram as ProverStepWrongProgram,
    ProverStepWrongSteps as ProverStepWrongSteps,
    ProverStepProgramFixed as ProverStepProgramFixed,
    ProverStepEndUnbound as ProverStepEndUnbound,
    ProverStepDataUnbound as ProverStepDataUnbound,
    ProverStepWrongDataKey as ProverStepWrongDataKey,
    ProverStepWrongReplica as ProverStepWrongReplica,
)
from ledger.errors.rewards import (
    RewardError as RewardError,
    RewardAlreadyClaimed as RewardAlreadyClaimed,
    RewardBadAttesters as RewardBadAttesters,
    RewardBadFunding as RewardBadFunding,
    RewardBadParams as RewardBadParams,
    RewardBadRecord as RewardBadRecord,
    RewardBadStage as RewardBadStage,
    RewardClaimClosed as RewardClaimClosed,
    RewardClaimOpen as RewardClaimOpen,
    RewardConvicted as RewardConvicted,
    RewardNoPool as RewardNoPool,
    RewardNotListed as RewardNotListed,
    RewardNothingToPay as RewardNothingToPay,
    RewardPoolUnfunded as RewardPoolUnfunded,
    RewardReentered as RewardReentered,
    RewardRoundNotFinal as RewardRoundNotFinal,
    RewardRoundNotPaid as RewardRoundNotPaid,
    RewardTokenFailed as RewardTokenFailed,
    RewardTransferFailed as RewardTransferFailed,
)


def _descendants(base: type[ContractRevert]) -> list[type[ContractRevert]]:
    found = []
    for cls in base.__subclasses__():
        found += [cls, *_descendants(cls)]
    return found


#: Every Python class that mirrors a Solidity custom error, by the error's name: the subclasses of the three
#: contracts' bases (a Python class per ABI error, and none more, is tests/test_ledger_errors.py's check).
REVERT_CLASSES: dict[str, type[ContractRevert]] = {
    cls.__name__: cls for base in (RegistryError, LedgerRevert, ProverError, RewardError) for cls in
    _descendants(base)
}
