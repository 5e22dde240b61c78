"""The AggregationProver contract's custom errors (and its libraries'), one Python class each
(the fraud proof of a wrong aggregation: docs/FRAUD_PROOF.md)."""

from __future__ import annotations

from ledger.errors.base import ContractRevert


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
    """The round's factors are version 2 in a run that is not normed: no norm commitment a norm proof could
    open (version-2 factors in a normed run are a wrong round, proven)."""


class ProverBadSumPath(ProverError):
    """A sum-tree leaf or its path does not lead to the contribution's committed norm root at the chunk."""


class ProverNormCorrect(ProverError):
    """The committed scales follow from the committed sums, and the opened sum-tree chunk is right."""


class ProverBadTarget(ProverError):
    """A data-availability challenge names a contribution the round did not accept."""


class ProverBondMismatch(ProverError):
    """A challenge was sent with another amount than the run's bond."""


class ProverChallengeExists(ProverError):
    """That challenger already challenged that leaf of that round."""


class ProverNoAnswerer(ProverError):
    """The run is hashed (version 1): no node of it answers availability challenges, so none is taken
    (issue 79)."""


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


class ProverNoGenesis(ProverError):
    """A proof of round 0 in a run created without a genesis root: round 0's start is not on chain."""


class ProverBadSchedule(ProverError):
    """The proof's schedule leaf or its path is not the run's leaf of the round (RunParams.scheduleRoot)."""
    """The round's dispute window closed and the caller has no game on it with a fresh window (an answer's):
    its leaves can no longer be challenged by it."""


class ProverGameTooLong(ProverError):
    """The caller's game on that stage of the round took the run's ``maxGameSteps`` steps already."""


class ProverProofWindowClosed(ProverError):
    """The round's proof window closed (its dispute window and games are over): it is final or on its way,
    no proof or expiry overturns it any more."""


class ProverParentOpen(ProverError):
    """The round's parent can still be overturned: a proof of the round waits until it cannot (a proof never
    slashes through a wrong parent); retry from the block named."""


class ProverNoClaim(ProverError):
    """No reward of that round is held (none was, or it was claimed)."""


class ProverNotClaimant(ProverError):
    """The caller did not commit the proof before it was sent (within the claim window), nor sent it
    (after)."""


class ProverRoundStands(ProverError):
    """The round was not overturned: a game's escrowed bonds come back only from an overturned round."""


class ProverNotLedger(ProverError):
    """Only the ledger pays the prover."""


class ProverNotStepProver(ProverError):
    """Only the StepProver this prover deployed overturns a round on a contribution case
    (``overturnByStep``)."""
