"""``dlx-node data prepare``: a trained tokenizer and shards from the command line, and the settings it
prints."""

from __future__ import annotations

import json

from node.cli import main
from node.config import load_config
from node.runconfig import config_hash, run_document
from training.data import corpus_from_config, generated_text, round_batches


def _settings(stdout: str) -> list[str]:
    """The ``key = value`` lines after '[model]' / '[training]' as --set overrides."""
    section, overrides = "", []
    for line in stdout.splitlines():
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
        elif section and " = " in line:
            key, value = line.split(" = ", 1)
            overrides.append(f"{section}.{key}={value.strip(chr(34))}")
    return overrides


def test_prepare_trains_a_tokenizer_and_prints_settings_a_llama_run_loads(tmp_path, capsys):
    text = tmp_path / "book.txt"
    text.write_text(generated_text(seed=2, n_bytes=40_000))
    out = tmp_path / "ds"
    code = main(["data", "prepare", str(text), "--out", str(out), "--train-tokenizer", "--vocab-size", "400",
                 "--shard-tokens", "3000", "--no-progress"])
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["tokenizer"].startswith("sha256:") and len(manifest["shards"]) >= 3
    overrides = _settings(stdout)
    assert f"training.data_path={out.resolve()}" in overrides
    assert any(o.startswith("model.tokenizer=") for o in overrides) and "model.vocab_size=400" in overrides
    cfg = load_config(None, ["model.preset=llama-tiny", *overrides])
    document = run_document(cfg)
    assert document["training"]["data_sha256"] == f"manifest:{manifest['root']}"
    assert document["model"]["tokenizer"] == manifest["tokenizer"]
    assert len(config_hash(document)) == 32
    corpus = corpus_from_config(cfg.training, cfg.model)
    x, y = round_batches(corpus, 0, 1, 2, 3, 4, cfg.model.block_size)[2]
    assert x.shape == (4, cfg.model.block_size) and torch_equal_shifted(x, y)


def torch_equal_shifted(x, y) -> bool:
    return bool((x[:, 1:] == y[:, :-1]).all())


def test_prepare_errors_are_one_line_with_an_exit_code(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("hello\n" * 100)
    assert main(["data", "prepare", str(text), "--out", str(tmp_path / "a"), "--train-tokenizer"]) == 2
    assert "--vocab-size" in capsys.readouterr().err
    bad = tmp_path / "x.jsonl"
    bad.write_text('{"body": 1}\n')
    assert main(["data", "prepare", str(bad), "--out", str(tmp_path / "b")]) == 12
    assert "x.jsonl:1: no string field 'text'" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def test_the_demo_takes_a_prepared_dataset_with_its_tokenizer(tmp_path):
    from node.commands.demo import _dataset_model_settings
    from training.prepare import prepare_dataset, train_tokenizer

    text = tmp_path / "t.txt"
    text.write_text(generated_text(seed=4, n_bytes=20_000))
    prepare_dataset([text], tmp_path / "bytes")
    assert _dataset_model_settings(tmp_path / "bytes") == ["model.vocab_size=256"]
    tokenizer = train_tokenizer([text], 300)
    prepare_dataset([text], tmp_path / "bpe", tokenizer)
    settings = _dataset_model_settings(tmp_path / "bpe")
    assert settings == [f"model.vocab_size={tokenizer.vocab_size}",
                        f"model.tokenizer={tmp_path / 'bpe' / 'tokenizer.json'}"]
    cfg = load_config(None, ["model.preset=llama-tiny", f"training.data_path={tmp_path / 'bpe'}", *settings])
    assert corpus_from_config(cfg.training, cfg.model).sha256 == json.loads(
        (tmp_path / "bpe" / "manifest.json").read_text())["root"]
