"""docs/RESULTS.md's section on starting from a Hugging Face model and pulling it back (issue 76)."""

from __future__ import annotations

from results_sections import table


def _gb(x) -> str:
    return "-" if x is None else f"{x / 2**30:.2f} GiB"


def _mb(x) -> str:
    return "-" if x is None else f"{x / 2**20:.0f} MiB"


def hf_import(r: dict) -> list[str]:
    """Peak memory of import and export against the model's bytes (bench_hf_import.py)."""
    m = r["model"]
    rows = [[step, _mb(r[key]["rss_before_bytes"]), _mb(r[key]["peak_rss_bytes"]),
             _mb(r[key]["step_peak_bytes"]), f"{100 * r[key]['step_peak_over_model']:.1f}%",
             _gb(r[key]["written_bytes"]), f"{r[key]['seconds']} s"]
            for step, key in (("import (training/hf_import.py)", "import"),
                              ("export (training/export.py)", "export"))]
    return [(
        f"A random {m['architecture']} of TinyLlama 1.1B's shape ({m['layers']} layers, hidden "
        f"{m['hidden_size']}, {m['num_attention_heads']} heads / {m['num_key_value_heads']} key-value "
        f"heads, vocabulary {m['vocab_size']:,}): {m['params'] / 1e9:.2f} billion parameters, "
        f"{_gb(m['float32_bytes'])} of float32 weights. Each step in a fresh process; its peak is the "
        "process's peak RSS (VmHWM, reset before the step) less its RSS before the step (Python, torch "
        "and the project imported). The import reads the directory and writes the initial-weights file "
        "one tensor at a time; the export reads the weights from a mapping that loads each tensor when "
        "asked (a pull holds the checkpoint's weights besides: the model's bytes), so each step's own "
        "peak is about its largest tensor (the embedding or the head, 250 MiB here)."), ""] + table(
        ["step", "RSS before", "peak RSS", "the step's peak", "of the model's bytes", "written", "time"],
        rows)
