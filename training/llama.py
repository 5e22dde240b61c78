"""The Llama family (Touvron et al. 2023, arXiv 2302.13971 and 2307.09288) as ``LlamaForCausalLM`` names it.

Parameter names and layouts are Hugging Face's, so a checkpoint exports as a
copy (:mod:`training.export`):

* ``model.embed_tokens`` (vocab, C); no position table: positions enter
  through rotary embeddings (RoPE, Su et al. 2021, arXiv 2104.09864) applied
  to queries and keys in every block, with base ``rope_theta``;
* ``n_layer`` pre-norm blocks ``model.layers.{i}``::

      x = x + o_proj(attention(rope(q_proj(n)), rope(k_proj(n)), v_proj(n)))   n = input_layernorm(x)
      x = x + down_proj(silu(gate_proj(n)) * up_proj(n))                        n =
      post_attention_layernorm(x)

  with RMSNorm (Zhang & Sennrich 2019; weight only, eps 1e-5), the SwiGLU MLP
  (Shazeer 2020, arXiv 2002.05202) of width ``intermediate_size``, and
  grouped-query attention (Ainslie et al. 2023, arXiv 2305.13245):
  ``n_kv_head`` key/value heads, each shared by ``n_head / n_kv_head``
  consecutive query heads (HF's ``repeat_kv``). No biases anywhere; ``dropout``
  applies to the attention probabilities only, as HF's ``attention_dropout``;
* final ``model.norm`` and an untied ``lm_head`` (vocab, C): pipeline stages
  keep the embedding in the first stage and the head in the last.

RoPE follows HF's convention (``rotate_half`` over the two halves of each
head, ``inv_freq = theta^(-2i/d)`` in float32, ``cos``/``sin`` cast to the
activations' dtype), so the exported model's logits equal ours.

Initialisation: every matrix ~ N(0, 0.02), except the two projections that
write into the residual stream (``o_proj``, ``down_proj``) ~ N(0, 0.02 /
sqrt(2 n_layer)) as in GPT-2; RMSNorm weights 1.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from training.config import ModelConfig
from training.family import INIT_STD, Embedding, Linear, ModelFamily

RMS_NORM_EPS = 1e-5
_RESIDUAL_PROJECTIONS = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight``, computed in at least float32 (HF's LlamaRMSNorm)."""

    def __init__(self, n: int, eps: float = RMS_NORM_EPS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        # Half precisions are normalised in float32; float32 and float64 keep their own precision.
        h = x.float() if x.element_size() < 4 else x
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def scale_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """The inverse frequencies under ``scaling`` (``rope_type`` "linear" or Llama 3.1's "llama3"), as
    ``transformers``' ``ROPE_INIT_FUNCTIONS`` compute them."""
    kind = scaling.get("rope_type", "default")
    if kind == "default":
        return inv_freq
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_context = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(
    head_dim: int, theta: float, seq_len: int, device: torch.device, dtype: torch.dtype,
    scaling: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (T, head_dim) of positions ``0..seq_len-1``: angle ``p * theta^(-2i/d)``, halves repeated;
    the frequencies scaled by ``scaling`` (:func:`scale_inv_freq`) when one is given.
    """
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim)
    )
    if scaling:
        inv_freq = scale_inv_freq(inv_freq, scaling)
    positions = torch.arange(seq_len, device=device).float()
    freqs = positions[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``(x1, x2) -> (-x2, x1)`` over the two halves of the last dimension."""
    half = x.size(-1) // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each head of ``x`` (B, heads, T, d) by its positions' angles."""
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary positions; biases on q, k and v only with
    ``attention_bias`` (Qwen2's), none on the output."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.n_kv_head = cfg.n_kv_head
        self.head_dim = cfg.head_dim
        self.dropout = cfg.dropout
        make = BiasedLinear if cfg.attention_bias else Linear
        self.q_proj = make(cfg.n_embd, cfg.n_head * cfg.head_dim)
        self.k_proj = make(cfg.n_embd, cfg.n_kv_head * cfg.head_dim)
        self.v_proj = make(cfg.n_embd, cfg.n_kv_head * cfg.head_dim)
        self.o_proj = Linear(cfg.n_head * cfg.head_dim, cfg.n_embd)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        batch, time, _ = x.shape
        cos, sin = rope
        # (B, T, heads * d) -> (B, heads, T, d)
        q = self.q_proj(x).view(batch, time, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, time, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, time, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        groups = self.n_head // self.n_kv_head
        if groups > 1:
            # query head h reads key/value head h // groups (HF's repeat_kv)
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.o_proj(y.transpose(1, 2).reshape(batch, time, self.n_head * self.head_dim))


class BiasedLinear(Linear):
    """``Linear`` with a bias (out,): ``x W^T + b``."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__(n_in, n_out)
        self.bias = nn.Parameter(torch.empty(n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class SwiGLU(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.n_embd, cfg.intermediate_size)
        self.up_proj = Linear(cfg.n_embd, cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """One pre-norm Llama block (HF's ``LlamaDecoderLayer``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = SwiGLU(cfg)
        self.input_layernorm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.n_embd, cfg.norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaFamily(ModelFamily):
    """Llama: RMSNorm, rotary positions, SwiGLU, grouped-query attention, no biases."""

    name = "llama"
    root = "model"
    blocks = "layers"
    final_norm = "norm"
    embeddings = ("embed_tokens",)

    def embedding_param_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        return {"model.embed_tokens.weight": (cfg.vocab_size, cfg.n_embd)}

    def block_param_shapes(self, cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
        c, d, inner = cfg.n_embd, cfg.head_dim, cfg.intermediate_size
        shapes: dict[str, tuple[int, ...]] = {"self_attn.q_proj.weight": (cfg.n_head * d, c)}
        if cfg.attention_bias:  # HF's order: each projection's weight, then its bias
            shapes["self_attn.q_proj.bias"] = (cfg.n_head * d,)
        shapes["self_attn.k_proj.weight"] = (cfg.n_kv_head * d, c)
        if cfg.attention_bias:
            shapes["self_attn.k_proj.bias"] = (cfg.n_kv_head * d,)
        shapes["self_attn.v_proj.weight"] = (cfg.n_kv_head * d, c)
        if cfg.attention_bias:
            shapes["self_attn.v_proj.bias"] = (cfg.n_kv_head * d,)
        shapes.update({
            "self_attn.o_proj.weight": (c, cfg.n_head * d),
            "mlp.gate_proj.weight": (inner, c),
            "mlp.up_proj.weight": (inner, c),
            "mlp.down_proj.weight": (c, inner),
            "input_layernorm.weight": (c,),
            "post_attention_layernorm.weight": (c,),
        })
        return {f"model.layers.{layer}.{suffix}": shape for suffix, shape in shapes.items()}

    def head_param_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        return {"model.norm.weight": (cfg.n_embd,), "lm_head.weight": (cfg.vocab_size, cfg.n_embd)}

    def init_rule(self, cfg: ModelConfig, name: str, shape: tuple[int, ...]) -> tuple[str, float]:
        if name.endswith(".bias"):  # Qwen2's q/k/v biases
            return "fill", 0.0
        if len(shape) == 1:  # the RMSNorm weights: the other vectors
            return "fill", 1.0
        if name.endswith(_RESIDUAL_PROJECTIONS):
            return "normal", self.residual_std(cfg)
        return "normal", INIT_STD

    def embedding_modules(self, cfg: ModelConfig) -> dict[str, nn.Module]:
        return {"embed_tokens": Embedding(cfg.vocab_size, cfg.n_embd)}

    def embed(self, modules: nn.ModuleDict, idx: torch.Tensor) -> torch.Tensor:
        return modules["embed_tokens"](idx)

    def make_block(self, cfg: ModelConfig) -> nn.Module:
        return DecoderLayer(cfg)

    def make_final_norm(self, cfg: ModelConfig) -> nn.Module:
        return RMSNorm(cfg.n_embd, cfg.norm_eps)

    def block_context(self, cfg: ModelConfig, seq_len: int, device: torch.device, dtype: torch.dtype) -> Any:
        # A pure function of (cfg, T): every stage computes the same tensors the whole model would.
        scaling = json.loads(cfg.rope_scaling) if cfg.rope_scaling else None
        return rope_cos_sin(cfg.head_dim, cfg.rope_theta, seq_len, device, dtype, scaling)

    def hf_config(self, cfg: ModelConfig, bos_token_id: int, eos_token_id: int) -> dict[str, Any]:
        """``LlamaForCausalLM``: the same sizes, RMSNorm eps, rope theta, untied head, no biases."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.n_embd,
            "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.n_layer,
            "num_attention_heads": cfg.n_head,
            "num_key_value_heads": cfg.n_kv_head,
            "head_dim": cfg.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": cfg.block_size,
            "initializer_range": INIT_STD,
            "rms_norm_eps": RMS_NORM_EPS,
            # transformers >= 5 reads rope_parameters, older versions rope_theta.
            "rope_theta": cfg.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "attention_bias": False,
            "attention_dropout": cfg.dropout,
            "mlp_bias": False,
            "pretraining_tp": 1,
            "tie_word_embeddings": False,
            "bos_token_id": bos_token_id,
            "eos_token_id": eos_token_id,
            "use_cache": True,
            "torch_dtype": "float32",
        }


LLAMA = LlamaFamily()
