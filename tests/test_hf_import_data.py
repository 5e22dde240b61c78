"""The data of a run started from a Hugging Face model (issue 76, "Data for it"): prepared with the source's
own tokenizer (``dlx-node data prepare --tokenizer DIR``); a clear one-line error, before anything is written,
when the tokenizer's vocabulary and the model's disagree, and ``--init-from`` refuses a dataset prepared with
another tokenizer before the model is imported (the create-run refusal on a real chain:
tests/test_init_from_create_run.py)."""

from __future__ import annotations

import json

import pytest
from test_hf_import import _source

from node.cli import main
from node.commands.runfile import import_model
from node.errors import ConfigError
from training.data import generated_text
from training.prepare import prepare_dataset
from training.sharded_corpus import read_manifest
from training.tokenizer import ByteTokenizer, load_tokenizer, train_bpe

pytest.importorskip("transformers")


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "tok.json").write_bytes(train_bpe(iter([generated_text(seed=3, n_bytes=20_000)]), 300))
    _source("qwen2", tmp_path / "qwen", tmp_path / "tok.json")
    (tmp_path / "text.txt").write_text(generated_text(seed=4, n_bytes=30_000))
    return tmp_path / "qwen"


def test_data_prepared_with_the_model_directory_uses_its_own_tokenizer(model_dir, tmp_path, capsys):
    out = tmp_path / "ds"
    assert main(["data", "prepare", str(tmp_path / "text.txt"), "--out", str(out), "--tokenizer",
                 str(model_dir), "--no-progress"]) == 0
    printed = capsys.readouterr().out  # the run's [model] comes from the model: only its data_path is printed
    assert f"--init-from {model_dir}" in printed and "vocab_size =" not in printed
    assert f'data_path = "{out.resolve()}"' in printed
    manifest = read_manifest(out)[1]
    tokenizer = load_tokenizer(str(model_dir / "tokenizer.json"))
    assert manifest.tokenizer == f"sha256:{tokenizer.sha256}" and manifest.vocab_size == tokenizer.vocab_size
    import_model(str(model_dir), {"block_size": 32}, tmp_path / "node", "run.toml", str(out))  # accepted


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused_before_anything_is_written(model_dir,
                                                                                         tmp_path, capsys):
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "vocab_size": 200}))
    out = tmp_path / "ds"
    assert main(["data", "prepare", str(tmp_path / "text.txt"), "--out", str(out), "--tokenizer",
                 str(model_dir), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "300 tokens" in err and "vocab_size=200" in err and "disagree" in err, err
    assert len(err.splitlines()) == 1 and not out.exists()
    with pytest.raises(ConfigError, match="tokenizer and its model disagree"):  # and --init-from refuses it
        import_model(str(model_dir), {"block_size": 32}, tmp_path / "node", "run.toml")


def test_init_from_refuses_data_prepared_with_another_tokenizer_before_importing(model_dir, tmp_path):
    prepare_dataset([tmp_path / "text.txt"], tmp_path / "bytes-ds", ByteTokenizer(), shard_tokens=8192)
    with pytest.raises(ConfigError, match="prepared with tokenizer bytes, not the model's own") as refused:
        import_model(str(model_dir), {"block_size": 32}, tmp_path / "node", "run.toml",
                     str(tmp_path / "bytes-ds"))
    assert "\n" not in str(refused.value) and f"--tokenizer {model_dir}" in str(refused.value)
    assert not (tmp_path / "node").exists()  # refused before the weights were written
    # a BPE of the same size trained on other text: ids within the vocabulary, other tokens
    (tmp_path / "other.json").write_bytes(train_bpe(iter([generated_text(seed=9, n_bytes=20_000)]), 300))
    other = load_tokenizer(str(tmp_path / "other.json"))
    assert other.sha256 != load_tokenizer(str(model_dir / "tokenizer.json")).sha256
    prepare_dataset([tmp_path / "text.txt"], tmp_path / "other-ds", other, shard_tokens=8192)
    with pytest.raises(ConfigError, match="its ids mean other tokens to this model"):
        import_model(str(model_dir), {}, tmp_path / "node", "run.toml", str(tmp_path / "other-ds"))
