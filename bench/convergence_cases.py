"""The model cases and exchange shape of the convergence benchmarks (bench/bench_convergence.py,
bench/bench_convergence_ablation.py): one definition, so that both measure the same models."""

from __future__ import annotations

ROUNDS, INNER_STEPS, REPLICAS, STAGES = 30, 50, 2, 2
_LLAMA = dict(preset="llama-mini", n_layer=4, n_head=4, n_kv_head=2, block_size=64)
#: name -> (model fields, per-replica batch, family)
CASES = {
    "gpt2-mini": (dict(preset="mini"), 8, "gpt2"),
    "llama-xs": (dict(_LLAMA, n_embd=32), 1, "llama"),
    "llama-s": (dict(_LLAMA, n_embd=64), 2, "llama"),
    "llama-m": (dict(_LLAMA, n_embd=96, n_layer=5), 4, "llama"),
    "llama-l": (dict(_LLAMA, n_embd=128), 8, "llama"),
}
