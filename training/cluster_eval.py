"""The held-out eval of a node that is a cluster, its weights snapshot kept on the ranks (issue 75).

The node evaluates the weights after a round's training on a snapshot, on another thread, while the next
round trains (node/live/worker/contributor.py; :meth:`training.pipeline.LocalReplicaTrainer.eval_snapshot`).
One process copies the stage; a cluster's rank 0 gathered the weights whole into a plain module. Here each
rank copies its own FSDP shard of every parameter (``snapshot``: 1/N of the weights per rank, no
communication), and the snapshot rank 0 evaluates (:class:`StreamedEvalSnapshot`) is the stage module on
the meta device whose blocks are made real as the forward reaches them (training.cluster_stream.
BlockStreamer): each of a block's parameters gathered from the ranks' copies (``snapshot_tensors``: the
same all-gather a parameter's ``full_tensor`` is) and dropped after the block. The forward is the module's
own on the same values, so the loss is the bits of the gathered module's (tests/test_cluster_node.py). A
snapshot serves one eval (the node's use): its copies are dropped on every rank when the eval is done, or,
if it is never run, at the next snapshot after it is gone.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from training.cluster_stream import BlockStreamer
from training.errors import EngineStateError
from training.host_tensors import host_float32
from training.pipeline import EvalSnapshot


def snapshot_command(rank, command: tuple):
    """A rank's part of a snapshot command (``rank``: the cluster rank's ``_Rank``): ``snapshot`` (copy the
    rank's shards; drop the released), ``snapshot_tensors`` (gather parameters whole: a dict on rank 0),
    ``snapshot_drop``."""
    kind, snapshot_id = command[0], command[1]
    kept = rank.snapshots
    if kind == "snapshot":
        for old in command[2]:
            kept.pop(old, None)
        with torch.no_grad():
            kept[snapshot_id] = {name: param.to_local().detach().clone()
                                 for name, param in rank.module.named_parameters()}
        return None
    if kind == "snapshot_drop":
        kept.pop(snapshot_id, None)
        return None
    return _gathered(rank, kept.get(snapshot_id), snapshot_id, command[2])


def _gathered(rank, local, snapshot_id: int, names: Sequence[str]):
    from torch.distributed.tensor import DTensor

    if local is None:
        raise EngineStateError(f"eval snapshot {snapshot_id} of the cluster is no longer kept")
    params = dict(rank.module.named_parameters())
    out = {}
    with torch.no_grad():
        for name in names:
            param = params[name]
            full = DTensor.from_local(local[name], param.device_mesh, param.placements, shape=param.shape,
                                      stride=param.stride()).full_tensor()
            out[name] = host_float32(full)
            del full
    return out if torch.distributed.get_rank() == 0 else None


class StreamedEvalSnapshot(EvalSnapshot):
    """Rank 0's snapshot of the live weights (module docstring): ``command`` runs a cluster command on every
    rank; ``released``: where the ids of snapshots dropped unevaluated are queued."""

    def __init__(self, module_of, model_cfg, platform, command, snapshot_id: int, released: list) -> None:
        with torch.device("meta"):
            module = module_of(model_cfg)
        self.model_cfg, self.platform = model_cfg, platform
        self.stage_modules = [module.eval()]
        self._command, self._id = command, snapshot_id
        self._streamer = BlockStreamer(module, self._fetch, torch.float32)
        self._done = weakref.finalize(self, released.append, snapshot_id)

    def _fetch(self, names: Sequence[str]):
        return self._command(("snapshot_tensors", self._id, list(names)))

    def eval_loss(self, batches) -> float:
        """:meth:`EvalSnapshot.eval_loss` of the snapshot's weights; then its copies are dropped (once)."""
        if not self._done.alive:
            raise EngineStateError("a cluster's eval snapshot serves one eval: take another")
        try:
            with self._streamer.top():
                return super().eval_loss(batches)
        finally:
            self._done.detach()
            self._command(("snapshot_drop", self._id))
