"""How a run with a round limit ends for a node: once its last round is committed, or provably cannot be.

A node that has trained and finished the run's last round does not leave at once: the
chain may not hold the round yet, and peers may still need what this node serves (its
attestations and record signatures, which the committer says again until a quorum
forms; its stage shards and the assembled checkpoints; the archive a restarted member
catches up from). Before, a node stopped after one round timeout, "before every stage
was attested", while its partner still had work, and the run's last round was never
committed. Now it keeps its host, gossip and committer up (:meth:`RunEnd.await_last_commit`)
until, and says which:

- the chain holds the run's last round ("committed");
- fewer members are live (this node and the placed peers heard from) than the run's
  quorum of record signatures, for two round timeouts: no record can gather its
  signatures ("cannot be committed: N live members for a quorum of k");
- the chain's last round has not moved for ``STALL_ROUNDS`` round timeouts while
  enough members were live: every one of them waits as well ("cannot be committed:
  no progress");
- the node is asked to stop.

Then, if its fraud prover keeps a proof waiting for its parent round's window (issue 62: a proof of t waits
until t - 1 can no longer be overturned) or plays an availability game whose answers may come only in the last
block of each window, the node stays up while the settlement loop sends or settles it, at most
``STALL_ROUNDS`` round timeouts (a chain that mines only on transactions may never get there: the proof is
kept in ``proofs/`` and the next ``dlx-node start`` sends it).
"""

from __future__ import annotations

import logging
import threading
import time

from node.config import NodeConfig
from node.errors import DLX_ERRORS
from node.live.peers.membership import Membership
from node.live.chain.onchain import NodeChain
from node.live.state.status import Reporter

logger = logging.getLogger(__name__)

#: The last commit is waited for at most this many round timeouts without the chain's last round moving.
STALL_ROUNDS = 10
#: How often the wait says what it waits for.
REPORT_EVERY_S = 60.0
#: How often the chain and the peers are looked at.
POLL_S = 2.0


class RunOverWatch:
    """Whether the chain holds run ``run_id``'s last round (issue 80: a node still waiting for a close then
    stops with the run-over code instead of waiting forever), read at most every ``every`` seconds; never for
    an open-ended run, and not while the chain does not answer."""

    def __init__(self, chain: NodeChain, run_id: int, every: float = 15.0, clock=time.monotonic) -> None:
        self.chain, self.run_id, self.every, self.clock = chain, run_id, every, clock
        self._read_at: float | None = None
        self.over = False

    def __call__(self) -> bool:
        now = self.clock()
        if self.over or (self._read_at is not None and now - self._read_at < self.every):
            return self.over
        self._read_at = now
        try:
            info = self.chain.run_info(self.run_id)  # None: a chain face with no run (test_node_assembly's)
            last = info.max_rounds if info is not None else 0
            self.over = bool(last) and self.chain.last_round(self.run_id) >= last - 1
        except DLX_ERRORS as exc:
            logger.debug("the run's last round was not read (%s)", exc)
        return self.over


class RunEnd:
    """See module docstring."""

    def __init__(self, *, cfg: NodeConfig, chain: NodeChain, membership: Membership, reporter: Reporter,
                 peer_id: str, stop: threading.Event, clock=time.monotonic) -> None:
        self.cfg = cfg
        self.run_id = cfg.ledger.run_id
        self.chain = chain
        self.membership = membership
        self.reporter = reporter
        self.peer_id = peer_id
        self.stop = stop
        self._clock = clock
        self.prover = None  # the run's FraudProver, where the run is fraud-provable (set by the assembly)

    def await_last_commit(self) -> str:
        """Wait until the run's last round is on chain or provably cannot be; return which (one line)."""
        last = self.cfg.rounds - 1
        self.reporter.set_state("ending")
        started = moved = reported = self._clock()
        seen, short_since = None, None
        while not self.stop.is_set():
            now = self._clock()
            try:
                committed, quorum = self.chain.last_round(self.run_id), self.chain.quorum_of(self.run_id)
            except DLX_ERRORS as exc:  # an RPC outage: the rounds wait for the chain, so does the end
                logger.debug("chain read failed while waiting for the run's last commit: %s", exc)
                self.stop.wait(POLL_S)
                continue
            if committed >= last:
                self._send_kept_proofs()
                return self._ended(f"round {last}, the run's last, is committed")
            if committed != seen:
                seen, moved = committed, now
            live = len((self.membership.alive() & set(self.membership.placed_peers())) - {self.peer_id}) + 1
            short_since = (short_since or now) if live < quorum else None
            if short_since is not None and now - short_since >= 2 * self.cfg.round_timeout:
                return self._ended(f"round {last} cannot be committed: {live} live member(s) for a quorum of "
                                   f"{quorum} record signatures (last committed round {committed})")
            if now - moved >= STALL_ROUNDS * self.cfg.round_timeout:
                return self._ended(
                    f"round {last} cannot be committed: the chain's last round ({committed}) has "
                    f"not moved for {now - moved:.0f}s with {live} live member(s)")
            if now - reported >= REPORT_EVERY_S:
                reported = now
                logger.info("the run ends at round %d: waiting for it on chain (last committed %d, %d live "
                            "member(s), quorum %d, %.0fs so far); still serving peers", last, committed, live,
                            quorum, now - started)
            self.stop.wait(POLL_S)
        return "stopped before the run's last round was committed"

    def _send_kept_proofs(self) -> None:
        """Stay up while the prover's kept proofs wait for their parents' windows (module docstring)."""
        waiting = self.prover.open_rounds() if self.prover is not None else []
        if not waiting:
            return
        logger.warning("the run is over; staying up to send the proof(s) of round(s) %s once their parent "
                       "rounds' windows close, or their availability games are over", waiting)
        deadline = self._clock() + STALL_ROUNDS * self.cfg.round_timeout
        while waiting and not self.stop.is_set() and self._clock() < deadline:
            self.stop.wait(POLL_S)
            waiting = self.prover.open_rounds()
        if waiting:
            logger.error("the proof(s) of round(s) %s not sent yet (the chain has not reached their window): "
                         "kept in proofs/, the next `dlx-node start` sends them", waiting)

    @staticmethod
    def _ended(why: str) -> str:
        logger.info("run over: %s", why)
        return why
