"""What `dlx-node pull` writes besides the weights: file modes, the model card, the generation config."""

from __future__ import annotations

import json
import stat

import pytest

from node.tools.pull import _write_model_dir
from training.config import ModelConfig
from training.model import init_state_dict

PROVENANCE = {
    "run_id": 3, "round": 7, "content_hash": "c1" * 32, "weights_root": "e6" * 32,
    "attesters": ["0x70997970C51812dc3A010C7d01b50e0d17dc79C8", "0x3C44CdDdB6a900fa2b585dd299e03d12FA4293BC"],
    "commit_tx": "0x" + "ab" * 32, "chain_id": 31337, "ledger": "0x" + "11" * 20,
    "registry": "0x" + "22" * 20, "config_hash": "33" * 32,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    cfg = ModelConfig(preset="tiny")  # a 32-token context (the demo's mini has 64: the same table overflow)
    out = tmp_path_factory.mktemp("pulled") / "model"
    _write_model_dir(init_state_dict(cfg, 0), cfg, out, PROVENANCE, "http://127.0.0.1:8545",
                     ["/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWJWoaqZhDaoEFshF7Rh1bpY9ohihFhzcW6d69Lr2NASuq"])
    return out


def test_every_file_is_readable_by_others_and_nothing_is_left_beside(model_dir):
    modes = {p.relative_to(model_dir).as_posix(): stat.S_IMODE(p.stat().st_mode)
                 for p in model_dir.rglob("*")}
    assert modes["model.safetensors"] == 0o644
    assert all(mode == (0o755 if (model_dir / name).is_dir() else 0o644) for name, mode in modes.items()), \
        modes
    assert stat.S_IMODE(model_dir.stat().st_mode) == 0o755
    assert [p.name for p in model_dir.parent.iterdir()] == ["model"]  # no staging directory left


def test_the_model_card_carries_the_provenance_in_front_matter_and_text(model_dir):
    import yaml

    text = (model_dir / "README.md").read_text()
    assert text.startswith("---\n")
    front = yaml.safe_load(text.split("---\n")[1])
    assert front["library_name"] == "transformers" and front["pipeline_tag"] == "text-generation"
    dlx = front["dlx"]
    assert (dlx["chain_id"], dlx["run_id"], dlx["round"]) == (31337, 3, 7)
    assert (dlx["ledger"], dlx["weights_root"], dlx["content_hash"]) == (
        PROVENANCE["ledger"], PROVENANCE["weights_root"], PROVENANCE["content_hash"])
    assert dlx["attesters"] == PROVENANCE["attesters"]
    assert (f"dlx-node audit --rpc http://127.0.0.1:8545 --run 3 --ledger {PROVENANCE['ledger']} "
            f"--registry {PROVENANCE['registry']} --bootstrap /ip4/127.0.0.1/tcp/4001/p2p/") in text
    assert PROVENANCE["commit_tx"] in text
    assert json.loads((model_dir / "dlx_provenance.json").read_text()) == PROVENANCE


def test_generate_stays_within_the_context(model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((model_dir / "generation_config.json").read_text())
    assert config["max_length"] == 32
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    # Without a length, generate stops at the context (no prompt: it starts from the bos byte).
    assert model.generate().shape[1] <= 32
    # max_new_tokens beyond the context: transformers' own generate ran past the 32-row position table
    # (IndexError in wpe, issue 80); the export's table goes on to 1024 rows, the last trained one's copies.
    assert json.loads((model_dir / "config.json").read_text())["dlx_context"] == 32
    assert model.config.n_positions == 1024
    assert model.generate(max_new_tokens=200, do_sample=False).shape == (1, 201)
    # The sliding window the card documents (loaded only with trust_remote_code) slides at the 32 trained.
    windowed = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True).eval()
    assert windowed.generate(max_new_tokens=100).shape == (1, 101)
    # Within the context the window changes nothing: the same tokens as transformers' own greedy search.
    prompt = tok("To be, or not", return_tensors="pt")
    with torch.no_grad():
        assert windowed.generate(**prompt, max_new_tokens=8).tolist() == \
            model.generate(**prompt, max_new_tokens=8, do_sample=False).tolist()


def test_a_pulled_gpt2_model_imports_back_at_its_trained_context(model_dir, tmp_path):
    """--init-from a pulled model: the context is dlx_context (32), not the grown table's 1024 rows, and the
    weights are the checkpoint's, the table's copied rows dropped."""
    import torch

    from training.hf_import import import_hf
    from training.hf_import_weights import load_init_weights

    imported = import_hf(model_dir, tmp_path / "initial")
    cfg = ModelConfig(**imported.fields)
    assert cfg.block_size == 32
    want = init_state_dict(ModelConfig(preset="tiny"), 0)
    got = load_init_weights(cfg)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[name], want[name]) for name in want)
