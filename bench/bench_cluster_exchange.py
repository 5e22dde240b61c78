"""Rank 0's memory for a cluster node's exchange: whole contributions scattered, against parts forwarded as
they arrive (issue 75; docs/SCALE.md, "The per-shard exchange of a node that is a cluster").

One stage (a whole ``--preset`` replica, as bench/bench_cluster_memory.py), ``--contributions`` other
replicas' contributions, each a version-2 envelope of ``--parts`` parts (training/cluster_parts.py) stored
whole in a file as a node's blob store keeps it. N = ``--ranks`` spawned processes (gloo, one thread each):

* ``whole`` (what a cluster node does today, training/cluster_outer.py ``_split``): rank 0 reads every
  closed envelope whole (the pool holds them), decodes each, cuts its codec blob along the ranks' plan
  (``split_contribution``) and scatters the pieces (``scatter_object_list``);
* ``parts`` (training/cluster_exchange.py): rank 0 reads each part as a range of the envelope's blob (what a
  holder's range read serves; over the network the part comes from a peer instead, as bytes of the same
  size), checks it against its digest (p2p/parts.py) and forwards its pieces to their ranks
  (``PartForwarder``), ``--streams`` parts at once, keeping none.

The figure is rank 0's peak of Python allocations over the exchange (``tracemalloc``: bytes objects and
buffers, which is where contributions live here; the pickled tensors ``scatter_object_list`` builds are
torch's allocations and are not counted, so ``whole`` is if anything under-counted), beside its peak RSS
(each path runs in fresh processes; RSS includes the interpreter and torch, ``rss_before_bytes`` before the
exchange).
Both paths' messages are checked equal on every rank. Then a round's apply of the same contributions in a
cluster node (``apply``: training/cluster_outer.py's ``finish`` command on FSDP2-sharded replicas, a run
without parts against one in parts, where rank 0 forwards each contribution a part at a time instead of
scattering it): rank 0's peak over the distribution step and over the command, the new weights hash checked
equal. Writes ONE JSON, bench/results/cluster_exchange.json.

    PYTHONPATH=$PWD python bench/bench_cluster_exchange.py [--preset llama-20m] [--ranks 2] [--parts 16]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.benchio import default_out, peak_rss_bytes, write_result  # noqa: E402
from node import protocol as msg  # noqa: E402
from node.live.exchange.parts import part_sizes  # noqa: E402
from p2p.envelope import Envelope, decode_envelope, payload_offset  # noqa: E402
from p2p.identity import Identity  # noqa: E402
from p2p.parts import check_part, cut_at, part_digests  # noqa: E402
from training.cluster_exchange import PartForwarder, receive_shards  # noqa: E402
from training.cluster_parts import exchange_plan  # noqa: E402
from training.cluster_plan import plan_shards, split_contribution  # noqa: E402
from training.compression import encode_contribution  # noqa: E402
from training.config import ModelConfig  # noqa: E402
from training.config_compression import CompressionConfig  # noqa: E402
from training.stages import split_stages, stage_param_shapes  # noqa: E402

MAX_BYTES = 1 << 31


def stage_shapes(preset: str) -> dict[str, tuple[int, ...]]:
    """The shapes of a whole ``preset`` replica as one stage (bench/bench_cluster_memory.py's stage)."""
    cfg = ModelConfig(preset=preset)
    shapes = stage_param_shapes(cfg, split_stages(cfg.n_layer, 1)[0])
    return {name: tuple(shape) for name, shape in shapes.items()}


def contributions(shapes: dict, count: int, codec: bool) -> list[bytes]:
    comp = CompressionConfig() if codec else CompressionConfig(enabled=False)
    out = []
    for replica in range(count):
        generator = torch.Generator().manual_seed(replica)
        tensors = {name: torch.randn(shape, generator=generator) * 1e-3 for name, shape in shapes.items()}
        out.append(encode_contribution(tensors, comp, stage_index=0, outer_round=0)[0])
    return out


def prepare(preset: str, count: int, parts: int, codec: bool, folder: Path) -> list[dict]:
    """Each contribution's envelope file and where its parts lie (blob-relative for the forwarder)."""
    shapes = stage_shapes(preset)
    identity = Identity.from_seed(bytes(32))
    out = []
    for index, blob in enumerate(contributions(shapes, count, codec)):
        body = msg.encode_contribution_body(msg.ContributionBody(bytes(32), bytes(32), blob))
        sizes = part_sizes(body, blob, shapes, parts)
        envelope = Envelope.create(identity, 1, 0, msg.CONTRIBUTION, body, stage=0, replica=index,
                                   part_sizes=sizes)
        path = folder / f"{index}.envelope"
        path.write_bytes(envelope.to_bytes())
        out.append({"path": str(path), "offset": payload_offset(envelope, len(body)), "sizes": sizes,
                    "head": len(body) - len(blob), "digests": part_digests(cut_at(body, sizes)),
                    "bytes": len(envelope.to_bytes())})
    return out


def whole_rank0(items: list[dict], ranks_plan) -> list:
    envelopes = [Path(item["path"]).read_bytes() for item in items]  # the pool holds the closed envelopes
    blobs = [msg.decode_contribution_body(decode_envelope(e, MAX_BYTES).payload).blob for e in envelopes]
    per_rank: list[list[bytes]] = [[] for _ in range(ranks_plan.world)]
    for blob in blobs:
        for rank, part in enumerate(split_contribution(blob, ranks_plan, stage_index=0, outer_round=0)):
            per_rank[rank].append(part)
    received: list = [None]
    dist.scatter_object_list(received, per_rank, src=0)
    return received[0]


def parts_rank0(items: list[dict], parts_plan, ranks_plan, streams: int) -> list:
    forwarder = PartForwarder(parts_plan, ranks_plan, len(items))

    def one(c: int, j: int) -> None:
        item = items[c]
        at = item["offset"] + sum(item["sizes"][:j])
        with open(item["path"], "rb") as handle:
            data = os.pread(handle.fileno(), item["sizes"][j], at)
        check_part(j, data, item["digests"][j], item["sizes"][j])
        forwarder.forward(c, j, data[item["head"]:] if j == 0 else data)

    with ThreadPoolExecutor(max_workers=streams) as pool:
        for future in [pool.submit(one, c, j) for c in range(len(items)) for j in range(parts_plan.world)]:
            future.result()
    return forwarder.shards()[0]


def rank_main(rank: int, world: int, preset: str, items: list[dict], parts: int, streams: int, out: str,
              path: str) -> None:
    """One path (``whole`` or ``parts``) in fresh processes, so that each path's peak RSS is its own."""
    torch.set_num_threads(1)
    shapes = stage_shapes(preset)
    ranks_plan, parts_plan = plan_shards(shapes, world), exchange_plan(shapes, parts)
    rss_before = peak_rss_bytes()
    dist.barrier()
    tracemalloc.start()
    started = time.perf_counter()
    if rank == 0:
        got = whole_rank0(items, ranks_plan) if path == "whole" else \
            parts_rank0(items, parts_plan, ranks_plan, streams)
    elif path == "whole":
        box: list = [None]
        dist.scatter_object_list(box, None, src=0)
        got = box[0]
    else:
        got = receive_shards(parts_plan, ranks_plan, rank, len(items))[0]
    seconds = time.perf_counter() - started
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    torch.save({"peak_traced_bytes": peak, "seconds": seconds, "rss_before_bytes": rss_before,
                "digest": hashlib.sha256(b"".join(got)).hexdigest(), "rss_bytes": peak_rss_bytes()},
               f"{out}.{path}.{rank}")


def apply_rank(rank: int, world: int, preset: str, files: list[str], parts: int, codec: bool, out: str,
               path: str) -> None:
    """A round's apply in a cluster node (training/cluster_outer.py, the ``finish`` command behind
    ``ShardedStageEngine.absorb_round``) on FSDP2-sharded replicas, in fresh processes: ``whole`` the run
    without parts (rank 0 splits every contribution and scatters the pieces), ``parts`` a run with
    ``diloco.exchange_parts`` = ``parts`` (rank 0 forwards each contribution a part at a time). Rank 0
    holds the closed contributions before the apply, as the node's pool does (not counted)."""
    from torch.distributed.device_mesh import init_device_mesh

    from training.cluster_engine import shard_stage_module
    from training.cluster_outer import OuterShard
    from training.config import DilocoConfig
    from training.stages import StageModule

    torch.set_num_threads(1)
    cfg = ModelConfig(preset=preset)
    module = shard_stage_module(StageModule(cfg, split_stages(cfg.n_layer, 1)[0], seed=0),
                                init_device_mesh("cpu", (world,)))
    params = dict(module.named_parameters())
    shapes = {name: tuple(p.shape) for name, p in params.items()}
    assert shapes == stage_shapes(preset), "the module's stage is not the contributions'"
    diloco = DilocoConfig(one_step_delay=False, num_replicas=len(files) + 1,
                          exchange_parts=parts if path == "parts" else 1)
    comp = CompressionConfig() if codec else CompressionConfig(enabled=False)
    shard = OuterShard(0, shapes, diloco, comp, 0, params)
    blobs = [Path(f).read_bytes() for f in files] if rank == 0 else None
    marks = {"before_distribute_peak": 0}
    split = shard._split

    def distribute(*args):  # the contributions to the ranks: scattered whole, or forwarded part by part
        current, marks["before_distribute_peak"] = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        started = time.perf_counter()
        got = split(*args)
        marks["distribute_seconds"] = time.perf_counter() - started
        marks["distribute_peak_bytes"] = tracemalloc.get_traced_memory()[1] - current
        return got

    shard._split = distribute
    rss_before = peak_rss_bytes()
    dist.barrier()
    tracemalloc.start()
    started = time.perf_counter()
    result = shard.run("finish", (0, len(files), {}, True), private=blobs)
    seconds = time.perf_counter() - started
    peak = max(tracemalloc.get_traced_memory()[1], marks.pop("before_distribute_peak"))
    tracemalloc.stop()
    torch.save({**marks, "peak_traced_bytes": peak, "seconds": seconds, "rss_before_bytes": rss_before,
                "rss_bytes": peak_rss_bytes(),
                "weights_hash": None if result is None else result.weights_hash.hex(),
                "accepted": None if result is None else [r.accepted for r in result.contributions]},
               f"{out}.apply.{path}.{rank}")


def measure_apply(args, codec: bool) -> dict:
    """Rank 0's peak over a round's apply, whole contributions scattered against parts forwarded."""
    from training.cluster_launch import run_cluster

    with tempfile.TemporaryDirectory() as folder:
        files = []
        for index, blob in enumerate(contributions(stage_shapes(args.preset), args.contributions, codec)):
            files.append(str(Path(folder) / f"{index}.blob"))
            Path(files[-1]).write_bytes(blob)
        out = str(Path(folder) / "rank")
        for path in ("whole", "parts"):
            run_cluster(apply_rank, args.ranks, args.preset, files, args.parts, codec, out, path,
                        backend="gloo")
        first = {path: torch.load(f"{out}.apply.{path}.0", weights_only=False) for path in ("whole", "parts")}
    assert first["whole"]["weights_hash"] == first["parts"]["weights_hash"], "the two applies differ"
    assert all(first["whole"]["accepted"]), "a contribution was left out"
    return {"rank0": {path: {k: v for k, v in first[path].items() if k not in ("weights_hash", "accepted")}
                      for path in ("whole", "parts")},
            "rank0_ratio": first["parts"]["peak_traced_bytes"] / first["whole"]["peak_traced_bytes"],
            "rank0_distribute_ratio": (first["parts"]["distribute_peak_bytes"]
                                       / first["whole"]["distribute_peak_bytes"]),
            "same_weights_hash": True}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="llama-20m")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--parts", type=int, default=16)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--contributions", type=int, default=3)
    parser.add_argument("--out", default=default_out(__file__))
    args = parser.parse_args()
    from training.cluster_launch import run_cluster

    load = list(os.getloadavg())
    shapes = stage_shapes(args.preset)
    runs = {}
    for label, codec in (("codec", True), ("raw", False)):
        with tempfile.TemporaryDirectory() as folder:
            items = prepare(args.preset, args.contributions, args.parts, codec, Path(folder))
            out = str(Path(folder) / "rank")
            for path in ("whole", "parts"):
                run_cluster(rank_main, args.ranks, args.preset, items, args.parts, args.streams, out, path,
                            backend="gloo")
            ranks = [{path: torch.load(f"{out}.{path}.{rank}", weights_only=False)
                      for path in ("whole", "parts")} for rank in range(args.ranks)]
        assert all(r["whole"]["digest"] == r["parts"]["digest"] for r in ranks), "the two paths differ"
        first = ranks[0]
        runs[label] = {
            "envelope_bytes": [item["bytes"] for item in items],
            "largest_part_bytes": max(max(item["sizes"]) for item in items),
            "rank0": {path: {k: v for k, v in first[path].items() if k != "digest"}
                      for path in ("whole", "parts")},
            "rank0_ratio": first["parts"]["peak_traced_bytes"] / first["whole"]["peak_traced_bytes"],
            "workers_peak_traced_bytes": {path: [r[path]["peak_traced_bytes"] for r in ranks[1:]]
                                          for path in ("whole", "parts")},
            "same_messages_on_every_rank": True,
        }
        print(label, runs[label]["rank0"], f"ratio {runs[label]['rank0_ratio']:.3f}", flush=True)
        runs[label]["apply"] = measure_apply(args, codec)
        apply = runs[label]["apply"]
        print(label, "apply", apply["rank0"], f"ratio {apply['rank0_ratio']:.3f}",
              f"distribute ratio {apply['rank0_distribute_ratio']:.3f}", flush=True)
    write_result(args.out, {
        "preset": args.preset, "params": sum(torch.Size(s).numel() for s in shapes.values()),
        "tensors": len(shapes), "ranks": args.ranks, "parts": exchange_plan(shapes, args.parts).world,
        "streams": args.streams, "contributions": args.contributions, "runs": runs,
    }, load_at_start=load)


if __name__ == "__main__":
    main()
