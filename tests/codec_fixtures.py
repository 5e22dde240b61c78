"""Pseudo-gradient-like inputs for the encoder tests (tests/test_training_encoder_v*.py)."""

from __future__ import annotations

import torch


def stage_like(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """A stage's tensors: decaying spectra plus noise, a zero column, biases, an empty tensor."""
    generator = torch.Generator().manual_seed(seed)

    def lowrank(m: int, n: int) -> torch.Tensor:
        spectrum = torch.logspace(0, -2, min(m, n))
        u, _ = torch.linalg.qr(torch.randn(m, min(m, n), generator=generator))
        v, _ = torch.linalg.qr(torch.randn(n, min(m, n), generator=generator))
        return (u * spectrum) @ v.t() * 0.05 + 1e-4 * torch.randn(m, n, generator=generator)

    tensors = {
        "a.weight": lowrank(128, 384),
        "b.weight": lowrank(512, 128),
        "c.weight": lowrank(128, 128),
        "e.bias": 0.01 * torch.randn(384, generator=generator),
        "f.bias": torch.zeros(128),
        "g.empty": torch.zeros(0),
    }
    tensors["c.weight"][:, 3] = 0.0
    return {name: value * scale for name, value in tensors.items()}


def drift(base: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    """Round ``step``'s pseudo-gradient: the base directions, rescaled, plus fresh noise (as training
    drifts)."""
    noise = stage_like(100 + step)
    return {name: value * (1 + 0.2 * step) + 0.3 * noise[name] for name, value in base.items()}


def shape_map(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {name: tuple(value.shape) for name, value in tensors.items()}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (so -0.0 differs from 0.0, as the weights hash sees it)."""
    return a.dtype == b.dtype and a.shape == b.shape and a.contiguous().view(torch.int32).equal(
        b.contiguous().view(torch.int32))


def encoder_sim(encoder: str, rounds: int):
    """A two-replica, two-stage run of ``tiny`` with start states (training.reexec_sim) coded by
    ``encoder``."""
    from training.config import DilocoConfig, ModelConfig, TrainingConfig
    from training.config_compression import CompressionConfig
    from training.data import generated_corpus
    from training.reexec_sim import SimConfig

    return SimConfig(
        corpus=generated_corpus(seed=0, n_bytes=30_000),
        model=ModelConfig(preset="tiny"),
        training=TrainingConfig(seed=3, batch_size=4, warmup_steps=2),
        diloco=DilocoConfig(inner_steps=3, num_replicas=2),
        compression=CompressionConfig(min_compress_numel=512, encoder=encoder),
        num_stages=2,
        rounds=rounds,
    )


def rerun_replica0(sim, records, outer_round: int):
    """The spot check of replica 0's contribution of ``outer_round`` from the start state it bound."""
    from training.reexec import verify_contribution

    record = records[outer_round]
    return verify_contribution(
        [part.to_bytes() for part in record.states[0].stages], record.claims[0], sim.corpus, sim.model,
        sim.training, sim.diloco, sim.compression, outer_round=outer_round, replica=0, run_rounds=sim.rounds,
        previous_contributions=records[outer_round - 1].contributions if outer_round else None,
    )
