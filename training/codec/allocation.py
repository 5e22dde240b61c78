"""Compression under a bandwidth budget: how the bytes of a contribution are shared between its tensors.

The one-step delay hides the exchange of round t behind the inner steps of
round t+1 only if it fits in that time. Given ``compression.bandwidth_budget``
(bytes one replica may send for one stage in one round, e.g. link bytes/s x
round compute seconds / peers served), the encoder no longer works to a fixed
relative error: it spends the byte budget where it removes the most error.

Per tensor ``X_j`` every candidate coding ``c`` (quant(b), lowrank(r, b); see
:mod:`training.codec.coding`) has a cost ``bytes_j(c)`` and an error
``err_j(c) = ||X_j - decode(c)||_F^2`` (absolute, not relative: a squared error
costs the same loss wherever it sits, to first order, and error feedback
re-sends it next round). The policy solves::

    minimise  sum_j err_j(c_j)   subject to   sum_j bytes_j(c_j) + framing <= budget

greedily on each tensor's lower convex hull of ``(bytes, err)``: start every
tensor at its cheapest coding, then repeatedly take the upgrade with the largest
error removed per extra byte that still fits (the classic optimal rule for the
convex relaxation of this knapsack). If even the cheapest codings exceed the
budget they are sent anyway (the stats report the overshoot). The resulting
per-round relative errors are what a fixed ``error_budget`` would have had to
be to fit: the policy chooses the error budget per round and per tensor.

Every encoder kind allocates with these functions; they differ in how they
estimate ``err_j(c)`` (``training/codec/v1.py`` ... ``v4.py``).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

import torch


def framing_bytes(name: str, shape: Sequence[int]) -> int:
    """Upper estimate of the msgpack bytes of one entry besides its payload (keys, name, shape, headers)."""
    return 48 + len(name.encode()) + 9 * len(shape)


def contribution_overhead(tensors: Mapping[str, torch.Tensor]) -> int:
    """Upper estimate of a contribution's msgpack bytes besides its payloads: the header and every entry's
    framing."""
    return 32 + sum(framing_bytes(name, tuple(tensors[name].shape)) for name in sorted(tensors))


def lower_hull(points: Sequence[tuple[int, float]]) -> list[int]:
    """Indices of ``points`` (cost, error) on the lower-left convex hull, by increasing cost.

    Dominated points (costlier and not more accurate) and points above the
    hull are dropped; the first index is the cheapest point (ties: smaller error).
    """
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    hull: list[int] = []
    for index in order:
        cost, error = points[index]
        if hull and error >= points[hull[-1]][1]:
            continue  # not more accurate than a cheaper point
        while len(hull) >= 2:
            (c1, e1), (c2, e2) = points[hull[-2]], points[hull[-1]]
            # Drop hull[-1] if it lies on or above the segment from hull[-2] to this point.
            if (e1 - e2) * (cost - c2) <= (e2 - error) * (c2 - c1):
                hull.pop()
            else:
                break
        hull.append(index)
    return hull


def allocate(options: Mapping[str, Sequence[tuple[int, float]]], budget: int) -> dict[str, int]:
    """Pick one option index per tensor minimising total error with total cost <= ``budget`` (greedy on
    hulls).

    ``options[name]`` lists ``(cost_bytes, squared_error)``. Returns
    ``{name: option index}``; every tensor gets at least its cheapest option.
    """
    hulls = {name: lower_hull(points) for name, points in options.items()}
    position = {name: 0 for name in hulls}
    spent = sum(options[name][hull[0]][0] for name, hull in hulls.items())
    heap: list[tuple[float, str]] = []

    def push(name: str) -> None:
        hull, k = hulls[name], position[name]
        if k + 1 < len(hull):
            (c0, e0), (c1, e1) = options[name][hull[k]], options[name][hull[k + 1]]
            heapq.heappush(heap, (-(e0 - e1) / max(c1 - c0, 1), name))

    for name in sorted(hulls):
        push(name)
    while heap:
        _, name = heapq.heappop(heap)
        hull, k = hulls[name], position[name]
        extra = options[name][hull[k + 1]][0] - options[name][hull[k]][0]
        if spent + extra > budget:
            continue  # this upgrade does not fit; later (steeper-cost) ones of this tensor neither
        spent += extra
        position[name] = k + 1
        push(name)
    return {name: hulls[name][position[name]] for name in hulls}
