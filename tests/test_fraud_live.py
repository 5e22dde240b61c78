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

import dataclasses
import json
import threading
import time

import pytest

from ledger.chunkproof import AggregationProof, StageLeaf, chunked_weights_root
from node.config import load_config
from node.fraudproof import initial_state
from node.live.fraud.prover import FraudProver
from node.store.checkpoint import RunLayout, build_checkpoint, checkpoint_problems
from node.tools.pull import round_standing
from p2p.config import P2PConfig
from p2p.host import P2PHost
from p2p.identity import Identity
from tests.fraud_fixtures import OTHER, contribution, tensors
from tests.ledger_fixtures import digest, mine
from training.diloco import aggregate_with_report

from tests.fraud_live_fixtures import (COLLUDERS, PROVER, SHAPES, STAKE, World,
                                        WithholdingStates, _attestation, _one_element_changed,
                                        _record, _setup, _states, colluders_answerer)


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


@pytest.mark.parametrize("world", ["auto"], indirect=True)
def test_a_colluders_state_written_only_when_asked_is_fetched_and_proven_wrong(world, tmp_path):
    """The colluders publish their state as every node does by default (storage.start_states = "rebuild",
    with a spill directory: node/live/fraud/stateserve.py): only its hash when published, its bytes written
    when the prover asks. The prover's fetch gets them and the round is proven wrong as before."""
    from functools import partial

    from node.live.fraud.chunkstate import ChunkedStates

    colluder_host, prover_host = world.hosts
    colluders = _states(world, colluder_host, partial(ChunkedStates, spill_dir=tmp_path / "colluder-states"))
    honest = _states(world, prover_host)
    own_leaf = _record(world, honest, world.aggregation.new_global)
    wrong_leaf = _record(world, colluders, _one_element_changed(world.aggregation.new_global))
    assert colluders.on_ask is not None and colluders.on_ask.pending_rounds() == [1]
    assert list(colluder_host.store.packed_dir.glob("*.manifest")) == []  # the factors' blob is a file
    prover_host.connect(colluder_host.listen_addrs[0])
    deployment, run, records, prover, mine_record = _setup(world, tmp_path, honest, wrong_leaf, own_leaf,
                                                           colluder_host.peer_id)
    prover.check(0, records[0], records[0])
    prover.check(1, records[1], mine_record)
    assert set(prover.log.proofs) == {1}, prover.log.unprovable
    assert deployment.client(PROVER).invalid_from(run.run_id) == 1
    assert colluders.on_ask.written == 1 and colluders.on_ask.pending_rounds() == []


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
    answerer = colluders_answerer(world, deployment, run.run_id, prover, colluders)
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
    # Each answer was looked for from the block before its challenge was opened, not from the run's start
    # (issue 79: the look-up's cost grew with the run): that block is never after the challenge's own.
    opened = {bytes(c["id"]): c["block"] for c in client.availability_challenges(run.run_id, 0)}
    looked_from = prover.chain._challenge_opened
    assert set(prover.log.challenges.values()) <= set(looked_from)
    assert all(0 < looked_from[cid] <= opened[cid] for cid in looked_from), (looked_from, opened)
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
    # Other factors that nobody serves: opened on chain (a FACTORS challenge: since issue 62 a version-2
    # round's factors are held to the run's values too, tests/test_fraud_live_rank.py), no proof sent.
    other_factors = dataclasses.replace(StageLeaf.decode(own_leaf),
                                        factors_hash=digest("other factors")).encode()
    deployment, run, records, prover, mine_record = _setup(world, tmp_path, honest, other_factors, own_leaf,
                                                           colluder_host.peer_id)
    prover.check(0, records[0], records[0])
    prover.check(1, records[1], mine_record)
    assert set(prover.log.challenges) == {1} and not prover.log.proofs and 1 not in prover.log.unprovable
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
    round until the round's dispute window closes on chain (node/live/fraud/window.py, DisputeWindow), not
    a fixed number of rounds, or a griefer's late challenge would overturn a right round and slash its honest
    attesters. Once the window has closed the state is dropped (and no challenge can be opened any more)."""
    from ledger.availability import WEIGHTS, availability_target
    from ledger.errors import ProverChallengeTooLate
    from node.live.fraud.answerer import ChallengeAnswerer
    from node.live.fraud.chunkstate import PUBLISHED_ROUNDS
    from node.live.fraud.window import DisputeWindow

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



def test_a_spilled_state_answers_a_challenge_in_the_last_block_of_its_proof_window(world, tmp_path):
    """Retention (issue 75): a spilled state keeps only what the published state and the contributions' codec
    blobs do not hold (its weights and momentum are read back from the blob this node publishes of the round,
    its payload pieces cut again from the blobs). A challenge of a right round
    in the last block of its proof window, after the node has pruned every older round and spilled this one,
    is still answered: every chunk of it is served from the spilled file and the published blob."""
    from ledger.availability import MOMENTUM, PAYLOAD, WEIGHTS, availability_target
    from node.live.fraud.answerer import ChallengeAnswerer
    from node.live.fraud.chunkstate import PUBLISHED_ROUNDS, DisputeWindow
    from node.live.fraud.spillfile import encode_spilled

    colluder_host, prover_host = world.hosts
    honest = _states(world, prover_host)
    honest.spill_dir = tmp_path / "chunk-states"
    honest.spill_dir.mkdir()
    own_leaf = _record(world, honest, world.aggregation.new_global)
    whole = honest.state(1, 0)
    deployment, run, records, prover, _mine = _setup(world, tmp_path, honest, own_leaf, own_leaf,
                                                     colluder_host.peer_id)
    honest.window = DisputeWindow(prover.chain, run.run_id)
    honest.forget_before(1 + PUBLISHED_ROUNDS + 20)
    assert honest.in_memory() == [] and honest.state(0, 0) is None
    spilled = honest.spill_dir / "round-00000001-stage-0.state"
    stage_leaves = sum(len(leaf) for leaf in (*whole.weight_leaves, *whole.momentum_leaves))
    pieces = sum(len(piece) for leaves in whole.payload_leaves for piece in leaves)
    # what was spilled before (the pieces as bytes, not cut from their blobs when read): now neither
    # leaves nor pieces
    spilled_whole = len(encode_spilled(dataclasses.replace(
        whole, payload_leaves=[list(leaves) for leaves in whole.payload_leaves])))
    blobs = sum(map(len, world.blobs))
    assert spilled.stat().st_size < spilled_whole - stage_leaves - pieces + blobs + 1024, \
        (spilled.stat().st_size, spilled_whole, stage_leaves, pieces, blobs)
    griefer = deployment.client(6)
    _opens, closes = griefer.proof_window_of(run.run_id, 1)
    mine(deployment.w3, closes - 2 - deployment.w3.eth.block_number)  # the challenge is mined in closes - 1
    leaves = [StageLeaf.decode(own_leaf), world.other.leaf()]
    last = len(whole.weight_leaves) - 1
    targets = [availability_target(records[1], leaves, whole.factors, 0, WEIGHTS, last),
               availability_target(records[1], leaves, whole.factors, 0, MOMENTUM, 0),
               availability_target(records[1], leaves, whole.factors, 0, PAYLOAD + 1, 0)]
    challenges = [griefer.challenge_availability(targets[0])]
    assert deployment.w3.eth.block_number == closes - 1
    answerer = ChallengeAnswerer(run_id=run.run_id, chain=prover.chain, states=honest, prover=prover,
                                 stop=world.stop)
    answerer.poll()
    assert answerer.answered[challenges[0]].startswith("answered"), answerer.answered
    challenges += [griefer.challenge_availability(t) for t in targets[1:]]  # the game's fresh window: open
    answerer.poll()
    assert all(answerer.answered[c].startswith("answered") for c in challenges), answerer.answered
    assert honest.state(1, 0) == whole
    assert griefer.invalid_from(run.run_id) is None
