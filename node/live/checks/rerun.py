"""Rerunning a member's contribution: its envelopes, the committed inputs, the rerun job and
its result (the SpotChecker's)."""

from __future__ import annotations

import logging
import shutil
import time

from ledger.errors import LedgerError
from node import protocol as msg
from node.errors import NodeError
from node.live.checks.admission import rerun_need
from node.live.checks.heldstates import STATE_ROUNDS_KEPT
from node.live.checks.spotcheck import SpotCheckJob, SpotCheckResult
from node.platforms import undeclared_claim
from p2p.envelope import Envelope
from p2p.errors import EnvelopeRejected, P2PError
from training.robust import CALLER_REASONS

logger = logging.getLogger(__name__)


#: A rerun that takes longer than this is abandoned (no verdict, nobody accused).
RERUN_TIMEOUT_S = 900.0


class ContributionRerun:
    """Rerunning a member's contribution (see the module docstring)."""

    # -- one check ----------------------------------------------------------------------
    def _check(self, outer_round: int, replica: int) -> SpotCheckResult | None:
        """Rerun (outer_round, replica) once; None if it could not be checked (inputs missing, rerun
        failed)."""
        key = (outer_round, replica)
        with self._lock:
            if key in self._results:
                return self._results[key]
        started = time.monotonic()
        try:
            result = self._rerun(outer_round, replica)
        except (NodeError, P2PError, OSError, EnvelopeRejected) as exc:
            if self.ctx.stop.is_set():  # the node is stopping: the worker was closed under the check
                logger.info("spot check of replica %d round %d abandoned: the node is stopping", replica,
                            outer_round)
                self.abandoned += 1
                return None
            logger.warning("spot check of replica %d round %d not done: %s", replica, outer_round, exc)
            self.not_done += 1
            result = None
        seconds = time.monotonic() - started
        with self._lock:
            self._results[key] = result
            for old in [k for k in self._results if k[0] < outer_round - 4 * STATE_ROUNDS_KEPT]:
                del self._results[old]
        if result is not None:
            self.checks_run += 1
            self.check_seconds += seconds
            self.mismatches += 0 if result.honest or result.elsewhere or result.undecided else 1
            log = logger.info if result.honest else logger.warning
            log("spot check of replica %d round %d: %s (%s, rerun %.1fs, check %.1fs)", replica, outer_round,
                result.verdict, result.reason, result.seconds, seconds)
        return result

    def _envelopes_of(self, outer_round: int, replica: int) -> list[Envelope]:
        """The replica's envelopes of every stage as recorded (fetched from their holders if not held
        here)."""
        return self.inputs.envelopes(outer_round, replica)

    def _committed(self, rounds) -> dict[int, dict[int, bytes]]:
        """round -> stage -> weights hash on record: the record's (kept when it was recorded) over this
        node's own (which holds only its stages on a split cluster)."""
        out = {}
        for r in rounds:
            hashes = {**(self.ctx.stage_hashes(r) or {}), **self.inputs.committed(r)}
            if hashes:
                out[r] = hashes
        return out

    def _rerun(self, outer_round: int, replica: int) -> SpotCheckResult:
        cfg = self.ctx.cfg
        envs = self._envelopes_of(outer_round, replica)
        bodies = [msg.decode_contribution_body(e.payload) for e in envs]
        job_dir = self.ctx.work_dir / f"round-{outer_round:08d}-replica{replica}"
        shutil.rmtree(job_dir, ignore_errors=True)
        job_dir.mkdir(parents=True, exist_ok=True)
        try:
            sliced = self.ctx.rerun_inputs
            payloads = [b.blob for b in bodies] if sliced is None else sliced.claims(outer_round, envs)
            parts = self.states.fetch_files(envs, [b.state_hash for b in bodies], job_dir)
            self.state_bytes_fetched += sum(path.stat().st_size for path in parts)
            self.state_fetches += 1
            claimed = [(e.stage, e.sender_peer_id, part) for e, part in zip(envs, parts)]
            try:
                undeclared = undeclared_claim(claimed, self._declared(e.sender_peer_id for e in envs))
                if undeclared is not None:  # refused only on the chain's declarations as they are now
                    undeclared = undeclared_claim(claimed,
                                                  self._declared((e.sender_peer_id for e in envs), True))
            except LedgerError as exc:
                raise NodeError(f"the signers' declared platforms are not readable: {exc}") from exc
            if undeclared is not None:  # refused whatever a rerun would give: the evidence is the state
                self.states.keep_evidence([path.read_bytes() for path in parts])
                return SpotCheckResult("mismatch", undeclared[1], {}, 0.0, failed_stages=(undeclared[0],))
            if sliced is None:
                (previous, previous_excluded), partials = self._previous_round(outer_round - 1), {}
            else:
                previous, previous_excluded, partials = {}, {}, sliced.previous(outer_round - 1)
            committed = self._committed(range(outer_round - 3, outer_round))
            held = {c.stage for c in (self.inputs.contributions(outer_round - 1) or [])
                        if c.replica == replica}
            dropped = [s for s in range(cfg.pipeline.num_stages) if s not in held] if outer_round > 0 else []
            claims = [(e.stage, b.state_hash, b.data_commitment, p, b.applied_hash)
                      for e, b, p in zip(envs, bodies, payloads)]
            job = SpotCheckJob(cfg.to_dict(), outer_round, replica, claims, parts, previous,
                               previous_excluded, committed, previous_dropped=dropped,
                               previous_partials=partials, data_key=self._data_key(envs))
            job.write(job_dir)
            # The parts were never read here: fetched into files, moved into the job's (issue 75: the
            # claimant's whole start state, about 40 bytes per parameter of the model, beside a child of
            # about a node's size).
            state_files = job.state_paths(job_dir)
            del job, claimed, parts
            result = self._run_admitted(job_dir, state_files)
            if not result.honest and not result.undecided:
                # the start state the failed rerun used is part of the evidence
                self.states.keep_evidence([path.read_bytes() for path in state_files])
            elif result.next_state_hashes is not None:
                self.states.hold_linkable(outer_round, replica, state_files)
            return result
        finally:
            shutil.rmtree(job_dir, ignore_errors=True)
            self.states.drop_fetched([b.state_hash for b in bodies])

    def _data_key(self, envs) -> bytes | None:
        """The key the replica's windows were drawn by in a run keyed by account (``training.data_windows
        = "account"``; None otherwise): the account of the signer of its stage-0 contribution (the
        CONTRIBUTOR's, never this verifier's own unless it is that signer), as the run's seats bind it to the
        signing key."""
        if self.ctx.cfg.training.data_windows != "account":
            return None
        signer = next((e.sender_peer_id for e in envs if e.stage == 0), None)
        if signer == self.ctx.peer_id:
            return self.ctx.chain.account_bytes
        account = None if signer is None else self.ctx.membership.account_of(signer)
        if account is None:
            raise NodeError(f"no account known for the signer of the stage-0 contribution "
                            f"({str(signer)[-8:]}), whose account keys the replica's data windows")
        return account

    def _run_admitted(self, job_dir, state_files) -> SpotCheckResult:
        """The job run by the worker once the host can hold its child (node/live/checks/admission.py;
        ``spot_check_memory_wait_s`` = 0: at once)."""
        wait_s = self.ctx.cfg.spot_check_memory_wait_s
        if wait_s <= 0:
            return self._worker.run(job_dir, RERUN_TIMEOUT_S)
        need = rerun_need(sum(path.stat().st_size for path in state_files))
        reservation = self._admission.admit(need, wait_s, self.ctx.stop)
        try:
            return self._worker.run(job_dir, RERUN_TIMEOUT_S, on_start=reservation.set_child)
        finally:
            reservation.release()

    def _previous_round(self, outer_round: int) -> tuple[dict[int, list[bytes]], dict[int, dict[int, str]]]:
        """Round t-1's closed payloads per stage (canonical order) and its screening exclusions."""
        if outer_round < 0:
            return {}, {}
        sealed = self.inputs.contributions(outer_round)
        if sealed is None:
            raise NodeError(
                f"round {outer_round} is not sealed here; its contributions are needed for the rerun")
        previous: dict[int, list[bytes]] = {}
        index: dict[bytes, tuple[int, int]] = {}
        for c in sealed:  # every stage's (a split node fetches those of the stages it does not hold)
            payload = self.inputs.envelope(outer_round, c).payload
            stage_list = previous.setdefault(c.stage, [])
            index[c.envelope_hash] = (c.stage, len(stage_list))
            stage_list.append(msg.decode_contribution_body(payload).blob)
        excluded: dict[int, dict[int, str]] = {}
        for stage, _replica, _peer, digest_hex, reason, detail in self.ctx.archive.excluded(outer_round):
            # what the engine cannot re-derive
            if reason in CALLER_REASONS and bytes.fromhex(digest_hex) in index:
                s, i = index[bytes.fromhex(digest_hex)]
                excluded.setdefault(s, {})[i] = str(detail)
        return previous, excluded
