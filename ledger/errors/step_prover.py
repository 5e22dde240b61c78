"""The StepProver contract's custom errors (the contribution proof's games: docs/FRAUD_PROOF.md, "The
contribution proof"), one Python class each; all are :class:`ProverError`\\ s."""

from __future__ import annotations

from ledger.errors.prover import ProverError


class ProverStepBondMismatch(ProverError):
    """The value sent is not the claim's or the challenge's bond."""


class ProverStepBadOp(ProverError):
    """The op kind is not one the contract recomputes (or its operands do not fit it)."""


class ProverStepUnknownClaim(ProverError):
    """No claim (or game) with this id."""


class ProverStepClaimClosed(ProverError):
    """The claim's game has ended."""


class ProverStepBadElement(ProverError):
    """The element index is not inside the disputed tensor."""


class ProverStepNotYourMove(ProverError):
    """The sender is not the side whose move it is."""


class ProverStepWrongPhase(ProverError):
    """The move does not belong to the game's current phase."""


class ProverStepClockOut(ProverError):
    """The mover's clock has run out: only ``timeout`` is left."""


class ProverStepClockRunning(ProverError):
    """``timeout`` before the side to move has used up its clock."""


class ProverStepBadOpening(ProverError):
    """An opening's Merkle path does not lead to its committed root (``which`` names the opening)."""


class ProverStepTreeMismatch(ProverError):
    """A tree sum's posted children (``left``, ``right``) do not add up to the disputed node in float32."""


class ProverStepNotListed(ProverError):
    """A run claim names a payload root that its round's committed record does not list for its stage (or the
    index given does not point at it): a claim about a contribution the ledger never accepted."""


class ProverStepWrongStart(ProverError):
    """A run claim's start weights are not the stage's weights root the ledger committed for the round's start
    (round - 1's stage leaf, or the run's genesis)."""


class ProverStepWindowClosed(ProverError):
    """A run claim after its round's proof window closed, or a case whose course (claims, then a challenge and
    a full game on the last one: ``4 clock + 1`` blocks) would not end inside that window."""


class ProverStepClaimsClosed(ProverError):
    """A run claim on a contribution whose open case's deadline for claims has passed."""


class ProverStepNotCommitted(ProverError):
    """``openCase`` without the sender's commitment (``commitCase``) made in an earlier block: a copy of
    another's ``openCase`` (a front-runner's) is refused."""


class ProverStepCaseOpen(ProverError):
    """A case on this contribution is open already (one at a time)."""


class ProverStepNoCase(ProverError):
    """No case is open on this contribution."""


class ProverStepCaseRunning(ProverError):
    """Too early: the case's deadline for claims (overturn) or its end (dismissal) is still ahead."""


class ProverStepClaimStands(ProverError):
    """A run claim on the contribution has not been proven wrong: the round is not overturned."""


class ProverStepNoProgram(ProverError):
    """The run has no step program (StepProver.setProgram): it takes no run claim and no case."""


class ProverStepWrongProgram(ProverError):
    """The run claim's program (root, state leaves, ops, depth) is not the run's."""


class ProverStepWrongSteps(ProverError):
    """The run claim's step count is not the run's inner steps H."""


class ProverStepProgramFixed(ProverError):
    """Only the run's creator sets its program, once, before its first commit."""


class ProverStepEndUnbound(ProverError):
    """The run has no end rule (StepProver.setEndRule): its claims' ends are not disputed (challengeEnd)."""


class ProverStepDataUnbound(ProverError):
    """The run has no data (StepProver.setData), or the claim names no data key (its round's factors list no
    contributor), so its batches are not disputed (challengeData); or data terms with no root, no rows or no
    window start were given."""


class ProverStepWrongDataKey(ProverError):
    """The run claim's data key is not its replica's: for stage 0 the member account its round's factors list
    for the contribution, for a later stage the stage-0 member its replica binding opens."""


class ProverStepWrongReplica(ProverError):
    """A later stage's run claim does not show its replica's data key: no replica binding, a stage-0 index the
    factors list no member at, or no signature of ``DataKey`` for that key by the contribution's own member
    (docs/FRAUD_PROOF.md "The replica's key")."""
