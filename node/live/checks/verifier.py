"""Re-execution spot checks in a running node: start states, sampled reruns, accusations, verdicts, ejection.

Every contribution binds the hash of its replica's start state and of the data
it trained on (:class:`node.protocol.ContributionBody`); the node serves
its start states as blobs (:mod:`node.live.checks.heldstates`). Once round ``t`` is on
chain, each node draws, from the round's attested weights root, its own peer id
and the platforms the round's signers declared on chain when they joined, which
other replicas it re-executes (:func:`node.live.checks.routing.draw_checks`: ``spot_checks``
expected checks per contribution from everyone, and ``spot_checks`` expected ones by
verifiers of the claimant's declared platform where the run has any), fetches their start states and reruns
them in a child process (:mod:`node.live.checks.spotcheck`). A start state that claims
another platform than its signer declared is refused without a rerun (a mismatch:
:func:`node.platforms.undeclared_claim`).

A rerun that does not reproduce the contribution becomes signed evidence: an
``evidence`` envelope (the accused's contribution envelopes, the verifier's
result), kept under ``evidence/`` and served as a blob. The verifier opens an
accusation on chain (``accuse``: the accused can no longer withdraw), gossips
it, and signs a guilty verdict. Every other member that hears the accusation
reruns the same contribution itself and signs its own verdict, guilty or not.
Once the accusation's quorum of members other than the accused signed the same
verdict, any of them submits ``resolveAccusation``: a guilty verdict slashes the
accused and removes it from the run, and every node stops counting its messages.
One verifier alone can never eject anyone (docs/PROTOCOL.md, "Spot checks").

Nodes also watch the run's ``AccusationOpened`` events on chain, so an accusation
that was never gossiped is judged too: if its evidence blob is not served within
:data:`node.live.checks.tribunal.EVIDENCE_FETCH_TIMEOUT_S`, or is not an evidence envelope naming the accused,
the node signs a not-guilty verdict (an accuser must serve its evidence; its bond
is forfeited); otherwise it confirms it as a gossiped one. An accusation that no
verdict decides lapses on chain at its deadline (docs/LEDGER.md, "Accusations").

This module samples and reruns; accusing, confirming, judging and resolving are
:class:`node.live.checks.tribunal.Tribunal`'s, which :class:`SpotChecker` extends. The two halves
run on two threads (:class:`node.live.checks.jobqueue.JobQueue`): the reruns one at a time, and the
tribunal's work, which never waits behind a rerun. At a run's normal end the queued checks get
``spot_check_drain_s`` more (:meth:`SpotChecker.drain`); what a stop leaves is counted
(:attr:`SpotChecker.left_undone`, ``spot_checks_left_undone`` in status.json).
"""

from __future__ import annotations

import logging
import queue
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ledger.errors import LedgerError
from node import protocol as msg
from node.errors import NodeError
from node.live.checks.heldstates import HeldStates
from node.live.checks.jobqueue import JobQueue
from node.live.checks.routing import draw_checks
from node.live.checks.admission import RerunAdmission
from node.live.checks.spotcheck import RerunWorker, SpotCheckResult
from node.live.checks.staterebuild import ReplayRound, StateReplay, rebuilds_start_states
from node.live.checks.spotinputs import HeardRound, InputsUnavailable, ReplicaInputs, heard_round
from node.live.checks.tribunal import COURT, Tribunal
from p2p.envelope import Envelope
from p2p.errors import P2PError
from training.reexec import EXACT, check_state_chain, claimed_steps, restart_state_reason, start_global_round
from training.robust import OTHER_RESULT
from node.live.checks.rerun import ContributionRerun

logger = logging.getLogger(__name__)

#: A sampled check of a round this far behind the newest recorded one is skipped: the claimant
#: may no longer serve its start state, and a verifier must not fall ever further behind.
MAX_LAG_ROUNDS = 4
#: How often the node reads the run's accusations from the chain.
ACCUSATION_POLL_S = 10.0
#: Priorities of the rerun queue: a rerun another member's accusation waits on (its verdict) goes first,
#: then drawing a recorded round's checks (quick: no rerun), then the sampled checks, oldest round first.
RERUN_FOR_VERDICT, DRAW, CHECK = 0, 1, 2


@dataclass
class VerifierContext:
    cfg: object  # NodeConfig
    run_id: int
    peer_id: str
    chain: object  # NodeChain
    host: object  # P2PHost
    archive: object  # Archive
    membership: object  # Membership
    gossip: Callable  # (round, kind, message, stage) -> envelope bytes
    sign_envelope: Callable[[int, str, bytes], bytes]  # (round, kind, payload) -> signed envelope bytes
    stage_hashes: Callable[[int], dict[int, bytes]]  # round -> stage -> weights hash this node computed
    own_replica: Callable[[], int]
    # accusations and verdicts travel in envelopes of the sender's current round
    current_round: Callable[[], int]
    work_dir: Path
    evidence_dir: Path
    stop: threading.Event
    on_ejected: Callable[[str, bytes], None]  # (peer id, account) of a member found guilty
    # The round book's snapshot_closes / snapshot_attestations: a split node binds every stage's contributions
    # of a recorded round to the record from them
    # (node.live.checks.spotinputs). None: only sealed rounds are checked.
    closes: Callable | None = None
    attestations: Callable | None = None
    # Evidence another module builds and judges whole (the sliced exchange's wrong partial,
    # node.slicedproof): Evidence.verdict -> judge(evidence, accused peer) -> (guilty or None, why);
    # and the queue of its charges: (round, accused peer, replica, build(account) -> Evidence).
    evidence_judges: dict[str, Callable] = field(default_factory=dict)
    charges: queue.Queue | None = None
    # The exchange's own rerun inputs (node.live.exchange.protocol.Exchange.rerun_inputs: the sliced
    # exchange's claims are the slices its references bind, its
    # round t-1 the partials applied); None: the full exchange's.
    rerun_inputs: object | None = None
    # Peer ids -> the platform each declared on chain when it joined (NodeChain.declared_platforms; raises
    # LedgerError if unreadable). None: no declarations (no routing, no declared-platform check).
    declared_platforms: Callable[[list[str]], dict[str, bytes]] | None = None
    # (round, account, evidence hash) of each accusation this node opened on chain (the case opener follows
    # it up: node/live/fraud/opener.py); None: not followed
    on_accused: Callable[[int, bytes, bytes], None] | None = None


class SpotChecker(ContributionRerun, Tribunal):
    """Serves start states; checks sampled contributions; accuses, confirms and resolves (module
    docstring)."""

    def __init__(self, ctx: VerifierContext) -> None:
        self.ctx = ctx
        self.states = HeldStates(ctx.host, ctx.work_dir, ctx.evidence_dir, ctx.cfg.pipeline.num_stages,
                                 ctx.stop)
        if rebuilds_start_states(ctx.cfg):  # one kept every start_state_every rounds, the others rebuilt
            self.states.rebuild_others(ctx.cfg.storage.start_state_every,
                                       StateReplay(ctx.cfg.to_dict(), ctx.work_dir, self.replay_round))
        self._newest = -1
        self._worker = RerunWorker(ctx.work_dir / "worker.log")
        self._admission = RerunAdmission()  # host-wide, by memory (spot_check_memory_wait_s)
        self._results: dict[tuple[int, int], SpotCheckResult | None] = {}  # (round, replica) -> result
        # evidence hash -> (round, accusation)
        self._accusations: dict[bytes, tuple[int, msg.Accusation]] = {}
        self._verdicts: dict[tuple[bytes, bool], dict[str, bytes]] = {}  # (evidence, guilty) -> signer -> sig
        self._resolved: set[bytes] = set()
        self._verdict_quorums: dict[bytes, int] = {}  # evidence hash -> the accusation's quorum on chain
        self._on_chain: dict[bytes, float] = {}  # evidence hash -> when the chain watch first saw it open
        self._watched_block: int | None = None  # the chain watch reads accusations from this block on
        self._watched_at = time.monotonic()
        self._lock = threading.Lock()
        self.inputs = ReplicaInputs(archive=ctx.archive, host=ctx.host, membership=ctx.membership,
                                    run_id=ctx.run_id, peer_id=ctx.peer_id,
                                    num_stages=ctx.cfg.pipeline.num_stages,
                                    max_blob_bytes=ctx.cfg.p2p.max_blob_bytes,
                                    work_dir=ctx.work_dir / "fetch")
        self.checks_run = 0
        self.check_seconds = 0.0  # wall time of the checks done (fetching the inputs and the rerun)
        self.state_bytes_fetched = 0  # the claimants' start states fetched for the checks (issue 75's model)
        self.state_fetches = 0  # the checks whose start states those are (counted at the fetch, with them)
        self.not_done = 0  # sampled checks whose inputs could not be had: nobody is accused for those
        # round t -> t+1 start-state links checked (node.live.checks.verifier._chain_holds)
        self.chain_checks = 0
        self.routed = 0  # checks only the same-platform draw picked (node.live.checks.routing)
        self.mismatches = 0
        self.skipped = 0
        self.abandoned = 0  # checks cut short because the node stopped
        # Two threads: the reruns, one at a time in one child process (they take no more of the machine than
        # one rerun does), and the tribunal's work, which never
        # waits behind a rerun (node/live/checks/jobqueue.py).
        self._reruns = JobQueue("spotcheck", {"draw": self._draw, "check": self._check_sampled,
                                              "link": self._link, "verdict": self._judge_by_rerun}, ctx.stop)
        self._court = JobQueue("tribunal", {"watch": self._watch_chain, "charge": self.charge,
                                            "accuse": self._accuse, "confirm": self._confirm,
                                            "chain": self._judge_chain_accusation, "resolve": self._resolve},
                               ctx.stop, tick=self._court_tick)
        # Started once both exist: the court's tick reads self._court, its first tick comes at once.
        self._reruns.start()
        self._court.start()

    def serve_start_states(self, outer_round: int, parts: dict[int, bytes]) -> dict[int, bytes]:
        """Serve this node's start-state parts of ``outer_round``; stage -> state hash (what the envelope
        binds)."""
        # kept until the retention (node/store/retention.py, in the finisher's tail) lets the round go
        return self.states.serve(outer_round, parts, 0)

    def replay_round(self, outer_round: int) -> ReplayRound:
        """What a replay of this node's own round ``outer_round`` reads (node/live/checks/staterebuild.py):
        round ``outer_round - 1`` as this node applied it, from its archive, as a spot check's rerun reads
        it; raises NodeError (InputsUnavailable) where it is not kept."""
        replica, previous_round = self.ctx.own_replica(), outer_round - 1
        sliced = self.ctx.rerun_inputs
        inputs = ReplayRound()
        if previous_round >= 0:
            if sliced is None:
                inputs.previous, inputs.excluded = self._previous_round(previous_round)
            else:
                inputs.partials = sliced.previous(previous_round)
            sealed = self.inputs.contributions(previous_round) or []
            held = {c.stage for c in sealed if c.replica == replica}
            inputs.dropped = [s for s in range(self.ctx.cfg.pipeline.num_stages) if s not in held]
        if self.ctx.cfg.diloco.budgeted:
            env = self._envelopes_of(outer_round, replica)[0]
            inputs.declared_steps = claimed_steps(msg.decode_contribution_body(env.payload).blob)
        if self.ctx.cfg.training.data_windows == "account":
            inputs.data_key = self._data_key(self._envelopes_of(outer_round, replica))
        return inputs

    # -- sampling -----------------------------------------------------------------------
    def on_recorded(self, outer_round: int, weights_root: bytes) -> None:
        """Round ``outer_round`` is on chain with ``weights_root``: draw this node's checks of it."""
        if self.ctx.cfg.spot_checks <= 0:
            return
        self._newest = max(self._newest, outer_round)
        heard = None
        if self.ctx.closes is not None and self.ctx.attestations is not None:
            # Now, on the committer's thread: the book forgets the round's closes a few rounds on.
            heard = heard_round(outer_round, self.ctx.cfg.pipeline.num_stages, self.ctx.closes,
                                self.ctx.attestations, self.ctx.stage_hashes(outer_round) or {},
                                self.ctx.cfg.commitment_scheme)
        self._reruns.put(DRAW, "draw", outer_round, weights_root, heard)

    def _record(self, outer_round: int, weights_root: bytes, heard: HeardRound) -> None:
        """Keep the round's contributions of every stage as its record on chain binds them (spotinputs)."""
        try:
            record = self.ctx.chain.commit_of(self.ctx.run_id, outer_round)
            if record is None or record.weights_root != weights_root:
                raise InputsUnavailable("the chain's record is not the one this round was recorded with")
            self.inputs.record(outer_round, heard, record.contributions_root, record.weights_root)
        except (LedgerError, InputsUnavailable) as exc:
            logger.warning("round %d: its contributions of every stage are not bound to the record here: %s",
                           outer_round, exc)

    def _lagging(self, outer_round: int) -> bool:
        return outer_round < self._newest - MAX_LAG_ROUNDS

    def _draw(self, outer_round: int, weights_root: bytes, heard: HeardRound | None = None) -> None:
        """Draw the round's checks (one ``check`` job per replica drawn), then its chain ``link`` job."""
        if heard is not None:
            self._record(outer_round, weights_root, heard)
        sealed = self.inputs.contributions(outer_round)
        if sealed is None:
            return
        signers: dict[int, set[str]] = {}  # replica -> its stages' signers (several on a split cluster)
        for c in sealed:
            signers.setdefault(c.replica, set()).add(c.peer_id)
        try:
            declared = self._declared({peer for peers in signers.values() for peer in peers})
        except LedgerError as exc:  # no draw on a partial view: every node must derive the same checks
            logger.warning(
                "round %d: no spot checks drawn, the members' declared platforms are not readable: %s",
                outer_round, exc)
            return
        drawn = draw_checks(weights_root, self.ctx.peer_id, outer_round, signers, declared,
                            self.ctx.cfg.spot_checks, self.ctx.own_replica())
        self.routed += sum(check.same_platform for check in drawn)
        chosen = [check.replica for check in drawn]
        # Contributions the holders left out as built on another result of round t-1 (a forked member's
        # round, docs/PROTOCOL.md "When a node's weights leave the record"): not reruns of the record.
        elsewhere = self._left_out_elsewhere(outer_round)
        for replica in chosen:
            if replica in elsewhere:
                logger.info(
                    "spot check of replica %d round %d not run: left out of the round as built on another "
                    "result of round %d", replica, outer_round, outer_round - 1)
                continue
            self._reruns.put(CHECK, "check", outer_round, replica, signers[replica])
        self._reruns.put(CHECK, "link", outer_round, signers)

    def _declared(self, peers, fresh: bool = False) -> dict[str, bytes]:
        """peer id -> the platform it declared when it joined (node.live.checks.routing; {} if none are known
        here)."""
        return {} if self.ctx.declared_platforms is None else self.ctx.declared_platforms(sorted(peers),
                                                                                          fresh)

    def _ejected(self, signers: set[str]) -> bool:
        return any(self.ctx.membership.ejected(peer) for peer in signers)

    def _check_sampled(self, outer_round: int, replica: int, signers: set[str]) -> None:
        """One drawn check: rerun; a contribution that does not reproduce goes to the tribunal's thread."""
        if self._lagging(outer_round):
            self.skipped += 1
            logger.info("spot check of replica %d round %d skipped: %d rounds behind the chain", replica,
                        outer_round, self._newest - outer_round)
            return
        if self._ejected(signers):
            return  # already found guilty and removed: nothing left to decide
        result = self._check(outer_round, replica)
        if result is not None and result.elsewhere:
            logger.warning("spot check of replica %d round %d: %s (not accused: a forked member's round)",
                           replica, outer_round, result.reason)
        elif result is not None and result.undecided:
            logger.warning("spot check of replica %d round %d undecided, not accused: %s", replica,
                           outer_round, result.reason)
        elif result is not None and not result.honest:
            self._court.put(COURT, "accuse", outer_round, replica, result)

    def _link(self, outer_round: int, signers: dict[int, set[str]]) -> None:
        """The chain: every replica this node reran exactly in round t-1 must start round t where that rerun
        ended (or from the record, after a restart).

        Done however far behind the chain this node is (no :meth:`_lagging` skip): the rerun of round t-1, the
        costly half, is done already, and a link whose hashes chain costs one comparison. Skipping it on the
        lag, as before, skipped every link on a loaded machine (each link's turn came after its round's checks
        had put the node behind), so a member forging its start state between rounds went uncaught for as long
        as the load lasted (tests/test_reexec_e2e.py's forge-state, caught at round 94 of 100 at load 30)."""
        with self._lock:
            linked = [(replica, result) for (r, replica), result in self._results.items()
                      if r == outer_round - 1 and result is not None and result.next_state_hashes is not None]
        for replica, result in linked:
            if replica not in signers or self._ejected(signers[replica]):
                continue
            try:
                next_envs = self._envelopes_of(outer_round, replica)
            except NodeError:
                continue  # not whole in round t's close: no link to check
            holds, reason, parts, broken = self._chain_holds(outer_round - 1, replica, result, next_envs)
            self.chain_checks += holds is not None
            if holds is False:
                self.mismatches += 1
                # The evidence: the state the chain does not lead to, and the start state of the rerun
                # that shows where it should have led (an auditor reruns round t from it; the accused
                # stops serving its own copy after STATE_ROUNDS_KEPT rounds, or at will).
                self.states.keep_evidence(self.states.linkable(outer_round - 1, replica) + parts)
                logger.warning("chain check of replica %d rounds %d-%d: %s", replica, outer_round - 1,
                               outer_round, reason)
                self._court.put(COURT, "accuse", outer_round - 1, replica,
                                SpotCheckResult("state_mismatch", reason, {}, 0.0, failed_stages=broken),
                                next_envs)
        self.states.forget_linkable(before=outer_round)

    def _left_out_elsewhere(self, outer_round: int) -> set[int]:
        """Replicas whose contribution of the round this node's archive sealed as left out, built on another
        result of the round before (node.binding.other_result_exclusions)."""
        try:
            return {int(replica) for _stage, replica, _peer, _digest, reason, _detail in
                    self.ctx.archive.excluded(outer_round) if reason == OTHER_RESULT}
        except NodeError as exc:
            logger.warning("round %d: its exclusions are not readable here: %s", outer_round, exc)
            return set()

    def _chain_holds(self, outer_round: int, replica: int, result: SpotCheckResult,
                     next_envs: list[Envelope]) -> tuple[bool | None, str, list[bytes], tuple[int, ...]]:
        """Whether round t+1's start state of ``replica`` is where the exact rerun of round t led, or a
        restart's state rebuilt from the record (None: could not tell, e.g. the state was not served);
        the reason; the state parts fetched (none if the hashes chained); the stages whose state follows
        from neither (their signers are the ones a broken chain accuses)."""
        claimed = [msg.decode_contribution_body(e.payload).state_hash for e in next_envs]
        if check_state_chain(result.next_state_hashes, claimed) == EXACT:
            return True, "chained", [], ()
        job_dir = self.ctx.work_dir / f"chain-{outer_round + 1:08d}-replica{replica}"
        shutil.rmtree(job_dir, ignore_errors=True)
        job_dir.mkdir(parents=True, exist_ok=True)
        try:
            parts = self.states.fetch(next_envs, claimed, job_dir)
        except (P2PError, OSError) as exc:
            logger.warning("chain check of replica %d round %d not done: %s", replica, outer_round + 1, exc)
            return None, str(exc), [], ()
        finally:
            shutil.rmtree(job_dir, ignore_errors=True)
            self.states.drop_fetched(claimed)
        committed = self._committed(range(outer_round - 2, outer_round + 1))
        global_round = start_global_round(self.ctx.cfg.diloco, outer_round + 1)
        # Stage by stage: a split replica's stages are signed by different members, each for its own part.
        reasons = {stage: restart_state_reason([part], [claimed[stage]], committed, global_round)
                   for stage, part in enumerate(parts) if claimed[stage] != result.next_state_hashes[stage]}
        broken = tuple(stage for stage, why in reasons.items() if why is not None)
        if not broken:
            logger.info("replica %d entered round %d from the record (a restart): its chain starts again",
                        replica, outer_round + 1)
            return True, "restarted from the record", parts, ()
        why = "; ".join(reasons[stage] for stage in broken)
        return False, (f"its round {outer_round + 1} start state follows neither from the rerun of round "
                       f"{outer_round} nor from the record: {why}"), parts, broken

    # -- the threads ----------------------------------------------------------------------
    def _rerun_then_judge(self, *args) -> None:
        """Queue the rerun another member's accusation needs, ahead of the sampled checks (its verdict follows
        it on the rerun thread: :meth:`Tribunal._judge_by_rerun`)."""
        self._reruns.put(RERUN_FOR_VERDICT, "verdict", *args)

    def _court_tick(self) -> None:
        """Between the tribunal's jobs: the chain's accusations every ACCUSATION_POLL_S, the exchange's
        charges."""
        if time.monotonic() - self._watched_at >= ACCUSATION_POLL_S:
            self._watched_at = time.monotonic()
            self._court.put(COURT, "watch")
        while self.ctx.charges is not None:
            try:
                self._court.put(COURT, "charge", *self.ctx.charges.get_nowait())
            except queue.Empty:
                break

    @property
    def pending_checks(self) -> int:
        """Sampled checks drawn and not run yet."""
        return self._reruns.pending("check")

    def idle(self) -> bool:
        """Nothing queued or in flight on either thread, and no charge waiting to be taken."""
        return (self._reruns.pending() == 0 and self._reruns.running is None and self._court.pending() == 0
                and self._court.running is None and (self.ctx.charges is None or self.ctx.charges.empty()))

    def drain(self, timeout: float) -> int:
        """At a run's normal end: let the queued checks and charges run for up to ``timeout`` seconds (the
        node still serves its peers meanwhile); return the sampled checks still queued."""
        deadline = time.monotonic() + timeout
        if not self.idle():
            logger.info("the run is over: finishing the spot checks and charges still queued or running (%d "
                        "check(s) not started; at most %.0fs)", self.pending_checks, timeout)
        while not self.idle() and not self.ctx.stop.is_set() and time.monotonic() < deadline:
            self.ctx.stop.wait(0.2)
        return self.pending_checks

    @property
    def left_undone(self) -> int:
        """Sampled checks not done because the node stopped: still queued, or cut short."""
        return self.pending_checks + self.abandoned

    def close(self) -> None:
        """Stop both threads (``ctx.stop`` is set by the owner) and the rerun child; log what is left
        undone."""
        self._court.join(timeout=5)
        self._reruns.join(timeout=5)
        self._worker.close()
        self.states.close()
        undone, undrawn = self.left_undone, self._reruns.pending("draw")
        if undone or undrawn:
            logger.warning("spot checks left undone at stop: %d sampled check(s)%s", undone,
                           f", {undrawn} recorded round(s) not drawn" if undrawn else "")
