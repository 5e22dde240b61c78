"""What a node remembers across restarts (state.json) and shows to operators (status.json, progress).

``state.json`` holds the rounds this node contributed to and finished, so a
restarted node never signs a second, different message for a round it already
handled; it is written atomically after every change. ``status.json`` is the
snapshot ``dlx-node status`` and the demo read.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from node.errors import StateError
from node.fsutil import atomic_write_bytes, atomic_write_json, is_disk_full, report_disk_full

logger = logging.getLogger(__name__)


@dataclass
class Progress:
    """The node's live figures (shown by the CLI's progress line and written to status.json)."""

    state: str = "starting"
    round: int = -1
    step: int = 0
    inner_steps: int = 0
    loss: float = math.nan
    eval_loss: float = math.nan
    peers: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    gossip_messages_sent: int = 0  # run-topic messages this node published
    gossip_messages_received: int = 0  # distinct run-topic messages delivered to it
    traffic: dict = field(default_factory=dict)  # per protocol: P2PHost.transfer_stats()
    # per connected peer: "direct" or "relayed" (P2PHost.connection_paths)
    paths: dict = field(default_factory=dict)
    last_commit: int = -1
    last_finished: int = -1
    weights_root: str = ""
    spot_checks: int = 0  # other replicas' contributions re-executed (node.live.checks.verifier)
    spot_check_mismatches: int = 0
    chain_checks: int = 0  # start-state links from an exact rerun into the next round checked
    spot_check_seconds: float = 0.0  # wall time of those checks (fetching their inputs and the rerun)
    spot_check_state_bytes: int = 0  # the claimants' start states those checks fetched
    spot_check_state_fetches: int = 0  # how many checks fetched them (a check counts here when it fetches)
    spot_checks_not_done: int = 0  # sampled checks whose inputs were not served or not bound to the record
    spot_checks_left_undone: int = 0  # sampled checks still queued (or cut short) when the node stopped
    timing: dict = field(default_factory=dict)  # node.live.state.roundclock.RoundClock.summary()
    history: list[dict] = field(default_factory=list)

    def current_round(self) -> int:
        """The round being trained (-1: none); accusations and verdicts travel in envelopes of it."""
        return self.round


class StateFile:
    """The node's state.json for one run (a file of another run counts as empty)."""

    def __init__(self, path: Path, run_id: int) -> None:
        self.path = path
        self.run_id = run_id
        self._lock = threading.RLock()
        self._state = self._load()

    def _load(self) -> dict:
        if not self.path.exists():
            return {}
        try:
            state = json.loads(self.path.read_text())
        except (OSError, ValueError, RecursionError) as exc:
            raise StateError(f"state file {self.path} is corrupt ({exc}); move it away to start fresh, "
                             "the node will then rejoin from the chain's latest checkpoint") from None
        if not isinstance(state, dict) or state.get("run_id") != self.run_id:
            return {}
        problem = _state_problem(state)
        if problem:
            raise StateError(f"state file {self.path} is corrupt ({problem}); move it away to start fresh, "
                             "the node will then rejoin from the chain's latest checkpoint")
        return state

    def get(self, key: str, default: Any = None) -> Any:
        with self._lock:
            return self._state.get(key, default)

    def update(self, **values: Any) -> None:
        """Set keys and write the file atomically."""
        with self._lock:
            self._state.update(values)
            self._save()

    def record_round(self, outer_round: int, weights_root: bytes, committed_by_me: bool,
                     keep: int = 1024) -> None:
        """Remember the weights root this node computed for a round (for operators and tests).

        Only the last ``keep`` rounds are kept: the file is rewritten several times a round, and a
        long run made it grow by ~200 bytes a round without end (98 kB at round 500).
        """
        with self._lock:
            roots = self._state.setdefault("weights_roots", {})
            roots[str(outer_round)] = weights_root.hex()
            for old in sorted(roots, key=int)[:-keep]:
                del roots[old]
            if committed_by_me:
                committed = self._state.setdefault("committed", [])
                committed.append(outer_round)
                del committed[:-keep]
            self._save()

    def signed_record(self, outer_round: int) -> tuple[bytes, bytes] | None:
        """(EIP-712 digest, signature) of the record this node signed for a round, in any life."""
        with self._lock:
            entry = self._state.get("signed_records", {}).get(str(outer_round))
        return None if entry is None else (bytes.fromhex(entry[0]), bytes.fromhex(entry[1]))

    def remember_signed(self, outer_round: int, digest: bytes, signature: bytes, keep: int = 256) -> None:
        """Record a signature before it is sent: a member never signs two records of one round (it would
        be slashed for equivocation), not even across a restart. The last ``keep`` rounds are kept."""
        with self._lock:
            signed = self._state.setdefault("signed_records", {})
            signed[str(outer_round)] = [digest.hex(), signature.hex()]
            for old in sorted(signed, key=int)[:-keep]:
                del signed[old]
            self._save()

    def attested(self, outer_round: int) -> tuple[float, float, int] | None:
        """(train loss, held-out loss, tokens) this node attested for a round it contributed to, in any
        life."""
        with self._lock:
            entry = self._state.get("attested", {}).get(str(outer_round))
        if entry is None:
            return None
        train, held_out, tokens = entry
        return (math.nan if train is None else float(train), math.nan if held_out is None
                else float(held_out),
                int(tokens))

    def remember_attested(self, outer_round: int, train_loss: float, eval_loss: float, tokens: int,
                          keep: int = 64) -> None:
        """Keep a contributed round's attested figures: a restarted node that finishes the round again
        attests the same (its training figures are gone with the process). The last ``keep`` rounds."""
        as_json = lambda x: None if math.isnan(x) else x  # noqa: E731 - state.json stays strict JSON
        with self._lock:
            attested = self._state.setdefault("attested", {})
            attested[str(outer_round)] = [as_json(train_loss), as_json(eval_loss), int(tokens)]
            for old in sorted(attested, key=int)[:-keep]:
                del attested[old]
            self._save()

    def _save(self) -> None:
        self._state["run_id"] = self.run_id
        atomic_write_json(self.path, self._state)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_hex(value: Any, size: int) -> bool:
    if not isinstance(value, str) or len(value) != 2 * size:
        return False
    try:
        bytes.fromhex(value)
    except ValueError:
        return False
    return True


def _state_problem(state: dict) -> str:
    """What is wrong with the keys the node reads back from state.json ("" if nothing)."""
    for key in ("last_finished", "last_contributed"):
        if key in state and not _is_int(state[key]):
            return f"{key} is not an integer"
    rounds_key = lambda k: isinstance(k, str) and k.lstrip("-").isdigit() and len(k) < 20  # noqa: E731
    signed = state.get("signed_records", {})
    if not isinstance(signed, dict) or not all(
            rounds_key(k) and isinstance(v, list) and len(v) == 2 and _is_hex(v[0], 32) and _is_hex(v[1], 65)
            for k, v in signed.items()):
        return "signed_records is not a map of round -> [digest hex, signature hex]"
    roots = state.get("weights_roots", {})
    if not isinstance(roots, dict) or not all(rounds_key(k) and isinstance(v, str) for k, v in roots.items()):
        return "weights_roots is not a map of round -> hex"
    attested = state.get("attested", {})
    number = lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))  # noqa: E731
    if not isinstance(attested, dict) or not all(
            rounds_key(k) and isinstance(v, list) and len(v) == 3 and number(v[0]) and number(v[1])
            and _is_int(v[2])
            for k, v in attested.items()):
        return "attested is not a map of round -> [train loss, held-out loss, tokens]"
    reentered = state.get("reentered_for", [])
    if not isinstance(reentered, list) or not all(_is_int(r) for r in reentered):
        return "reentered_for is not a list of rounds"
    committed = state.get("committed", [])
    if not isinstance(committed, list) or not all(_is_int(r) for r in committed):
        return "committed is not a list of rounds"
    return ""


def write_status(path: Path, progress: Progress, peer_id: str, run_id: int, placement,
                 listen_addrs: list[str], writer: "StatusWriter | None" = None) -> None:
    """Write status.json (best effort: a full disk must not stop training).

    With a ``writer``, the document is taken now and written on the writer's thread (the
    training thread does not wait for the disk).
    """
    p = progress
    status = {
        "pid": os.getpid(), "peer_id": peer_id, "run_id": run_id, "state": p.state,
        "round": p.round, "step": p.step, "inner_steps": p.inner_steps, "loss": _num(p.loss),
        "eval_loss": _num(p.eval_loss), "peers": p.peers, "bytes_sent": p.bytes_sent,
        "bytes_received": p.bytes_received, "gossip_messages_sent": p.gossip_messages_sent,
        "gossip_messages_received": p.gossip_messages_received, "traffic": p.traffic,
        "paths": p.paths,
        "last_finished": p.last_finished, "last_commit": p.last_commit,
        "weights_root": p.weights_root, "spot_checks": p.spot_checks,
        "spot_check_mismatches": p.spot_check_mismatches, "chain_checks": p.chain_checks,
        "spot_check_seconds": round(p.spot_check_seconds, 3), "spot_checks_not_done": p.spot_checks_not_done,
        "spot_check_state_bytes": p.spot_check_state_bytes,
        "spot_check_state_fetches": p.spot_check_state_fetches,
        "spot_checks_left_undone": p.spot_checks_left_undone,
        "timing": p.timing,
        "updated_at": time.time(),
        "placement": None if placement is None else {
            "cluster": placement.cluster, "replica": placement.replica, "stages": list(placement.stages)},
        "listen_addrs": listen_addrs,
    }
    if writer is not None:
        writer.submit(path, _status_bytes(status))
        return
    try:
        atomic_write_bytes(path, _status_bytes(status))
    except OSError as exc:
        logger.debug("status not written: %s", exc)


def _status_bytes(status: dict) -> bytes:
    return json.dumps(status, indent=1, sort_keys=True).encode() + b"\n"  # as atomic_write_json


class Reporter:
    """The node's live figures out: status.json (written off the training thread) and the command's hook."""

    def __init__(self, *, path: Path, progress: Progress, peer_id: str, run_id: int, station,
                 on_progress=None) -> None:
        self.path = path
        self.progress = progress
        self.peer_id = peer_id
        self.run_id = run_id
        self.station = station  # node.live.state.station.Station: the placement status.json shows
        self.on_progress = on_progress
        self._listen_addrs: list[str] = []
        self._last_report = 0.0
        self._writer = StatusWriter()

    def listening(self, listen_addrs: list[str]) -> None:
        """The host's addresses from now on (empty: no host)."""
        self._listen_addrs = list(listen_addrs)

    def set_state(self, state: str) -> None:
        self.progress.state = state
        self.report()

    def report(self, throttle: bool = False) -> None:
        now = time.monotonic()
        if throttle and now - self._last_report < 0.5:
            return
        self._last_report = now
        write_status(self.path, self.progress, self.peer_id, self.run_id, self.station.placement(),
                     self._listen_addrs, writer=self._writer)
        if self.on_progress is not None:
            self.on_progress(self.progress)

    def close(self) -> None:
        """Write what is pending, then stop the writer."""
        self._writer.close()


class StatusWriter:
    """Writes status.json on its own thread, atomically; of several pending documents the latest wins."""

    def __init__(self) -> None:
        self._pending: tuple[Path, bytes] | None = None
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="status-writer", daemon=True)
        self._thread.start()

    def submit(self, path: Path, data: bytes) -> None:
        with self._cond:
            if self._closed:
                return
            self._pending = (path, data)
            self._cond.notify()

    def close(self, timeout: float = 10.0) -> None:
        """Write what is pending, then stop."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                item, self._pending = self._pending, None
                if item is None:
                    return
            try:
                atomic_write_bytes(*item, durable=False)  # read while the node runs: no fsync
            except OSError as exc:
                if is_disk_full(exc):
                    report_disk_full(exc, "status.json not updated (the next report writes it)",
                                     kind="status.json")
                else:
                    logger.debug("status not written: %s", exc)


def _num(x: float) -> float | None:
    return None if x is None or math.isnan(x) else x
