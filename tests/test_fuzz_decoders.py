"""Every decoder a peer, a file or the chain reaches ends in success or its own defined error (issue 15).

Property-based (hypothesis) over the targets of ``tests/fuzz_targets.py``: random bytes, mutations
of valid objects (bit flips, truncations, splices; valid msgpack/JSON/TOML with wrong types, sizes
and ranges; envelopes re-signed around mutated payloads) and structures hypothesis builds itself.
The budget is small and derandomized so CI is fast and reproducible; ``bench/fuzz_campaign.py``
runs the same targets over a million inputs. Below the properties, one regression test per bug
the fuzzing found, each with the input that used to escape (or to blow up memory).
"""

from __future__ import annotations

import json
import math
import random
import struct
import tracemalloc

import msgpack
import pytest
from fuzz_targets import (
    CHECKPOINT,
    GOSSIP_LIMIT,
    IDENTITY,
    PAYLOADS,
    RUN_ID,
    SHAPES,
    Target,
    decode_gossip,
    random_input,
    safetensors_bytes,
    sign,
    targets,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from node import protocol as msg
from node.config import load_config
from node.errors import ConfigError, StateError
from node.live.state.status import StateFile
from node.runconfig import node_config_from_run, parse_run_document
from node.store.checkpoint import parse_checkpoint
from p2p.envelope import Envelope, decode_envelope
from p2p.errors import EnvelopeRejected
from p2p.gossip import SYNC_MAX_RESPONSE_BYTES, parse_sync_response
from p2p.wire import ProtocolViolation, decode_frame, read_frame
from training.codec_wire import decode_contribution
from training.errors import ContributionCodecRefused, ContributionDecodeError, ReplicaStateError

TARGETS = {t.name: t for t in targets()}
FUZZ = settings(max_examples=15, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _ends_well(target: Target, data: bytes) -> None:
    """``data`` decodes or raises one of the target's errors; anything else fails the test."""
    try:
        target.decode(data)
    except target.errors:
        pass


# ----------------------------------------------------------------------------- properties


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(TARGETS))
@FUZZ
@given(data=st.binary(max_size=512))
def test_random_bytes_end_in_success_or_the_defined_error(name, data):
    _ends_well(TARGETS[name], data)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(TARGETS))
@FUZZ
@given(rng=st.randoms(use_true_random=False))
def test_mutations_of_valid_inputs_end_in_success_or_the_defined_error(name, rng: random.Random):
    target = TARGETS[name]
    for _ in range(3):  # seeds mutated byte-wise and structurally (tests/fuzz_targets.random_input)
        _ends_well(target, random_input(rng, target))


def test_every_seed_decodes():
    """The seeds are valid inputs: the mutations start from objects the decoders accept."""
    for target in TARGETS.values():
        if target.name == "envelope_validator":
            continue  # stateful: a seed it saw before is a replay, by design
        for seed in target.seeds:
            try:
                assert target.decode(seed) is not None, target.name
            except ContributionCodecRefused:  # the uncompressed seed, in a run that compresses
                assert target.name == "contribution_refuse_raw"


_ANY = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1) | st.floats()
    | st.binary(max_size=70) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)
_ENVELOPE_FIELDS = msgpack.unpackb(sign(msg.ANNOUNCE, PAYLOADS[msg.ANNOUNCE]), raw=False)


@pytest.mark.timeout(60)
@FUZZ
@given(name=st.sampled_from(sorted(_ENVELOPE_FIELDS)), value=_ANY)
def test_an_envelope_field_of_any_type_is_rejected_by_reason(name, value):
    fields = dict(_ENVELOPE_FIELDS, **{name: value})
    with pytest.raises(EnvelopeRejected) as caught:
        decode_envelope(msgpack.packb(fields, use_bin_type=True), GOSSIP_LIMIT)
    assert caught.value.reason in {"malformed", "bad_domain", "bad_version", "bad_kind", "non_canonical",
                                   "payload_hash_mismatch", "bad_signature", "oversized"}


@pytest.mark.timeout(60)
@FUZZ
@given(kind=st.sampled_from(sorted(PAYLOADS)), values=st.dictionaries(st.text(max_size=20), _ANY,
                                                                      max_size=10),
       keep=st.booleans())
def test_a_signed_payload_of_any_shape_is_refused_with_protocol_error(kind, values, keep):
    """Behind a valid signature, a payload map of any keys and values: decoded or ProtocolError."""
    base = msgpack.unpackb(PAYLOADS[kind], raw=False) if keep else {}
    try:
        payload = msgpack.packb({**base, **values}, use_bin_type=True)
    except (OverflowError, ValueError):
        return
    try:
        decode_gossip(sign(kind, payload))
    except msg.ProtocolError:
        pass


@pytest.mark.timeout(60)
@FUZZ
@given(prefix=st.binary(min_size=0, max_size=8), body=st.binary(max_size=64), cut=st.integers(0, 80))
def test_read_frame_on_a_stream_ends_in_protocol_violation(prefix, body, cut):
    """The async reader: short, truncated or oversized frames from a stream are ProtocolViolations."""
    import trio

    class Stream:
        def __init__(self, data: bytes) -> None:
            self.data = data

        async def read(self, n: int) -> bytes:
            chunk, self.data = self.data[:n], self.data[n:]
            return chunk

    data = (prefix + body)[:cut]

    async def main():
        try:
            await read_frame(Stream(data), 4096)
        except ProtocolViolation:
            pass

    trio.run(main)


# ----------------------------------------------------------------------------- regressions


def test_payload_keys_mixing_str_and_bin_are_a_protocol_error():
    raw = msgpack.unpackb(PAYLOADS[msg.ANNOUNCE], raw=False)
    raw[b"size"] = raw.pop("size")  # used to raise TypeError from sorted() in decode_payload
    with pytest.raises(msg.ProtocolError):
        msg.decode_payload(msg.ANNOUNCE, msgpack.packb(raw, use_bin_type=True))


def _checkpoint_with_meta(text: str | None) -> bytes:
    length = struct.unpack("<Q", CHECKPOINT[:8])[0]
    header = json.loads(CHECKPOINT[8:8 + length])
    header["__metadata__"] = None if text is None else {"dlx": text}
    return safetensors_bytes(header, CHECKPOINT[8 + length:])


@pytest.mark.parametrize("change", ["stage_hashes_list", "round_infinite", "deep", "null_metadata"])
def test_malformed_checkpoint_metadata_is_a_state_error(change):
    length = struct.unpack("<Q", CHECKPOINT[:8])[0]
    meta = json.loads(json.loads(CHECKPOINT[8:8 + length])["__metadata__"]["dlx"])
    if change == "stage_hashes_list":
        text = json.dumps({**meta, "stage_hashes": ["00" * 32]})  # was AttributeError
    elif change == "round_infinite":
        text = json.dumps({**meta, "round": math.inf})  # was OverflowError
    elif change == "deep":
        text = "[" * 50_000  # was RecursionError
    else:
        text = None  # was AttributeError ('NoneType' has no .get)
    with pytest.raises(StateError):
        parse_checkpoint(_checkpoint_with_meta(text))


@pytest.mark.parametrize("document", [
    b'{"format": "dlx-run-v1", "run_name": 1' + b"0" * 5000 + b"}",  # was ValueError (int digits)
    b'{"format": "dlx-run-v1"}',  # was KeyError
    b'{"format": "dlx-run-v1", "run_name": "x", "training": 3, "model": {}, "diloco": {}, "compression": {},'
    b' "pipeline": {"num_stages": 1}}',  # was TypeError
    b"[" * 50_000,  # was RecursionError
])
def test_malformed_run_documents_are_a_config_error(document):
    with pytest.raises(ConfigError):
        node_config_from_run(parse_run_document(document))


@pytest.mark.parametrize("line", [
    "round_timeout = 1" + "0" * 400,  # was OverflowError (int too large for float)
    "round_timeout = nan",  # was accepted: nan passes every "> 0" check
    "rounds = 1" + "0" * 30,  # out of int64
    '[p2p]\nbootstrap = [1, true]',  # was AttributeError ('int' has no startswith)
    "[compression]\nbit_choices = [2.0, 4.0]",  # was accepted as floats
    "rounds = " + "[" * 3000 + "]" * 3000,  # deep nesting
])
def test_malformed_node_toml_is_a_config_error(tmp_path, line):
    path = tmp_path / "node.toml"
    path.write_text(line + "\n")
    with pytest.raises(ConfigError):
        load_config(path)


@pytest.mark.parametrize("state", [
    [1, 2],
    {"run_id": RUN_ID, "signed_records": {"9": ["zz", "ef"]}},  # was ValueError from fromhex
    {"run_id": RUN_ID, "signed_records": [1]},  # was AttributeError
    {"run_id": RUN_ID, "last_contributed": "5"},  # the node adds 1 to it at start
    {"run_id": RUN_ID, "attested": {"3": [1.5, None]}},  # unpacked into three figures
    {"run_id": RUN_ID, "attested": {"3": [1.5, None, "100"]}},
    {"run_id": RUN_ID, "attested": {"x": [1.5, None, 100]}},
    {"run_id": RUN_ID, "attested": {"3": [True, None, 100]}},
    {"run_id": RUN_ID, "reentered_for": ["2"]},
])
def test_malformed_state_json_is_a_state_error_or_ignored(tmp_path, state):
    path = tmp_path / "state.json"
    path.write_text(json.dumps(state))
    try:
        loaded = StateFile(path, RUN_ID)
    except StateError:
        return
    assert loaded.get("run_id") is None  # a file that is not a map of this run counts as empty


@pytest.mark.parametrize("manifest", [
    b'{"round": 3, "contributions": [[Infinity, 1, "p", "ab"]]}',  # was OverflowError
    b'{"round": 3, "contributions": ' + b"[" * 5000 + b"]" * 5000 + b"}",  # was RecursionError
])
def test_a_malformed_archive_manifest_is_a_state_error(manifest):
    with pytest.raises(StateError):
        TARGETS["archive_manifest"].decode(manifest)


def test_a_replica_state_tensor_name_that_is_not_utf8_is_a_replica_state_error():
    target = TARGETS["replica_state"]
    data = target.seeds[0]
    name = b"adam.step/"
    index = data.index(name)
    with pytest.raises(ReplicaStateError):
        target.decode(data[:index] + b"\xff" + data[index + 1:])  # was UnicodeDecodeError


def test_a_chain_log_that_does_not_decode_is_a_ledger_decode_error():
    from ledger.errors import LedgerDecodeError

    target = TARGETS["chain_log"]
    committed = next(seed for seed in target.seeds if len(seed) > 400)
    with pytest.raises(LedgerDecodeError):  # was eth_abi's InsufficientDataBytes
        target.decode(committed[:-40])


def test_kind_with_a_trailing_newline_is_refused():
    envelope = Envelope.create(IDENTITY, RUN_ID, 0, "hello", b"")
    fields = msgpack.unpackb(envelope.to_bytes(), raw=False)
    fields["kind"] = "hello\n"  # re.match with $ accepted it
    with pytest.raises(EnvelopeRejected) as caught:
        decode_envelope(msgpack.packb(fields, use_bin_type=True), GOSSIP_LIMIT)
    assert caught.value.reason == "bad_kind"


def _peak(call) -> int:
    tracemalloc.start()
    try:
        call()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def test_a_tree_of_nested_maps_is_refused_before_it_is_built():
    """9.8 MB of nested maps used to take 300 MiB and seconds to reach 'malformed'."""
    def tree(depth: int) -> dict:
        return {} if depth == 0 else {chr(97 + i): tree(depth - 1) for i in range(12)}

    bomb = msgpack.packb(tree(5))  # 0.8 MB
    def decode():
        with pytest.raises(EnvelopeRejected):
            decode_envelope(bomb, 1 << 30)
    assert _peak(decode) < 1 << 20


def test_a_sync_response_of_nested_arrays_is_refused_before_it_is_built():
    """A 16 MiB response of empty arrays used to become ~1 GiB of Python lists."""
    count = 1 << 20
    body = (b"\x83\xa5epoch\xc4\x08" + bytes(8) + b"\xa4next\x00\xa8messages\xdd" + count.to_bytes(4, "big")
            + b"\x90" * count)
    frame = len(body).to_bytes(4, "big") + body

    def decode():
        with pytest.raises(ProtocolViolation):
            parse_sync_response(decode_frame(frame, SYNC_MAX_RESPONSE_BYTES, max_containers=2))
    assert _peak(decode) < 2 * len(frame)  # the frame and its one copy; not ~60 bytes per byte


def test_a_contribution_of_nested_arrays_is_refused_before_it_is_built():
    shapes = {"w": (512, 512)}
    inner = b"\xdc\x00\x48" + b"\x90" * 72
    bomb = b"\x84\xa1v\x01\xa2st\x00\xa2rd\x03\xa1t\xdc\x00\x48" + inner * 72

    def decode():
        with pytest.raises(ContributionDecodeError):
            decode_contribution(bomb, shapes)
    assert _peak(decode) < 1 << 20
    assert decode_contribution(TARGETS["contribution"].seeds[0], SHAPES)  # the bound admits a real one


def test_a_payload_of_nested_arrays_is_refused_before_it_is_built():
    """Payloads are bounded to the maps and arrays their type holds (a close: up to 4096 entries)."""
    bomb = b"\x81\xa1x\xdc\xff\xff" + b"\x90" * 0xFFFF

    def decode():
        with pytest.raises(msg.ProtocolError):
            msg.decode_payload(msg.HELLO, bomb[:msg.MAX_GOSSIP_PAYLOAD])
    assert _peak(decode) < 1 << 20
    close = msg.Close([[i, IDENTITY.peer_id, bytes(32), 1] for i in range(600)])  # ~54 KiB
    assert len(msg.decode_payload(msg.CLOSE, msg.encode_payload(close)).contributions) == 600
