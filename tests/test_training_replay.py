"""Bit-exact replay of an aggregation in a second process (what the auditor does)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from training.compression import encode_contribution
from training.config import DilocoConfig
from training.config_compression import CompressionConfig
from training.diloco import aggregate

REPLAY = textwrap.dedent(
    """
    import sys
    import torch
    torch.set_num_threads(int(sys.argv[2]))
    from training.config import DilocoConfig
    from training.diloco import aggregate
    case = torch.load(sys.argv[1])
    _, _, digest = aggregate(case["weights"], case["momentum"], case["contributions"],
                             DilocoConfig(**case["cfg"]), stage_index=1, outer_round=5)
    print(digest.hex())
    """
)


def test_aggregation_replays_bit_exactly_in_another_process(tmp_path):
    g = torch.Generator().manual_seed(7)
    shapes = {"h.1.attn.c_attn.weight": (64, 192), "h.1.mlp.c_fc.weight": (64, 256), "h.1.ln_1.bias": (64,)}
    weights = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    momentum = {n: 0.01 * torch.randn(s, generator=g) for n, s in shapes.items()}
    compression = CompressionConfig(error_budget=0.3, bit_choices=[2, 4, 8, 16], min_compress_numel=1024)
    contributions, codecs = [], set()
    for replica in range(3):
        # Low-rank structure plus noise: the codec picks low-rank entries for the matrices.
        pseudo_gradient = {
            n: 0.01 * (torch.randn(s[0], 2, generator=g) @ torch.randn(2, s[1], generator=g)
                       + 0.1 * torch.randn(s, generator=g)) if len(s) == 2
                else 0.01 * torch.randn(s, generator=g)
            for n, s in shapes.items()
        }
        blob, _, stats = encode_contribution(pseudo_gradient, compression, stage_index=1, outer_round=5)
        contributions.append(blob)
        codecs.update(t.codec for t in stats.tensors)
    assert codecs == {"lowrank", "quant"}
    cfg = dict(outer_lr=0.7, outer_momentum=0.9, nesterov=True)
    _, _, digest = aggregate(weights, momentum, contributions, DilocoConfig(**cfg), stage_index=1,
                             outer_round=5)

    case = tmp_path / "case.pt"
    torch.save({"weights": weights, "momentum": momentum, "contributions": contributions, "cfg": cfg}, case)
    # One intra-op thread there, torch's default (all cores) here.
    replayed = subprocess.run(
        [sys.executable, "-c", REPLAY, str(case), "1"], capture_output=True, text=True, timeout=120,
        check=True
    ).stdout.strip()
    assert replayed == digest.hex()
