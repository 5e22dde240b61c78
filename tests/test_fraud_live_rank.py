"""The live prover proves a round that lists a contribution whose piece has a rank past the run's ``maxRank``,
and a version-2 round's factors held to the run's values (issue 62; docs/FRAUD_PROOF.md, "The node's proofs of
the values"), in process as tests/test_fraud_live_values.py: real libp2p hosts, py-evm, the node's own parts
(node/live/fraud/prover.py, factors.py, values.py, chunkstate.py), the real contracts.

Members 1 and 2 (the quorum) collude; member 3, honest and outside the quorum, proves. A low-rank piece past
the run's ``maxRank`` (64, the decoder's) does not decode for any honest node, which leaves the contribution
out (``undecodable``); the colluders list it anyway, signed by one of them. The contract refuses to decode
such a piece (``ProverCommon.wellFormedPiece``), so the chunk proof of a chunk it touches proves the round
wrong whatever its weights: the honest node cuts the pieces of the contribution it left out
(training.chunks.cut_payload), fetches the committed state from an attester and sends it. Before, it logged
the round unprovable (the set left out differs). A version-2 round publishes its factors now (beside its
state, ``ChunkedScheme.published_parts``), so a chunked run's values are held and proven the same way.
"""

from __future__ import annotations

import dataclasses
import hashlib

import msgpack
import numpy as np
import pytest

from ledger.chain import connect_pyevm
from ledger.chunkproof import AggregationProof, Norms, tree_root
from ledger.contribution_binding import ContributionClaim
from ledger.normproof import SumTree
from ledger.runparams import MAX_RANK
from node.config import load_config
from node.fraudproof import initial_state
from node.live.fraud.chunkstate import ChunkedStates
from node.live.fraud.values import piece_past_rank
from tests.fraud_fixtures import contribution
from tests.fraud_live_fixtures import (_LEDGERS, NORMED_RUN, SHAPES, _normed_world, _one_element_changed,
                                       _setup, _states, run_values)
from tests.ledger_fixtures import deploy
from tests.test_fraud_live_values import _adversary, _assert_overturned, _envelopes, _kept, _lied_leaf
from training.chunks import cut_payload, payload_leaves
from training.codec_exact import pack_ints
from training.diloco import aggregate_with_report
from training.errors import ContributionDecodeError

EVIL_RANK = MAX_RANK + 1
COLLUDER = 2  # signs the contribution of a rank past the run's


def _past_rank(seed: int = 40) -> bytes:
    """A contribution whose matrix tensor is coded at rank ``EVIL_RANK`` (within its 80 columns, past the
    decoder's and the run's 64): what a colluder's modified encoder may send."""
    blob = msgpack.unpackb(contribution(SHAPES, "lowrank", seed, rank=4), raw=False)
    rng = np.random.default_rng(seed)
    for entry in blob["t"]:
        if entry["c"] != "lowrank":
            continue
        (m, n), bits = entry["s"], entry["b"]
        entry.update(r=EVIL_RANK, p=pack_ints(_ints(rng, m * EVIL_RANK), bits),
                     q=pack_ints(_ints(rng, n * EVIL_RANK), bits),
                     w=rng.integers(0, 65536, EVIL_RANK).astype("<u2").tobytes())
    return msgpack.packb(blob, use_bin_type=True)


def _ints(rng, count: int):
    import torch

    return torch.from_numpy(rng.integers(-100, 101, count))


def _blobs() -> list[bytes]:
    """Member 1's low-rank contribution, colluder 2's past the rank, member 3's raw one."""
    return [contribution(SHAPES, "lowrank", 30, rank=4), _past_rank(),
            contribution(SHAPES, "raw", 32, scale=0.5)]


def test_a_piece_past_the_rank_does_not_decode_here_and_is_cut_for_the_proof():
    evil = _past_rank()
    with pytest.raises(ContributionDecodeError, match="rank 65"):
        payload_leaves(evil, SHAPES)
    pieces = cut_payload(evil, SHAPES)
    chunk = piece_past_rank(pieces, MAX_RANK)
    assert chunk == 0 and pieces[0][5] == EVIL_RANK  # a.weight is the first tensor: its pieces carry the rank
    assert piece_past_rank(pieces, EVIL_RANK) is None
    assert piece_past_rank(payload_leaves(_blobs()[0], SHAPES), MAX_RANK) is None
    for garbage in (b"", b"\x93\x01", msgpack.packb({"t": [{"n": "a.weight", "c": "lowrank"}]})):
        with pytest.raises((ValueError, KeyError, TypeError, IndexError)):
            cut_payload(garbage, SHAPES)


def test_a_node_keeps_only_the_pieces_a_rank_proof_needs():
    """node/live/fraud/leftout.py: of what a round left out, only an undecodable contribution with a low-rank
    piece past 64 is kept (its pieces are what a rank proof sends); one left out for another reason (here a
    piece of rank 4 whose header names another round: undecodable, but no piece past the rank) is not."""
    from node.live.fraud.leftout import left_out_pieces
    from tests.fraud_fixtures import DILOCO, tensors

    weights, momentum = tensors(1, SHAPES), tensors(2, SHAPES, scale=0.1)
    blobs = [*_blobs(), contribution(SHAPES, "lowrank", 33, rank=4, outer_round=7)]
    aggregation = aggregate_with_report(weights, momentum, blobs, DILOCO, stage_index=0, outer_round=1)
    reports = aggregation.contributions
    assert [r.reason for r in reports if not r.accepted] == ["undecodable", "undecodable"]
    kept = left_out_pieces(reports, blobs, weights)
    assert list(kept) == [tree_root(cut_payload(blobs[1], SHAPES))]


def _listing_the_evil(world, honest_state, evil: bytes, outer_round: int = 1):
    """The colluders' state: the honest aggregation's state with the contribution past the rank listed at its
    place (index 1), its scale 1.0, its sum tree and sums made up, signed by the colluder; the weights one
    element off (their step with it)."""
    pieces = cut_payload(evil, SHAPES)
    factors = honest_state.factors
    at = 1
    envelope = _envelopes([evil])[0]
    root = tree_root(pieces)

    def insert(values, value):
        return (*values[:at], value, *values[at:])

    norms = factors.norms
    sum_trees = list(honest_state.sum_trees)
    if norms is not None:
        tree = SumTree.of([1] * len(pieces))
        probe = deploy(connect_pyevm())
        assert probe.ledger in _LEDGERS
        signature = probe.client(COLLUDER).sign_contribution(
            ContributionClaim(1, outer_round, 0, root, tree.root, 0))
        norms = Norms(norms.clip_bits, norms.steps, insert(norms.roots, tree.root),
                      insert(norms.sums, tree.total),
                      insert(norms.contributors, probe.client(COLLUDER).address),
                      insert(norms.signatures, signature))
        sum_trees.insert(at, tree)
    listed = dataclasses.replace(factors, envelopes=insert(factors.envelopes, envelope),
                                 payload_roots=insert(factors.payload_roots, root),
                                 scale_bits=insert(factors.scale_bits, 0x3FF0000000000000), norms=norms)
    return listed, [*honest_state.payload_leaves[:at], pieces, *honest_state.payload_leaves[at:]], sum_trees


def _colluders_record(world, host, honest_state, evil: bytes) -> bytes:
    """Record, keep and serve the colluders' state (as their modified ChunkedStates.record would)."""
    from training.chunks import tensor_leaves

    colluders = _states(world, host)
    factors, payload, trees = _listing_the_evil(world, honest_state, evil)
    weights = _one_element_changed(world.aggregation.new_global)
    state = dataclasses.replace(honest_state, weight_leaves=tensor_leaves(weights), factors=factors,
                                payload_leaves=payload, sum_trees=trees)
    leaf = state.leaf().encode()
    colluders.replace(1, 0, state)
    colluders.publish(1, 0, leaf, weights, world.aggregation.new_momentum)
    for alias, blob in colluders.scheme.published_parts(leaf, state):
        colluders.publish_part(1, 0, alias, blob)
    return leaf


@pytest.mark.parametrize("version, how", [("normed", "closed"), ("chunked", "closed"),
                                          ("normed", "rejected")])
def test_a_round_listing_a_piece_past_the_runs_rank_is_proven_by_the_live_node(tmp_path, caplog, version,
                                                                                how):
    """``closed``: the honest node closed the contribution and left it out (undecodable); ``rejected``: it
    refused it when it fetched it (the exchange's pool: its payload does not decode), so it closed the other
    two (another contributions root) and holds only the signed envelope it kept as evidence."""
    with _normed_world(tmp_path, _blobs()) as (world, _chunked, _colluded):
        if version == "chunked":
            world.cfg = load_config(None, [*NORMED_RUN, "diloco.commitments=chunked"])
        world.bindings = _bindings_or_none(world)
        evil = world.blobs[1]
        if how == "rejected":  # its close: the two contributions it fetched
            world.blobs = [world.blobs[0], world.blobs[2]]
            world.bindings = world.bindings and [world.bindings[0], world.bindings[2]]
        world.aggregation = _aggregated(world)
        reports = world.aggregation.contributions
        assert [r.reason for r in reports if not r.accepted] == (["undecodable"] if how == "closed" else [])
        colluder_host, prover_host = world.hosts
        honest = ChunkedStates(cfg=world.cfg, host=prover_host, layout=world.layout,
                               config_hash=world.layout.config_hash,
                               evidence_dir=_evidence(tmp_path, evil) if how == "rejected" else None)
        honest.replace(0, 0, initial_state(0, world.weights, world.momentum))
        own_leaf = honest.record(1, 0, world.aggregation.new_global, world.aggregation.new_momentum, reports,
                                 world.blobs, _envelopes(world.blobs), world.bindings)
        wrong_leaf = _colluders_record(world, colluder_host, honest.state(1, 0), evil)
        prover_host.connect(colluder_host.listen_addrs[0])
        deployment, run, records, prover, mine_record = _setup(world, tmp_path, honest, wrong_leaf, own_leaf,
                                                               colluder_host.peer_id,
                                                               values=run_values(world.cfg))
        if how == "rejected":
            mine_record = dataclasses.replace(mine_record, contributions_root=hashlib.sha256(b"two").digest())
        client = deployment.client(3)
        assert client.run_values(run.run_id)["max_rank"] == MAX_RANK
        with caplog.at_level("ERROR", logger="node.live.fraud.prover"):
            prover.check(0, records[0], records[0])
            prover.check(1, records[1], mine_record)
        assert set(prover.log.proofs) == {1}, prover.log.unprovable
        assert f"rank past the run's maxRank {MAX_RANK}" in caplog.text
        _assert_overturned(deployment, run, client)
        kept = _kept(tmp_path)
        assert isinstance(kept, AggregationProof) and kept.chunk == 0
        # the pieces of every listed contribution: the one past the rank cut from what this node left out
        assert kept.pieces[1][5] == EVIL_RANK and [piece[0] for piece in kept.pieces] == [2, 2, 0]


def _evidence(tmp_path, blob: bytes):
    """The evidence directory of a node whose pool rejected ``blob``'s envelope (as node/live/exchange/pool.py
    keeps it), beside an unrelated file that is not an envelope."""
    from node import protocol as msg
    from p2p.envelope import Envelope
    from p2p.identity import Identity

    body = msg.encode_contribution_body(msg.ContributionBody(bytes(32), bytes(32), blob))
    envelope = Envelope.create(Identity.generate(), 1, 1, msg.CONTRIBUTION, body, stage=0, replica=1)
    directory = tmp_path / "evidence"
    directory.mkdir()
    digest = hashlib.sha256(envelope.to_bytes()).hexdigest()
    (directory / f"round-00000001-stage0-{digest}.envelope").write_bytes(envelope.to_bytes())
    (directory / f"round-00000001-stage0-{'0' * 64}.envelope").write_bytes(b"not an envelope")
    return directory


def _aggregated(world):
    return aggregate_with_report(world.weights, world.momentum, world.blobs, world.cfg.diloco, stage_index=0,
                                 outer_round=1, compression_cfg=world.cfg.compression)


def _bindings_or_none(world):
    from tests.fraud_live_fixtures import _bindings

    return _bindings(world.cfg, world.blobs) if world.cfg.commitment_scheme.proves_factors else None


def test_a_version_two_round_stepped_with_another_lr_is_proven_by_the_live_node(tmp_path, caplog):
    """A chunked (version-2) run: the colluders step round 1 with lr 7.0 and commit factors that say so; its
    factors are published beside its state, so the honest node opens them and sends the values proof."""
    with _normed_world(tmp_path, [contribution(SHAPES, "lowrank", 30, rank=4),
                                  contribution(SHAPES, "quant", 31)]) as (world, _chunked, _colluded):
        world.cfg = load_config(None, [*NORMED_RUN, "diloco.commitments=chunked"])
        world.bindings = None
        world.aggregation = _aggregated(world)
        colluder_host, prover_host = world.hosts
        wrong_leaf = _lied_leaf(world, _adversary(world.cfg, outer_lr=7.0), colluder_host, world.blobs, None)
        honest = _states(world, prover_host)
        own_leaf = honest.record(1, 0, world.aggregation.new_global, world.aggregation.new_momentum,
                                 world.aggregation.contributions, world.blobs, _envelopes(world.blobs), None)
        prover_host.connect(colluder_host.listen_addrs[0])
        deployment, run, records, prover, mine_record = _setup(world, tmp_path, honest, wrong_leaf, own_leaf,
                                                               colluder_host.peer_id,
                                                               values=run_values(world.cfg))
        assert deployment.client(3).run_struct(run.run_id)["commitments"] == 2
        with caplog.at_level("ERROR", logger="node.live.fraud.prover"):
            prover.check(0, records[0], records[0])
            prover.check(1, records[1], mine_record)
        assert set(prover.log.proofs) == {1}, prover.log.unprovable
        assert "factors' lr/mu bits" in caplog.text
        _assert_overturned(deployment, run, deployment.client(3))
        kept = _kept(tmp_path)
        assert kept.new_weights == b"" and kept.pieces == [] and kept.schedule_leaf
        _assert_audit_says_why(world, records, deployment.client(3), run, wrong_leaf)


def _assert_audit_says_why(world, records, client, run, wrong_leaf: bytes) -> None:
    """``audit`` replays the round, finds the committed factors not its own and says why it builds no proof
    of them (node/tools/audit_proof.py FACTORS_NOT_HELD), from the round's real checkpoint of the colluders'
    state (the record as if it had published one; the proof a node kept is shown as
    tests/test_fraud_live_values.py checks)."""
    from types import SimpleNamespace

    from node.fraudproof import initial_state
    from node.store.checkpoint import build_checkpoint
    from node.tools.audit_proof import FACTORS_NOT_HELD, check_fraud_proof
    from tests.fraud_fixtures import OTHER, tensors

    lied = aggregate_with_report(world.weights, world.momentum, world.blobs,
                                 _adversary(world.cfg, outer_lr=7.0).diloco, stage_index=0, outer_round=1,
                                 compression_cfg=world.cfg.compression)
    other = (tensors(3, OTHER), tensors(4, OTHER, 0.0))
    leaves = {0: wrong_leaf, 1: world.other.leaf().encode()}
    checkpoint = build_checkpoint(world.layout, 1, {0: (lied.new_global, lied.new_momentum), 1: other},
                                  leaves).to_bytes()
    commit = dataclasses.replace(records[1], checkpoint_hash=hashlib.sha256(checkpoint).digest())
    replayer = SimpleNamespace(cfg=world.cfg, states=[_lied_state(world, world.aggregation), world.other],
                               prev_states=[initial_state(0, world.weights, world.momentum), world.other])
    source = SimpleNamespace(name="archive", proofs=lambda _round: [],
                             checkpoint=lambda _round, _hash: checkpoint)
    verdict = SimpleNamespace(checks=[], notes=[])
    check_fraud_proof(verdict, SimpleNamespace(commit=commit, attesters=[]), records[0], replayer, [source],
                      client, client.history(run.run_id), world.layout)
    (check,) = verdict.checks
    assert check.status == "unverifiable" and f"stage 0: {FACTORS_NOT_HELD}" in check.reason, check.reason


def _lied_state(world, aggregation):
    return world.cfg.commitment_scheme.stage_state_of(
        0, aggregation.new_global, aggregation.new_momentum, aggregation.contributions, world.blobs,
        world.cfg.diloco, 1, envelopes=_envelopes(world.blobs),
        decode_args={"stage_index": 0, "outer_round": 1, "refuse_raw": world.cfg.compression.enabled})


def test_a_version_two_rounds_other_clip_scale_stays_unprovable_and_says_why(tmp_path):
    """A chunked run's factors that keep the run's values but another clip scale (norm_clip 0): opened, held
    to the run, nothing sent; the log says why (no norm commitment in version 2)."""
    with _normed_world(tmp_path, [contribution(SHAPES, "raw", 32, scale=0.5),
                                  contribution(SHAPES, "quant", 31)]) as (world, chunked, _colluded):
        world.cfg = load_config(None, [*NORMED_RUN, "diloco.commitments=chunked"])
        world.bindings = None
        world.aggregation = _aggregated(world)
        colluder_host, prover_host = world.hosts
        wrong_leaf = _lied_leaf(world, chunked, colluder_host, world.blobs, None)
        honest = _states(world, prover_host)
        own_leaf = honest.record(1, 0, world.aggregation.new_global, world.aggregation.new_momentum,
                                 world.aggregation.contributions, world.blobs, _envelopes(world.blobs), None)
        assert own_leaf != wrong_leaf
        prover_host.connect(colluder_host.listen_addrs[0])
        deployment, run, records, prover, mine_record = _setup(world, tmp_path, honest, wrong_leaf, own_leaf,
                                                               colluder_host.peer_id,
                                                               values=run_values(world.cfg))
        prover.check(0, records[0], records[0])
        prover.check(1, records[1], mine_record)
        assert not prover.log.proofs and not prover.log.challenges
        assert "version-2 round's clip scales" in prover.log.unprovable[1]
        assert deployment.client(3).invalid_from(run.run_id) is None
