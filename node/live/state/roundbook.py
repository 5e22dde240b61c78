"""What a node has heard about each round: a thread-safe book with blocking waits.

The gossip consumer thread files every accepted message here; the round loop
and the chain worker wait on it with deadlines. Pure bookkeeping: no network,
no torch, no chain.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from node.protocol import Attestation, Close, Hello

T = TypeVar("T")

#: A peer not heard from (hello or any round message) for this long is treated as gone and
#: is not expected in a round. Generous: a node busy training on a loaded machine can leave
#: its heartbeat thread waiting for the GIL for several seconds.
PEER_TTL_S = 20.0
#: (peer, envelope hash) pairs kept per (round, stage): one per member, a second per equivocator
#: (the validator refuses a third envelope of a slot as a replay or equivocation alike).
MAX_ANNOUNCED_PER_SLOT = 8192
#: Signers of hellos kept at most (any key can sign a hello of the run; members say hello every second):
#: past this, the half heard from longest ago is dropped, so peer ids that came and went (a member that
#: left, a flood of made-up keys) do not grow the book for the node's life.
MAX_PEERS = 4096


@dataclass(frozen=True)
class Announced:
    peer_id: str
    replica: int
    envelope_hash: bytes
    size: int


@dataclass
class PeerInfo:
    peer_id: str
    public_key: bytes
    hello: Hello
    seen_at: float


class RoundBook:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.peers: dict[str, PeerInfo] = {}
        self.announces: dict[tuple[int, int], dict[str, Announced]] = defaultdict(dict)
        # Every (peer, envelope hash) a sender announced for (round, stage), a second, equivocating
        # announce included (which one a node saw first is timing): what a sliced close may name.
        self.announced: dict[tuple[int, int], set[tuple[str, bytes]]] = defaultdict(set)
        self.closes: dict[tuple[int, int], dict[str, tuple[Close, bytes]]] = defaultdict(dict)
        # first arrival, monotonic
        self.close_times: dict[tuple[int, int], dict[str, float]] = defaultdict(dict)
        self.equivocators: dict[tuple[int, int], set[str]] = defaultdict(set)  # signed two different closes
        # A lower-ranked coordinator's request to take over the close (first arrival, monotonic), and the
        # coordinators that signed they will not close (docs/PROTOCOL.md, "Closing a round").
        self.takeovers: dict[tuple[int, int], dict[str, float]] = defaultdict(dict)
        self.yields: dict[tuple[int, int], set[str]] = defaultdict(set)
        self.attestations: dict[tuple[int, int], dict[str, Attestation]] = defaultdict(dict)
        # round -> record digest -> (record, {signer address: 65-byte EIP-712 signature})
        self.signatures: dict[int, dict[bytes, tuple[object, dict[str, bytes]]]] = defaultdict(dict)
        # (round, signer) -> the first (digest, signature) it signed; a second, different one is evidence
        self._signed_by: dict[tuple[int, str], tuple[bytes, bytes]] = {}
        self.record_equivocations: list[tuple[int, str, tuple, tuple]] = []

    # -- filing (gossip thread) ------------------------------------------------
    def add_hello(self, peer_id: str, public_key: bytes, hello: Hello) -> None:
        with self._cond:
            if peer_id not in self.peers and len(self.peers) >= MAX_PEERS:
                for stale in sorted(self.peers, key=lambda p: self.peers[p].seen_at)[: MAX_PEERS // 2]:
                    del self.peers[stale]
            self.peers[peer_id] = PeerInfo(peer_id, public_key, hello, time.monotonic())
            self._cond.notify_all()

    def heard_from(self, peer_id: str) -> None:
        """Any signed message of a known peer shows it is alive."""
        with self._cond:
            info = self.peers.get(peer_id)
            if info is not None:
                info.seen_at = time.monotonic()

    def notify(self) -> None:
        """Wake every waiter (something they may be waiting for changed elsewhere)."""
        with self._cond:
            self._cond.notify_all()

    def add_announce(self, round_index: int, stage: int, item: Announced, first: bool = True) -> None:
        """File a signed announce; ``first=False``: a sender's second, different announce of the slot
        (equivocation), kept only as something a close may name, never as the sender's announce."""
        with self._cond:
            if first:
                self.announces[(round_index, stage)].setdefault(item.peer_id, item)
            hashes = self.announced[(round_index, stage)]
            if len(hashes) < MAX_ANNOUNCED_PER_SLOT:
                hashes.add((item.peer_id, item.envelope_hash))
            self._cond.notify_all()

    def was_announced(self, round_index: int, stage: int, peer_id: str, envelope_hash: bytes) -> bool:
        """Whether ``peer_id`` signed an announce of ``envelope_hash`` for (round, stage)."""
        with self._cond:
            return (peer_id, envelope_hash) in self.announced.get((round_index, stage), ())

    def add_close(self, round_index: int, stage: int, coordinator: str, close: Close,
                  envelope: bytes) -> None:
        with self._cond:
            self.closes[(round_index, stage)].setdefault(coordinator, (close, envelope))
            self.close_times[(round_index, stage)].setdefault(coordinator, time.monotonic())
            self._cond.notify_all()

    def add_close_equivocation(self, round_index: int, stage: int, coordinator: str) -> None:
        """``coordinator`` signed a second, different close of (round, stage): none of its closes counts."""
        with self._cond:
            self.equivocators[(round_index, stage)].add(coordinator)
            self._cond.notify_all()

    def add_takeover(self, round_index: int, stage: int, coordinator: str) -> None:
        with self._cond:
            self.takeovers[(round_index, stage)].setdefault(coordinator, time.monotonic())
            self._cond.notify_all()

    def add_yield(self, round_index: int, stage: int, coordinator: str) -> None:
        with self._cond:
            self.yields[(round_index, stage)].add(coordinator)
            self._cond.notify_all()

    def takeovers_of(self, round_index: int, stage: int) -> dict[str, float]:
        """Coordinators that asked to take over the close of (round, stage), with when it arrived."""
        with self._cond:
            return dict(self.takeovers.get((round_index, stage), {}))

    def yielded(self, round_index: int, stage: int) -> set[str]:
        """Coordinators that signed they will not close (round, stage)."""
        with self._cond:
            return set(self.yields.get((round_index, stage), ()))

    def add_attestation(self, round_index: int, stage: int, peer_id: str, att: Attestation) -> None:
        with self._cond:
            self.attestations[(round_index, stage)].setdefault(peer_id, att)
            self._cond.notify_all()

    def add_record_signature(self, round_index: int, digest: bytes, record: object, signer: str,
                             signature: bytes) -> None:
        """File a verified member signature over a round's record (``digest`` = its EIP-712 digest).

        A member that signed two different records of one round is kept in
        ``record_equivocations`` as ``(round, signer, (record, sig), (record, sig))``: proof enough
        on chain to slash it (TrainingLedger.reportEquivocation). Only its first record counts.
        """
        with self._cond:
            first = self._signed_by.setdefault((round_index, signer), (digest, signature))
            if first[0] != digest:
                first_record = self.signatures[round_index][first[0]][0]
                self.record_equivocations.append(
                    (round_index, signer, (first_record, first[1]), (record, signature)))
                return
            entry = self.signatures[round_index].setdefault(digest, (record, {}))
            entry[1].setdefault(signer, signature)
            self._cond.notify_all()

    def snapshot_signatures(self, round_index: int) -> dict[bytes, tuple[object, dict[str, bytes]]]:
        with self._cond:
            return {d: (rec, dict(sigs)) for d, (rec, sigs) in self.signatures.get(round_index, {}).items()}

    def take_record_equivocations(self) -> list[tuple[int, str, tuple, tuple]]:
        with self._cond:
            found, self.record_equivocations = self.record_equivocations, []
            return found

    # -- reading ---------------------------------------------------------------
    def snapshot_announces(self, round_index: int, stage: int) -> dict[str, Announced]:
        with self._cond:
            return dict(self.announces.get((round_index, stage), {}))

    def snapshot_attestations(self, round_index: int, stage: int) -> dict[str, Attestation]:
        with self._cond:
            return dict(self.attestations.get((round_index, stage), {}))

    def snapshot_closes(self, round_index: int, stage: int) -> dict[str, tuple[Close, bytes]]:
        with self._cond:
            return dict(self.closes.get((round_index, stage), {}))

    def close_age(self, round_index: int, stage: int, coordinator: str) -> float:
        """Seconds since ``coordinator``'s close of (round, stage) arrived (0 if it has not)."""
        with self._cond:
            since = self.close_times.get((round_index, stage), {}).get(coordinator)
            return 0.0 if since is None else time.monotonic() - since

    def first_close_at(self, round_index: int, stage: int) -> float | None:
        """When (monotonic) the first close of (round, stage) reached this node; None if none has."""
        with self._cond:
            times = self.close_times.get((round_index, stage))
            return min(times.values()) if times else None

    def close_equivocators(self, round_index: int, stage: int) -> set[str]:
        with self._cond:
            return set(self.equivocators.get((round_index, stage), ()))

    def live_peers(self, max_age: float) -> dict[str, PeerInfo]:
        now = time.monotonic()
        with self._cond:
            return {p: info for p, info in self.peers.items() if now - info.seen_at <= max_age}

    def wait_for(self, predicate: Callable[[], T | None], timeout: float,
                 stop: threading.Event | None = None) -> T | None:
        """Block until ``predicate()`` returns a non-None value, the timeout passes or ``stop`` is set."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                value = predicate()
                if value is not None:
                    return value
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (stop is not None and stop.is_set()):
                    return None
                self._cond.wait(min(remaining, 0.5))

    def forget_before(self, round_index: int) -> None:
        """Drop state of rounds older than ``round_index`` (bounds memory on long runs)."""
        with self._cond:
            for book in (self.announces, self.announced, self.closes, self.close_times, self.equivocators,
                         self.attestations, self.takeovers, self.yields):
                for key in [k for k in book if k[0] < round_index]:
                    del book[key]
            for key in [k for k in self.signatures if k < round_index]:
                del self.signatures[key]
            for key in [k for k in self._signed_by if k[0] < round_index]:
                del self._signed_by[key]
