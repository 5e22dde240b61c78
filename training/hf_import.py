"""Start from a Hugging Face model directory: map its config to a :class:`ModelConfig`, its tensors to ours.

:func:`import_hf` reads ``DIR`` (``config.json``, ``model.safetensors`` or a sharded
``model.safetensors.index.json``, the tokenizer's ``tokenizer.json``) and writes the model's initial
weights as one float32 safetensors file under the project's parameter names, in canonical order, streamed
one tensor at a time (:class:`SafetensorsReader` reads each tensor's bytes with ``readinto``: no second full
copy of the model in memory, and no memory map whose pages would stay resident). The file is named by its
sha256, which the run document gives as ``model.init_weights``; ``training.model.init_state_dict`` then
loads it (:func:`load_init_weights`) instead of drawing random weights, so the genesis root, every
replica's start and the audit's replay of round 0 are these weights.

Supported (:data:`SUPPORTED`), each mapped to the project's families:

* ``LlamaForCausalLM``: grouped-query attention, rope scaling "linear" and Llama 3's "llama3", tied or
  untied embeddings; refused: attention or MLP biases, a head size other than hidden / heads, an
  activation other than silu.
* ``Qwen2ForCausalLM``: the Llama blocks with biases on q, k and v (``model.attention_bias``), its own
  RMSNorm eps.
* ``MistralForCausalLM``: the Llama blocks. Sliding-window attention is supported only where it changes
  nothing: a run's context (``block_size``) no longer than the window (every token then sees every earlier
  one, as in full causal attention); a longer context is refused (so is Qwen2's ``use_sliding_window``).
* ``GPT2LMHeadModel``: gelu_new, LayerNorm eps 1e-5, ``block_size`` = ``n_positions``.

A tied head (``tie_word_embeddings``, or no ``lm_head.weight`` in the files) starts as a copy of the
embedding: pipeline stages keep the embedding in the first stage and the head in the last, so they train
untied, and the export (:func:`exported_files`) writes ``tie_word_embeddings: false`` in the source's
architecture class. Anything else is refused with :class:`HFImportError` naming the architecture.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from training.config import ModelConfig
from training.errors import TrainingError

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "GPT2LMHeadModel")
LLAMA_LIKE = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
#: The source's JSON files the export writes back (the model's config, the generation and tokenizer
#: settings); kept in ``model.hf_source`` with the source's content hashes.
SOURCE_FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "special_tokens_map.json")
#: Buffers some checkpoints hold besides the parameters (GPT-2's causal mask, old rotary caches).
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")
DEFAULT_LLAMA_CONTEXT = 1024  # block_size of an imported Llama-like model unless the run file sets one
INIT_DIR = "initial"  # a node keeps its run's initial weights as <data_dir>/initial/<sha256>.safetensors
#: The source's JSON files ride in the run document (a blob of at most 64 KiB, node/commands/rundocs.py).
MAX_SOURCE_FILES_BYTES = 40 * 1024


def all_finite(tensor: Any) -> bool:
    """``torch.isfinite(tensor).all()`` in pieces of 4M elements: the whole-tensor form holds temporaries of
    about twice the tensor's size (measured on a (32000, 2048) float32 embedding: +430 MB)."""
    return all(bool(piece.isfinite().all()) for piece in tensor.reshape(-1).split(1 << 22))


class HFImportError(TrainingError, ValueError):
    """The directory is not a model this project can start from (the message says why and what is)."""


_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}
MAX_HEADER_BYTES = 100 * 1024 * 1024


class SafetensorsReader:
    """A safetensors file read one tensor at a time into memory of its own (``readinto``; no memory map)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.handle = open(path, "rb")  # noqa: SIM115 (closed by close())
        try:
            size = self.handle.seek(0, os.SEEK_END)
            self.handle.seek(0)
            head = self.handle.read(8)
            (length,) = struct.unpack("<Q", head) if len(head) == 8 else (-1,)
            if not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
                raise ValueError("no safetensors header")
            header = json.loads(self.handle.read(length))
            self.base = 8 + length
            self.entries = {k: v for k, v in header.items() if k != "__metadata__"}
            for name, entry in self.entries.items():
                begin, end = entry["data_offsets"]
                if entry["dtype"] not in _DTYPES or not 0 <= begin <= end <= size - self.base:
                    raise ValueError(f"{name}: dtype {entry['dtype']} or offsets {entry['data_offsets']}")
        except (ValueError, KeyError, TypeError, struct.error) as exc:
            self.handle.close()
            raise HFImportError(f"{path}: not a safetensors file of float tensors ({exc})") from None

    def keys(self) -> list[str]:
        return list(self.entries)

    def get_tensor(self, name: str) -> Any:
        import torch

        entry = self.entries[name]
        begin, end = entry["data_offsets"]
        dtype = getattr(torch, _DTYPES[entry["dtype"]])
        shape = tuple(int(n) for n in entry["shape"])
        count = 1
        for n in shape:
            count *= n
        if count * torch.empty((), dtype=dtype).element_size() != end - begin:
            raise HFImportError(f"{self.path}: {name}: {end - begin} bytes for shape {shape}")
        tensor = torch.empty(shape, dtype=dtype)
        if count:
            self.handle.seek(self.base + begin)
            view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())  # the tensor's own bytes
            if self.handle.readinto(view) != end - begin:
                raise HFImportError(f"{self.path}: {name} is cut short")
        return tensor

    def close(self) -> None:
        self.handle.close()

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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


def _need(config: dict, key: str, kind: type = int) -> Any:
    value = config.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise HFImportError(f"config.json: {key}={value!r}: expected a {kind.__name__}")
    return value


def _rope(config: dict) -> tuple[float, str]:
    """(rope_theta, rope_scaling as canonical JSON or "") from transformers 4's or 5's keys."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise HFImportError(f"config.json: rope parameters {params!r}: expected an object")
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, ""
    if kind == "linear":
        return theta, json.dumps({"factor": float(params["factor"]), "rope_type": "linear"}, sort_keys=True)
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [key for key in keys if key not in params]
        if missing:
            raise HFImportError(f"config.json: llama3 rope scaling lacks {missing}")
        scaling = {key: params[key] for key in keys}
        return theta, json.dumps({**scaling, "rope_type": "llama3"}, sort_keys=True)
    raise HFImportError(f"config.json: rope scaling {kind!r} is not supported (supported: default, linear, "
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
        if block_size not in (0, positions):
            raise HFImportError(f"model.block_size={block_size}: a GPT-2 source's context is its "
                                f"n_positions={positions} (its position table); leave block_size unset")
        return {"family": "gpt2", "preset": "tiny", "vocab_size": _need(config, "vocab_size"),
                "n_layer": _need(config, "n_layer"), "n_head": _need(config, "n_head"), "n_embd": n_embd,
                "block_size": positions}
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
    theta, scaling = _rope(config)
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
    """Whether the source's head is its embedding (``tie_word_embeddings``, or no ``lm_head.weight``)."""
    default = source.architecture in ("GPT2LMHeadModel", "Qwen2ForCausalLM")
    return bool(source.config.get("tie_word_embeddings", default)) or "lm_head.weight" not in source.key_files


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


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def source_digest(source: HFSource) -> str:
    """The source's weights by content: sha256 over each weight file's (name, sha256), in name order."""
    digest = hashlib.sha256()
    for path in sorted(source.weight_files):
        digest.update(f"{path.name}\0{sha256_file(path)}\n".encode())
    return digest.hexdigest()


def stream_safetensors(out: Any, shapes: dict[str, tuple[int, ...]], tensor_of: Any,
                       metadata: dict[str, str] | None = None) -> str:
    """Write a float32 safetensors file to the binary handle ``out``, tensor by tensor in ``shapes``' order
    (``tensor_of(name)`` gives each; only one is held at a time); return the file's sha256."""
    import torch

    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        size = 4 * int(torch.Size(shape).numel())
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    digest = hashlib.sha256()
    for piece in (struct.pack("<Q", len(encoded)), encoded):
        out.write(piece)
        digest.update(piece)
    for name, shape in shapes.items():
        tensor = tensor_of(name)
        if tuple(tensor.shape) != tuple(shape):
            raise HFImportError(f"{name} has shape {tuple(tensor.shape)}, the model needs {tuple(shape)}")
        tensor = tensor.detach().to(device="cpu", dtype=torch.float32).contiguous()
        if not all_finite(tensor):
            raise HFImportError(f"{name} holds NaN or infinite values")
        data = memoryview(tensor.numpy()).cast("B") if tensor.numel() else b""
        out.write(data)
        digest.update(data)
        del tensor, data
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
        return handles[path].get_tensor(names[name])

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


# ---------------------------------------------------------------------- loading and export
_SEARCH_DIRS: list[Path] = []


def add_search_dir(directory: str | os.PathLike) -> None:
    """Look for ``sha256:`` initial weights in ``directory`` too (a node adds ``<data_dir>/initial``)."""
    path = Path(directory)
    if path not in _SEARCH_DIRS:
        _SEARCH_DIRS.append(path)


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
