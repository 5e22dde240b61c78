"""A contribution in parts (issue 75; docs/SCALE.md, "The per-shard exchange"): the cut every node agrees on
(training/cluster_parts.py), envelope version 2's parts root (p2p/envelope.py, p2p/parts.py), each part
checked alone, and the refusals of a wrong part, a part of another root, an index out of range, a truncated
part and a lying announcement."""

from __future__ import annotations

import functools
import hashlib

import msgpack
import pytest

from node import protocol as msg
from node.config import NodeConfig
from node.runconfig import run_document
from p2p.envelope import (DOMAIN_PARTS, VERSION_PARTS, Envelope, EnvelopeValidator, assemble, decode_envelope,
                          decode_header)
from p2p.errors import EnvelopeRejected
from p2p.identity import Identity
from p2p.parts import (MAX_PARTS, PartRejected, check_manifest, check_part, cut_at, pack_manifest,
                       part_digests, part_proof, parts_root, verify_part)
from tests import cluster_workers as workers
from training.cluster_parts import (blob_cuts, blob_layout, cut_entries, exchange_plan, first_part,
                                    part_routes, shard_message)
from training.cluster_plan import plan_shards, split_contribution
from training.config import DilocoConfig
from training.errors import ContributionDecodeError, TrainingConfigError

SEED = bytes(range(32))


@functools.cache
def _shapes() -> tuple:
    return tuple((name, tuple(p.shape)) for name, p in workers.make_module().named_parameters())


def stage_shapes() -> dict:
    return dict(_shapes())


@functools.cache
def contribution(outer_round: int = 0) -> bytes:
    return workers.others(stage_shapes(), outer_round)[0]


# ---------------------------------------------------------------------- 1. the cut
@pytest.mark.parametrize("parts", [1, 2, 3, 5, 1000])
def test_the_parts_concatenate_to_the_contribution_and_each_is_a_run_of_whole_tensors(parts):
    shapes, blob = stage_shapes(), contribution()
    plan = exchange_plan(shapes, parts)
    assert plan.world == min(parts, len(shapes))
    assert plan == plan_shards(shapes, plan.world)  # the same cut on every node: a pure function
    sizes = blob_cuts(blob, plan)
    pieces = cut_at(blob, sizes)
    assert b"".join(pieces) == blob and len(pieces) == plan.world and all(pieces)
    # part j's entries are its tensors' entries: with the prefix, split_contribution's message of them
    prefix, entries0 = first_part(pieces[0])
    assert prefix == blob_layout(blob).prefix
    expected = split_contribution(blob, plan)
    assert shard_message(prefix, entries0, len(plan.names[0])) == expected[0]
    for j in range(1, plan.world):
        assert shard_message(prefix, pieces[j], len(plan.names[j])) == expected[j]


def test_a_declared_steps_contribution_cuts_alike():
    from training.codec_wire import declare_steps

    shapes, blob = stage_shapes(), declare_steps(contribution(), 7)
    plan = exchange_plan(shapes, 4)
    pieces = cut_at(blob, blob_cuts(blob, plan))
    prefix, _ = first_part(pieces[0])
    assert shard_message(prefix, pieces[2], len(plan.names[2])) == split_contribution(blob, plan)[2]


def test_what_does_not_cut_is_refused():
    shapes = stage_shapes()
    plan = exchange_plan(shapes, 2)
    with pytest.raises(ContributionDecodeError, match="not a codec message"):
        blob_cuts(b"\xc1junk", plan)
    entries_last = msgpack.unpackb(contribution(), raw=False)
    moved = msgpack.packb({"t": entries_last["t"], "v": 1, "st": 0, "rd": 0}, use_bin_type=True)
    with pytest.raises(ContributionDecodeError, match="no entries array as its last field"):
        blob_cuts(moved, plan)
    with pytest.raises(ContributionDecodeError, match="bytes after"):
        blob_cuts(contribution() + b"\x00", plan)
    fewer = msgpack.packb({**entries_last, "t": entries_last["t"][:-1]}, use_bin_type=True)
    with pytest.raises(ContributionDecodeError, match="tensors, the stage has"):
        blob_cuts(fewer, plan)
    with pytest.raises(ContributionDecodeError, match="more entries than its tensors"):
        cut_entries(contribution()[blob_layout(contribution()).entries_at:], [1])


def test_a_part_goes_to_the_ranks_that_hold_its_tensors():
    shapes, blob = stage_shapes(), contribution()
    ranks = plan_shards(shapes, 2)
    for parts in (1, 3, 5):
        plan = exchange_plan(shapes, parts)
        routes = part_routes(plan, ranks)
        pieces = cut_at(blob, blob_cuts(blob, plan))
        prefix, first_entries = first_part(pieces[0])
        per_rank: dict[int, list[bytes]] = {0: [], 1: []}
        for j, route in enumerate(routes):
            entries = first_entries if j == 0 else pieces[j]
            for (rank, _), piece in zip(route, cut_entries(entries, [count for _, count in route])):
                per_rank[rank].append(piece)
        for rank in (0, 1):
            assert shard_message(prefix, b"".join(per_rank[rank]), len(ranks.names[rank])) \
                == split_contribution(blob, ranks)[rank]


def test_exchange_parts_is_a_run_setting_out_of_the_document_at_1():
    assert "exchange_parts" not in run_document(NodeConfig())["diloco"]
    cfg = NodeConfig()
    cfg.diloco.exchange_parts = 4
    assert run_document(cfg)["diloco"]["exchange_parts"] == 4
    with pytest.raises(TrainingConfigError, match="exchange_parts=0"):
        DilocoConfig(exchange_parts=0)
    with pytest.raises(TrainingConfigError, match="only the full exchange"):
        DilocoConfig(exchange_parts=2, exchange="sliced", num_replicas=4)


# ---------------------------------------------------------------------- 2. the envelope and each part alone
def parts_envelope(blob: bytes, parts: int = 3, **fields) -> tuple[Envelope, list[bytes]]:
    body = msg.encode_contribution_body(msg.ContributionBody(bytes(32), bytes(32), blob))
    head = len(body) - len(blob)
    sizes = blob_cuts(blob, exchange_plan(stage_shapes(), parts))
    sizes[0] += head  # part 0 carries the body's head too
    envelope = Envelope.create(Identity.from_seed(SEED), 7, 3, msg.CONTRIBUTION, body, stage=0, replica=1,
                               timestamp_ms=1_700_000_000_000, part_sizes=sizes, **fields)
    return envelope, cut_at(body, sizes)


def test_a_version_2_envelope_binds_the_parts_root_and_decodes_whole_or_as_header_and_parts():
    envelope, parts = parts_envelope(contribution())
    assert envelope.version == VERSION_PARTS and envelope.domain == DOMAIN_PARTS and envelope.in_parts
    assert envelope.payload_sha256 == b"" and envelope.parts_root == parts_root(part_digests(parts))
    whole = envelope.to_bytes()
    assert decode_envelope(whole, 1 << 24) == envelope
    with pytest.raises(EnvelopeRejected) as caught:
        decode_envelope(whole, 1 << 24, versions=(1,))
    assert caught.value.reason == "bad_version"
    header = decode_header(envelope.header().to_bytes(), 1 << 24)
    assert assemble(header, parts).to_bytes() == whole  # the record's envelope hash, rebuilt from parts
    assert msg.decode_contribution_body(decode_envelope(whole, 1 << 24).payload).blob == contribution()
    with pytest.raises(EnvelopeRejected, match="header's payload must be empty"):
        decode_header(whole, 1 << 24)


def test_a_version_1_envelope_is_what_it_was():
    v1 = Envelope.create(Identity.from_seed(SEED), 7, 3, msg.CONTRIBUTION, b"x", timestamp_ms=1)
    assert v1.version == 1 and not v1.in_parts and v1.payload_sha256 == hashlib.sha256(b"x").digest()
    assert b"parts_root" not in v1.to_bytes() and decode_envelope(v1.to_bytes(), 1024) == v1
    with pytest.raises(EnvelopeRejected) as caught:
        decode_header(v1.header().to_bytes(), 1024)
    assert caught.value.reason == "bad_version"  # a header is version 2's


@pytest.mark.parametrize("tamper, reason", [
    (lambda e: dict(e, payload=e["payload"][:-1]), "parts_size_mismatch"),
    (lambda e: dict(e, payload=e["payload"][:-1] + bytes([e["payload"][-1] ^ 1])), "parts_root_mismatch"),
    (lambda e: dict(e, part_sizes=b""), "malformed"),
    (lambda e: dict(e, part_sizes=e["part_sizes"][:-1]), "malformed"),
    (lambda e: dict(e, part_sizes=bytes(8) + e["part_sizes"][8:]), "malformed"),
    (lambda e: dict(e, part_sizes=(1).to_bytes(8, "big") * (MAX_PARTS + 1)), "malformed"),
    (lambda e: dict(e, parts_root=bytes(31)), "malformed"),
    (lambda e: dict(e, domain=b"dlx-envelope-v1"), "bad_domain"),
    (lambda e: dict(e, version=1), "bad_version"),
    (lambda e: dict(e, payload_sha256=bytes(32)), "malformed"),
    (lambda e: dict(e, round=4), "bad_signature"),
])
def test_a_tampered_version_2_envelope_is_refused_with_its_reason(tamper, reason):
    envelope, _ = parts_envelope(contribution())
    fields = msgpack.unpackb(envelope.to_bytes(), raw=False)
    with pytest.raises(EnvelopeRejected) as caught:
        decode_envelope(msgpack.packb(tamper(fields), use_bin_type=True), 1 << 24)
    assert caught.value.reason == reason


def test_each_part_is_checked_alone_and_every_bad_part_is_refused_with_its_reason():
    envelope, parts = parts_envelope(contribution(), parts=5)
    sizes, root = envelope.sizes, envelope.parts_root
    digests = check_manifest(pack_manifest(part_digests(parts)), root, len(parts))
    other, other_parts = parts_envelope(contribution(1), parts=5)
    for index, part in enumerate(parts):
        check_part(index, part, digests[index], sizes[index])
        verify_part(root, sizes, index, part, part_proof(digests, index))

    def reason(call) -> str:
        with pytest.raises(PartRejected) as caught:
            call()
        return caught.value.reason

    # a wrong part: another part's bytes at index 1, or one byte changed
    wrong = reason(lambda: check_part(1, parts[2], digests[1], sizes[1]))
    assert wrong in ("part_digest_mismatch", "part_truncated", "part_oversized")
    flipped = parts[1][:-1] + bytes([parts[1][-1] ^ 1])
    assert reason(lambda: check_part(1, flipped, digests[1], sizes[1])) == "part_digest_mismatch"
    proofs = [part_proof(digests, index) for index in range(5)]
    assert reason(lambda: verify_part(root, sizes, 1, flipped, proofs[1])) == "part_proof_invalid"
    # a part of another root (another contribution's part 1 with its own valid proof)
    other_digests = part_digests(other_parts)
    assert reason(lambda: verify_part(root, other.sizes, 1, other_parts[1], part_proof(other_digests, 1))) \
        == "part_proof_invalid"
    # the right part with the proof of another index
    assert reason(lambda: verify_part(root, sizes, 1, parts[1], proofs[2])) == "part_proof_invalid"
    # an index out of range
    assert reason(lambda: verify_part(root, sizes, 5, parts[1], [])) == "part_index_out_of_range"
    assert reason(lambda: verify_part(root, sizes, -1, parts[1], [])) == "part_index_out_of_range"
    assert reason(lambda: part_proof(digests, 9)) == "part_index_out_of_range"
    # a truncated part, and one with a byte too many
    assert reason(lambda: check_part(3, parts[3][:-1], digests[3], sizes[3])) == "part_truncated"
    assert reason(lambda: verify_part(root, sizes, 3, parts[3][:-1], proofs[3])) == "part_truncated"
    assert reason(lambda: check_part(3, parts[3] + b"\x00", digests[3], sizes[3])) == "part_oversized"
    # a lying announcement: digests that are not the signed root's, or not as many
    assert reason(lambda: check_manifest(pack_manifest(other_digests), root, 5)) == "manifest_root_mismatch"
    assert reason(lambda: check_manifest(pack_manifest(digests[:4]), root, 5)) == "manifest_root_mismatch"
    assert reason(lambda: check_manifest(pack_manifest(digests)[:-1], root, 5)) == "manifest_malformed"


def test_a_re_signed_version_2_contribution_is_a_replay_and_another_is_an_equivocation():
    envelope, _ = parts_envelope(contribution())
    again, _ = parts_envelope(contribution(), )
    validator = EnvelopeValidator(7, 1 << 24, min_round=3, versions=(1, 2))
    validator.check(envelope.to_bytes())
    resigned = Envelope.create(Identity.from_seed(SEED), 7, 3, msg.CONTRIBUTION, envelope.payload, stage=0,
                               replica=1, timestamp_ms=1_700_000_000_001, part_sizes=envelope.sizes)
    with pytest.raises(EnvelopeRejected) as caught:
        validator.check(resigned.to_bytes())
    assert caught.value.reason == "replayed"
    other, _ = parts_envelope(contribution(1))
    with pytest.raises(EnvelopeRejected) as caught:
        validator.check(other.to_bytes())
    assert caught.value.reason == "equivocation"
    assert again == envelope
    with pytest.raises(EnvelopeRejected) as caught:
        EnvelopeValidator(7, 1 << 24, min_round=3).check(envelope.to_bytes())
    assert caught.value.reason == "bad_version"  # gossip speaks version 1 unless told otherwise


@pytest.mark.parametrize("size", [1, 255, 256, 65535, 65536, 200_000])
def test_a_part_is_a_range_of_the_whole_envelope_at_every_width_of_its_payload(size):
    from p2p.envelope import payload_offset

    payload = bytes(i % 251 for i in range(size))
    sizes = [size] if size < 3 else [size // 3, size // 3, size - 2 * (size // 3)]
    envelope = Envelope.create(Identity.from_seed(SEED), 7, 3, msg.CONTRIBUTION, payload, timestamp_ms=1,
                               part_sizes=sizes)
    at = payload_offset(envelope.header(), size)
    assert envelope.to_bytes()[at:at + size] == payload


# ---------------------------------------------------------------------- the wire vectors (wire.json)
def v2_vectors() -> dict:
    import json
    from pathlib import Path

    return json.loads((Path(__file__).parent / "vectors" / "wire.json").read_text())["envelopes_v2"]


def test_the_version_2_vectors_decode_cut_and_verify_as_written():
    from p2p.envelope import payload_offset

    vector = v2_vectors()
    data = bytes.fromhex(vector["envelope_hex"])
    envelope = decode_envelope(data, 1 << 20)
    parts = [bytes.fromhex(p) for p in vector["parts_hex"]]
    digests = [bytes.fromhex(d) for d in vector["part_digests_hex"]]
    assert envelope.domain.decode() == vector["domain"] and envelope.sizes == vector["part_sizes"]
    assert envelope.parts_root.hex() == vector["parts_root_hex"] == parts_root(digests).hex()
    assert envelope.signing_bytes().hex() == vector["signing_bytes_hex"]
    assert hashlib.sha256(data).hexdigest() == vector["envelope_hash_hex"]
    assert b"".join(parts) == envelope.payload and part_digests(parts) == digests
    header = decode_header(bytes.fromhex(vector["header_hex"]), 1 << 20)
    assert assemble(header, parts).to_bytes() == data
    at = vector["payload_offset"]
    assert payload_offset(header, sum(vector["part_sizes"])) == at
    assert data[at:at + len(parts[0])] == parts[0]
    assert check_manifest(bytes.fromhex(vector["manifest_hex"]), envelope.parts_root, len(parts)) == digests
    for index, (part, proof) in enumerate(zip(parts, vector["proofs_hex"])):
        verify_part(envelope.parts_root, envelope.sizes, index, part, [bytes.fromhex(s) for s in proof])
    # each part's entries are the tensors the plan names (the codec blob's, after part 0's body head)
    body = msg.decode_contribution_body(envelope.payload)
    shapes = {name: (1,) for names in vector["parts_plan"] for name in names}
    assert [list(n) for n in exchange_plan(shapes, vector["exchange_parts"]).names] == vector["parts_plan"]
    prefix, _ = first_part(parts[0][len(envelope.payload) - len(body.blob):])
    assert shard_message(prefix, parts[1], len(vector["parts_plan"][1])) == split_contribution(
        body.blob, exchange_plan(shapes, 2))[1]


@pytest.mark.parametrize("vector", v2_vectors()["rejected"], ids=lambda v: v["name"])
def test_the_refused_version_2_vectors(vector):
    with pytest.raises(EnvelopeRejected) as caught:
        decode_envelope(bytes.fromhex(vector["envelope_hex"]), 1 << 20)
    assert caught.value.reason == vector["reason"]
