"""The two sides of the cluster tests (tests/test_cluster_engine.py): a one-process reference and a
cluster rank that run the same rounds on the same inputs. Module-level functions: the spawned ranks
import them."""

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

    return {"hash": stage_weights_hash(global_weights),
            "weights_root": tree_root(tensor_leaves(global_weights)),
            "momentum_root": tree_root(tensor_leaves(momentum))}


def reference(outer: str = "nesterov") -> list[dict]:
    """One process, one StageEngine of the whole stage: each round's own blob, record, reports, live
    weights."""
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
                    "reports": [(r.index, r.accepted, r.reason, r.norm, r.scale)
                                for r in result.contributions],
                    "live": {name: p.detach().clone() for name, p in params.items()},
                    "momentum": {name: m.clone() for name, m in engine.momentum.items()}})
    return out


def cluster_rank(rank: int, world: int, path: str, outer: str = "nesterov") -> None:
    """The same rounds on a cluster rank; every rank saves what the test compares."""
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


def batches(cfg, outer_round: int, replica: int, steps: int = 2, rows: int = 4) -> list:
    generator = torch.Generator().manual_seed(100 * outer_round + replica)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, cfg.vocab_size, (rows, cfg.block_size + 1), generator=generator)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def replica_run(rank: int, world: int, path: str) -> None:
    """A cluster replica (``world`` ranks, FSDP2 inner steps on real batches, byte budget on) beside an
    ordinary one-process replica (held by rank 0) for two rounds: both apply the same contributions, so
    both must hold the same weights hash each round. Round 1 of the cluster is then rerun from its start
    state on the same ranks: the contribution's bytes must come back."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    from training.cluster_engine import ClusterStageEngine, ClusterTrainer, shard_stage_module
    from training.config import TrainingConfig
    from training.model import lm_loss
    from training.pipeline import make_inner_optimizer

    torch.set_num_threads(1)
    dcfg = DilocoConfig(one_step_delay=False, num_replicas=2, outer_lr=0.7)
    comp = CompressionConfig()  # "auto": a byte budget, split over the ranks
    tcfg = TrainingConfig()
    mesh = init_device_mesh("cpu", (world,))
    module = shard_stage_module(make_module(), mesh)
    trainer = ClusterTrainer(module, tcfg)
    engine = ClusterStageEngine(0, module, dcfg, comp)
    if rank == 0:
        plain = make_module()
        plain_params = dict(plain.named_parameters())
        plain_opt = make_inner_optimizer(plain, tcfg)
        plain_engine = StageEngine(0, plain_params, dcfg, comp)
    out = {"hashes": [], "plain": [], "losses": []}
    saved = None
    initial = {name: value.detach().clone() for name, value in make_module().named_parameters()}
    for outer_round in range(2):
        if outer_round == 1:
            saved = ({n: p.to_local().clone() for n, p in engine.live.items()},
                     copy.deepcopy(trainer.optimizer.state_dict()), engine.engine.state_dict())
        for x, y in batches(module.cfg, outer_round, 0):
            out["losses"].append(trainer.train_step(x, y))
        if outer_round == 0:  # the whole pseudo-gradient, for the one-process verifier's checks (test only)
            local = {n: p.full_tensor().detach().clone() for n, p in engine.live.items()}
            out["pseudo_gradient"] = {n: torch.sub(initial[n], local[n]) for n in local}
        part, _ = engine.encode_contribution(outer_round)
        own = engine.gather_contribution(part)
        if outer_round == 0:
            out["round0"] = own
        if outer_round == 1:
            out["round1"] = own
        other = None
        if rank == 0:
            for x, y in batches(plain.cfg, outer_round, 1):
                plain_opt.zero_grad(set_to_none=True)
                lm_loss(plain(x), y).backward()
                plain_opt.step()
            other, _ = plain_engine.encode_contribution(outer_round)
        engine.apply_round(outer_round, [own, other] if rank == 0 else None)
        out["hashes"].append(engine.weights_hash())
        if rank == 0:
            plain_engine.apply_round(outer_round, [own, other])
            out["plain"].append(plain_engine.weights_hash())
    # the rerun of round 1 from its start state, on the same number of ranks
    locals_, optimizer_state, engine_state = saved
    with torch.no_grad():
        for name, param in engine.live.items():
            param.to_local().copy_(locals_[name])
    trainer.optimizer.load_state_dict(optimizer_state)
    engine.engine.load_state_dict(engine_state)
    for x, y in batches(module.cfg, 1, 0):
        trainer.train_step(x, y)
    part, _ = engine.encode_contribution(1)
    out["rerun1"] = engine.gather_contribution(part)
    torch.save(out, f"{path}.{rank}")
