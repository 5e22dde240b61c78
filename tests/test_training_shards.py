"""Prepared datasets: shards + manifest, the memory-mapped reader, refusals that name the file, the prepare
step."""

import dataclasses
import hashlib
import json
import struct

import numpy as np
import pytest
import torch

from training.config import ModelConfig, TrainingConfig
from training.data import corpus_from_config, eval_batches, generated_text, load_corpus, round_batches
from training.errors import DataError, ShardError
from training.prepare import prepare_dataset, train_tokenizer
from training.screening import screening_batch
from training.shards import SHARD_HEADER, ShardEntry, ShardWriter, merkle_root, parse_manifest, write_shard
from training.sharded_corpus import is_dataset, open_dataset, read_manifest
from training.tokenizer import ByteTokenizer, encode_bytes, safe_chunks


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "story.txt"
    path.write_text(generated_text(seed=3, n_bytes=60_000))
    return path


@pytest.fixture(scope="module")
def byte_dataset(text_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("ds") / "bytes"
    # 7000-token shards: many windows cross a shard boundary
    prepare_dataset([text_file], out, ByteTokenizer(), shard_tokens=7000)
    return out


def test_byte_dataset_gives_exactly_the_batches_of_the_text_file(text_file, byte_dataset):
    dataset = open_dataset(byte_dataset)
    text = load_corpus(text_file, 0.1)
    assert len(dataset.manifest.shards) == 9  # 60,000 ids in 7,000-id shards
    assert dataset.split_tokens("train") == text.train.numel() \
        and dataset.split_tokens("eval") == text.eval.numel()
    for replica, outer_round in ((0, 0), (1, 5), (3, 2**40)):
        ours = round_batches(dataset, 7, replica, outer_round, 6, 8, 64)
        theirs = round_batches(text, 7, replica, outer_round, 6, 8, 64)
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(ours, theirs))
        assert ours[0][0].dtype == torch.long
    assert all(torch.equal(a[0], b[0]) for a, b in zip(eval_batches(dataset, 3, 4, 64),
                                                       eval_batches(text, 3, 4, 64)))
    assert torch.equal(screening_batch(dataset, 7, 3, 16, 64)[0], screening_batch(text, 7, 3, 16, 64)[0])


def test_windows_across_shards_and_wide_ids(tmp_path):
    ids = np.arange(70_000, dtype=np.int64) * 7 % 70_000  # needs uint32
    writer = ShardWriter(tmp_path, vocab_size=70_000, shard_tokens=1000)
    writer.append(ids[:12_345])
    writer.append(ids[12_345:])
    manifest = writer.finish("bytes", eval_start=60_000)
    assert manifest.dtype == "uint32" and len(manifest.shards) == 70
    assert (tmp_path / "shard-00000.bin").stat().st_size == SHARD_HEADER.size + 4000
    dataset = open_dataset(tmp_path)
    starts = torch.tensor([[0, 990, 1999], [59_000 - 2500, 1, 500]])
    x, y = dataset.windows("train", starts, 2500)  # every window spans 3-4 shards
    assert x.shape == (2, 3, 2500)
    for row, start in enumerate(starts.reshape(-1).tolist()):
        assert torch.equal(x.reshape(-1, 2500)[row], torch.from_numpy(ids[start:start + 2500]))
        assert torch.equal(y.reshape(-1, 2500)[row], torch.from_numpy(ids[start + 1:start + 2501]))
    held_out, _ = dataset.windows("eval", torch.tensor([0]), 10)
    assert torch.equal(held_out[0], torch.from_numpy(ids[60_000:60_010]))
    with pytest.raises(ShardError, match="past the end of the split"):
        dataset.windows("train", torch.tensor([59_995]), 10)


def test_manifest_root_pins_every_field(byte_dataset):
    directory, manifest = read_manifest(byte_dataset / "manifest.json")
    assert directory == byte_dataset and is_dataset(byte_dataset) and not is_dataset(byte_dataset.parent)
    document = json.loads((byte_dataset / "manifest.json").read_bytes())
    assert document["root"] == manifest.root and len(manifest.root) == 64
    variants = [
        dataclasses.replace(manifest, eval_start=manifest.eval_start - 1),
        dataclasses.replace(manifest, tokenizer="sha256:" + "0" * 64),
        dataclasses.replace(manifest, shards=manifest.shards[:-1]),
    ]
    assert len({manifest.root, *(v.root for v in variants)}) == 4
    leaves = [bytes([i]) * 32 for i in range(3)]
    pair = hashlib.sha256(leaves[0] + leaves[1]).digest()
    assert merkle_root(leaves) == hashlib.sha256(pair + leaves[2]).digest()
    for field, value in (("eval_start", 0), ("dtype", "uint32"), ("root", "0" * 64), ("num_tokens", 5)):
        with pytest.raises(ShardError, match="manifest.json"):
            parse_manifest(json.dumps({**document, field: value}).encode(), "x/manifest.json")


def _copy(src, dst):
    dst.mkdir()
    for path in src.iterdir():
        (dst / path.name).write_bytes(path.read_bytes())
    return dst


def _rewrite_manifest(directory, index, data):
    """Replace shard ``index`` and re-pin it in the manifest (so only the shard's content is wrong)."""
    (directory / f"shard-{index:05d}.bin").write_bytes(data)
    _, manifest = read_manifest(directory)
    shards = list(manifest.shards)
    shards[index] = ShardEntry(shards[index].file, hashlib.sha256(data).hexdigest(), shards[index].tokens)
    (directory / "manifest.json").write_bytes(dataclasses.replace(manifest, shards=tuple(shards)).to_json())


def test_bad_shards_are_refused_naming_the_file(byte_dataset, tmp_path):
    shard = "shard-00003.bin"
    good = (byte_dataset / shard).read_bytes()

    truncated = _copy(byte_dataset, tmp_path / "truncated")
    (truncated / shard).write_bytes(good[:-10])
    with pytest.raises(ShardError, match=rf"{shard}: truncated"):
        open_dataset(truncated)

    flipped = _copy(byte_dataset, tmp_path / "flipped")
    data = bytearray(good)
    data[100] ^= 1
    (flipped / shard).write_bytes(bytes(data))
    with pytest.raises(ShardError, match=rf"{shard}: wrong hash"):
        open_dataset(flipped)

    header = _copy(byte_dataset, tmp_path / "header")
    _rewrite_manifest(header, 3, b"NOTASHRD" + good[8:])
    with pytest.raises(ShardError, match=rf"{shard}: wrong header"):
        open_dataset(header)

    beyond = _copy(byte_dataset, tmp_path / "beyond")
    ids = np.frombuffer(good[SHARD_HEADER.size:], dtype="<u2").copy()
    ids[17] = 300  # beyond the byte vocabulary of 256
    _rewrite_manifest(beyond, 3, good[:SHARD_HEADER.size] + ids.tobytes())
    with pytest.raises(ShardError, match=rf"{shard}: token id 300 is beyond the vocabulary \(256 ids\)"):
        open_dataset(beyond)

    missing = _copy(byte_dataset, tmp_path / "missing")
    (missing / shard).unlink()
    with pytest.raises(ShardError, match=rf"{shard}: cannot read shard"):
        open_dataset(missing)

    with pytest.raises(ShardError, match="dataset root"):
        open_dataset(byte_dataset, expected_root="0" * 64)


def test_write_shard_header_and_little_endian_ids(tmp_path):
    entry = write_shard(tmp_path / "shard-00000.bin", np.array([1, 258, 65535]), vocab_size=65536)
    data = (tmp_path / "shard-00000.bin").read_bytes()
    assert data[:8] == b"DLXTOKS\x00" and struct.unpack("<HHIQ", data[8:24]) == (1, 2, 65536, 3)
    assert data[32:] == b"\x01\x00\x02\x01\xff\xff"
    assert entry.sha256 == hashlib.sha256(data).hexdigest() and entry.tokens == 3


def test_bpe_chunks_encode_like_the_whole_text():
    text = generated_text(seed=5, n_bytes=40_000) + "\n  indented line\n\n\nAfter blank lines: 12,345 ok.\n"
    tokenizer = train_tokenizer_from_text(text, 600)
    pieces = list(safe_chunks(__import__("io").BytesIO(text.encode()), chunk_bytes=512))
    assert len(pieces) > 50
    assert b"".join(pieces) == text.encode()
    whole = tokenizer.encode(text)
    assert np.array_equal(encode_bytes(tokenizer, text.encode()), whole)
    assert np.array_equal(np.concatenate(tokenizer.encode_chunks(pieces)), whole)
    assert tokenizer.decode(whole) == text


def train_tokenizer_from_text(text, vocab_size):
    from training.tokenizer import tokenizer_from_bytes, train_bpe

    return tokenizer_from_bytes(train_bpe(iter([text]), vocab_size))


def test_prepare_jsonl_with_a_trained_bpe_and_a_held_out_file(tmp_path):
    records = [{"text": generated_text(seed=i, n_bytes=3000), "id": i} for i in range(12)]
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(json.dumps(r) for r in records[:10]) + "\n")
    held = tmp_path / "valid.jsonl"
    held.write_text("\n".join(json.dumps(r) for r in records[10:]) + "\n")
    tokenizer = train_tokenizer([train], 700)
    assert tokenizer.eos_id == 0 and 300 < tokenizer.vocab_size <= 700
    manifest = prepare_dataset([train], tmp_path / "ds", tokenizer, eval_inputs=[held], shard_tokens=4096)
    assert manifest.tokenizer == f"sha256:{tokenizer.sha256}" and manifest.dtype == "uint16"
    assert (tmp_path / "ds" / "tokenizer.json").read_bytes() == tokenizer.data
    dataset = open_dataset(tmp_path / "ds")
    train_ids = dataset.train.windows(torch.tensor([0]), dataset.split_tokens("train"))[0]
    # ten documents, nine <|endoftext|> between them
    assert int((train_ids == 0).sum()) == 9
    expected = []
    for i, record in enumerate(records[:10]):
        expected += ([0] if i else []) + tokenizer.encode(record["text"])
    assert train_ids.tolist() == expected
    eval_ids = dataset.eval.windows(torch.tensor([0]), dataset.split_tokens("eval"))[0]
    assert eval_ids.tolist() == [0] + tokenizer.encode(records[10]["text"]) + [0] + tokenizer.encode(
        records[11]["text"])

    model = ModelConfig(preset="llama-tiny", vocab_size=tokenizer.vocab_size,
                        tokenizer=str(tmp_path / "ds" / "tokenizer.json"))
    corpus = corpus_from_config(TrainingConfig(data_path=str(tmp_path / "ds")), model)
    assert corpus.sha256 == manifest.root
    x, _ = round_batches(corpus, 0, 0, 0, 2, 4, model.block_size)[0]
    assert x.shape == (4, model.block_size) and int(x.max()) < tokenizer.vocab_size
    with pytest.raises(DataError, match="prepared with tokenizer sha256:.*model.tokenizer is bytes"):
        corpus_from_config(TrainingConfig(data_path=str(tmp_path / "ds")), ModelConfig(preset="llama-tiny"))


def test_prepare_refuses_bad_inputs(tmp_path, text_file):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: no string field 'text'"):
        prepare_dataset([bad], tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
    parquet = tmp_path / "x.parquet"
    parquet.write_bytes(b"PAR1")
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        with pytest.raises(DataError, match="pip install pyarrow"):
            prepare_dataset([parquet], tmp_path / "pq")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(DataError, match="not empty"):
        prepare_dataset([text_file], tmp_path / "full")
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("a")
    with pytest.raises(DataError, match="cannot hold a training split"):
        prepare_dataset([tiny], tmp_path / "tiny")


def test_prepare_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="Parquet input needs pyarrow (not installed)")
    import pyarrow.parquet as pq

    texts = [generated_text(seed=i, n_bytes=500) for i in range(20)]
    pq.write_table(pa.table({"content": texts}), tmp_path / "docs.parquet")
    manifest = prepare_dataset([tmp_path / "docs.parquet"], tmp_path / "ds", text_field="content")
    assert manifest.num_tokens == sum(len(t) for t in texts) + 2 * 19  # "\n\n" between documents


def _rss_file_mib() -> float:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("RssFile:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no RssFile in /proc/self/status")


def test_reading_windows_does_not_keep_the_dataset_resident(tmp_path):
    rng = np.random.default_rng(0)
    writer = ShardWriter(tmp_path, vocab_size=8192, shard_tokens=1 << 23)
    for _ in range(4):
        writer.append(rng.integers(0, 8192, 1 << 23, dtype=np.uint16))
    writer.finish("bytes", eval_start=(1 << 25) - 4096)
    grown = {}
    for release in (True, False):
        dataset = open_dataset(tmp_path, release_pages=release)  # 64 MiB of ids in 4 shards
        before = _rss_file_mib()
        for outer_round in range(4):  # 3200 windows spread over the whole dataset
            round_batches(dataset, 0, 0, outer_round, 50, 16, 256)
        grown[release] = _rss_file_mib() - before
        dataset.train.tokens.close()
    assert grown[True] < 8, f"mapped pages kept resident: {grown[True]:.1f} MiB"
    assert grown[False] > 8  # every window maps at least a page: 3200 pages of 4 KiB, kept
