"""The spec in docs/ says what the code does (issue 65, "The spec"): checked against the committed ABI and the
contracts' sources, so a doc that drifts fails here."""

from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LEDGER_MD = (REPO / "docs" / "LEDGER.md").read_text()


def _abi_events() -> set[str]:
    artifact = json.loads((REPO / "contracts" / "artifacts" / "TrainingLedger.json").read_text())
    abi = artifact.get("abi", artifact)
    return {entry["name"] for entry in abi if entry.get("type") == "event"}


def test_ledger_md_lists_every_event_of_the_ledger():
    start = LEDGER_MD.index("Events (all with the run id as first topic")
    listed = set(re.findall(r"`(\w+)\(", LEDGER_MD[start:LEDGER_MD.index("\n\n", start)]))
    assert _abi_events() - listed == set(), "events the ABI has and LEDGER.md does not list"
    assert listed - _abi_events() == set(), "events LEDGER.md lists and the ABI does not have"


def test_ledger_md_writes_the_quorum_over_the_counted_members_and_describes_commit_quorum_of():
    core = (REPO / "contracts" / "src" / "TrainingLedger.sol").read_text()
    assert "LedgerCore.quorum(run.quorum, run.quorumBps, run.countedCount)" in core
    assert "memberCount / 10000" not in LEDGER_MD
    assert LEDGER_MD.count("ceil(quorumBps x countedCount / 10000)") >= 2
    assert "**`commitQuorumOf(runId, round)`** is the quorum the commit of `round` needed" in LEDGER_MD
    assert "_s.commitBlocks[runId][round] = block.number | (uint256(quorum) << 64)" in core


def test_ledger_md_gives_the_dispute_bond_the_contracts_fate():
    disputes = (REPO / "contracts" / "src" / "LedgerDisputes.sol").read_text()
    # upheld and lapsed forfeit the disputers' bonds, an overturn while open returns them
    assert disputes.count("LedgerCore.forfeitBond(s, runId, disputers[i], bond)") == 2
    assert disputes.count("LedgerCore.returnBond(s, runId, disputers[i], bond)") == 1
    assert "added to the disputer's stake" not in LEDGER_MD
    paragraph = LEDGER_MD[LEDGER_MD.index("**Disputes** cost"):]
    paragraph = paragraph[:paragraph.index("\n\n")]
    assert "held by the round's case" in paragraph and "forfeited" in paragraph
    assert "`withdrawStake` never pays it back" in paragraph


def test_p2p_md_lists_every_kind_of_the_protocol():
    from node import protocol as msg

    p2p_md = (REPO / "docs" / "P2P.md").read_text()
    row = next(line for line in p2p_md.splitlines() if line.startswith("| `kind` |"))
    listed = set(re.findall(r"`([a-z_]+)`", row.split("|")[3]))
    assert listed == {*msg.KINDS, msg.EVIDENCE, msg.PARTIAL}


def test_the_merkle_proof_convention_is_named_in_protocol_md():
    protocol_md = (REPO / "docs" / "PROTOCOL.md").read_text()
    assert "`(sibling, sibling_is_left)`" in protocol_md
    assert "sha256(0x01 || sibling || node)` if `sibling_is_left`" in protocol_md


def test_the_codec_packing_dilocox_md_spells_out():
    import torch

    from training.codec_exact import pack_ints, unpack_ints
    from training.codec_wire import matrix_view_shape

    assert pack_ints(torch.tensor([-32767, 0, 32767]), 16) == bytes.fromhex("0000ff7ffeff")
    assert pack_ints(torch.tensor([-1, 0, 1]), 2) == bytes([0x24])
    assert unpack_ints(bytes.fromhex("0000ff7ffeff"), 16, 3, "t").tolist() == [-32767, 0, 32767]
    assert [matrix_view_shape(s) for s in [(), (5,), (4, 3), (2, 3, 4)]] == [(1, 1), (5, 1), (4, 3), (2, 12)]
    dilocox_md = (REPO / "docs" / "DILOCOX.md").read_text()
    assert "`q = [-32767, 0, 32767]` at b = 16 is `00 00 ff 7f fe ff`" in dilocox_md
    assert "b = 2 is the one byte `0b00_10_01_00` = `0x24`" in dilocox_md


def test_the_codec_decoder_takes_any_key_order():
    import msgpack

    vectors = json.loads((REPO / "tests" / "vectors" / "wire.json").read_text())
    contribution = next(v for v in vectors["envelopes"] if v["name"] == "contribution")
    codec = contribution["contribution_body"]["codec"]
    from training.codec_wire import decode_contribution

    blob = bytes.fromhex(codec["blob_hex"])
    shapes = {name: tuple(shape) for name, shape in codec["shapes"].items()}
    message = msgpack.unpackb(blob, raw=False)
    reordered = dict(reversed(list(message.items())))
    reordered["t"] = [dict(reversed(list(entry.items()))) for entry in message["t"]]
    again = msgpack.packb(reordered, use_bin_type=True)
    assert again != blob
    first = decode_contribution(blob, shapes, stage_index=message["st"], outer_round=message["rd"])
    second = decode_contribution(again, shapes, stage_index=message["st"], outer_round=message["rd"])
    assert all(torch_equal(first[name], second[name]) for name in shapes)


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


def test_the_leaf_layout_fraud_proof_md_spells_out():
    import struct

    import torch

    from training.chunks import leaf_values, tensor_leaves

    tensors = {"b": torch.ones(130), "a": torch.zeros(0),
               "c": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    leaves = tensor_leaves(tensors)
    headers = [leaf_values(leaf)[0] for leaf in leaves]
    # "a" (no elements) keeps index 0; "b" is 1-D: one column, 3 chunks by element offset; "c" is (2, 3)
    assert headers == [(1, 0, 1, 64), (1, 64, 1, 64), (1, 128, 1, 2), (2, 0, 3, 6)]
    assert leaves[0][24:28] == bytes.fromhex("3f800000")  # 1.0, big-endian binary32
    assert struct.unpack(">6f", leaves[3][24:]) == (0.0, 1.0, 2.0, 3.0, 4.0, 5.0)
    text = (REPO / "docs" / "FRAUD_PROOF.md").read_text()
    assert "`offset` counts **elements**, not bytes" in text and "1.0 is `3f 80 00 00`" in text


def test_the_layer_cut_dilocox_md_spells_out():
    from training.stages import split_stages

    specs = split_stages(6, 4)
    assert [(s.layer_start, s.layer_end) for s in specs] == [(0, 2), (2, 4), (4, 5), (5, 6)]
    assert [(s.has_embeddings, s.has_head) for s in specs] == [(True, False), (False, False), (False, False),
                                                              (False, True)]
    text = (REPO / "docs" / "DILOCOX.md").read_text()
    assert "`n_layer = 6`, S = 4 gives blocks `[0, 2)`, `[2, 4)`, `[4, 5)`, `[5, 6)`" in text


def test_each_refused_codec_payload_vector_has_one_fault():
    """wire.json's refused version-2 codec payloads differ from an accepted one in their ns alone (their keys
    in the encoder's order): a decoder cannot refuse them for anything else."""
    import msgpack

    from training.codec_wire import decode_declared

    vectors = json.loads((REPO / "tests" / "vectors" / "wire.json").read_text())["contribution_payloads"]
    shapes = {name: tuple(shape) for name, shape in vectors["shapes"].items()}
    for case in vectors["rejected"]:
        message = msgpack.unpackb(bytes.fromhex(case["payload_hex"]), raw=False)
        assert [k for k in message if k != "ns"] == ["v", "st", "rd", "t"], case["name"]
        fixed = {"v": 2, "st": message["st"], "rd": message["rd"], "ns": 7, "t": message["t"]}
        steps, _ = decode_declared(msgpack.packb(fixed, use_bin_type=True), shapes,
                                   stage_index=vectors["stage"], outer_round=vectors["round"])
        assert steps == 7, case["name"]


def test_the_header_hash_protocol_md_spells_out():
    """docs/PROTOCOL.md, "What checkpointHash commits": a header written from its description alone (a JSON
    object, no whitespace, metadata first, the tensors in their names' byte order at consecutive offsets,
    padded with spaces to 8 bytes) is the code's, and the tag it names gives the code's hash."""
    import hashlib
    import math
    import struct

    from node.store.checkpoint import RunLayout
    from node.store.checkpoint_hash import HEADER_HASH_TAG, checkpoint_header, header_hash, metadata_only

    text = (REPO / "docs" / "PROTOCOL.md").read_text()
    found = re.search(r"`T` the (\d+) ASCII bytes `([^`]+)`", text)
    assert found and len(found.group(2)) == int(found.group(1))
    tag = found.group(2).encode()
    assert tag == HEADER_HASH_TAG
    shapes = ({"wte": (5, 3), "ln": (3,)}, {"h.0.w": (3, 2), "b": (2,)})
    for moments in (1, 2):
        layout = RunLayout(7, b"c" * 32, {"n_layer": 1, "rope_theta": 10000.0}, shapes, True, moments, True)
        hashes, leaves = {0: b"\x01" * 32, 1: b"\x02" * 32}, {0: b"\x03" * 160, 1: b"\x04" * 160}
        meta = json.dumps({"format": "dlx-checkpoint-v1", "run_id": 7, "round": 9,
                           "model_config": layout.model_config, "tokenizer": "byte-level-v1",
                           "config_hash": "63" * 32,
                           "stage_hashes": {str(s): h.hex() for s, h in hashes.items()},
                           "stage_leaves": {str(s): v.hex() for s, v in leaves.items()}},
                          sort_keys=True, separators=(",", ":"))
        tensors = {}
        for stage in shapes:
            for name, shape in stage.items():
                tensors[f"weights.{name}"] = list(shape)
                tensors[f"momentum.{name}"] = list(shape) if moments == 1 else [moments, *shape]
        header: dict = {"__metadata__": {"dlx": meta}}
        offset = 0
        for name in sorted(tensors, key=lambda n: n.encode()):
            size = 4 * math.prod(tensors[name])
            header[name] = {"dtype": "F32", "shape": tensors[name], "data_offsets": [offset, offset + size]}
            offset += size
        body = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        body += b" " * (-len(body) % 8)
        raw = struct.pack("<Q", len(body)) + body
        assert checkpoint_header(layout, metadata_only(layout, 9, hashes, leaves)) == raw
        assert header_hash(raw) == hashlib.sha256(tag + raw).digest()


def test_ledger_md_gives_each_deployed_contracts_size_from_its_artifact():
    import contracts

    rows = re.findall(r"^\| `(\w+)`[^\n]*\| ([\d,]+) \| ([\d.]+)% \|$", LEDGER_MD, re.M)
    deployed = {"NodeRegistry", "TrainingLedger", "AggregationProver", *contracts.LIBRARIES, "StepProver",
                *contracts.STEP_LIBRARIES}
    assert {name for name, _, _ in rows} == deployed, "LEDGER.md's size table lists other contracts"
    for name, size, share in rows:
        actual = (len(contracts.artifact(name)["deployedBytecode"]) - 2) // 2
        expected = (actual, f"{100 * actual / contracts.CODE_SIZE_LIMIT:.1f}")
        assert (int(size.replace(",", "")), share) == expected, \
            f"LEDGER.md gives {name} {size} bytes ({share}%); its artifact deploys {actual}"
