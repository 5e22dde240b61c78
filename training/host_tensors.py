"""Float32 host tensors: the precision and the device boundary of the outer loop (docs/GPU.md).

Every pseudo-gradient, snapshot and outer step is float32 arithmetic on the CPU, whatever device the live
weights train on; these helpers make that boundary and the precision of every scalar explicit.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

Weights = dict[str, torch.Tensor]


def float32_scalar(value: float) -> torch.Tensor:
    """A float32 0-d tensor: makes the precision of every scalar in the outer step explicit."""
    return torch.tensor(value, dtype=torch.float32)


def host_float32(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as float32 on the CPU (itself if it already is; a copy from a GPU).

    The device boundary of issue 32 (docs/GPU.md): live weights may sit on a GPU, but
    every pseudo-gradient, snapshot and outer step of the engine is float32 CPU arithmetic.
    """
    return tensor.detach().to(device="cpu", dtype=torch.float32)


def adopted(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself when it is a contiguous float32 CPU tensor (a caller hands it over: no copy), else
    its float32 CPU copy; the same values either way."""
    if tensor.device.type == "cpu" and tensor.dtype == torch.float32 and tensor.is_contiguous():
        return tensor.detach()
    return host_float32(tensor).contiguous().clone()


def host_float32_copy(weights: Mapping[str, torch.Tensor]) -> Weights:
    """float32 CPU copies of ``weights`` (the live params may be on a GPU; see :func:`host_float32`).

    From a CUDA device the copies go into pinned memory asynchronously, then one synchronization: the
    transfer runs at the link's speed instead of one blocking pageable copy per tensor (what the training
    thread waits for each round, docs/GPU.md). The values are the same bits either way.
    """
    copies: Weights = {}
    devices: set[torch.device] = set()
    for name, value in weights.items():
        source = value.detach()
        if source.device.type == "cuda":
            devices.add(source.device)
            copies[name] = torch.empty(source.shape, dtype=torch.float32, pin_memory=True)
            copies[name].copy_(source, non_blocking=True)
        else:
            copies[name] = source.to(device="cpu", dtype=torch.float32, copy=True)
    for device in devices:
        torch.cuda.synchronize(device)
    return copies
