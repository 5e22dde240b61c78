"""The GPT-2 family (Radford et al. 2019) with Hugging Face's parameter names and layout.

The architecture is GPT-2's exactly, so that a checkpoint exported by
:mod:`training.export` loads in ``transformers`` as ``GPT2LMHeadModel``:

* token embedding ``transformer.wte`` and learned position embedding
  ``transformer.wpe``;
* ``n_layer`` pre-norm blocks ``transformer.h.{i}``:
  ``x = x + attn(ln_1(x))``, ``x = x + mlp(ln_2(x))``;
* attention ``attn.c_attn`` (fused q, k, v) and ``attn.c_proj``, causal,
  scaled by ``1/sqrt(head_dim)``;
* MLP ``mlp.c_fc`` (C -> 4C), ``gelu_new`` (the tanh approximation of GELU),
  ``mlp.c_proj`` (4C -> C);
* final ``transformer.ln_f`` (LayerNorm eps 1e-5) and an *untied*
  ``lm_head`` (shape (vocab, C), no bias). GPT-2 ties ``lm_head`` to ``wte``;
  we do not, because pipeline stages keep the embeddings in the first stage
  and the head in the last (``tie_word_embeddings=false`` on export).

Linear layers inside the blocks use HF's ``Conv1D`` layout: weight of shape
(in, out) and ``y = x @ W + b``.

Initialisation follows GPT-2: weights ~ N(0, 0.02), biases 0, LayerNorm (1, 0),
and the two residual projections per block (``attn.c_proj`` and
``mlp.c_proj``) ~ N(0, 0.02 / sqrt(2 * n_layer)) so the residual stream's
variance does not grow with depth.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from training.config import ModelConfig
from training.family import INIT_STD, Embedding, ModelFamily

LAYER_NORM_EPS = 1e-5
#: The position table a Hugging Face export holds at least (GPT-2's own n_positions): its rows past the
#: trained context (``block_size``, written as ``dlx_context``) are copies of the last trained one, so that
#: transformers' own ``generate`` past the context does not index past the table (IndexError in ``wpe``;
#: issue 80). training/hf_import_families.py reads such an export back at its trained context.
HF_POSITIONS = 1024

# Per-block parameter suffixes in the order of HF's GPT2Block state_dict.
BLOCK_PARAMS = (
    "ln_1.weight",
    "ln_1.bias",
    "attn.c_attn.weight",
    "attn.c_attn.bias",
    "attn.c_proj.weight",
    "attn.c_proj.bias",
    "ln_2.weight",
    "ln_2.bias",
    "mlp.c_fc.weight",
    "mlp.c_fc.bias",
    "mlp.c_proj.weight",
    "mlp.c_proj.bias",
)


class Conv1D(nn.Module):
    """HF's GPT-2 linear layer: weight (in, out), ``y = x @ W + b``."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.empty(n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape[:-1] + (self.weight.size(1),)
        return torch.addmm(self.bias, x.reshape(-1, x.size(-1)), self.weight).view(shape)


class LayerNorm(nn.Module):
    """LayerNorm with GPT-2's eps; parameters start uninitialised (see init_state_dict)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n))
        self.bias = nn.Parameter(torch.empty(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, LAYER_NORM_EPS)


class CausalSelfAttention(nn.Module):
    """GPT-2 multi-head causal self-attention."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = Conv1D(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = Conv1D(cfg.n_embd, cfg.n_embd)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        q, k, v = self.c_attn(x).split(channels, dim=2)
        # (B, T, C) -> (B, heads, T, head_dim)
        q, k, v = (t.view(batch, time, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(batch, time, channels)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """GPT-2 feed-forward: C -> 4C -> gelu_new -> C."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.c_fc = Conv1D(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = Conv1D(4 * cfg.n_embd, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # gelu_new in HF is exactly the tanh approximation.
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    """One pre-norm transformer block."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, context: Any = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Family(ModelFamily):
    """GPT-2: learned positions, LayerNorm, GELU MLP, fused-qkv attention with biases."""

    name = "gpt2"
    root = "transformer"
    blocks = "h"
    final_norm = "ln_f"
    embeddings = ("wte", "wpe")

    def embedding_param_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        return {
            "transformer.wte.weight": (cfg.vocab_size, cfg.n_embd),
            "transformer.wpe.weight": (cfg.block_size, cfg.n_embd),
        }

    def block_param_shapes(self, cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
        c = cfg.n_embd
        shapes = {
            "ln_1.weight": (c,),
            "ln_1.bias": (c,),
            "attn.c_attn.weight": (c, 3 * c),
            "attn.c_attn.bias": (3 * c,),
            "attn.c_proj.weight": (c, c),
            "attn.c_proj.bias": (c,),
            "ln_2.weight": (c,),
            "ln_2.bias": (c,),
            "mlp.c_fc.weight": (c, 4 * c),
            "mlp.c_fc.bias": (4 * c,),
            "mlp.c_proj.weight": (4 * c, c),
            "mlp.c_proj.bias": (c,),
        }
        assert tuple(shapes) == BLOCK_PARAMS
        return {f"transformer.h.{layer}.{suffix}": shape for suffix, shape in shapes.items()}

    def head_param_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        return {
            "transformer.ln_f.weight": (cfg.n_embd,),
            "transformer.ln_f.bias": (cfg.n_embd,),
            "lm_head.weight": (cfg.vocab_size, cfg.n_embd),
        }

    def init_rule(self, cfg: ModelConfig, name: str, shape: tuple[int, ...]) -> tuple[str, float]:
        if name.endswith("c_proj.weight"):
            return "normal", self.residual_std(cfg)
        if ".ln_" in name or "ln_f" in name:
            return "fill", 1.0 if name.endswith("weight") else 0.0
        if name.endswith(".bias"):
            return "fill", 0.0
        return "normal", INIT_STD

    def embedding_modules(self, cfg: ModelConfig) -> dict[str, nn.Module]:
        return {
            "wte": Embedding(cfg.vocab_size, cfg.n_embd),
            "wpe": Embedding(cfg.block_size, cfg.n_embd),
            "drop": nn.Dropout(cfg.dropout),
        }

    def embed(self, modules: nn.ModuleDict, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.size(1), dtype=torch.long, device=idx.device)
        return modules["drop"](modules["wte"](idx) + modules["wpe"](positions))

    def make_block(self, cfg: ModelConfig) -> nn.Module:
        return Block(cfg)

    def make_final_norm(self, cfg: ModelConfig) -> nn.Module:
        return LayerNorm(cfg.n_embd)

    def hf_config(self, cfg: ModelConfig, bos_token_id: int, eos_token_id: int) -> dict[str, Any]:
        """``GPT2LMHeadModel``: ``n_positions = n_ctx`` = at least :data:`HF_POSITIONS` (``dlx_context`` =
        ``block_size``), gelu_new, untied head."""
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": cfg.vocab_size,
            "n_positions": max(cfg.block_size, HF_POSITIONS),
            "n_ctx": max(cfg.block_size, HF_POSITIONS),
            "dlx_context": cfg.block_size,  # the positions trained (HF_POSITIONS)
            "n_embd": cfg.n_embd,
            "n_layer": cfg.n_layer,
            "n_head": cfg.n_head,
            "n_inner": None,  # 4 * n_embd
            "activation_function": "gelu_new",
            "resid_pdrop": cfg.dropout,
            "embd_pdrop": cfg.dropout,
            "attn_pdrop": cfg.dropout,
            "layer_norm_epsilon": LAYER_NORM_EPS,
            "initializer_range": INIT_STD,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
            "tie_word_embeddings": False,
            "bos_token_id": bos_token_id,
            "eos_token_id": eos_token_id,
            "use_cache": True,
            "torch_dtype": "float32",
        }


GPT2 = GPT2Family()
