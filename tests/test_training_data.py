"""Corpus loading, held-out split and deterministic round batches."""

import hashlib
import struct
import subprocess
import sys

import pytest
import torch

from training.data import (
    ROUND_BATCHES_DOMAIN,
    corpus_from_bytes,
    eval_batches,
    generated_corpus,
    generated_text,
    load_corpus,
    round_batches,
)
from training.errors import DataError
from training.tokenizer import ByteTokenizer


def _digest(batches):
    h = hashlib.sha256()
    for x, y in batches:
        h.update(x.numpy().tobytes())
        h.update(y.numpy().tobytes())
    return h.hexdigest()


def test_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "naïve café — 東京 🚀"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == text
    assert tok.decode(ids[:-1]).endswith("\ufffd")  # a cut multi-byte char is replaced, not an error


def test_held_out_split_is_the_disjoint_tail(tmp_path):
    data = bytes(range(256)) * 40
    path = tmp_path / "c.txt"
    path.write_bytes(data)
    corpus = load_corpus(path, eval_fraction=0.1, block_size=16)
    assert corpus.train.numel() + corpus.eval.numel() == len(data)
    assert bytes(corpus.train.numpy()) + bytes(corpus.eval.numpy()) == data
    assert corpus.eval.numel() == 1024
    assert corpus.sha256 == hashlib.sha256(data).hexdigest()
    # eval batches come only from the tail
    train_len = corpus.train.numel()
    for x, y in eval_batches(corpus, n=3, batch_size=4, block_size=16):
        assert x.shape == y.shape == (4, 16)
        assert torch.equal(x[:, 1:], y[:, :-1])
    offset_ok = all(
        bytes(x_row.to(torch.uint8).numpy()) in bytes(corpus.eval.numpy())
        for x, _ in eval_batches(corpus, 3, 4, 16)
        for x_row in x
    )
    assert offset_ok and train_len == len(data) - 1024
    assert _digest(eval_batches(corpus, 3, 4, 16)) == _digest(eval_batches(corpus, 3, 4, 16))


def test_round_batches_depend_on_seed_replica_round_only():
    corpus = generated_corpus(seed=1, n_bytes=20_000)
    args = dict(inner_steps=3, batch_size=4, block_size=16)
    a = round_batches(corpus, 5, 0, 2, **args)
    assert len(a) == 3 and a[0][0].shape == (4, 16) and a[0][0].dtype == torch.long
    assert torch.equal(a[0][0][:, 1:], a[0][1][:, :-1])
    assert _digest(a) == _digest(round_batches(corpus, 5, 0, 2, **args))
    others = [round_batches(corpus, 6, 0, 2, **args), round_batches(corpus, 5, 1, 2, **args),
              round_batches(corpus, 5, 0, 3, **args)]
    assert len({_digest(a)} | {_digest(o) for o in others}) == 4
    # step k's batch does not depend on the round length
    longer = round_batches(corpus, 5, 0, 2, inner_steps=5, batch_size=4, block_size=16)
    assert _digest(longer[:3]) == _digest(a)
    # nor on the steps asked for before it (a time-bounded round builds its batches a few at a time)
    assert _digest(round_batches(corpus, 5, 0, 2, inner_steps=5, batch_size=4, block_size=16, first_step=2)) \
        == \
        _digest(longer[2:])
    for bad in (-1, 5):
        with pytest.raises(DataError, match=f"first_step={bad}"):
            round_batches(corpus, 5, 0, 2, inner_steps=5, batch_size=4, block_size=16, first_step=bad)


def test_round_batches_follow_the_documented_derivation():
    corpus = generated_corpus(seed=2, n_bytes=5_000)
    x, y = round_batches(corpus, 9, 1, 4, inner_steps=2, batch_size=2, block_size=8)[1]
    digest = hashlib.sha256(ROUND_BATCHES_DOMAIN + struct.pack(">QQQQQ", 9, 1, 4, 1, 1)).digest()
    offset = int.from_bytes(digest[:8], "big") % (corpus.train.numel() - 8)
    train = bytes(corpus.train.numpy())
    assert bytes(x[1].to(torch.uint8).numpy()) == train[offset : offset + 8]
    assert bytes(y[1].to(torch.uint8).numpy()) == train[offset + 1 : offset + 9]


def test_round_batches_are_identical_in_a_fresh_process():
    code = (
        "import hashlib\n"
        "from training.data import generated_corpus, round_batches\n"
        "h = hashlib.sha256()\n"
        "for x, y in round_batches(generated_corpus(1, 20_000), 5, 1, 7, 3, 4, 16):\n"
        "    h.update(x.numpy().tobytes()); h.update(y.numpy().tobytes())\n"
        "print(h.hexdigest())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    expected = _digest(round_batches(generated_corpus(1, 20_000), 5, 1, 7, 3, 4, 16))
    assert out.stdout.strip() == expected


def test_generated_corpus_is_deterministic_english_like():
    text = generated_text(seed=3, n_bytes=2_000)
    assert len(text) == 2_000 and text == generated_text(seed=3, n_bytes=2_000)
    assert text != generated_text(seed=4, n_bytes=2_000)
    assert text.isascii() and text.count(" ") > 200 and "." in text


def test_bad_files_get_specific_errors(tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_corpus(tmp_path / "missing.txt")
    with pytest.raises(DataError, match="directory"):
        load_corpus(tmp_path)
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match="empty"):
        load_corpus(empty)
    short = tmp_path / "short.txt"
    short.write_bytes(b"x" * 100)
    with pytest.raises(DataError, match=r"eval split has 10 tokens, fewer than block_size \+ 1 = 33"):
        load_corpus(short, eval_fraction=0.1, block_size=32)
    binary = tmp_path / "latin1.txt"
    binary.write_bytes("café ".encode("latin-1") * 100)  # not UTF-8: read as bytes, fine
    corpus = load_corpus(binary, block_size=8)
    assert corpus.num_bytes == 500
    with pytest.raises(DataError, match="replica=-1"):
        round_batches(corpus, 0, -1, 0, 1, 1, 8)
    with pytest.raises(DataError, match="eval_fraction"):
        corpus_from_bytes(b"abc", eval_fraction=0.0)
