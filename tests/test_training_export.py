"""Export to a Hugging Face GPT-2 directory, loaded back with `transformers`.

Tolerance: logits of the loaded GPT2LMHeadModel equal the project's GPT within
atol 1e-4 (observed ~1e-7: same math, different kernels).
"""

import os

import pytest
import torch
import transformers  # test-only dependency (pyproject [test] extra)

from training.config import ModelConfig
from training.errors import ExportError
from training.export import bytes_to_unicode, export_hf
from training.model import GPT
from training.tokenizer import ByteTokenizer

ATOL = 1e-4


def test_bytes_to_unicode_is_a_bijection():
    mapping = bytes_to_unicode()
    assert sorted(mapping) == list(range(256)) and len(set(mapping.values())) == 256
    assert mapping[ord("a")] == "a" and mapping[ord(" ")] == "Ġ"  # GPT-2's well-known space char


@pytest.mark.timeout(120)
def test_export_loads_in_transformers_with_equal_logits_and_tokenizer(tmp_path):
    cfg = ModelConfig(preset="tiny")
    model = GPT(cfg, seed=4).eval()
    out = export_hf(model.state_dict(), cfg, tmp_path / "export")
    files = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert sorted(os.listdir(out)) == files
    assert [p for p in os.listdir(tmp_path) if p != "export"] == []  # no temp dir left behind

    hf, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    hf.eval()
    assert type(hf).__name__ == "GPT2LMHeadModel"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert hf.config.tie_word_embeddings is False
    idx = torch.randint(0, 256, (2, cfg.block_size), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, model(idx)[0], atol=ATOL, rtol=0)
        prompt = idx[:1, :8]
        generated = hf.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    ours = model.generate(prompt, 6)
    # Greedy decoding agrees token for token; HF stops early only on eos (byte 0).
    assert torch.equal(generated, ours[:, : generated.shape[1]])
    assert generated.shape[1] == 14 or int(generated[0, -1]) == 0

    tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "naïve café — 東京 🚀 Ā\n end"
    ids = tok(text)["input_ids"]
    assert ids == ByteTokenizer().encode(text)
    assert tok.decode(ids) == text


def test_export_refuses_bad_input_and_existing_dirs(tmp_path):
    cfg = ModelConfig(preset="tiny")
    sd = GPT(cfg).state_dict()
    target = tmp_path / "export"
    export_hf(sd, cfg, target)
    with pytest.raises(ExportError, match="already exists"):
        export_hf(sd, cfg, target)
    before = (target / "model.safetensors").read_bytes()
    bad = dict(sd)
    bad["lm_head.weight"] = torch.zeros(3, 3)
    with pytest.raises(ExportError, match="lm_head.weight: shape"):
        export_hf(bad, cfg, target, overwrite=True)
    with pytest.raises(ExportError, match="missing"):
        export_hf({k: v for k, v in sd.items() if k != "lm_head.weight"}, cfg, target, overwrite=True)
    bad["lm_head.weight"] = torch.full_like(sd["lm_head.weight"], float("nan"))
    with pytest.raises(ExportError, match="NaN"):
        export_hf(bad, cfg, target, overwrite=True)
    assert (target / "model.safetensors").read_bytes() == before  # untouched by the refused exports
    sd2 = GPT(cfg, seed=9).state_dict()
    export_hf(sd2, cfg, target, overwrite=True)
    assert (target / "model.safetensors").read_bytes() != before
    assert sorted(os.listdir(tmp_path)) == ["export"]
