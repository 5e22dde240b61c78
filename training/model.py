"""A GPT-2 decoder with Hugging Face's parameter names and layout.

The architecture is GPT-2's (Radford et al. 2019) exactly, so that a checkpoint
exported by :mod:`training.export` loads in ``transformers`` as
``GPT2LMHeadModel``:

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

The module tree is built by :class:`TransformerSlice`, which can hold any
contiguous range of blocks with or without the embeddings and the head.
:class:`GPT` is the slice holding everything; :class:`training.stages.StageModule`
is a partial slice. Because both run the very same code, chaining the stages
reproduces the full model's forward bit for bit, and every parameter keeps its
full-model name so stage state dicts are disjoint subsets of the full one.

Initialisation follows GPT-2: weights ~ N(0, 0.02), biases 0, LayerNorm (1, 0),
and the two residual projections per block (``attn.c_proj`` and
``mlp.c_proj``) ~ N(0, 0.02 / sqrt(2 * n_layer)) so the residual stream's
variance does not grow with depth. :func:`init_state_dict` draws them from a
local ``torch.Generator`` in the canonical parameter order, so the weights
depend on (config, seed) only and never on the global RNG.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

from training.config import ModelConfig
from training.errors import ModelInputError, StateDictError

logger = logging.getLogger(__name__)

LAYER_NORM_EPS = 1e-5
INIT_STD = 0.02

# Per-block parameter suffixes in the order of HF's GPT2Block state_dict.
_BLOCK_PARAMS = (
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


def embedding_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of the embedding parameters (held by the first stage)."""
    return {
        "transformer.wte.weight": (cfg.vocab_size, cfg.n_embd),
        "transformer.wpe.weight": (cfg.block_size, cfg.n_embd),
    }


def block_param_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """Shapes of block ``layer``'s parameters, in HF order."""
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
    assert tuple(shapes) == _BLOCK_PARAMS
    return {f"transformer.h.{layer}.{suffix}": shape for suffix, shape in shapes.items()}


def head_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of the final LayerNorm and the LM head (held by the last stage)."""
    return {
        "transformer.ln_f.weight": (cfg.n_embd,),
        "transformer.ln_f.bias": (cfg.n_embd,),
        "lm_head.weight": (cfg.vocab_size, cfg.n_embd),
    }


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the full model, in canonical (state_dict) order."""
    shapes = dict(embedding_param_shapes(cfg))
    for layer in range(cfg.n_layer):
        shapes.update(block_param_shapes(cfg, layer))
    shapes.update(head_param_shapes(cfg))
    return shapes


def count_params(cfg: ModelConfig) -> int:
    """Number of scalar parameters of the full model."""
    return sum(math.prod(shape) for shape in param_shapes(cfg).values())


def init_state_dict(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """GPT-2 initial weights of the full model, a pure function of (cfg, seed).

    Tensors are drawn in canonical order from one local CPU generator seeded
    with ``seed``; the global RNG is neither read nor advanced.
    """
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int(seed))
    residual_std = INIT_STD / math.sqrt(2 * cfg.n_layer)
    state: dict[str, torch.Tensor] = {}
    for name, shape in param_shapes(cfg).items():
        tensor = torch.empty(shape, dtype=torch.float32)
        if name.endswith("c_proj.weight"):
            tensor.normal_(0.0, residual_std, generator=generator)
        elif ".ln_" in name or "ln_f" in name:
            tensor.fill_(1.0 if name.endswith("weight") else 0.0)
        elif name.endswith(".bias"):
            tensor.zero_()
        else:
            tensor.normal_(0.0, INIT_STD, generator=generator)
        state[name] = tensor
    return state


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position of the batch."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


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


class Embedding(nn.Module):
    """A lookup table; unlike ``nn.Embedding`` it does not touch the global RNG."""

    def __init__(self, num: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class Linear(nn.Module):
    """Bias-free ``nn.Linear`` layout (weight (out, in)) for the LM head."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TransformerSlice(nn.Module):
    """Blocks ``[layer_start, layer_end)`` of a GPT-2, optionally with embeddings and head.

    Parameter names are those of the full model (``transformer.h.{i}`` keeps the
    global block index ``i``). The forward maps token ids (if
    ``has_embeddings``) or hidden states to hidden states, or to logits if
    ``has_head``. Weights come from ``init_state_dict(cfg, seed)`` unless
    ``seed`` is None (then they are left uninitialised for a later
    ``load_state_dict``).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        layer_start: int,
        layer_end: int,
        has_embeddings: bool,
        has_head: bool,
        seed: int | None = 0,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_start = layer_start
        self.layer_end = layer_end
        self.has_embeddings = has_embeddings
        self.has_head = has_head
        parts: dict[str, nn.Module] = {}
        if has_embeddings:
            parts["wte"] = Embedding(cfg.vocab_size, cfg.n_embd)
            parts["wpe"] = Embedding(cfg.block_size, cfg.n_embd)
            parts["drop"] = nn.Dropout(cfg.dropout)
        # ModuleDict keyed by the global index: keys match the full model's ModuleList.
        parts["h"] = nn.ModuleDict({str(i): Block(cfg) for i in range(layer_start, layer_end)})
        if has_head:
            parts["ln_f"] = LayerNorm(cfg.n_embd)
        self.transformer = nn.ModuleDict(parts)
        if has_head:
            self.lm_head = Linear(cfg.n_embd, cfg.vocab_size)
        if seed is not None:
            full = init_state_dict(cfg, seed)
            self.load_state_dict({name: full[name] for name in self.state_dict()})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.has_embeddings:
            x = self._embed(x)
        else:
            _check_hidden(x, self.cfg)
        for block in self.transformer["h"].values():
            x = block(x)
        if self.has_head:
            x = self.lm_head(self.transformer["ln_f"](x))
        return x

    def _embed(self, idx: torch.Tensor) -> torch.Tensor:
        _check_ids(idx, self.cfg)
        positions = torch.arange(idx.size(1), dtype=torch.long, device=idx.device)
        x = self.transformer["wte"](idx) + self.transformer["wpe"](positions)
        return self.transformer["drop"](x)

    def load_state_dict(  # type: ignore[override]
        self, state_dict, strict: bool = True, assign: bool = False
    ):
        """``nn.Module.load_state_dict`` with a :class:`StateDictError` naming the mismatch."""
        own = {name: tuple(t.shape) for name, t in self.state_dict().items()}
        if strict:
            missing = sorted(set(own) - set(state_dict))
            extra = sorted(set(state_dict) - set(own))
            if missing or extra:
                raise StateDictError(f"state dict mismatch: missing {missing[:5]}, unexpected {extra[:5]}")
        for name, tensor in state_dict.items():
            if name in own and tuple(tensor.shape) != own[name]:
                raise StateDictError(f"{name}: shape {tuple(tensor.shape)} != expected {own[name]}")
        return super().load_state_dict(state_dict, strict=strict, assign=assign)


def _check_ids(idx: torch.Tensor, cfg: ModelConfig) -> None:
    if idx.dim() != 2 or idx.dtype != torch.long:
        raise ModelInputError(f"token ids must be a LongTensor (B, T), got {idx.dtype} {tuple(idx.shape)}")
    if idx.size(1) > cfg.block_size:
        raise ModelInputError(f"sequence length {idx.size(1)} > block_size={cfg.block_size}")
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= cfg.vocab_size):
        raise ModelInputError(f"token ids must be in [0, {cfg.vocab_size})")


def _check_hidden(x: torch.Tensor, cfg: ModelConfig) -> None:
    if x.dim() != 3 or x.size(-1) != cfg.n_embd or not x.is_floating_point():
        raise ModelInputError(f"hidden states must be float (B, T, {cfg.n_embd}), got {tuple(x.shape)}")


class GPT(TransformerSlice):
    """The full GPT-2 decoder: token ids (B, T) -> logits (B, T, vocab)."""

    def __init__(self, cfg: ModelConfig, seed: int | None = 0) -> None:
        super().__init__(cfg, 0, cfg.n_layer, has_embeddings=True, has_head=True, seed=seed)

    def forward(  # type: ignore[override]
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits for every position, and the mean cross-entropy if ``targets`` is given."""
        logits = super().forward(idx)
        loss = None if targets is None else lm_loss(logits, targets)
        return logits, loss

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy decoding of ``max_new_tokens`` tokens (context cropped to block_size)."""
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.cfg.block_size :])
            idx = torch.cat([idx, logits[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
        return idx
