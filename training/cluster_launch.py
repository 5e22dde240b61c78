"""Starting a cluster's N processes from one (issue 75; docs/CLUSTER.md).

:func:`run_cluster` spawns N ranks (``torch.multiprocessing.spawn``), each joining one process group (gloo
on the CPU, NCCL when the ranks have GPUs) over a free loopback port, runs ``fn(rank, world, *args)`` and
leaves the group. A rank that raises fails the whole launch (spawn raises in the parent, naming the rank).
Under ``torchrun`` the group is already described by the environment: :func:`init_from_env`.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from training.errors import EngineStateError


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def _rank_main(rank: int, world: int, port: int, backend: str, threads: int, fn: Callable,
               args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    if threads > 0:
        torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run_cluster(fn: Callable, world: int, *args, backend: str | None = None, threads: int = 0) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` spawned processes of one group (module docstring).

    ``fn`` must be importable by name (a module-level function); ``threads`` > 0 sets each rank's intra-op
    threads (a 2-core machine with 4 ranks: 1)."""
    if not isinstance(world, int) or world < 1:
        raise EngineStateError(f"cluster of {world!r} processes: must be at least 1")
    mp.spawn(_rank_main, args=(world, free_port(), backend or default_backend(), threads, fn, args),
             nprocs=world, join=True)


def init_from_env(backend: str | None = None) -> tuple[int, int]:
    """Join the group ``torchrun`` describes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): ``(rank,
    world)``."""
    missing = [key for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if key not in os.environ]
    if missing:
        raise EngineStateError(f"not started by torchrun: {', '.join(missing)} not set")
    dist.init_process_group(backend or default_backend())
    return dist.get_rank(), dist.get_world_size()
