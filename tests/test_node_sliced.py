"""Units of the sliced exchange's wire pieces: the slice bundle and its reference, a record's Merkle path,
which closed envelope is a usable input, how a sliced close is judged without fetching, the lazy
contribution pool, the fallback order, the partial announce, the run settings, and the engine's outer
step on an assembled average."""

from __future__ import annotations

import hashlib
import math
import time

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from node import protocol as msg
from node.config import config_from_dict
from node.live.exchange.closejudge import PENDING
from node.live.state.roundbook import Announced
from node.runconfig import run_document
from p2p.identity import Identity
from training.butterfly import aggregate_slice, average_of_partials, encode_slices
from training.slice_plan import SliceError, candidate, live_plan, plan_slices
from training.config import DilocoConfig
from training.config_compression import CompressionConfig
from training.diloco import aggregate_with_report, average_contributions, step_with_average
from training.errors import TrainingConfigError
from training.slicebundle import (
    bundle_slices,
    parse_slice_record,
    parse_slice_reference,
    read_slice,
    record_range,
    slice_bundle,
)
from training.stage_engine import StageEngine

_IDENTITY = Identity.generate()  # one key for the hypothesis examples (generating one per example is slow)


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
    lying = type(reference)(5, hashlib.sha256(other_bundle).digest(), len(other_bundle),
                            reference.slices_root)
    assert bundle_slices(other_bundle, lying) == [None] * 5  # no record proves to the signed root


def _contribution(identity, reference: bytes, *, run_id=7, outer_round=3, stage=1, replica=2,
                  kind=msg.CONTRIBUTION) -> bytes:
    from p2p.envelope import Envelope

    body = msg.encode_contribution_body(msg.ContributionBody(b"s" * 32, b"d" * 32, reference))
    return Envelope.create(identity, run_id, outer_round, kind, body, stage=stage, replica=replica).to_bytes()


def test_a_closed_envelope_is_an_input_only_if_it_is_the_signers_contribution_with_a_fitting_reference():
    """The aggregators' and the auditor's rule: a pure function of the bytes the close fixes by hash."""
    from node.live.exchange.sliced import usable_reference
    from p2p.identity import Identity

    identity, other = Identity.generate(), Identity.generate()
    bundle, reference = slice_bundle([b"a" * 10, b"b" * 20, b"c" * 5])
    envelope = _contribution(identity, reference)
    entry = [2, identity.peer_id, hashlib.sha256(envelope).digest(), len(envelope)]
    got = usable_reference(envelope, entry, 7, 3, 1, 3, 1 << 20)
    assert got is not None and got.bundle_digest == hashlib.sha256(bundle).digest()
    assert usable_reference(envelope, entry, 7, 3, 1, 4, 1 << 20) is None  # another plan
    assert usable_reference(envelope, entry, 8, 3, 1, 3, 1 << 20) is None  # another run
    assert usable_reference(envelope, entry, 7, 4, 1, 3, 1 << 20) is None  # another round
    assert usable_reference(envelope, entry, 7, 3, 0, 3, 1 << 20) is None  # another stage
    assert usable_reference(envelope, [1, *entry[1:]], 7, 3, 1, 3, 1 << 20) is None  # another replica
    assert usable_reference(envelope, [2, other.peer_id, *entry[2:]], 7, 3, 1, 3, 1 << 20) is None  # signer
    assert usable_reference(_contribution(identity, reference, kind=msg.ANNOUNCE), entry, 7, 3, 1, 3,
                            1 << 20) is None  # not a contribution
    assert usable_reference(_contribution(identity, b"x" * 88), entry, 7, 3, 1, 3, 1 << 20) is None
    assert usable_reference(envelope, entry, 7, 3, 1, 3, len(bundle) - 1) is None  # a bundle over the limit


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_hostile_closed_envelopes_are_absent_inputs_never_errors_nor_other_references(data):
    """Random bytes and mutations of a real contribution envelope: None (an absent input) or exactly the
    reference its signer signed; never an exception."""
    from node.live.exchange.sliced import usable_reference

    identity = _IDENTITY
    _bundle, reference = slice_bundle([b"a" * 10, b"b" * 20, b"c" * 5])
    envelope = _contribution(identity, reference)
    entry = [2, identity.peer_id, hashlib.sha256(envelope).digest(), len(envelope)]
    raw = bytearray(data.draw(st.one_of(st.binary(max_size=600), st.just(envelope))))
    for _ in range(data.draw(st.integers(0, 4))):
        if raw and data.draw(st.booleans()):
            raw[data.draw(st.integers(0, len(raw) - 1))] ^= data.draw(st.integers(1, 255))
        else:
            cut = data.draw(st.integers(0, len(raw)))
            raw[cut:cut] = data.draw(st.binary(max_size=40))
    got = usable_reference(bytes(raw), entry, 7, 3, 1, 3, 1 << 20)
    assert got is None or got == parse_slice_reference(reference, 3, 1 << 20)


def _lazy_rooms(quorum: int = 1):
    from test_node_rooms import rooms

    book, membership, pool, coordinator = rooms(quorum=quorum)
    pool.lazy = True
    return book, membership, pool, coordinator


def _announce(book, outer_round, stage, replica, peer, envelope_hash, first=True):
    from node.live.state.roundbook import Announced

    book.add_announce(outer_round, stage, Announced(peer, replica, envelope_hash, 451), first=first)


def test_a_sliced_close_is_judged_without_fetching_any_envelope():
    """Placed and announced by its signer is enough; what the envelope holds is the aggregators' question,
    and a node that happened to refuse one (as coordinator) does not refuse the close over it."""
    from test_node_rooms import digest, entry

    book, _membership, pool, coordinator = _lazy_rooms(quorum=2)
    close = msg.Close([entry(0, "peer-a"), entry(1, "peer-b")])
    assert coordinator.judge(4, 0, "c", close) == PENDING  # not announced yet: waited for
    _announce(book, 4, 0, 0, "peer-a", digest("peer-a"))
    _announce(book, 4, 1, 1, "peer-b", digest("peer-b"))  # another stage's announce does not count
    assert coordinator.judge(4, 0, "c", close) == PENDING
    _announce(book, 4, 0, 1, "peer-b", digest("peer-b"))
    pool.refused[digest("peer-b")] = ("peer-b", "payload does not decode")
    assert coordinator.judge(4, 0, "c", close) is None
    assert pool.fetched == []  # nothing was fetched to judge it
    # A second, equivocating announce may be the one a close names (which one came first is timing).
    _announce(book, 5, 0, 0, "peer-a", digest("first"))
    _announce(book, 5, 0, 0, "peer-a", digest("second"), first=False)
    _announce(book, 5, 0, 1, "peer-b", digest("peer-b"))
    assert book.snapshot_announces(5, 0)["peer-a"].envelope_hash == digest("first")
    named = msg.Close([[0, "peer-a", digest("second"), 451], entry(1, "peer-b")])
    assert coordinator.judge(5, 0, "c", named) is None
    # What a member did not announce (a coordinator's forgery) is never here: refused after the stall limit.
    forged = msg.Close([[0, "peer-a", digest("forged"), 451], entry(1, "peer-b")])
    assert coordinator.judge(5, 0, "c-forged", forged) == PENDING
    # Placement still counts: an announced hash under another replica is not here.
    misplaced = msg.Close([entry(1, "peer-b"), [2, "peer-a", digest("first"), 451]])
    assert coordinator.judge(5, 0, "c-misplaced", misplaced) == PENDING


def test_a_proofs_close_stands_only_where_the_coordinators_rules_say_it_went_by():
    """RoundCoordinator.close_standing, what the live judge of a wrong partial asks of the proof's close: the
    set this node aggregated; where it took no close of the round, a holder's close valid by the entry rules;
    never a non-holder's, a refused one, or another set than the one aggregated."""
    from test_node_rooms import PEERS, digest, entry

    book, _membership, _pool, coordinator = _lazy_rooms(quorum=2)
    real = msg.Close([entry(0, "peer-a"), entry(1, "peer-b"), entry(2, "peer-c")])
    coordinator.adopt(4, 0, real)  # this node aggregated it
    assert coordinator.close_standing(4, 0, "peer-b", real)[0] is True
    framed = msg.Close([entry(0, "peer-a"), entry(1, "peer-b"), [5, "peer-c", digest("peer-c"), 100]])
    stands, why = coordinator.close_standing(4, 0, "peer-b", framed)  # a member's made-up close
    assert stands is False and "another set" in why
    assert coordinator.close_standing(4, 0, "peer-x", real)[0] is False  # no holder of the stage
    # A round this node took no close of: a holder's close whose entries were announced as named stands.
    for replica, peer in enumerate(PEERS):
        _announce(book, 5, 0, replica, peer, digest(peer))
    assert coordinator.close_standing(5, 0, "peer-c", real)[0] is True
    stands, _why = coordinator.close_standing(5, 0, "peer-c", framed)
    assert stands is None  # its misnamed entry was never announced so: nothing is told here
    # no quorum
    assert coordinator.close_standing(5, 0, "peer-c", msg.Close([entry(0, "peer-a")]))[0] is False
    book.add_close(5, 0, "peer-b", real, b"")
    coordinator.withdraw(5, 0, real, "its inputs never came")  # refused here (an apply found them withheld)
    stands, why = coordinator.close_standing(5, 0, "peer-b", real)
    assert stands is False and "never came" in why


def test_a_forged_sliced_close_is_refused_once_the_stall_limit_passes():
    from test_node_rooms import Clock, digest, entry, rooms

    clock = Clock()
    book, _membership, pool, coordinator = rooms(quorum=1, clock=clock, round_timeout=30.0)
    pool.lazy = True
    _announce(book, 0, 0, 1, "peer-b", digest("peer-b"))
    forged = msg.Close([[0, "peer-a", digest("forged"), 451], entry(1, "peer-b")])
    assert coordinator.judge(0, 0, "c", forged) == PENDING
    clock.now += coordinator.stall_limit() + 1
    assert "1 of 2 still missing" in coordinator.judge(0, 0, "c", forged)


def test_a_lazy_pool_fetches_announced_contributions_only_where_it_may_close(tmp_path):
    import threading

    from node.live.exchange.pool import ContributionPool
    from node.live.state.roundbook import RoundBook
    from p2p.errors import BlobUnavailable

    class Host:
        peer_id = "me"

        def __init__(self):
            self.asked, self.done = [], threading.Event()

        def fetch_blob(self, sha256_hex, dest, providers=None, timeout=None):
            self.asked.append(sha256_hex)
            self.done.set()
            raise BlobUnavailable("stand-in host serves nothing")

    host, book = Host(), RoundBook()
    pool = ContributionPool(host, book, 1, tmp_path, 1 << 20, 5.0, 2, lazy=True)
    try:
        _announce(book, 2, 0, 1, "peer-b", b"" * 32)
        pool.prefetch(2, 0)  # what an announce's arrival does: nothing in a lazy pool
        assert host.asked == []
        pool.want(2, 0)  # this node may close (2, 0): it fetches what was announced
        assert host.done.wait(10)
        assert host.asked[0] == (b"" * 32).hex()
        pool.forget_before(3)
        assert pool._wanted == set()
    finally:
        pool.close()


def test_a_wanted_contribution_has_its_inputs_fetched_as_soon_as_its_envelope_is_here(tmp_path):
    """A fallback coordinator wants the contributions from the deadline on and closes CLOSE_FALLBACK_S later
    with the bundles it then holds: the bundle fetch starts when the envelope arrives, not at its turn
    (asked only by ready_close then, every honest bundle but its own was missing: bench_byzantine `late`)."""
    import threading

    from node.live.exchange.pool import ContributionPool
    from node.live.state.roundbook import RoundBook

    sender = Identity.generate()
    envelope = _contribution(sender, slice_bundle([b"x", b"y", b"z"])[1], outer_round=2, stage=0, replica=1)
    digest = hashlib.sha256(envelope).digest()

    class Host:
        peer_id = "me"

        def fetch_blob(self, sha256_hex, dest, providers=None, timeout=None):
            dest.write_bytes(envelope)

        def provide_blob(self, data, announce=True):
            return hashlib.sha256(data).hexdigest()

    asked = threading.Event()

    def held(outer_round, stage, d, env):
        assert (outer_round, stage, d, env) == (2, 0, digest, envelope)
        asked.set()
        return False  # its bundle is on its way

    book = RoundBook()
    pool = ContributionPool(Host(), book, 7, tmp_path, 1 << 20, 5.0, 2, lazy=True, inputs_held=held)
    try:
        book.add_announce(2, 0, Announced(sender.peer_id, 1, digest, len(envelope)), first=True)
        pool.want(2, 0)  # past the deadline: this fallback coordinator may have to close
        assert asked.wait(30)  # nobody called closable: the envelope's arrival asked for its bundle
        assert digest in pool.have(2, 0)
        asked.clear()
        pool.prefetch(3, 0)  # a round not wanted asks for nothing
        assert not asked.is_set()
    finally:
        pool.close()


def test_a_lazy_coordinator_asks_for_the_contributions_only_when_first_in_line_or_past_the_deadline():
    from node.live.state.topology import committer_order
    from test_node_rooms import PEERS

    from node.live.state.topology import committer_order

    _book, membership, _pool, coordinator = _lazy_rooms()
    holders = membership.holders(0)
    for outer_round in range(12):
        order = committer_order(outer_round * 1000, holders)
        first = order[0] == "peer-a"
        assert coordinator._may_close(outer_round, 0, order, set(PEERS), deadline=float("inf")) == first
        # long past the deadline
        assert coordinator._may_close(outer_round, 0, order, set(PEERS), deadline=0.0)
        # Just past the deadline only the first fallback's turn
        # is one away: the holders further down fetch nothing.
        just = time.monotonic() - 0.5
        assert coordinator._may_close(outer_round, 0, order, set(PEERS), deadline=just) == (
            order.index("peer-a") <= 1)
        # The first coordinator gone: the next in line is first.
        assert coordinator._may_close(outer_round, 0, order, set(PEERS) - {order[0]}, float("inf")) == (
            first or order[1] == "peer-a")


def test_min_slice_numel_is_a_validated_run_setting_of_sliced_runs_only():
    from node.config import ConfigError
    from training.config import ModelConfig
    from training.stages import split_stages, stage_param_shapes

    full = run_document(config_from_dict({}))["diloco"]
    assert "min_slice_numel" not in full and "exchange" not in full  # a full run's hash is unchanged
    sliced = run_document(config_from_dict({"diloco": {"exchange": "sliced", "min_slice_numel": 4096}}))
    assert sliced["diloco"]["min_slice_numel"] == 4096
    assert run_document(config_from_dict({"diloco": {"exchange": "sliced"}}))["diloco"]["min_slice_numel"] \
        == 1024
    for bad in (0, -1, 1 << 31, True, 2.5, "4096"):
        with pytest.raises((TrainingConfigError, ConfigError), match="min_slice_numel"):
            DilocoConfig(exchange="sliced", min_slice_numel=bad)
    with pytest.raises(TrainingConfigError, match="only the sliced exchange"):
        DilocoConfig(min_slice_numel=4096)
    # The plan follows it: tiny's stages (~21k elements) in A = R slices down to 1,024 elements, in
    # at most 5 of 4,096 or more, and whole at 32,768.
    config = ModelConfig(preset="tiny")
    for spec in split_stages(config.n_layer, 2):
        shapes = stage_param_shapes(config, spec)
        numel = sum(math.prod(shape) for shape in shapes.values())
        assert live_plan(shapes, 16, 4096).num_slices == min(16, numel // 4096)
        assert live_plan(shapes, 16, 1 << 15).num_slices == 1


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
    assert run_document(config_from_dict({"diloco": {"exchange": "sliced"}}))["diloco"]["exchange"] \
        == "sliced"
    with pytest.raises(TrainingConfigError, match="diloco.exchange"):
        DilocoConfig(exchange="butterfly")


def test_outer_step_on_assembled_partials_matches_the_full_exchange_when_the_partials_are_exact():
    """With the codec off, partials are the exact slice averages: the sliced round equals the full one bit for
    bit."""
    torch.manual_seed(0)
    shapes = {"a": (64, 300), "b": (300,), "c": (40, 40)}
    plan = plan_slices(shapes, 3, min_slice_numel=1000)
    assert plan.num_slices == 3
    cfg = CompressionConfig(enabled=False)
    diloco = DilocoConfig(norm_clip=0.0, num_replicas=3)
    grads = [{n: torch.randn(s) for n, s in shapes.items()} for _ in range(3)]
    slices = [encode_slices(g, plan, cfg, 0, stage_index=0, outer_round=4)[0] for g in grads]
    partials = [aggregate_slice([slices[i][j] for i in range(3)], plan, j, cfg, 0, norm_clip=0.0,
                                stage_index=0, outer_round=4).partial for j in range(3)]
    weights = {n: torch.randn(s) for n, s in shapes.items()}
    momentum = {n: torch.zeros(s) for n, s in shapes.items()}
    average = average_of_partials(partials, plan, stage_index=0, outer_round=4, refuse_raw=False)
    sliced = step_with_average(weights, momentum, average, diloco, 4)
    full_blobs = [encode_slices(g, plan_slices(shapes, 1), cfg, 0, stage_index=0, outer_round=4)[0][0]
                  for g in grads]
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
    engine = StageEngine(0, params, DilocoConfig(one_step_delay=False, num_replicas=1),
                         CompressionConfig(enabled=False))
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
            out.append(aggregate_slice([s[0] for s in slices], plan, 0, cfg, budget, norm_clip=2.0,
                                       stage_index=0, outer_round=1).partial)
            assert torch.get_num_threads() == threads  # restored
    finally:
        torch.set_num_threads(before)
    assert out[0] and out[0] == out[1]


def test_a_flood_of_partial_announces_costs_only_its_sender():
    """One member announcing many partials of a slot cannot crowd out the aggregator's announce."""
    import threading
    from types import SimpleNamespace

    from node.live.exchange.sliced import ANNOUNCES_PER_SENDER, SlicedExchange

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


def test_a_coordinator_closes_only_with_contributions_whose_inputs_it_holds(tmp_path):
    """ContributionPool.closable (what RoundCoordinator.ready_close reads): the envelopes here whose inputs
    the exchange says it holds (the sliced exchange: the whole bundle, fetched, archived, served), so a
    member that serves its envelope but withholds its bundle is never closed by an honest coordinator."""
    from node.live.exchange.pool import ContributionPool

    identities = [Identity.generate() for _ in range(3)]
    envelopes = [_contribution(identity, slice_bundle([bytes([i])] * 3)[1], replica=i)
                 for i, identity in enumerate(identities)]
    digests = [hashlib.sha256(e).digest() for e in envelopes]
    asked = []

    def held(outer_round, stage, digest, envelope):
        asked.append((outer_round, stage, digest))
        return digest != digests[1]  # replica 1 withholds its bundle

    pool = ContributionPool(None, None, 7, tmp_path, 1 << 20, 1.0, 1, inputs_held=held)
    plain = ContributionPool(None, None, 7, tmp_path, 1 << 20, 1.0, 1)
    try:
        for digest, envelope in zip(digests, envelopes):
            pool.add(3, 1, digest, envelope)
            plain.add(3, 1, digest, envelope)
        assert set(pool.closable(3, 1)) == {digests[0], digests[2]}
        assert set(pool.have(3, 1)) == set(digests)  # still here (an aggregator reads its envelope)
        assert sorted(asked) == sorted((3, 1, d) for d in digests)
        assert set(plain.closable(3, 1)) == set(digests)  # the full exchange: the envelope is everything
    finally:
        pool.close()
        plain.close()
