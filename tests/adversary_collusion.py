"""tests/adversary.py's colluding quorum moves of issue 62 (docs/FRAUD_PROOF.md, "The run's values"):
rounds whose weights are exactly the outer step of their committed factors, so no chunk differs, but whose
factors are not the run's. Each function returns the part classes of its attack (keyword arguments of
node.live.assembly.Kinds).

- ``collude-lr``: in round 1 every colluder steps with outer lr 7.0 (the run's schedule says otherwise) and
  commits factors that say 7.0, with weights consistent with them; it serves its state and factors as its own.
  One honest member outside the quorum must prove the round wrong by its factors alone (a values proof) and
  must not sign round 2 on top of it before.
- ``collude-lr-late``: ``collude-lr``, and the colluders serve nothing of their state (no weights, no factors,
  no sum trees): the honest member must challenge the factors' availability on chain; the colluders answer
  every challenge truthfully, but only in the last blocks of its window (LATE_MARGIN_BLOCKS), the clock's
  move. The honest member's weights left the record (its own aggregate stood): its re-entry from the chain's
  checkpoint must wait for its game (node/live/peers/lifecycle.py), or its next life loses it.
- ``collude-fabricate``: in round 1 every colluder aggregates, beside the real contributions, a fabricated
  one (a copy of the first one's payload under another envelope) that no member signed: signed by an account
  that holds no seat in the run (FABRICATOR_KEY) and listed as the first contribution's contributor (a
  member, the same in every colluder). The run's values hold, the scales follow from the committed sums and
  every chunk is the step of the committed factors: only the binding shows it (one member listed twice, a
  signature not by the member beside it), and the honest member must send the binding proof
  (``proveWrongNorm``, the factors alone).
- ``collude-fabricate-own``: the same contribution listed as the non-member itself, its signature valid: only
  the contract's ``memberOf`` shows it. And the colluders commit rounds 0 and 1 back to back: each withholds
  its signature of round 0 until it has aggregated round 1 (the honest member alone is no quorum), so round 1
  is committed as soon as round 0 is, a block or two later. A proof of round 1 is taken only once round 0's
  window closed (``ProverParentOpen``), a block or two after round 1's own dispute window; ProverBinding read
  the seats only within that window before (docs/FRAUD_PROOF.md, "The binding"), and the round stood.
"""

from __future__ import annotations

import hashlib
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

logger = logging.getLogger("adversary")

COLLUSION_ATTACKS = ("collude-lr", "collude-lr-late", "collude-fabricate", "collude-fabricate-own")
#: The round ``collude-lr`` steps with another lr (round 0's proof window closes first).
COLLUDED_ROUND = 1
#: The outer lr it steps round COLLUDED_ROUND with.
WRONG_LR = 7.0
#: ``collude-lr-late`` answers a challenge once the chain is this close to its deadline (its answerer polls
#: every LATE_POLL_S: the last blocks it can be sure to reach while the e2e mines a few blocks a second).
LATE_MARGIN_BLOCKS = 6
LATE_POLL_S = 0.5
#: The key of the account ``collude-fabricate`` binds its fabricated contribution to (never a member).
FABRICATOR_KEY = b"\x5a" * 32
#: ``collude-fabricate-own`` withholds its signature of round 0 at most this long, waiting for round 1's
#: aggregate (then signs it anyway: the run goes on).
HOLD_ROUND_0_S = 300.0


def colluding_lr():
    from node.live.worker.replica import ReplicaWorker

    class OtherLrWorker(ReplicaWorker):
        """Steps round COLLUDED_ROUND with WRONG_LR: the engine's outer step and the finisher's factors read
        the run's DilocoConfig (one object), so both say 7.0 until the next round is applied."""

        _honest_lr: float | None = None

        def _set_lr(self, stage: int, value: float) -> None:
            for diloco in {id(d): d for d in (self.cfg.diloco, self.engines[stage].diloco_cfg)}.values():
                object.__setattr__(diloco, "outer_lr", value)

        def apply(self, stage, outer_round, contributions, excluded=None, prepared=None):
            if outer_round == COLLUDED_ROUND:
                self._honest_lr = self.cfg.diloco.outer_lr
                self._set_lr(stage, WRONG_LR)
                logger.warning("adversary: round %d stage %d: stepping with outer lr %s", outer_round, stage,
                               WRONG_LR)
                prepared = None  # a prepared aggregation was computed with the run's lr
            elif self._honest_lr is not None:
                self._set_lr(stage, self._honest_lr)
            return super().apply(stage, outer_round, contributions, excluded=excluded, prepared=prepared)

    return {"worker": OtherLrWorker}


def colluding_lr_late():
    from ledger.errors import LedgerError
    from node.errors import DLX_ERRORS
    from node.live.fraud import answerer
    from node.live.fraud.answerer import ChallengeAnswerer
    from node.live.fraud.chunkstate import ChunkedStates

    # Serve nothing of the committed state: every leaf a prover needs must be challenged on chain.
    ChunkedStates.publish = lambda self, *args, **kwargs: None
    ChunkedStates.publish_part = lambda self, *args, **kwargs: None

    def late_poll(self) -> None:
        """Answer each challenge as the honest answerer does, but only in the last blocks of its window."""
        held = self.__dict__.setdefault("_held", {})
        try:
            challenges, head = self.chain.availability_challenges(self.run_id, self._from_block)
        except DLX_ERRORS:
            return
        self._from_block = head + 1
        for challenge in challenges:
            held.setdefault(bytes(challenge["id"]), challenge)
        for challenge_id, challenge in list(held.items()):
            try:
                deadline, block = self.chain.challenge_of(challenge_id)["deadline"], self.chain.block_number()
                if block < deadline - LATE_MARGIN_BLOCKS:
                    continue
                del held[challenge_id]
                self.answered[challenge_id] = self._answer(challenge_id, challenge)
            except (*DLX_ERRORS, LedgerError, IndexError) as exc:
                held.pop(challenge_id, None)
                self.answered[challenge_id] = f"not answered: {type(exc).__name__}: {exc}"[:300]
                continue
            logger.warning("adversary: round %d stage %d: challenge %s answered late (block %d, deadline "
                           "%d): %s", challenge["round"], challenge["stage"], challenge_id.hex()[:12], block,
                           deadline, self.answered[challenge_id])

    ChallengeAnswerer.poll = late_poll
    answerer.ANSWER_EVERY_S = LATE_POLL_S  # read at each wait: the last blocks of a window are not missed
    return colluding_lr()


def colluding_fabricate(own: bool = False):
    """``collude-fabricate``; ``own``: ``collude-fabricate-own``."""
    import threading

    from eth_account import Account

    from ledger.contribution_binding import sign_contribution
    from node.live.fraud.chunkstate import ChunkedStates
    from node.live.fraud.contribution_binding import ContributionBinder
    from node.live.record.quorumcommit import QuorumCommit
    from node.live.worker.replica import ReplicaWorker

    binders: list = []  # this node's binder (its chain names the EIP-712 domain), seen when it signs
    fabricated: dict = {}  # (round, stage) -> the fabricated payload
    honest_sign, honest_record = ContributionBinder.sign, ChunkedStates.record
    honest_sign_record = QuorumCommit._sign
    applied = threading.Event()  # round COLLUDED_ROUND aggregated (with the fabricated contribution)

    def sign(self, outer_round, stage, blob, shapes):
        binders[:] = [self]
        return honest_sign(self, outer_round, stage, blob, shapes)

    def record(self, outer_round, stage, weights, momentum, reports, payloads, envelopes, bindings=None):
        blob = fabricated.get((outer_round, stage))
        if blob is not None and len(reports) == len(payloads) + 1 and binders:
            binder = binders[0]
            claim = binder._claim(outer_round, stage, blob, {n: tuple(t.shape) for n, t in weights.items()})
            client = binder.chain.client
            outsider = Account.from_key(FABRICATOR_KEY)
            listed_as = bindings[0][0] if bindings and bindings[0] and not own else outsider.address
            binding = (listed_as, sign_contribution(outsider, claim, client.chain_id, client.ledger_address))
            envelope = hashlib.sha256(b"fabricated" + blob).digest()
            payloads, envelopes = [*payloads, blob], [*envelopes, envelope]
            bindings = [*(bindings or [None] * len(reports[:-1])), binding]
            logger.warning("adversary: round %d stage %d: listing a fabricated contribution as %s's, signed "
                           "by %s, who holds no seat", outer_round, stage, listed_as, outsider.address)
        return honest_record(self, outer_round, stage, weights, momentum, reports, payloads, envelopes,
                             bindings)

    class FabricatingWorker(ReplicaWorker):
        """Aggregates round COLLUDED_ROUND with a copy of its first contribution's payload beside the real
        ones (the weights are the outer step of all of them: no chunk differs)."""

        def apply(self, stage, outer_round, contributions, excluded=None, prepared=None):
            if outer_round == COLLUDED_ROUND and contributions:
                fabricated[(outer_round, stage)] = contributions[0]
                contributions, prepared = [*contributions, contributions[0]], None
            result = super().apply(stage, outer_round, contributions, excluded=excluded, prepared=prepared)
            if outer_round == COLLUDED_ROUND:
                applied.set()
            return result

    def sign_record(self, record):
        """Round COLLUDED_ROUND - 1's record signed only once round COLLUDED_ROUND is aggregated: the two
        rounds are then committed back to back."""
        if record.round == COLLUDED_ROUND - 1:
            logger.warning("adversary: round %d: withholding this member's record signature until round %d "
                           "is aggregated", record.round, COLLUDED_ROUND)
            applied.wait(HOLD_ROUND_0_S)
        return honest_sign_record(self, record)

    ContributionBinder.sign = sign
    ChunkedStates.record = record
    if own:
        QuorumCommit._sign = sign_record
    return {"worker": FabricatingWorker}


def collusion_parts(attack: str) -> dict:
    """The part classes of one of COLLUSION_ATTACKS."""
    return {"collude-lr": colluding_lr, "collude-lr-late": colluding_lr_late,
            "collude-fabricate": colluding_fabricate,
            "collude-fabricate-own": lambda: colluding_fabricate(own=True)}[attack]()
