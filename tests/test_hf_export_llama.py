"""A pulled Llama run with a trained BPE: LlamaForCausalLM + AutoTokenizer from the directory, logits equal
ours (float32, within 1e-5), text round-trips and generates; the run's tokenizer is found by its hash and
nothing else."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from node.errors import PullRefused, PullUnavailable
from node.tools.hf_export import find_tokenizer, write_model_dir
from training.config import ModelConfig
from training.data import generated_text
from training.model import GPT
from training.tokenizer import tokenizer_from_bytes, train_bpe

PROVENANCE = {
    "run_id": 1, "round": 4, "content_hash": "c1" * 32, "weights_root": "e6" * 32, "attesters": [],
    "commit_tx": "", "chain_id": 31337, "ledger": "0x" + "11" * 20, "registry": "0x" + "22" * 20,
    "config_hash": "33" * 32,
}
TEXT = "To be, or not to be, that is the question: naïve café — 東京 🚀\n\tend"


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    data = train_bpe(iter([generated_text(seed=1, n_bytes=30_000), TEXT]), 420)
    archive = tmp_path_factory.mktemp("archive")
    digest = hashlib.sha256(data).hexdigest()
    (archive / "tokenizers").mkdir()
    (archive / "tokenizers" / f"{digest}.json").write_bytes(data)
    return tokenizer_from_bytes(data), archive


@pytest.fixture(scope="module")
def pulled(bpe, tmp_path_factory):
    tokenizer, archive = bpe
    cfg = ModelConfig(preset="llama-tiny", n_layer=3, vocab_size=tokenizer.vocab_size,
                      tokenizer=f"sha256:{tokenizer.sha256}")
    model = GPT(cfg, seed=11).eval()
    out = tmp_path_factory.mktemp("pull") / "model"
    found = find_tokenizer(cfg.tokenizer, [archive])
    write_model_dir(model.state_dict(), cfg, out, PROVENANCE, "http://127.0.0.1:8545", [], found)
    return cfg, model, out


def test_directory_holds_a_llama_with_the_runs_tokenizer(pulled, bpe):
    tokenizer, _ = bpe
    cfg, _, out = pulled
    names = sorted(p.name for p in out.iterdir())
    assert names == ["README.md", "config.json", "custom_generate", "dlx_provenance.json",
                     "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest() == tokenizer.sha256
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_key_value_heads"] == 2
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.eos_id == 0 and generation["max_length"] == cfg.block_size
    card = (out / "README.md").read_text()
    assert "- llama" in card and "Llama-architecture" in card \
        and f"byte-level BPE of {tokenizer.vocab_size}" in card


def test_transformers_loads_both_and_they_work_together(pulled, bpe):
    transformers = pytest.importorskip("transformers")
    tokenizer, _ = bpe
    cfg, model, out = pulled
    tok = transformers.AutoTokenizer.from_pretrained(out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    ids = tok(TEXT)["input_ids"]
    assert ids == tokenizer.encode(TEXT) and tok.decode(ids) == TEXT
    assert len(ids) < len(TEXT.encode())  # merges: fewer tokens than bytes
    batch = torch.randint(0, cfg.vocab_size, (2, cfg.block_size), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(hf(batch).logits, model(batch)[0], atol=1e-5, rtol=0)
        prompt = tok("To be", return_tensors="pt")
        generated = hf.generate(**prompt, max_new_tokens=12, do_sample=False)
    text = tok.decode(generated[0])
    assert text.startswith("To be") and len(generated[0]) > prompt["input_ids"].shape[1]
    ours = model.generate(prompt["input_ids"], 12)
    assert torch.equal(generated, ours[:, : generated.shape[1]])


class _Fetcher:
    """A peer that serves ``data`` for any hash (the blob layer's own check is not what is tested here)."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def fetch_to(self, hash_hex: str, dest: Path) -> Path:
        dest.write_bytes(self.data)
        return dest


def test_the_tokenizer_is_taken_only_with_its_hash(bpe, tmp_path):
    tokenizer, archive = bpe
    reference = f"sha256:{tokenizer.sha256}"
    assert find_tokenizer(reference, [archive]).sha256 == tokenizer.sha256
    assert find_tokenizer(reference, [], _Fetcher(tokenizer.data)).sha256 == tokenizer.sha256
    with pytest.raises(PullRefused, match="from peers refused"):
        find_tokenizer(reference, [], _Fetcher(tokenizer.data + b" "))
    impostor = tmp_path / "tokenizers"
    impostor.mkdir()
    (impostor / f"{tokenizer.sha256}.json").write_bytes(tokenizer.data.replace(b"<|endoftext|>",
                                                                               b"<|endoftxet|>"))
    with pytest.raises(PullUnavailable, match="found neither in --archive"):  # exit 9, as any refusal
        find_tokenizer(reference, [tmp_path])
    assert find_tokenizer("bytes").vocab_size == 256
