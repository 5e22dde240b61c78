"""The spot checker's two threads: a charge is opened while a rerun is in flight; queued checks at the end.

The spot checker is the real one (node/live/checks/verifier.py with its tribunal and queues); the boundary is
faked: the chain (accuse, sign), the host (serve), the archive (a sealed round of three replicas) and
the rerun itself, which a subclass makes as slow as the test says (a rerun is a child process that takes
tens of seconds on a real model: tests/test_spotchecks.py runs real ones).
"""

from __future__ import annotations

import math
import queue
import threading
import time
from types import SimpleNamespace

from node import protocol as msg
from node.errors import NodeError
from node.live.checks.spotcheck import SpotCheckResult
from node.live.checks.verifier import SpotChecker, VerifierContext
from node.store.archive import ArchivedContribution
from p2p.envelope import Envelope
from p2p.identity import Identity

RUN = 7
CHEATER = b"c" * 20


class SlowReruns(SpotChecker):
    """Reruns that end only when the test releases them (or the node stops under them)."""

    def __init__(self, ctx: VerifierContext) -> None:
        self.rerun_started = threading.Event()
        self.release = threading.Event()
        self.reran: list[tuple[int, int]] = []
        super().__init__(ctx)

    def _rerun(self, outer_round: int, replica: int) -> SpotCheckResult:
        self.rerun_started.set()
        while not self.release.wait(0.05):
            if self.ctx.stop.is_set():
                raise NodeError("the rerun worker was closed under the check")
        self.reran.append((outer_round, replica))
        return SpotCheckResult("exact", "reproduced", {0: 0.0}, 0.1)


class Chain:
    """The chain boundary: accusations are kept; a verdict signature is its fields."""

    account_bytes = b"m" * 20

    def __init__(self) -> None:
        self.accused: list[tuple[str, bytes]] = []

    def accuse(self, run_id, accused, evidence_hash) -> None:
        self.accused.append((accused, evidence_hash))

    def sign_verdict(self, verdict) -> bytes:
        return verdict.evidence_hash + bytes([verdict.guilty])

    def accusation(self, *_a):
        return None  # the run's k is the quorum

    def run_info(self, _run_id):
        return SimpleNamespace(quorum=2)


def _checker(tmp_path, stop: threading.Event) -> tuple[SlowReruns, Chain, list, queue.Queue]:
    me = Identity.generate()
    sealed = [ArchivedContribution(0, replica, f"peer-{replica}", bytes([replica]) * 32)
              for replica in range(3)]
    gossiped: list = []
    charges: queue.Queue = queue.Queue()
    chain = Chain()
    ctx = VerifierContext(
        cfg=SimpleNamespace(spot_checks=8.0, p2p=SimpleNamespace(max_blob_bytes=1 << 20),
                            pipeline=SimpleNamespace(num_stages=1)),
        run_id=RUN, peer_id=me.peer_id, chain=chain, host=SimpleNamespace(provide_blob=lambda *_a, **_k: "h"),
        archive=SimpleNamespace(sealed=lambda r: sealed if r == 0 else None, recorded=lambda _r: None,
                                excluded=lambda _r: []),
        membership=SimpleNamespace(ejected=lambda _peer: False, book=SimpleNamespace(
            live_peers=lambda _age: {"peer-1": SimpleNamespace(hello=SimpleNamespace(account=CHEATER))})),
        gossip=lambda *a: gossiped.append(a),
        sign_envelope=lambda r, kind, payload: Envelope.create(me, RUN, r, kind, payload).to_bytes(),
        stage_hashes=lambda _r: {}, own_replica=lambda: 0, current_round=lambda: 3,
        work_dir=tmp_path / "work", evidence_dir=tmp_path / "evidence", stop=stop,
        on_ejected=lambda *_a: None, charges=charges)
    return SlowReruns(ctx), chain, gossiped, charges


def _wait(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_charge_is_opened_while_a_rerun_is_in_flight(tmp_path):
    """Round 0 is recorded: this node draws replicas 1 and 2 and reruns replica 1, slowly. Meanwhile the
    exchange raises a charge against replica 1's signer (self-contained evidence, as a wrong sliced
    partial's): it is accused on chain, the accusation gossiped and our guilty verdict signed while the rerun
    is still running; the reruns then go on, one at a time."""
    stop = threading.Event()
    checker, chain, gossiped, charges = _checker(tmp_path, stop)
    try:
        checker.on_recorded(0, b"w" * 32)
        assert checker.rerun_started.wait(60), "the sampled rerun did not start"

        def build(account: bytes) -> msg.Evidence:
            return msg.Evidence(account, 1, [b"the accused's signed partial"], "wrong-partial",
                                "slice 3 differs", [math.inf])

        charges.put((0, "peer-1", 1, build))
        _wait(lambda: any(kind == msg.VERDICT for _r, kind, _m in gossiped),
              "no verdict signed on the charge")
        assert not checker.release.is_set() and checker.reran == []  # the rerun is still in flight
        [(accused, evidence_hash)] = chain.accused
        assert accused == "0x" + CHEATER.hex()
        kinds = [(kind, getattr(m, "evidence_hash", None), getattr(m, "guilty", None))
                 for _r, kind, m in gossiped]
        assert kinds == [(msg.ACCUSATION, evidence_hash, None), (msg.VERDICT, evidence_hash, True)]
        assert checker.pending_checks == 1  # replica 2's check waits its turn behind replica 1's

        checker.release.set()
        assert checker.drain(60) == 0
        assert checker.reran == [(0, 1), (0, 2)] and checker.checks_run == 2 and checker.left_undone == 0
    finally:
        stop.set()
        checker.close()


def test_queued_checks_are_drained_at_the_end_and_counted_undone_at_a_stop(tmp_path):
    """A drain lets queued checks run (bounded); what is still queued or cut short when the node stops is
    counted as left undone, and no check starts after the stop."""
    stop = threading.Event()
    checker, _chain, _gossiped, _charges = _checker(tmp_path, stop)
    try:
        checker.on_recorded(0, b"w" * 32)
        assert checker.rerun_started.wait(60)
        # The first rerun does not end: a short drain gives up with the second check still queued.
        assert checker.drain(0.5) == 1 and not checker.idle()
    finally:
        stop.set()
        checker.close()
    _wait(lambda: checker.abandoned == 1, "the rerun in flight was not cut short at the stop")
    assert checker.left_undone == 2 and checker.reran == [] and checker.checks_run == 0

    stop = threading.Event()
    checker, _chain, _gossiped, _charges = _checker(tmp_path / "again", stop)
    checker.release.set()
    try:
        checker.on_recorded(0, b"w" * 32)
        assert checker.drain(60) == 0 and checker.idle()
        assert checker.reran == [(0, 1), (0, 2)] and checker.left_undone == 0
    finally:
        stop.set()
        checker.close()
