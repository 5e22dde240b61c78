"""The process group of one replica's pipeline: the rendezvous of its stage processes over TCP, one
formation at a time (a restarted stage re-forms it), and the backend (training/pipeline.py's
:class:`~training.pipeline_stage.PipelineStageTrainer` runs on it)."""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from training.errors import PipelineError

logger = logging.getLogger(__name__)

#: Rank 0's rendezvous store server, one per (host, port), kept for the life of the process: a
#: group whose peer died can keep the old server's port (gloo's pending point-to-point work holds
#: it), so a re-formed group must reuse the server, each formation in a fresh key namespace.
_SERVERS: dict[tuple[str, int], dist.TCPStore] = {}
#: Joins of other ranks that rank 0 has answered so far, per server.
_ANSWERED: dict[tuple[str, int], int] = {}
_POLL_S = 0.05
#: Seconds one attempt of a rank other than 0 tries to reach the cluster's rendezvous store.
CONNECT_ATTEMPT_S = 5.0


def _connect_store(host: str, port: int, world_size: int, timeout: timedelta) -> dist.TCPStore:
    """A client of the cluster's rendezvous store, connected in short attempts until ``timeout``.

    The store client's back-off between connection attempts grows the longer the server is down
    (rank 0 restarting takes a minute on a loaded machine), so one long attempt reached the server
    seconds after it was back; each short attempt starts with a fresh back-off."""
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        attempt = max(0.1, min(CONNECT_ATTEMPT_S, deadline - time.monotonic()))
        try:
            store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timedelta(seconds=attempt))
        except (RuntimeError, TimeoutError, OSError):
            if time.monotonic() >= deadline:
                raise
            continue
        store.set_timeout(timeout)
        return store


def _formation_store(rank: int, world_size: int, host: str, port: int, timeout: timedelta) -> dist.Store:
    """A fresh key namespace of the cluster's rendezvous store for one formation of the group.

    Every rank other than 0 takes a ticket (``joins``, an atomic counter) and waits for rank 0
    to name, under ``ready/<ticket>``, the namespace of the formation it is admitted to. Rank 0
    waits for ``world_size - 1`` tickets newer than those it answered before, and admits them
    to a namespace unique to this formation. A restarted rank therefore never reads the
    addresses a dead process left in the store, whichever side restarted.
    """
    if rank != 0:
        store = _connect_store(host, port, world_size, timeout)
        ticket = store.add("joins", 1)
        store.wait([f"ready/{ticket}"], timeout)
        formation = store.get(f"ready/{ticket}").decode()
        return dist.PrefixStore(f"formation/{formation}/", store)
    key = (host, port)
    server = _SERVERS.get(key)
    if server is None:
        server = dist.TCPStore(
            host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False
        )
        _SERVERS[key], _ANSWERED[key] = server, 0
    server.set_timeout(timeout)
    deadline = time.monotonic() + timeout.total_seconds()
    while server.add("joins", 0) < _ANSWERED[key] + world_size - 1:
        if time.monotonic() > deadline:
            raise PipelineError(f"rank 0/{world_size}: the other stages did not come within "
                                f"{timeout.total_seconds():.0f}s")
        time.sleep(_POLL_S)
    joins = server.add("joins", 0)
    formation = f"{os.getpid()}-{time.time_ns()}"
    for ticket in range(_ANSWERED[key] + 1, joins + 1):
        server.set(f"ready/{ticket}", formation)
    _ANSWERED[key] = joins
    return dist.PrefixStore(f"formation/{formation}/", server)


#: How the formed group's activations travel (:func:`group_transport`): ``"nccl"`` or ``"host"``.
_TRANSPORT: list[str] = ["host"]


def pipeline_backend(transport: str = "host") -> str:
    """The torch.distributed backend of a cluster's pipeline: gloo alone for the ``"host"`` transport (every
    tensor that crosses a process is on the CPU), and ``"cpu:gloo,cuda:nccl"`` for ``"nccl"`` (activations of
    stages on GPUs go over NCCL, the loss and gradient-norm scalars, kept on the host, over gloo)."""
    return "cpu:gloo,cuda:nccl" if transport == "nccl" else "gloo"


def device_identity(device: torch.device | str | None) -> str:
    """What a rank tells the others of its training device: ``"cpu"``, or ``"cuda:<uuid>"`` naming the
    physical GPU (two processes that see one GPU under different indices name it alike)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type != "cuda":
        return "cpu"
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    if uuid is None:  # an old torch: the host and the bus id stand for the GPU
        import socket

        return f"cuda:{socket.gethostname()}:{getattr(props, 'pci_bus_id', device.index)}"
    return f"cuda:{uuid}"


def choose_transport(identities: list[str]) -> str:
    """``"nccl"`` when every rank trains on its own GPU; else ``"host"``: NCCL refuses two ranks on one GPU
    ("invalid usage", seen on an H200 with a replica's two stages on it) and cannot reach a rank on the CPU,
    so the activations are copied to the host and go over gloo."""
    gpus = [i for i in identities if i.startswith("cuda:")]
    if len(gpus) == len(identities) and len(set(gpus)) == len(gpus) and dist.is_nccl_available():
        return "nccl"
    return "host"


def group_transport() -> str:
    """The transport of the group this process formed last (``"host"`` before any)."""
    return _TRANSPORT[0]


def _agree_transport(store: dist.Store, rank: int, world_size: int, device) -> str:
    store.set(f"device/{rank}", device_identity(device))
    return choose_transport([store.get(f"device/{r}").decode() for r in range(world_size)])


def init_pipeline_group(
    rank: int, world_size: int, master_addr: str, master_port: int, timeout_s: float = 60.0,
    device: torch.device | str | None = None,
) -> dist.ProcessGroup:
    """Join (rank 0: host) the process group of one replica's pipeline, this rank training on ``device``
    (default the CPU). The ranks tell each other their devices through the rendezvous store and agree on the
    transport (:func:`choose_transport`, then :func:`group_transport`) and so the backend.

    Rendezvous over TCP at ``master_addr:master_port``; the rendezvous and every
    later collective or point-to-point operation fail after ``timeout_s``.
    One pipeline group per process: it is torch's default process group. After
    :func:`close_pipeline_group` the group can be formed again (a stage's process
    died and was restarted): each formation uses its own store namespace.
    """
    if dist.is_initialized():
        raise PipelineError(
            "a torch.distributed process group already exists in this process; close() it first"
        )
    if not 0 <= rank < world_size:
        raise PipelineError(f"rank={rank} not in [0, world_size={world_size})")
    timeout = timedelta(seconds=timeout_s)
    try:
        store = _formation_store(rank, world_size, master_addr, int(master_port), timeout)
        transport = _agree_transport(store, rank, world_size, device)
        dist.init_process_group(backend=pipeline_backend(transport), store=store, rank=rank,
                                world_size=world_size, timeout=timeout)
        _TRANSPORT[0] = transport
    except PipelineError as exc:
        raise PipelineError(
            f"rank {rank}/{world_size}: pipeline rendezvous at {master_addr}:{master_port} failed: {exc}"
        ) from exc
    except (RuntimeError, ValueError, OSError) as exc:  # DistStoreError, DistNetworkError: RuntimeError
        raise PipelineError(
            f"rank {rank}/{world_size}: pipeline rendezvous at {master_addr}:{master_port} failed: {exc}"
        ) from exc
    logger.info("pipeline group joined: rank %d/%d at %s:%d (activations over %s)", rank, world_size,
                master_addr, master_port, "NCCL" if transport == "nccl" else "gloo, through the host")
    return dist.group.WORLD


def close_pipeline_group() -> None:
    """Destroy the process group made by :func:`init_pipeline_group` (no-op if none)."""
    if dist.is_initialized():
        dist.destroy_process_group()
