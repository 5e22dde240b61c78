"""The Llama family: HF names and shapes, presets, stages == whole model exactly, export == LlamaForCausalLM.

Tolerance of the export: logits of the loaded LlamaForCausalLM equal the project's forward in float32
within 1e-5 (same math; kernels may sum in another order).
"""

import math

import pytest
import torch

from training.config import ModelConfig
from training.errors import StateDictError, TrainingConfigError
from training.model import GPT, count_params, init_state_dict, param_shapes
from training.stages import StageModule, split_stages, split_state_dict, stage_param_names

TINY = ModelConfig(preset="llama-tiny")

#: Parameters of every Llama preset at the vocabulary it is named for (docs/MODELS.md, the preset table).
PRESET_PARAMS = {
    ("llama-tiny", 256): 34_976,
    ("llama-20m", 8192): 18_880_896,
    ("llama-60m", 32000): 62_925_312,
    ("llama-124m", 32000): 124_668_672,
    ("llama-350m", 32000): 348_701_696,
    ("llama-1b", 32000): 1_100_048_384,
}


def test_preset_parameter_counts():
    for (preset, vocab), expected in PRESET_PARAMS.items():
        cfg = ModelConfig(preset=preset, vocab_size=vocab)
        count = count_params(cfg)
        print(f"{preset:<11} vocab {vocab:>6}: {count:>13,} parameters ({cfg.n_layer} layers, {cfg.n_embd} "
              f"wide, {cfg.n_head} heads / {cfg.n_kv_head} kv, SwiGLU {cfg.intermediate_size}, "
              f"context {cfg.block_size})")
        assert cfg.family == "llama"
        assert count == expected
    assert count_params(TINY) == sum(p.numel() for p in GPT(TINY).parameters())


def test_names_and_shapes_are_those_of_llama_for_causal_lm():
    transformers = pytest.importorskip("transformers")
    from training.export import hf_config

    cfg = ModelConfig(preset="llama-tiny", n_layer=3)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config(cfg)))
    theirs = {name: tuple(t.shape) for name, t in hf.state_dict().items()}
    ours = param_shapes(cfg)
    assert ours == theirs
    assert list(GPT(cfg).state_dict()) == list(ours)
    assert not any(name.endswith(".bias") for name in ours)  # no biases
    # grouped-query attention: 2 key/value heads for 4 query heads
    assert ours["model.layers.0.self_attn.k_proj.weight"] == (2 * cfg.head_dim, cfg.n_embd)
    assert ours["model.layers.0.self_attn.q_proj.weight"] == (4 * cfg.head_dim, cfg.n_embd)


def test_init_is_deterministic_and_scaled():
    state_before = torch.random.get_rng_state()
    a = init_state_dict(TINY, seed=7)
    assert torch.equal(torch.random.get_rng_state(), state_before)
    b = init_state_dict(TINY, seed=7)
    c = init_state_dict(TINY, seed=8)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert torch.all(a["model.layers.0.input_layernorm.weight"] == 1) \
        and torch.all(a["model.norm.weight"] == 1)
    big = ModelConfig(preset="llama-20m")
    d = init_state_dict(big, seed=0)
    assert d["model.layers.0.mlp.up_proj.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    residual = 0.02 / math.sqrt(2 * big.n_layer)
    assert d["model.layers.3.mlp.down_proj.weight"].std().item() == pytest.approx(residual, rel=0.05)
    assert d["model.layers.3.self_attn.o_proj.weight"].std().item() == pytest.approx(residual, rel=0.05)
    assert not torch.equal(d["lm_head.weight"], d["model.embed_tokens.weight"])  # untied


def test_forward_is_causal_and_a_few_steps_learn():
    model = GPT(TINY, seed=1)
    idx = torch.randint(0, 256, (2, TINY.block_size), generator=torch.Generator().manual_seed(0))
    logits, loss = model(idx, idx)
    assert logits.shape == (2, TINY.block_size, 256)
    assert loss.item() == pytest.approx(math.log(256), rel=0.05)
    changed = idx.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 256
    assert torch.equal(model(changed)[0][:, :-1], logits[:, :-1])
    x = (torch.arange(TINY.block_size + 1).repeat(4, 1) % 7)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(20):
        _, loss = model(x[:, :-1], x[:, 1:])
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < first / 2


def test_rotary_positions_matter_and_theta_is_used():
    a = GPT(TINY, seed=2)
    b = GPT(ModelConfig(preset="llama-tiny", rope_theta=500000.0), seed=2)
    idx = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))
    assert not torch.allclose(a(idx)[0], b(idx)[0])
    # Attention without positions is blind to the order of the context; with no position table, only the
    # rotary embeddings can tell "a b c" from "b a c" at "c".
    ordered, swapped = torch.tensor([[10, 20, 30]]), torch.tensor([[20, 10, 30]])
    assert not torch.allclose(a(ordered)[0][0, -1], a(swapped)[0][0, -1])


@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_stage_modules_chain_to_the_whole_model_bit_for_bit(num_stages):
    cfg = ModelConfig(preset="llama-tiny", n_layer=3)
    full = GPT(cfg, seed=3)
    specs = split_stages(cfg.n_layer, num_stages)
    stages = [StageModule(cfg, spec, seed=3) for spec in specs]
    assert [list(s.state_dict()) for s in stages] == [stage_param_names(cfg, spec) for spec in specs]
    assert "model.embed_tokens.weight" in stages[0].state_dict()
    assert {"model.norm.weight", "lm_head.weight"} <= set(stages[-1].state_dict())
    idx = torch.randint(0, 256, (3, cfg.block_size), generator=torch.Generator().manual_seed(5))
    hidden = idx
    for stage in stages:
        hidden = stage(hidden)
    assert torch.equal(hidden, full(idx)[0])
    # and gradients too: one backward through the chain equals one through the whole model
    targets = torch.roll(idx, -1, dims=1)
    loss_full = full(idx, targets)[1]
    loss_full.backward()
    hidden = idx
    for stage in stages:
        hidden = stage(hidden)
    torch.nn.functional.cross_entropy(hidden.reshape(-1, 256), targets.reshape(-1)).backward()
    grads = {n: p.grad for s in stages for n, p in s.named_parameters()}
    assert all(torch.equal(grads[n], p.grad) for n, p in full.named_parameters())


def test_split_state_dict_by_name_alone():
    cfg = ModelConfig(preset="llama-tiny", n_layer=3)
    full = init_state_dict(cfg, 0)
    specs = split_stages(3, 3)
    by_name = split_state_dict(full, specs)
    assert [list(part) for part in by_name] == [list(part) for part in split_state_dict(full, specs, cfg)]
    with pytest.raises(StateDictError, match="belong to no stage"):
        split_state_dict({**full, "model.rotary.inv_freq": torch.zeros(2)}, specs)


def test_config_validation_names_the_field():
    with pytest.raises(TrainingConfigError, match="n_kv_head=3: must divide model.n_head=4"):
        ModelConfig(preset="llama-tiny", n_kv_head=3)
    with pytest.raises(TrainingConfigError, match=r"model.n_kv_head=2 is a setting of the llama family"):
        ModelConfig(preset="tiny", n_kv_head=2)
    with pytest.raises(TrainingConfigError, match="is a gpt2 preset"):
        ModelConfig(preset="tiny", family="llama")
    with pytest.raises(TrainingConfigError, match="model.family='mamba'"):
        ModelConfig(preset="llama-tiny", family="mamba")
    with pytest.raises(TrainingConfigError, match="rope_theta"):
        ModelConfig(preset="llama-tiny", rope_theta=0.5)
    # Llama's SwiGLU width rule: 8/3 C rounded up to a multiple of 256 (2730 -> 2816 at C = 1024)
    assert ModelConfig(preset="llama-350m").intermediate_size == 2816
    assert ModelConfig(preset="llama-1b").intermediate_size == 5632  # TinyLlama's
    assert ModelConfig(preset="llama-20m", n_embd=768, n_head=12).intermediate_size == 2048
    assert ModelConfig(preset="llama-tiny", n_head=2, n_kv_head=0).n_kv_head == 2


def test_exported_llama_equals_our_forward_and_generates(tmp_path):
    transformers = pytest.importorskip("transformers")
    from training.export import export_hf

    cfg = ModelConfig(preset="llama-tiny", n_layer=3, rope_theta=50000.0)
    model = GPT(cfg, seed=4).eval()
    out = export_hf(model.state_dict(), cfg, tmp_path / "export")
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    hf = hf.float().eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert hf.config.num_key_value_heads == 2 and hf.config.tie_word_embeddings is False
    idx = torch.randint(0, 256, (2, cfg.block_size), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, model(idx)[0], atol=1e-5, rtol=0)
        prompt = idx[:1, :8]
        generated = hf.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    ours = model.generate(prompt, 8)
    assert torch.equal(generated, ours[:, : generated.shape[1]])
