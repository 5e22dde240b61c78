"""Start from a Hugging Face model directory: map its config to a :class:`ModelConfig`, its tensors to ours.

:func:`import_hf` reads ``DIR`` (``config.json``, ``model.safetensors`` or a sharded
``model.safetensors.index.json``, the tokenizer's ``tokenizer.json``) and writes the model's initial
weights as one float32 safetensors file under the project's parameter names, in canonical order, streamed
one tensor at a time (:class:`SafetensorsReader` reads each tensor's bytes with ``readinto``: no second full
copy of the model in memory, and no memory map whose pages would stay resident). The file is named by its
sha256, which the run document gives as ``model.init_weights``; ``training.model.init_state_dict`` then
loads it (:func:`load_init_weights`) instead of drawing random weights, so the genesis root, every
replica's start and the audit's replay of round 0 are these weights.

This module reads the directory and writes the weights; the rest is split by role (each name is re-exported
here): :mod:`training.hf_import_families` maps each family's config and tensor names,
:mod:`training.hf_import_files` reads and writes safetensors one tensor at a time, and
:mod:`training.hf_import_weights` finds, loads and checks a run's initial weights and gives the export the
source's files.

Supported (:data:`SUPPORTED`), each mapped to the project's families:

* ``LlamaForCausalLM``: grouped-query attention, rope scaling "linear" and Llama 3's "llama3" (from
  ``rope_parameters``, or ``rope_scaling`` beside ``rope_theta`` as Llama 3.x writes it), tied or
  untied embeddings; refused: attention or MLP biases, a head size other than hidden / heads, an
  activation other than silu.
* ``Qwen2ForCausalLM``: the Llama blocks with biases on q, k and v (``model.attention_bias``), its own
  RMSNorm eps.
* ``MistralForCausalLM``: the Llama blocks. Sliding-window attention is supported only where it changes
  nothing: a run's context (``block_size``) no longer than the window (every token then sees every earlier
  one, as in full causal attention); a longer context is refused (so is one longer than a Qwen2's window
  when its ``use_sliding_window`` is true).
* ``GPT2LMHeadModel``: gelu_new, LayerNorm eps 1e-5, ``block_size`` = ``n_positions``.

A tied head (``tie_word_embeddings``, or where config.json does not say, the class's default: GPT-2's
only) starts as a copy of the embedding (an untied source without ``lm_head.weight`` is refused):
pipeline stages keep the embedding in the first stage and the head in the last, so they train untied,
and the export (:func:`exported_files`) writes ``tie_word_embeddings: false`` in the source's
architecture class. Anything else is refused with :class:`HFImportError` naming the architecture.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from training.config import ModelConfig
from training.hf_import_families import (  # noqa: F401 (the import's API)
    DEFAULT_LLAMA_CONTEXT,
    IGNORED_SUFFIXES,
    LLAMA_LIKE,
    SUPPORTED,
    model_fields,
    source_names,
    tied,
)
from training.hf_import_files import (  # noqa: F401 (the import's API)
    HFImportError,
    SafetensorsReader,
    all_finite,
    sha256_file,
    stream_safetensors,
)
from training.hf_import_weights import (  # noqa: F401 (the import's API)
    _SEARCH_DIRS,
    INIT_DIR,
    SOURCE_FILES,
    add_search_dir,
    exported_files,
    init_weights_path,
    load_init_weights,
)

#: The source's JSON files ride in the run document (a blob of at most 64 KiB, node/commands/rundocs.py).
MAX_SOURCE_FILES_BYTES = 40 * 1024


@dataclass
class HFSource:
    """What :func:`read_source` found in a model directory."""

    path: Path
    config: dict[str, Any]
    weight_files: list[Path]
    key_files: dict[str, Path]  # tensor name -> the file holding it
    tokenizer: Path
    extra: dict[str, Any] = field(default_factory=dict)  # SOURCE_FILES found, parsed

    @property
    def architecture(self) -> str:
        return str((self.config.get("architectures") or [""])[0])


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise HFImportError(f"{path}: not readable JSON ({exc})") from None


def read_source(directory: str | os.PathLike) -> HFSource:
    """The config, weight files and tokenizer of a Hugging Face model directory (refused when incomplete)."""
    path = Path(directory).expanduser()
    if not (path / "config.json").is_file():
        raise HFImportError(f"--init-from {path}: no config.json (a Hugging Face model directory has one)")
    config = _read_json(path / "config.json")
    if not isinstance(config, dict):
        raise HFImportError(f"{path / 'config.json'}: not a JSON object")
    arch = str((config.get("architectures") or [""])[0])
    if arch not in SUPPORTED:
        raise HFImportError(f"--init-from {path}: architecture {arch or '(none named)'} (model_type "
                            f"{config.get('model_type')!r}) is not supported; supported: "
                            f"{', '.join(SUPPORTED)}")
    index = path / "model.safetensors.index.json"
    key_files: dict[str, Path] = {}
    if (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    elif index.is_file():
        weight_map = _read_json(index).get("weight_map") if isinstance(_read_json(index), dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise HFImportError(f"{index}: no weight_map")
        for key, name in weight_map.items():
            shard = path / str(name)
            if Path(str(name)).name != str(name) or not shard.is_file():
                raise HFImportError(f"{index}: {key} is in {name!r}, which is not a file of {path}")
            key_files[key] = shard
        files = sorted(set(key_files.values()))
    else:
        found = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pth"))
        raise HFImportError(f"--init-from {path}: no model.safetensors or model.safetensors.index.json"
                            + (f" (found {found[:3]}: pickled weights are not read; save with "
                               "safe_serialization=True)" if found else ""))
    if not key_files:
        with SafetensorsReader(files[0]) as reader:
            key_files = {key: files[0] for key in reader.keys()}
    tokenizer = path / "tokenizer.json"
    if not tokenizer.is_file():
        raise HFImportError(f"--init-from {path}: no tokenizer.json (the run tokenizes with the source's own "
                            "tokenizer: save it with a fast tokenizer, AutoTokenizer.from_pretrained(DIR)"
                            ".save_pretrained(DIR))")
    extra = {name: _read_json(path / name) for name in SOURCE_FILES if (path / name).is_file()}
    return HFSource(path, config, files, key_files, tokenizer, extra)



def source_digest(source: HFSource) -> str:
    """The source's weights by content: sha256 over each weight file's (name, sha256), in name order."""
    digest = hashlib.sha256()
    for path in sorted(source.weight_files):
        digest.update(f"{path.name}\0{sha256_file(path)}\n".encode())
    return digest.hexdigest()



def write_init_weights(source: HFSource, cfg: ModelConfig, dest_dir: str | os.PathLike) -> Path:
    """Write the source's tensors as ``dest_dir/<sha256>.safetensors`` (float32, our names, canonical order),
    one tensor in memory at a time; return the path."""
    from training.model import param_shapes

    shapes, names = param_shapes(cfg), source_names(source, cfg)
    dest = Path(dest_dir)
    dest.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=".init-", suffix=".tmp", dir=dest)
    tmp = Path(tmp_name)
    handles: dict[Path, Any] = {}

    def tensor_of(name: str) -> Any:
        path = source.key_files[names[name]]
        if path not in handles:
            handles[path] = SafetensorsReader(path)
        if names[name] not in handles[path].entries:
            raise HFImportError(f"{path.name}: {names[name]} is not in it (the index says it is)")
        tensor = handles[path].get_tensor(names[name])
        if name == "transformer.wpe.weight" and tensor.shape[0] > shapes[name][0]:
            tensor = tensor[:shapes[name][0]]  # an export's rows past its dlx_context (training/export.py)
        return tensor

    try:
        with os.fdopen(fd, "wb") as out:
            try:
                digest = stream_safetensors(out, shapes, tensor_of)
            except HFImportError as exc:
                raise HFImportError(f"{source.path}: {exc}") from None
            out.flush()
            os.fsync(out.fileno())
        final = dest / f"{digest}.safetensors"
        os.replace(tmp, final)
        return final
    finally:
        for reader in handles.values():
            reader.close()
        tmp.unlink(missing_ok=True)


@dataclass
class Imported:
    """What :func:`import_hf` made: the [model] settings (paths for the local node.toml) and the files."""

    fields: dict[str, Any]
    weights: Path
    tokenizer: Path
    architecture: str


def import_hf(directory: str | os.PathLike, dest_dir: str | os.PathLike, block_size: int = 0) -> Imported:
    """Import a model directory: its [model] settings, its weights written under ``dest_dir`` (see module
    docstring) and its tokenizer (checked against the vocabulary)."""
    from training.tokenizer import TokenizerError, check_vocab, load_tokenizer

    source = read_source(directory)
    fields = model_fields(source, block_size)
    try:
        tokenizer = load_tokenizer(str(source.tokenizer))
        check_vocab(tokenizer, fields["vocab_size"])
    except TokenizerError as exc:
        raise HFImportError(f"--init-from {source.path}: its tokenizer and its model disagree: "
                            f"{exc}") from None
    extra = dict(source.extra)
    if isinstance(extra.get("tokenizer_config.json"), dict):  # its added tokens are in tokenizer.json too
        extra["tokenizer_config.json"] = {k: v for k, v in extra["tokenizer_config.json"].items()
                                          if k != "added_tokens_decoder"}
    hf_source = {**extra, "source": {"architecture": source.architecture,
                                            "weights_sha256": source_digest(source),
                                            "tokenizer_sha256": tokenizer.sha256, "tied": tied(source)}}
    fields["hf_source"] = json.dumps(hf_source, sort_keys=True, separators=(",", ":"))
    if len(fields["hf_source"]) > MAX_SOURCE_FILES_BYTES:
        raise HFImportError(f"--init-from {source.path}: its {', '.join(extra)} take "
                            f"{len(fields['hf_source'])} bytes, more than the run document carries "
                            f"({MAX_SOURCE_FILES_BYTES}): shorten tokenizer_config.json (its chat_template)")
    fields["tokenizer"] = str(source.tokenizer.resolve())
    cfg = ModelConfig(**fields)
    weights = write_init_weights(source, cfg, dest_dir)
    fields["init_weights"] = str(weights.resolve())
    return Imported(fields, weights, source.tokenizer, source.architecture)



# ---------------------------------------------------------------------- the run's data
def check_source_vocab(directory: str | os.PathLike, tokenizer: Any) -> None:
    """``dlx-node data prepare --tokenizer DIR`` of a model directory: the ids the tokenizer emits must all be
    in the model's vocabulary (``config.json``'s ``vocab_size``); refused before anything is written."""
    path = Path(directory).expanduser()
    if not (path / "config.json").is_file():
        return
    config = _read_json(path / "config.json")
    vocab = config.get("vocab_size") if isinstance(config, dict) else None
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        raise HFImportError(f"{path / 'config.json'}: vocab_size={vocab!r}: expected a positive integer")
    if tokenizer.vocab_size > vocab:
        raise HFImportError(f"{path}: its tokenizer.json has {tokenizer.vocab_size} tokens, more than its "
                            f"model's vocabulary (config.json vocab_size={vocab}): the tokenizer and the "
                            "model disagree (a tokenizer of another model?); prepare with the model's own")


def check_prepared_data(data_path: str | os.PathLike, directory: str | os.PathLike) -> None:
    """A run started from the model ``directory`` trains on a prepared dataset (``data_path``) only if it was
    prepared with the model's own tokenizer and its ids fit the model's vocabulary (``create-run --init-from``
    refuses it before anything is imported or sent); a text file is tokenized by the nodes with that
    tokenizer (nothing to check)."""
    from training.errors import ShardError
    from training.sharded_corpus import is_dataset, read_manifest

    if not data_path or not is_dataset(data_path):
        return
    source = read_source(directory)
    vocab_size, tokenizer_sha256 = model_fields(source)["vocab_size"], sha256_file(source.tokenizer)
    try:
        manifest = read_manifest(data_path)[1]
    except ShardError as exc:
        raise HFImportError(f"training.data_path={str(data_path)!r}: {exc}") from None
    prepare = f"dlx-node data prepare TEXT... --tokenizer {source.path} --out DIR"
    if manifest.tokenizer != f"sha256:{tokenizer_sha256}":
        raise HFImportError(f"training.data_path={str(data_path)!r} was prepared with tokenizer "
                            f"{manifest.tokenizer[:23]}, not the model's own "
                            f"(sha256:{tokenizer_sha256[:16]}...): its ids mean other tokens to this model; "
                            f"prepare it with `{prepare}`")
    if manifest.vocab_size > vocab_size:
        raise HFImportError(f"training.data_path={str(data_path)!r} holds ids up to "
                            f"{manifest.vocab_size - 1}, beyond the model's vocabulary ({vocab_size}): the "
                            f"tokenizer and the model disagree; prepare it with `{prepare}`")
