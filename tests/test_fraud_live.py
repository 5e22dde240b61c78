"""A node proves a wrong aggregation on chain by itself (issue 43; docs/FRAUD_PROOF.md), in process: real
libp2p hosts (the committers publish their stage state under its leaf, the prover fetches it), a real EVM
(py-evm), the node's own parts (node/live/fraud/chunkstate.py, node/live/fraud/prover.py,
node/live/chain/onchain.py, node/live/state/roundbook.py).

Members 1 and 2 (the quorum) collude: they commit round 1 with one element of stage 0 changed. Member 3,
honest and outside the quorum, alone gets the round invalidated, the attesters slashed and itself paid; or,
when the colluders withhold their state, challenges its availability and settles the challenge unanswered; or,
for a back door (a root with no stage leaves behind it), challenges a stage leaf itself. A right round,
committed factors other than its own and a malformed attested leaf send nothing, and a right round's
challenges are answered (node/live/fraud/answerer.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import threading
import time

import pytest
import torch

from ledger.chain import connect_pyevm
from ledger.chunkproof import AggregationProof, StageLeaf, chunked_weights_root
from node import protocol as msg
from node.commitments import scheme_named
from node.config import load_config
from node.fraudproof import initial_state
from node.live.chain.onchain import NodeChain
from node.live.fraud.chunkstate import ChunkedStates
from node.live.fraud.contribution_binding import ContributionBinder
from node.live.fraud.prover import FraudProver
from node.live.state.roundbook import RoundBook
from node.store.checkpoint import RunLayout, build_checkpoint, checkpoint_problems
from node.tools.pull import round_standing
from p2p.config import P2PConfig
from p2p.host import P2PHost
from p2p.identity import Identity
from tests.fraud_fixtures import OTHER, contribution, tensors
from tests.ledger_fixtures import deploy, digest, mine
from training.diloco import aggregate_with_report

SHAPES = {"a.weight": (16, 80), "b.bias": (70,)}
STAKE = 10**18
PROVER, COLLUDERS = 3, (1, 2)


class WithholdingStates(ChunkedStates):
    """A committer that publishes nothing of its state (the prover must challenge it on chain)."""

    def publish(self, outer_round, stage, leaf, weights, momentum) -> None:
        return None


@dataclasses.dataclass
class World:
    cfg: object
    layout: RunLayout
    weights: dict
    momentum: dict
    blobs: list
    aggregation: object
    other: object  # stage 1's state, the same in both rounds
    hosts: list
    stop: threading.Event  # every prover's: set at the end, so no challenge expirer outlives its test
    bindings: list | None = None  # a version-3 run's: each blob's contributor and signature (_bindings)

    def __post_init__(self) -> None:
        if self.bindings is None and self.cfg.commitment_scheme.proves_factors:
            self.bindings = _bindings(self.cfg, self.blobs)


#: The ledger every fresh py-evm deployment (_setup's) gets: its deployer's nonces are the same each time.
_LEDGERS: list[str] = []


def _bindings(cfg, blobs: list) -> list:
    """Blob ``j`` signed by member ``j + 1`` for run 1 of a fresh py-evm deployment, what _setup creates, as
    a version-3 run's live contributors sign theirs (issue 62: node/live/fraud/contribution_binding.py)."""
    probe = deploy(connect_pyevm(), min_stake=STAKE)
    _LEDGERS.append(probe.ledger)
    signed = []
    for j, blob in enumerate(blobs):
        binder = ContributionBinder(1, NodeChain(probe.client(j + 1)), cfg.diloco,
                                    refuse_raw=cfg.compression.enabled)
        signed.append((probe.client(j + 1).address, binder.sign(1, 0, blob, SHAPES)[1]))
    return signed


@pytest.fixture
def world(tmp_path, request):
    """A chunked (version-2) run's, or the version ``request.param`` names ("auto": the default, version
    3)."""
    version = getattr(request, "param", "chunked")
    cfg = load_config(None, ["diloco.outer_lr=0.7", "diloco.outer_momentum=0.9", "pipeline.num_stages=2",
                             f"diloco.commitments={version}"])
    assert cfg.diloco.commitments == {"auto": "normed"}.get(version, version) \
        and cfg.commitment_scheme.chunked
    layout = RunLayout(1, b"\x07" * 32, {}, (SHAPES, OTHER), chunked=True)
    weights, momentum = tensors(1, SHAPES), tensors(2, SHAPES, scale=0.1)
    blobs = [contribution(SHAPES, "lowrank", 30, rank=4), contribution(SHAPES, "quant", 31)]
    aggregation = aggregate_with_report(weights, momentum, blobs, cfg.diloco, stage_index=0, outer_round=1,
                                        compression_cfg=cfg.compression)
    assert all(report.accepted for report in aggregation.contributions)
    other = initial_state(1, tensors(3, OTHER), tensors(4, OTHER, 0.0))
    hosts = [P2PHost.start(P2PConfig(listen_port=0), Identity.generate(), data_dir=tmp_path / f"host{i}")
             for i in range(2)]
    stop = threading.Event()
    yield World(cfg, layout, weights, momentum, blobs, aggregation, other, hosts, stop)
    stop.set()
    for host in hosts:
        host.close()


def _states(world: World, host, kind=ChunkedStates) -> ChunkedStates:
    states = kind(cfg=world.cfg, host=host, layout=world.layout, config_hash=world.layout.config_hash)
    states.replace(0, 0, initial_state(0, world.weights, world.momentum))
    return states


def _record(world: World, states: ChunkedStates, weights: dict, momentum: dict | None = None) -> bytes:
    envelopes = [hashlib.sha256(b"envelope" + blob).digest() for blob in world.blobs]
    return states.record(1, 0, weights, world.aggregation.new_momentum if momentum is None else momentum,
                         world.aggregation.contributions, world.blobs, envelopes, world.bindings)


def _one_element_changed(weights: dict) -> dict:
    changed = {name: tensor.clone() for name, tensor in weights.items()}
    value = changed["a.weight"][3, 17]
    changed["a.weight"][3, 17] = torch.nextafter(value, value + 1)  # one ulp: the smallest change there is
    return changed


def _setup(world: World, tmp_path, states: ChunkedStates, committed_leaf: bytes, own_leaf: bytes,
           colluder_peer: str):
    """The chain (rounds 0 and 1 committed by the colluders, round 1 with ``committed_leaf``), the book of
    attestations the prover heard, and the prover (member 3, holding stage 0). The run is created with the
    commitments version of ``world.cfg`` (RunParams.commitments)."""
    deployment = deploy(connect_pyevm(), min_stake=STAKE)
    run = deployment.member_run((1, 2, 3), quorum=2, min_stake=STAKE,
                                commitments=world.cfg.commitment_scheme.version)
    # what _bindings signed for: run 1 of the ledger every fresh deployment gets
    assert run.run_id == 1 and all(ledger == deployment.ledger for ledger in _LEDGERS)
    start = initial_state(0, world.weights, world.momentum).leaf().encode()
    other = world.other.leaf().encode()
    book, records = RoundBook(), []
    prover_peer, second = world.hosts[1].peer_id, Identity.generate().peer_id
    for outer_round, (stage0, own0) in enumerate([(start, start), (committed_leaf, own_leaf)]):
        if outer_round:  # round 0's window closes first: round 1's proof is taken at once (issue 62)
            mine(deployment.w3, run.client(1).run_struct(run.run_id)["disputeBlocks"])
        record = dataclasses.replace(run.next_record(), weights_root=chunked_weights_root(
            [StageLeaf.decode(stage0), StageLeaf.decode(other)]))
        run.client(1).commit_round(record, run.sign(record, COLLUDERS))
        records.append(record)
        for peer, leaf in ((colluder_peer, stage0), (second, stage0), (prover_peer, own0)):
            book.add_attestation(outer_round, 0, peer, _attestation(leaf))
            book.add_attestation(outer_round, 1, peer, _attestation(other))
    prover = FraudProver(run_id=run.run_id, chain=NodeChain(deployment.client(PROVER)), book=book,
                         states=states, stages=lambda: (0,), num_stages=2, stop=world.stop,
                         proofs_dir=tmp_path / "proofs")
    mine_record = dataclasses.replace(records[1], weights_root=chunked_weights_root(
        [StageLeaf.decode(own_leaf), StageLeaf.decode(other)]))
    return deployment, run, records, prover, mine_record


def _attestation(leaf: bytes) -> msg.Attestation:
    return msg.Attestation(b"\x01" * 32, b"\x02" * 32, 2, float("nan"), float("nan"), 0, b"", b"", leaf)


@pytest.mark.parametrize("world", ["chunked", "auto"], indirect=True)
def test_one_honest_node_alone_proves_a_colluding_quorums_one_element_change(world, tmp_path):
    colluder_host, prover_host = world.hosts
    colluders = _states(world, colluder_host)
    honest = _states(world, prover_host)
    own_leaf = _record(world, honest, world.aggregation.new_global)
    wrong_leaf = _record(world, colluders, _one_element_changed(world.aggregation.new_global))
    assert own_leaf != wrong_leaf
    prover_host.connect(colluder_host.listen_addrs[0])
    deployment, run, records, prover, mine_record = _setup(world, tmp_path, honest, wrong_leaf, own_leaf,
                                                           colluder_host.peer_id)
    client = deployment.client(PROVER)
    before = client.balance()
    prover.check(0, records[0], records[0])  # agreed: nothing to do, its committed leaves remembered
    assert not prover.log.proofs and not prover.log.unprovable
    prover.check(1, records[1], mine_record)
    assert set(prover.log.proofs) == {1}, prover.log.unprovable
    assert client.invalid_from(run.run_id) == 1 and not client.is_final(run.run_id, 1)
    for index in COLLUDERS:
        assert client.member(run.run_id, deployment.client(index).address).status == "slashed"
    assert client.member(run.run_id, client.address).status == "active"
    assert client.balance() > before + STAKE // 2  # half of the two slashed stakes, less the gas
    kept = json.loads((tmp_path / "proofs" / "round-00000001-stage0.json").read_text())
    proof = AggregationProof.from_json(kept["proof"])
    assert proof.stage == 0 and proof.record == records[1].fields() and len(kept["attesters"]) == 2
    history = client.history(run.run_id)
    assert history.dispute_outcomes == {1: "proven wrong"}
    standing = round_standing(history, client.chain_id, client.ledger_address)
    assert standing[0] is None and standing[1] is not None  # pull refuses round 1, not round 0
    prover.check(1, records[1], mine_record)  # seen again: already invalid, it says so and sends nothing
    assert "already invalid" in prover.log.unprovable[1]


@pytest.mark.parametrize("world", ["chunked", "auto"], indirect=True)
def test_a_withheld_state_is_challenged_and_the_round_invalidated_unanswered(world, tmp_path):
    colluder_host, prover_host = world.hosts
    colluders = _states(world, colluder_host, WithholdingStates)
    honest = _states(world, prover_host)
    own_leaf = _record(world, honest, world.aggregation.new_global)
    wrong_leaf = _record(world, colluders, _one_element_changed(world.aggregation.new_global))
    prover_host.connect(colluder_host.listen_addrs[0])
    deployment, run, records, prover, mine_record = _setup(world, tmp_path, honest, wrong_leaf, own_leaf,
                                                           colluder_host.peer_id)
    prover.check(0, records[0], records[0])
    prover.check(1, records[1], mine_record)
    assert set(prover.log.challenges) == {1} and not prover.log.proofs
    client = deployment.client(PROVER)
    assert client.invalid_from(run.run_id) is None
    assert prover.settle_challenges()  # not due yet: still pending
    mine(deployment.w3, client.run_struct(run.run_id)["accusationBlocks"])
    assert not prover.settle_challenges()
    assert set(prover.log.expired) == {1} and client.invalid_from(run.run_id) == 1
    for index in COLLUDERS:
        assert client.member(run.run_id, deployment.client(index).address).status == "slashed"
    prover.stop.set()


@pytest.mark.parametrize(("weights_wrong", "momentum_wrong"), [(True, False), (True, True), (False, True)],
                         ids=["weights", "weights-and-momentum", "momentum"])
def test_a_withheld_state_answered_leaf_by_leaf_is_still_proven(world, tmp_path, weights_wrong,
                                                                momentum_wrong):
    """The colluders withhold their state, then answer every availability challenge with their (wrong) leaves:
    each answer's path shows the honest node which subtree differs from its own, so it challenges its way down
    to the wrong chunk (a bisection, one bond per leaf) and proves it from the published leaves."""
    from node.live.fraud.answerer import ChallengeAnswerer

    colluder_host, prover_host = world.hosts
    colluders = _states(world, colluder_host, WithholdingStates)
    honest = _states(world, prover_host)
    own_leaf = _record(world, honest, world.aggregation.new_global)
    weights, momentum = world.aggregation.new_global, world.aggregation.new_momentum
    wrong_leaf = _record(world, colluders, _one_element_changed(weights) if weights_wrong else weights,
                         _one_element_changed(momentum) if momentum_wrong else momentum)
    prover_host.connect(colluder_host.listen_addrs[0])
    deployment, run, records, prover, mine_record = _setup(world, tmp_path, honest, wrong_leaf, own_leaf,
                                                           colluder_host.peer_id)
    colluder = FraudProver(run_id=run.run_id, chain=NodeChain(deployment.client(COLLUDERS[0])),
                           book=prover.book, states=colluders, stages=lambda: (0,), num_stages=2,
                           stop=world.stop)
    answerer = ChallengeAnswerer(run_id=run.run_id, chain=colluder.chain, states=colluders, prover=colluder,
                                 stop=world.stop)
    prover.check(0, records[0], records[0])
    prover.check(1, records[1], mine_record)
    assert set(prover.log.challenges) == {1} and not prover.log.proofs
    chunks = len(honest.state(1, 0).weight_leaves)
    # Each answer at least halves the subtree the wrong chunk is in. The prover's expirer thread may take an
    # answered challenge (and send the proof) rather than this loop: wait for it, a generous bound.
    deadline = time.monotonic() + 300
    while not prover.log.proofs and not prover.log.unprovable and time.monotonic() < deadline:
        answerer.poll()
        prover.settle_challenges()
        prover.stop.wait(0.2)
    assert set(prover.log.proofs) == {1}, prover.log.unprovable
    answered = sorted(answerer.answered.values())
    assert all(a.startswith("answered") for a in answered) and len(answered) <= chunks.bit_length() + 1, \
        answered
    # The changed element's chunk is opened in each tree that differs, and nothing of a tree that does not
    # (its leaf is this node's own).
    assert any("leaf 4 of tree 0" in a for a in answered) == any("of tree 0" in a for a in answered) \
        == weights_wrong
    assert any("leaf 4 of tree 1" in a for a in answered) == any("of tree 1" in a for a in answered) \
        == momentum_wrong
    client = deployment.client(PROVER)
    assert client.invalid_from(run.run_id) == 1 and not prover.log.expired
    for index in COLLUDERS:
        assert client.member(run.run_id, deployment.client(index).address).status == "slashed"
    kept = json.loads((tmp_path / "proofs" / "round-00000001-stage0.json").read_text())
    assert AggregationProof.from_json(kept["proof"]).chunk == 4
    assert not prover.settle_challenges()  # nothing left pending
    prover.stop.set()


def test_a_right_round_other_factors_or_a_bad_leaf_send_nothing(world, tmp_path):
    colluder_host, prover_host = world.hosts
    honest = _states(world, prover_host)
    own_leaf = _record(world, honest, world.aggregation.new_global)
    # A right round: the committed root is this node's own.
    deployment, run, records, prover, mine_record = _setup(world, tmp_path, honest, own_leaf, own_leaf,
                                                           colluder_host.peer_id)
    prover.check(0, records[0], records[0])
    prover.check(1, records[1], mine_record)
    assert not prover.log.proofs and not prover.log.challenges and not prover.log.unprovable
    # Other factors (a clip scale, the set left out): not provable by a chunk; said, nothing sent.
    other_factors = dataclasses.replace(StageLeaf.decode(own_leaf),
                                        factors_hash=digest("other factors")).encode()
    deployment, run, records, prover, mine_record = _setup(world, tmp_path, honest, other_factors, own_leaf,
                                                           colluder_host.peer_id)
    prover.check(0, records[0], records[0])
    prover.check(1, records[1], mine_record)
    assert "factors" in prover.log.unprovable[1] and not prover.log.proofs and not prover.log.challenges
    assert deployment.client(PROVER).invalid_from(run.run_id) is None
    # A malformed leaf in the attestations: it counts for nothing, the committed leaves are not found.
    book = prover.book
    bad = bytearray(own_leaf)
    bad[0] = 1  # a uint32 with bits above 32 set: not an ABI encoding
    for outer_round in (0, 1):
        book.attestations[(outer_round, 0)] = {peer: _attestation(bytes(bad)) for peer in book.attestations[
            (outer_round, 0)]}
    fresh = FraudProver(run_id=run.run_id, chain=prover.chain, book=book, states=honest, stages=lambda: (0,),
                        num_stages=2, stop=world.stop)
    fresh.check(1, records[1], mine_record)
    assert "no attested stage leaves" in fresh.log.unprovable[1] and not fresh.log.proofs


def test_a_chunked_runs_checkpoint_is_verified_by_its_stage_leaves(world):
    """A chunked run's checkpoint carries its stage leaves: weights and momentum must be their chunks, and the
    leaves' root the record's; a hashed checkpoint (no leaves) or a doctored momentum is refused."""
    layout = RunLayout(1, b"\x07" * 32, {}, (SHAPES, OTHER), chunked=True)
    first = initial_state(0, world.weights, world.momentum)
    states = {0: (world.weights, world.momentum), 1: (tensors(3, OTHER), tensors(4, OTHER, 0.0))}
    leaves = {0: first.leaf().encode(), 1: world.other.leaf().encode()}
    root = chunked_weights_root([first.leaf(), world.other.leaf()])
    full = build_checkpoint(layout, 4, states, leaves)
    assert checkpoint_problems(full, layout, 4, root) == []
    assert any("weightsRoot" in p for p in checkpoint_problems(full, layout, 4, digest("another root")))
    assert any("stage leaves of stages []" in p
               for p in checkpoint_problems(build_checkpoint(layout, 4, states),
                                              layout, 4, root))
    doctored = {**states, 0: (world.weights, {n: t + 1 for n, t in world.momentum.items()})}
    assert any("not the chunks" in p
               for p in checkpoint_problems(build_checkpoint(layout, 4, doctored, leaves),
                                                                 layout, 4, root))


def test_a_back_door_root_is_challenged_for_its_stage_leaf_and_falls_unanswered(world, tmp_path):
    """The colluders commit a weights root with no stage leaves behind it: nobody can open a chunk of it, so
    the honest node challenges them to publish a stage leaf itself; nobody can, and the round falls."""
    colluder_host, prover_host = world.hosts
    honest = _states(world, prover_host)
    own_leaf = _record(world, honest, world.aggregation.new_global)
    deployment, run, records, prover, mine_record = _setup(world, tmp_path, honest, own_leaf, own_leaf,
                                                           colluder_host.peer_id)
    door = dataclasses.replace(run.next_record(), weights_root=digest("back door"))
    run.client(1).commit_round(door, run.sign(door, COLLUDERS))
    prover.check(2, door, dataclasses.replace(door, weights_root=mine_record.weights_root))
    assert set(prover.log.challenges) == {2} and "no attested stage leaves" in prover.log.unprovable[2]
    client = deployment.client(PROVER)
    mine(deployment.w3, client.run_struct(run.run_id)["accusationBlocks"])
    assert not prover.settle_challenges()
    assert set(prover.log.expired) == {2} and client.invalid_from(run.run_id) == 2
    for index in COLLUDERS:
        assert client.member(run.run_id, deployment.client(index).address).status == "slashed"
    prover.stop.set()


def test_the_challenges_of_a_right_round_are_answered_and_it_stands(world, tmp_path):
    """A griefer challenges a right round (a weights chunk, a payload piece, the stage leaf): every honest
    node answers from what it holds, the griefer's bonds are forfeited and the round is never invalidated."""
    from ledger.availability import PAYLOAD, STAGE_LEAF, WEIGHTS, availability_target, stage_leaf_target
    from ledger.errors import ProverChallengeSettled
    from node.live.fraud.answerer import ChallengeAnswerer

    colluder_host, prover_host = world.hosts
    honest = _states(world, prover_host)
    own_leaf = _record(world, honest, world.aggregation.new_global)
    deployment, run, records, prover, _mine = _setup(world, tmp_path, honest, own_leaf, own_leaf,
                                                     colluder_host.peer_id)
    griefer = deployment.client(6)
    leaves = [StageLeaf.decode(own_leaf), world.other.leaf()]
    factors = honest.state(1, 0).factors
    targets = [availability_target(records[1], leaves, factors, 0, WEIGHTS, 2),
               availability_target(records[1], leaves, factors, 0, PAYLOAD + 1, 0),
               stage_leaf_target(records[1], 1)]
    challenges = [griefer.challenge_availability(target) for target in targets]
    answerer = ChallengeAnswerer(run_id=run.run_id, chain=prover.chain, states=honest, prover=prover,
                                 stop=world.stop)
    answerer.poll()
    assert all(answerer.answered[c].startswith("answered") for c in challenges), answerer.answered
    answerer.poll()  # seen again: nothing sent twice
    mine(deployment.w3, griefer.run_struct(run.run_id)["accusationBlocks"])
    for challenge in challenges:
        assert griefer.challenge_of(challenge)["settled"]
        with pytest.raises(ProverChallengeSettled):
            griefer.expire_challenge(challenge)
    assert griefer.invalid_from(run.run_id) is None
    assert STAGE_LEAF == deployment.client(PROVER).sender.call(deployment.client(PROVER)._prover,
                                                                "STAGE_LEAF")


def test_a_right_rounds_state_is_kept_while_it_can_be_challenged(world, tmp_path):
    """A late challenge of a right round, many rounds after it, is still answered: a node keeps its state of a
    round until the round's dispute window closes on chain (node/live/fraud/chunkstate.py, DisputeWindow), not
    a fixed number of rounds, or a griefer's late challenge would overturn a right round and slash its honest
    attesters. Once the window has closed the state is dropped (and no challenge can be opened any more)."""
    from ledger.availability import WEIGHTS, availability_target
    from ledger.errors import ProverChallengeTooLate
    from node.live.fraud.answerer import ChallengeAnswerer
    from node.live.fraud.chunkstate import PUBLISHED_ROUNDS, DisputeWindow

    colluder_host, prover_host = world.hosts
    honest = _states(world, prover_host)
    own_leaf = _record(world, honest, world.aggregation.new_global)
    deployment, run, records, prover, _mine = _setup(world, tmp_path, honest, own_leaf, own_leaf,
                                                     colluder_host.peer_id)
    honest.window = DisputeWindow(prover.chain, run.run_id)
    later = 1 + PUBLISHED_ROUNDS + 20  # the node has finished many rounds since
    honest.forget_before(later)
    # round 1 is still disputable (round 0's window closed before round 1 was committed: its state is gone)
    assert honest.state(1, 0) is not None and honest.state(0, 0) is None
    griefer = deployment.client(6)
    leaves = [StageLeaf.decode(own_leaf), world.other.leaf()]
    target = availability_target(records[1], leaves, honest.state(1, 0).factors, 0, WEIGHTS, 2)
    challenge = griefer.challenge_availability(target)
    answerer = ChallengeAnswerer(run_id=run.run_id, chain=prover.chain, states=honest, prover=prover,
                                 stop=world.stop)
    answerer.poll()
    assert answerer.answered[challenge].startswith("answered"), answerer.answered
    # the answer gave the griefer's game a fresh window: the state is kept until the round's proof window
    # (extended by the game, issue 62) closes
    mine(deployment.w3, prover.chain.run_info(run.run_id).dispute_blocks + 1)
    honest.forget_before(later)
    _opens, closes = griefer.proof_window_of(run.run_id, 1)
    assert deployment.w3.eth.block_number < closes and honest.state(1, 0) is not None
    mine(deployment.w3, closes - deployment.w3.eth.block_number)
    honest.forget_before(later)
    assert honest.state(1, 0) is None and honest.state(0, 0) is None
    with pytest.raises(ProverChallengeTooLate):
        griefer.challenge_availability(target)
    assert griefer.invalid_from(run.run_id) is None


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


NORMED_RUN = ["diloco.outer_lr=0.7", "diloco.outer_momentum=0.9", "pipeline.num_stages=2",
              "compression.enabled=false"]


@contextlib.contextmanager
def _normed_world(tmp_path, blobs: list):
    """A version-3 (normed) run's world over ``blobs`` (aggregated by the rule), with the colluders' config
    (version-2 factors, ``norm_clip`` 0: every scale 1.0) and their aggregation; hosts and provers stopped at
    the end. Yields (world, the colluders' config, their aggregation)."""
    cfg = load_config(None, [*NORMED_RUN, "diloco.commitments=normed"])
    chunked = load_config(None, [*NORMED_RUN, "diloco.commitments=chunked", "diloco.norm_clip=0"])
    layout = RunLayout(1, b"\x07" * 32, {}, (SHAPES, OTHER), chunked=True)
    weights, momentum = tensors(1, SHAPES), tensors(2, SHAPES, scale=0.1)
    aggregation = aggregate_with_report(weights, momentum, blobs, cfg.diloco, stage_index=0, outer_round=1,
                                        compression_cfg=cfg.compression)
    colluded = aggregate_with_report(weights, momentum, blobs, chunked.diloco, stage_index=0, outer_round=1,
                                     compression_cfg=chunked.compression)
    other = initial_state(1, tensors(3, OTHER), tensors(4, OTHER, 0.0))
    hosts = [P2PHost.start(P2PConfig(listen_port=0), Identity.generate(), data_dir=tmp_path / f"host{i}")
             for i in range(2)]
    stop = threading.Event()
    try:
        yield World(cfg, layout, weights, momentum, blobs, aggregation, other, hosts, stop), chunked, colluded
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
        colluders = _states(dataclasses.replace(world, cfg=chunked), colluder_host)
        own_leaf = _record(world, honest, honest_aggregation.new_global)
        envelopes = [hashlib.sha256(b"envelope" + blob).digest() for blob in blobs]
        wrong_leaf = colluders.record(1, 0, colluded.new_global, colluded.new_momentum,
                                      colluded.contributions, blobs,
                                      envelopes)  # a chunked node publishes no factors
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
