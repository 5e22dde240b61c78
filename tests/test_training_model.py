"""The GPT-2 model: names, shapes, sizes, deterministic init, forward."""

import math

import pytest
import torch

from training.config import ModelConfig
from training.errors import ModelInputError, StateDictError
from training.model import GPT, count_params, init_state_dict, param_shapes, token_ids_to


def test_hf_names_and_canonical_order():
    cfg = ModelConfig(preset="tiny")
    model = GPT(cfg)
    names = list(model.state_dict())
    assert names == list(param_shapes(cfg))
    assert names[:2] == ["transformer.wte.weight", "transformer.wpe.weight"]
    assert names[-3:] == ["transformer.ln_f.weight", "transformer.ln_f.bias", "lm_head.weight"]
    sd = model.state_dict()
    c = cfg.n_embd
    assert sd["transformer.h.0.attn.c_attn.weight"].shape == (c, 3 * c)  # Conv1D (in, out)
    assert sd["transformer.h.1.mlp.c_proj.weight"].shape == (4 * c, c)
    assert sd["lm_head.weight"].shape == (cfg.vocab_size, c)
    # untied head
    assert sd["lm_head.weight"].data_ptr() != sd["transformer.wte.weight"].data_ptr()


def test_preset_sizes():
    tiny = count_params(ModelConfig(preset="tiny"))
    small = count_params(ModelConfig(preset="small"))
    assert tiny < 200_000
    assert 2_000_000 < small < 10_000_000
    assert count_params(ModelConfig(preset="tiny")) == sum(p.numel() for p in GPT(ModelConfig()).parameters())


def test_init_is_deterministic_and_gpt2_scaled():
    cfg = ModelConfig(preset="tiny")
    state_before = torch.random.get_rng_state()
    a = init_state_dict(cfg, seed=7)
    assert torch.equal(torch.random.get_rng_state(), state_before)  # global RNG untouched
    b = init_state_dict(cfg, seed=7)
    c = init_state_dict(cfg, seed=8)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["transformer.wte.weight"], c["transformer.wte.weight"])
    assert torch.all(a["transformer.h.0.ln_1.weight"] == 1)
    assert torch.all(a["transformer.h.0.attn.c_attn.bias"] == 0)
    assert a["transformer.wte.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    residual = 0.02 / math.sqrt(2 * cfg.n_layer)
    assert a["transformer.h.0.mlp.c_proj.weight"].std().item() == pytest.approx(residual, rel=0.05)
    model = GPT(cfg, seed=7)
    assert all(torch.equal(model.state_dict()[k], a[k]) for k in a)


def test_forward_shapes_loss_and_causality():
    cfg = ModelConfig(preset="tiny")
    model = GPT(cfg)
    idx = torch.randint(0, 256, (2, cfg.block_size), generator=torch.Generator().manual_seed(0))
    logits, loss = model(idx, idx)
    assert logits.shape == (2, cfg.block_size, 256)
    assert loss.item() == pytest.approx(math.log(256), rel=0.05)  # near-uniform at init
    # changing a later token must not change earlier logits
    idx2 = idx.clone()
    idx2[:, -1] = (idx2[:, -1] + 1) % 256
    logits2, _ = model(idx2)
    assert torch.equal(logits[:, :-1], logits2[:, :-1])
    assert model(idx)[1] is None


def test_bad_ids_are_refused_on_the_host_before_they_reach_a_device():
    # On an accelerator the forward pass only queues its range check (no host synchronisation), so the
    # trainers check a batch before moving it: a "meta" device stands in for one (no data is moved there).
    cfg = ModelConfig(preset="tiny")
    for bad in (-1, 256):
        with pytest.raises(ModelInputError, match=r"\[0, 256\)"):
            token_ids_to(torch.tensor([[1, bad]]), torch.device("meta"), cfg)
    with pytest.raises(ModelInputError, match="LongTensor"):
        token_ids_to(torch.zeros(1, 4), torch.device("meta"), cfg)
    assert token_ids_to(torch.tensor([[0, 255]]), torch.device("meta"), cfg).device.type == "meta"


def test_bad_inputs_are_refused():
    cfg = ModelConfig(preset="tiny")
    model = GPT(cfg)
    with pytest.raises(ModelInputError, match="block_size"):
        model(torch.zeros(1, cfg.block_size + 1, dtype=torch.long))
    with pytest.raises(ModelInputError, match=r"\[0, 256\)"):
        model(torch.full((1, 4), 256, dtype=torch.long))
    with pytest.raises(ModelInputError, match="LongTensor"):
        model(torch.zeros(1, 4))
    with pytest.raises(StateDictError, match="shape"):
        sd = model.state_dict()
        sd["lm_head.weight"] = torch.zeros(3, 3)
        model.load_state_dict(sd)


def test_a_few_steps_reduce_loss():
    cfg = ModelConfig(preset="tiny")
    torch.manual_seed(0)
    model = GPT(cfg)
    idx = torch.arange(cfg.block_size + 1).repeat(4, 1) % 7  # a trivially predictable sequence
    x, y = idx[:, :-1], idx[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(20):
        _, loss = model(x, y)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < first / 2
