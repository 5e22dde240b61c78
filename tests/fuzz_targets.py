"""The decoders a peer, a file or the chain can reach, with their defined errors and valid seeds.

Shared by ``tests/test_fuzz_decoders.py`` (hypothesis, a small budget in CI) and
``bench/fuzz_campaign.py`` (a fast in-process mutation fuzzer, >= 1,000,000 inputs). Each
:class:`Target` is one decoder as the node calls it on untrusted bytes, the errors it may raise
(its package's specific error; anything else is a bug) and a few valid inputs to mutate. The
mutators make random bytes, byte-level mutations of the seeds (bit flips, truncations, splices)
and structured ones (valid msgpack or JSON or TOML whose values have the wrong types or sizes;
envelopes re-signed around a mutated payload, so the payload decoder is reached through a valid
signature).
"""

from __future__ import annotations

import atexit
import json
import math
import os
import random
import shutil
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import torch

from node import protocol as msg
from node.config import load_config
from node.errors import CONFIG_ERRORS, ConfigError, StateError
from node import protocol as msg
from node.live.state.status import StateFile
from node.runconfig import canonical_json, node_config_from_run, parse_run_document, run_document
from node.store.archive import Archive
from node.store.checkpoint import Checkpoint, parse_checkpoint
from p2p.blob_protocol import (
    MAX_FRAME_BYTES,
    bad_request_reply,
    not_found_reply,
    ok_reply,
    out_of_range_reply,
    parse_reply,
    parse_request,
    request_frame,
)
from p2p.envelope import Envelope, EnvelopeValidator, decode_envelope
from p2p.errors import EnvelopeRejected, IdentityError
from p2p.gossip import (
    SYNC_MAX_OFFER_BYTES,
    SYNC_MAX_RESPONSE_BYTES,
    parse_sync_offer,
    parse_sync_request,
    parse_sync_response,
    parse_sync_want,
    sync_offer_frame,
    sync_request_frame,
    sync_response_frame,
    sync_want_frame,
)
from p2p.identity import Identity
from p2p.wire import ProtocolViolation, decode_frame, encode_frame
from training.codec_wire import decode_contribution
from training.compression import encode_contribution
from training.config_compression import CompressionConfig
from training.errors import ContributionDecodeError, ReplicaStateError

RUN_ID = 7
GOSSIP_LIMIT = 64 * 1024 + 4096  # the run topic validator's envelope limit (docs/PROTOCOL.md)
IDENTITY = Identity.from_seed(bytes(range(32)))
SHAPES = {"a.weight": (8, 6), "b.bias": (6,), "c.empty": (0,)}


@dataclass
class Target:
    """One decoder: ``decode(data)`` must return or raise one of ``errors``, nothing else."""

    name: str
    decode: Callable[[bytes], Any]
    errors: tuple[type[BaseException], ...]
    seeds: list[bytes]
    structured: Callable[[random.Random], bytes] | None = None
    notes: str = ""
    extra: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- random values


def random_value(rng: random.Random, depth: int = 0) -> Any:
    """A msgpack/JSON-able value of any type, biased to boundaries (wrong types, sizes, ranges)."""
    choice = rng.randrange(16 if depth < 3 else 11)
    if choice == 0:
        return rng.choice([0, 1, -1, 2**31 - 1, 2**32, 2**63 - 1, 2**64 - 1, -(2**63), 255, 256, 65535])
    if choice == 1:
        return rng.randrange(-1000, 1000)
    if choice == 2:
        return rng.choice([math.nan, math.inf, -math.inf, 0.5, -0.0, 1e308, 5e-324])
    if choice == 3:
        return rng.choice([True, False, None])
    if choice in (4, 5):
        return rng.randbytes(rng.choice([0, 1, 19, 20, 21, 31, 32, 33, 64, 65, 66, rng.randrange(300)]))
    if choice in (6, 7):
        return "".join(rng.choice("az09_-/:.\x00\u00e9\U0001f600 ")
                       for _ in range(rng.choice([0, 1, 5, 40, 513])))
    if choice == 8:
        return rng.choice(["hello", "ok", "busy", "not_found", "raw", "quant", "lowrank", "dlx-run-v1"])
    if choice == 9:
        return rng.randrange(2**64)
    if choice == 10:
        return []
    if choice in (11, 12, 13):
        return [random_value(rng, depth + 1) for _ in range(rng.choice([0, 1, 2, 4, 5]))]
    return {str(random_value(rng, 3))[:12]: random_value(rng, depth + 1) for _ in range(rng.randrange(4))}


def mutate_tree(rng: random.Random, value: Any, depth: int = 0, bin_keys: bool = True) -> Any:
    """``value`` (maps and lists) with one element replaced, removed or added somewhere inside.

    ``bin_keys``: may turn a str key into bytes (msgpack has both; JSON does not).
    """
    if isinstance(value, dict) and value and (depth < 4 and rng.random() < 0.6):
        key = rng.choice(list(value))
        out = dict(value)
        roll = rng.random()
        if roll < 0.1:
            del out[key]
        elif roll < 0.18:
            out[str(random_value(rng, 3))[:10] or "x"] = random_value(rng)
        elif roll < 0.22 and isinstance(key, str) and bin_keys:
            out[key.encode()] = out.pop(key)  # a bin key where a str belongs
        else:
            out[key] = mutate_tree(rng, value[key], depth + 1, bin_keys)
        return out
    if isinstance(value, list) and value and (depth < 4 and rng.random() < 0.6):
        out = list(value)
        index = rng.randrange(len(out))
        roll = rng.random()
        if roll < 0.1:
            del out[index]
        elif roll < 0.2:
            out.insert(index, random_value(rng))
        else:
            out[index] = mutate_tree(rng, out[index], depth + 1, bin_keys)
        return out
    return random_value(rng)


def packb(value: Any) -> bytes:
    try:
        return msgpack.packb(value, use_bin_type=True)
    except (OverflowError, TypeError, ValueError):  # an int the format cannot hold: drop it
        return msgpack.packb(str(value)[:64], use_bin_type=True)


def mutate_bytes(rng: random.Random, data: bytes, seeds: list[bytes]) -> bytes:
    """A byte-level mutation of ``data`` (flips, boundary bytes, truncation, insertion, splice)."""
    buf = bytearray(data)
    count = 1
    while count < 8 and rng.random() < 0.4:  # mostly one change, sometimes a few
        count += 1
    for _ in range(count):
        roll = rng.randrange(9)
        if roll == 0 and buf:
            i = rng.randrange(len(buf))
            buf[i] ^= 1 << rng.randrange(8)
        elif roll == 1 and buf:
            buf[rng.randrange(len(buf))] = rng.choice([0x00, 0xFF, 0x7F, 0x80, 0xC0, 0xC1, 0xC4, 0xD9, 0xDC,
                                                       0xDD, 0xDE, 0xDF, 0xCF, 0xCB, 0x90, 0x80, 0x9F])
        elif roll == 2 and buf:
            del buf[rng.randrange(len(buf) + 1):]  # truncation
        elif roll == 3:
            i = rng.randrange(len(buf) + 1)
            buf[i:i] = rng.randbytes(rng.choice([1, 2, 4, 8, 32]))
        elif roll == 4 and len(buf) > 1:
            i = rng.randrange(len(buf))
            del buf[i:i + rng.randrange(1, 64)]
        elif roll == 5 and buf:
            i = rng.randrange(len(buf))
            j = min(len(buf), i + rng.randrange(1, 64))
            buf[i:i] = buf[i:j]  # duplicate a range
        elif roll == 6 and seeds:
            other = rng.choice(seeds)
            cut = rng.randrange(len(buf) + 1)
            buf = buf[:cut] + other[rng.randrange(len(other) + 1):]  # splice
        elif roll == 7 and len(buf) >= 4:
            i = rng.randrange(len(buf) - 3)
            buf[i:i + 4] = rng.choice([b"\xff\xff\xff\xff", b"\x7f\xff\xff\xff", b"\x00\x00\x00\x00",
                                       b"\x00\x01\x00\x00"])
        else:
            buf += rng.randbytes(rng.randrange(1, 16))
    return bytes(buf)


def random_input(rng: random.Random, target: Target) -> bytes:
    """One fuzz input for ``target``: random bytes, a byte mutation of a seed, or a structured one."""
    roll = rng.random()
    if roll < 0.08:
        return rng.randbytes(rng.choice([0, 1, 2, 4, 8, 16, 64, 256, 4096]))
    if roll < 0.55 or target.structured is None:
        return mutate_bytes(rng, rng.choice(target.seeds), target.seeds)
    return target.structured(rng)


# ----------------------------------------------------------------------------- envelopes and payloads


def valid_payloads() -> dict[str, bytes]:
    """One valid payload of every gossip kind."""
    peer = IDENTITY.peer_id
    return {
        msg.HELLO: msg.encode_payload(msg.Hello("cluster-0", 1, bytes(range(20)),
                                                [f"/ip4/127.0.0.1/tcp/4001/p2p/{peer}"], 3, 2)),
        msg.ANNOUNCE: msg.encode_payload(msg.Announce(bytes(range(32)), 1234)),
        msg.CLOSE: msg.encode_payload(msg.Close([[0, peer, bytes(32), 100], [1, peer, bytes(range(32)), 7]])),
        msg.ATTESTATION: msg.encode_payload(msg.Attestation(bytes(32), bytes(range(32)), 2, 3.5, math.nan,
                                                            512, b"", bytes(32))),
        msg.RECORD: msg.encode_payload(msg.RecordSignature(bytes(32), bytes(32), bytes(32), 3_500_000,
                                                           3_400_000, 512, 2, bytes(32), bytes(20),
                                                           bytes(65))),
        **_spot_check_payloads(),
    }


def _spot_check_payloads() -> dict[str, bytes]:
    """The re-execution kinds (accusation, verdict, evidence), where this tree has them."""
    out = {}
    if hasattr(msg, "Accusation"):
        out[msg.ACCUSATION] = msg.encode_payload(msg.Accusation(4, bytes(20), IDENTITY.peer_id, 1, bytes(32),
                                                                900))
    if hasattr(msg, "VerdictSignature"):
        out[msg.VERDICT] = msg.encode_payload(msg.VerdictSignature(bytes(20), bytes(32), True, bytes(20),
                                                                   bytes(65)))
    if hasattr(msg, "Evidence"):
        out[msg.EVIDENCE] = msg.encode_payload(msg.Evidence(bytes(20), 1, [b"envelope"], "guilty", "distance",
                                                            [0.5]))
    return out


PAYLOADS = valid_payloads()


def sign(kind: str, payload: bytes, round_index: int = 3, stage: int = 0) -> bytes:
    return Envelope.create(IDENTITY, RUN_ID, round_index, kind, payload, stage=stage, replica=1,
                           timestamp_ms=1_700_000_000_000).to_bytes()


def envelope_seeds() -> list[bytes]:
    seeds = [sign(kind, payload) for kind, payload in PAYLOADS.items()]
    seeds.append(sign(msg.CONTRIBUTION, contribution_seeds()[0]))
    return seeds


def structured_envelope(rng: random.Random) -> bytes:
    """A valid envelope with one header field of the wrong type/size/value, not re-signed."""
    fields = msgpack.unpackb(rng.choice(ENVELOPES), raw=False)
    return packb(mutate_tree(rng, fields))


def structured_gossip(rng: random.Random) -> bytes:
    """A correctly signed envelope around a mutated payload (the payload decoder behind a valid signature)."""
    kind = rng.choice(list(PAYLOADS))
    return sign(kind, structured_payload(rng, kind), stage=rng.choice([-1, 0, 1]))


def structured_payload(rng: random.Random, kind: str) -> bytes:
    tree = msgpack.unpackb(PAYLOADS[kind], raw=False)
    if rng.random() < 0.2:
        return packb(random_value(rng))
    return packb(mutate_tree(rng, tree))


def decode_gossip(data: bytes) -> Any:
    """What the node does with a run-topic message: verify the envelope, then decode its payload."""
    env = decode_envelope(data, GOSSIP_LIMIT)
    if env.kind in PAYLOADS:
        return msg.decode_payload(env.kind, env.payload)
    return env


_validator = EnvelopeValidator(RUN_ID, GOSSIP_LIMIT, min_round=0, max_rounds_ahead=8)


def validate(data: bytes) -> Any:
    """The stateful validator (replays, rounds, equivocation) on top of decoding."""
    return _validator.check(data)


# ----------------------------------------------------------------------------- contributions


def contribution_seeds() -> list[bytes]:
    generator = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}
    seeds = []
    for cfg in (CompressionConfig(), CompressionConfig(min_compress_numel=1, bit_choices=[2, 16], max_rank=2),
                CompressionConfig(enabled=False)):
        blob, _, _ = encode_contribution(tensors, cfg, stage_index=0, outer_round=3)
        seeds.append(blob)
    return seeds


CONTRIBUTIONS = contribution_seeds()


def structured_contribution(rng: random.Random) -> bytes:
    return packb(mutate_tree(rng, msgpack.unpackb(rng.choice(CONTRIBUTIONS), raw=False)))


def decode_codec(data: bytes) -> Any:
    return decode_contribution(data, SHAPES, stage_index=0, outer_round=3, refuse_raw=False)


def decode_codec_strict(data: bytes) -> Any:
    return decode_contribution(data, SHAPES, stage_index=0, outer_round=3, refuse_raw=True)


# ----------------------------------------------------------------------------- stream frames


def frame_seeds(frames: list[dict]) -> list[bytes]:
    return [encode_frame(f) for f in frames]


def structured_frame(rng: random.Random, seeds: list[bytes]) -> bytes:
    body = msgpack.unpackb(rng.choice(seeds)[4:], raw=False)
    packed = packb(mutate_tree(rng, body))
    length = len(packed) if rng.random() < 0.9 else rng.choice([0, len(packed) + 1, 4097, 2**32 - 1])
    return length.to_bytes(4, "big") + packed


BLOB_REQUESTS = frame_seeds([request_frame(bytes(range(32)), 0, 0),
                             request_frame(bytes(32), 8 << 20, 8 << 20)])
BLOB_REPLIES = frame_seeds([ok_reply(100, bytes(range(32)), 0, 100), not_found_reply(), out_of_range_reply(5),
                            {"status": "busy"}, bad_request_reply("sha256 must be 32 bytes")])
SYNC_REQUESTS = frame_seeds([sync_request_frame("/dlx/run/7/v1", b"", 0),
                             sync_request_frame("/dlx/run/7/v1", os.urandom(8), 12)])


def sync_response_seeds() -> list[bytes]:
    return frame_seeds([sync_response_frame(b"\x01" * 8, 3, envelope_seeds()[:3]),
                        sync_response_frame(b"\x02" * 8, 0, [])])


def decode_blob_request(data: bytes) -> Any:
    return parse_request(decode_frame(data, MAX_FRAME_BYTES))


def decode_blob_reply(data: bytes) -> Any:
    return parse_reply(decode_frame(data, MAX_FRAME_BYTES), bytes(range(32)), 0, 100)


def decode_sync_request(data: bytes) -> Any:
    return parse_sync_request(decode_frame(data, 4096))


def decode_sync_response(data: bytes) -> Any:
    return parse_sync_response(decode_frame(data, SYNC_MAX_RESPONSE_BYTES, max_containers=2))


SYNC_OFFERS = frame_seeds([sync_offer_frame(b"\x01" * 8, 3, [bytes(range(16)), bytes(16)]),
                           sync_offer_frame(b"\x02" * 8, 0, [])])
SYNC_WANTS = frame_seeds([sync_want_frame([0, 3, 9]), sync_want_frame([])])


def decode_sync_offer(data: bytes) -> Any:
    return parse_sync_offer(decode_frame(data, SYNC_MAX_OFFER_BYTES, max_containers=2))


def decode_sync_want(data: bytes) -> Any:
    return parse_sync_want(decode_frame(data, 64 + 5 * 10), 10)


# ----------------------------------------------------------------------------- files


def checkpoint_seed() -> bytes:
    generator = torch.Generator().manual_seed(1)
    weights = {"a.weight": torch.randn(4, 3, generator=generator),
               "b.bias": torch.randn(3, generator=generator)}
    momentum = {name: torch.zeros_like(t) for name, t in weights.items()}
    return Checkpoint(RUN_ID, 5, {"preset": "tiny", "n_layer": 2}, bytes(range(32)),
                      {0: bytes(32), 1: bytes(32)}, weights, momentum).to_bytes()


CHECKPOINT = checkpoint_seed()


def safetensors_bytes(header: dict, body: bytes) -> bytes:
    raw = json.dumps(header, default=_jsonable).encode()
    return struct.pack("<Q", len(raw)) + raw + body


def structured_checkpoint(rng: random.Random) -> bytes:
    """The seed checkpoint with its safetensors header or its dlx metadata mutated (offsets kept)."""
    length = struct.unpack("<Q", CHECKPOINT[:8])[0]
    header = json.loads(CHECKPOINT[8:8 + length])
    body = CHECKPOINT[8 + length:]
    if rng.random() < 0.6:
        meta = json.loads(header["__metadata__"]["dlx"])
        roll = rng.random()
        if roll < 0.1:
            text = "[" * rng.choice([100, 5000, 50000]) + "]" * rng.choice([0, 5000])
        elif roll < 0.2:
            text = json.dumps(meta).replace("5", "1" + "0" * rng.choice([400, 5000]), 1)
        else:
            text = json.dumps(mutate_tree(rng, meta, bin_keys=False), default=_jsonable)
        header["__metadata__"]["dlx"] = text
    else:
        header = mutate_tree(rng, header, bin_keys=False)
    return safetensors_bytes(header, body)


def decode_checkpoint(data: bytes) -> Any:
    return parse_checkpoint(data)


class _FileTarget:
    """Writes the input to a file, then runs a reader on the path (readers take paths)."""

    def __init__(self, name: str, reader: Callable[[Path], Any]) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=f"dlx-fuzz-{name}-"))
        atexit.register(shutil.rmtree, self.dir, True)
        self.reader = reader

    def __call__(self, data: bytes) -> Any:
        return self.reader(self.dir, data)


def _read_toml(directory: Path, data: bytes) -> Any:
    path = directory / "node.toml"
    path.write_bytes(data)
    return load_config(path)


def toml_seeds() -> list[bytes]:
    template = (Path(__file__).resolve().parent.parent / "node" / "templates" / "node.toml").read_bytes()
    return [template, b'rounds = 3\n[diloco]\ninner_steps = 4\n[storage]\nkeep_rounds = 5\n']


TOML_VALUES = ["1" + "0" * 400, "-1", "0", "nan", "inf", "-inf", "1e400", "true", '"x"', "[]", "[1, 2]",
               '["a", 2]', "[[1], [2]]", "{a = 1}", "1979-05-27T07:32:00Z", "0x7fffffffffffffff",
               "9223372036854775808", '""', "3.5", "[" * 2000 + "]" * 2000, "[2.0, 4.0]", "[true]"]


def structured_toml(rng: random.Random) -> bytes:
    lines = rng.choice(TOML_SEEDS).decode().splitlines()
    for _ in range(rng.randrange(1, 4)):
        index = rng.randrange(len(lines))
        line = lines[index]
        if "=" in line and not line.startswith("#"):
            key = line.split("=", 1)[0]
            lines[index] = f"{key}= {rng.choice(TOML_VALUES)}"
        elif rng.random() < 0.5:
            lines.insert(index, rng.choice(["[storage]", "[nonsense]", "unknown = 1", "[p2p]", "[[model]]"]))
        else:
            del lines[index]
    return "\n".join(lines).encode()


def run_document_seed() -> bytes:
    return canonical_json(run_document(load_config(None, ["model.preset=tiny"])))


def structured_json(rng: random.Random, seed: bytes) -> bytes:
    tree = json.loads(seed)
    roll = rng.random()
    if roll < 0.05:
        return b"[" * 5000 + b"]" * 5000
    if roll < 0.1:
        return seed.replace(b"2", b"1" + b"0" * 5000, 1)
    return json.dumps(mutate_tree(rng, tree, bin_keys=False), default=_jsonable).encode()


def _jsonable(value: Any) -> Any:
    """What a JSON writer would make of bytes (random_value makes them; JSON has none)."""
    return value.hex() if isinstance(value, bytes) else str(value)


def decode_run_document(data: bytes) -> Any:
    return node_config_from_run(parse_run_document(data))


def state_seed() -> bytes:
    return json.dumps({"run_id": RUN_ID, "last_finished": 9, "last_contributed": 10, "committed": [1, 2],
                       "weights_roots": {"9": "ab" * 32},
                       "signed_records": {"9": ["cd" * 32, "ef" * 65], "8": ["01" * 32, "02" * 65]}}).encode()


def _read_state(directory: Path, data: bytes) -> Any:
    path = directory / "state.json"
    path.write_bytes(data)
    state = StateFile(path, RUN_ID)
    return (state.get("last_finished", -1), state.get("last_contributed", -1), state.signed_record(9),
            state.signed_record(8), state.signed_record(1))


def archive_seed() -> bytes:
    return json.dumps({"round": 3, "contributions": [[0, 1, IDENTITY.peer_id, "ab" * 32]],
                       "excluded": []}).encode()


def _read_manifest(directory: Path, data: bytes) -> Any:
    archive = Archive(directory, RUN_ID)
    path = archive.sealed_path(3)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return archive.sealed(3)


def _read_identity(directory: Path, data: bytes) -> Any:
    path = directory / "identity.key"
    path.write_bytes(data)
    os.chmod(path, 0o600)
    return Identity.load(path)


def identity_file() -> bytes:
    directory = tempfile.mkdtemp(prefix="dlx-fuzz-id-")
    try:
        path = Path(directory) / "identity.key"
        IDENTITY.save(path)
        return path.read_bytes()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


TOML_SEEDS = toml_seeds()
RUN_DOCUMENT = run_document_seed()
ENVELOPES = envelope_seeds()
SYNC_RESPONSES = sync_response_seeds()


def targets() -> list[Target]:
    """Every fuzz target (see module docstring)."""
    from fuzz_targets_extra import chain_log_targets, replica_state_target, sliced_targets

    return [
        Target("envelope", lambda d: decode_envelope(d, GOSSIP_LIMIT), (EnvelopeRejected,), ENVELOPES,
               structured_envelope),
        Target("envelope_validator", validate, (EnvelopeRejected,), ENVELOPES, structured_envelope),
        Target("gossip_message", decode_gossip, (EnvelopeRejected, msg.ProtocolError), ENVELOPES,
               structured_gossip),
        *[Target(f"payload_{kind}", lambda d, kind=kind: msg.decode_payload(kind, d), (msg.ProtocolError,),
                 [payload], lambda rng, kind=kind: structured_payload(rng, kind))
          for kind, payload in PAYLOADS.items()],
        Target("contribution", decode_codec, (ContributionDecodeError,), CONTRIBUTIONS,
               structured_contribution),
        Target("contribution_refuse_raw", decode_codec_strict, (ContributionDecodeError,), CONTRIBUTIONS,
               structured_contribution),
        Target("blob_request", decode_blob_request, (ProtocolViolation,), BLOB_REQUESTS,
               lambda rng: structured_frame(rng, BLOB_REQUESTS)),
        Target("blob_reply", decode_blob_reply, (ProtocolViolation,), BLOB_REPLIES,
               lambda rng: structured_frame(rng, BLOB_REPLIES)),
        Target("sync_request", decode_sync_request, (ProtocolViolation,), SYNC_REQUESTS,
               lambda rng: structured_frame(rng, SYNC_REQUESTS)),
        Target("sync_response", decode_sync_response, (ProtocolViolation,), SYNC_RESPONSES,
               lambda rng: structured_frame(rng, SYNC_RESPONSES)),
        Target("sync_offer", decode_sync_offer, (ProtocolViolation,), SYNC_OFFERS,
               lambda rng: structured_frame(rng, SYNC_OFFERS)),
        Target("sync_want", decode_sync_want, (ProtocolViolation,), SYNC_WANTS,
               lambda rng: structured_frame(rng, SYNC_WANTS)),
        Target("checkpoint", decode_checkpoint, (StateError,), [CHECKPOINT], structured_checkpoint),
        Target("archive_manifest", _FileTarget("archive", _read_manifest), (StateError,), [archive_seed()],
               lambda rng: structured_json(rng, archive_seed())),
        Target("state_json", _FileTarget("state", _read_state), (StateError,), [state_seed()],
               lambda rng: structured_json(rng, state_seed())),
        Target("node_toml", _FileTarget("toml", _read_toml), CONFIG_ERRORS, TOML_SEEDS, structured_toml),
        Target("run_document", decode_run_document, (ConfigError, *CONFIG_ERRORS), [RUN_DOCUMENT],
               lambda rng: structured_json(rng, RUN_DOCUMENT)),
        Target("identity_key", _FileTarget("identity", _read_identity), (IdentityError,),
               [IDENTITY.seed, identity_file()]),
        replica_state_target(),
        *chain_log_targets(),
        *sliced_targets(),
    ]


__all__ = ["ReplicaStateError", "Target", "random_input", "targets"]
