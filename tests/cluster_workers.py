"""The two sides of the cluster tests (tests/test_cluster_engine.py): a one-process reference and a cluster rank
that run the same rounds on the same inputs. Module-level functions: the spawned ranks import them."""

from __future__ import annotations

import zlib

import msgpack
import torch

from ledger.chunkproof import tree_root
from training.chunks import tensor_leaves
from training.compression import encode_contribution
from training.config import DilocoConfig, ModelConfig
from training.config_compression import CompressionConfig
from training.stage_engine import StageEngine
from training.stages import StageModule, split_stages

ROUNDS = 2


def configs(outer: str = "nesterov") -> tuple[DilocoConfig, CompressionConfig]:
    return (DilocoConfig(one_step_delay=False, num_replicas=3, outer_optimizer=outer, outer_lr=0.7),
            CompressionConfig(bandwidth_budget=0))


def make_module(preset: str = "tiny") -> StageModule:
    cfg = ModelConfig(preset=preset)
    return StageModule(cfg, split_stages(cfg.n_layer, 1)[0], seed=0)


def noise(name: str, shape, outer_round: int, replica: int, scale: float = 0.01) -> torch.Tensor:
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 1000 * outer_round + 17 * replica)
    return torch.mul(torch.randn(tuple(shape), generator=generator), scale)


def others(shapes: dict, outer_round: int) -> list[bytes]:
    """Round ``outer_round``'s other contributions: two honest ones (one large: clipped), one that does not
    decode, one whose last tensor's entry is broken (the last rank's part fails)."""
    comp = CompressionConfig(bandwidth_budget=0)
    blobs = []
    for replica, scale in ((1, 0.01), (2, 0.2)):
        tensors = {name: noise(name, shape, outer_round, replica, scale) for name, shape in shapes.items()}
        blobs.append(encode_contribution(tensors, comp, stage_index=0, outer_round=outer_round)[0])
    message = msgpack.unpackb(blobs[0], raw=False)
    last = message["t"][-1]
    last["s"] = [7, 7]  # a shape the stage's last tensor does not have: wrong_shape, found by the last rank
    broken = msgpack.packb(message, use_bin_type=True)
    return [*blobs, b"not a contribution", broken]


def record(global_weights, momentum) -> dict:
    from training.hashing import stage_weights_hash

    return {"hash": stage_weights_hash(global_weights), "weights_root": tree_root(tensor_leaves(global_weights)),
            "momentum_root": tree_root(tensor_leaves(momentum))}


def reference(outer: str = "nesterov") -> list[dict]:
    """One process, one StageEngine of the whole stage: each round's own blob, record, reports, live weights."""
    dcfg, comp = configs(outer)
    module = make_module()
    params = dict(module.named_parameters())
    engine = StageEngine(0, params, dcfg, comp)
    shapes = {name: tuple(p.shape) for name, p in params.items()}
    out = []
    for outer_round in range(ROUNDS):
        with torch.no_grad():
            for name, param in params.items():
                param.add_(noise(name, param.shape, outer_round, 0))
        own, _ = engine.encode_contribution(outer_round)
        result = engine.apply_round(outer_round, [own, *others(shapes, outer_round)])
        out.append({"own": own, **record(engine.global_weights, engine.momentum),
                    "reports": [(r.index, r.accepted, r.reason, r.norm, r.scale) for r in result.contributions],
                    "live": {name: p.detach().clone() for name, p in params.items()},
                    "momentum": {name: m.clone() for name, m in engine.momentum.items()}})
    return out


def cluster_rank(rank: int, world: int, path: str, outer: str = "nesterov") -> None:
    """The same rounds on a cluster rank; rank 0 saves what the test compares, every rank its state's bytes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from training.cluster_engine import ClusterStageEngine, shard_stage_module

    torch.set_num_threads(1)
    dcfg, comp = configs(outer)
    mesh = init_device_mesh("cpu", (world,))
    module = shard_stage_module(make_module(), mesh)
    engine = ClusterStageEngine(0, module, dcfg, comp)
    shapes = dict(engine.plan.shapes)
    out = []
    for outer_round in range(ROUNDS):
        with torch.no_grad():
            for name, param in engine.live.items():
                full = noise(name, param.shape, outer_round, 0)
                param.to_local().add_(distribute_tensor(full, param.device_mesh, param.placements).to_local())
        part, _ = engine.encode_contribution(outer_round)
        own = engine.gather_contribution(part)
        contributions = [own, *others(shapes, outer_round)] if rank == 0 else None
        applied = engine.apply_round(outer_round, contributions)
        weights_hash = engine.weights_hash()
        roots = engine.chunk_roots()
        live = {name: p.full_tensor().detach().clone() for name, p in engine.live.items()}
        momentum = {name: m.clone() for name, m in engine.engine.momentum.items()}
        out.append({"own": own, "hash": weights_hash, "roots": roots,
                    "reports": [(r.index, r.accepted, r.reason, r.norm, r.scale) for r in applied.reports],
                    "live": live, "momentum": momentum, "tensors": list(engine.own),
                    "state": engine.state_bytes()})
    torch.save(out, f"{path}.{rank}")
