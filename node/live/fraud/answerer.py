"""Answering the availability challenges of a chunked run's rounds (issue 43; docs/FRAUD_PROOF.md).

Anyone may challenge the committers of a round to publish one committed leaf on chain
(``challengeAvailability``: a chunk of a stage's new weights or momentum, of an accepted contribution's
payload, or a stage leaf itself); left unanswered past the run's ``accusationBlocks``, the round is overturned
and its attesters slashed. So a right round must never go unanswered: every node of a chunked run watches the
run's challenges and answers each one it can from what it holds (``answerChallenge``, at the cost of one
transaction; the challenger's bond is
forfeited): a stage leaf from the committed stage leaves its prover found (node/live/fraud/prover.py), any
other leaf from its own state of the stage, when that state is the committed one
(node/live/fraud/chunkstate.py). A challenge of a round this node's state is not the committed one of (a wrong
round) it leaves to the committers.
"""

from __future__ import annotations

import logging
import threading

from ledger.availability import STAGE_LEAF, availability_answer, stage_leaf_answer
from ledger.errors import LedgerError
from node.errors import DLX_ERRORS
from node.fraudproof import parse_stage_leaf
from node.live.fraud.chunkstate import ChunkedStates
from node.live.chain.onchain import NodeChain
from node.live.fraud.prover import FraudProver

logger = logging.getLogger(__name__)

#: How often the run's new challenges are read from the chain.
ANSWER_EVERY_S = 5.0


class ChallengeAnswerer:
    """Watches a chunked run's availability challenges and answers those it can (module docstring)."""

    def __init__(self, *, run_id: int, chain: NodeChain, states: ChunkedStates, prover: FraudProver,
                 stop: threading.Event) -> None:
        self.run_id = run_id
        self.chain = chain
        self.states = states
        self.prover = prover
        self.stop = stop
        self.answered: dict[bytes, str] = {}  # challenge id -> what was done (answered, or why not)
        self._from_block = 0

    def run(self) -> None:
        """Poll until the node stops (a thread of its own)."""
        while not self.stop.wait(ANSWER_EVERY_S):
            self.poll()

    def poll(self) -> None:
        """Read the run's new challenges and answer each one this node can; nothing here raises."""
        try:
            challenges, head = self.chain.availability_challenges(self.run_id, self._from_block)
        except DLX_ERRORS as exc:
            logger.debug("availability challenges not read: %s", exc)
            return
        self._from_block = head + 1
        for challenge in challenges:
            challenge_id = bytes(challenge["id"])
            if challenge_id in self.answered:
                continue
            try:
                self.answered[challenge_id] = self._answer(challenge_id, challenge)
            except (*DLX_ERRORS, LedgerError, IndexError) as exc:  # IndexError: a leaf this state has not
                self.answered[challenge_id] = f"not answered: {type(exc).__name__}: {exc}"[:300]
            logger.warning("round %d stage %d: availability challenge %s: %s", challenge["round"],
                           challenge["stage"], challenge_id.hex()[:12], self.answered[challenge_id])

    def _answer(self, challenge_id: bytes, challenge: dict) -> str:
        outer_round, stage, which, chunk = (challenge["round"], challenge["stage"], challenge["which"],
                                            challenge["chunk"])
        record = self.chain.commit_of(self.run_id, outer_round)
        committed = self.prover.committed_leaves(outer_round, record) if record is not None else None
        if committed is None:
            return "not answered: the round's committed stage leaves are not known here"
        if which == STAGE_LEAF:
            leaves = [parse_stage_leaf(leaf, s) for s, leaf in enumerate(committed)]
            self.chain.answer_challenge(challenge_id, *stage_leaf_answer(leaves, stage))
            return "answered with the committed stage leaf"
        state = self.states.state(outer_round, stage)
        if state is None or state.leaf().encode() != committed[stage]:
            return "not answered: this node does not hold the committed state of the stage"
        self.chain.answer_challenge(challenge_id, *availability_answer(state, which, chunk))
        return f"answered with leaf {chunk} of tree {which}"
