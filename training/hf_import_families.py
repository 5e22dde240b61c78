"""The families an import maps (training/hf_import.py): a Hugging Face ``config.json`` to the project's
[model] settings (:func:`model_fields`), and the source's tensor names to ours (:func:`source_names`).

* ``LlamaForCausalLM``: grouped-query attention, rope scaling "linear" and Llama 3's "llama3", tied or
  untied embeddings; refused: attention or MLP biases, a head size other than hidden / heads, an
  activation other than silu.
* ``Qwen2ForCausalLM``: the Llama blocks with biases on q, k and v (``model.attention_bias``), its own
  RMSNorm eps.
* ``MistralForCausalLM``: the Llama blocks; sliding-window attention only for a context within the window.
* ``GPT2LMHeadModel``: gelu_new, LayerNorm eps 1e-5, ``block_size`` = ``n_positions``.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from training.config import ModelConfig
from training.hf_import_files import HFImportError

if TYPE_CHECKING:
    from training.hf_import import HFSource

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "GPT2LMHeadModel")
LLAMA_LIKE = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
#: Buffers some checkpoints hold besides the parameters (GPT-2's causal mask, old rotary caches).
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")
DEFAULT_LLAMA_CONTEXT = 1024  # block_size of an imported Llama-like model unless the run file sets one


def _need(config: dict, key: str, kind: type = int) -> Any:
    value = config.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise HFImportError(f"config.json: {key}={value!r}: expected a {kind.__name__}")
    return value


def _rope(config: dict, arch: str) -> tuple[float, str]:
    """(rope_theta, rope_scaling as canonical JSON or "") from transformers 5's ``rope_parameters`` or, as
    Llama 3's config.json writes them, ``rope_scaling`` beside a top-level ``rope_theta``."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise HFImportError(f"config.json: rope parameters {params!r}: expected an object")
    theta = params.get("rope_theta") or config.get("rope_theta") or 10000.0
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise HFImportError(f"{arch} with rope_theta={theta!r}: expected a positive number")
    theta = float(theta)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, ""
    if kind == "linear":
        return theta, json.dumps({"factor": float(params["factor"]), "rope_type": "linear"}, sort_keys=True)
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [key for key in keys if key not in params]
        if missing:
            raise HFImportError(f"{arch}: config.json's llama3 rope scaling lacks {missing}")
        scaling = {key: params[key] for key in keys}
        return theta, json.dumps({**scaling, "rope_type": "llama3"}, sort_keys=True)
    raise HFImportError(f"{arch} with rope scaling {kind!r}: not supported (supported: default, linear, "
                        "llama3)")


def model_fields(source: HFSource, block_size: int = 0) -> dict[str, Any]:
    """The [model] settings of the source (sizes, family, rope, biases), refused unless supported."""
    config, arch = source.config, source.architecture
    if arch not in SUPPORTED:
        raise HFImportError(f"--init-from {source.path}: architecture {arch or '(none named)'} "
                            f"(model_type {config.get('model_type')!r}) is not supported; supported: "
                            f"{', '.join(SUPPORTED)}")
    if arch == "GPT2LMHeadModel":
        n_embd, positions = _need(config, "n_embd"), _need(config, "n_positions")
        checks = {"activation_function": (config.get("activation_function", "gelu_new"),
                                          ("gelu_new", "gelu_pytorch_tanh")),
                  "layer_norm_epsilon": (config.get("layer_norm_epsilon", 1e-5), (1e-5,)),
                  "n_inner": (config.get("n_inner"), (None, 4 * n_embd)),
                  "scale_attn_weights": (config.get("scale_attn_weights", True), (True,)),
                  "scale_attn_by_inverse_layer_idx": (config.get("scale_attn_by_inverse_layer_idx", False),
                                                      (False,))}
        for key, (value, allowed) in checks.items():
            if value not in allowed:
                raise HFImportError(f"GPT2LMHeadModel with {key}={value!r}: only {list(allowed)} map to this "
                                    "project's GPT-2")
        # an export of this project: the positions it trained (the table's rows past them are copies)
        context = config.get("dlx_context", positions)
        if isinstance(context, bool) or not isinstance(context, int) or not 1 <= context <= positions:
            raise HFImportError(f"GPT2LMHeadModel with dlx_context={context!r}: must be an integer in "
                                f"[1, n_positions={positions}] (the positions trained)")
        if block_size not in (0, context):
            key = "dlx_context" if "dlx_context" in config else "n_positions"
            raise HFImportError(f"model.block_size={block_size}: a GPT-2 source's context is its "
                                f"{key}={context} (its position table); leave block_size unset")
        return {"family": "gpt2", "preset": "tiny", "vocab_size": _need(config, "vocab_size"),
                "n_layer": _need(config, "n_layer"), "n_head": _need(config, "n_head"), "n_embd": n_embd,
                "block_size": context}
    hidden, heads = _need(config, "hidden_size"), _need(config, "num_attention_heads")
    name = LLAMA_LIKE[arch]
    if config.get("hidden_act", "silu") != "silu":
        raise HFImportError(f"{arch} with hidden_act={config.get('hidden_act')!r}: only silu is supported")
    if config.get("head_dim") not in (None, hidden // heads) or hidden % heads:
        raise HFImportError(f"{arch} with head_dim={config.get('head_dim')} != hidden_size / "
                            f"num_attention_heads = {hidden / heads:g}: not supported")
    if config.get("mlp_bias"):
        raise HFImportError(f"{arch} with mlp_bias=true: not supported")
    if name == "llama" and config.get("attention_bias"):
        raise HFImportError("LlamaForCausalLM with attention_bias=true (a bias on o_proj too): not "
                            "supported; Qwen2's q/k/v biases are")
    max_positions = int(config.get("max_position_embeddings") or DEFAULT_LLAMA_CONTEXT)
    block = block_size or min(max_positions, DEFAULT_LLAMA_CONTEXT)
    window = config.get("sliding_window")
    if name == "qwen2" and not config.get("use_sliding_window", False):
        window = None
    if name == "llama":
        window = None
    if window is not None and block > int(window):
        raise HFImportError(f"{arch} with sliding_window={window} and model.block_size={block}: "
                            "sliding-window attention is supported only for a context within the window; "
                            f"set model.block_size <= {window}")
    theta, scaling = _rope(config, arch)
    fields = {"family": "llama", "preset": "llama-tiny", "vocab_size": _need(config, "vocab_size"),
              "n_layer": _need(config, "num_hidden_layers"), "n_head": heads, "n_embd": hidden,
              "block_size": block, "n_kv_head": int(config.get("num_key_value_heads") or heads),
              "intermediate_size": _need(config, "intermediate_size"), "rope_theta": theta,
              "rms_norm_eps": float(config.get("rms_norm_eps", 1e-6 if name == "qwen2" else 1e-5))}
    if name == "qwen2":
        fields["attention_bias"] = True
    if scaling:
        fields["rope_scaling"] = scaling
    return fields


def tied(source: HFSource) -> bool:
    """Whether the source's head is its embedding: ``tie_word_embeddings``, or where config.json does not
    say, the default of its transformers class (GPT-2's head is tied, Llama's, Mistral's and Qwen2's are
    not). An untied source must hold ``lm_head.weight`` (:func:`source_names` refuses one that does not:
    transformers would start that head from random values)."""
    default = source.architecture == "GPT2LMHeadModel"
    return bool(source.config.get("tie_word_embeddings", default))


def source_names(source: HFSource, cfg: ModelConfig) -> dict[str, str]:
    """Our parameter name -> the source tensor it is copied from (every one checked present)."""
    from training.model import param_shapes

    keys = set(source.key_files)
    gpt2_bare = cfg.family == "gpt2" and "transformer.wte.weight" not in keys and "wte.weight" in keys
    embedding = "transformer.wte.weight" if cfg.family == "gpt2" else "model.embed_tokens.weight"
    is_tied = tied(source)
    names = {}
    for name in param_shapes(cfg):
        src = embedding if name == "lm_head.weight" and is_tied else name
        if gpt2_bare and src.startswith("transformer."):
            src = src[len("transformer."):]
        if src == "lm_head.weight" and src not in keys:
            said = source.config.get("tie_word_embeddings")
            raise HFImportError(f"{source.path}: tensor lm_head.weight is missing and config.json does not "
                                f"tie the head (tie_word_embeddings={said}): "
                                f"transformers would start this {source.architecture}'s head from random "
                                "values")
        if src not in keys:
            raise HFImportError(f"{source.path}: tensor {src} is missing (the config describes a "
                                f"{source.architecture} that has it)")
        names[name] = src
    used = set(names.values())
    extra = sorted(k for k in keys - used if not k.endswith(IGNORED_SUFFIXES) and k != "lm_head.weight")
    if extra:
        raise HFImportError(f"{source.path}: tensors the {source.architecture} this project builds does not "
                            f"have: {extra[:5]}{' ...' if len(extra) > 5 else ''}")
    return names

