"""Hostile requests to a real seeder (``demo --keep``'s :class:`ArchiveSeeder`) over real libp2p streams.

The seeder serves each round's contribution list under its contributions root and the run's prepared dataset
(manifest under its root, shards by sha256) over ``/dlx/blob/1.0.0``, so ``audit LINK`` passes through it
alone. A raw libp2p host sends it oversized, malformed, truncated and unknown-round requests: each one gets a
reply that says what was wrong (``bad_request`` with its reason, ``not_found``, ``out_of_range``), never a
crash; honest clients (a real :class:`P2PHost`, as ``audit`` and ``join`` use) are served the same lists and
dataset before and after.
"""

from __future__ import annotations

import hashlib
import json
import sys

import msgpack
import multiaddr
import pytest
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as create_new_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux
from libp2p.transport.tcp.tcp import TCP

from ledger.merkle import merkle_root
from node.commands.seeder import ArchiveSeeder, round_lists
from node.shardfetch import MAX_MANIFEST_BYTES, complete_dataset
from p2p.config import P2PConfig
from p2p.errors import BlobNotFound, BlobTooLarge
from p2p.host import P2PHost
from p2p.identity import Identity
from training.data import generated_text
from training.prepare import prepare_dataset
from training.shards import MANIFEST_NAME
from training.sharded_corpus import read_manifest
from training.tokenizer import ByteTokenizer

pytestmark = pytest.mark.timeout(120)
BLOB = TProtocol("/dlx/blob/1.0.0")
RUN_ID = 7
PEER = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
ROUND_1 = [(0, 0, PEER, hashlib.sha256(b"a").hexdigest()), (0, 1, PEER, hashlib.sha256(b"b").hexdigest())]
MISFILED = [(0, 0, PEER, hashlib.sha256(b"c").hexdigest())]  # round 5's list, found in round 3's directory


def frame(obj) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return len(body).to_bytes(4, "big") + body


def root_of(entries) -> str:
    return merkle_root([bytes.fromhex(h) for _s, _r, _p, h in sorted(entries)]).hex()


@pytest.fixture(scope="module")
def seeder(tmp_path_factory):
    """A seeder over one node's archive (round 1's list sealed; rounds 2, 3, 4 and 6 broken on disk) and a
    byte-level dataset of 3 shards."""
    base = tmp_path_factory.mktemp("seeder")
    run_dir = base / "node" / "archive" / f"run-{RUN_ID}"
    for index, document in ((1, {"round": 1, "contributions": ROUND_1}),
                            (2, {"round": 2, "contributions": "not a list"}),
                            (3, {"round": 5, "contributions": MISFILED}),
                            (6, {"round": 6, "contributions": [[0, 0, PEER, "zz" * 32]]})):
        (run_dir / f"round-{index:08d}").mkdir(parents=True)
        (run_dir / f"round-{index:08d}" / "round.json").write_text(json.dumps(document))
    (run_dir / "round-00000004").mkdir()
    (run_dir / "round-00000004" / "round.json").write_bytes(b"\xff{" * 100)  # not even JSON
    text = base / "story.txt"
    text.write_text(generated_text(seed=3, n_bytes=9_000))
    prepare_dataset([text], base / "ds", ByteTokenizer(), shard_tokens=3500)
    archive = ArchiveSeeder.start([base / "node"], RUN_ID, datasets=[base / "ds"])
    try:
        yield archive, base / "ds"
    finally:
        archive.close()


def raw_exchanges(target: str, requests: dict[str, tuple[bytes, bool]]) -> dict[str, bytes]:
    """Each request's payload sent on a new stream from a raw libp2p host (half-closing after it where asked);
    what came back on each (b"" for a reset or nothing)."""
    key_pair = create_new_key_pair()
    noise = NoiseTransport(key_pair, noise_privkey=create_new_x25519_key_pair().private_key)
    raw = new_host(key_pair=key_pair, sec_opt={NOISE_PROTOCOL_ID: noise},
                   muxer_opt={YAMUX_PROTOCOL_ID: Yamux}, transports=[TCP()])
    answers: dict[str, bytes] = {}

    async def send_all():
        async with raw.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
            info = info_from_p2p_addr(multiaddr.Multiaddr(target))
            await raw.connect(info)
            for name, (payload, half_close) in requests.items():
                stream = await raw.new_stream(info.peer_id, [BLOB])
                received = b""
                try:
                    await stream.write(payload)
                    if half_close:
                        await stream.close()
                    with trio.move_on_after(10):
                        while chunk := await stream.read(1 << 16):
                            received += chunk
                except Exception:  # noqa: BLE001 - a reset or EOF ends what we read; the assertions judge it
                    pass
                answers[name] = received
            await raw.close()

    trio.run(send_all)
    return answers


def reply(raw_answer: bytes) -> tuple[dict, bytes]:
    """The reply frame and the bytes after it."""
    assert len(raw_answer) >= 4, f"no reply: {raw_answer!r}"
    length = int.from_bytes(raw_answer[:4], "big")
    return msgpack.unpackb(raw_answer[4:4 + length]), raw_answer[4 + length:]


def honest_fetches(archive: ArchiveSeeder, dataset, workdir) -> None:
    """What ``audit LINK`` and ``join`` fetch from the seeder, fetched and checked by a real host."""
    with P2PHost.start(P2PConfig(listen_host="127.0.0.1", listen_port=0, gossip_resync_interval=0),
                       Identity.generate(), data_dir=workdir) as client:
        peer = client.connect(archive.multiaddr)
        listed = json.loads(client.fetch_alias(root_of(ROUND_1), peer, 1 << 20, timeout=30))
        assert listed == {"round": 1, "contributions": [list(e) for e in sorted(ROUND_1)]}
        manifest = read_manifest(dataset)[1]
        fill = complete_dataset(manifest.root, workdir / "copy", client, [peer])
        assert (fill.fetched, fill.refusals) == (len(manifest.shards), [])
        assert (workdir / "copy" / MANIFEST_NAME).read_bytes() == (dataset / MANIFEST_NAME).read_bytes()
        with pytest.raises(BlobNotFound):  # a round the seeder holds no list of
            client.fetch_alias(hashlib.sha256(b"round 9").hexdigest(), peer, 1 << 20, timeout=30)
        with pytest.raises(BlobTooLarge):  # the client's own limit, read from the reply header
            client.fetch_alias(manifest.root, peer, 10, timeout=30)
        assert MAX_MANIFEST_BYTES > (dataset / MANIFEST_NAME).stat().st_size


def test_hostile_requests_get_a_clear_refusal_and_the_seeder_keeps_serving(seeder, tmp_path):
    archive, dataset = seeder
    honest_fetches(archive, dataset, tmp_path / "before")
    round_1 = bytes.fromhex(root_of(ROUND_1))
    list_size = len(json.dumps({"round": 1, "contributions": sorted(ROUND_1)}).encode())
    shard = read_manifest(dataset)[1].shards[0]
    request = frame({"sha256": round_1, "offset": 0, "length": 0})
    answers = raw_exchanges(archive.multiaddr, {
        "prefix_over_limit": ((1 << 31).to_bytes(4, "big"), False),
        "frame_over_limit": (frame({"sha256": round_1, "offset": 0, "length": 1, "pad": b"x" * 5000}), False),
        "not_msgpack": (b"\x00\x00\x00\x05hello", False),
        "not_a_map": (frame([round_1, 0, 1]), False),
        "nested_junk": (frame({"sha256": [[[]]] * 50, "offset": 0, "length": 1}), False),
        "cut_short": (request[:9], True),
        "prefix_only": (request[:2], True),
        "hex_string_key": (frame({"sha256": round_1.hex(), "offset": 0, "length": 1}), False),
        "negative_offset": (frame({"sha256": round_1, "offset": -1, "length": 2}), False),
        "float_length": (frame({"sha256": round_1, "offset": 0, "length": 1.5}), False),
        "unknown_round": (frame({"sha256": hashlib.sha256(b"round 9").digest(), "offset": 0, "length": 1}),
                          False),
        "misfiled_round": (frame({"sha256": bytes.fromhex(root_of(MISFILED)), "offset": 0, "length": 1}),
                           False),
        "beyond_the_list": (frame({"sha256": round_1, "offset": 0, "length": list_size + 1}), False),
        "huge_length": (frame({"sha256": round_1, "offset": 1, "length": 1 << 62}), False),
        "past_a_shard": (frame({"sha256": bytes.fromhex(shard.sha256), "offset": 1 << 40, "length": 1}),
                         False),
        "honest_range": (frame({"sha256": round_1, "offset": 1, "length": 7}), False),
    })
    refusals = {name: reply(answer)[0] for name, answer in answers.items()}
    expected = {
        "prefix_over_limit": "exceeds limit 4096", "frame_over_limit": "exceeds limit 4096",
        "not_msgpack": "malformed frame", "not_a_map": "not a map", "nested_junk": "'sha256': expected bytes",
        "cut_short": "cut short", "prefix_only": "cut short", "hex_string_key": "'sha256': expected bytes",
        "negative_offset": "'offset'=-1: must be >= 0", "float_length": "'length': expected int",
    }
    for name, detail in expected.items():
        assert refusals[name]["status"] == "bad_request", (name, refusals[name])
        assert detail in refusals[name]["detail"], (name, refusals[name])
    for name in ("unknown_round", "misfiled_round"):
        assert refusals[name] == {"status": "not_found"}, (name, refusals[name])
    for name in ("beyond_the_list", "huge_length"):
        assert refusals[name] == {"status": "out_of_range", "total": list_size}, (name, refusals[name])
    assert refusals["past_a_shard"]["status"] == "out_of_range"
    header, body = reply(answers["honest_range"])
    assert (header["status"], body) == ("ok", json.dumps(
        {"round": 1, "contributions": sorted(ROUND_1)}).encode()[1:8])
    assert all(not reply(answers[name])[1] for name in refusals if name != "honest_range")  # no bytes after
    honest_fetches(archive, dataset, tmp_path / "after")


def test_only_the_well_formed_round_lists_on_disk_are_served(seeder, tmp_path):
    """A node's round.json that is not a list an auditor could use (wrong shape, another round's, a non-hex
    hash, not JSON) is left out at start, and the seeder starts all the same; the sealed one is served under
    its root. (The served side is checked over the wire above: the misfiled list's root is not_found.)"""
    node = tmp_path / "node"
    run_dir = node / "archive" / f"run-{RUN_ID}"
    (run_dir / "round-00000001").mkdir(parents=True)
    (run_dir / "round-00000001" / "round.json").write_text(json.dumps({"round": 1, "contributions": ROUND_1}))
    for name, data in (("round-00000003", json.dumps({"round": 5, "contributions": MISFILED})),
                       ("round-00000004", "[1, 2"), ("round-0000000x", "{}"),
                       ("round-00000006", json.dumps({"round": 6, "contributions": [[0, 0, "p", "z" * 64]]})),
                       ("round-00000008", json.dumps({"round": 8, "contributions": [[0, 0]]})),
                       ("round-00000009", "[" * 100_000 + "]" * 100_000)):
        (run_dir / name).mkdir()
        (run_dir / name / "round.json").write_text(data)
    lists = round_lists([node], RUN_ID)
    assert list(lists) == [root_of(ROUND_1)]
    assert json.loads(lists[root_of(ROUND_1)])["contributions"] == [list(e) for e in sorted(ROUND_1)]


@pytest.fixture
def recursion_as_in_the_node():
    """The recursion limit of a node or CLI process: py_ecc (imported through web3) raises it to 100,000 on
    import; another module run earlier on the same worker may have set it lower since."""
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, 100_000))
    yield
    sys.setrecursionlimit(old)


@pytest.mark.usefixtures("recursion_as_in_the_node")
def test_a_deeply_nested_list_is_refused_before_it_is_decoded():
    """A list served under a round's root (or left on disk) nested 80,000 deep: decoded as is, it overflowed
    the C stack of a process that imported py_ecc (recursion limit 100,000): a segfault, not an error."""
    from training.jsonbound import loads_bounded, nesting_depth
    from node.tools.evidence import listed_entries

    assert sys.getrecursionlimit() >= 80_000  # as in the node and the CLI (py_ecc sets it on import)
    with pytest.raises(ValueError, match="nested 80000 deep, over 8"):
        listed_entries(b"[" * 80_000 + b"]" * 80_000, 1)
    with pytest.raises(ValueError, match="nested 3 deep, over 2"):
        loads_bounded('{"a": [[1], "]]]"]}', 2)
    assert nesting_depth('{"a": [[1], "[[[\\"[["]}') == 3 and nesting_depth('"[["') == 0
    assert loads_bounded('{"a": [[1], "]]]"]}', 3) == {"a": [[1], "]]]"]}
    with pytest.raises(ValueError):
        listed_entries(b"\xff[]", 1)  # not UTF-8


@pytest.mark.usefixtures("recursion_as_in_the_node")
def test_a_deeply_nested_manifest_on_disk_is_refused_before_it_is_decoded(tmp_path):
    """The same nesting in a dataset's manifest.json (a fetched or copied dataset, not a peer's): every reader
    goes through parse_manifest, which refuses it with a ShardError naming the depth (no segfault)."""
    from training.errors import ShardError
    from training.shards import parse_manifest

    assert sys.getrecursionlimit() >= 80_000  # as in the node and the CLI (py_ecc sets it on import)
    with pytest.raises(ShardError, match="manifest.json: not valid JSON .*nested 200000 deep, over 8"):
        parse_manifest(b"[" * 200_000 + b"]" * 200_000)


def test_a_deeply_nested_manifest_from_a_peer_is_refused_and_the_seeder_serves_the_dataset(seeder, tmp_path):
    """A hostile peer serves, under the dataset's root, 200,000-deep JSON (decoded as is, it segfaulted a
    joiner: the root is checked only after decoding): refused naming the peer, and the dataset is completed
    from the seeder."""
    archive, dataset = seeder
    manifest = read_manifest(dataset)[1]
    config = P2PConfig(listen_host="127.0.0.1", listen_port=0, gossip_resync_interval=0)
    with P2PHost.start(config, Identity.generate(), data_dir=tmp_path / "hostile") as hostile, \
            P2PHost.start(config, Identity.generate(), data_dir=tmp_path / "client") as client:
        deep = b"[" * 200_000 + b"]" * 200_000
        hostile.provide_alias(manifest.root, hostile.provide_blob(deep, announce=False))
        liar = client.connect(hostile.listen_addrs[0])
        honest = client.connect(archive.multiaddr)
        fill = complete_dataset(manifest.root, tmp_path / "copy", client, [liar, honest])
    assert fill.fetched == len(manifest.shards)
    refusal = fill.refusals[0]  # (then the shards it was asked for first: it has none)
    assert liar in refusal and "manifest" in refusal and "nested 200000 deep, over 8" in refusal, refusal
    assert all(liar in r and "not_found" in r for r in fill.refusals[1:]), fill.refusals


@pytest.mark.usefixtures("recursion_as_in_the_node")
def test_a_deeply_nested_kept_proof_in_an_archive_is_skipped_by_the_audit():
    """A node's archive (or a peer serving one) with a 200,000-deep "kept proof": the audit passes over it
    as a file that is no proof, never decoding it (a segfault once py_ecc is imported), and still reads the
    well-formed ones beside it (here: none, so nothing is found)."""
    from node.tools.audit_proof import _kept_proofs

    class Source:  # the one method the audit asks of an archive or a peer's copy
        def proofs(self, _round):
            return [b"[" * 200_000 + b"]" * 200_000, b'{"proof": 1}', b"not json"]

    class Commit:
        round = 1

        def fields(self):
            return (1, 1)

    assert sys.getrecursionlimit() >= 80_000  # as in the node and the CLI (py_ecc sets it on import)
    assert _kept_proofs([Source()], Commit()) == []


@pytest.mark.usefixtures("recursion_as_in_the_node")
def test_deeply_nested_archive_files_are_passed_over_by_the_audit(tmp_path):
    """An --archive whose round.json and own-contribution marker nest 200,000 deep (a hostile or broken copy):
    the audit reads each as a file that says nothing (no segfault), and a well-formed archive beside it is
    read as before."""
    from node.tools.audit_archives import AuditArchives

    deep = b"[" * 200_000 + b"]" * 200_000
    bad = tmp_path / "bad" / "archive" / "run-1" / "round-00000001"
    good = tmp_path / "good" / "archive" / "run-1" / "round-00000001"
    for path in (bad, good):
        path.mkdir(parents=True)
    (bad / "round.json").write_bytes(deep)
    (bad / f"{'ab' * 32}.own").write_bytes(deep)
    entry = [0, 1, "peer", "cd" * 32]
    (good / "round.json").write_text(json.dumps({"round": 1, "contributions": [entry], "excluded": [entry],
                                                 "left_out_own": [entry]}))
    archives = AuditArchives([tmp_path / "bad", tmp_path / "good"], 1)
    assert sys.getrecursionlimit() >= 80_000  # as in the node and the CLI (py_ecc sets it on import)
    assert archives.sealed() == {1: [entry]}
    assert archives.excluded(1) == [entry] and archives.left_out_own(1) == [entry]
