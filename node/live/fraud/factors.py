"""The fraud prover's proofs from committed factors (node/live/fraud/prover.py): a chunked round's
factors opened from an attester or through a ``FACTORS`` challenge and proven wrong where they are not the
run's values or binding (issue 62, node/live/fraud/values.py), where they list a piece past the run's
``maxRank``, or (version 3) where a clip scale or a sum of squares is wrong (docs/FRAUD_PROOF.md, "The clip
scales"), or walked leaf by leaf where the sum trees are withheld; and the
round before each round, round 0's being the run's genesis (``RunParams.genesisRoot``).
"""

from __future__ import annotations

import logging

from ledger.availability import FACTORS, availability_target
from ledger.chunkproof import StageLeaf, StageState
from ledger.normproof import SCALES, scale_proof
from ledger.records import RoundRecord
from node.errors import DLX_ERRORS
from node.fraudproof import norm_proof_of_difference, parse_stage_leaf, wrong_sum_contribution
from node.live.fraud.values import CHUNK, RunValues, factors_fault, piece_past_rank, rank_proof, values_proof
from node.live.fraud.walks import SumWalk

logger = logging.getLogger("node.live.fraud.prover")

#: Parents remembered per round (a proof from factors published later needs its round's).
PARENTS_REMEMBERED = 8


class FactorProofs:
    """The committed factors half of :class:`node.live.fraud.prover.FraudProver` (module docstring); the
    prover holds the shared state (``chain``, ``states``, ``schedule``, ``_values``, ``_parents``,
    ``_foreign``, ``_genesis``, ``_factor_opens``) and the hooks (``_send``, ``_send_norm``, ``_unprovable``,
    ``_attesters_of``, ``_challenge_sums``, ``_open``, ``committed_leaves``)."""

    def run_values(self) -> RunValues:
        """The run's values on chain the committed factors are held to (read once)."""
        if self._values is None:
            from node.commitments.values import schedule_of

            info = self.chain.run_info(self.run_id)
            schedule = self.schedule
            cfg = getattr(self.states, "cfg", None)  # the run document's (None: a test's bare states)
            if schedule is None and cfg is not None and getattr(info, "schedule_rounds", 0):
                schedule = schedule_of(cfg.diloco, info.max_rounds)  # as node/live/parts/fraud.py's
            client = getattr(self.chain, "client", None)
            self._values = RunValues.of(info, schedule, chain_id=getattr(client, "chain_id", 0),
                                        ledger_address=getattr(client, "ledger_address", ""))
        return self._values


    def _parent(self, outer_round: int):
        """``(record of t - 1, its committed stage leaves, stage -> this node's state of t - 1)``; for round
        0 ``(None, the run's genesis stage leaves, their states)`` where the run binds a genesis root (issue
        62); None (logged) if they are not known here."""
        if outer_round == 0:
            genesis = self._genesis_states()
            if genesis is None:
                return None
            leaves = [state.leaf().encode() for state in genesis]
            self._parents[0] = (None, leaves)
            return None, leaves, lambda stage: genesis[stage]
        prev_record = self.chain.commit_of(self.run_id, outer_round - 1)
        prev_leaves = self.committed_leaves(outer_round - 1, prev_record) if prev_record is not None else None
        if prev_leaves is None:
            self._unprovable(outer_round,
                             f"round {outer_round - 1}'s committed stage leaves are not known here")
            return None
        self._parents[outer_round] = (prev_record, prev_leaves)
        for old in [r for r in self._parents if r < outer_round - PARENTS_REMEMBERED]:
            del self._parents[old]
        return prev_record, prev_leaves, lambda stage: self.states.state(outer_round - 1, stage)

    def _genesis_states(self) -> list[StageState] | None:
        """The run's stage states before round 0 (its document's model and seed), if the chain's genesis root
        is theirs; None (logged) otherwise."""
        from ledger.chunkproof import chunked_weights_root

        genesis_root = self.run_values().genesis_root
        if not any(genesis_root):
            self._unprovable(0, "the run binds no genesis root: round 0 has no committed start to recompute "
                                "from")
            return None
        if self._genesis is None:
            from node.commitments.values import genesis_states

            cfg = getattr(self.states, "cfg", None)
            if cfg is None:
                self._unprovable(0, "the run document is not known here: no genesis states")
                return None
            self._genesis = genesis_states(cfg)
        if chunked_weights_root([state.leaf() for state in self._genesis]) != genesis_root:
            self._unprovable(0, "the run's genesis root on chain is not this document's initial state")
            return None
        return self._genesis


    def _prove_norms(self, outer_round: int, stage: int, record: RoundRecord, leaves: list[bytes],
                     leaf: StageLeaf, own: StageState) -> bool:
        """A version-3 round whose factors differ from this node's: open the committed factors and sum trees
        from an attester of the leaf and prove a wrong clip scale or sum
        (node.fraudproof.norm_proof_of_difference)."""
        providers = self._attesters_of(outer_round, stage, leaves[stage])
        opened = self.states.committed_norms(outer_round, stage, leaf, providers)
        # nobody serves them: the committers must publish the factors on chain, or lose the round
        if opened is None:
            logger.error(
                "round %d stage %d: the committed factors are not this node's and no attester serves them; "
                "challenging their availability on chain", outer_round, stage)
            target = availability_target(record, [parse_stage_leaf(v, s) for s, v in enumerate(leaves)],
                                         own.factors, stage, FACTORS, 0)
            challenge_id = self.chain.challenge_availability(target)
            with self._lock:
                self._factor_opens[challenge_id] = (stage, record, leaves, leaf, own)
                self.log.wrong[outer_round] = f"stage {stage}: its committed factors differ from this node's"
            self._open(outer_round, challenge_id)
            return True
        factors, trees = opened
        return self._prove_norms_from(outer_round, stage, record, leaves, leaf, own, factors, trees)

    def _prove_norms_from(self, outer_round: int, stage: int, record: RoundRecord, leaves: list[bytes],
                          leaf: StageLeaf, own: StageState, factors, trees) -> bool:
        """Prove the committed ``factors`` (their bytes if they do not decode) wrong: against the run's
        values and binding, a listed piece past the rank, then (version 3) a wrong clip scale or sum from them
        and the sum ``trees`` (None: not had)."""
        providers = self._attesters_of(outer_round, stage, leaves[stage])
        # the factors held to the run's values and binding (issue 62): proven from the factors alone
        fault = factors_fault(self.run_values(), factors, outer_round, stage)
        encoded = factors if isinstance(factors, bytes) else factors.encode()
        if fault is not None and fault[0] == CHUNK:
            parent = self._parents.get(outer_round)
            if parent is None:
                self._unprovable(outer_round, f"stage {stage}: {fault[1]}, but round {outer_round - 1}'s "
                                              "committed stage leaves are no longer known here")
                return False
            self._send(outer_round, stage, values_proof(parent[0], record, parent[1], leaves, stage, encoded),
                       fault[1])
            return True
        if fault is not None:
            return self._send_norm(outer_round, stage, scale_proof(record, leaves, stage, encoded), fault[1])
        if self._prove_rank(outer_round, stage, record, leaves, leaf, factors):
            return True
        if not self.scheme.proves_factors:  # version 2: no norm commitment to hold the scales to
            self._unprovable(outer_round, f"stage {stage}: the committed factors keep the run's values; "
                                          "a version-2 round's clip scales and the set left out are not "
                                          "provable")
            return False
        if outer_round in self._foreign:
            return self._unbound_contributor(outer_round, stage, record, leaves, encoded,
                                             "the committed contributions are not the ones this node "
                                             "aggregated, and their factors keep the run's values and "
                                             "binding (a dispute's matter)")

        def committed_weights():
            fetched = self.states.committed_state(outer_round, stage, leaf, providers)
            return None if fetched is None else fetched[0]

        proof, why = norm_proof_of_difference(record, leaves, stage, factors, trees, own, committed_weights)
        if proof is None or proof.contribution != SCALES:
            # issue 79: the cheapest proof that holds. The scales' proof (the contract checks the count, the
            # clip, the steps, the binding and every listed seat from the factors alone, ~1.2M gas at 128
            # contributions) goes before a sum proof, a walk of availability challenges or "not provable"
            scales = self._scales_proof_holding(outer_round, stage, record, leaves, encoded)
            if scales is not None:  # none found here: what only the chain sees, a listed account's seat
                return self._send_norm(outer_round, stage, scales, (
                    "factors list a contributor that held no seat in the round" if proof is None else
                    f"factors break a rule the contract checks from them alone (the scales' proof holds, "
                    f"cheaper than the one found here: {why})"))
        if proof is None and trees is None and (found := wrong_sum_contribution(factors, own)) is not None:
            walk = SumWalk(outer_round, stage, record, list(leaves), factors, own, *found)
            logger.error("round %d stage %d: contribution %d's committed sum tree is not this "
                         "node's and nobody serves "
                         "it; opening it leaf by leaf through availability challenges", outer_round, stage,
                         found[0])
            self._found_wrong(outer_round, f"stage {stage}: a committed sum tree differs from this node's")
            self._challenge_sums(walk)
            return True
        if proof is None:  # and the scales' proof does not hold either (tried above)
            self._unprovable(outer_round, f"stage {stage}: {why}")
            return False
        return self._send_norm(outer_round, stage, proof, why)

    def _prove_rank(self, outer_round: int, stage: int, record: RoundRecord, leaves: list[bytes],
                    leaf: StageLeaf, factors) -> bool:
        """Committed ``factors`` (decoded) that list a contribution this node closed and whose piece the
        contract's decoder refuses (a rank past the run's ``maxRank``: node/live/fraud/values.py,
        :func:`piece_past_rank`; an honest node left it out, undecodable): the chunk proof of that chunk, from
        the committed state an attester serves. False (logged where it applies) if none is listed, or the
        proof's inputs are not had here."""
        if isinstance(factors, bytes):
            return False
        max_rank = self.run_values().max_rank
        held = [self.states.pieces_of(outer_round, stage, root) for root in factors.payload_roots]
        past = [None if pieces is None else piece_past_rank(pieces, max_rank) for pieces in held]
        found = next(((j, chunk) for j, chunk in enumerate(past) if chunk is not None), None)
        if found is None:
            return False
        j, chunk = found
        why = (f"factors list contribution {j}, whose piece of chunk {chunk} has a rank past the run's "
               f"maxRank {max_rank}")
        parent = self._parents.get(outer_round)
        prev = (self._genesis or [None] * (stage + 1))[stage] if outer_round == 0 \
            else self.states.state(outer_round - 1, stage)
        committed = self.states.committed_state(outer_round, stage, leaf,
                                                self._attesters_of(outer_round, stage, leaves[stage]))
        missing = ("round t - 1's committed stage leaves" if parent is None
                   else "this node's state of round t - 1" if prev is None
                   or prev.leaf().encode() != parent[1][stage]
                   else "the committed state (its attesters withhold it)" if committed is None
                   else f"contribution {held[:j].index(None)}'s pieces" if None in held[:j] else None)
        if missing is not None:
            self._unprovable(outer_round, f"stage {stage}: {why}, but not had here: {missing}")
            return False
        proof = rank_proof(parent[0], record, parent[1], leaves, prev, committed, factors, held, chunk,
                           self.run_values().schedule)
        self._send(outer_round, stage, proof, why)
        return True

    def _scales_proof_holding(self, outer_round: int, stage: int, record: RoundRecord, leaves: list[bytes],
                              factors: bytes):
        """The scales' proof of the committed ``factors`` (bytes) if the contract's view (``isWrongNorm``)
        says it holds now, else None (logged where the view refuses it)."""
        proof = scale_proof(record, leaves, stage, factors)
        try:
            holds = self.chain.norm_proof_holds(proof)
        except DLX_ERRORS as exc:
            holds = False
            logger.info("round %d stage %d: the scales' proof does not check: %s", outer_round, stage, exc)
        return proof if holds else None

    def _unbound_contributor(self, outer_round: int, stage: int, record: RoundRecord, leaves: list[bytes],
                             factors: bytes, why_not: str) -> bool:
        """Committed contributions other than this node's, whose factors keep the run's values and whose
        signatures recover, or factors no other proof applies to: a listed account that held no seat in the
        round is seen only on chain (the binding's ``memberOf``), so the scales' proof is sent if the
        contract's view holds it; else the round is logged unprovable (``why_not``)."""
        proof = self._scales_proof_holding(outer_round, stage, record, leaves, factors)
        if proof is not None:
            return self._send_norm(outer_round, stage, proof,
                                   "factors list a contributor that held no seat in the round")
        self._unprovable(outer_round, why_not)
        return False

