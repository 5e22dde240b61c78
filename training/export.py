"""Export a trained model as a Hugging Face GPT-2 directory.

``export_hf(state_dict, model_cfg, out_dir)`` writes what
``transformers.AutoModelForCausalLM.from_pretrained(out_dir)`` and
``transformers.AutoTokenizer.from_pretrained(out_dir)`` load, with no
dependency on ``transformers`` or ``tokenizers`` at export time:

``config.json``
    ``model_type`` gpt2, ``GPT2LMHeadModel``, the sizes of the model
    (``n_positions = n_ctx = block_size``), ``gelu_new``, LayerNorm eps 1e-5 and
    ``tie_word_embeddings = false`` (our ``lm_head`` is its own matrix). The
    byte vocabulary has no free id for a special token, so byte 0 (NUL, which
    text never contains) serves as bos/eos id.
``model.safetensors``
    The state dict under its (already Hugging Face) names, float32.
``tokenizer.json`` + ``tokenizer_config.json``
    A byte-level BPE with no merges over GPT-2's ``bytes_to_unicode`` alphabet:
    vocabulary ``{bytes_to_unicode[b]: b}``, so token id = raw byte value,
    exactly as :class:`training.tokenizer.ByteTokenizer`. ByteLevel
    pre-tokenizer (no prefix space, no regex split) and ByteLevel decoder.
    No special tokens are registered: any text, including the character that
    stands for byte 0, round-trips.

The directory is written into a temporary sibling, every file fsync'ed, then
renamed into place, so a crash never leaves a half-written export under
``out_dir``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from training.config import ModelConfig
from training.errors import ExportError
from training.model import INIT_STD, LAYER_NORM_EPS, param_shapes

logger = logging.getLogger(__name__)

END_OF_TEXT_ID = 0  # the NUL byte stands in for GPT-2's <|endoftext|>


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {byte: chr(code) for byte, code in zip(printable, codes)}


def hf_config(model_cfg: ModelConfig) -> dict:
    """The ``config.json`` of a ``GPT2LMHeadModel`` equal to our GPT."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": model_cfg.vocab_size,
        "n_positions": model_cfg.block_size,
        "n_ctx": model_cfg.block_size,
        "n_embd": model_cfg.n_embd,
        "n_layer": model_cfg.n_layer,
        "n_head": model_cfg.n_head,
        "n_inner": None,  # 4 * n_embd
        "activation_function": "gelu_new",
        "resid_pdrop": model_cfg.dropout,
        "embd_pdrop": model_cfg.dropout,
        "attn_pdrop": model_cfg.dropout,
        "layer_norm_epsilon": LAYER_NORM_EPS,
        "initializer_range": INIT_STD,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": False,
        "bos_token_id": END_OF_TEXT_ID,
        "eos_token_id": END_OF_TEXT_ID,
        "use_cache": True,
        "torch_dtype": "float32",
    }


def tokenizer_json(model_cfg: ModelConfig) -> dict:
    """A ``tokenizers`` serialisation whose ids are raw byte values."""
    if model_cfg.vocab_size != 256:
        raise ExportError(f"model.vocab_size={model_cfg.vocab_size}: the byte tokenizer needs 256")
    mapping = bytes_to_unicode()
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": dict(byte_level),
        "post_processor": None,
        "decoder": dict(byte_level),
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {mapping[byte]: byte for byte in range(256)},
            "merges": [],
        },
    }


def tokenizer_config(model_cfg: ModelConfig) -> dict:
    """``tokenizer_config.json``: the generic fast tokenizer over ``tokenizer.json``."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_cfg.block_size,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
    }


def _check_state_dict(state_dict: dict[str, torch.Tensor], model_cfg: ModelConfig) -> dict[str, torch.Tensor]:
    expected = param_shapes(model_cfg)
    missing = [name for name in expected if name not in state_dict]
    extra = [name for name in state_dict if name not in expected]
    if missing or extra:
        raise ExportError(
            f"state dict does not match the model config: missing {missing[:5]}, extra {extra[:5]}"
        )
    tensors = {}
    for name, shape in expected.items():
        tensor = state_dict[name]
        if tuple(tensor.shape) != shape:
            raise ExportError(f"{name}: shape {tuple(tensor.shape)} != {shape} of the model config")
        if not torch.isfinite(tensor).all():
            raise ExportError(f"{name}: contains NaN or infinite values")
        tensors[name] = tensor.detach().to(torch.float32).contiguous().clone()
    return tensors


def _write_json(path: Path, value: dict) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(value, handle, indent=2, ensure_ascii=False)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())


def export_hf(
    full_state_dict: dict[str, torch.Tensor],
    model_cfg: ModelConfig,
    out_dir: str | os.PathLike,
    overwrite: bool = False,
) -> Path:
    """Write a Hugging Face GPT-2 model + byte tokenizer directory at ``out_dir`` (atomically).

    An existing ``out_dir`` is an error unless ``overwrite``; then it is
    replaced only after the new export is complete.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise ExportError(f"{out} already exists: choose a new directory or pass overwrite=True")
    tensors = _check_state_dict(full_state_dict, model_cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        _write_json(tmp / "config.json", hf_config(model_cfg))
        _write_json(tmp / "tokenizer.json", tokenizer_json(model_cfg))
        _write_json(tmp / "tokenizer_config.json", tokenizer_config(model_cfg))
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        with open(tmp / "model.safetensors", "rb") as handle:
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o755)
        if out.exists():
            old = out.with_name(f".{out.name}.old")
            if old.exists():
                shutil.rmtree(old)
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old)
        else:
            os.replace(tmp, out)
    except OSError as exc:
        raise ExportError(f"cannot write export to {out}: {exc}") from exc
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("exported %d tensors to %s", len(tensors), out)
    return out
