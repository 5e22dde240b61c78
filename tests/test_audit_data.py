"""``dlx-node audit --data DIR`` on a run with a prepared dataset: the auditor reads batches from the dataset
exactly as nodes do, and only from the run's dataset; anything else is refused naming the mismatch."""

from __future__ import annotations

import pytest
import torch

from node.config import load_config
from node.runconfig import run_document
from node.tools.audit_replay import Replayer
from training.data import corpus_from_config, generated_text, round_batches
from training.prepare import prepare_dataset, train_tokenizer
from training.screening import screening_batch
from training.sharded_corpus import read_manifest


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    text = root / "book.txt"
    text.write_text(generated_text(seed=8, n_bytes=30_000))
    tokenizer = train_tokenizer([text], 320)
    prepare_dataset([text], root / "ds", tokenizer, shard_tokens=3000)
    prepare_dataset([text], root / "other", tokenizer, eval_fraction=0.2, shard_tokens=3000)
    cfg = load_config(None, ["model.preset=llama-tiny", f"model.vocab_size={tokenizer.vocab_size}",
                             f"model.tokenizer={root / 'ds' / 'tokenizer.json'}",
                             f"training.data_path={root / 'ds'}"])
    return root, cfg, run_document(cfg)


def test_the_auditor_reads_the_batches_the_nodes_read(run):
    root, cfg, document = run
    replayer = Replayer(document, root / "ds")
    audited = replayer._corpus()
    assert audited is not None and replayer.corpus_problem == ""
    node = corpus_from_config(cfg.training, cfg.model, [root / "ds"])  # what a node opens
    assert audited.sha256 == node.sha256 == read_manifest(root / "ds")[1].root
    seed, block = cfg.training.seed, cfg.model.block_size
    batches = zip(round_batches(audited, seed, 1, 3, 4, 2, block),
                  round_batches(node, seed, 1, 3, 4, 2, block))
    for ours, theirs in batches:
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    assert torch.equal(screening_batch(audited, seed, 3, 8, block)[0],
                       screening_batch(node, seed, 3, 8, block)[0])


@pytest.mark.parametrize("data, expected", [
    ("other", "dataset root"),  # same text and tokenizer, another split: another root
    ("book.txt", "not a prepared dataset"),
    ("", "pass its directory with --data DIR"),
])
def test_another_dataset_is_refused_naming_the_mismatch(run, data, expected):
    root, _, document = run
    replayer = Replayer(document, root / data if data else None)
    assert replayer._corpus() is None
    assert expected in replayer.corpus_problem
    if data == "other":
        assert read_manifest(root / "other")[1].root in replayer.corpus_problem
