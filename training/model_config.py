"""The model's configuration (``[model]``): the families, the size presets and :class:`ModelConfig`.

Plain dataclasses with no torch import (training/config.py re-exports them).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from training.config_base import DEFAULT_RANDOM, LEGACY_RANDOM, RandomSource, _require

FAMILIES = ("gpt2", "llama")
BYTES_TOKENIZER = "bytes"

MODEL_PRESETS: dict[str, dict[str, int | str]] = {
    # GPT-2 (training/gpt2.py). ~43k parameters: unit and integration tests.
    "tiny": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32},
    # ~0.87M parameters: demo runs on 2 CPU cores.
    "mini": {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64},
    # ~2.8M parameters: benchmarks.
    "small": {"n_layer": 6, "n_head": 6, "n_embd": 192, "block_size": 128},
    # Llama (training/llama.py). Parameter counts (README "Llama family") depend on the
    # vocabulary, which is the tokenizer's: the names give the size at the vocabulary each is
    # meant for (llama-20m at an 8192-token BPE, the larger ones at 32000). Without
    # intermediate_size, the SwiGLU width follows Llama's rule (ModelConfig._resolve_llama).
    "llama-tiny": {"family": "llama", "n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 32,
                   "intermediate_size": 64, "block_size": 32},
    # mini's blocks in Llama's form: the convergence benchmark on 2 CPU cores (~2.6M parameters at
    # an 8192-token BPE, most of them in the untied embedding and head).
    "llama-mini": {"family": "llama", "n_layer": 4, "n_head": 4, "n_kv_head": 2, "n_embd": 128,
                   "block_size": 128},
    "llama-20m": {"family": "llama", "n_layer": 8, "n_head": 6, "n_kv_head": 2, "n_embd": 384,
                  "block_size": 256},
    # Between llama-20m and llama-124m: the largest preset the whole system runs at on a 24 GB machine with
    # four nodes (issue 75, docs/SCALE.md); 62.9M parameters at 32000.
    "llama-60m": {"family": "llama", "n_layer": 10, "n_head": 8, "n_kv_head": 2, "n_embd": 512,
                  "block_size": 512},
    # GPT-2 small's width and depth, Llama's blocks.
    "llama-124m": {"family": "llama", "n_layer": 12, "n_head": 12, "n_kv_head": 4, "n_embd": 768,
                   "block_size": 1024},
    "llama-350m": {"family": "llama", "n_layer": 24, "n_head": 16, "n_kv_head": 8, "n_embd": 1024,
                   "block_size": 1024},
    # TinyLlama 1.1B's shape (arXiv 2401.02385).
    "llama-1b": {"family": "llama", "n_layer": 22, "n_head": 32, "n_kv_head": 4, "n_embd": 2048,
                 "block_size": 2048},
}
DEFAULT_ROPE_THETA = 10000.0
# Settings only the Llama family has; a GPT-2 configuration leaves them at these values, and its
# run document omits them (so the hash of every GPT-2 run stays what it was).
LLAMA_ONLY = {"n_kv_head": 0, "intermediate_size": 0, "rope_theta": 0.0}
# Settings a model imported from a Hugging Face directory may need (training/hf_import.py); a run document
# omits each while it is at this neutral value, so the hash of every earlier run stays what it was.
# The first three are the Llama family's (Qwen2's q/k/v biases, its RMSNorm eps, Llama 3's rope scaling).
IMPORT_ONLY = {"attention_bias": False, "rms_norm_eps": 0.0, "rope_scaling": "", "init_weights": "",
               "hf_source": ""}
LLAMA_IMPORT_ONLY = ("attention_bias", "rms_norm_eps", "rope_scaling")
DEFAULT_RMS_NORM_EPS = 1e-5
ROPE_TYPES = ("default", "linear", "llama3")


def preset_family(preset: str) -> str:
    """The model family a preset belongs to."""
    return str(MODEL_PRESETS[preset].get("family", "gpt2"))


@dataclass
class ModelConfig:
    """A decoder-only language model. ``preset`` fills the size fields left at 0.

    ``family`` picks the architecture (``training.model.FAMILIES``): ``gpt2`` (the default,
    training/gpt2.py) or ``llama`` (training/llama.py: RMSNorm, rotary positions, SwiGLU,
    grouped-query attention). Empty: the preset's family. ``n_kv_head``, ``intermediate_size``
    and ``rope_theta`` are Llama's (0: the preset's, else ``n_head``, the SwiGLU width rule
    and 10000). ``tokenizer`` is ``"bytes"`` (token id = byte value, vocabulary 256), the
    path of a Hugging Face ``tokenizers`` JSON file, or ``"sha256:<hex>"`` naming such a file
    by its content (training/tokenizer.py); ``vocab_size`` must hold its ids.
    """

    preset: str = "tiny"
    vocab_size: int = 256  # byte-level tokenizer
    n_layer: int = 0
    n_head: int = 0
    n_embd: int = 0
    block_size: int = 0
    dropout: float = 0.0
    family: str = ""
    n_kv_head: int = 0
    intermediate_size: int = 0
    rope_theta: float = 0.0
    tokenizer: str = BYTES_TOKENIZER
    # Where the initial weights come from (RandomSource): "philox" (the same bits on every machine) for a
    # configuration that names none; a run document that names none is an older run's, drawn by "torch"
    # (node.runconfig.node_config_from_run), which it keeps so that it still audits.
    init: str = DEFAULT_RANDOM.value
    # An imported model (training/hf_import.py): Qwen2's biases on q, k and v; the RMSNorm eps (0: 1e-5); the
    # rope scaling as canonical JSON ("": none; "linear" or Llama 3's "llama3"); the initial weights (a
    # safetensors file of this model's tensors, by path or "sha256:<hex>", instead of a random draw); the
    # source's config.json as canonical JSON (export writes the source's architecture class from it).
    attention_bias: bool = False
    rms_norm_eps: float = 0.0
    rope_scaling: str = ""
    init_weights: str = ""
    hf_source: str = ""

    def __post_init__(self) -> None:
        sources = [source.value for source in RandomSource]
        _require(self.init in sources, f"model.init={self.init!r}: must be one of {sources} "
                                          "(\"philox\": the same initial weights on every machine)")
        self.init = RandomSource(self.init).value  # a plain str, as TOML and the run document hold it
        _require(
            self.preset in MODEL_PRESETS,
            f"model.preset={self.preset!r}: must be one of {list(MODEL_PRESETS)}",
        )
        preset_fam = preset_family(self.preset)
        if not self.family:
            self.family = preset_fam
        _require(self.family in FAMILIES, f"model.family={self.family!r}: must be one of {list(FAMILIES)}")
        _require(
            self.family == preset_fam,
            f"model.preset={self.preset!r} is a {preset_fam} preset but model.family={self.family!r}: use "
            f"one of {[name for name in MODEL_PRESETS if preset_family(name) == self.family]}",
        )
        for name, value in MODEL_PRESETS[self.preset].items():
            if name != "family" and getattr(self, name) == 0:
                setattr(self, name, value)
        for name in ("vocab_size", "n_layer", "n_head", "n_embd", "block_size"):
            _require(getattr(self, name) >= 1, f"model.{name}={getattr(self, name)}: must be >= 1")
        _require(
            self.n_embd % self.n_head == 0,
            f"model.n_embd={self.n_embd} is not divisible by model.n_head={self.n_head}: "
            "pick n_embd as a multiple of n_head",
        )
        _require(0.0 <= self.dropout < 1.0, f"model.dropout={self.dropout}: must be in [0, 1)")
        _require(
            isinstance(self.tokenizer, str) and self.tokenizer.strip() != "",
            f'model.tokenizer={self.tokenizer!r}: must be "bytes", a tokenizer.json path or "sha256:<hex>"',
        )
        if self.tokenizer.startswith("sha256:"):
            digest = self.tokenizer[len("sha256:"):]
            _require(
                len(digest) == 64 and all(c in "0123456789abcdef" for c in digest),
                f"model.tokenizer={self.tokenizer!r}: after 'sha256:' give 64 lowercase hex digits",
            )
        self._check_import_settings()
        if self.family == "llama":
            self._resolve_llama()
        else:
            for name in LLAMA_IMPORT_ONLY:
                _require(
                    getattr(self, name) == IMPORT_ONLY[name],
                    f"model.{name}={getattr(self, name)!r} is a setting of the llama family; model.family is "
                    f"{self.family!r}: remove it",
                )
            for name, neutral in LLAMA_ONLY.items():
                _require(
                    getattr(self, name) == neutral,
                    f"model.{name}={getattr(self, name)} is a setting of the llama family; model.family is "
                    f"{self.family!r}: remove it or use a llama-* preset",
                )

    def _resolve_llama(self) -> None:
        if self.n_kv_head == 0:
            self.n_kv_head = self.n_head
        if self.intermediate_size == 0:
            # Llama's rule: 2/3 of 4C (SwiGLU has three matrices where GPT-2's MLP has two),
            # rounded up to a multiple of 256.
            self.intermediate_size = -(-(8 * self.n_embd // 3) // 256) * 256
        if self.rope_theta == 0:
            self.rope_theta = DEFAULT_ROPE_THETA
        _require(
            1 <= self.n_kv_head <= self.n_head and self.n_head % self.n_kv_head == 0,
            f"model.n_kv_head={self.n_kv_head}: must divide model.n_head={self.n_head} (grouped-query "
            "attention shares each key/value head among n_head / n_kv_head query heads)",
        )
        _require(
            (self.n_embd // self.n_head) % 2 == 0,
            f"model.n_embd / model.n_head = {self.n_embd // self.n_head}: the head size must be even for "
            "rotary position embeddings",
        )
        _require(
            self.intermediate_size >= 1, f"model.intermediate_size={self.intermediate_size}: must be >= 1"
        )
        _require(
            math.isfinite(self.rope_theta) and self.rope_theta > 1,
            f"model.rope_theta={self.rope_theta}: must be a finite base > 1 (10000 is Llama 2's)",
        )

    def _check_import_settings(self) -> None:
        import json

        _require(isinstance(self.attention_bias, bool), f"model.attention_bias={self.attention_bias!r}: "
                                                        "true or false")
        _require(self.rms_norm_eps == 0 or 0 < self.rms_norm_eps < 1,
                 f"model.rms_norm_eps={self.rms_norm_eps}: must be in (0, 1) (0: 1e-5)")
        for name in ("rope_scaling", "init_weights", "hf_source"):
            _require(isinstance(getattr(self, name), str), f"model.{name} must be a string")
        if self.rope_scaling:
            try:
                rope = json.loads(self.rope_scaling)
            except ValueError:
                rope = None
            _require(isinstance(rope, dict) and rope.get("rope_type") in ROPE_TYPES,
                     f"model.rope_scaling={self.rope_scaling[:80]!r}: must be a JSON object whose rope_type "
                     f"is one of {list(ROPE_TYPES)}")
            needed = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                                         "original_max_position_embeddings")}
            for key in needed.get(rope["rope_type"], ()):
                value = rope.get(key)
                _require(isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0,
                         f"model.rope_scaling: {rope['rope_type']} needs a positive number {key!r}")
        if self.hf_source:
            try:
                parsed = json.loads(self.hf_source)
            except ValueError:
                parsed = None
            _require(isinstance(parsed, dict),
                     "model.hf_source: must be a JSON object (the source directory's config files by name)")

    @property
    def norm_eps(self) -> float:
        """The RMSNorm eps (Llama family): ``rms_norm_eps``, or 1e-5 when it is 0."""
        return self.rms_norm_eps or DEFAULT_RMS_NORM_EPS

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def byte_level(self) -> bool:
        """True when the tokenizer is the built-in byte-level one."""
        return self.tokenizer == BYTES_TOKENIZER

    def document(self) -> dict:
        """The settings as plain data, without those that do not apply to the family.

        A GPT-2 configuration with the byte tokenizer gives exactly the fields it had before
        families and tokenizers existed, so run documents (and config hashes) of such runs do
        not change. ``tokenizer`` is returned as configured: the run document replaces a path
        by ``sha256:<hex>`` (node/runconfig.py). ``init`` only when it is not the legacy
        generator: a run document from before ``model.init`` rebuilds to the same bytes.
        """
        out = dataclasses.asdict(self)
        if self.init == LEGACY_RANDOM:
            del out["init"]
        for name, neutral in IMPORT_ONLY.items():
            if out[name] == neutral:
                del out[name]
        if self.family == "gpt2":
            del out["family"]
            for name in LLAMA_ONLY:
                del out[name]
            if self.byte_level:
                del out["tokenizer"]
        return out
