"""The live prover proves the rounds whose factors the run does not allow (issue 62; docs/FRAUD_PROOF.md, "The
run's values", "The binding"), in process as tests/test_fraud_live.py: real libp2p hosts, py-evm, the node's
own prover (node/live/fraud/prover.py, node/live/fraud/factors.py, node/live/fraud/values.py) in a normed run
created with its document's values on chain (RunParams' schedule root, Nesterov flag, norm clip, genesis
root).

Members 1 and 2 (the quorum) collude and serve what they committed; member 3, honest and outside the quorum,
alone gets each round overturned and the colluders slashed: a round stepped with another lr or without
Nesterov (every chunk the step of the committed factors: a values proof over the factors alone), a round whose
contributions carry no binding, one listing a contribution signed by an account that holds no seat (the
contract's view shows it), and a back-doored round 0 (proven against the genesis root). Before issue 62's
prover each was logged "unprovable".
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json

import pytest

from ledger.chain import connect_pyevm
from ledger.chunkproof import AggregationProof
from ledger.normproof import SCALES, NormProof
from node.live.chain.onchain import NodeChain
from node.live.fraud.contribution_binding import ContributionBinder
from tests.fraud_fixtures import contribution
from tests.fraud_live_fixtures import (_LEDGERS, COLLUDERS, PROVER, SHAPES, STAKE, _bindings, _normed_world,
                                       _one_element_changed, _setup, _states, run_values)
from tests.ledger_fixtures import deploy
from training.diloco import aggregate_with_report

OUTSIDER = 6  # an account that never joins the run


def _blobs(outer_round: int = 1) -> list[bytes]:
    return [contribution(SHAPES, "lowrank", 30, rank=4, outer_round=outer_round),
            contribution(SHAPES, "quant", 31, outer_round=outer_round),
            contribution(SHAPES, "raw", 32, scale=0.5, outer_round=outer_round)]


def _envelopes(blobs) -> list[bytes]:
    return [hashlib.sha256(b"envelope" + blob).digest() for blob in blobs]


def _adversary(cfg, **changes):
    """``cfg`` with outer-step values the run does not have (set past the config's checks, as a modified node
    would)."""
    diloco = copy.copy(cfg.diloco)
    for name, value in changes.items():
        object.__setattr__(diloco, name, value)
    changed = copy.copy(cfg)
    object.__setattr__(changed, "diloco", diloco)
    return changed


def _lied_leaf(world, cfg, host, blobs, bindings, outer_round: int = 1) -> bytes:
    """The colluders aggregate ``blobs`` with ``cfg``'s outer step and record (and serve) the state."""
    colluders = _states(dataclasses.replace(world, cfg=cfg), host)
    lied = aggregate_with_report(world.weights, world.momentum, blobs, cfg.diloco, stage_index=0,
                                 outer_round=outer_round, compression_cfg=cfg.compression)
    return colluders.record(outer_round, 0, lied.new_global, lied.new_momentum, lied.contributions, blobs,
                            _envelopes(blobs), bindings)


def _prove(world, tmp_path, caplog, wrong_leaf: bytes, **setup):
    """Round 1 committed with ``wrong_leaf`` in a run bound to the document's values; the honest node checks
    it. Returns (deployment, run, prover, its client)."""
    colluder_host, prover_host = world.hosts
    honest = _states(world, prover_host)
    own_leaf = honest.record(1, 0, world.aggregation.new_global, world.aggregation.new_momentum,
                             world.aggregation.contributions, world.blobs, _envelopes(world.blobs),
                             world.bindings)
    assert own_leaf != wrong_leaf
    prover_host.connect(colluder_host.listen_addrs[0])
    deployment, run, records, prover, mine_record = _setup(world, tmp_path, honest, wrong_leaf, own_leaf,
                                                           colluder_host.peer_id,
                                                           values=run_values(world.cfg), **setup)
    client = deployment.client(PROVER)
    assert client.run_values(run.run_id)["schedule_rounds"] >= 1
    with caplog.at_level("ERROR", logger="node.live.fraud.prover"):
        for outer_round, record in enumerate(records[:-1]):
            prover.check(outer_round, record, record)
        prover.check(len(records) - 1, records[-1], mine_record)
    return deployment, run, prover, client


def _assert_overturned(deployment, run, client, invalid: int = 1) -> None:
    assert client.invalid_from(run.run_id) == invalid
    for index in COLLUDERS:
        assert client.member(run.run_id, deployment.client(index).address).status == "slashed"
    assert client.member(run.run_id, client.address).status == "active"


def _kept(tmp_path, outer_round: int = 1):
    kept = tmp_path / "proofs" / f"round-{outer_round:08d}-stage0.json"
    document = json.loads(kept.read_bytes())["proof"]
    return NormProof.from_json(document) if document.get("kind") == "norm" else AggregationProof.from_json(
        document)


@pytest.mark.parametrize("changes", [{"outer_lr": 7.0}, {"nesterov": False}], ids=["lr 7.0", "not Nesterov"])
def test_a_round_stepped_with_values_the_run_does_not_have_is_proven_by_the_live_node(tmp_path, caplog,
                                                                                       changes):
    with _normed_world(tmp_path, _blobs()) as (world, _chunked, _colluded):
        wrong_leaf = _lied_leaf(world, _adversary(world.cfg, **changes), world.hosts[0], world.blobs,
                                world.bindings)
        deployment, run, prover, client = _prove(world, tmp_path, caplog, wrong_leaf)
        assert set(prover.log.proofs) == {1}, prover.log.unprovable
        word = "lr/mu bits" if "outer_lr" in changes else "Nesterov flag"
        assert f"factors' {word}" in caplog.text and "sending the fraud proof" in caplog.text
        _assert_overturned(deployment, run, client)
        kept = _kept(tmp_path)  # the values proof: the factors and the schedule leaf, no leaf of a chunk
        assert isinstance(kept, AggregationProof) and kept.new_weights == b"" and kept.pieces == []
        assert kept.schedule_leaf and kept.factors != b""
        _assert_audit_shows(tmp_path, client, run, "the factors against the run's values")


def _assert_audit_shows(tmp_path, client, run, what: str) -> None:
    """``audit --archive`` shows the proof the node kept, checked on chain (node/tools/audit_proof.py)."""
    from types import SimpleNamespace

    from node.tools.audit_proof import check_fraud_proof

    kept = (tmp_path / "proofs" / "round-00000001-stage0.json").read_bytes()
    verdict = SimpleNamespace(checks=[], notes=[])
    source = SimpleNamespace(proofs=lambda outer_round: [kept] if outer_round == 1 else [])
    record = SimpleNamespace(commit=client.commit_of(run.run_id, 1),
                             attesters=client.commit_record(run.run_id, 1).attesters)
    check_fraud_proof(verdict, record, None, None, [source], client, client.history(run.run_id), None)
    (check,) = verdict.checks
    assert check.status == "ok" and what in check.reason and "already proven" in check.reason, check.reason


def test_contributions_without_their_binding_are_proven_by_the_live_node(tmp_path, caplog):
    with _normed_world(tmp_path, _blobs()) as (world, _chunked, _colluded):
        wrong_leaf = _lied_leaf(world, world.cfg, world.hosts[0], world.blobs, None)  # nobody signed them
        deployment, run, prover, client = _prove(world, tmp_path, caplog, wrong_leaf)
        assert set(prover.log.proofs) == {1}, prover.log.unprovable
        assert "without their binding" in caplog.text and "sending the norm proof" in caplog.text
        _assert_overturned(deployment, run, client)
        assert _kept(tmp_path).contribution == SCALES
        _assert_audit_shows(tmp_path, client, run, "the clip scales")


def _signed_by_outsider(cfg, blob: bytes) -> tuple[str, bytes]:
    """``blob`` signed for run 1 round 1 by an account of the ledger every fresh deployment gets that never
    joins the run (a fabricated contribution's binding)."""
    probe = deploy(connect_pyevm(), min_stake=STAKE)
    assert probe.ledger in _LEDGERS or not _LEDGERS
    binder = ContributionBinder(1, NodeChain(probe.client(OUTSIDER)), cfg.diloco,
                                refuse_raw=cfg.compression.enabled)
    return probe.client(OUTSIDER).address, binder.sign(1, 0, blob, SHAPES)[1]


def test_a_fabricated_contribution_signed_by_a_non_member_is_proven_by_the_live_node(tmp_path, caplog):
    """The colluders list a fourth contribution, signed (validly) by an account with no seat in the run: the
    factors keep the run's values, every signature recovers, the scales follow the committed sums; only the
    contract's view (``memberOf``) sees it, and the prover asks it."""
    with _normed_world(tmp_path, _blobs()) as (world, _chunked, _colluded):
        fabricated = contribution(SHAPES, "quant", 77)
        blobs = [*world.blobs, fabricated]
        bindings = [*_bindings(world.cfg, world.blobs), _signed_by_outsider(world.cfg, fabricated)]
        wrong_leaf = _lied_leaf(world, world.cfg, world.hosts[0], blobs, bindings)
        deployment, run, prover, client = _prove(world, tmp_path, caplog, wrong_leaf)
        assert set(prover.log.proofs) == {1}, prover.log.unprovable
        assert "a contributor that held no seat" in caplog.text
        _assert_overturned(deployment, run, client)


def test_a_back_doored_round_zero_is_proven_by_the_live_node_against_the_genesis_root(tmp_path, caplog):
    with _normed_world(tmp_path, _blobs(0), 0) as (world, _chunked, _colluded):
        world.bindings = _bindings(world.cfg, world.blobs, 0)
        colluder_host, prover_host = world.hosts
        aggregation, envelopes = world.aggregation, _envelopes(world.blobs)
        honest, colluders = _states(world, prover_host), _states(world, colluder_host)
        own_leaf = honest.record(0, 0, aggregation.new_global, aggregation.new_momentum,
                                 aggregation.contributions, world.blobs, envelopes, world.bindings)
        wrong_leaf = colluders.record(0, 0, _one_element_changed(aggregation.new_global),
                                      aggregation.new_momentum, aggregation.contributions, world.blobs,
                                      envelopes, world.bindings)
        prover_host.connect(colluder_host.listen_addrs[0])
        deployment, run, records, prover, mine_record = _setup(world, tmp_path, honest, wrong_leaf, own_leaf,
                                                               colluder_host.peer_id,
                                                               values=run_values(world.cfg), round_zero=True)
        client = deployment.client(PROVER)
        with caplog.at_level("ERROR", logger="node.live.fraud.prover"):
            prover.check(0, records[0], mine_record)
        assert set(prover.log.proofs) == {0}, prover.log.unprovable
        _assert_overturned(deployment, run, client, invalid=0)
        kept = _kept(tmp_path, 0)
        assert kept.prev_record[1] == 0 and kept.new_weights != b""  # a chunk's proof over the genesis start


def test_an_honest_node_does_not_sign_on_top_of_a_round_it_holds_wrong(tmp_path, caplog):
    """Issue 62: a node that can prove round 1 wrong proves it before it signs round 2, and while the proof
    waits (round 0's window still open: ProverParentOpen) it refuses to sign round 2's record on top of it
    (the committer's own signing, node/live/record/quorumcommit.py); once the proof lands, the round and the
    run are overturned and the colluders slashed."""
    from types import SimpleNamespace

    from ledger.records import RoundRecord
    from node.live.record.quorumcommit import QuorumCommit
    from node.live.state.roundbook import RoundBook
    from node.live.state.status import StateFile
    from tests.ledger_fixtures import mine

    with _normed_world(tmp_path, _blobs()) as (world, _chunked, _colluded):
        wrong_leaf = _lied_leaf(world, _adversary(world.cfg, outer_lr=7.0), world.hosts[0], world.blobs,
                                world.bindings)
        deployment, run, prover, client = _prove(world, tmp_path, caplog, wrong_leaf, parent_closed=False)
        assert not prover.log.proofs and 1 in prover.log.wrong  # built and kept, waiting for round 0's window
        assert 1 in prover._deferred  # ProverParentOpen: sent again by the settlement loop
        committer = QuorumCommit()
        committer.node = SimpleNamespace(chain=prover.chain, fraud=prover, book=RoundBook(),
                                         state=StateFile(tmp_path / "state.json", run.run_id),
                                         gossip=lambda *args: b"", run_id=run.run_id)
        record2 = RoundRecord(run.run_id, 2, client.head_of(run.run_id), bytes(32), bytes(32), 0, 0, 0, 0,
                              bytes(32))
        with caplog.at_level("ERROR", logger="node.live.record.quorumcommit"):
            assert committer._sign(record2) is None
        assert "not signing the record on top of a wrong round: round 1 is wrong" in caplog.text
        assert committer.node.state.signed_record(2) is None
        assert prover.refuses_to_sign(1) is None  # round 1 itself was signed before it was known wrong
        mine(deployment.w3, client.run_struct(run.run_id)["disputeBlocks"] + 1)
        prover.settle_challenges()  # the settlement loop sends the proof once the parent's window closed
        assert set(prover.log.proofs) == {1}, prover.log.unprovable
        _assert_overturned(deployment, run, client)
        assert "round 1 is wrong" in prover.refuses_to_sign(2)  # and overturned: the run halted there
        assert prover.refuses_to_sign(1) is None


def test_the_prover_names_each_value_the_run_does_not_allow_and_the_proof_that_shows_it():
    """node/live/fraud/values.py's classification, one committed change at a time, on a bound right round (its
    contributions signed by three members of a py-evm deployment): each value the run does not allow picks the
    proof the contract takes for it (tests/test_run_values.py, tests/test_contribution_binding.py prove them
    on chain), and the right round none."""
    from ledger.runparams import DEFAULT_MAX_CONTRIBUTIONS
    from node.commitments.values import schedule_of
    from node.live.fraud.values import CHUNK, NORM, RunValues, factors_fault
    from tests.fraud_fixtures import DILOCO, aggregated_round, bound
    from training.chunks import float64_bits

    normed = dataclasses.replace(DILOCO, commitments="normed")
    deployment = deploy(connect_pyevm())
    clients = [deployment.client(index) for index in (1, 2, 3)]
    right = bound(aggregated_round(SHAPES, _blobs(), normed).honest, clients, 1, 1).factors
    client = clients[0]
    values = RunValues(1, 3, schedule_of(normed), normed.nesterov, float64_bits(normed.norm_clip), 50,
                       DEFAULT_MAX_CONTRIBUTIONS, bytes(32), client.chain_id, client.ledger_address)
    norms = right.norms
    assert factors_fault(values, right, 1, 0) is None
    cases = {
        "lr/mu bits": (CHUNK, dataclasses.replace(right, lr_bits=0x40E00000)),
        "Nesterov flag": (CHUNK, dataclasses.replace(right, nesterov=not right.nesterov)),
        "more than the run's 2": (NORM, right, {"max_contributions": 2}),
        "normClip bits": (NORM, dataclasses.replace(right, norms=dataclasses.replace(norms, clip_bits=0))),
        "steps, past the run's 50": (NORM, dataclasses.replace(right, norms=dataclasses.replace(
            norms, steps=(51, 50, 50)))),
        "without their binding": (NORM, dataclasses.replace(right, norms=dataclasses.replace(
            norms, contributors=(), signatures=()))),
        "account twice": (NORM, dataclasses.replace(right, norms=dataclasses.replace(
            norms, contributors=(norms.contributors[0],) * 3))),
        "not by its contributor": (NORM, dataclasses.replace(right, norms=dataclasses.replace(
            norms, signatures=norms.signatures[::-1]))),
        "version 2 (no norm commitment)": (NORM, dataclasses.replace(right, norms=None)),
        "not canonical version-3": (NORM, b"\0" * 64),
    }
    for word, (kind, factors, *changes) in cases.items():
        run = dataclasses.replace(values, **(changes[0] if changes else {}))
        fault = factors_fault(run, factors, 1, 0)
        assert fault is not None and fault[0] == kind and word in fault[1], (word, fault)
    # a chunked run's (version 2): version-3 factors, or too many, are the values proof's
    chunked = dataclasses.replace(values, version=2)
    assert factors_fault(chunked, right, 1, 0)[0] == CHUNK
    version_two = dataclasses.replace(right, norms=None)
    assert factors_fault(dataclasses.replace(chunked, max_contributions=2), version_two, 1, 0)[0] == CHUNK
    # a run without a schedule on chain: its lr and flag are not held (only a hand-made run)
    assert factors_fault(dataclasses.replace(values, schedule=None), cases["lr/mu bits"][1], 1, 0) is None
