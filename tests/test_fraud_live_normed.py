"""A version-3 (normed) run's live prover (docs/FRAUD_PROOF.md, "The clip scales", "The run's version"), in
process as tests/test_fraud_live.py: the colluding quorum's unclipped scale and version-2 factors proven by
the honest node alone (served, or withheld and challenged), a right round's sum-tree challenge answered, and a
run created with another version refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading

import pytest

from ledger.chain import connect_pyevm
from ledger.chunkproof import StageLeaf
from node.commitments import scheme_named
from node.config import load_config
from node.fraudproof import initial_state
from node.live.chain.onchain import NodeChain
from node.store.checkpoint import RunLayout
from p2p.config import P2PConfig
from p2p.host import P2PHost
from p2p.identity import Identity
from tests.fraud_fixtures import OTHER, contribution, tensors
from tests.ledger_fixtures import deploy, digest, mine
from training.diloco import aggregate_with_report

from tests.fraud_live_fixtures import (COLLUDERS, PROVER, SHAPES, WithholdingFactors, World,
                                        _normed_world, _record, _setup, _states)


def test_one_honest_node_alone_proves_a_colluding_quorums_unclipped_scale(tmp_path, caplog):
    """A version-3 run (``diloco.commitments = "normed"``): the colluders aggregate a contribution the norm
    rule clips with scale 1.0 and weights consistent with it (no chunk differs from the step of their
    factors), and publish their factors and sum trees; the honest node opens them and proves the scale wrong
    on chain."""
    from ledger.chunkproof import build_proof

    cfg = load_config(None, ["diloco.outer_lr=0.7", "diloco.outer_momentum=0.9", "pipeline.num_stages=2",
                             "diloco.commitments=normed", "compression.enabled=false"])
    assert cfg.diloco.commitments == "normed" and cfg.diloco.norm_clip == 2.0
    layout = RunLayout(1, b"\x07" * 32, {}, (SHAPES, OTHER), chunked=True)
    weights, momentum = tensors(1, SHAPES), tensors(2, SHAPES, scale=0.1)
    blobs = [contribution(SHAPES, "lowrank", 30, rank=4), contribution(SHAPES, "quant", 31),
             contribution(SHAPES, "raw", 32, scale=0.5)]
    honest_aggregation = aggregate_with_report(weights, momentum, blobs, cfg.diloco, stage_index=0,
                                               outer_round=1, compression_cfg=cfg.compression)
    assert honest_aggregation.contributions[2].scale < 1.0  # the rule clips the raw one
    loose = dataclasses.replace(cfg.diloco, norm_clip=0.0)
    colluded = aggregate_with_report(weights, momentum, blobs, loose, stage_index=0, outer_round=1,
                                     compression_cfg=cfg.compression)
    assert all(report.scale == 1.0 for report in colluded.contributions)
    other = initial_state(1, tensors(3, OTHER), tensors(4, OTHER, 0.0))
    hosts = [P2PHost.start(P2PConfig(listen_port=0), Identity.generate(), data_dir=tmp_path / f"host{i}")
             for i in range(2)]
    stop = threading.Event()
    try:
        world = World(cfg, layout, weights, momentum, blobs, honest_aggregation, other, hosts, stop)
        colluder_host, prover_host = hosts
        colluders, honest = _states(world, colluder_host), _states(world, prover_host)
        own_leaf = _record(world, honest, honest_aggregation.new_global)
        envelopes = [hashlib.sha256(b"envelope" + blob).digest() for blob in blobs]
        wrong_leaf = colluders.record(1, 0, colluded.new_global, colluded.new_momentum,
                                      colluded.contributions, blobs, envelopes, world.bindings)
        assert own_leaf != wrong_leaf
        prover_host.connect(colluder_host.listen_addrs[0])
        deployment, run, records, prover, mine_record = _setup(world, tmp_path, honest, wrong_leaf, own_leaf,
                                                               colluder_host.peer_id)
        client = deployment.client(PROVER)
        start = initial_state(0, weights, momentum)
        for chunk in range(len(start.weight_leaves)):  # no chunk proof sees it: the weights follow the scales
            assert not client.proof_holds(build_proof(
                records[0], records[1], [start.leaf(), other.leaf()],
                [StageLeaf.decode(wrong_leaf), other.leaf()], start, colluders.state(1, 0), chunk))
        prover.check(0, records[0], records[0])
        with caplog.at_level("ERROR", logger="node.live.fraud.prover"):
            prover.check(1, records[1], mine_record)
        assert set(prover.log.proofs) == {1}, prover.log.unprovable
        assert "clip scale 2 is not the norm rule of the committed sums; sending the norm proof" \
            in caplog.text
        assert client.invalid_from(run.run_id) == 1
        for index in COLLUDERS:
            assert client.member(run.run_id, deployment.client(index).address).status == "slashed"
        assert client.member(run.run_id, client.address).status == "active"
        # The proof is kept, and the audit shows it, checked on chain (isWrongNorm).
        from types import SimpleNamespace

        from ledger.normproof import SCALES, NormProof
        from node.tools.audit_proof import check_fraud_proof
        kept = (tmp_path / "proofs" / "round-00000001-stage0.json").read_bytes()
        assert NormProof.from_json(json.loads(kept)["proof"]).contribution == SCALES
        verdict = SimpleNamespace(checks=[], notes=[])
        source = SimpleNamespace(proofs=lambda outer_round: [kept] if outer_round == 1 else [])
        attesters = client.commit_record(run.run_id, 1).attesters
        check_fraud_proof(verdict, SimpleNamespace(commit=records[1], attesters=attesters), None, None,
                          [source], client, client.history(run.run_id), None)
        (check,) = verdict.checks
        assert check.status == "ok" and "the clip scales" in check.reason and "already proven" in check.reason
        assert verdict.notes[0].startswith("fraud proof (proveWrongNorm's argument)")
    finally:
        stop.set()
        for host in hosts:
            host.close()



def test_one_honest_node_alone_proves_a_colluding_quorums_version_two_factors_in_a_normed_run(tmp_path,
                                                                                              caplog):
    """The version escape: in a version-3 run the colluders aggregate with every scale 1.0 (the raw
    contribution unclipped) and commit version-2 factors, which carry no norm commitment a proof of the scales
    could open, and serve them. The run's version is on chain (RunParams.commitments): the honest node's norm
    proof over those factors gets the round invalidated and the colluders slashed."""
    blobs = [contribution(SHAPES, "lowrank", 30, rank=4), contribution(SHAPES, "quant", 31),
             contribution(SHAPES, "raw", 32, scale=0.5)]
    with _normed_world(tmp_path, blobs) as (world, chunked, colluded):
        honest_aggregation, hosts = world.aggregation, world.hosts
        assert honest_aggregation.contributions[2].scale < 1.0  # the rule clips the raw one
        assert all(report.scale == 1.0 for report in colluded.contributions)
        colluder_host, prover_host = hosts
        honest = _states(world, prover_host)
        colluders = _states(dataclasses.replace(world, cfg=chunked), colluder_host)
        own_leaf = _record(world, honest, honest_aggregation.new_global)
        envelopes = [hashlib.sha256(b"envelope" + blob).digest() for blob in blobs]
        wrong_leaf = colluders.record(1, 0, colluded.new_global, colluded.new_momentum,
                                      colluded.contributions, blobs, envelopes)
        committed = colluders.state(1, 0)
        assert committed.factors.norms is None and honest.state(1, 0).factors.norms is not None
        for alias, blob in scheme_named("normed").published_parts(wrong_leaf, committed):
            colluders.publish_part(1, 0, alias, blob)  # they serve what they committed: version 2
        prover_host.connect(colluder_host.listen_addrs[0])
        deployment, run, records, prover, mine_record = _setup(world, tmp_path, honest, wrong_leaf, own_leaf,
                                                               colluder_host.peer_id)
        client = deployment.client(PROVER)
        assert client.commitments_of(run.run_id) == 3
        prover.check(0, records[0], records[0])
        with caplog.at_level("ERROR", logger="node.live.fraud.prover"):
            prover.check(1, records[1], mine_record)
        assert set(prover.log.proofs) == {1}, prover.log.unprovable
        assert "factors are version 2 (no norm commitment) in a version-3 run; sending the norm proof" \
            in caplog.text
        assert client.invalid_from(run.run_id) == 1
        for index in COLLUDERS:
            assert client.member(run.run_id, deployment.client(index).address).status == "slashed"
        assert client.member(run.run_id, client.address).status == "active"


def test_a_node_refuses_a_run_created_with_another_commitments_version():
    """A run whose document says one version and whose chain another (its creator's mistake): the prover would
    prove every honest round wrong, so a node refuses it before it joins (NodeChain.check_run)."""
    from node.errors import ConfigError

    deployment = deploy(connect_pyevm())
    config_hash = digest("document")
    run_id = deployment.client(1).create_run(config_hash, 2, 50, commitments=scheme_named("chunked").version)
    chain = NodeChain(deployment.client(2))
    chain.check_run(run_id, config_hash, commitments="chunked")
    with pytest.raises(ConfigError, match="commitments version 2 \\(chunked\\).*'normed' \\(version 3\\)"):
        chain.check_run(run_id, config_hash, commitments="normed")


def test_a_right_normed_rounds_sum_tree_challenge_is_answered(tmp_path):
    """In a version-3 run a griefer challenges a sum-tree leaf of a right round: the honest node answers it
    from its own state (the chunk's sum and its sum path), the bond is forfeited and the round stands."""
    from ledger.availability import availability_target, sums_which
    from node.live.fraud.answerer import ChallengeAnswerer

    blobs = [contribution(SHAPES, "lowrank", 30, rank=4), contribution(SHAPES, "quant", 31)]
    with _normed_world(tmp_path, blobs) as (world, _chunked, _colluded):
        aggregation, hosts, other = world.aggregation, world.hosts, world.other
        honest = _states(world, hosts[1])
        own_leaf = _record(world, honest, aggregation.new_global)
        deployment, run, records, prover, _mine = _setup(world, tmp_path, honest, own_leaf, own_leaf,
                                                         hosts[0].peer_id)
        assert deployment.client(PROVER).commitments_of(run.run_id) == 3
        griefer = deployment.client(6)
        state = honest.state(1, 0)
        assert len(state.sum_trees) == 2
        target = availability_target(records[1], [StageLeaf.decode(own_leaf), other.leaf()], state.factors, 0,
                                     sums_which(2, 1), 3)
        challenge = griefer.challenge_availability(target)
        answerer = ChallengeAnswerer(run_id=run.run_id, chain=prover.chain, states=honest, prover=prover,
                                     stop=threading.Event())
        answerer.poll()
        assert answerer.answered[challenge] == f"answered with leaf 3 of tree {sums_which(2, 1)}"
        mine(deployment.w3, deployment.client(PROVER).run_info(run.run_id).accusation_blocks)
        assert griefer.challenge_of(challenge)["settled"]
        assert griefer.invalid_from(run.run_id) is None


def test_withheld_version_two_factors_are_challenged_published_and_proven(tmp_path, caplog):
    """The version escape with the factors withheld: the colluders serve their state but not their (version-2)
    factors; the honest node challenges the factors' availability on chain, the colluders must publish them
    (or lose the round), and the node proves the round wrong from the published bytes."""
    blobs = [contribution(SHAPES, "quant", 31), contribution(SHAPES, "raw", 32, scale=0.5)]
    with _normed_world(tmp_path, blobs) as (world, chunked, colluded):
        honest_aggregation, hosts = world.aggregation, world.hosts
        colluder_host, prover_host = hosts
        honest = _states(world, prover_host)
        colluders = _states(dataclasses.replace(world, cfg=chunked), colluder_host, WithholdingFactors)
        own_leaf = _record(world, honest, honest_aggregation.new_global)
        envelopes = [hashlib.sha256(b"envelope" + blob).digest() for blob in blobs]
        wrong_leaf = colluders.record(1, 0, colluded.new_global, colluded.new_momentum,
                                      colluded.contributions, blobs,
                                      envelopes)  # their state served, their factors not
        prover_host.connect(colluder_host.listen_addrs[0])
        deployment, run, records, prover, mine_record = _setup(world, tmp_path, honest, wrong_leaf, own_leaf,
                                                               colluder_host.peer_id)
        client = deployment.client(PROVER)
        prover.check(0, records[0], records[0])
        with caplog.at_level("ERROR", logger="node.live.fraud.prover"):
            prover.check(1, records[1], mine_record)
        assert "no attester serves them; challenging their availability on chain" in caplog.text
        (challenge,) = prover.log.challenges.values()
        assert client.invalid_from(run.run_id) is None
        # The colluders answer: the bytes whose sha256 is their stage leaf's factorsHash.
        from ledger.availability import FACTORS, availability_answer
        deployment.client(1).answer_challenge(challenge, *availability_answer(colluders.state(1, 0), FACTORS,
                                                                              0))
        with caplog.at_level("ERROR", logger="node.live.fraud.prover"):
            prover.settle_challenges()
        assert set(prover.log.proofs) == {1}, prover.log.unprovable
        assert "factors are version 2 (no norm commitment) in a version-3 run; sending the norm proof" \
            in caplog.text
        assert client.invalid_from(run.run_id) == 1
        for index in COLLUDERS:
            assert client.member(run.run_id, deployment.client(index).address).status == "slashed"
        prover.stop.set()
