"""Units of the sliced exchange's wire pieces: the manifest, the inputs root from hashes, the fallback
order, the partial announce, the run setting, and the engine's outer step on an assembled average."""

from __future__ import annotations

import hashlib

import msgpack
import pytest
import torch

from node.config import config_from_dict
from node.live import protocol as msg
from node.runconfig import run_document
from training.butterfly import (
    SliceError,
    aggregate_slice,
    average_of_partials,
    candidate,
    encode_slices,
    inputs_root,
    inputs_root_of_hashes,
    parse_slice_manifest,
    plan_slices,
    slice_manifest,
)
from training.config import CompressionConfig, DilocoConfig
from training.diloco import StageEngine, aggregate_with_report, average_contributions, step_with_average
from training.errors import TrainingConfigError


def test_manifest_round_trips_and_refuses_what_does_not_fit_the_plan():
    blobs = [b"a" * 10, b"b" * 20, b"c"]
    data = slice_manifest(blobs)
    assert parse_slice_manifest(data, 3, 100) == [(hashlib.sha256(b).digest(), len(b)) for b in blobs]
    with pytest.raises(SliceError):
        parse_slice_manifest(data, 2, 100)  # another plan
    with pytest.raises(SliceError):
        parse_slice_manifest(data[:-1], 3, 100)  # truncated
    with pytest.raises(SliceError):
        parse_slice_manifest(data + b"x", 3, 100)  # trailing bytes
    with pytest.raises(SliceError):
        parse_slice_manifest(data, 3, 15)  # a slice larger than the blob limit
    with pytest.raises(SliceError):
        parse_slice_manifest(b"dlx-contribution/2" + data, 3, 100)
    with pytest.raises(SliceError):
        parse_slice_manifest(slice_manifest([b""]), 1, 100)  # an empty slice blob


def test_the_root_holders_compute_from_hashes_is_the_aggregators_root():
    blobs = [bytes([i]) * (i + 3) for i in range(5)]
    assert inputs_root_of_hashes([hashlib.sha256(b).digest() for b in blobs]) == inputs_root(blobs)
    swapped = [blobs[1], blobs[0], *blobs[2:]]
    assert inputs_root_of_hashes([hashlib.sha256(b).digest() for b in swapped]) != inputs_root(blobs)


def test_fallback_order_is_a_rotation_of_every_member():
    for members in (1, 3, 4):
        for outer_round in range(5):
            for j in range(members):
                order = [candidate(j, outer_round, members, m) for m in range(members)]
                assert sorted(order) == list(range(members))
            firsts = {candidate(j, outer_round, members, 0) for j in range(members)}
            assert len(firsts) == members  # A = R: every member aggregates one slice


def test_partial_announce_is_decoded_strictly():
    good = msg.PartialAnnounce(2, b"\x01" * 32, 1000)
    assert msg.decode_payload(msg.PARTIAL_ANNOUNCE, msg.encode_payload(good)) == good
    for bad in ({"slice_index": 2, "envelope_hash": b"\x01" * 31, "size": 1000},
                {"slice_index": -1, "envelope_hash": b"\x01" * 32, "size": 1000},
                {"slice_index": 2, "envelope_hash": b"\x01" * 32, "size": 0},
                {"slice_index": 2, "envelope_hash": b"\x01" * 32, "size": 1000, "extra": 1},
                {"slice_index": "2", "envelope_hash": b"\x01" * 32, "size": 1000}):
        with pytest.raises(msg.ProtocolError):
            msg.decode_payload(msg.PARTIAL_ANNOUNCE, msgpack.packb(bad, use_bin_type=True))


def test_exchange_setting_is_validated_and_named_in_the_run_document_only_when_sliced():
    assert "exchange" not in run_document(config_from_dict({}))["diloco"]
    assert run_document(config_from_dict({"diloco": {"exchange": "sliced"}}))["diloco"]["exchange"] == "sliced"
    with pytest.raises(TrainingConfigError, match="diloco.exchange"):
        DilocoConfig(exchange="butterfly")


def test_outer_step_on_assembled_partials_matches_the_full_exchange_when_the_partials_are_exact():
    """With the codec off, partials are the exact slice averages: the sliced round equals the full one bit for bit."""
    torch.manual_seed(0)
    shapes = {"a": (64, 300), "b": (300,), "c": (40, 40)}
    plan = plan_slices(shapes, 3, min_slice_numel=1000)
    assert plan.num_slices == 3
    cfg = CompressionConfig(enabled=False)
    diloco = DilocoConfig(norm_clip=0.0, num_replicas=3)
    grads = [{n: torch.randn(s) for n, s in shapes.items()} for _ in range(3)]
    slices = [encode_slices(g, plan, cfg, 0, stage_index=0, outer_round=4)[0] for g in grads]
    partials = [aggregate_slice([slices[i][j] for i in range(3)], plan, j, cfg, 0, norm_clip=0.0, stage_index=0,
                                outer_round=4).partial for j in range(3)]
    weights = {n: torch.randn(s) for n, s in shapes.items()}
    momentum = {n: torch.zeros(s) for n, s in shapes.items()}
    average = average_of_partials(partials, plan, stage_index=0, outer_round=4, refuse_raw=False)
    sliced = step_with_average(weights, momentum, average, diloco, 4)
    full_blobs = [encode_slices(g, plan_slices(shapes, 1), cfg, 0, stage_index=0, outer_round=4)[0][0] for g in grads]
    full = aggregate_with_report(weights, momentum, full_blobs, diloco, stage_index=0, outer_round=4)
    assert torch.equal(average_contributions([{n: g[n] for n in shapes} for g in grads])["a"], average["a"])
    assert sliced.weights_hash == full.weights_hash
    # Every partial empty (nothing accepted anywhere): a no-op round, as in the full exchange.
    assert average_of_partials([b""] * 3, plan, stage_index=0, outer_round=4) is None
    assert step_with_average(weights, momentum, None, diloco, 4).weights_hash == \
        aggregate_with_report(weights, momentum, [b"x"], diloco, stage_index=0, outer_round=4).weights_hash


def test_engine_applies_a_precomputed_aggregation():
    torch.manual_seed(1)
    params = {"w": torch.nn.Parameter(torch.randn(8, 8))}
    engine = StageEngine(0, params, DilocoConfig(one_step_delay=False, num_replicas=1), CompressionConfig(enabled=False))
    with torch.no_grad():
        params["w"].sub_(0.1)
    engine.encode_contribution(0)
    average = {"w": torch.full((8, 8), 0.1)}
    aggregation = step_with_average(engine.global_weights, engine.momentum, average, engine.diloco_cfg, 0)
    result = engine.finish_round(0, [b"ignored"], aggregation=aggregation)
    assert result.weights_hash == aggregation.weights_hash == engine.weights_hash()
    assert torch.equal(params["w"].detach(), aggregation.new_global["w"])


def test_a_partial_is_coded_alike_whatever_the_callers_thread_count():
    """The partial's SVD/QR runs on one thread: a 1-thread node and a 2-thread auditor code the same bytes."""
    torch.manual_seed(2)
    shapes = {"a": (256, 192), "b": (192,)}
    plan = plan_slices(shapes, 2, min_slice_numel=1000)
    cfg = CompressionConfig()
    budget = 6000
    low_rank = [{n: torch.randn(s[0], 8) @ torch.randn(8, s[1]) if len(s) == 2 else torch.randn(s)
                 for n, s in shapes.items()} for _ in range(3)]
    slices = [encode_slices(g, plan, cfg, budget, stage_index=0, outer_round=1)[0] for g in low_rank]
    before = torch.get_num_threads()
    try:
        out = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out.append(aggregate_slice([s[0] for s in slices], plan, 0, cfg, budget, norm_clip=2.0, stage_index=0,
                                       outer_round=1).partial)
            assert torch.get_num_threads() == threads  # restored
    finally:
        torch.set_num_threads(before)
    assert out[0] and out[0] == out[1]


def test_a_flood_of_partial_announces_costs_only_its_sender():
    """One member announcing many partials of a slot cannot crowd out the aggregator's announce."""
    import threading
    from types import SimpleNamespace

    from node.live.sliced import ANNOUNCES_PER_SENDER, SlicedExchange

    exchange = SlicedExchange.__new__(SlicedExchange)  # only the announce book is exercised here
    exchange._cond, exchange._announced = threading.Condition(), {}
    flooder = SimpleNamespace(round=3, stage=0, sender_peer_id="flooder")
    for index in range(500):
        exchange.on_announce(flooder, msg.PartialAnnounce(1, index.to_bytes(32, "big"), 100), b"")
    aggregator = SimpleNamespace(round=3, stage=0, sender_peer_id="aggregator")
    exchange.on_announce(aggregator, msg.PartialAnnounce(1, b"\x07" * 32, 100), b"")
    entries = exchange._announced[(3, 0, 1)]
    assert sum(1 for e in entries if e[0] == "flooder") == ANNOUNCES_PER_SENDER
    assert ("aggregator", b"\x07" * 32, 100) in entries
