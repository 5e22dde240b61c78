"""A cluster node's rank 0 forwards each part of a contribution to the ranks that own its tensors as it
arrives (training/cluster_exchange.py): real processes (spawn, gloo, CPU), parts in a shuffled order from two
threads; each rank ends with split_contribution's message of its tensors, byte for byte, and a contribution
that never came or whose part does not cut is None with its reason on every rank that owns some of it."""

from __future__ import annotations

import pytest
import torch

from tests import cluster_exchange_workers as exchange_workers
from tests import cluster_workers as workers
from training.cluster_parts import exchange_plan, part_routes
from training.cluster_plan import plan_shards, split_contribution

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("world, parts", [(2, 4)])
def test_rank_0_forwards_each_part_to_its_ranks_and_each_assembles_its_shard(tmp_path, world, parts):
    from training.cluster_launch import run_cluster

    shapes = {name: tuple(p.shape) for name, p in workers.make_module().named_parameters()}
    ranks_plan = plan_shards(shapes, world)
    routes = part_routes(exchange_plan(shapes, parts), ranks_plan)
    assert any(len(route) > 1 for route in routes)  # a part crosses a rank boundary: rank 0 cuts it
    path = str(tmp_path / "rank")
    run_cluster(exchange_workers.forward_rank, world, path, parts, backend="gloo")
    blobs = exchange_workers.blobs()
    last_part_ranks = {rank for rank, _ in routes[-1]}
    for rank in range(world):
        messages, failed = torch.load(f"{path}.{rank}", weights_only=False)
        assert messages[0] == split_contribution(blobs[0], ranks_plan)[rank]
        assert messages[2] == split_contribution(blobs[2], ranks_plan)[rank]
        # rank 0 knows why; the others are told which part failed
        assert messages[1] is None and ("did not come" if rank == 0 else "failed on rank 0") in failed[1]
        if rank in last_part_ranks:  # the junk part's ranks leave contribution 3 out, with its reason
            assert messages[3] is None and "part" in failed[3]
        else:
            assert messages[3] == split_contribution(blobs[0], ranks_plan)[rank]
        assert set(failed) == ({1, 3} if rank in last_part_ranks else {1})
