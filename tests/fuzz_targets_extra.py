"""Fuzz targets of tests/fuzz_targets.py that need more set-up: chain logs and replica start states.

Chain logs: an RPC endpoint is not trusted to return well-formed logs, so every event of both
contracts' ABIs is a target seed. A fuzz input is laid out as ``[event index][topic count]
[topics, 32 bytes each][ABI data]`` so that byte mutations land in the topics and the data; the
decoder under test is :meth:`ledger.events.EventDecoder.decode` followed by the record builder
the client uses for that event.
"""

from __future__ import annotations

import random
import struct
from typing import Any

import torch
from eth_abi import encode
from eth_utils import keccak

import contracts
from ledger.errors import LedgerError
from ledger.events import (
    EventDecoder,
    abi_type,
    commit_record_from,
    dispute_from,
    equivocation_from,
    run_info_from,
    slash_from,
)
from ledger.history import memberships_from
from training.errors import ReplicaStateError
from training.replica_state import STATE_MAGIC, RoundMeta, StageStartState, parse_stage_state

# ----------------------------------------------------------------------------- chain logs


def _abi_value(kind: str, rng: random.Random) -> Any:
    if kind.endswith("[]"):
        return [_abi_value(kind[:-2], rng) for _ in range(rng.randrange(3))]
    if kind.startswith("("):
        return tuple(_abi_value(part, rng) for part in _split_tuple(kind[1:-1]))
    if kind == "address":
        return "0x" + rng.randbytes(20).hex()
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "string":
        return "dlx://blob/" + rng.randbytes(8).hex()
    if kind == "bytes":
        return rng.randbytes(rng.choice([0, 32, 64, 65]))
    if kind.startswith("bytes"):
        return rng.randbytes(int(kind[5:]))
    if kind.startswith("uint"):
        return rng.randrange(2 ** min(int(kind[4:] or 256), 64))
    raise ValueError(kind)


def _split_tuple(inner: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in inner:
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
            continue
        depth += char == "("
        depth -= char == ")"
        current += char
    return parts + [current] if current else parts


BUILDERS = {
    "RunCreated": run_info_from,
    "RoundCommitted": commit_record_from,
    "RoundDisputed": dispute_from,
    "EquivocationReported": equivocation_from,
    "MemberSlashed": slash_from,
    "MemberJoined": lambda event: memberships_from([event]),
}


def _events() -> list[tuple[EventDecoder, dict]]:
    out = []
    for name in ("NodeRegistry", "TrainingLedger"):
        abi = contracts.artifact(name)["abi"]
        decoder = EventDecoder(abi)
        out.extend((decoder, entry) for entry in abi if entry["type"] == "event")
    return out


EVENTS = _events()


def log_seed(index: int, rng: random.Random) -> bytes:
    """A well-formed log of event ``index`` with random valid arguments, in the fuzz layout."""
    decoder, entry = EVENTS[index]
    signature = f"{entry['name']}({','.join(abi_type(item) for item in entry['inputs'])})"
    topics = [keccak(text=signature)]
    plain_types, plain_values = [], []
    for item in entry["inputs"]:
        value = _abi_value(abi_type(item), rng)
        if item.get("indexed"):
            topics.append(encode([abi_type(item)], [value]))
        else:
            plain_types.append(abi_type(item))
            plain_values.append(value)
    return bytes([index, len(topics)]) + b"".join(topics) + encode(plain_types, plain_values)


def decode_log(data: bytes) -> Any:
    """Decode a fuzz-layout log as the ledger client does (EventDecoder, then the record builder)."""
    if len(data) < 2:
        return None
    decoder, entry = EVENTS[data[0] % len(EVENTS)]
    count = min(data[1], 4)
    topics = [data[2 + 32 * i: 2 + 32 * (i + 1)] for i in range(count)]
    log = {"topics": topics, "data": data[2 + 32 * count:], "blockNumber": 5, "logIndex": 0,
           "transactionHash": "0x" + "00" * 32, "address": "0x" + "11" * 20}
    event = decoder.decode(log)
    if event is not None and event.name in BUILDERS:
        return BUILDERS[event.name](event)
    return event


def structured_log(rng: random.Random) -> bytes:
    """A well-formed log whose topic count or one ABI word is off (e.g. a huge offset or length)."""
    data = bytearray(log_seed(rng.randrange(len(EVENTS)), rng))
    roll = rng.random()
    if roll < 0.2:
        data[1] = rng.randrange(6)
    else:
        count = data[1]
        body = 2 + 32 * count
        words = (len(data) - body) // 32
        if words:
            i = body + 32 * rng.randrange(words)
            data[i:i + 32] = rng.choice([2**256 - 1, 2**255, 2**64, 2**32, 1 << 20, 32, 0, 1]).to_bytes(32,
                                                                                                        "big")
    return bytes(data)


def chain_log_targets() -> list:
    from fuzz_targets import Target

    rng = random.Random(0)
    seeds = [log_seed(index, rng) for index in range(len(EVENTS))]
    return [Target("chain_log", decode_log, (LedgerError,), seeds, structured_log)]


# ----------------------------------------------------------------------------- replica start states


def replica_state_seed() -> bytes:
    generator = torch.Generator().manual_seed(2)
    shapes = {"a.weight": (3, 2), "b.bias": (2,)}
    tensors = {"adam.step/": torch.zeros(())}
    for group in ("param", "global", "momentum", "residual", "round_start", "adam.m", "adam.v"):
        for name, shape in shapes.items():
            tensors[f"{group}/{name}"] = torch.randn(shape, generator=generator)
    meta = RoundMeta(outer_round=4, replica=1, num_stages=2, inner_steps=3, lr_total_steps=0, threads=1,
                     micro_batches=0)
    return StageStartState(meta, 0, (3, 2, -1), tensors).to_bytes()


REPLICA_STATE = replica_state_seed()


def structured_replica_state(rng: random.Random) -> bytes:
    """The seed with its JSON meta mutated (re-framed) or a tensor record's counts changed."""
    from fuzz_targets import mutate_tree, structured_json

    data = bytearray(REPLICA_STATE)
    start = len(STATE_MAGIC)
    meta_len = struct.unpack("<I", data[start:start + 4])[0]
    if rng.random() < 0.5:
        meta = structured_json(rng, bytes(data[start + 4:start + 4 + meta_len]))
        if rng.random() < 0.5:  # canonical, so the checks past the canonical-form one are reached
            import json

            try:
                tree = mutate_tree(rng, json.loads(data[start + 4:start + 4 + meta_len]), bin_keys=False)
                meta = json.dumps(tree, sort_keys=True, separators=(",", ":"), default=str).encode()
            except (ValueError, TypeError):
                pass
        return bytes(data[:start]) + struct.pack("<I", len(meta)) + meta + bytes(data[start + 4 + meta_len:])
    i = rng.randrange(start + 4 + meta_len, len(data) - 8)
    data[i:i + 8] = rng.choice([2**64 - 1, 2**63, 2**32, 0, 1, 9, 1 << 40]).to_bytes(8, "little")
    return bytes(data)


def replica_state_target():
    from fuzz_targets import Target

    return Target("replica_state", parse_stage_state, (ReplicaStateError,), [REPLICA_STATE],
                  structured_replica_state)


# ----------------------------------------------------------------------------- the sliced exchange


SLICED_ENTRY_ROUND, SLICED_STAGE, SLICED_COUNT = 3, 0, 3


def _sliced_reference() -> bytes:
    from training.slicebundle import slice_bundle

    return slice_bundle([b"a" * 10, b"b" * 20, b"c" * 5])[1]


def _sliced_envelope(reference: bytes) -> bytes:
    from fuzz_targets import sign

    from node import protocol as msg

    body = msg.encode_contribution_body(msg.ContributionBody(b"s" * 32, b"d" * 32, reference))
    return sign(msg.CONTRIBUTION, body, round_index=SLICED_ENTRY_ROUND, stage=SLICED_STAGE)


def closed_envelope_input(data: bytes):
    """What a slice aggregator (and the auditor) does with a closed envelope's bytes: its usable
    reference or None (an absent input), never an exception (node.live.exchange.sliced.usable_reference)."""
    from fuzz_targets import GOSSIP_LIMIT, IDENTITY, RUN_ID

    from node.live.exchange.sliced import usable_reference

    entry = [1, IDENTITY.peer_id, bytes(32), len(data)]
    return usable_reference(data, entry, RUN_ID, SLICED_ENTRY_ROUND, SLICED_STAGE, SLICED_COUNT, GOSSIP_LIMIT)


def structured_closed_envelope(rng: random.Random) -> bytes:
    """A correctly signed contribution envelope around a mutated reference (or body)."""
    reference = bytearray(_sliced_reference())
    for _ in range(rng.randrange(1, 4)):
        if rng.random() < 0.7 and reference:
            reference[rng.randrange(len(reference))] ^= rng.randrange(1, 256)
        else:
            cut = rng.randrange(len(reference) + 1)
            reference[cut:cut] = rng.randbytes(rng.randrange(1, 9))
    return _sliced_envelope(bytes(reference))


def sliced_targets() -> list:
    from fuzz_targets import GOSSIP_LIMIT, Target
    from training.slice_plan import SliceError
    from training.slicebundle import parse_slice_reference
    from training.slicemessages import parse_partial, partial_payload

    reference = _sliced_reference()
    return [
        Target("sliced_closed_envelope", closed_envelope_input, (), [_sliced_envelope(reference)],
               structured_closed_envelope),
        Target("slice_reference", lambda d: parse_slice_reference(d, SLICED_COUNT, GOSSIP_LIMIT),
               (SliceError,), [reference]),
        Target("partial_payload", parse_partial, (SliceError,),
               [partial_payload(1, 3, bytes(32), 4, b"blob")]),
    ]
