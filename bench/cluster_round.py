"""A node's whole round, part by part, with every rank's memory peak over each part (issue 75).

Used by bench/bench_cluster_memory.py (``round[N]``): the parts of a round as a running node takes them on
rank 0 (node/live/worker/, node/live/round/finisher.py), each through the node's own functions:

* ``inner_steps``: the round's inner steps (the FSDP shards, ClusterReplicaTrainer.train_step);
* ``start_state``: the round's start state written to a file (``StartStateCapture.write``: the trainer part
  gathered a tensor at a time into a spill file, the engine part streamed from the ranks);
* ``eval``: the held-out eval (the worker's ``eval_snapshot``);
* ``encode``: the contribution (byte budget "auto", error feedback);
* ``screen``: screening of the closed contributions (the worker's ``StageAggregation.screen``);
* ``apply``: the outer step (``finish_round``: the aggregation on the ranks);
* ``record``: the weights hash and the chunk roots;
* ``finisher``: the state kept for a survivor's re-entry (handles) and the checkpoint shard written from it
  (``write_checkpoint`` of the handles, as ``RoundFinisher.write_shard``);

and two that a node takes only on a fork (fork repair, node/live/record/forkrepair.py), measured after the
round: ``derive`` (the aggregation of the round on a kept base, screening included) and ``move_global``
(the engine moved to a kept state). Before each part every rank gives its free pages back and resets its
peak (training/cluster_memory.py); after it each rank's peak over the part is read. A rank's *transient* of a
part is its peak over the part less its resident set before the part.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch

from node.live.worker.aggregation import StageAggregation
from node.store.checkpoint import Checkpoint, write_checkpoint
from training.cluster_memory import memory_row
from training.data import Corpus
from training.replica_capture import StartStateCapture
from training.reexec_rules import round_meta

ROUND_PARTS = ("inner_steps", "start_state", "eval", "encode", "screen", "apply", "record", "finisher")
FORK_PARTS = ("derive", "move_global")


class Screener(StageAggregation):
    """The worker's screening and fork repair's ``derive`` (StageAggregation) over one engine."""

    def __init__(self, engine, cfg, corpus) -> None:
        self.engines, self.cfg, self.corpus = {0: engine}, cfg, corpus


def node_cfg(model, training, diloco, compression) -> SimpleNamespace:
    """What StageAggregation reads of a node's config."""
    return SimpleNamespace(model=model, training=training, diloco=diloco, compression=compression,
                           pipeline=SimpleNamespace(num_stages=1))


def corpus_of(model, tokens: int = 1 << 16) -> Corpus:
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(0, model.vocab_size, (tokens,), generator=generator, dtype=torch.int64)
    return Corpus(train=ids[: tokens // 2], eval=ids[tokens // 2:], source="random", sha256="0" * 64)


class RoundDriver:
    """One node's round (module docstring) on ``trainer`` (a ClusterReplicaTrainer, or a one-process
    LocalReplicaTrainer) and ``engine`` (its stage engine); ``memory(reset)``: every rank's memory rows."""

    def __init__(self, trainer, engine, cfg, memory, others, batch, eval_batches) -> None:
        """``others(outer_round)``: the other replicas' contributions of a round."""
        self.trainer, self.engine, self.cfg, self.memory = trainer, engine, cfg, memory
        self.others, self.batch, self.eval_batches = others, batch, eval_batches
        self.screener = Screener(engine, cfg, corpus_of(cfg.model))
        self.parts: dict[str, list[dict]] = {}
        self.kept = None  # the finisher's held state (handles, for a cluster)

    def measure(self, name: str, work):
        before = self.memory(True)
        result = work()
        after = self.memory(False)
        self.parts[name] = [{"rss_before": b["rss"], "peak": a["peak"], "transient": a["peak"] - b["rss"]}
                            for b, a in zip(before, after)]
        return result

    def round(self, outer_round: int, measured: bool) -> dict:
        """Every part of ``outer_round`` in the node's order; measured part by part when ``measured``."""
        run = self.measure if measured else (lambda _name, work: work())
        trainer, engine = self.trainer, self.engine
        with tempfile.TemporaryDirectory() as tmp:
            meta = round_meta(outer_round, 0, self.cfg.model, self.cfg.diloco, run_rounds=0, num_stages=1)
            part = run("start_state", lambda: self._start_state(meta, Path(tmp)))
            del part
            run("inner_steps", self._inner_steps)
            loss = run("eval", lambda: trainer.eval_snapshot().eval_loss(self.eval_batches))
            own, _stats = run("encode", lambda: engine.encode_contribution(outer_round))
            blobs = [own, *self.others(outer_round)]
            excluded, _reports = run("screen", lambda: self.screener.screen(outer_round, blobs))
            result = run("apply", lambda: engine.finish_round(outer_round, blobs, excluded=excluded))
            run("record", self._record)
            run("finisher", lambda: self._finisher(outer_round, Path(tmp)))
        return {"eval_loss": loss, "weights_hash": result.weights_hash.hex(), "excluded": sorted(excluded),
                "contribution_bytes": len(own)}

    def fork(self, outer_round: int, base, blobs) -> None:
        """Fork repair's parts on the state kept before ``outer_round`` (``base``: its handles)."""
        self.measure("derive", lambda: self.screener.derive(0, outer_round, base, blobs))
        self.measure("move_global", lambda: self.engine.move_global(*base))

    def _inner_steps(self) -> None:
        begin, end = getattr(self.trainer, "begin_steps", None), getattr(self.trainer, "end_steps", None)
        if begin is not None:
            begin()
        try:
            self.trainer.train_step(*self.batch)
        finally:
            if end is not None:
                end()

    def _start_state(self, meta, directory: Path) -> dict:
        from node.live.worker import cluster

        module = self.trainer.stage_modules[0]
        part = cluster.trainer_part(self.trainer, module, self.trainer.optimizers[0], spill_dir=directory)
        return StartStateCapture(meta, lambda _stage: self.engine, {0: part}).write(directory / "states")

    def _record(self) -> tuple[bytes, tuple[bytes, bytes]]:
        """The round's weights hash and chunk roots (a cluster's from its ranks' frontiers; one process's from
        its tensors' leaves, as its record builds them)."""
        roots = getattr(self.engine, "chunk_roots", None)
        if roots is not None:
            return self.engine.weights_hash(), roots()
        from ledger.chunkproof import tree_root
        from training.chunks import tensor_leaves

        return self.engine.weights_hash(), (tree_root(tensor_leaves(self.engine.global_weights)),
                                            tree_root(tensor_leaves(self.engine.momentum)))

    def _finisher(self, outer_round: int, directory: Path) -> bytes:
        weights, momentum = self.engine.global_weights, self.engine.momentum
        self.kept = (weights, momentum)
        shard = Checkpoint(1, outer_round, {}, b"\0" * 32, {0: self.engine.weights_hash()}, weights, momentum)
        return write_checkpoint(directory / "shard.safetensors", shard)


def local_memory(_reset: bool) -> list[dict]:
    """The one-process node's memory rows (one rank)."""
    return [memory_row(_reset)]
