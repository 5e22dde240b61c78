"""What the reproducible mode's cross-platform checks compute in each child (tests/repro_probe.py,
bench/bench_reproducible.py): the weights after two fresh inner steps, and the payload bytes of the codec's
encoders on fixed inputs, each as a short sha256; and the environment of a child under another ATen
instruction set, thread count and ``MKL_CBWR`` path.

The inputs are made without any platform-dependent kernel (token ids from torch's integer generator,
matrices from :mod:`training.portable_rng`'s Philox stream and float64 products of integers), so every
child starts from the same bits.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os

import torch

#: (preset, inner optimizer) trained fresh for two inner steps in every child.
FRESH = (("tiny", "adamw"), ("llama-tiny", "muon"))
ENCODERS = ("v1", "v2", "v3", "v4")
NATIVE = "native"


def trainer_for(preset: str, optimizer: str, reproducible: bool, batch: int, kernels: int = 1):
    """``(model config, LocalReplicaTrainer)`` of ``preset`` from its initial weights (``kernels``: the
    reproducible mode's ``training.reproducible_kernels``)."""
    from training.config import ModelConfig, TrainingConfig
    from training.pipeline import LocalReplicaTrainer

    model_cfg = ModelConfig(preset=preset)
    return model_cfg, LocalReplicaTrainer(model_cfg, TrainingConfig(
        batch_size=batch, optimizer=optimizer, device="cpu", reproducible=reproducible,
        reproducible_kernels=kernels if reproducible else 1))


def digest(tensors) -> str:
    out = hashlib.sha256()
    for tensor in tensors:
        out.update(tensor.detach().contiguous().numpy().tobytes())
    return out.hexdigest()[:16]


def fresh_steps(
    preset: str, optimizer: str, reproducible: bool = True, batch: int = 2, kernels: int = 1
) -> str:
    """sha256 (16 hex) of the weights after two inner steps of ``preset`` from its initial weights."""
    model_cfg, trainer = trainer_for(preset, optimizer, reproducible, batch, kernels)
    generator = torch.Generator().manual_seed(7)
    for _ in range(2):
        x, y = (torch.randint(0, model_cfg.vocab_size, (batch, model_cfg.block_size), generator=generator)
                for _ in range(2))
        trainer.train_step(x, y)
    return digest(trainer.state_dict().values())


def normal(name: str, *shape: int) -> torch.Tensor:
    from training.portable_rng import standard_normal

    return torch.from_numpy(standard_normal(name.encode(), math.prod(shape))).reshape(shape).to(torch.float32)


def codec_inputs() -> dict[str, torch.Tensor]:
    """A stage-like pseudo-gradient: a matrix of rank 6 plus noise (sketched: both sides > 96), a thin
    matrix, a small one (an exact SVD in "v1") and a bias."""
    low = (normal("codec/left", 160, 6).double() @ normal("codec/right", 6, 384).double()).float()
    return {"h.0.attn.weight": torch.add(low, normal("codec/noise", 160, 384) * 0.05),
            "h.0.mlp.weight": normal("codec/thin", 300, 48) * 1e-3,
            "h.0.ln.weight": normal("codec/small", 40, 64), "h.0.ln.bias": normal("codec/bias", 160)}


def codec_bytes(encoder: str, exact: bool = True, rounds: int = 3, budget: int = 12000,
                kernels: int = 3) -> str:
    """sha256 (16 hex) of ``rounds`` contributions of ``encoder`` under a byte budget (with its memo) and
    one to the error budget, encoded as a reproducible run of kernel version ``kernels`` encodes
    (``exact``) or as a run without the mode."""
    from training.codec.registry import encoder_for
    from training.config_compression import CompressionConfig
    from training.exact_codec import ExactCodec

    tensors, coder, out = codec_inputs(), encoder_for(CompressionConfig(encoder=encoder)), hashlib.sha256()
    with ExactCodec(kernels) if exact else contextlib.nullcontext():
        memo = None
        for outer_round in range(rounds):
            blob, _, _, memo = coder.encode_round(tensors, budget, memo, stage_index=0,
                                                  outer_round=outer_round)
            out.update(blob)
        out.update(coder.encode_to_error_budget(tensors, stage_index=0, outer_round=0)[0])
    return out.hexdigest()[:16]


#: Numba's target (kernel version 2's compiled loops) under each ATen capability: "default" compiles for
#: the baseline x86-64 (SSE2, no FMA), "avx2" for Haswell's features (AVX2 and FMA, no AVX-512), the
#: machine's own for the host (here AVX-512).
NUMBA_TARGETS = {
    "default": {"NUMBA_CPU_NAME": "generic"},
    "avx2": {"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES":
             "+sse2,+sse3,+ssse3,+sse4.1,+sse4.2,+popcnt,+avx,+avx2,+fma,+f16c,+bmi,+bmi2,+lzcnt,+movbe"},
}


def child_env(root, capability: str, threads: int, cbwr: str | None) -> dict[str, str]:
    """The environment of a child under ``capability`` (or :data:`NATIVE`), ``threads`` and ``MKL_CBWR``;
    Numba's target follows the capability (:data:`NUMBA_TARGETS`)."""
    drop = ("ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS", "MKL_CBWR", "NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    # PASSIVE: 2 threads on a loaded machine do not spin-wait (on a shared 2-core machine: minutes).
    env.update(PYTHONPATH=str(root), OMP_NUM_THREADS=str(threads), OMP_WAIT_POLICY="PASSIVE")
    if capability != NATIVE:
        env["ATEN_CPU_CAPABILITY"] = capability
        env.update(NUMBA_TARGETS.get(capability, {}))
    if cbwr:
        env["MKL_CBWR"] = cbwr
    return env
