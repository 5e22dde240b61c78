"""Every node checks each committed round of a chunked run and proves a wrong one on chain itself (issue 43).

The committer hands each round it read back from the chain to :meth:`FraudProver.check`. In a chunked run
(docs/FRAUD_PROOF.md) the record's weights root is the Merkle root over one stage leaf per stage; where the
committed root is not the one this node derived from the same contributions, for each stage it holds whose
committed leaf differs from its own, the node

1. takes the committed stage leaves from the attestations it heard (the combination whose root is the
   record's), and round t - 1's the same way (it must hold its own state of t - 1 equal to the committed
   one: a proof recomputes chunk i of round t from round t - 1's committed chunk);
2. fetches the committed state from an attester of the committed leaf (node/live/fraud/chunkstate.py: the
   state served under the leaf, checked against the leaf's roots), finds the first chunk that differs from its
   own and sends ``proveWrongAggregation`` (node.fraudproof.proof_of_difference): any account may, no stake
   needed. The chain then invalidates the round and every later one, slashes every attester and pays
   this node half of the slash;
3. if no attester serves the committed state (withheld), challenges the committers on chain to publish its
   first chunk of the tree that differs (``challengeAvailability``, the run's bond) and, once the answer
   window has passed unanswered, settles the challenge (``expireChallenge``): the round is then invalidated
   the same way. If they answer, the answer's leaf and path (read from its transaction) say which subtree of
   the committed tree differs from this node's: it challenges the first leaf of that subtree next (a
   bisection,
   :class:`Walk`), until a published leaf differs, then opens that chunk's other tree where its root differs
   too, and proves the chunk from the published leaves as in 2. If no
   attested stage leaves give the committed root at all (a back door: a root with nothing behind it), it
   challenges them to publish a stage leaf itself (``STAGE_LEAF``), which nobody can answer for a back door.
   Right rounds' challenges are answered by every node (node/live/fraud/answerer.py). The challenges and
   their walks are node/live/fraud/challenges.py's and node/live/fraud/walks.py's.

In a run whose scheme proves its factors (version 3, ``"normed"``: node/commitments/normed.py) committed
factors other than its own are opened from an attester of the leaf (the factors and sum trees it serves), or,
when none serves them, from an availability challenge of the factors (``FACTORS``: the committers publish them
on chain or lose the round), and a wrong clip scale or sum of squares, or factors of another version than the
run's (``RunParams.commitments``), is proven with ``proveWrongNorm`` (docs/FRAUD_PROOF.md, "The clip scales",
"The run's version"). Where the committed sum trees are withheld too, a contribution whose committed tree or
total is not this node's is walked leaf by leaf (:class:`SumWalk`): each answered sum-tree leaf's path (its
siblings' hashes and sums) says which subtree holds a lied sum, or its total already differs from the
committed one; the lied leaf, once opened, with the round's committed weights leaf of that chunk (this node's
own where the weights root is, else fetched or challenged too), is a sum proof.

Committed factors the run does not allow (issue 62: another lr, mu or Nesterov flag than the run's values on
chain, another clip, steps past H, too many contributions, an unbound one) are proven from the factors alone
(node/live/fraud/factors.py, node/live/fraud/values.py), also where the committed contributions are not this
node's, and in a version-2 run too (its factors are opened the same way); a listed piece past the run's
``maxRank`` by the chunk proof of its chunk; round 0 from the run's genesis states. A node never signs a
round's record on top of a round it holds wrong (:meth:`FraudProver.refuses_to_sign`, asked by the committer).

What it cannot prove it says in the log and leaves to the dispute (node/live/record/forkrepair.py): a round
whose contributions root differs and whose factors keep the run's values and binding, committed factors other
than its own that keep the run's values in a version-2 run (another clip scale or set left out:
docs/FRAUD_PROOF.md, "Known gaps"), or
in a version-3 run when the scales follow from right sums and only the set left out differs, a round whose
previous state this node no longer holds. Nothing here raises out of :meth:`check`: a bad or missing input
costs only the proof.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ledger.availability import MOMENTUM, WEIGHTS
from ledger.chunkproof import StageState
from ledger.errors import LedgerRunHalted, ProverParentOpen
from ledger.normproof import NormProof
from ledger.records import RoundRecord
from node.errors import DLX_ERRORS
from node.fsutil import atomic_write_bytes
from node.fraudproof import parse_stage_leaf, proof_of_difference
from node.live.chain.onchain import NodeChain
from node.live.fraud.challenges import AvailabilityChallenges
from node.live.fraud.chunkstate import ChunkedStates
from node.live.fraud.factors import FactorProofs
from node.live.fraud.kept_games import KEPT_DEPTH
from node.live.fraud.values import RunValues
from node.live.fraud.walks import SumWalk, Walk
from node.live.state.roundbook import RoundBook
from training.jsonbound import loads_bounded

logger = logging.getLogger(__name__)

#: Combinations of attested stage leaves tried to find the committed ones (as node/live/record/forkrepair.py).
MAX_COMBINATIONS = 256
#: Committed stage leaves remembered per round (round t's proof needs round t - 1's).
ROUNDS_REMEMBERED = 8
#: Where a node keeps the proofs it sent, under its data dir (``audit --archive`` reads them).
PROOFS_DIR = "proofs"


@dataclass
class ProverLog:
    """What the prover did, for the node's status and the tests: one line per action, by round."""

    proofs: dict[int, str] = field(default_factory=dict)  # round -> tx hash or receipt of the proof sent
    challenges: dict[int, bytes] = field(default_factory=dict)  # round -> challenge id
    expired: dict[int, bytes] = field(default_factory=dict)  # round -> challenge id settled unanswered
    unprovable: dict[int, str] = field(default_factory=dict)  # round -> why no proof applies
    # round -> why this node holds it wrong: a proof built (sent, or waiting for its parent's window) or a
    # walk of its withheld state or factors begun; dropped if the proof or walk fails (this node was mistaken)
    wrong: dict[int, str] = field(default_factory=dict)


class FraudProver(FactorProofs, AvailabilityChallenges):
    """Checks committed rounds of a chunked run and proves wrong ones (module docstring)."""

    def __init__(self, *, run_id: int, chain: NodeChain, book: RoundBook, states: ChunkedStates, stages,
                 num_stages: int, stop: threading.Event, proofs_dir: Path | None = None,
                 schedule=None, values: RunValues | None = None,
                 genesis: list[StageState] | None = None) -> None:
        self.run_id = run_id
        self._values = values  # the run's values on chain (issue 62); None: read from the chain when needed
        # the run's committed outer schedule (ledger.runvalues.Schedule; issue 62): every chunk proof carries
        # its leaf of the round; None: a run created without one
        self.schedule = schedule
        self.chain = chain
        self.book = book
        self.states = states
        self.scheme = states.scheme  # the run's commitments (node/commitments/): what can be proven
        self.stages = stages  # callable: the stages this node holds
        self.num_stages = num_stages
        self.stop = stop
        self.proofs_dir = proofs_dir  # where each proof sent is kept (PROOFS_DIR of the node's data dir)
        self.log = ProverLog()
        self._committed: dict[int, list[bytes]] = {}  # round -> committed stage leaves
        self._pending: dict[bytes, int] = {}  # challenge id -> round
        self._walks: dict[bytes, Walk | SumWalk] = {}  # challenge id -> the walk it opens a leaf of
        # challenge id of a stage's factors -> (stage, record,
        # committed stage leaves, its leaf, this node's state)
        self._factor_opens: dict[bytes, tuple] = {}
        self._lock = threading.Lock()
        # One settlement at a time (the expirer's thread, check() and a caller): a call returns after every
        # challenge found settled has been followed, also one another thread took first.
        self._settling = threading.RLock()
        self._expirer: threading.Thread | None = None
        # round -> (stage, proof, attesters, why): proofs waiting for their parent round's window to close
        self._deferred: dict[int, tuple] = {}
        self._opens_at: dict[int, int] = {}  # round -> the block its deferred proof is taken from (closesAt)
        # round -> (record of t - 1 or None for round 0, its committed stage leaves encoded): a values proof's
        self._parents: dict[int, tuple] = {}
        self._foreign: set[int] = set()  # rounds whose committed contributions are not this node's
        # the run's states before round 0 (its genesisRoot; None: derived from the run document when needed)
        self._genesis: list[StageState] | None = genesis
        self._resume_kept()
        self._resume_games()  # the factors challenges an earlier life left open (kept_games.py)

    def _resume_kept(self) -> None:
        """Send again the proofs an earlier life of this node kept (a node that re-enters or restarts while a
        proof waits for its parent's window must not lose it, nor sign on top of the round): each is deferred
        to the settlement loop, which sends it (a round already overturned is refused and logged)."""
        from ledger.chunkproof import AggregationProof
        from ledger.errors import LedgerInputError

        if self.proofs_dir is None or not self.proofs_dir.is_dir():
            return
        for path in sorted(self.proofs_dir.glob("round-*-stage*.json")):
            try:
                document = loads_bounded(path.read_bytes(), KEPT_DEPTH)
                kind = NormProof if document["proof"].get("kind") == "norm" else AggregationProof
                proof = kind.from_json(document["proof"])
                attesters = [str(a) for a in document.get("attesters", [])]
            except (OSError, ValueError, KeyError, TypeError, AttributeError, LedgerInputError) as exc:
                logger.warning("a kept proof %s is not read: %s", path.name, exc)
                continue
            outer_round = int(proof.record[1])
            self._deferred[outer_round] = (proof.stage, proof, attesters, "a proof kept by an earlier life")
            self.log.wrong[outer_round] = f"stage {proof.stage}: a proof was kept"
        if self._deferred:
            self._ensure_settling()

    # -- signing on top ------------------------------------------------------------------------
    def refuses_to_sign(self, outer_round: int) -> str | None:
        """Why this node must not sign round ``outer_round``'s record (None: it may): an earlier round it
        holds wrong, or one overturned on chain (issue 62: an honest node never signs on top of a wrong round;
        the committer asks before each signature, node/live/record/quorumcommit.py). Rounds are checked in
        order, so round t's proof is built, and sent or kept waiting for its parent's window, before t + 1
        is signed."""
        with self._lock:
            wrong = sorted((t, why) for t, why in self.log.wrong.items() if t < outer_round)
        if wrong:
            t, why = wrong[0]
            return f"round {t} is wrong ({why})"
        invalid = self.chain.invalid_from(self.run_id)
        if invalid is not None and invalid < outer_round:
            return f"round {invalid} and every later one were overturned on chain"
        return None

    def _found_wrong(self, outer_round: int, why: str) -> None:
        with self._lock:
            self.log.wrong[outer_round] = why

    # -- the committed leaves --------------------------------------------------------------
    def committed_leaves(self, outer_round: int, record: RoundRecord) -> list[bytes] | None:
        """The stage leaves whose root is ``record``'s weights root, among those attested here (None:
        none)."""
        if outer_round in self._committed:
            return self._committed[outer_round]
        options = []
        for stage in range(self.num_stages):
            heard = self.book.snapshot_attestations(outer_round, stage).values()
            options.append(sorted({leaf for att in heard if (leaf := self.scheme.attested_leaf(att, stage))}))
        for combination in itertools.islice(itertools.product(*options), MAX_COMBINATIONS):
            if self.scheme.weights_root([], list(combination)) == record.weights_root:
                self._remember(outer_round, list(combination))
                return list(combination)
        return None

    def _remember(self, outer_round: int, leaves: list[bytes]) -> None:
        self._committed[outer_round] = leaves
        for old in [r for r in self._committed if r < outer_round - ROUNDS_REMEMBERED]:
            del self._committed[old]

    def _attesters_of(self, outer_round: int, stage: int, leaf: bytes) -> list[str]:
        return sorted(peer for peer, att in self.book.snapshot_attestations(outer_round, stage).items()
                      if att.stage_leaf == leaf)

    # -- one committed round ------------------------------------------------------------------
    def check(self, outer_round: int, onchain: RoundRecord, mine: RoundRecord | None) -> None:
        """Check committed round ``outer_round`` against this node's record ``mine``; prove it wrong if it
        is."""
        try:
            self._check(outer_round, onchain, mine)
        except DLX_ERRORS as exc:
            self._unprovable(outer_round, f"the proof failed: {type(exc).__name__}: {exc}")
        self.settle_challenges()

    def _check(self, outer_round: int, onchain: RoundRecord, mine: RoundRecord | None) -> None:
        committed = self.committed_leaves(outer_round, onchain)
        if mine is None or onchain.weights_root == mine.weights_root:
            return
        with self._lock:  # after a round held wrong here: a proof of this one waits for it, and falls with it
            earlier = min((t for t in self.log.wrong if t < outer_round), default=None)
        if earlier is not None:
            self._unprovable(outer_round, f"round {earlier} is held wrong here (its proof comes first)")
            return
        same_inputs = onchain.contributions_root == mine.contributions_root
        why_foreign = ("the committed contributions are not the ones this node aggregated (a dispute's "
                       "matter, not a chunk's)")
        # a back door, or leaves nobody attested to this node: make them show the leaves
        if committed is None:
            if not same_inputs:
                self._unprovable(outer_round, why_foreign)
                return
            self._unprovable(outer_round,
                             "no attested stage leaves heard here give the committed weights root")
            self._challenge_stage_leaf(outer_round, onchain)
            return
        invalid = self.chain.invalid_from(self.run_id)
        if invalid is not None and invalid <= outer_round:
            self._unprovable(outer_round,
                             f"already invalid on chain: round {invalid} and every later one were "
                                          "overturned")
            return
        if outer_round in self.log.wrong:  # already proven or played here (a kept proof, a resumed game)
            return
        parent = self._parent(outer_round)
        if parent is None:
            return
        prev_record, prev_leaves, prev_state = parent
        if not same_inputs:
            # other contributions: only what the factors alone show (the run's values, the binding) is proven
            self._foreign.add(outer_round)
        for stage in self.stages():
            own = self.states.state(outer_round, stage)
            if own is None or own.leaf().encode() == committed[stage]:
                continue
            if not same_inputs:
                leaf = parse_stage_leaf(committed[stage], stage)
                if leaf.factors_hash != own.factors.digest():
                    if self._prove_norms(outer_round, stage, onchain, committed, leaf, own):
                        return
                else:
                    self._unprovable(outer_round, why_foreign)
                continue
            prev = prev_state(stage)
            if prev is None or prev.leaf().encode() != prev_leaves[stage]:
                self._unprovable(outer_round,
                                 f"stage {stage}: this node does not hold round {outer_round - 1}'s "
                                              "committed state")
                continue
            if self._prove_stage(outer_round, stage, onchain, prev_record, prev_leaves, committed, prev, own):
                return  # one proof invalidates the round (and every later one)

    def _prove_stage(self, outer_round: int, stage: int, record: RoundRecord, prev_record: RoundRecord,
                     prev_leaves: list[bytes], leaves: list[bytes], prev: StageState,
                     own: StageState) -> bool:
        leaf = parse_stage_leaf(leaves[stage], stage)
        if leaf.factors_hash != own.factors.digest():  # the factors held to the run (version 3: the scales)
            return self._prove_norms(outer_round, stage, record, leaves, leaf, own)
        prev_stages = [parse_stage_leaf(v, s) for s, v in enumerate(prev_leaves)]
        stages = [parse_stage_leaf(v, s) for s, v in enumerate(leaves)]
        fetched = self.states.committed_state(outer_round, stage, leaf,
                                              self._attesters_of(outer_round, stage, leaves[stage]))
        if fetched is None:
            own_leaf = own.leaf()
            which = WEIGHTS if leaf.weights_root != own_leaf.weights_root else MOMENTUM
            walk = Walk(outer_round, stage, record, prev_record, prev_stages, stages, prev, own, which, 0)
            logger.error(
                "round %d stage %d: the committed state is withheld by its attesters; challenging its "
                "availability on chain", outer_round, stage)
            self._found_wrong(outer_round, f"stage {stage}: its committed state differs from this node's")
            self._challenge(walk)
            return True
        committed = StageState(stage, fetched[0], fetched[1], own.factors, own.payload_leaves)
        proof, why = proof_of_difference(prev_record, record, prev_stages, stages, prev, own, committed)
        if proof is None:
            self._unprovable(outer_round, f"stage {stage}: {why}")
            return False
        self._send(outer_round, stage, proof, why)
        return True

    def _send_norm(self, outer_round: int, stage: int, proof, why: str) -> bool:
        attesters = self.chain.attesters_of(self.run_id, outer_round)
        logger.error("round %d stage %d: the committed %s; sending the norm proof", outer_round, stage, why)
        self._keep(outer_round, stage, proof, attesters)
        self._deliver(outer_round, stage, proof, attesters, why)
        return True

    def _send(self, outer_round: int, stage: int, proof, why: str) -> None:
        schedule = self.schedule if self.schedule is not None else self.run_values().schedule
        if schedule is not None:
            leaf, path = schedule.opening(outer_round)
            proof = dataclasses.replace(proof, schedule_leaf=leaf, schedule_path=path)
        attesters = self.chain.attesters_of(self.run_id, outer_round)
        wrong = why if why.startswith("factors") else f"the committed weights root is wrong at {why}"
        logger.error("round %d stage %d: %s; sending the fraud proof", outer_round, stage, wrong)
        self._keep(outer_round, stage, proof, attesters)
        self._deliver(outer_round, stage, proof, attesters, why)

    def _deliver(self, outer_round: int, stage: int, proof, attesters, why: str) -> None:
        """Commit to the proof, then send it (the client's commit-reveal: a copy sent by a front-runner is not
        paid, issue 62). While round t - 1 can still be overturned the chain refuses it (ProverParentOpen): it
        is kept and sent again by the settlement loop once the parent's window closed. Beaten to it by a copy
        (LedgerRunHalted with a reward held for the round), this node's earlier commitment claims the
        reward."""
        norm = isinstance(proof, NormProof)
        send = self.chain.prove_wrong_norm if norm else self.chain.prove_wrong_aggregation
        try:
            receipt = send(proof, attesters)
        except ProverParentOpen as exc:
            logger.warning("round %d: the proof waits for round %d's window to close (block %s)", outer_round,
                           outer_round - 1, exc.values.get("closesAt"))
            self._defer(outer_round, (stage, proof, attesters, why), exc.values.get("closesAt"))
            return
        except LedgerRunHalted:
            receipt = self.chain.claim_held_reward(self.run_id, outer_round)
            if receipt is None:
                raise
            logger.error("round %d: another sent this node's proof first; its held reward was claimed",
                         outer_round)
        self.log.proofs[outer_round] = str(_tx_of(receipt))
        logger.error(
            "round %d: proven wrong on chain (stage %d, %s; tx %s): the round and every later one are "
            "invalid, its %d attester(s) slashed", outer_round, stage, why, self.log.proofs[outer_round],
            len(attesters or ()))
        self.chain.reclaim_game_bonds(self.run_id, outer_round, stage)  # the walk's answered steps' bonds

    def _send_deferred(self) -> None:
        """Send again the proofs that waited for their parent round's window (the settlement loop's)."""
        with self._lock:
            deferred = dict(self._deferred)
            self._deferred.clear()
        for outer_round, (stage, proof, attesters, why) in deferred.items():
            try:
                self._deliver(outer_round, stage, proof, attesters, why)
            except DLX_ERRORS as exc:
                self._unprovable(outer_round, f"the proof failed: {type(exc).__name__}: {exc}"[:300])

    def _keep(self, outer_round: int, stage: int, proof, attesters) -> None:
        """Keep the proof in the node's evidence (``audit --archive`` shows it and checks it on chain)."""
        self._found_wrong(outer_round, f"stage {stage}: a proof was built")
        if self.proofs_dir is None:
            return
        document = {"proof": proof.to_json(), "attesters": list(attesters or ())}
        try:
            atomic_write_bytes(self.proofs_dir / f"round-{outer_round:08d}-stage{stage}.json",
                               json.dumps(document, sort_keys=True).encode())
        except OSError as exc:
            logger.warning("round %d: the fraud proof was not kept on disk: %s", outer_round, exc)

    def _unprovable(self, outer_round: int, why: str) -> None:
        with self._lock:
            self.log.wrong.pop(outer_round, None)
        if self.log.unprovable.get(outer_round) != why:
            logger.warning(
                "round %d: the committed weights root differs from this node's; no fraud proof: %s",
                outer_round, why)
        self.log.unprovable[outer_round] = why


def _tx_of(receipt) -> str:
    try:
        return "0x" + bytes(receipt["transactionHash"]).hex()
    except (TypeError, KeyError, ValueError):
        return str(receipt)[:80]
