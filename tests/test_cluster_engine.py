"""A node that is a cluster (issue 75; training/cluster_*.py, docs/CLUSTER.md): the shard plan, the split and
join of a contribution, roots and norms from shards, the sharded aggregation in one process, and real
2-rank clusters (torch.multiprocessing spawn, gloo, CPU) against one process on the same inputs."""

from __future__ import annotations

import random

import pytest
import torch

from ledger.merkle import merkle_root
from tests import cluster_workers as workers
from training.chunks import cut_payload, tensor_leaves
from training.cluster_merkle import exact_square_sum, norm_of, root_from_frontiers, shard_frontier
from training.cluster_plan import cluster_identity, join_contribution, plan_shards, split_contribution
from training.cluster_robust import round_reports, shard_aggregation, shard_facts
from training.diloco import aggregate_with_report, zero_outer_state
from training.errors import ContributionDecodeError, EngineStateError
from training.robust import contribution_norm


def stage_shapes():
    return {name: tuple(p.shape) for name, p in workers.make_module().named_parameters()}


def test_plan_cuts_whole_tensors_in_chunk_order_and_balances():
    shapes = stage_shapes()
    for world in (1, 2, 3, 4):
        plan = plan_shards(shapes, world)
        assert plan.order == sorted(shapes, key=lambda n: n.encode())
        assert all(plan.names[rank] for rank in range(world))
        assert sum(plan.numel(rank) for rank in range(world)) == plan.numel()
        ranges = [plan.chunk_range(rank) for rank in range(world)]
        assert ranges[0][0] == 0 and ranges[-1][1] == plan.total_chunks
        assert all(ranges[r][1] == ranges[r + 1][0] for r in range(world - 1))
    # the largest shard of the best contiguous cut: no cut of 2 does better than the plan's
    plan = plan_shards(shapes, 2)
    sizes = [plan.numel(0), plan.numel(1)]
    order = plan.order
    best = min(max(sum(torch.Size(shapes[n]).numel() for n in order[:k]),
                   sum(torch.Size(shapes[n]).numel() for n in order[k:])) for k in range(1, len(order)))
    assert max(sizes) == best
    with pytest.raises(EngineStateError, match="every rank holds at least one whole tensor"):
        plan_shards({"a": (4,)}, 2)
    assert cluster_identity(1) == "" and cluster_identity(4) == "fsdp2;ranks=4"


def test_split_and_join_give_back_the_bytes_and_refuse_what_the_decoder_refuses():
    shapes = stage_shapes()
    blob = workers.others(shapes, 0)[0]
    plan = plan_shards(shapes, 3)
    parts = split_contribution(blob, plan, stage_index=0, outer_round=0)
    assert len(parts) == 3 and join_contribution(parts) == blob
    with pytest.raises(ContributionDecodeError, match="not valid msgpack"):
        split_contribution(b"\xc1junk", plan)
    with pytest.raises(ContributionDecodeError, match="for round 0, expected 5"):
        split_contribution(blob, plan, outer_round=5)


@pytest.mark.parametrize("total", [1, 2, 3, 5, 8, 13, 64, 100])
def test_root_from_shard_frontiers_is_the_tree_root(total):
    leaves = [bytes([i % 256, i // 256]) * 3 for i in range(total)]
    rng = random.Random(total)
    for _ in range(6):
        cuts = sorted(rng.sample(range(1, total), min(total - 1, rng.randint(0, 4)))) if total > 1 else []
        bounds = [0, *cuts, total]
        frontiers = [shard_frontier(leaves[a:b], a, total) for a, b in zip(bounds, bounds[1:])]
        assert root_from_frontiers(frontiers, total) == merkle_root(leaves)
        assert all(len(f) <= 2 * total.bit_length() + 2 for f in frontiers)


def test_exact_square_sums_of_shards_add_to_the_whole_norm():
    generator = torch.Generator().manual_seed(3)
    tensors = {f"t{i}": torch.randn(17 * i + 5, generator=generator) * 10.0 ** (i - 3) for i in range(6)}
    parts = [dict(list(tensors.items())[:2]), dict(list(tensors.items())[2:])]
    total = sum(exact_square_sum(part) for part in parts)
    assert norm_of(total) == contribution_norm(tensors)


@pytest.mark.parametrize("outer", ["nesterov", "adam"])
def test_sharded_aggregation_is_the_whole_stage_aggregation_bit_for_bit(outer):
    """In one process: each rank's part decoded, the facts combined, each shard stepped; the tensors, reports,
    hash and chunk leaves are the whole-stage aggregation's."""
    dcfg, comp = workers.configs(outer)
    shapes = stage_shapes()
    generator = torch.Generator().manual_seed(1)
    global_weights = {n: torch.randn(s, generator=generator) for n, s in shapes.items()}
    momentum = zero_outer_state(dcfg, global_weights)
    for outer_round in range(2):
        contributions = workers.others(shapes, outer_round)
        whole = aggregate_with_report(global_weights, momentum, contributions, dcfg, stage_index=0,
                                      outer_round=outer_round, compression_cfg=comp)
        plan = plan_shards(shapes, 3)
        split = []
        for blob in contributions:
            try:
                split.append((split_contribution(blob, plan, stage_index=0, outer_round=outer_round), None))
            except ContributionDecodeError as exc:
                split.append(([None] * 3, exc))
        errors = {j: exc for j, (_, exc) in enumerate(split) if exc is not None}
        facts, decoded = zip(*(shard_facts([parts[r] for parts, _ in split], plan.shard_shapes(r),
                                           stage_index=0, outer_round=outer_round, refuse_raw=True,
                                           split_errors=errors)
                               for r in range(3)))
        reports = round_reports(list(facts), dcfg)
        assert [(r.index, r.accepted, r.reason, r.norm, r.scale) for r in reports] == [
            (r.index, r.accepted, r.reason, r.norm, r.scale) for r in whole.contributions]
        assert [r.reason for r in reports] == ["", "", "undecodable", "wrong_shape"]
        assert reports[1].scale < 1.0  # the large one is clipped
        new_global, new_momentum = {}, {}
        for rank in range(3):
            names = plan.names[rank]
            shard = shard_aggregation({n: global_weights[n] for n in names}, {n: momentum[n] for n in names},
                                      decoded[rank], reports, dcfg, outer_round)
            new_global.update(shard.new_global)
            new_momentum.update(shard.new_momentum)
        for name in shapes:
            assert torch.equal(new_global[name].view(torch.int32), whole.new_global[name].view(torch.int32))
            assert torch.equal(new_momentum[name].view(torch.int32),
                               whole.new_momentum[name].view(torch.int32))
        leaves = []
        for rank in range(3):
            names = plan.names[rank]
            leaves += tensor_leaves({n: new_global[n] for n in names}, first_tensor=plan.tensor_base(rank))
        assert leaves == tensor_leaves(whole.new_global)
        pieces = [piece for rank, part in enumerate(split[0][0])
                  for piece in cut_payload(part, plan.shard_shapes(rank))]
        assert pieces == cut_payload(contributions[0], shapes)
        global_weights, momentum = whole.new_global, whole.new_momentum


@pytest.mark.parametrize("outer", ["nesterov", pytest.param("adam", marks=pytest.mark.slow)])
def test_two_rank_cluster_gives_the_one_process_bits(tmp_path, outer):
    """A real 2-rank cluster (spawn, gloo, FSDP2) and one process run the same two rounds on the same
    inputs: the own contribution, the reports, the weights hash, the chunk roots (from frontiers), the
    momentum and the live weights written back into the FSDP shards are the same bits."""
    from training.cluster_launch import run_cluster

    expected = workers.reference(outer)
    path = str(tmp_path / "rank")
    run_cluster(workers.cluster_rank, 2, path, outer, backend="gloo")
    ranks = [torch.load(f"{path}.{rank}", weights_only=False) for rank in range(2)]
    for outer_round, want in enumerate(expected):
        got = ranks[0][outer_round]
        assert got["own"] == want["own"]
        assert got["hash"] == want["hash"]
        assert got["roots"] == (want["weights_root"], want["momentum_root"])
        assert got["reports"] == want["reports"]
        for name, value in want["live"].items():
            assert torch.equal(got["live"][name].view(torch.int32), value.view(torch.int32)), name
        held = [set(ranks[r][outer_round]["tensors"]) for r in range(2)]
        assert held[0].isdisjoint(held[1]) and held[0] | held[1] == set(want["momentum"])
        for rank in range(2):
            for name, value in ranks[rank][outer_round]["momentum"].items():
                assert torch.equal(value.view(torch.int32), want["momentum"][name].view(torch.int32)), name
        assert ranks[1][outer_round]["hash"] is None and ranks[1][outer_round]["roots"] is None


def test_the_fingerprint_records_the_cluster_and_another_n_is_another_platform():
    import dataclasses

    from training.fingerprint import (
        RULE_CROSS_PLATFORM,
        RULE_SAME_PLATFORM,
        compare_rerun,
        fingerprint,
        parse_fingerprint,
    )
    from training.errors import PlatformError

    single = fingerprint(torch.device("cpu"), "fp32")
    assert "cluster" not in single.document()  # one process: the bytes every fingerprint had
    two = fingerprint(torch.device("cpu"), "fp32", cluster=cluster_identity(2))
    assert two.document()["cluster"] == "fsdp2;ranks=2" and parse_fingerprint(two.document()) == two
    assert "cluster (fsdp2;ranks=2)" in two.describe()
    for bad in ("", "fsdp2;ranks=1", "fsdp2;ranks=02", "ddp;ranks=2"):
        with pytest.raises(PlatformError, match="cluster"):
            parse_fingerprint({**two.document(), "cluster": bad})
    same = compare_rerun(two, dataclasses.replace(two), 0.0, claimed_threads=1, rerun_threads=1)
    assert same.rule == RULE_SAME_PLATFORM and same.verdict == "exact"
    fewer = compare_rerun(two, single, 5e-3, claimed_threads=1, rerun_threads=1, reproducible=True)
    assert fewer.rule == RULE_CROSS_PLATFORM and fewer.verdict == "undecided"


@pytest.mark.slow
def test_a_cluster_replica_trains_beside_an_ordinary_one_and_reruns_bit_exactly(tmp_path):
    """2 ranks train real batches under FSDP2 with a byte budget split over them; an ordinary replica applies
    the same contributions and holds the same weights each round; the cluster's round 1 rerun from its start
    state on 2 ranks gives the same contribution bytes."""
    from training.cluster_launch import run_cluster

    path = str(tmp_path / "rank")
    run_cluster(workers.replica_run, 2, path, backend="gloo")
    got = torch.load(f"{path}.0", weights_only=False)
    assert got["hashes"] == got["plain"] and len(set(got["hashes"])) == 2
    assert all(loss == loss and loss > 0 for loss in got["losses"])
    assert got["round1"] is not None and got["rerun1"] == got["round1"]
    # A verifier of one process: the claimant's plan encodes the cluster's pseudo-gradient to its bytes, and
    # the round's inner steps emulated in one process land within the tolerance rule's reach.
    from training.cluster_verify import ShardedEncoder, emulated_inner_step
    from training.config import DilocoConfig, TrainingConfig
    from training.config_compression import CompressionConfig
    from training.fingerprint import MISMATCH, compare_rerun, fingerprint
    from training.pipeline import make_inner_optimizer
    from training.reexec_distance import contribution_distance, relative_l2

    dcfg, comp = DilocoConfig(one_step_delay=False, num_replicas=2, outer_lr=0.7), CompressionConfig()
    shapes = {name: tuple(value.shape) for name, value in got["pseudo_gradient"].items()}
    encoder = ShardedEncoder(shapes, 2, dcfg, comp)
    assert encoder.compress(got["pseudo_gradient"], stage_index=0, outer_round=0) == got["round0"]
    module = workers.make_module()
    initial = {name: value.detach().clone() for name, value in module.named_parameters()}
    optimizer = make_inner_optimizer(module, TrainingConfig())
    for x, y in workers.batches(module.cfg, 0, 0):
        emulated_inner_step(module, optimizer, x, y, 2, TrainingConfig().grad_clip)
    rerun = {name: torch.sub(initial[name], value.detach()) for name, value in module.named_parameters()}
    assert relative_l2(rerun, got["pseudo_gradient"]) < 1e-5
    blob = ShardedEncoder(shapes, 2, dcfg, comp).compress(rerun, stage_index=0, outer_round=0)
    distance = contribution_distance(got["round0"], blob, shapes, stage_index=0, outer_round=0)
    claimed = fingerprint(torch.device("cpu"), "fp32", cluster=cluster_identity(2))
    verdict = compare_rerun(claimed, fingerprint(torch.device("cpu"), "fp32"), distance, claimed_threads=1,
                            rerun_threads=1)
    assert verdict.verdict != MISMATCH, verdict.reason
