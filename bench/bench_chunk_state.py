"""Time to build a stage's chunk state vs. the aggregation itself, at `mini` stage sizes (issue 43 item 1).

In a chunked run (docs/FRAUD_PROOF.md) every node, after a stage's outer step, derives the stage's chunk state
(the run's commitment scheme's stage_state_of, node/commitments/: the weights' and momentum's chunk leaves,
each accepted contribution's payload pieces, their Merkle roots, the stage leaf) and serializes the stage's
state to publish it (node/live/fraud/chunkstate.py); a prover that fetched a committed state checks its chunk
roots. This bench times each of those beside the aggregation (training/diloco.py ``aggregate_with_report``) of
the same contributions, for both stages of `mini` (2 stages) and 2, 4 and 8 contributions coded by the run's
default encoder at the "auto" byte budget (H = 50, M = 2: what a demo sends).

Each row is measured for both fraud-provable versions: version 2 (``diloco.commitments = "chunked"``: the
row's plain keys, whose stage leaf is comparable with older results) and version 3 (``"normed"``, the default
since it became "auto"'s: keys ``normed_*``), which also decodes each accepted contribution once more and sums
its chunks' squares exactly (node.fraudproof.stage_norms) and serves the factors and sum-tree leaves
(ledger.normproof.encode_norm_state) beside the state: ``normed_norms_s`` is that part alone (of the first
contribution: ``normed_decode_s`` its second decode, ``normed_squares_s`` its exact sums, ``normed_tree_s``
its sum tree), ``normed_state_and_leaf_s`` the whole state, ``normed_served_bytes`` the norm blob,
``normed_encode_s`` its encoding.

The result goes to ``bench/results/chunk_state.json``. Figures are CPU seconds of this process
(time.process_time, one torch thread, the least of ``--repeat``), so other jobs' load inflates them only
through shared caches. Each row carries the stage leaf (hex), so two runs (before and after a change of the
leaves' code) show that the commitments are bit-identical.

    nice -n 10 python bench/bench_chunk_state.py [--before /tmp/before.json --before-label "commit ..."]

``--before FILE``: a result of this script on an older tree (``--out /tmp/before.json`` there), kept under
``before`` (its rows, ``recorded`` and ``--before-label``), with each row's speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.benchio import default_out, write_result  # noqa: E402
from ledger.chunkproof import tree_root  # noqa: E402
from ledger.normproof import SumTree, encode_norm_state  # noqa: E402
from node.commitments import stage_state  # noqa: E402
from node.fraudproof import chunk_square_sums, stage_norms  # noqa: E402
from node.store.checkpoint import Checkpoint  # noqa: E402
from training.chunks import tensor_leaves  # noqa: E402
from training.codec_wire import decode_declared  # noqa: E402
from training.compression import encode_within_bandwidth  # noqa: E402
from training.config import DilocoConfig, ModelConfig  # noqa: E402
from training.config_compression import CompressionConfig  # noqa: E402
from training.diloco import aggregate_with_report  # noqa: E402
from training.stages import split_stages, stage_param_shapes  # noqa: E402

PRESET, STAGES, INNER_STEPS, REPLICAS = "mini", 2, 50, 2


def _best(fn, repeat: int):
    best, value = float("inf"), None
    for _ in range(repeat):
        started = time.process_time()
        value = fn()
        best = min(best, time.process_time() - started)
    return best, value


def measure(stage: int, count: int, repeat: int) -> dict:
    model_cfg = ModelConfig(preset=PRESET)
    shapes = stage_param_shapes(model_cfg, split_stages(model_cfg.n_layer, STAGES)[stage])
    numel = sum(torch.Size(shape).numel() for shape in shapes.values())
    generator = torch.Generator().manual_seed(100 + stage)
    weights = {name: torch.randn(*shape, generator=generator) * 0.02 for name, shape in shapes.items()}
    momentum = {name: torch.randn(*shape, generator=generator) * 1e-3 for name, shape in shapes.items()}
    compression = CompressionConfig()
    budget = compression.stage_bandwidth_budget(numel, INNER_STEPS, REPLICAS)
    blobs = []
    for _ in range(count):
        pseudo_gradient = {name: torch.randn(*shape, generator=generator) * 1e-3
                               for name, shape in shapes.items()}
        blobs.append(encode_within_bandwidth(pseudo_gradient, compression, budget, stage_index=stage,
                                             outer_round=1)[0])
    diloco = DilocoConfig(outer_lr=0.7, outer_momentum=0.9, inner_steps=INNER_STEPS, commitments="chunked")
    normed = DilocoConfig(outer_lr=0.7, outer_momentum=0.9, inner_steps=INNER_STEPS, commitments="normed")
    aggregate_s, aggregation = _best(lambda: aggregate_with_report(weights, momentum, blobs, diloco,
                                                                   stage_index=stage, outer_round=1), repeat)
    decode_args = {"stage_index": stage, "outer_round": 1}
    state_s, state = _best(lambda: stage_state(stage, aggregation, blobs, diloco, 1, decode_args=decode_args),
                           repeat)
    leaf_s, leaf = _best(lambda: stage_state(stage, aggregation, blobs, diloco, 1,
                                             decode_args=decode_args).leaf(),
                         repeat)
    shard = Checkpoint(0, 1, {}, bytes(32), {}, aggregation.new_global, aggregation.new_momentum)
    publish_s, data = _best(shard.to_bytes, repeat)

    def check():  # a prover's check of a fetched state against the committed leaf's roots
        return tree_root(tensor_leaves(aggregation.new_global)), \
            tree_root(tensor_leaves(aggregation.new_momentum))

    check_s, roots = _best(check, repeat)
    assert roots == (leaf.weights_root, leaf.momentum_root)
    accepted = [blobs[report.index] for report in aggregation.contributions if report.accepted]
    norms_s, _ = _best(lambda: stage_norms(accepted, shapes, normed, decode_args), repeat)
    decode_s, (_, decoded) = _best(lambda: decode_declared(accepted[0], shapes, **decode_args), repeat)
    squares_s, sums = _best(lambda: chunk_square_sums(decoded), repeat)
    tree_s, _ = _best(lambda: SumTree.of(sums), repeat)
    normed_s, normed_leaf = _best(
        lambda: stage_state(stage, aggregation, blobs, normed, 1, decode_args=decode_args).leaf(), repeat)
    normed_state = stage_state(stage, aggregation, blobs, normed, 1, decode_args=decode_args)
    encode_s, served = _best(lambda: encode_norm_state(normed_state.factors.encode(), normed_state.sum_trees),
                             repeat)
    assert normed_leaf.weights_root == leaf.weights_root and normed_leaf != leaf
    return {"stage": stage, "elements": numel, "chunks": state.leaf().num_chunks, "contributions": count,
            "contribution_bytes": [len(blob) for blob in blobs], "budget_bytes": budget,
            "aggregate_s": round(aggregate_s, 4), "state_s": round(state_s, 4),
            "state_and_leaf_s": round(leaf_s, 4), "publish_bytes_s": round(publish_s, 4),
            "published_bytes": len(data), "check_fetched_s": round(check_s, 4),
            "state_over_aggregate": round(leaf_s / aggregate_s, 2), "stage_leaf": leaf.encode().hex(),
            "normed_norms_s": round(norms_s, 4), "normed_decode_s": round(decode_s, 4),
            "normed_squares_s": round(squares_s, 4), "normed_tree_s": round(tree_s, 4),
            "normed_state_and_leaf_s": round(normed_s, 4),
            "normed_over_chunked": round(normed_s / leaf_s, 2), "normed_served_bytes": len(served),
            "normed_encode_s": round(encode_s, 4), "normed_stage_leaf": normed_leaf.encode().hex()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", default="2,4,8", help="contributions aggregated per case")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--before", default=None, help="this script's result on an older tree, to compare")
    parser.add_argument("--before-label", default="", help="what that older tree is (e.g. its commit)")
    parser.add_argument("--out", default=default_out(__file__))
    args = parser.parse_args()
    torch.set_num_threads(1)
    load = list(os.getloadavg())
    rows = []
    for stage in range(STAGES):
        for count in (int(c) for c in args.counts.split(",")):
            rows.append(measure(stage, count, args.repeat))
            print({k: v for k, v in rows[-1].items() if not k.endswith("stage_leaf")}, flush=True)
    result = {"preset": PRESET, "stages": STAGES, "inner_steps": INNER_STEPS, "rows": rows}
    if args.before:
        before = json.loads(Path(args.before).read_text())
        result["before"] = {"rows": before["rows"], "recorded": before.get("recorded"),
                            "label": args.before_label}
        old = {(row["stage"], row["contributions"]): row for row in before["rows"]}
        for row in rows:
            prior = old.get((row["stage"], row["contributions"]))
            if prior is not None:
                row["same_stage_leaf_as_before"] = prior["stage_leaf"] == row["stage_leaf"]
                row["speedup_state_and_leaf"] = round(prior["state_and_leaf_s"] / row["state_and_leaf_s"], 1)
    write_result(args.out, result, load)
    return 0


if __name__ == "__main__":
    sys.exit(main())
