"""Export a trained model as a Hugging Face directory: ``GPT2LMHeadModel`` or ``LlamaForCausalLM``.

``export_hf(state_dict, model_cfg, out_dir, tokenizer=...)`` writes what
``transformers.AutoModelForCausalLM.from_pretrained(out_dir)`` and
``transformers.AutoTokenizer.from_pretrained(out_dir)`` load, with no
dependency on ``transformers`` at export time:

``config.json``
    The family's config (:meth:`training.family.ModelFamily.hf_config`): for
    GPT-2 ``n_positions = n_ctx`` = at least 1024 (``dlx_context`` = ``block_size``: the position table's
    rows past it are copies of the last trained one, so ``generate`` past the context runs),
    ``gelu_new``, LayerNorm eps 1e-5; for Llama the sizes, ``n_kv_head``, RMSNorm eps, ``rope_theta``, no
    biases. Always ``tie_word_embeddings = false`` (our ``lm_head`` is its own
    matrix). bos/eos ids are the tokenizer's end-of-text token; the byte
    vocabulary has no free id, so there byte 0 (NUL, which text never contains)
    serves.
``model.safetensors``
    The state dict under its (already Hugging Face) names, float32.
``tokenizer.json`` + ``tokenizer_config.json``
    The tokenizer's (:meth:`training.tokenizer.ByteTokenizer.hf_files`, or the
    BPE file itself): ``AutoTokenizer`` gives the ids the model was trained on.

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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from training.config import ModelConfig
from training.errors import ExportError, TokenizerError
from training.hf_import import all_finite
from training.model import family_of, param_shapes
from training.tokenizer import ByteTokenizer, Tokenizer, bytes_to_unicode, check_vocab, load_tokenizer

logger = logging.getLogger(__name__)

__all__ = ["bytes_to_unicode", "export_hf", "hf_config", "special_token_id"]


def special_token_id(tokenizer: Tokenizer) -> int:
    """The id a Hugging Face export gives bos, eos and pad: the end-of-text token (byte 0 for bytes)."""
    special = tokenizer.hf_special_id
    return 0 if special is None else int(special)


def hf_config(model_cfg: ModelConfig, tokenizer: Tokenizer | None = None) -> dict[str, Any]:
    """The ``config.json`` of the ``transformers`` model equal to ours."""
    special = special_token_id(tokenizer or ByteTokenizer())
    return family_of(model_cfg).hf_config(model_cfg, special, special)


def _check_state_dict(state_dict: Mapping[str, torch.Tensor], model_cfg: ModelConfig) -> dict[str, tuple]:
    """The shapes to write, every tensor checked first (nothing is written for a bad state dict). No tensor is
    kept: ``state_dict`` may be a mapping that reads each from a file when asked."""
    expected = param_shapes(model_cfg)
    missing = [name for name in expected if name not in state_dict]
    extra = [name for name in state_dict if name not in expected]
    if missing or extra:
        raise ExportError(
            f"state dict does not match the model config: missing {missing[:5]}, extra {extra[:5]}"
        )
    for name, shape in expected.items():
        tensor = state_dict[name]
        if tuple(tensor.shape) != shape:
            raise ExportError(f"{name}: shape {tuple(tensor.shape)} != {shape} of the model config")
        if not all_finite(tensor):  # in pieces: no temporaries the model's size
            raise ExportError(f"{name}: contains NaN or infinite values")
        del tensor
    return expected


#: GPT-2's learned position table.
POSITIONS = "transformer.wpe.weight"


def _position_table(config: dict, model_cfg: ModelConfig, shapes: dict[str, tuple],
                    state_dict: Mapping[str, torch.Tensor]):
    """(shapes, tensor getter) of the export: a GPT-2 position table grown to the config's ``n_positions``
    with copies of its last trained row (training.gpt2.HF_POSITIONS), every other tensor as it is."""
    positions = int(config.get("n_positions") or 0) if POSITIONS in shapes else 0
    if positions <= model_cfg.block_size:
        return shapes, state_dict.__getitem__

    def tensor_of(name: str) -> torch.Tensor:
        tensor = state_dict[name]
        if name != POSITIONS:
            return tensor
        return torch.cat([tensor, tensor[-1:].expand(positions - tensor.shape[0], -1)])

    return {**shapes, POSITIONS: (positions, shapes[POSITIONS][1])}, tensor_of


def _write_file(path: Path, value: dict | bytes) -> None:
    with open(path, "wb") as handle:
        if isinstance(value, bytes):
            handle.write(value)
        else:
            handle.write((json.dumps(value, indent=2, ensure_ascii=False) + "\n").encode("utf-8"))
        handle.flush()
        os.fsync(handle.fileno())


def export_hf(
    full_state_dict: Mapping[str, torch.Tensor],
    model_cfg: ModelConfig,
    out_dir: str | os.PathLike,
    overwrite: bool = False,
    tokenizer: Tokenizer | None = None,
) -> Path:
    """Write a Hugging Face model + tokenizer directory at ``out_dir`` (atomically).

    ``tokenizer``: the run's (default: ``model_cfg.tokenizer`` loaded, which
    works for ``"bytes"`` and a path; a ``"sha256:..."`` reference must be
    resolved by the caller). An existing ``out_dir`` is an error unless
    ``overwrite``; then it is replaced only after the new export is complete.
    """
    from training.hf_import import stream_safetensors

    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise ExportError(f"{out} already exists: choose a new directory or pass overwrite=True")
    shapes = _check_state_dict(full_state_dict, model_cfg)
    try:
        tokenizer = tokenizer or load_tokenizer(model_cfg.tokenizer)
        check_vocab(tokenizer, model_cfg.vocab_size)
    except TokenizerError as exc:
        raise ExportError(f"cannot export the tokenizer: {exc}") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        files: dict[str, Any] = {"config.json": hf_config(model_cfg, tokenizer),
                                 **tokenizer.hf_files(model_cfg.block_size)}
        if model_cfg.hf_source:  # an imported model: the source's class, generation and tokenizer settings
            from training.hf_import import exported_files

            files.update(exported_files(model_cfg))
        for name, content in files.items():
            _write_file(tmp / name, content)
        shapes, tensor_of = _position_table(files["config.json"], model_cfg, shapes, full_state_dict)
        with open(tmp / "model.safetensors", "wb") as handle:
            # tensor by tensor (training.hf_import.stream_safetensors): no second copy of the weights
            stream_safetensors(handle, shapes, tensor_of)
            handle.flush()
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
    logger.info("exported %d tensors to %s", len(shapes), out)
    return out
