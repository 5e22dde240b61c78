"""The bytes of bench/scale_model.py's model: a spot check's start state by the round it is of, the
start states a node serves, and its bytes sent (the exchange, fitted per parameter held, plus those)."""

from __future__ import annotations


def linear(model: dict, quantity: str, point: dict) -> float | None:
    """A fitted ``q = a + b x`` (bench/scale_model.py's ``fit``) at ``point``; None if not fitted."""
    f = model.get(quantity)
    if f is None:
        return None
    return f["intercept"] + f["slope"] * point[f["x"]]


#: The rounds whose start states differ in what they hold: round 0's (no inner optimizer moments, no
#: snapshots yet), round 1's, and any later one's (the steady state a long run's checks fetch).
STATE_ROUNDS = ("first", "second", "later")


def _state_counts(n: int) -> list[int]:
    """How many of round 0's, round 1's and later rounds' states a node fetched when it fetched ``n`` in
    order (each node of the benches checks the other replica's rounds 0, 1, 2, ...)."""
    return [min(n, 1), min(max(n - 1, 0), 1), max(n - 2, 0)]


def fit_start_state(points: list[dict]) -> dict | None:
    """The start state a check fetches, in bytes per parameter of the replica, by the round it is of
    (:data:`STATE_ROUNDS`): least squares of ``bytes / parameters = counts . sizes`` over every node that
    fetched one, its counts from how many it fetched (:func:`_state_counts`). None when the nodes' counts
    do not tell the rounds apart (every node fetched as many, say)."""
    import numpy as np

    rows = [(_state_counts(n), b / p["parameters"]) for p in points if p.get("spot_check_fetches")
            for n, b in zip(p["spot_check_fetches"], p["spot_check_state_bytes"]) if n > 0]
    if not rows:
        return None
    a = np.array([r[0] for r in rows], dtype=float)
    y = np.array([r[1] for r in rows])
    used = [i for i in range(len(STATE_ROUNDS)) if a[:, i].any()]  # rounds no node reached stay unknown
    sizes, _, rank, _ = np.linalg.lstsq(a[:, used], y, rcond=None)
    if rank < len(used) or "later" not in [STATE_ROUNDS[i] for i in used]:
        return None
    out = dict.fromkeys(STATE_ROUNDS)
    out.update({STATE_ROUNDS[i]: float(v) for i, v in zip(used, sizes)})
    return {**out, "nodes": len(rows)}


def spot_check_bytes(model: dict, point: dict, rate: float | None = None) -> float | None:
    """The start-state bytes a node serves per round. At a measured run's own draw (``rate`` None): what its
    nodes' fetches (of rounds 0, 1, ... in order) take. At ``rate`` checks per replica per round (a layout of
    many rounds): each a later round's whole replica state, a stage's part from each of its nodes."""
    fitted = model.get("start_state")
    if fitted is None:
        return None
    if rate is not None:
        return rate * fitted["later"] * point["parameters"] / point["stages"]
    fetches = point.get("spot_check_fetches")
    if not fetches:
        return None
    per_node = []
    for n in fetches:
        counts = _state_counts(n)
        if any(c and fitted[k] is None for c, k in zip(counts, STATE_ROUNDS)):
            return None  # a round's size the fit did not see
        per_node.append(sum(c * (fitted[k] or 0.0) for c, k in zip(counts, STATE_ROUNDS)))
    return point["parameters"] * sum(per_node) / len(per_node) / point["rounds"]


def bytes_per_check(model: dict, point: dict) -> float | None:
    """The mean start state a measured run's checks fetched, at its own mix of round 0's and later ones."""
    served, fetches = spot_check_bytes(model, point), point.get("spot_check_fetches")
    return None if served is None or not fetches else served * point["rounds"] * len(fetches) / sum(fetches)


def bytes_sent(model: dict, point: dict, rate: float | None = None) -> float | None:
    """A node's bytes sent per round: the exchange's (fitted per parameter held), the start states served."""
    exchange, spot = linear(model, "exchange_bytes_per_round", point), spot_check_bytes(model, point, rate)
    return None if exchange is None or spot is None else max(0.0, exchange) + spot
