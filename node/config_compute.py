"""``[compute]``: how many processes train this node's replica (issue 75, docs/CLUSTER.md "Started how").

``processes = N`` > 1 makes the node a cluster of N processes: the node process is rank 0 (its libp2p host,
its chain account, its store, its round loop) and starts ranks 1..N-1 itself; the replica's inner steps run
under FSDP2 over the N ranks (training/cluster_replica.py). The table is ``[compute]``, not ``[cluster]``:
the top-level key ``cluster`` already names the nodes that share one pipeline replica, and a TOML file
cannot hold both a key and a table of one name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from node.errors import ConfigError

#: The most processes one node starts (a guard against a typo starting thousands of processes).
MAX_PROCESSES = 256


@dataclass
class ComputeConfig:
    """``[compute]``: ``processes`` = the processes that train this node's replica (1: this one only)."""

    processes: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.processes, bool) or not isinstance(self.processes, int):
            raise ConfigError(f"compute.processes={self.processes!r}: must be an integer >= 1")
        if not 1 <= self.processes <= MAX_PROCESSES:
            raise ConfigError(f"compute.processes={self.processes}: must be in [1, {MAX_PROCESSES}] "
                              "(1 = this process trains alone)")


def check_compute(cfg) -> None:
    """What a node of ``compute.processes`` > 1 needs of the rest of ``cfg`` (a NodeConfig); sets
    ``training.device`` to "cpu" for one ("auto" would pick a GPU the cluster's ranks do not use)."""
    n = cfg.compute.processes
    if n == 1:
        return
    where = f"compute.processes={n}"
    problems = []
    if cfg.pipeline.num_stages != 1 or cfg.cluster_size != 1:
        problems.append("a cluster node trains a whole replica: pipeline.num_stages = 1 and cluster_size = 1 "
                        f"(not {cfg.pipeline.num_stages} and {cfg.cluster_size})")
    if cfg.training.device not in ("cpu", "auto"):
        problems.append(f"training.device={cfg.training.device!r}: a cluster node's ranks train on the CPU "
                        "(gloo); GPUs are not wired into the node yet")
    if cfg.training.precision != "fp32" or cfg.training.compile or cfg.training.reproducible:
        problems.append("a cluster node trains in float32, eagerly: training.precision = \"fp32\", "
                        "training.compile = false, training.reproducible = false")
    if cfg.training.optimizer != "adamw":
        problems.append(f"training.optimizer={cfg.training.optimizer!r}: a cluster node's inner optimizer is "
                        "\"adamw\"")
    if cfg.diloco.sliced:
        problems.append("diloco.exchange=\"sliced\": a cluster node aggregates its rounds shard by shard on "
                        "its ranks; the sliced exchange is not wired for it (\"full\")")
    if cfg.training.batch_size % n:
        problems.append(f"training.batch_size={cfg.training.batch_size} does not split into {n} equal "
                        "slices (each rank trains one)")
    if problems:
        raise ConfigError(f"{where}: " + "; ".join(problems))
    cfg.training = dataclasses.replace(cfg.training, device="cpu")
