"""What a holder of a sliced run checks and accuses besides the exchange itself (docs/PROTOCOL.md, "Sliced
exchange").

A mixin of :class:`node.live.exchange.sliced.SlicedExchange`: spot checks of the partials a holder
applies, the judges of the sliced evidence kinds (a wrong partial, a bad bundle:
:mod:`node.slicedproof`), gathering that evidence and handing it to the spot checker
(``charges``), and the rerun inputs of re-execution spot checks (:mod:`node.live.checks.sliced_rerun`).
It reads the exchange's plans, pool, host and fetches; it holds no state of its own.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import random
import time
from dataclasses import dataclass

from node import protocol as msg
from node.errors import StateError
from node.fsutil import keep_evidence
from node.live.checks.sliced_rerun import SlicedRerunInputs
from node.slicedproof import (
    BAD_BUNDLE,
    WRONG_PARTIAL,
    CloseStanding,
    bad_bundle_evidence,
    decodes_strictly,
    judge_bad_bundle,
    judge_wrong_partial,
    usable_reference,
    wrong_partial_evidence,
)
from p2p.envelope import decode_envelope
from p2p.errors import EnvelopeRejected

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class UsedPartial:
    """The partial a holder used for one slice: who signed it (its turn in the fallback order) and its
    bytes."""

    slice_index: int
    turn: int
    envelope: bytes
    blob: bytes


def close_signers(book, outer_round: int, stage: int, close: msg.Close) -> list[str]:
    """The coordinators whose close of (round, stage) in ``book`` names ``close``'s set: each fetched
    every closed envelope and whole bundle before closing and serves them (docs/PROTOCOL.md)."""
    return [coordinator for coordinator, (other, _data) in book.snapshot_closes(outer_round, stage).items()
            if other.contributions == close.contributions]


class SlicedChecks:
    """Checks and accusations of a sliced exchange (module docstring)."""

    def spot_check_partials(self, outer_round: int, stage: int, close: msg.Close,
                            used: list[UsedPartial]) -> None:
        """Replay some of the partials this holder takes, each with probability ``spot_checks / (n - 1)``
        (drawn from this node's own randomness: an aggregator cannot know who checks it); one that differs
        from its replay is kept and accused (:meth:`charge`). It does not change what is applied (every
        holder applies the same partials); it makes a wrong partial that was the only one here cost its
        signer its stake. On the training thread: the replay's encoder must not share it with training."""
        members = len(close.contributions)
        rate = min(1.0, self.worker().cfg.spot_checks / max(1, members - 1))
        draw = random.SystemRandom()
        for partial in used:
            sender = decode_envelope(partial.envelope, self.max_blob_bytes).sender_peer_id
            if sender == self.peer_id or partial.turn < 0 or rate <= 0 or draw.random() >= rate:
                continue
            inputs, references, fetched = None, {}, {}
            signers = close_signers(self.pool.book, outer_round, stage, close)
            waited = time.monotonic() + self.turn_timeout
            while inputs is None and time.monotonic() < waited and not self.stop.is_set():
                inputs = self._slice_inputs(outer_round, stage, partial.slice_index, close, references,
                                            partial.turn, fetched, signers)
            if inputs is None:
                logger.info("round %d stage %d slice %d: spot check skipped: inputs not read", outer_round,
                            stage, partial.slice_index)
                continue
            if self.worker().aggregate_slice(stage, outer_round, partial.slice_index, inputs).partial \
                    == partial.blob:
                logger.info("round %d stage %d slice %d: spot check of %s's partial: it equals its replay",
                            outer_round, stage, partial.slice_index, sender[-8:])
                continue
            logger.warning(
                "round %d stage %d slice %d: spot check: the partial of %s differs from the replay of "
                "its inputs: a wrong partial", outer_round, stage, partial.slice_index, sender[-8:])
            self.keep_wrong_partial(outer_round, stage, partial.slice_index, partial.envelope)
            self.charge(outer_round, stage, close, partial.envelope,
                        f"slice {partial.slice_index}: its partial differs from the replay "
                        "of the inputs it binds")

    # -- accusing a wrong partial (node.slicedproof) --------------------------------------
    def evidence_judges(self, close_standing: CloseStanding) -> dict:
        """``close_standing``: the round coordinator's rule whether a proof's close is one the aggregators
        went by (:meth:`node.live.exchange.coordination.RoundCoordinator.close_standing`)."""
        return {WRONG_PARTIAL: functools.partial(self.judge_evidence, close_standing=close_standing),
                BAD_BUNDLE: self.judge_bad_bundle}

    def rerun_inputs(self) -> SlicedRerunInputs:
        return SlicedRerunInputs(self)

    def decodes(self, stage: int, outer_round: int, j: int, blob: bytes) -> bool:
        """Whether slice blob ``j`` of (stage, round) decodes strictly for its shapes (an aggregator's first
        test)."""
        worker = self.worker()
        return decodes_strictly(blob, worker.plans[stage], j, stage_index=stage, outer_round=outer_round,
                                refuse_raw=worker.cfg.compression.enabled)

    def judge_bad_bundle(self, evidence: msg.Evidence, accused_peer: str) -> tuple[bool | None, str]:
        """The verdict on bad-bundle evidence (node.slicedproof), with this node's plans."""
        worker = self.worker()
        if worker is None:
            return None, "this node is not placed yet"
        return judge_bad_bundle(
            evidence, accused_peer, run_id=self.run_id, max_blob_bytes=self.max_blob_bytes,
            num_slices=lambda stage: worker.plans[stage].num_slices if stage in worker.plans else None,
            decodes=self.decodes)

    def charge_bad_bundle(self, outer_round: int, envelope: bytes, bundle: bytes | None, reason: str) -> None:
        """Accuse the signer of a contribution ``envelope`` whose reference or ``bundle`` is bad, once per
        envelope, if this node's own judgement of the evidence finds it guilty (``charges``)."""
        digest = hashlib.sha256(envelope).digest()
        try:
            header = decode_envelope(envelope, self.max_blob_bytes)
        except (EnvelopeRejected, ValueError):
            return
        evidence = bad_bundle_evidence(b"", header.replica, envelope, bundle, reason)
        with self._cond:
            if self.charges is None or digest in self._charged:
                return
            self._charged.add(digest)
        guilty, why = self.judge_bad_bundle(evidence, header.sender_peer_id)
        if not guilty:
            logger.info("round %d: bad contribution of %s not accused: %s", outer_round,
                        header.sender_peer_id[-8:], why)
            return
        logger.warning("round %d: the contribution of %s is bad (%s): accusing it", outer_round,
                       header.sender_peer_id[-8:], why)
        build = functools.partial(bad_bundle_evidence, replica=header.replica, envelope=envelope,
                                  bundle=bundle, reason=why)
        self.charges.put((outer_round, header.sender_peer_id, header.replica, build))

    def judge_evidence(self, evidence: msg.Evidence, accused_peer: str, *,
                       close_standing: CloseStanding) -> tuple[bool | None, str]:
        """The verdict on wrong-partial evidence: replayed with this node's plans and aggregation rule."""
        worker = self.worker()
        if worker is None:
            return None, "this node is not placed yet"
        return judge_wrong_partial(
            evidence, accused_peer, run_id=self.run_id, max_blob_bytes=self.max_blob_bytes,
            num_slices=lambda stage: worker.plans[stage].num_slices if stage in worker.plans else None,
            replay=lambda stage, outer_round, j, inputs: worker.aggregate_slice(stage, outer_round, j,
                                                                                inputs).partial,
            close_standing=functools.partial(self.proof_close_standing, close_standing))

    def proof_close_standing(self, close_standing: CloseStanding, outer_round: int, stage: int, signer: str,
                             close: msg.Close) -> tuple[bool | None, str]:
        """Whether a wrong-partial proof's close stands (``close_standing`` of the judge): the coordinator's
        rule (a holder's close naming the set this node aggregated, or valid by its entry rules); where that
        cannot be told (the round left the round book), the set this node sealed of that round and stage."""
        stands, why = close_standing(outer_round, stage, signer, close)
        if stands is not None:
            return stands, why
        try:
            sealed = self.archive.sealed(outer_round)
        except StateError:
            sealed = None
        if sealed is None:
            return None, why
        ours = {(c.replica, c.peer_id, c.envelope_hash) for c in sealed if c.stage == stage}
        try:
            named = {(int(e[0]), str(e[1]), bytes(e[2])) for e in close.contributions}
        except (TypeError, ValueError, IndexError):
            return False, "its close holds a malformed entry"
        if named == ours and len(named) == len(close.contributions):
            return True, "the set this node sealed of the round"
        return False, "it names another set than the one this node sealed of the round"

    def charge(self, outer_round: int, stage: int, close: msg.Close, partial: bytes, reason: str) -> None:
        """Gather the evidence against a wrong partial (in the background) and hand it to the spot checker,
        which accuses its signer on chain (``charges``); once per partial."""
        digest = hashlib.sha256(partial).digest()
        with self._cond:
            if self.charges is None or digest in self._charged:
                return
            self._charged.add(digest)
        try:
            self._bundles.submit(self._gather_charge, outer_round, stage, close, partial, reason)
        except RuntimeError:  # closed: the node is stopping
            pass

    def _gather_charge(self, outer_round: int, stage: int, close: msg.Close, partial: bytes,
                       reason: str) -> None:
        signers = close_signers(self.pool.book, outer_round, stage, close)
        if not signers:
            logger.warning("round %d stage %d: wrong partial not accused: its close is gone", outer_round,
                           stage)
            return
        close_envelope = self.pool.book.snapshot_closes(outer_round, stage)[signers[0]][1]
        have = self.pool.have(outer_round, stage)
        num_slices = self.worker().plans[stage].num_slices
        envelopes, bundles = [], []
        for entry in close.contributions:
            providers = [entry[1], *signers]
            envelope = have.get(entry[2]) or self.fetch_first(entry[2], providers)
            reference = None if envelope is None else usable_reference(
                envelope, entry, self.run_id, outer_round, stage, num_slices, self.max_blob_bytes)
            bundle = b"" if reference is None else self.fetch_first(reference.bundle_digest, providers)
            if envelope is None or bundle is None:
                logger.warning("round %d stage %d: wrong partial not accused: the input of %s is not here",
                               outer_round, stage, entry[1][-8:])
                return
            envelopes.append(envelope)
            bundles.append(bundle)
        header = decode_envelope(partial, self.max_blob_bytes)
        build = functools.partial(wrong_partial_evidence, replica=header.replica, partial=partial,
                                  envelopes=envelopes, bundles=bundles, close=close_envelope, reason=reason)
        self.charges.put((outer_round, header.sender_peer_id, header.replica, build))

    def fetch_first(self, digest: bytes, providers: list[str]) -> bytes | None:
        """The blob ``digest`` from the first of ``providers`` that serves it (sha256-checked), or None."""
        for provider in dict.fromkeys(providers):
            data = self._fetch(digest, provider)
            if data is not None:
                return data
        return None

    def keep_wrong_partial(self, outer_round: int, stage: int, j: int, envelope: bytes) -> None:
        """Keep a bound partial that differs from its replay: the signed evidence of a wrong partial."""
        digest = hashlib.sha256(envelope).hexdigest()
        keep_evidence(self.evidence_dir
                      / f"round-{outer_round:08d}-stage{stage}-slice{j}-{digest}.wrong.partial",
                      envelope)
