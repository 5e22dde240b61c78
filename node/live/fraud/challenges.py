"""The fraud prover's availability challenges (node/live/fraud/prover.py, step 3 of its docstring): where
the committed state, factors or sum trees are withheld, the committers are challenged on chain to publish one
leaf at a time (:class:`node.live.fraud.walks.Walk`, :class:`node.live.fraud.walks.SumWalk`, a bisection),
each answer is followed to the next challenge or to the proof, and a challenge left unanswered past its window
is settled (``expireChallenge``): the round is then invalidated on chain.
"""

from __future__ import annotations

import hashlib
import logging
import threading

from ledger.availability import MOMENTUM, WEIGHTS, availability_target, differing_subtree, opened_proof, \
    stage_leaf_target
from ledger.chunkproof import Factors, StageLeaf, StageState, tree_path
from ledger.errors import ChainUnavailable, LedgerError, ProverChallengeNotDue, ProverChallengeSettled
from ledger.normproof import SUM_BYTES, differing_sum_subtree, opened_sum_proof, path_total
from ledger.records import RoundRecord
from node.errors import DLX_ERRORS
from node.fraudproof import parse_stage_leaf
from node.live.fraud.kept_games import KeptGames
from node.live.fraud.walks import SumWalk, Walk

logger = logging.getLogger(__name__)

#: How often a pending availability challenge is tried for settlement.
EXPIRE_EVERY_S = 5.0
#: How often instead while a deferred proof's window is about to open (DUE_BLOCKS or fewer blocks ahead): it
#: is sent in the first blocks it is taken in. A proof of a contributor without a seat is taken only while its
#: round can still be disputed (ProverBinding), which may end a few blocks after its parent's window.
DUE_EVERY_S = 0.25
DUE_BLOCKS = 8


class AvailabilityChallenges(KeptGames):
    """The availability challenges half of :class:`node.live.fraud.prover.FraudProver` (module docstring).

    The prover holds the state these methods share (``chain``, ``states``, ``stages``, ``stop``, ``log``, the
    pending challenges, their walks and factor openings, the locks and the expirer thread) and the proof's
    end (the hooks below): a challenge answered is followed to a proof the prover sends.
    """

    # -- the prover's hooks ---------------------------------------------------------------------------
    def _attesters_of(self, outer_round: int, stage: int, leaf: bytes) -> list[str]:
        raise NotImplementedError

    def _prove_norms_from(self, outer_round: int, stage: int, record: RoundRecord, leaves: list[bytes],
                          leaf: StageLeaf, own: StageState, factors, trees) -> bool:
        raise NotImplementedError

    def _send(self, outer_round: int, stage: int, proof, why: str) -> None:
        raise NotImplementedError

    def _send_norm(self, outer_round: int, stage: int, proof, why: str) -> bool:
        raise NotImplementedError

    def _unprovable(self, outer_round: int, why: str) -> None:
        raise NotImplementedError

    def _send_deferred(self) -> None:
        raise NotImplementedError

    def _defer(self, outer_round: int, entry: tuple, opens_at) -> None:
        """Keep a proof the chain refused while its parent round can still be overturned (ProverParentOpen:
        ``opens_at``, its ``closesAt``) for the settlement loop, which sends it again once that block is
        reached."""
        with self._lock:
            self._deferred[outer_round] = entry
            if isinstance(opens_at, int):
                self._opens_at[outer_round] = opens_at
        self._ensure_settling()

    # -- a sum tree's walk --------------------------------------------------------------------------
    def _challenge_sums(self, walk: SumWalk) -> None:
        """Challenge the committers to publish leaf ``walk.chunk`` of ``walk.which`` (the sum tree, or the
        weights)."""
        stages = [parse_stage_leaf(v, s) for s, v in enumerate(walk.leaves)]
        target = availability_target(walk.record, stages, walk.factors, walk.stage, walk.which, walk.chunk)
        challenge_id = self.chain.challenge_availability(target)
        with self._lock:
            self._walks[challenge_id] = walk
        self._open(walk.outer_round, challenge_id)

    def _advance_sums(self, walk: SumWalk, leaf: bytes, path: list[bytes]) -> None:
        """Go on with a sum tree's walk from a published leaf (or, once the lied leaf is found, the
        weights')."""
        if walk.opened is not None:  # the committed weights leaf of the lied chunk: the proof is complete
            self._send_sum(walk, (leaf, path))
            return
        own_tree = walk.own.sum_trees[walk.mine]
        if len(leaf) != SUM_BYTES:  # the contract checked the width: a misread answer
            self._unprovable(walk.outer_round,
                             f"stage {walk.stage}: the published sum leaf is not {SUM_BYTES} bytes")
            return
        wrong_total = path_total(leaf, path) != walk.factors.norms.sums[walk.contribution]
        if wrong_total or int.from_bytes(leaf, "big") != own_tree.sums[walk.chunk]:
            walk.opened = (leaf, path)  # a lied leaf, or a tree whose total is not the committed one
            weights = self._committed_weight_leaf(walk)
            if weights is None:  # the weights are withheld too: open that chunk's leaf of them
                self._challenge_sums(walk)
                return
            self._send_sum(walk, weights)
            return
        self._descend(walk, differing_sum_subtree(own_tree, walk.chunk, path), "sum leaf", "sum tree",
                      self._challenge_sums)

    def _committed_weight_leaf(self, walk: SumWalk) -> tuple[bytes, list[bytes]] | None:
        """The round's committed weights leaf of ``walk.chunk`` with its path: this node's own where the
        committed weights root is its own, else from the state an attester serves; None if neither."""
        leaf = parse_stage_leaf(walk.leaves[walk.stage], walk.stage)
        own = walk.own
        if (leaf.weights_root, leaf.num_chunks) == (own.leaf().weights_root, len(own.weight_leaves)):
            weights = own.weight_leaves
        else:
            fetched = self.states.committed_state(walk.outer_round, walk.stage, leaf, self._attesters_of(
                walk.outer_round, walk.stage, walk.leaves[walk.stage]))
            if fetched is None:
                return None
            weights = fetched[0]
        return weights[walk.chunk], tree_path(weights, walk.chunk)

    def _send_sum(self, walk: SumWalk, weights: tuple[bytes, list[bytes]]) -> None:
        pieces = walk.own.payload_leaves[walk.mine]
        proof = opened_sum_proof(walk.record, walk.leaves, walk.stage, walk.factors.encode(),
                                 walk.contribution, walk.chunk, weights,
                                 (pieces[walk.chunk], tree_path(pieces, walk.chunk)), walk.opened)
        self._send_norm(walk.outer_round, walk.stage, proof,
                        f"contribution {walk.contribution}'s sum of squares at "
                                                             f"chunk {walk.chunk} (opened by "
                                                             "availability challenges)")
    # -- a state's walk ------------------------------------------------------------------------------
    def _challenge(self, walk: Walk) -> None:
        """Challenge the committers to publish leaf ``walk.chunk`` of tree ``walk.which`` of the withheld
        state."""
        target = availability_target(walk.record, walk.stages, walk.own.factors, walk.stage, walk.which,
                                     walk.chunk)
        challenge_id = self.chain.challenge_availability(target)
        with self._lock:
            self._walks[challenge_id] = walk
        self._open(walk.outer_round, challenge_id)

    def _answered(self, challenge_id: bytes, outer_round: int) -> None:
        """A challenge of this node's was answered: go on with its walk from the published leaf and path (read
        from AvailabilityAnswered's log, however the answer was sent), or prove from the published factors.
        The answer is read before the walk is taken: an outage (ChainUnavailable) leaves both for a retry."""
        with self._lock:
            walk = self._walks.get(challenge_id)
            factors_open = self._factor_opens.get(challenge_id)
        answer = self.chain.availability_answer(challenge_id) if walk or factors_open else None
        with self._lock:
            self._walks.pop(challenge_id, None)
            self._factor_opens.pop(challenge_id, None)
        if factors_open is not None:
            self._factors_published(outer_round, answer, *factors_open)
            return
        if walk is None:  # a stage leaf's challenge: the committers showed the leaf
            logger.warning(
                "round %d: the availability challenge was answered; the published stage leaf is not "
                "followed further here", outer_round)
            return
        if answer is None:
            self._unprovable(outer_round,
                             "the availability challenge was settled without an answer (another party "
                                          "expired it)")
            return
        leaf, path = answer
        # The answer gave this node's game a fresh window (accusationBlocks) for its next step, even after the
        # round's dispute window: the walk goes on at once.
        logger.warning("round %d stage %d: the committers published leaf %d of tree %d", outer_round,
                       walk.stage, walk.chunk, walk.which)
        if isinstance(walk, SumWalk):
            self._advance_sums(walk, leaf, path)
            return
        self._advance(walk, leaf, path)

    def _factors_published(self, outer_round: int, answer, stage: int, record: RoundRecord,
                           leaves: list[bytes], leaf: StageLeaf, own: StageState) -> None:
        if answer is None:
            self._unprovable(outer_round, "the factors' availability challenge was settled without an answer")
            return
        published = bytes(answer[0])
        # the contract checked it: a misread event
        if hashlib.sha256(published).digest() != leaf.factors_hash:
            self._unprovable(outer_round,
                             f"stage {stage}: the published factors are not the committed stage leaf's")
            return
        logger.warning("round %d stage %d: the committers published their factors", outer_round, stage)
        try:
            factors = Factors.decode(published)
        except LedgerError:
            factors = published
        # Their sum trees are not had here (nobody served them): the factors' version or the scales are proven
        # from the factors alone, a sum by walking the committed tree (SumWalk).
        self._prove_norms_from(outer_round, stage, record, leaves, leaf, own, factors, None)

    def _advance(self, walk: Walk, leaf: bytes, path: list[bytes]) -> None:
        own_leaves = walk.own.weight_leaves if walk.which == WEIGHTS else walk.own.momentum_leaves
        other = MOMENTUM if walk.which == WEIGHTS else WEIGHTS
        completing = other in walk.opened  # the differing chunk is known: this was its other tree's leaf
        committed_chunks = walk.stages[walk.stage].num_chunks
        if (completing or committed_chunks != len(own_leaves) or walk.chunk >= len(own_leaves)
                or leaf != own_leaves[walk.chunk]):
            walk.opened[walk.which] = (walk.chunk, leaf, path)
            if not completing:
                own_root = (walk.own.leaf().momentum_root if other == MOMENTUM
                            else walk.own.leaf().weights_root)
                committed_root = (walk.stages[walk.stage].momentum_root if other == MOMENTUM
                                  else walk.stages[walk.stage].weights_root)
                if committed_root != own_root:  # that tree differs too: open its leaf of this chunk
                    walk.which = other
                    self._challenge(walk)
                    return
                mine = walk.own.momentum_leaves if other == MOMENTUM else walk.own.weight_leaves
                walk.opened[other] = (walk.chunk, mine[walk.chunk], tree_path(mine, walk.chunk))
            proof = opened_proof(walk.prev_record, walk.record, walk.prev_stages, walk.stages, walk.prev,
                                 walk.own, walk.chunk, walk.opened[WEIGHTS][1:], walk.opened[MOMENTUM][1:])
            self._send(walk.outer_round, walk.stage, proof,
                       f"chunk {walk.chunk} (opened by availability challenges)")
            return
        self._descend(walk, differing_subtree(own_leaves, walk.chunk, path), "leaf", "tree", self._challenge)

    def _descend(self, walk: Walk | SumWalk, following: int | None, leaf: str, tree: str, challenge) -> None:
        """One bisection step of a walk: challenge the next leaf where this node's tree and the published path
        differ, or log the round unprovable where they agree."""
        if following is None:
            self._unprovable(walk.outer_round,
                             f"stage {walk.stage}: the published {leaf} {walk.chunk} and its path "
                                               f"agree with this node's {tree}")
            return
        walk.chunk = following
        challenge(walk)

    def _challenge_stage_leaf(self, outer_round: int, record: RoundRecord) -> None:
        """Challenge the committers to publish the leaf of the first stage this node holds under the record's
        root: a root with no stage leaves behind it (a back door) cannot be answered, and the round falls."""
        stage = min(self.stages(), default=0)
        logger.error(
            "round %d: no attested stage leaves give the committed weights root; challenging the committers "
            "to publish stage %d's leaf on chain", outer_round, stage)
        self._open(outer_round, self.chain.challenge_availability(stage_leaf_target(record, stage)))

    def _open(self, outer_round: int, challenge_id: bytes) -> None:
        self.log.challenges[outer_round] = challenge_id
        with self._lock:
            self._pending[challenge_id] = outer_round
        self._keep_game(outer_round, challenge_id)  # a factors challenge outlives this life (kept_games.py)
        self._ensure_settling()

    def _ensure_settling(self) -> None:
        """Run the settlement loop (the expirer's thread) while challenges or deferred proofs are pending."""
        with self._lock:
            if self._expirer is None or not self._expirer.is_alive():
                self._expirer = threading.Thread(target=self._expire_loop, name="fraud-expirer", daemon=True)
                self._expirer.start()

    # -- what is still open (the re-entry's hold, the run's end) -------------------------------------------
    def open_rounds(self) -> list[int]:
        """The rounds whose proof waits for its parent's window or whose availability game is still open (the
        settlement loop sends or settles them)."""
        with self._lock:
            return sorted({*self._deferred, *self._pending.values()})

    def holds_reentry(self, outer_round: int) -> str | None:
        """Why a node whose weights left the record at ``outer_round`` must not re-enter from the chain's
        checkpoint yet (node/live/peers/lifecycle.py), None if it may: a round up to it that this node holds
        wrong (a proof built, deferred or a walk begun: ``log.wrong``) and that the chain has not overturned
        yet. A next life would lose the game: it holds neither the walk nor this life's state of the round."""
        with self._lock:
            wrong = sorted((t, why) for t, why in self.log.wrong.items() if t <= outer_round)
        if not wrong or self.overturned(wrong[0][0]):
            return None
        return f"round {wrong[0][0]} is held wrong here ({wrong[0][1]}) and its proof or game is still open"

    def overturned(self, outer_round: int) -> bool:
        """Whether the chain overturned round ``outer_round`` (it and every later one are invalid); False
        where the chain cannot be read now."""
        try:
            invalid = self.chain.invalid_from(self.run_id)
        except DLX_ERRORS:
            return False
        return invalid is not None and invalid <= outer_round

    # -- availability challenges ---------------------------------------------------------------
    def _expire_loop(self) -> None:
        while not self.stop.wait(self._settle_every()):
            if not self.settle_challenges():
                return

    def _settle_every(self) -> float:
        """EXPIRE_EVERY_S, or DUE_EVERY_S while a deferred proof's window opens within DUE_BLOCKS blocks."""
        with self._lock:
            opens = [self._opens_at.get(t) for t in self._deferred]
        if not opens:
            return EXPIRE_EVERY_S
        try:
            head = self.chain.block_number()
        except DLX_ERRORS:
            return EXPIRE_EVERY_S
        due = any(at is not None and head + DUE_BLOCKS >= at for at in opens)
        return DUE_EVERY_S if due else EXPIRE_EVERY_S

    def settle_challenges(self) -> bool:
        """Settle every pending challenge that is due: answered ones are dropped, unanswered ones expired
        (also done every EXPIRE_EVERY_S on a thread while any is pending). Whether some are still pending.

        Settlements do not overlap: a call made while another thread follows an answered challenge (builds and
        sends its proof) returns after that one, so what it reads of ``log`` afterwards includes it.
        """
        with self._settling:
            self._send_deferred()
            return self._settle_due()

    def _settle_due(self) -> bool:
        with self._lock:
            pending = dict(self._pending)
        for challenge_id, outer_round in pending.items():
            try:
                state = self.chain.challenge_of(challenge_id)
                if state["settled"]:
                    if self._drop(challenge_id):  # this thread took it (the expirer's and check()'s may race)
                        self._follow(challenge_id, outer_round)
                    continue
                self.chain.expire_challenge(challenge_id)
            except ProverChallengeNotDue:
                continue
            except ProverChallengeSettled:  # answered since it was read (or expired by another party)
                if self._drop(challenge_id):
                    self._follow(challenge_id, outer_round)
                continue
            except LedgerError as exc:  # the game is over without this node (window closed, run halted)
                self._drop(challenge_id)
                self._forget_game(challenge_id)
                self._unprovable(outer_round, f"the availability challenge was not settled: {exc}"[:300])
                continue
            except DLX_ERRORS as exc:
                logger.debug("round %d: availability challenge not settled yet: %s", outer_round, exc)
                continue
            self.log.expired[outer_round] = challenge_id
            logger.error(
                "round %d: the availability challenge went unanswered; the round is invalidated on chain "
                "and its attesters slashed", outer_round)
            self._drop(challenge_id)
            self._forget_game(challenge_id)
        with self._lock:
            return bool(self._pending) or bool(self._deferred)

    def _drop(self, challenge_id: bytes) -> bool:
        """Forget a pending challenge; whether it was pending."""
        with self._lock:
            return self._pending.pop(challenge_id, None) is not None

    def _follow(self, challenge_id: bytes, outer_round: int) -> None:
        try:
            self._answered(challenge_id, outer_round)
        except ChainUnavailable as exc:  # nothing was taken: followed again on the next settlement
            logger.warning("round %d: the answer could not be read yet: %s", outer_round, exc)
            with self._lock:
                self._pending[challenge_id] = outer_round
            return
        except DLX_ERRORS as exc:  # e.g. the round's dispute window closed: no more challenges
            self._unprovable(outer_round,
                             f"the proof from the answered challenge failed: {type(exc).__name__}: "
                                          f"{exc}"[:300])
        self._forget_game(challenge_id)
