"""Rank functions for tests/test_cluster_exchange.py (spawned processes import them by name)."""

from __future__ import annotations

import random
import threading

import torch

from p2p.parts import cut_at
from tests import cluster_workers as workers
from training.cluster_exchange import PartForwarder, receive_shards
from training.cluster_parts import blob_cuts, exchange_plan
from training.cluster_plan import plan_shards


def blobs() -> list[bytes]:
    shapes = {name: tuple(p.shape) for name, p in workers.make_module().named_parameters()}
    honest = workers.others(shapes, 0)[:2]
    return [*honest, workers.others(shapes, 1)[0]]


def forward_rank(rank: int, world: int, path: str, parts: int) -> None:
    """Rank 0 forwards contributions 0 and 2 part by part, from 2 threads in a shuffled order, announces 1
    as never come, and a part of 2 as entries that do not cut (3: a junk part); every rank saves what it
    assembled."""
    torch.set_num_threads(1)
    shapes = {name: tuple(p.shape) for name, p in workers.make_module().named_parameters()}
    parts_plan, ranks_plan = exchange_plan(shapes, parts), plan_shards(shapes, world)
    contributions = blobs() + [blobs()[0]]
    if rank != 0:
        torch.save(receive_shards(parts_plan, ranks_plan, rank, len(contributions)), f"{path}.{rank}")
        return
    forwarder = PartForwarder(parts_plan, ranks_plan, len(contributions))
    jobs = [(c, j, piece) for c in (0, 2, 3)
            for j, piece in enumerate(cut_at(contributions[c], blob_cuts(contributions[c], parts_plan)))]
    jobs = [(c, j, b"\x91\xc1" if (c, j) == (3, parts_plan.world - 1) else piece) for c, j, piece in jobs]
    random.Random(5).shuffle(jobs)
    threads = [threading.Thread(target=lambda half: [forwarder.forward(*job) for job in half],
                                args=(jobs[k::2],)) for k in range(2)]
    for thread in threads:
        thread.start()
    forwarder.missing(1, parts_plan.world)
    for thread in threads:
        thread.join()
    torch.save(forwarder.shards(), f"{path}.0")
