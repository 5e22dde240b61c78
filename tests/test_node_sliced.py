"""Units of the sliced exchange's wire pieces: the slice bundle and its reference, a record's Merkle path,
the contributions root a partial binds, the fallback
order, the partial announce, the run setting, and the engine's outer step on an assembled average."""

from __future__ import annotations

import hashlib

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from node.config import config_from_dict
from node.live import protocol as msg
from node.runconfig import run_document
from training.butterfly import (
    SliceError,
    aggregate_slice,
    average_of_partials,
    candidate,
    encode_slices,
    bundle_slices,
    contributions_root,
    live_plan,
    parse_slice_record,
    parse_slice_reference,
    plan_slices,
    read_slice,
    record_range,
    slice_bundle,
)
from training.config import CompressionConfig, DilocoConfig
from training.diloco import StageEngine, aggregate_with_report, average_contributions, step_with_average
from training.errors import TrainingConfigError


def _record(bundle: bytes, count: int, j: int) -> bytes:
    offset, length = record_range(count, j)
    return bundle[offset:offset + length]


@pytest.mark.parametrize("count", [1, 2, 3, 5, 16])
def test_every_slice_of_a_bundle_is_read_by_range_and_proven_to_the_reference(count):
    blobs = [bytes([j]) * (j + 1) * 7 for j in range(count)]
    bundle, data = slice_bundle(blobs)
    reference = parse_slice_reference(data, count, len(bundle))
    assert len(data) == 88  # constant whatever A: the envelope does not grow with the slice count
    assert (reference.bundle_digest, reference.bundle_size) == (hashlib.sha256(bundle).digest(), len(bundle))
    for j, blob in enumerate(blobs):
        digest, offset, size = parse_slice_record(_record(bundle, count, j), reference, j)
        assert (digest, bundle[offset:offset + size]) == (hashlib.sha256(blob).digest(), blob)
    assert bundle_slices(bundle, reference) == blobs


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_hostile_references_records_and_bundles_cost_only_themselves(data):
    """Random bytes and random mutations of a real reference, record or bundle: refused with a
    SliceError (or an absent slice), never another exception, and never a slice other than the one
    the signed reference fixes."""
    blobs = [bytes([j + 1]) * (j + 3) * 5 for j in range(3)]
    bundle, reference_bytes = slice_bundle(blobs)
    reference = parse_slice_reference(reference_bytes, 3, 1 << 20)

    def mutate(raw: bytes) -> bytes:
        raw = bytearray(raw)
        for _ in range(data.draw(st.integers(1, 4))):
            if raw and data.draw(st.booleans()):
                raw[data.draw(st.integers(0, len(raw) - 1))] ^= data.draw(st.integers(1, 255))
            else:
                cut = data.draw(st.integers(0, len(raw)))
                raw = raw[:cut] + data.draw(st.binary(max_size=40)) + raw[cut:]
        return bytes(raw)

    hostile_reference = data.draw(st.one_of(st.binary(max_size=120), st.just(reference_bytes).map(mutate)))
    try:
        parse_slice_reference(hostile_reference, 3, 1 << 20)
    except SliceError:
        pass
    j = data.draw(st.integers(0, 2))
    hostile_record = mutate(_record(bundle, 3, j))
    try:
        digest, offset, size = parse_slice_record(hostile_record, reference, j)
        assert digest == hashlib.sha256(blobs[j]).digest()  # a record that proves names the real slice
    except SliceError:
        pass
    hostile_bundle = mutate(bundle)
    got = read_slice(hostile_bundle, reference, j)
    assert got is None or got == blobs[j]
    try:
        assert bundle_slices(hostile_bundle, reference) == blobs  # only if the mutation was a no-op
    except SliceError:
        pass


def test_a_reference_that_does_not_fit_the_plan_is_refused():
    bundle, data = slice_bundle([b"a" * 10, b"b" * 20, b"c"])
    for bad in (data[:-1], data + b"x", b"dlx-slices/1" + data[12:]):
        with pytest.raises(SliceError):
            parse_slice_reference(bad, 3, 1000)
    with pytest.raises(SliceError):
        parse_slice_reference(data, 2, 1000)  # another plan
    with pytest.raises(SliceError):
        parse_slice_reference(data, 3, len(bundle) - 1)  # a bundle over the blob limit
    with pytest.raises(SliceError):
        slice_bundle([b"a", b""])  # an empty slice blob


def test_a_record_that_does_not_prove_its_slice_is_refused():
    blobs = [bytes([j]) * 9 for j in range(5)]
    bundle, data = slice_bundle(blobs)
    reference = parse_slice_reference(data, 5, len(bundle))
    record = _record(bundle, 5, 2)
    with pytest.raises(SliceError):
        parse_slice_record(record, reference, 3)  # record 2 presented as slice 3's
    with pytest.raises(SliceError):
        parse_slice_record(record[:-1], reference, 2)  # truncated
    for position in (0, 33, 45, len(record) - 1):  # the hash, the offset, the size, a sibling
        flipped = bytearray(record)
        flipped[position] ^= 1
        with pytest.raises(SliceError):
            parse_slice_record(bytes(flipped), reference, 2)
    other_bundle, other = slice_bundle([b"x" * 9] + blobs[1:])
    with pytest.raises(SliceError):  # a record of another bundle of the same replica
        parse_slice_record(_record(other_bundle, 5, 0), reference, 0)
    tampered = bundle[:-1] + bytes([bundle[-1] ^ 1])  # the last byte: the last slice's
    with pytest.raises(SliceError):  # not the bundle the reference names
        bundle_slices(tampered, reference)
    signed = type(reference)(5, hashlib.sha256(tampered).digest(), len(tampered), reference.slices_root)
    # A signed reference to a bundle with one bad slice: that slice is absent, the others are read.
    assert bundle_slices(tampered, signed) == [*blobs[:4], None]
    lying = type(reference)(5, hashlib.sha256(other_bundle).digest(), len(other_bundle), reference.slices_root)
    assert bundle_slices(other_bundle, lying) == [None] * 5  # no record proves to the signed root


def test_the_contributions_root_binds_every_slice_and_the_order():
    roots = [slice_bundle([bytes([i]) * 5, bytes([i]) * 6])[1][-32:] for i in range(4)]
    assert contributions_root(roots) == contributions_root(list(roots))
    assert contributions_root([roots[1], roots[0], *roots[2:]]) != contributions_root(roots)
    changed = slice_bundle([bytes([0]) * 5, b"y" * 6])[1][-32:]  # replica 0 with another slice 1
    assert contributions_root([changed, *roots[1:]]) != contributions_root(roots)


def test_the_live_plan_gives_every_replica_a_slice_of_the_tiny_model_up_to_16():
    from training.config import ModelConfig
    from training.stages import split_stages, stage_param_shapes

    config = ModelConfig(preset="tiny")
    for spec in split_stages(config.n_layer, 2):
        shapes = stage_param_shapes(config, spec)
        for replicas in (4, 8, 16):
            assert live_plan(shapes, replicas).num_slices == replicas


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


def test_an_aggregator_reads_one_slice_of_a_bundle_over_real_hosts(tmp_path):
    """Record j and slice j by range from a real provider: only those bytes travel, and they prove."""
    from p2p.config import P2PConfig
    from p2p.errors import BlobError
    from p2p.host import P2PHost
    from p2p.identity import Identity

    blobs = [bytes([j]) * (500 + j) for j in range(16)]
    bundle, data = slice_bundle(blobs)
    reference = parse_slice_reference(data, 16, len(bundle))
    with P2PHost.start(P2PConfig(), Identity.generate(), data_dir=tmp_path / "provider") as provider, \
            P2PHost.start(P2PConfig(), Identity.generate(), data_dir=tmp_path / "aggregator") as aggregator:
        sha = provider.provide_blob(bundle, announce=False)
        aggregator.connect(provider.listen_addrs[0])
        before = aggregator.transfer_stats().get("/dlx/blob/1.0.0", {}).get("received", 0)
        offset, length = record_range(16, 5)
        record = aggregator.fetch_blob_range(sha, offset, length, provider.peer_id, timeout=30)
        digest, start, size = parse_slice_record(record, reference, 5)
        blob = aggregator.fetch_blob_range(sha, start, size, provider.peer_id, timeout=30)
        received = aggregator.transfer_stats()["/dlx/blob/1.0.0"]["received"] - before
        assert blob == blobs[5] and hashlib.sha256(blob).digest() == digest
        assert received == length + size < len(bundle) / 8
        assert not aggregator.has_blob(sha)  # a range is not stored (it is not verified by its sha256)
        with pytest.raises(BlobError):
            aggregator.fetch_blob_range(sha, len(bundle) - 4, 8, provider.peer_id, timeout=30)  # past the end
        with pytest.raises(BlobError):
            aggregator.fetch_blob_range("00" * 32, 0, 8, provider.peer_id, timeout=30)  # not served
