"""The RewardPool contract's custom errors, one Python class each (issue 77; docs/REWARDS.md)."""

from __future__ import annotations

from ledger.errors.base import ContractRevert


class RewardError(ContractRevert):
    """A revert of the RewardPool contract."""


class RewardAlreadyClaimed(RewardError):
    """The account already claimed this share (a claim pays once)."""


class RewardBadAttesters(RewardError):
    """The attesters given are not the round's (their hash is not the ledger's)."""


class RewardBadParams(RewardError):
    """A pool's parameters were refused at creation (``reason`` says which rule)."""


class RewardBadRecord(RewardError):
    """The record is not the one committed for its round."""


class RewardBadStage(RewardError):
    """The stage leaf, its path or its factors do not open the record's version-3 stage."""


class RewardClaimClosed(RewardError):
    """The round's claim window closed (its remainder was swept), or it is not open."""


class RewardClaimOpen(RewardError):
    """The round's claim window is still open: it cannot be swept yet."""


class RewardConvicted(RewardError):
    """The account was convicted (slashed) in the run: its credits are forfeited."""


class RewardNoPool(RewardError):
    """The run has no pool."""


class RewardNotListed(RewardError):
    """The account is not the one listed (or did not sign) at that place of the record."""


class RewardNothingToPay(RewardError):
    """The share is zero (a round bounded by time whose steps round it to nothing)."""


class RewardPoolUnfunded(RewardError):
    """The pool's free funds do not cover the round's amount (top it up with fund)."""


class RewardRoundNotFinal(RewardError):
    """The round (or an earlier unopened one) is not final on the ledger."""


class RewardRoundNotPaid(RewardError):
    """The round precedes the pool: it is not paid."""


class RewardTransferFailed(RewardError):
    """The payment to the claimer failed: the claim is undone."""


class RewardBadFunding(RewardError):
    """The ETH sent is not the amount named (an ETH pool), or ETH was sent to a token pool."""


class RewardTokenFailed(RewardError):
    """The pool's ERC-20 reverted, returned false, or did not move what it was asked to: nothing changed."""


class RewardReentered(RewardError):
    """The pool was called from inside one of its token's calls (a re-entrant token): refused."""
