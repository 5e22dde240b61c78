"""The run's data terms: ``create-run`` fixes them from the run's dataset and a node checks them against its
own before it joins (issue 78; node/dataterms.py, docs/FRAUD_PROOF.md "The run's data terms").

The streamed data root is the whole split's (an in-memory corpus and a prepared dataset whose spans cross
shards); on py-evm a node takes a run whose terms are its dataset's and refuses, by name, one with other terms
(another seed, another block size, another corpus) and a run drawn by replica index whose terms are set; on
anvil the real ``create-run`` of a run drawn by account fixes its dataset's terms (once: the same command
again finds them), ``--no-data-terms`` fixes none, and a run drawn by replica index gets none.
"""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ledger.account import dev_account
from ledger.chunkproof import tree_root
from ledger.client import LedgerClient
from ledger.stepdata import DataClient, DataTerms
from node.dataterms import check_data_terms, data_client, own_terms
from node.errors import ConfigError
from tests.ledger_fixtures import FAST_RETRY, deploy, fresh_anvil_w3
from training.config import TrainingConfig
from training.data import corpus_from_ids
from training.data_binding import data_leaves, iter_data_leaves
from training.sharded_corpus import open_dataset
from training.shards import ShardWriter


def _corpus(n: int = 5_000):
    ids = torch.from_numpy(np.arange(n, dtype=np.int64) * 7 % 3_000)
    return corpus_from_ids(ids, "00" * 32, eval_fraction=0.1)


def _cfg(windows: str = "account", seed: int = 11, block: int = 16):
    return SimpleNamespace(training=TrainingConfig(data_windows=windows, seed=seed, batch_size=4),
                           model=SimpleNamespace(block_size=block))


def test_the_streamed_data_root_is_the_whole_splits(tmp_path):
    memory = _corpus()
    writer = ShardWriter(tmp_path, vocab_size=3_000, shard_tokens=700)  # spans cross shards
    writer.append(memory.train.numpy() if hasattr(memory.train, "numpy") else memory.train)
    writer.append(np.arange(4_500, 5_000, dtype=np.int64) * 7 % 3_000)
    writer.finish("bytes", eval_start=4_500)
    dataset = open_dataset(tmp_path)
    whole = tree_root(data_leaves(memory))
    for corpus in (memory, dataset):
        for span in (64, 640, 4_096):
            assert list(iter_data_leaves(corpus, span)) == data_leaves(corpus)
    terms = own_terms(_cfg(), dataset)
    assert terms == DataTerms(whole, 11, 4_500, 4, 16) == own_terms(_cfg(), memory)
    with pytest.raises(Exception, match="multiple of 64"):
        next(iter_data_leaves(memory, 100))


def test_a_node_takes_its_datasets_terms_and_refuses_others_by_name(request):
    from ledger.chain import connect_pyevm

    w3 = connect_pyevm()
    deployment = deploy(w3)
    run = deployment.member_run((1, 2), quorum=2)
    client = deployment.client(1)
    creator = client.address
    corpus = _corpus()
    check_data_terms(client, run.run_id, _cfg(), corpus)  # no terms: taken (said in the log)
    terms = own_terms(_cfg(), corpus)
    data = data_client(client)
    data.set_data(creator, run.run_id, terms)
    assert data.terms_of(run.run_id, client.from_block) == terms
    check_data_terms(client, run.run_id, _cfg(), corpus)
    for cfg, other in ((_cfg(seed=12), corpus), (_cfg(block=8), corpus), (_cfg(), _corpus(4_000))):
        with pytest.raises(ConfigError, match="are not this node's dataset's"):
            check_data_terms(client, run.run_id, cfg, other)
    with pytest.raises(ConfigError, match="by replica index"):
        check_data_terms(client, run.run_id, _cfg(windows="replica"), corpus)
    # a node that cannot read its dataset cannot check them: refused, saying why
    unreadable = SimpleNamespace(training=dataclasses.replace(_cfg().training, data_path="/nonexistent/data"),
                                 model=SimpleNamespace(block_size=16, tokenizer="bytes", vocab_size=256,
                                                       byte_level=True))
    with pytest.raises(ConfigError, match="cannot read"):
        check_data_terms(client, run.run_id, unreadable)


RUN_FILE = """\
run_name = "{name}"
rounds = 1
checkpoint_every = 1

[model]
preset = "tiny"

[training]
data_windows = "{windows}"

[diloco]
inner_steps = 5
num_replicas = 1

[pipeline]
num_stages = 1

[run]
stake_eth = 0.5
quorum = 1
accusation_blocks = 8
dispute_blocks = 8
"""


def test_create_run_fixes_the_data_terms_of_a_run_drawn_by_account(request, tmp_path, capsys):
    from node.cli import main
    from node.config import load_config

    w3 = fresh_anvil_w3(request, timeout=10.0)
    registry, ledger = LedgerClient.deploy(w3, dev_account(0, w3.eth.chain_id), retry=FAST_RETRY)
    deployment = tmp_path / "deployment.json"
    deployment.write_text(json.dumps({"chain_id": w3.eth.chain_id, "rpc_url": w3.provider.endpoint_uri,
                                      "registry": registry, "ledger": ledger, "from_block": 0}))
    reader = LedgerClient(w3, None, registry, ledger)
    data = data_client(reader)

    def create(name: str, windows: str, *extra: str) -> int:
        if name != "account":  # an account has one node key: the first run's
            extra = (*extra, "--identity", str(tmp_path / "account" / "identity.key"))
        run_file = tmp_path / f"{name}.toml"
        run_file.write_text(RUN_FILE.format(name=name, windows=windows))
        return main(["create-run", str(run_file), "--deployment", str(deployment), "--data-dir",
                     str(tmp_path / name), "--listen-port", "24997", "--confirmations", "1", "--dev-account",
                     "3", "--weak-run", "--yes", *extra])

    assert create("account", "account") == 0
    out = capsys.readouterr().out
    assert "fix the run's data terms" in out and "fixed run 1's data terms on chain" in out, out
    cfg = load_config(tmp_path / "account" / "node.toml")
    assert data.terms_of(1) == own_terms(cfg)
    assert create("account", "account") == 0  # finishing: found, not sent again
    assert "run 1's data terms were fixed before" in capsys.readouterr().out
    assert create("bare", "account", "--no-data-terms") == 0
    assert "--no-data-terms" in capsys.readouterr().out and data.terms_of(2) is None
    assert create("replica", "replica") == 0
    assert "data terms" not in capsys.readouterr().out and data.terms_of(3) is None
    assert DataClient(data.client).terms_of(1) is not None


def test_the_terms_are_cached_by_the_datasets_identity_and_the_terms_inputs(tmp_path, monkeypatch):
    """A node's own terms are kept in its data directory and read back while its dataset and the terms'
    inputs are unchanged (nothing is read of the split then); a rewritten file (same size, its modification
    time put back), another file in its place, another batch size or seed, and a cache that does not parse
    are each computed again; a file changed too recently to trust is not cached (the racy-clean rule)."""
    import os

    import node.dataterms as dataterms
    from training.config import ModelConfig

    text = tmp_path / "corpus.txt"
    text.write_bytes(bytes(range(97, 123)) * 300)
    stat = text.stat()
    os.utime(text, ns=(stat.st_atime_ns, stat.st_mtime_ns - 10**10))

    def cfg(**training):
        values = {"data_windows": "account", "seed": 11, "batch_size": 4, "data_path": str(text), **training}
        return SimpleNamespace(training=TrainingConfig(**values), model=ModelConfig(block_size=16),
                               data_dir=str(tmp_path))

    cache = dataterms._cache_of(cfg())
    assert cache == tmp_path / dataterms.TERMS_CACHE
    monkeypatch.setattr(dataterms, "RACY_S", 0.0)  # the file's change time is now: trusted at once here
    first = dataterms.cached_terms(cfg(), cache)
    assert first == own_terms(cfg()) and cache.is_file()

    reads = []
    real = dataterms.own_terms

    def counted(*args, **kwargs):
        reads.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(dataterms, "own_terms", counted)
    assert dataterms.cached_terms(cfg(), cache) == first and reads == []  # read back, nothing computed
    # the same bytes' size rewritten, its modification time put back: its change time moved
    mtime = text.stat().st_mtime_ns
    text.write_bytes(bytes(range(98, 124)) * 300)
    os.utime(text, ns=(mtime, mtime))
    second = dataterms.cached_terms(cfg(), cache)
    assert reads == [1] and second != first and second == real(cfg())
    # another file renamed into its place
    other = tmp_path / "other.txt"
    other.write_bytes(bytes(range(99, 125)) * 300)
    other.replace(text)
    third = dataterms.cached_terms(cfg(), cache)
    assert len(reads) == 2 and third.root not in (first.root, second.root)
    # the terms' own inputs
    assert dataterms.cached_terms(cfg(batch_size=8), cache).rows == 8 and len(reads) == 3
    assert dataterms.cached_terms(cfg(seed=12), cache).seed == 12 and len(reads) == 4
    assert dataterms.cached_terms(cfg(seed=12), cache).seed == 12 and len(reads) == 4  # cached again
    cache.write_text("{not json")
    assert dataterms.cached_terms(cfg(seed=12), cache).seed == 12 and len(reads) == 5
    # too new to trust: computed, not kept
    monkeypatch.setattr(dataterms, "RACY_S", 3600.0)
    cache.unlink()
    assert dataterms.cached_terms(cfg(), cache) == third and not cache.exists()
