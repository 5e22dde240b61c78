"""A fraud-provable run's per-round values, bound on chain (issue 62; docs/FRAUD_PROOF.md, "The run's
values"), each adversary's move on py-evm and on a real anvil (tests/chain_backends.py).

A quorum that colludes commits a round whose weights are exactly the outer step of values the run does not
have (another lr, momentum or Nesterov flag, no norm clip, declared steps past H, more contributions than the
run allows, a back-doored round 0): every chunk then is the step of the committed factors, so before issue 62
no proof could touch it. Now the run's values are in ``RunParams`` and each such round is proven wrong and its
attesters slashed, while a right round's proofs still revert; createRun refuses runs whose proofs could not be
sent.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib

import pytest

from ledger import errors
from ledger.chain import connect_pyevm
from ledger.chunkproof import build_proof, chunked_weights_root, tree_path
from ledger.normproof import clip_scales
from ledger.runparams import (DEFAULT_MAX_CONTRIBUTIONS, MAX_RANK, PROOF_MAX_CALLDATA, PROOF_MAX_GAS,
                              most_contributions, proof_cost)
from node.commitments.values import check_run_values, schedule_of
from node.fraudproof import round_factors_bits
from tests.chain_backends import assert_paid, chain, each_on_both
from tests.fraud_fixtures import DILOCO, aggregated_round, changed, commit, contribution, tensors
from tests.fraud_fixtures import bound as bind_contributions
from tests.ledger_fixtures import chain_w3, deploy, digest  # noqa: F401 (chain_w3: py-evm / anvil)
from training.chunks import float64_bits
from training.config import DilocoConfig

SHAPES = {"a.weight": (16, 80), "b.bias": (70,)}
STAKE = 10**18
NORMED = dataclasses.replace(DILOCO, commitments="normed")  # lr 0.7, mu 0.9, Nesterov, norm_clip 2
INNER_STEPS = 50  # tests/ledger_fixtures.py member_run's H


def blobs() -> list[bytes]:
    """Three contributions, one per codec, the raw one large enough to be clipped."""
    return [contribution(SHAPES, "lowrank", 10, rank=4), contribution(SHAPES, "quant", 11),
            contribution(SHAPES, "raw", 12, scale=0.5)]


def adversary(**changes) -> DilocoConfig:
    """The colluders' outer step: the run's configuration with values it does not allow (set past its checks,
    as a modified node would)."""
    cfg = copy.copy(NORMED)
    for name, value in changes.items():
        object.__setattr__(cfg, name, value)
    return cfg


def bound(diloco: DilocoConfig = NORMED, **overrides):
    """The run's schedule and the values createRun binds (node/commitments/values.py's, the genesis aside)."""
    schedule = schedule_of(diloco)
    values = {"schedule_root": schedule.root, "schedule_rounds": schedule.rounds, "nesterov": diloco.nesterov,
              "norm_clip_bits": float64_bits(diloco.norm_clip),
              "max_contributions": DEFAULT_MAX_CONTRIBUTIONS,
              "max_rank": MAX_RANK}
    return schedule, {**values, **overrides}


def on_chain(w3, round_, new, **overrides):
    """A run bound to NORMED's values (``overrides`` changed) on ``w3``, rounds 0 and 1 committed."""
    schedule, values = bound(**overrides)
    return commit(deploy(w3, min_stake=STAKE), round_, new, stake=STAKE, values=values, schedule=schedule)


def assert_overturned(committed, receipt_of) -> None:
    assert_paid(committed.deployment, committed.run_id, committed.prover(), receipt_of, stake=STAKE,
                slashed=committed.attesters, kept=(3,))


@pytest.fixture(scope="module")
def honest():
    return aggregated_round(SHAPES, blobs(), NORMED)


def test_a_right_round_of_a_bound_run_still_stands(chain_w3, honest):
    committed = on_chain(chain_w3, honest, honest.honest)
    prover = committed.prover()
    assert prover.run_values(committed.run_id)["schedule_root"] == committed.schedule.root
    for chunk in (0, 5, len(honest.honest.weight_leaves) - 1):
        with pytest.raises(errors.ProverRoundCorrect):
            prover.prove_wrong_aggregation(committed.proof(chunk))
    with pytest.raises(errors.ProverNormCorrect):
        prover.prove_wrong_norm(committed.scale_proof())
    proof = committed.proof(0)
    with pytest.raises(errors.ProverBadSchedule):  # the leaf of another round
        prover.prove_wrong_aggregation(dataclasses.replace(proof,
                                                           schedule_leaf=proof.schedule_leaf[:-1] + b"\1"))
    with pytest.raises(errors.ProverBadSchedule):  # none
        prover.prove_wrong_aggregation(dataclasses.replace(proof, schedule_leaf=b"", schedule_path=[]))
    assert prover.invalid_from(committed.run_id) is None


_LIED: dict = {}


def lied_round(**changes):
    """The colluders' round stepped with ``changes`` (cached: each runs on both backends)."""
    key = tuple(sorted(changes.items()))
    if key not in _LIED:
        _LIED[key] = aggregated_round(SHAPES, blobs(), adversary(**changes))
    return _LIED[key]


@pytest.mark.parametrize("backend, changes", each_on_both(
    [{"outer_lr": 7.0}, {"outer_lr": -0.7}, {"outer_lr": 0.0}, {"outer_momentum": 0.0}, {"nesterov": False}],
    ids=["lr 7.0", "lr -0.7", "lr 0", "mu 0", "not Nesterov"]))
def test_a_round_stepping_with_values_the_run_does_not_have_is_proven_wrong(request, backend, changes):
    lied = lied_round(**changes)
    # weights consistent with the committed factors, every chunk
    committed = on_chain(chain(request, backend), lied, lied.honest)
    factors = lied.honest.factors
    lr, mu = round_factors_bits(NORMED, 1)
    assert (factors.lr_bits, factors.mu_bits, factors.nesterov) != (lr, mu, True)
    proof = committed.proof(3)
    assert committed.prover().proof_holds(proof)
    assert_overturned(committed, lambda prover: prover.prove_wrong_aggregation(proof))


def test_a_round_without_the_runs_norm_clip_is_proven_wrong(chain_w3):
    """norm_clip 0: every scale 1.0 (the raw contribution unclipped), the weights and the norm commitment
    consistent with it: the norm proof holds the committed clip to the run's."""
    loose = lied_round(norm_clip=0.0)
    assert set(loose.honest.factors.scale_bits) == {0x3FF0000000000000}
    committed = on_chain(chain_w3, loose, loose.honest)
    with pytest.raises(errors.ProverRoundCorrect):  # every chunk is the step of the committed scales
        committed.prover().prove_wrong_aggregation(committed.proof(3))
    assert_overturned(committed, lambda prover: prover.prove_wrong_norm(committed.scale_proof()))


def with_steps(state, steps: int):
    """``state`` whose contributions each declare ``steps`` inner steps, its scales the rule's for them."""
    norms = dataclasses.replace(state.factors.norms, steps=(steps,) * len(state.factors.scale_bits))
    scales = tuple(float64_bits(s) for s in clip_scales(norms.sums, NORMED.norm_clip, norms.steps))
    factors = dataclasses.replace(state.factors, norms=norms, scale_bits=scales)
    return dataclasses.replace(state, factors=factors)


def test_declared_steps_past_the_runs_inner_steps_are_proven_wrong(chain_w3, honest):
    """The scales are the rule's for the declared steps: the committed round is right with H steps and wrong
    with H + 1 (more than a round may train)."""
    right = on_chain(chain_w3, honest, with_steps(honest.honest, INNER_STEPS))
    with pytest.raises(errors.ProverNormCorrect):
        right.prover().prove_wrong_norm(right.scale_proof())
    past = on_chain(chain_w3, honest, with_steps(honest.honest, INNER_STEPS + 1))
    assert_overturned(past, lambda prover: prover.prove_wrong_norm(past.scale_proof()))


def test_a_round_listing_more_than_max_contributions_is_proven_wrong(chain_w3, honest):
    committed = on_chain(chain_w3, honest, honest.honest, max_contributions=2)  # three listed
    assert committed.prover().norm_proof_holds(committed.scale_proof())
    proof = dataclasses.replace(committed.proof(0), pieces=[], piece_paths=[])  # no piece needs sending
    assert_overturned(committed, lambda prover: prover.prove_wrong_aggregation(proof))


def test_a_piece_above_the_runs_rank_does_not_decode(chain_w3, honest):
    committed = on_chain(chain_w3, honest, honest.honest, max_rank=3)  # the low-rank contribution has rank 4
    assert_overturned(committed, lambda prover: prover.prove_wrong_aggregation(committed.proof(0)))


class Round0:
    """A run whose round 0 is committed on top of its genesis root (RunParams.genesisRoot)."""

    def __init__(self, w3, round_, new, *, genesis: bool = True):
        self.genesis_leaves = [round_.prev.leaf(), round_.other.leaf()]
        schedule, values = bound()
        if genesis:
            values["genesis_root"] = chunked_weights_root(self.genesis_leaves)
        self.deployment = deploy(w3, min_stake=STAKE)
        self.run = self.deployment.member_run((1, 2, 3), quorum=2, min_stake=STAKE, commitments=3,
                                              values=values)
        if new.factors.norms is not None and not new.factors.norms.bound:  # bound (issue 62)
            signers = [self.deployment.client(index) for index in (1, 2, 3)]
            new = bind_contributions(new, signers, self.run.run_id, 0)
        self.stages = [new.leaf(), round_.other.leaf()]
        self.record = dataclasses.replace(self.run.next_record(),
                                          weights_root=chunked_weights_root(self.stages))
        self.run.client(1).commit_round(self.record, self.run.sign(self.record, (1, 2)))
        self.prev, self.new, self.schedule = round_.prev, new, schedule
        self.prover = self.deployment.client(6)
        self.run_id = self.run.run_id

    def proof(self, chunk: int):
        return build_proof(None, self.record, self.genesis_leaves, self.stages, self.prev, self.new, chunk,
                           self.schedule)


def test_a_back_doored_round_zero_is_proven_wrong_against_the_genesis_root(chain_w3, honest):
    right = Round0(chain_w3, honest, honest.honest)
    with pytest.raises(errors.ProverRoundCorrect):
        right.prover.prove_wrong_aggregation(right.proof(2))
    door = Round0(chain_w3, honest, changed(honest.honest, 2, 9))
    # weights from elsewhere than the genesis (its root names other weights): the proof's own start is refused
    other = dataclasses.replace(door.proof(2), prev_stage_leaf=changed(honest.prev, 2, 0).leaf().encode())
    with pytest.raises(errors.ProverBadStagePath):
        door.prover.prove_wrong_aggregation(other)
    # round 0 and everything after it; member 3 signed nothing
    assert_paid(door.deployment, door.run_id, door.prover, lambda prover: prover.prove_wrong_aggregation(
        door.proof(2)), stake=STAKE, slashed=(1, 2), kept=(3,), invalid_from=0)


def test_round_zero_of_a_run_without_a_genesis_root_cannot_be_proven(chain_w3, honest):
    door = Round0(chain_w3, honest, changed(honest.honest, 2, 9), genesis=False)
    with pytest.raises(errors.ProverNoGenesis):
        door.prover.prove_wrong_aggregation(door.proof(2))


class JunkFactors:
    """Factors bytes no honest node writes (a version-2 round's, whose lists do not decode)."""

    def __init__(self, data: bytes):
        self.data = data

    def encode(self) -> bytes:
        return self.data

    def digest(self) -> bytes:
        return hashlib.sha256(self.data).digest()


@pytest.fixture(scope="module")
def chunked():
    return aggregated_round(SHAPES, blobs())  # version 2


@pytest.mark.parametrize("backend, junk", each_on_both(
    [b"", bytes(224), (2**40).to_bytes(32, "big") * 12, bytes(96) + (192).to_bytes(32, "big") + bytes(200)],
    ids=["empty", "zeros", "huge words", "truncated lists"]))
def test_malformed_version_two_factors_are_a_wrong_round_not_a_revert(request, backend, junk, chunked):
    state = dataclasses.replace(chunked.honest, factors=JunkFactors(junk))
    committed = commit(deploy(chain(request, backend), min_stake=STAKE), chunked, state, stake=STAKE,
                       commitments=2)
    assert_overturned(committed, lambda prover: prover.prove_wrong_aggregation(committed.proof(0)))


def test_create_run_refuses_values_whose_proof_would_not_fit(chain_w3):
    deployment = deploy(chain_w3)
    client = deployment.client(1)
    for rank in (1, 8, 64):
        most = most_contributions(rank)
        gas, size = proof_cost(most, rank)
        assert gas <= PROOF_MAX_GAS and size <= PROOF_MAX_CALLDATA
        client.create_run(digest(f"ok {rank}"), 1, 10, values={"max_contributions": most, "max_rank": rank})
        with pytest.raises(errors.LedgerProofTooCostly) as caught:
            client.create_run(digest(f"costly {rank}"), 1, 10,
                              values={"max_contributions": most + 1, "max_rank": rank})
        refused = caught.value.values
        assert (refused["gas"], refused["calldataBytes"]) == proof_cost(most + 1, rank)
    for bad in ({"max_contributions": 0}, {"max_rank": 0}, {"max_rank": MAX_RANK + 1},
                {"norm_clip_bits": float64_bits(0.5)}, {"norm_clip_bits": float64_bits(float("inf"))}):
        with pytest.raises(errors.LedgerBadRunValues):
            client.create_run(digest("bad"), 1, 10, values=bad)
    with pytest.raises(errors.LedgerBadCommitments):
        client.create_run(digest("v4"), 1, 10, commitments=4)
    # a hashed run proves nothing: its bounds are not checked, nor stored
    run_id = client.create_run(digest("hashed"), 1, 10, commitments=1, values={"max_contributions": 60000})
    assert client.run_values(run_id)["max_contributions"] == 0
    assert client.run_info(run_id).max_contributions == 60000  # as created (the event)


def test_the_schedule_is_the_steps_lr_and_momentum_round_by_round():
    constant = schedule_of(NORMED)
    assert constant.rounds == 1
    decaying = DilocoConfig(outer_lr=0.8, outer_momentum=0.9, outer_warmup_rounds=3, outer_decay="cosine",
                            outer_decay_rounds=9, outer_final_momentum=0.5)
    schedule = schedule_of(decaying)
    assert schedule.rounds == 10
    for t in range(30):
        assert schedule.of_round(t) == round_factors_bits(decaying, t)
    assert schedule_of(decaying, max_rounds=4).rounds == 4
    leaf, path = schedule.opening(25)
    assert leaf == schedule.leaves()[9] and path == tree_path(schedule.leaves(), 9)


def test_a_run_binding_other_values_than_its_document_is_refused():
    from node.commitments.values import run_values
    from node.config import load_config

    cfg = load_config(None, ["model.preset=tiny", "diloco.commitments=normed"])
    mine = run_values(cfg)
    assert mine["genesis_root"] != bytes(32) and mine["schedule_rounds"] == 1
    assert check_run_values(cfg, mine) == []
    # unbound (issue 79): no schedule and no genesis root make a wrong round unprovable: refused, each named
    unbound = check_run_values(cfg, {**mine, "schedule_rounds": 0, "genesis_root": bytes(32)})
    assert [p.split(":")[0] for p in unbound] == ["schedule_rounds", "genesis_root"]
    problems = check_run_values(cfg, {**mine, "nesterov": not mine["nesterov"], "genesis_root": digest("x")})
    assert [p.split(":")[0] for p in problems] == ["nesterov", "genesis_root"]
    # a rank below the decoder's: honest nodes would accept pieces the contract refuses (they refuse to join)
    (lower,) = check_run_values(cfg, {**mine, "max_rank": MAX_RANK - 1})
    assert lower.startswith("max_rank: the chain allows rank 63, below the decoder's 64")
    unbound_low = check_run_values(cfg, {**mine, "schedule_rounds": 0, "max_rank": 8})
    assert [p.split(":")[0] for p in unbound_low] == ["schedule_rounds", "max_rank"]
    hashed = load_config(None, ["model.preset=tiny", "diloco.commitments=hashed"])
    assert run_values(hashed) == {} and check_run_values(hashed, mine) == []


def test_audit_reports_a_run_created_with_other_values_than_its_document():
    from types import SimpleNamespace

    from node.commitments.values import run_values
    from node.config import load_config
    from node.runconfig import run_document
    from node.tools.audit_rundoc import values_check
    from node.tools.report import FAIL, OK

    cfg = load_config(None, ["model.preset=tiny", "diloco.commitments=normed"])
    document = run_document(cfg)
    mine = run_values(cfg)
    assert values_check(document, SimpleNamespace(**mine, max_rounds=0)).status == OK
    lied = SimpleNamespace(**{**mine, "norm_clip_bits": 0}, max_rounds=0)
    check = values_check(document, lied)
    assert check.status == FAIL and "norm_clip_bits" in check.reason
    unbound = SimpleNamespace(**{**mine, "schedule_rounds": 0, "genesis_root": bytes(32)}, max_rounds=0)
    assert values_check(document, unbound) is None


def test_an_honest_round_lists_at_most_max_contributions():
    """The aggregation caps the accepted set at what the run's proofs allow (training/diloco.py MAX_LISTED,
    the ledger's default maxContributions): the rest are left out, so an honest round is never wrong by its
    count."""
    from training.diloco import MAX_LISTED, aggregate_with_report
    from training.robust import OVER_LIMIT

    assert MAX_LISTED == DEFAULT_MAX_CONTRIBUTIONS == most_contributions(MAX_RANK)
    many = [contribution(SHAPES, "quant", 50 + i) for i in range(MAX_LISTED + 2)]
    capped = aggregated_round(SHAPES, many, NORMED)
    assert len(capped.honest.factors.scale_bits) == MAX_LISTED
    committed = on_chain(connect_pyevm(), capped, capped.honest)
    with pytest.raises(errors.ProverRoundCorrect):
        committed.prover().prove_wrong_aggregation(committed.proof(1))
    with pytest.raises(errors.ProverNormCorrect):
        committed.prover().prove_wrong_norm(committed.scale_proof())
    hashed = dataclasses.replace(DILOCO, commitments="hashed")
    for diloco, accepted in ((NORMED, MAX_LISTED), (hashed, MAX_LISTED + 2)):
        aggregation = aggregate_with_report(tensors(1, SHAPES), tensors(2, SHAPES, scale=0.1), many, diloco,
                                            stage_index=0, outer_round=1)
        assert aggregation.accepted == list(range(accepted))
    assert aggregation_excluded(tensors(1, SHAPES), tensors(2, SHAPES, scale=0.1), many) == {
        MAX_LISTED: OVER_LIMIT, MAX_LISTED + 1: OVER_LIMIT}


def aggregation_excluded(weights, momentum, blobs_) -> dict:
    from training.diloco import aggregate_with_report

    return aggregate_with_report(weights, momentum, blobs_, NORMED, stage_index=0, outer_round=1).excluded
