"""The live prover walks a withheld sum tree (issue 43; docs/FRAUD_PROOF.md, "Known gaps" 2 (iii)), in
process: real libp2p hosts, a real EVM (py-evm), the node's own prover (node/live/fraud/prover.py) and
answerer (node/live/fraud/answerer.py).

In a version-3 run the colluding quorum (members 1 and 2) lies about a contribution's sum of squares and
serves neither its state nor its factors and sum trees. The honest non-quorum node (member 3) challenges the
factors (``FACTORS``), then the lied contribution's sum tree leaf by leaf (``which = 2 + M + j``): each
answer's path carries its siblings' sums and halves where the lied leaf can be, until the colluders must
publish the lied leaf itself, which (with the round's weights leaf of that chunk, challenged too where the
weights differ) is a sum proof. Answered or not, the round falls; an honest quorum that answers every
challenge of a right round keeps its stake.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time

from tests.fraud_live_fixtures import (COLLUDERS, PROVER, SHAPES, STAKE, _normed_world, _record, _setup,
                                       _states, colluders_answerer)

from ledger.availability import FACTORS, availability_answer, sums_which
from ledger.normproof import SCALES, NormProof, SumTree, clip_scales
from node.live.fraud.answerer import ChallengeAnswerer
from node.live.fraud.chunkstate import ChunkedStates
from node.live.fraud.prover import FraudProver
from ledger.chain import connect_pyevm
from tests.fraud_fixtures import bound, contribution, lied_sum
from tests.ledger_fixtures import deploy, mine
from training.chunks import float64_bits

BLOBS = [contribution(SHAPES, "lowrank", 30, rank=4), contribution(SHAPES, "quant", 31),
         contribution(SHAPES, "raw", 32, scale=0.5)]
LIED = 1  # the contribution whose sum the colluders lie about
CHUNK = 13  # of its 22 chunks: the walk must go down the tree to it
#: The lie, in units of 2**-298: far below the half ulp of the contribution's total as a double (about 2**236
#: here), so the scales stay the rule's and only a sum proof can show it.
LIE = 1 << 200


class WithholdingAll(ChunkedStates):
    """A committer that serves nothing it committed: neither its state nor its factors and sum trees."""

    def publish(self, outer_round, stage, leaf, weights, momentum) -> None:
        return None

    def publish_part(self, outer_round, stage, alias, blob) -> None:
        return None


def _walk(prover: FraudProver, answerer: ChallengeAnswerer | None, done) -> None:
    """Let the answerer answer and the prover follow until ``done()`` (a generous bound: a loaded machine)."""
    deadline = time.monotonic() + 300
    while not done() and time.monotonic() < deadline:
        if answerer is not None:
            answerer.poll()
        prover.settle_challenges()
        prover.stop.wait(0.2)


def _colluding(world, tmp_path, committed_state_of, honest_state_of=lambda state: state):
    """Rounds 0 and 1 on chain, round 1 committed by the colluders as ``committed_state_of(their state)``; the
    prover's own state ``honest_state_of(its state)``. Returns (deployment, run, records, prover, answerer,
    mine record, the colluders' states)."""
    colluder_host, prover_host = world.hosts
    honest = _states(world, prover_host)
    colluders = _states(world, colluder_host, WithholdingAll)
    _record(world, honest, world.aggregation.new_global)
    honest.replace(1, 0, honest_state_of(honest.state(1, 0)))
    own_leaf = honest.state(1, 0).leaf().encode()
    committed_state_of(colluders)
    wrong_leaf = colluders.state(1, 0).leaf().encode()
    prover_host.connect(colluder_host.listen_addrs[0])
    deployment, run, records, prover, mine_record = _setup(world, tmp_path, honest, wrong_leaf, own_leaf,
                                                           colluder_host.peer_id)
    answerer = colluders_answerer(world, deployment, run.run_id, prover, colluders)
    prover.check(0, records[0], records[0])
    return deployment, run, records, prover, answerer, mine_record, colluders


def _lie_about_one_leaf(world):
    def commit(colluders):
        _record(world, colluders, world.aggregation.new_global)
        colluders.replace(1, 0, _rebound(lied_sum(colluders.state(1, 0), LIED, CHUNK, -LIE)))
    return commit


def _rebound(state):
    """``state`` whose contributions are signed again over the roots it lists (issue 62): the contribution
    the colluders lie about is member LIED + 1's, a colluder's, which signs the lied sum-tree root; the others
    sign the same claims as before. (A lie about an honest member's contribution breaks its binding instead, a
    cheaper proof: test_an_unclipped_scale_of_an_honest_members_contribution_breaks_its_binding.)"""
    assert LIED + 1 in COLLUDERS
    probe = deploy(connect_pyevm(), min_stake=STAKE)  # the ledger of every fresh deployment (_bindings')
    return bound(state, [probe.client(j + 1) for j in range(len(BLOBS))], 1, 1)


def _assert_overturned(deployment, run) -> None:
    client = deployment.client(PROVER)
    assert client.invalid_from(run.run_id) == 1
    for index in COLLUDERS:
        assert client.member(run.run_id, deployment.client(index).address).status == "slashed"
    assert client.member(run.run_id, client.address).status == "active"


def test_a_withheld_sum_tree_answered_leaf_by_leaf_is_proven(tmp_path, caplog):
    """The colluders lie low about one chunk's sum (a tree and total consistent with it, the scales the
    rule's) and serve nothing: the honest node gets the factors, walks the tree down to the lied chunk and
    proves it."""
    with _normed_world(tmp_path, BLOBS) as (world, _chunked, _colluded):
        deployment, run, records, prover, answerer, mine_record, colluders = _colluding(
            world, tmp_path, _lie_about_one_leaf(world))
        committed = colluders.state(1, 0)
        own = prover.states.state(1, 0)
        assert committed.factors.scale_bits == own.factors.scale_bits  # no proof of the scales holds
        assert committed.leaf().weights_root == own.leaf().weights_root  # nor any chunk proof
        with caplog.at_level("ERROR", logger="node.live.fraud.prover"):
            prover.check(1, records[1], mine_record)
            assert set(prover.log.challenges) == {1} and not prover.log.proofs
            _walk(prover, answerer, lambda: prover.log.proofs or prover.log.unprovable)
        assert set(prover.log.proofs) == {1}, prover.log.unprovable
        assert "committed sum tree is not this node's and nobody serves it" in caplog.text
        which = sums_which(3, LIED)
        answered = sorted(answerer.answered.values())
        chunks = len(own.weight_leaves)
        assert all(a.startswith("answered") for a in answered), answered
        assert f"answered with leaf 0 of tree {FACTORS}" in answered
        assert f"answered with leaf {CHUNK} of tree {which}" in answered  # the lied leaf itself was published
        # A bisection, not a scan: leaf 0's path shows the subtree
        # of leaves 8-15 differs, leaf 8's that of 12-13, ...
        sums_opened = {a for a in answered if a.endswith(f"of tree {which}")}
        assert chunks == 22 and sums_opened == {f"answered with leaf {c} of tree {which}"
                                                    for c in (0, 8, 12, 13)}
        # the weights are this node's: not challenged
        assert not any(a.endswith("of tree 0") for a in answered)
        kept = NormProof.from_json(
            json.loads((tmp_path / "proofs" / "round-00000001-stage0.json").read_text())["proof"])
        assert (kept.contribution, kept.chunk) == (LIED, CHUNK)
        _assert_overturned(deployment, run)
        assert not prover.log.expired and not prover.settle_challenges()


def test_an_unclipped_scale_of_an_honest_members_contribution_breaks_its_binding(tmp_path, caplog):
    """The colluders aggregate the raw contribution unclipped (scale 1.0), and to keep the scales the rule's
    they commit, for it, the sums of a small contribution: every leaf lies, and the weights differ from the
    honest node's. The raw contribution is member 3's, the honest one's (issue 62): its signature is over its
    true sum-tree root, so the published factors alone prove the round (the scales' proof, the binding), with
    no walk of the lied tree (before the binding, the walk opened its first leaf and that chunk's weights
    leaf)."""
    with _normed_world(tmp_path, BLOBS) as (world, _chunked, colluded):
        loose = dataclasses.replace(world.cfg, diloco=dataclasses.replace(world.cfg.diloco, norm_clip=0.0))

        def commit(colluders):
            envelopes = [hashlib.sha256(b"envelope" + blob).digest() for blob in BLOBS]
            colluders.cfg = loose
            colluders.record(1, 0, colluded.new_global, colluded.new_momentum, colluded.contributions, BLOBS,
                             envelopes, world.bindings)
            state = colluders.state(1, 0)
            larger = max((0, 1), key=lambda j: state.sum_trees[j].total)  # the median of the rule's norms
            # its sums, said of contribution 2: the rule clips none
            small = SumTree.of(state.sum_trees[larger].sums)
            norms = state.factors.norms
            norms = dataclasses.replace(norms, clip_bits=float64_bits(world.cfg.diloco.norm_clip),
                                        roots=(*norms.roots[:2], small.root),
                                        sums=(*norms.sums[:2], small.total))
            colluders.replace(1, 0, dataclasses.replace(state, factors=dataclasses.replace(state.factors,
                                                                                           norms=norms),
                                                        sum_trees=[*state.sum_trees[:2], small]))

        deployment, run, records, prover, answerer, mine_record, colluders = _colluding(world, tmp_path,
                                                                                        commit)
        assert world.aggregation.contributions[2].scale < 1.0 and colluded.contributions[2].scale == 1.0
        committed = colluders.state(1, 0).factors
        assert committed.scale_bits == (float64_bits(1.0),) * 3
        # no proof of the scales
        assert clip_scales(committed.norms.sums, world.cfg.diloco.norm_clip) == [1.0] * 3
        with caplog.at_level("ERROR", logger="node.live.fraud.prover"):
            prover.check(1, records[1], mine_record)
            _walk(prover, answerer, lambda: prover.log.proofs or prover.log.unprovable)
        assert set(prover.log.proofs) == {1}, prover.log.unprovable
        assert "factors list contribution 2 with a signature not by its contributor" in caplog.text
        assert set(answerer.answered.values()) == {f"answered with leaf 0 of tree {FACTORS}"}  # no walk
        kept = NormProof.from_json(
            json.loads((tmp_path / "proofs" / "round-00000001-stage0.json").read_text())["proof"])
        assert kept.contribution == SCALES
        _assert_overturned(deployment, run)


def test_an_unanswered_sum_tree_leaf_overturns_the_round(tmp_path):
    """The colluders publish their factors (or lose the round) but not the sum-tree leaf the walk then asks
    for: past the answer window the honest node settles the challenge and the round falls."""
    with _normed_world(tmp_path, BLOBS) as (world, _chunked, _colluded):
        deployment, run, records, prover, _answerer, mine_record, colluders = _colluding(
            world, tmp_path, _lie_about_one_leaf(world))
        prover.check(1, records[1], mine_record)
        (factors_challenge,) = prover.log.challenges.values()
        deployment.client(1).answer_challenge(factors_challenge,
                                              *availability_answer(colluders.state(1, 0), FACTORS, 0))
        _walk(prover, None, lambda: prover.log.challenges[1] != factors_challenge)
        sums_challenge = prover.log.challenges[1]
        assert sums_challenge != factors_challenge and not prover.log.proofs and not prover.log.unprovable
        client = deployment.client(PROVER)
        assert client.challenge_of(sums_challenge)["sums"] and client.invalid_from(run.run_id) is None
        mine(deployment.w3, client.run_info(run.run_id).accusation_blocks)
        assert not prover.settle_challenges()
        assert prover.log.expired == {1: sums_challenge}
        _assert_overturned(deployment, run)


def test_an_honest_quorum_answering_a_mistaken_walk_keeps_its_stake(tmp_path):
    """A right round, its honest quorum serving nothing but answering every challenge from its state; the
    prover's own state is the one that is wrong (a sum leaf of its own tree off). Its walk reaches that chunk,
    the proof it sends is refused (ProverNormCorrect: the committed leaf is the squares of its piece), and the
    round stands: no one is slashed, no challenge expires."""
    with _normed_world(tmp_path, BLOBS) as (world, _chunked, _colluded):
        def commit(quorum):
            _record(world, quorum, world.aggregation.new_global)

        deployment, run, records, prover, answerer, mine_record, quorum = _colluding(
            world, tmp_path, commit, lambda state: lied_sum(state, LIED, CHUNK, LIE))
        prover.check(1, records[1], mine_record)
        _walk(prover, answerer, lambda: prover.log.proofs or prover.log.unprovable)
        assert not prover.log.proofs and "ProverNormCorrect" in prover.log.unprovable[1], \
            prover.log.unprovable
        answered = set(answerer.answered.values())
        assert f"answered with leaf {CHUNK} of tree {sums_which(3, LIED)}" in answered
        assert all(a.startswith("answered") for a in answered)
        client = deployment.client(PROVER)
        mine(deployment.w3, client.run_info(run.run_id).accusation_blocks)
        assert not prover.settle_challenges() and not prover.log.expired
        assert client.invalid_from(run.run_id) is None
        for index in COLLUDERS:
            assert client.member(run.run_id, deployment.client(index).address).status == "active"


def test_the_cheapest_proof_that_holds_is_sent_before_a_walk(tmp_path, caplog):
    """Issue 79 ("Also"): the colluders lie low about a contribution's sum, serve nothing, and list that
    contribution bound to an account that holds no seat in the run. Both a sum proof (after a walk of the
    tree through availability challenges) and the scales' proof (the seat, seen on chain only) hold: the
    node sends the cheapest, the scales' proof, once the factors are published, and walks nothing."""
    with _normed_world(tmp_path, BLOBS) as (world, _chunked, _colluded):
        def commit(colluders):
            _record(world, colluders, world.aggregation.new_global)
            probe = deploy(connect_pyevm(), min_stake=STAKE)  # the ledger of every fresh deployment
            signers = [probe.client(j + 1) for j in range(len(BLOBS))]
            signers[LIED] = probe.client(8)  # registered nowhere, no seat in the run
            colluders.replace(1, 0, bound(lied_sum(colluders.state(1, 0), LIED, CHUNK, -LIE), signers, 1, 1))

        deployment, run, records, prover, answerer, mine_record, colluders = _colluding(world, tmp_path,
                                                                                        commit)
        assert colluders.state(1, 0).factors.scale_bits == prover.states.state(1, 0).factors.scale_bits
        with caplog.at_level("ERROR", logger="node.live.fraud.prover"):
            prover.check(1, records[1], mine_record)
            _walk(prover, answerer, lambda: prover.log.proofs or prover.log.unprovable)
        assert set(prover.log.proofs) == {1}, prover.log.unprovable
        assert "factors list a contributor that held no seat in the round" in caplog.text, caplog.text
        assert set(answerer.answered.values()) == {f"answered with leaf 0 of tree {FACTORS}"}  # no walk
        kept = NormProof.from_json(
            json.loads((tmp_path / "proofs" / "round-00000001-stage0.json").read_text())["proof"])
        assert kept.contribution == SCALES
        _assert_overturned(deployment, run)
