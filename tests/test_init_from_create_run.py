"""``create-run --init-from DIR`` on the session's real anvil: an unsupported model is refused before anything
is sent; a supported one is imported into the organizer's directory, the run document names its weights and
tokenizer by content hash, and the genesis root on chain is that of the imported weights."""

from __future__ import annotations

import hashlib
import json
import logging

import pytest
from ledger_fixtures import FAST_RETRY, fresh_anvil_w3

from ledger.account import dev_account
from ledger.client import LedgerClient
from node.cli import main
from node.commitments.values import genesis_root
from node.config import load_config
from training.data import generated_text
from training.hf_import import add_search_dir
from training.model import init_state_dict
from training.prepare import prepare_dataset
from training.tokenizer import ByteTokenizer, train_bpe

transformers = pytest.importorskip("transformers")

RUN_FILE = """\
run_name = "init-from"
rounds = 2
checkpoint_every = 1

[model]
block_size = 32

[diloco]
inner_steps = 3
num_replicas = 2

[pipeline]
num_stages = 2

[run]
stake_eth = 0.5
quorum = 2
"""


@pytest.fixture(autouse=True)
def _fresh_log_handlers():
    yield
    logging.getLogger().handlers[:] = []


@pytest.fixture
def deployed(request, tmp_path):
    w3 = fresh_anvil_w3(request, timeout=10.0)
    registry, ledger = LedgerClient.deploy(w3, dev_account(0, w3.eth.chain_id), retry=FAST_RETRY)
    path = tmp_path / "deployment.json"
    path.write_text(json.dumps({"chain_id": w3.eth.chain_id, "rpc_url": w3.provider.endpoint_uri,
                                "registry": registry, "ledger": ledger, "from_block": 0}))
    return w3, path, LedgerClient(w3, None, registry, ledger)


@pytest.fixture
def source(tmp_path):
    directory = tmp_path / "llama"
    (tmp_path / "tok.json").write_bytes(train_bpe(iter([generated_text(seed=2, n_bytes=20_000)]), 300))
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tok.json"))
    fast.save_pretrained(directory)
    (tmp_path / "text.txt").write_text(generated_text(seed=4, n_bytes=20_000))
    return directory


def _create(tmp_path, deployment, directory, text=RUN_FILE):
    (tmp_path / "run.toml").write_text(text)
    return main(["create-run", str(tmp_path / "run.toml"), "--deployment", str(deployment), "--data-dir",
                 str(tmp_path / "org"), "--listen-port", "24998", "--confirmations", "1",
                 "--dev-account", "4", "--init-from", str(directory), "--yes"])


def test_an_unsupported_model_is_refused_before_anything_is_sent(deployed, source, tmp_path, capsys):
    _, path, client = deployed
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "architectures": ["GPTNeoXForCausalLM"]}))
    assert _create(tmp_path, path, source) == 2
    err = capsys.readouterr().err
    assert "GPTNeoXForCausalLM" in err and "supported: LlamaForCausalLM" in err and len(err.splitlines()) == 1
    assert client.run_count() == 0
    (source / "config.json").write_text(json.dumps(config))
    assert _create(tmp_path, path, source, RUN_FILE.replace("block_size = 32", "n_layer = 3")) == 2
    assert "--init-from takes the model from" in capsys.readouterr().err and client.run_count() == 0
    # data prepared with another tokenizer (bytes): its ids mean other tokens to the model
    prepare_dataset([tmp_path / "text.txt"], tmp_path / "bytes-ds", ByteTokenizer(), shard_tokens=4096)
    with_data = RUN_FILE.replace("[diloco]", f'[training]\ndata_path = "{tmp_path / "bytes-ds"}"\n\n[diloco]')
    capsys.readouterr()
    assert _create(tmp_path, path, source, with_data) == 2
    err = capsys.readouterr().err
    assert "prepared with tokenizer bytes, not the model's own" in err and len(err.splitlines()) == 1
    assert client.run_count() == 0 and not (tmp_path / "org" / "initial").exists()


def test_the_run_names_the_imported_weights_and_its_genesis_root_is_theirs(deployed, source, tmp_path):
    _, path, client = deployed
    assert _create(tmp_path, path, source) == 0
    org = tmp_path / "org"
    document = json.loads((org / "run.json").read_text())
    weights = next((org / "initial").glob("*.safetensors"))
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    assert weights.name == f"{digest}.safetensors" and document["model"]["init_weights"] == f"sha256:{digest}"
    tokenizer = hashlib.sha256((source / "tokenizer.json").read_bytes()).hexdigest()
    assert document["model"]["tokenizer"] == f"sha256:{tokenizer}"
    assert (org / "tokenizers" / f"{tokenizer}.json").is_file()
    cfg = load_config(org / "node.toml")  # the organizer's node starts from the imported weights, by path
    assert cfg.model.init_weights == str(weights) and cfg.model.n_layer == 2 and cfg.model.block_size == 32
    on_chain = client.run_values(1)["genesis_root"]
    add_search_dir(org / "initial")
    assert genesis_root(cfg) == on_chain != bytes(32)
    # a random model of the same shape would not be this run's start
    random_start = init_state_dict(type(cfg.model)(**{**cfg.model.__dict__, "init_weights": ""}), 0)
    imported = init_state_dict(cfg.model, 0)
    assert not all(bool((random_start[n] == imported[n]).all()) for n in imported)
