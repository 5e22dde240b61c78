"""An imported model's initial weights in a run (training/hf_import.py): found by the content hash the run
document names (:func:`init_weights_path`), loaded and checked (:func:`load_init_weights`, what
``training.model.init_state_dict`` returns for such a run), and the source's JSON files as the export writes
them back in its architecture class (:func:`exported_files`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from training.config import ModelConfig
from training.hf_import_files import HFImportError, SafetensorsReader, all_finite, sha256_file

#: The source's JSON files the export writes back (the model's config, the generation and tokenizer
#: settings); kept in ``model.hf_source`` with the source's content hashes.
SOURCE_FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "special_tokens_map.json")
INIT_DIR = "initial"  # a node keeps its run's initial weights as <data_dir>/initial/<sha256>.safetensors
_SEARCH_DIRS: list[Path] = []


def add_search_dir(directory: str | os.PathLike, first: bool = False) -> None:
    """Look for ``sha256:`` initial weights in ``directory`` too (a node adds ``<data_dir>/initial``);
    ``first``: before the others (a directory whose copy was just checked against the hash)."""
    path = Path(directory)
    if path in _SEARCH_DIRS and first:
        _SEARCH_DIRS.remove(path)
    if path not in _SEARCH_DIRS:
        _SEARCH_DIRS.insert(0 if first else len(_SEARCH_DIRS), path)


def init_weights_path(spec: str, search_dirs: list[str | os.PathLike] = ()) -> tuple[Path, str | None]:
    """(file, expected sha256 or None) of ``model.init_weights``: a path, or ``sha256:<hex>`` looked up as
    ``<dir>/<hex>.safetensors`` in ``search_dirs``, those of :func:`add_search_dir` and ``$DLX_INIT_DIRS``
    (':'-separated)."""
    if not spec.startswith("sha256:"):
        return Path(spec).expanduser(), None
    digest = spec[len("sha256:"):]
    env = filter(None, os.environ.get("DLX_INIT_DIRS", "").split(os.pathsep))
    dirs = [*search_dirs, *_SEARCH_DIRS, *env]
    for directory in dirs:
        path = Path(directory).expanduser() / f"{digest}.safetensors"
        if path.is_file():
            return path, digest
    raise HFImportError(f"model.init_weights {spec[:23]}...: the run's initial weights are not here "
                        f"(looked in {[str(d) for d in dirs] or 'no directory'}): fetch them from a peer "
                        "of the run")


def load_init_weights(cfg: ModelConfig, search_dirs: list[str | os.PathLike] = (), names=None) -> dict:
    """The initial weights ``cfg.init_weights`` names, checked: its content hash (a ``sha256:`` reference),
    exactly our parameter names and shapes, finite values; ``names``: only those (a stage's)."""
    import torch

    from training.model import param_shapes

    path, digest = init_weights_path(cfg.init_weights, search_dirs)
    if digest is not None and sha256_file(path) != digest:
        raise HFImportError(f"{path}: not the run's initial weights (sha256 differs from {digest[:16]}...)")
    shapes = param_shapes(cfg)
    try:
        with SafetensorsReader(path) as handle:
            keys = set(handle.keys())
            if keys != set(shapes):
                missing, extra = sorted(set(shapes) - keys)[:3], sorted(keys - set(shapes))[:3]
                raise HFImportError(f"{path}: its tensors are not this model's: missing {missing}, "
                                    f"extra {extra}")
            state = {}
            wanted = set(shapes) if names is None else set(names)
            for name, shape in shapes.items():
                if name not in wanted:
                    continue
                tensor = handle.get_tensor(name)
                if tuple(tensor.shape) != shape or tensor.dtype != torch.float32:
                    raise HFImportError(f"{path}: {name} is {tensor.dtype} {tuple(tensor.shape)}, the model "
                                        f"needs float32 {shape}")
                state[name] = tensor
    except OSError as exc:
        raise HFImportError(f"{path}: not readable initial weights ({exc})") from None
    for name, tensor in state.items():
        if not all_finite(tensor):
            raise HFImportError(f"{path}: {name} holds NaN or infinite values")
    return state


def exported_files(cfg: ModelConfig) -> dict[str, dict]:
    """The source's JSON files as an export writes them: its config.json with the head untied and float32
    weights (its architecture class, rope, context and token ids kept), and its generation and tokenizer
    settings as they were."""
    source = json.loads(cfg.hf_source)
    files = {name: source[name] for name in SOURCE_FILES if name in source}
    dropped = ("_name_or_path", "transformers_version")
    config = {k: v for k, v in files["config.json"].items() if k not in dropped}
    config["tie_word_embeddings"] = False
    config["torch_dtype"] = "float32"
    if "dtype" in config:
        config["dtype"] = "float32"
    files["config.json"] = config
    return files
