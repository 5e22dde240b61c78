"""Peak memory of starting from a Hugging Face model and pulling it back (issue 76), against its bytes.

Writes a random LlamaForCausalLM directory (config.json, float32 model.safetensors, a small BPE
tokenizer.json)
of TinyLlama 1.1B's shape by default, tensor by tensor; then, each in a fresh process:

* ``import``: ``training.hf_import.import_hf`` (read the directory, stream every tensor into the project's
  float32 initial-weights file, hash it);
* ``export``: ``training.export.export_hf`` of those initial weights back into a LlamaForCausalLM directory,
  from a mapping that reads each tensor from the file when asked, so the step's peak is the export's own
  (``pull`` holds the checkpoint's weights besides it: the model's bytes).

Each reports the process's peak RSS (VmHWM) and its RSS before the step (imports done), so the step's own
peak is their difference, compared with the model's float32 bytes: a streaming import and export each hold
about one tensor (the largest: the embedding or the head).

    python bench/bench_hf_import.py                         # bench/results/hf_import.json
    python bench/bench_hf_import.py --layers 2 --out /tmp/x.json   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.benchio import default_out, write_result  # noqa: E402

SHAPE = {"hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 32, "num_key_value_heads": 4,
         "vocab_size": 32000, "max_position_embeddings": 2048}  # TinyLlama 1.1B (arXiv 2401.02385)


def _reset_peak() -> None:
    """Start VmHWM again from the current RSS (Linux: 5 > /proc/self/clear_refs), so a peak is this step's."""
    Path("/proc/self/clear_refs").write_text("5")


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def make_source(directory: Path, layers: int) -> int:
    """Write the random source model; return its weights' bytes."""
    import torch

    from training.config import ModelConfig
    from training.data import generated_text
    from training.hf_import import stream_safetensors
    from training.model import param_shapes
    from training.tokenizer import train_bpe

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": layers,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
              "hidden_act": "silu", "torch_dtype": "float32", **SHAPE}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    (directory / "tokenizer.json").write_bytes(train_bpe(iter([generated_text(seed=1, n_bytes=50_000)]), 512))
    cfg = ModelConfig(preset="llama-tiny", n_layer=layers, n_embd=SHAPE["hidden_size"],
                      n_head=SHAPE["num_attention_heads"], n_kv_head=SHAPE["num_key_value_heads"],
                      intermediate_size=SHAPE["intermediate_size"], vocab_size=SHAPE["vocab_size"],
                      block_size=SHAPE["max_position_embeddings"])
    shapes = param_shapes(cfg)  # LlamaForCausalLM's names are the project's
    generator = torch.Generator().manual_seed(0)
    with open(directory / "model.safetensors", "wb") as out:
        stream_safetensors(out, shapes, lambda name: torch.randn(shapes[name], generator=generator) * 0.02)
    return (directory / "model.safetensors").stat().st_size


def header_bytes(source: Path) -> int:
    """The safetensors header's size (8 + its length) of the source's weights file."""
    with open(source / "model.safetensors", "rb") as handle:
        return 8 + int.from_bytes(handle.read(8), "little")


def phase_import(source: Path, work: Path) -> dict:
    import torch  # noqa: F401 (imported before the baseline: the step's peak is its own)

    from training.hf_import import import_hf

    _reset_peak()
    before = _status("VmRSS")
    start = time.perf_counter()
    imported = import_hf(source, work / "initial")
    seconds = time.perf_counter() - start
    (work / "fields.json").write_text(json.dumps(imported.fields))
    return {"rss_before_bytes": before, "peak_rss_bytes": _status("VmHWM"), "seconds": round(seconds, 1),
            "written_bytes": imported.weights.stat().st_size}


class LazyWeights(dict):
    """The initial weights file as a mapping that reads each tensor when asked (nothing held): the export's
    own memory is then all the step adds (a node's pull holds the weights besides: the model's bytes)."""

    def __init__(self, reader) -> None:
        super().__init__({name: None for name in reader.keys()})
        self.reader = reader

    def __getitem__(self, name):
        return self.reader.get_tensor(name)


def phase_export(work: Path) -> dict:
    import torch  # noqa: F401 (imported before the baseline)

    from training.config import ModelConfig
    from training.export import export_hf
    from training.hf_import import SafetensorsReader
    from training.tokenizer import load_tokenizer

    cfg = ModelConfig(**json.loads((work / "fields.json").read_text()))
    state = LazyWeights(SafetensorsReader(Path(cfg.init_weights)))
    _reset_peak()
    before = _status("VmRSS")
    start = time.perf_counter()
    out = export_hf(state, cfg, work / "export", tokenizer=load_tokenizer(cfg.tokenizer))
    seconds = time.perf_counter() - start
    return {"rss_before_bytes": before, "peak_rss_bytes": _status("VmHWM"),
            "seconds": round(seconds, 1), "written_bytes": (out / "model.safetensors").stat().st_size,
            "architecture": json.loads((out / "config.json").read_text())["architectures"][0]}


def _child(phase: str, *args: str) -> dict:
    done = subprocess.run([sys.executable, __file__, "--phase", phase, *args], capture_output=True, text=True,
                          check=False)
    if done.returncode:
        raise SystemExit(f"{phase} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=22, help="decoder layers (22: TinyLlama 1.1B)")
    parser.add_argument("--work", default="", help="scratch directory (default: a temporary one, removed)")
    parser.add_argument("--out", default=default_out(__file__))
    parser.add_argument("--phase", choices=["import", "export"], help=argparse.SUPPRESS)
    parser.add_argument("--source", default="", help="an existing source directory written by this script "
                                                      "before (default: write one)")
    args = parser.parse_args(argv)
    if args.phase == "import":
        print(json.dumps(phase_import(Path(args.source), Path(args.work))))
        return 0
    if args.phase == "export":
        print(json.dumps(phase_export(Path(args.work))))
        return 0
    load = list(os.getloadavg())
    work = Path(args.work or tempfile.mkdtemp(prefix="dlx-hf-bench-"))
    try:
        source = Path(args.source) if args.source else work / "source"
        if args.source:
            model_bytes = (source / "model.safetensors").stat().st_size
            args.layers = json.loads((source / "config.json").read_text())["num_hidden_layers"]
        else:
            model_bytes = make_source(source, args.layers)
        params = (model_bytes - header_bytes(source)) // 4  # before a temporary source is removed
        imported = _child("import", "--source", str(source), "--work", str(work))
        exported = _child("export", "--work", str(work))
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    gib = 1024**3

    def summary(step: dict) -> dict:
        own = step["peak_rss_bytes"] - step["rss_before_bytes"]
        return {**step, "step_peak_bytes": own, "step_peak_over_model": round(own / model_bytes, 4)}

    result = {"model": {"architecture": "LlamaForCausalLM", "layers": args.layers, **SHAPE,
                        "params": params, "float32_bytes": model_bytes,
                        "float32_gib": round(model_bytes / gib, 2)},
              "import": summary(imported), "export": summary(exported)}
    path = write_result(args.out, result, load)
    print(json.dumps({k: result[k] for k in ("import", "export")}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
