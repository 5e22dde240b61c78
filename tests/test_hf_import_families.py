"""Each family's config.json as its publishers write it (issue 76), no hub: transformers builds a small random
model, config.json is rewritten the way Llama 3.1 / 3.2, Qwen2.5 and Mistral write theirs, and transformers
loads that directory as the reference. The import's logits equal transformers' (float32, within 1e-5), the
export writes the same class back with equal logits, and what does not map is refused naming the
architecture and what is supported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.test_hf_import import VOCAB, _source, tokenizer_file  # noqa: F401 (the fixture)
from training.config import ModelConfig
from training.export import export_hf
from training.hf_import import HFImportError, import_hf
from training.model import GPT, init_state_dict
from training.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")

#: Llama 3.1's config.json writes its rope so (transformers 4): rope_scaling beside a top-level rope_theta
LLAMA3_ROPE = {"factor": 8.0, "low_freq_factor": 0.5, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32, "rope_type": "llama3"}


def _rewrite(directory: Path, drop: tuple[str, ...] = (), **values) -> None:
    config = json.loads((directory / "config.json").read_text())
    for key in drop:
        config.pop(key, None)
    (directory / "config.json").write_text(json.dumps({**config, **values}, indent=2))


def _drop_tensor(directory: Path, name: str) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(directory / "model.safetensors")
    del state[name]
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})


def _equal_both_ways(directory: Path, tmp_path: Path, arch: str) -> ModelConfig:
    """Import ``directory``; its logits equal transformers' loading of the same directory, and the export's
    (the same class, reloaded without trust_remote_code) equal ours."""
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    assert type(reference).__name__ == arch
    cfg = ModelConfig(**import_hf(directory, tmp_path / "initial").fields)
    ours = GPT(cfg, seed=None).eval()
    ours.load_state_dict(init_state_dict(cfg, seed=0))
    ids = torch.randint(0, VOCAB, (2, min(cfg.block_size, 40)), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, (got, _) = reference(ids).logits, ours(ids)
    assert want.abs().max() > 0.01 and (got - want).abs().max() <= 1e-5
    out = export_hf(ours.state_dict(), cfg, tmp_path / "out", tokenizer=load_tokenizer(cfg.tokenizer))
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back).__name__ == arch
    with torch.no_grad():
        assert (back(ids).logits - got).abs().max() <= 1e-5
    return cfg


@pytest.mark.parametrize("tie", [False, True], ids=["llama3.1-untied", "llama3.2-tied"])
def test_llama3_as_its_config_json_writes_it(tie, tmp_path, tokenizer_file):  # noqa: F811
    """GQA (4 query heads, 2 key/value heads), ``rope_scaling: {rope_type: llama3, ...}`` and ``rope_theta``
    500000 at the top level (no ``rope_parameters``), the head untied (3.1) or tied with no lm_head.weight
    in the file (3.2)."""
    src = tmp_path / "src"
    _source("llama-tied" if tie else "llama", src, tokenizer_file)
    _rewrite(src, drop=("rope_parameters",), rope_theta=500000.0, rope_scaling=LLAMA3_ROPE,
             tie_word_embeddings=tie)
    with safe_open(src / "model.safetensors", "pt") as handle:
        assert ("lm_head.weight" in handle.keys()) != tie
    cfg = _equal_both_ways(src, tmp_path, "LlamaForCausalLM")
    assert cfg.n_kv_head == 2 < cfg.n_head == 4 and cfg.rope_theta == 500000.0
    assert json.loads(cfg.rope_scaling) == LLAMA3_ROPE
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["rope_scaling"] == LLAMA3_ROPE and exported["tie_word_embeddings"] is False


def test_qwen2_without_a_tie_key_is_untied_as_transformers_reads_it(tmp_path, tokenizer_file):  # noqa: F811
    """Qwen2.5-7B's config.json: q/k/v biases, ``use_sliding_window: false`` with a window shorter than the
    context, and (here) no ``tie_word_embeddings`` key: transformers' Qwen2 default is an untied head, so
    lm_head.weight is the head (the import took the embedding for it before)."""
    src = tmp_path / "src"
    _source("qwen2", src, tokenizer_file)
    config = json.loads((src / "config.json").read_text())
    config["tie_word_embeddings"] = False  # a model with a head of its own, saved
    (src / "config.json").write_text(json.dumps(config))
    model = transformers.AutoModelForCausalLM.from_pretrained(src)
    with torch.no_grad():
        model.lm_head.weight.add_(torch.randn_like(model.lm_head.weight) * 0.05)
    model.save_pretrained(src)
    _rewrite(src, drop=("tie_word_embeddings",), use_sliding_window=False, sliding_window=16,
             max_window_layers=1)
    cfg = _equal_both_ways(src, tmp_path, "Qwen2ForCausalLM")
    assert cfg.attention_bias and cfg.block_size == 64


def test_mistral_sliding_window_is_supported_within_the_context_and_refused_past_it(tmp_path,
                                                                                   tokenizer_file):  # noqa: F811
    """Mistral 7B v0.1 writes ``sliding_window: 4096``; v0.2 on ``null``. A run whose context is within the
    window attends as full causal attention (supported, equal logits); a longer context is refused naming
    the window; ``null`` has no window."""
    src = tmp_path / "src"
    _source("mistral", src, tokenizer_file)
    _rewrite(src, sliding_window=48, max_position_embeddings=48)
    cfg = _equal_both_ways(src, tmp_path, "MistralForCausalLM")
    assert cfg.block_size == 48
    with pytest.raises(HFImportError, match=r"MistralForCausalLM with sliding_window=48 and "
                                            r"model.block_size=64: .* set model.block_size <= 48"):
        import_hf(src, tmp_path / "i2", block_size=64)
    _rewrite(src, sliding_window=None, max_position_embeddings=4096)
    assert ModelConfig(**import_hf(src, tmp_path / "i3", block_size=96).fields).block_size == 96


def test_what_does_not_map_is_refused_naming_the_architecture(tmp_path, tokenizer_file):  # noqa: F811
    src = tmp_path / "src"
    _source("llama", src, tokenizer_file, shard=False)
    _rewrite(src, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})
    with pytest.raises(HFImportError, match=r"LlamaForCausalLM with rope scaling 'yarn': not supported "
                                            r"\(supported: default, linear, llama3\)"):
        import_hf(src, tmp_path / "i")
    _rewrite(src, rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4})
    with pytest.raises(HFImportError, match="LlamaForCausalLM: config.json's llama3 rope scaling lacks"):
        import_hf(src, tmp_path / "i")
    _rewrite(src, drop=("rope_parameters",), tie_word_embeddings=False)
    _drop_tensor(src, "lm_head.weight")
    with pytest.raises(HFImportError, match="lm_head.weight is missing and config.json does not tie"):
        import_hf(src, tmp_path / "i")
    for key, value, says in (("attention_bias", True, "attention_bias=true"), ("hidden_act", "gelu", "silu"),
                             ("head_dim", 16, "head_dim=16")):
        _rewrite(src, **{key: value})
        with pytest.raises(HFImportError, match=f"LlamaForCausalLM with .*{says}"):
            import_hf(src, tmp_path / "i")
        _rewrite(src, drop=(key,))
    _rewrite(src, architectures=["MixtralForCausalLM"], model_type="mixtral")
    with pytest.raises(HFImportError, match=r"MixtralForCausalLM \(model_type 'mixtral'\) is not supported; "
                                            r"supported: LlamaForCausalLM, MistralForCausalLM, "
                                            r"Qwen2ForCausalLM, GPT2LMHeadModel"):
        import_hf(src, tmp_path / "i")


def test_gpt2_as_the_hubs_checkpoint_holds_it(tmp_path, tokenizer_file):  # noqa: F811
    """openai-community/gpt2's files: tensor names without ``transformer.``, no lm_head.weight (tied: its
    config.json has no tie key, and GPT-2's default ties), the attention's causal-mask buffers beside the
    weights. Imported, its logits are transformers'; exported, a GPT2LMHeadModel with ours."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    _source("gpt2", src, tokenizer_file)
    state = load_file(src / "model.safetensors")
    bare = {name.removeprefix("transformer."): t for name, t in state.items() if name != "lm_head.weight"}
    positions = json.loads((src / "config.json").read_text())["n_positions"]
    for layer in (0, 1):
        bare[f"h.{layer}.attn.bias"] = torch.tril(torch.ones(positions, positions)).view(1, 1, positions,
                                                                                         positions)
    save_file(bare, src / "model.safetensors", metadata={"format": "pt"})
    _rewrite(src, drop=("tie_word_embeddings",))
    assert not any(name.startswith("transformer.") for name in bare) and "lm_head.weight" not in bare
    cfg = _equal_both_ways(src, tmp_path, "GPT2LMHeadModel")
    assert cfg.family == "gpt2" and cfg.block_size == positions
