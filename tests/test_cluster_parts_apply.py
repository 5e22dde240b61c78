"""A cluster node's apply in a run in parts (``diloco.exchange_parts`` > 1; issue 75, docs/SCALE.md "The
per-shard exchange of a node that is a cluster"): rank 0 no longer scatters whole contributions; it checks
each as the split did and forwards its parts one at a time (training/cluster_exchange.py
``forward_to_ranks``). Real processes (gloo, CPU): the rounds' reports, weights hash, global weights and
momentum equal the one-process engine's bits, with contributions that decode, one that is no message, one
whose last tensor has a wrong shape (only the last rank finds it), one of another round (refused by the
header check) and one in another layout (its entries first: taken as the split takes it)."""

from __future__ import annotations

import msgpack
import pytest
import torch

import training.cluster_outer as cluster_outer

pytestmark = pytest.mark.timeout(300)


def _same(a, b) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _contributions(shapes: dict, compression, outer_round: int, generator) -> list[bytes]:
    from training.compression import encode_contribution

    def noise(scale: float) -> dict:
        return {n: torch.randn(s, generator=generator) * scale for n, s in shapes.items()}

    honest = [encode_contribution(noise(scale), compression, stage_index=0, outer_round=outer_round)[0]
              for scale in (1e-3, 2e-3, 5e-2)]
    message = msgpack.unpackb(honest[0], raw=False)
    broken = {**message, "t": [*message["t"][:-1], {**message["t"][-1], "s": [7, 7]}]}
    entries_first = msgpack.unpackb(honest[1], raw=False)
    entries_first = {"t": entries_first.pop("t"), **entries_first}
    other_round = encode_contribution(noise(1e-3), compression, stage_index=0, outer_round=outer_round + 1)[0]
    return [honest[0], b"\x93junk", msgpack.packb(broken, use_bin_type=True), honest[2], other_round,
            msgpack.packb(entries_first, use_bin_type=True)]


def test_a_cluster_node_in_parts_forwards_contributions_and_applies_as_one_process(monkeypatch):
    from training.cluster_replica import ClusterReplicaTrainer
    from training.config import DilocoConfig, ModelConfig
    from training.config_compression import CompressionConfig
    from training.config_training import TrainingConfig
    from training.model import init_state_dict
    from training.pipeline import LocalReplicaTrainer
    from training.stage_engine import StageEngine

    calls = {"split": 0, "forward": 0}

    def spy(name, real):
        def call(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(cluster_outer, "split_to_ranks", spy("split", cluster_outer.split_to_ranks))
    monkeypatch.setattr(cluster_outer, "forward_to_ranks", spy("forward", cluster_outer.forward_to_ranks))
    model, training = ModelConfig(), TrainingConfig(device="cpu", batch_size=4)
    diloco = DilocoConfig(inner_steps=2, one_step_delay=False, exchange_parts=4)
    compression = CompressionConfig(bandwidth_budget=0)
    full = init_state_dict(model, 0)
    cluster = ClusterReplicaTrainer(model, training, 2, full, timeout_s=300, threads=1)
    try:
        engine = cluster.outer_engine(0, diloco, compression)
        assert engine.shard.parts_plan is not None and len(engine.shard.parts_plan.names) == 4
        plain = LocalReplicaTrainer(model, training, 1, state_dict=full)
        ref = StageEngine(0, dict(plain.stage_modules[0].named_parameters()), diloco, compression)
        generator = torch.Generator().manual_seed(3)
        for outer_round in range(2):
            contributions = _contributions(ref.shapes, compression, outer_round, generator)
            ours = engine.absorb_round(outer_round, contributions, excluded={3: "screened"})
            theirs = ref.absorb_round(outer_round, contributions, excluded={3: "screened"})
            got = [(r.index, r.accepted, r.reason, r.norm, r.scale) for r in ours.contributions]
            assert got == [(r.index, r.accepted, r.reason, r.norm, r.scale) for r in theirs.contributions]
            assert [r.accepted for r in ours.contributions] == [True, False, False, False, False, True]
            reasons = [r.reason for r in ours.contributions]
            assert reasons[1:5] == ["undecodable", "wrong_shape", "screened", "undecodable"]
            assert "for round" in ours.contributions[4].detail  # the header check's own error, on every rank
            assert ours.weights_hash == theirs.weights_hash == ref.weights_hash()
            assert _same(dict(engine.global_weights), ref.global_weights)
            assert _same(dict(engine.momentum), ref.momentum)
        assert calls == {"split": 0, "forward": 2}  # no whole-contribution scatter in a run in parts
    finally:
        cluster.close()
