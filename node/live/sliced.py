"""The sliced ("butterfly") exchange of a round, when the run says ``diloco.exchange = "sliced"``.

Instead of fetching every closed contribution, a holder of stage ``s`` fetches
one partial per slice: aggregator ``j`` (a deterministic function of the close
and the round) fetches slice ``j`` of every closed contribution, aggregates it
(:func:`training.butterfly.aggregate_slice`) and publishes a signed ``partial``
envelope; everyone checks each partial's binding (its inputs root is the
close's contributions root, the Merkle root of the closed envelope hashes),
assembles the average and takes the outer step. A contribution envelope
carries a constant-size reference to its replica's slice bundle; only an
aggregator fetches the closed envelopes, and it reads each bundle's record and
slice by range, so a holder that aggregates nothing fetches nothing per member.
An envelope that is not a usable contribution (header, body or reference) is an
absent input, decided from its bytes alone (fixed by the hash the close names),
so every aggregator and the auditor agree. The protocol, the fallback order and
what an auditor replays are in docs/PROTOCOL.md, "Sliced exchange".
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from ledger.merkle import merkle_root
from node import protocol as msg
from node.fsutil import keep_evidence, retry_on_full_disk, serve_when_space
from node.live.coordination import RoundStopped
from node.live.exchange import Exchange, InputsWithheld
from node.live.partialfetch import PartialFetcher
from node.live.roundbook import Announced
from node.live.roundstate import StageInputs
from node.live.slicedchecks import SlicedChecks, UsedPartial, close_signers
from node.live.slicedreads import BUNDLE_RETRY_S, SliceReads
from node.slicedproof import usable_reference
from p2p.backoff import RetryBook
from p2p.envelope import Envelope, decode_envelope
from p2p.errors import EnvelopeRejected
from training.slice_plan import SliceError, candidate
from training.codec_wire import decode_contribution, header_steps
from training.errors import ContributionDecodeError
from training.slicebundle import SliceReference, parse_slice_reference, slice_bundle
from training.slicemessages import parse_partial, partial_payload

logger = logging.getLogger(__name__)

#: Partial announces kept per sender and per (round, stage, slice), and in all per slot.
ANNOUNCES_PER_SENDER = 4
#: Candidates of a slice that get a turn (the aggregator and its first fallbacks). After their turns every
#: holder replays a slice still missing; waiting for all n candidates made a withheld close cost
#: (n + 1) x p2p.transfer_timeout per stage, linear in the replicas.
CANDIDATE_TURNS = 3
MAX_ANNOUNCES_PER_SLOT = 4096


class SlicedExchange(SliceReads, SlicedChecks, Exchange):
    """Slice blobs out, partials in, for the stages this node holds (see module docstring).

    Its pool is lazy: a holder fetches the closed envelopes only where it may close the
    round or aggregates a slice of it (:meth:`prefetch_inputs`).
    """

    lazy_pool = True  # only a coordinator or an aggregator fetches envelopes
    holds_all_envelopes = False  # a holder archives the closed envelopes it holds; each contributor its own
    # Re-execution spot checks rerun a member against the slices its signed reference binds, and
    # round t-1 from the partials applied (node.live.slicedrerun).
    reexecutable = True
    # Withholding costs only the withholder: a coordinator closes only with the bundles it holds and serves.
    holds_inputs_to_close = True

    def __init__(self, **parts) -> None:
        super().__init__(**parts)
        self.peer_id = self.messenger.identity.peer_id
        self._cond = threading.Condition()
        # (round, stage, slice) -> [(sender peer id, envelope hash, size)] in arrival order
        self._announced: dict[tuple[int, int, int], list[tuple[str, bytes, int]]] = {}
        self._bundle_tried: dict[bytes, float] = {}  # bundle digest -> when its fetch last began
        self._bundle_missed: set[bytes] = set()  # bundles whose fetch failed (logged once)
        # (bundle digest, provider) -> when a read of it last failed: not asked again for BUNDLE_RETRY_S (each
        # pass of the wait asked a withholder again, ~10 requests a second per slice, for every turn)
        self._read_failed = RetryBook(BUNDLE_RETRY_S)
        self._missing_said: set[tuple] = set()  # (round, stage, slice, member, turn) whose missing input was logged
        self._charged: set[bytes] = set()  # wrong partials (envelope hashes) this node accused
        self._bundles = ThreadPoolExecutor(max_workers=2, thread_name_prefix="bundle")
        # Announced partials come in the background: a provider that does not answer holds up no slice.
        self._partials = PartialFetcher(self._fetch_partial, self._wake)

    def worker(self):
        return self.station.worker()

    # -- the exchange protocol ---------------------------------------------------------
    def check_blob(self, stage: int, outer_round: int, blob: bytes) -> None:
        self.check_manifest(stage, outer_round, blob)

    def gossip_handlers(self) -> dict:
        return {msg.PARTIAL_ANNOUNCE: self.on_announce}

    def contribution_blob(self, outer_round: int, stage: int, blob: bytes) -> bytes:
        # The envelope binds the slice blobs' hashes; the blobs are served.
        return self.publish(outer_round, stage, self.worker().last_slices(stage))

    def gather(self, outer_round: int, stage: int, close: msg.Close, waited: dict[str, float],
               prepare: bool) -> StageInputs:
        # The partials are fetched and applied at the apply (no screening); an aggregator's envelopes, meanwhile.
        self.prefetch_inputs(outer_round, stage, close)
        return StageInputs(close)

    def apply(self, outer_round: int, stage: int, inputs: StageInputs):
        """The sliced exchange's aggregation: one valid partial per slice, assembled, the outer step."""
        used = self.partials(outer_round, stage, inputs.close)
        self.spot_check_partials(outer_round, stage, inputs.close, used)
        result = self.worker().apply_partials(stage, outer_round, [partial.blob for partial in used])
        return result, self.held_envelopes(outer_round, stage, inputs.close)  # not every member's

    # -- what a replica sends ----------------------------------------------------------
    def publish(self, outer_round: int, stage: int, blobs: list[bytes]) -> bytes:
        """Serve this replica's slice blobs as one bundle; return the reference its contribution envelope carries.

        Served without a DHT announcement: an aggregator knows the provider (the
        close names the contribution's sender) and reads only its record and its
        slice of the bundle. Archived too: an auditor replays any partial from
        the contributors' archives.
        """
        # A time-bounded run's slices each declare the replica's inner steps; its reference declares them too.
        bundle, reference = slice_bundle(blobs, header_steps(blobs[0]))
        retry_on_full_disk(lambda: (self.archive.put_blob(outer_round, bundle, "slice"),
                                    self.host.provide_blob(bundle, announce=False)),
                           what=f"round {outer_round}'s slice bundle of stage {stage}", kind="contribution",
                           stop=self.stop)
        return reference

    def close_inputs_held(self, outer_round: int, stage: int, digest: bytes, envelope: bytes) -> bool:
        """Whether this node, about to close (round, stage), holds the whole bundle the checked envelope
        ``digest`` references; if not, fetch it (in the background, from its signer) and say no meanwhile.

        The rule that makes withholding cost only the withholder (docs/PROTOCOL.md, "Sliced exchange"):
        a coordinator closes only with bundles it holds (sha256-checked, archived, served), so an
        aggregator that cannot read a slice from its member reads it from the close's coordinator.
        """
        env = decode_envelope(envelope, self.max_blob_bytes)
        reference = parse_slice_reference(msg.decode_contribution_body(env.payload).blob,
                                          self.worker().plans[stage].num_slices, self.max_blob_bytes)
        bundle = reference.bundle_digest
        if self.host.has_blob(bundle.hex()):
            return True
        with self._cond:
            if time.monotonic() - self._bundle_tried.get(bundle, -BUNDLE_RETRY_S) < BUNDLE_RETRY_S:
                return False
            self._bundle_tried[bundle] = time.monotonic()
        try:
            self._bundles.submit(self._fetch_bundle, outer_round, bundle, env.sender_peer_id)
        except RuntimeError:  # closed: the node is stopping
            pass
        return False

    def _fetch_bundle(self, outer_round: int, bundle: bytes, sender: str) -> None:
        data = self._fetch(bundle, sender)
        if data is None:
            with self._cond:
                first = bundle not in self._bundle_missed
                self._bundle_missed.add(bundle)
            logger.log(logging.WARNING if first else logging.DEBUG, "round %d: bundle %s of %s not fetched: not "
                       "closed with its contribution (yet)", outer_round, bundle.hex()[:12], sender[-8:])
        else:
            retry_on_full_disk(lambda: self.archive.put_blob(outer_round, data, "slice"),  # the audit reads it
                               what=f"round {outer_round}'s fetched bundle {bundle.hex()[:12]}", kind="archive",
                               stop=self.stop)
        with self._cond:
            self._bundle_tried[bundle] = time.monotonic()
        self.pool.book.notify()  # the coordinator's wait looks again

    def check_manifest(self, stage: int, outer_round: int, blob: bytes) -> None:
        """Raise SliceError unless ``blob`` is a slice reference for this stage's plan (the contribution check)."""
        parse_slice_reference(blob, self.worker().plans[stage].num_slices, self.max_blob_bytes)

    def input_reference(self, outer_round: int, stage: int, entry, envelope: bytes) -> SliceReference | None:
        """The reference of a closed entry's envelope, or None if it is no usable contribution (an absent input).

        A pure function of the bytes (which the close fixes by their sha256) and the entry, so
        every aggregator and the auditor (node/tools/audit_sliced.py) decide alike.
        """
        return usable_reference(envelope, entry, self.run_id, outer_round, stage,
                                self.worker().plans[stage].num_slices, self.max_blob_bytes)

    def prefetch_inputs(self, outer_round: int, stage: int, close: msg.Close) -> None:
        """If this node aggregates a slice of the close, start fetching the closed envelopes in the
        background (in parallel, while the next round trains); a holder that aggregates nothing
        fetches none of them."""
        members = len(close.contributions)
        mine = any(close.contributions[candidate(j, outer_round, members, 0)][1] == self.peer_id
                   for j in range(self.worker().plans[stage].num_slices))
        if mine:
            signers = close_signers(self.pool.book, outer_round, stage, close)
            for replica, peer_id, digest, size in close.contributions:
                self.pool.fetch(outer_round, stage, Announced(peer_id, replica, digest, size),
                                also_from=signers[0] if signers else None)

    def held_envelopes(self, outer_round: int, stage: int, close: msg.Close) -> list[bytes | None]:
        """The closed envelopes this node holds (its own, those it fetched as coordinator or aggregator)."""
        have = self.pool.have(outer_round, stage)
        return [have.get(entry[2]) for entry in close.contributions]

    # -- gossip ----------------------------------------------------------------------
    def on_announce(self, env: Envelope, announce: msg.PartialAnnounce, _data: bytes) -> None:
        with self._cond:
            entries = self._announced.setdefault((env.round, env.stage, announce.slice_index), [])
            # A flood costs only its sender: each sender keeps at most ANNOUNCES_PER_SENDER per slot
            # (an honest candidate announces one partial), so nobody can crowd out the aggregator's.
            mine = sum(1 for entry in entries if entry[0] == env.sender_peer_id)
            if mine < ANNOUNCES_PER_SENDER and len(entries) < MAX_ANNOUNCES_PER_SLOT:
                entries.append((env.sender_peer_id, announce.envelope_hash, announce.size))
            self._cond.notify_all()

    def forget_before(self, outer_round: int) -> None:
        super().forget_before(outer_round)
        with self._cond:
            for key in [k for k in self._announced if k[0] < outer_round]:
                del self._announced[key]
            stale = time.monotonic() - 600.0
            self._bundle_tried = {k: v for k, v in self._bundle_tried.items() if v > stale}
            self._bundle_missed &= set(self._bundle_tried)
            self._read_failed.forget_older_than(600.0)
            self._missing_said = {k for k in self._missing_said if k[0] >= outer_round}
        self._partials.forget_before(outer_round)

    def close(self) -> None:
        self._bundles.shutdown(wait=False, cancel_futures=True)
        self._partials.close()
        super().close()

    # -- one round of one stage --------------------------------------------------------
    def partials(self, outer_round: int, stage: int, close: msg.Close) -> list[UsedPartial]:
        """One valid partial per slice for the close.

        Turn ``m`` of slice ``j`` opens ``m x turn_timeout`` seconds after this
        call; from then on the partial of candidate ``m`` counts too, and a
        candidate whose turn opened without a valid partial in hand aggregates
        and publishes its own. Partials this node archived for the close in an
        earlier life count at once (a restart re-applies what it applied). Once
        every candidate's turn has opened (turn ``min(n, CANDIDATE_TURNS)``), a holder that still lacks a
        slice aggregates it itself (not published: it is no candidate; the result
        is the same pure function). Raises InputsWithheld when a further turn has
        passed without a valid partial or its inputs (the caller refuses the close
        and takes the next coordinator's), RoundStopped on stop.
        """
        plan = self.worker().plans[stage]
        members = len(close.contributions)
        turns = min(members, CANDIDATE_TURNS)  # candidates 0 .. turns - 1 have a turn
        # Every partial binds the close's contributions root (what the attestation and the record
        # commit to): each envelope hash fixes its signed reference, which fixes every slice.
        root = merkle_root([entry[2] for entry in close.contributions])
        used: dict[int, UsedPartial] = self._archived_partials(outer_round, stage, close, root, plan)
        tried: set[bytes] = set()  # partial envelope hashes already judged
        inputs: dict[tuple[bytes, int], bytes] = {}  # slice blobs fetched so far (as an aggregator)
        references: dict[bytes, SliceReference | None] = {}  # envelope hash -> reference (None: absent)
        refused: dict[int, set[int]] = {}  # slice -> turns whose candidate signed a refused partial
        started = time.monotonic()
        signers = close_signers(self.pool.book, outer_round, stage, close)  # they hold every bundle
        while len(used) < plan.num_slices:
            if self.stop.is_set():
                raise RoundStopped(f"round {outer_round} stage {stage}: stopped while waiting for partials")
            turn = int((time.monotonic() - started) // self.turn_timeout)
            if turn >= turns + 1:
                raise InputsWithheld(f"no valid partial for slices {sorted(set(range(plan.num_slices)) - set(used))}"
                                     f" after every candidate's turn ({turns + 1} x {self.turn_timeout:.0f}s)")
            for j in range(plan.num_slices):
                if j in used:
                    continue
                if turn >= turns:  # every candidate had its turn: replay the slice here (a late partial
                    # or a restart that heard no announce; the inputs may still be withheld)
                    own = self._replayed(outer_round, stage, j, close, references, root, inputs, signers)
                    if own is not None:
                        used[j] = own
                        continue
                # A candidate whose signed partial was refused opens the next turn at once: every
                # holder that saw that partial refuses it alike, so nobody needs to wait it out.
                opened = max(turn, 1 + max(refused.get(j, {-1})))
                for m in range(min(opened, turns - 1) + 1):
                    replica, peer_id, _digest, _size = close.contributions[candidate(j, outer_round, members, m)]
                    if peer_id == self.peer_id:
                        # Tried again on every pass until every input is here (a fetch that failed
                        # under load must not cost a whole turn); fetched inputs are kept meanwhile.
                        own = self._aggregate(outer_round, stage, j, close, references, root, members, m,
                                              inputs, signers)
                        if own is not None:
                            used[j] = own
                            break
                    got = self._from_candidate(outer_round, stage, j, m, peer_id, replica, members, root,
                                               plan, tried)
                    if got is True:
                        refused.setdefault(j, set()).add(m)
                    elif got is not None:
                        used[j] = self._settle(got, outer_round, stage, close, opened, root, plan, tried,
                                               (references, inputs, signers))
                        break
            if len(used) < plan.num_slices:
                with self._cond:
                    self._cond.wait(0.2)
        for partial in used.values():  # the auditor's evidence of what this node applied; served on too
            retry_on_full_disk(lambda: (self.archive.put_blob(outer_round, partial.envelope, "partial"),
                                        self.host.provide_blob(partial.envelope, announce=False)),
                               what=f"round {outer_round}'s partials of stage {stage}", kind="archive", stop=self.stop)
        return [used[j] for j in range(plan.num_slices)]

    def _archived_partials(self, outer_round: int, stage: int, close: msg.Close, root: bytes,
                           plan) -> dict[int, UsedPartial]:
        """The valid candidates' partials of the close this node archived (as applied) in an earlier life."""
        members = len(close.contributions)
        found: dict[int, UsedPartial] = {}
        for data in self.archive.blobs(outer_round, "partial"):
            for j in range(plan.num_slices):
                for m in range(members):
                    replica, peer_id, _digest, _size = close.contributions[candidate(j, outer_round, members, m)]
                    try:
                        blob = self._check_partial(data, outer_round, stage, j, peer_id, replica, members, root, plan)
                    except (EnvelopeRejected, SliceError, ContributionDecodeError, ValueError):
                        continue
                    found.setdefault(j, UsedPartial(j, m, data, blob))
        if found:
            logger.info("round %d stage %d: %d partial(s) of an earlier life reused", outer_round, stage, len(found))
        return found

    def _replayed(self, outer_round, stage, j, close, references, root, fetched, signers) -> UsedPartial | None:
        """Slice j aggregated here by a holder that is no candidate (signed for the archive, not published);
        None while an input is missing."""
        inputs = self._slice_inputs(outer_round, stage, j, close, references, -1, fetched, signers)
        if inputs is None:
            return None
        blob = self.worker().aggregate_slice(stage, outer_round, j, inputs).partial
        plan = self.worker().plans[stage]
        logger.warning("round %d stage %d slice %d: no candidate's partial came in its turn: replayed here",
                       outer_round, stage, j)
        data = self.messenger.sign(outer_round, msg.PARTIAL, self.make_payload(
            j, plan.num_slices, root, len(close.contributions), blob), stage)
        return UsedPartial(j, -1, data, blob)

    def _settle(self, got: UsedPartial, outer_round, stage, close, opened, root, plan, tried,
                reading) -> UsedPartial:
        """``got``, unless another valid partial of the slice by an open candidate (``got``'s signer
        included: a candidate may sign two) is here and differs from it.

        Two partials that bind the same inputs and differ prove that one candidate lied (an honest one
        publishes the pure function of the inputs); this holder then replays the slice itself, as an
        aggregator would, and takes the partial equal to its replay. The others are kept under
        ``evidence/`` (``.wrong.partial``: the signed proof for an accusation, node.slicedproof).
        ``reading``: (references, fetched slices, the close's coordinators) as in :meth:`_aggregate`.
        """
        j = got.slice_index
        members = len(close.contributions)
        rivals = [got]
        for m in range(min(opened, members - 1) + 1):
            replica, peer_id, _digest, _size = close.contributions[candidate(j, outer_round, members, m)]
            if peer_id == self.peer_id:
                continue
            other = self._from_candidate(outer_round, stage, j, m, peer_id, replica, members, root, plan, tried,
                                         wait=self.turn_timeout)
            if isinstance(other, UsedPartial):
                rivals.append(other)
        if len({rival.blob for rival in rivals}) == 1:
            return got
        references, fetched, signers = reading
        logger.warning("round %d stage %d slice %d: %d bound partials differ: replaying the slice", outer_round,
                       stage, j, len({rival.blob for rival in rivals}))
        waited = time.monotonic() + 2 * self.turn_timeout
        inputs = None
        while inputs is None and time.monotonic() < waited and not self.stop.is_set():
            inputs = self._slice_inputs(outer_round, stage, j, close, references, got.turn, fetched, signers)
            if inputs is None:
                time.sleep(0.2)
        if inputs is None:
            logger.warning("round %d stage %d slice %d: inputs not read: the earliest turn's partial is used",
                           outer_round, stage, j)
            return min(rivals, key=lambda rival: rival.turn)
        replayed = self.worker().aggregate_slice(stage, outer_round, j, inputs).partial
        for rival in rivals:
            if rival.blob != replayed:
                sender = decode_envelope(rival.envelope, self.max_blob_bytes).sender_peer_id
                logger.warning("round %d stage %d slice %d: the partial of %s (turn %d) differs from the replay "
                               "of its inputs: a wrong partial", outer_round, stage, j, sender[-8:], rival.turn)
                self.keep_wrong_partial(outer_round, stage, j, rival.envelope)
                self.charge(outer_round, stage, close, rival.envelope,
                            f"slice {j}: its partial differs from the replay of the inputs it binds")
        right = [rival for rival in rivals if rival.blob == replayed]
        if right:
            return right[0]
        # No candidate's partial is the replay's: this holder applies its replay (signed, not published:
        # what it applied, for the archive; the auditor replays the slice too).
        data = self.messenger.sign(outer_round, msg.PARTIAL,
                                   self.make_payload(j, plan.num_slices, root, members, replayed), stage)
        return UsedPartial(j, -1, data, replayed)

    def _from_candidate(self, outer_round, stage, j, turn, peer_id, replica, members, root, plan,
                        tried, wait: float = 0.0) -> UsedPartial | bool | None:
        """The candidate's valid partial; True if it signed one that was refused; None if none is here yet
        (its announced partials come in the background; this waits up to ``wait`` seconds for each)."""
        refused = False
        with self._cond:
            offers = [e for e in self._announced.get((outer_round, stage, j), []) if e[0] == peer_id]
        for sender, envelope_hash, size in offers:
            if envelope_hash in tried:
                continue
            if size > self.max_blob_bytes:
                tried.add(envelope_hash)
                logger.warning("round %d stage %d slice %d: partial of %s announced at %d bytes: refused",
                               outer_round, stage, j, sender[-8:], size)
                continue  # an unsigned claim (the gossip announce): not a refusal of a signed partial
            data = self._partials.get(outer_round, envelope_hash, sender, wait)
            if data is None:
                continue  # not fetched (yet): try again on the next pass
            tried.add(envelope_hash)
            try:
                blob = self._check_partial(data, outer_round, stage, j, peer_id, replica, members, root, plan)
            except (EnvelopeRejected, SliceError, ContributionDecodeError, ValueError) as exc:
                self._refuse(outer_round, stage, j, sender, envelope_hash, f"{exc}", data)
                refused = True
                continue
            return UsedPartial(j, turn, data, blob)
        return True if refused else None

    def _check_partial(self, data, outer_round, stage, j, peer_id, replica, members, root, plan) -> bytes:
        """The partial's blob if the envelope is candidate ``peer_id``'s valid partial of slice j; raises otherwise."""
        env = decode_envelope(data, self.max_blob_bytes)
        if (env.kind, env.run_id, env.round, env.stage, env.sender_peer_id, env.replica) != (
                msg.PARTIAL, self.run_id, outer_round, stage, peer_id, replica):
            raise SliceError("partial envelope header does not name this round, stage and candidate")
        partial = parse_partial(env.payload)
        if (partial.slice_index, partial.num_slices, partial.num_inputs) != (j, plan.num_slices, members):
            raise SliceError(f"partial for slice {partial.slice_index} of {partial.num_slices} over "
                             f"{partial.num_inputs} inputs, expected {j} of {plan.num_slices} over {members}")
        if partial.inputs_root != root:
            raise SliceError("partial's inputs root differs from the close's contributions root")
        if partial.blob:
            decode_contribution(partial.blob, plan.slice_shapes(j), stage_index=stage, outer_round=outer_round,
                                refuse_raw=self.worker().cfg.compression.enabled)
        return partial.blob

    def _refuse(self, outer_round, stage, j, sender, envelope_hash, reason, data) -> None:
        logger.warning("round %d stage %d slice %d: partial %s of %s refused: %s", outer_round, stage, j,
                       envelope_hash.hex()[:12], sender[-8:], reason)
        keep_evidence(self.evidence_dir / f"round-{outer_round:08d}-stage{stage}-slice{j}-"
                      f"{envelope_hash.hex()}.partial", data)  # the signed envelope is the proof

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _reference(self, outer_round: int, stage: int, entry, references: dict[bytes, SliceReference | None],
                   signers: list[str]) -> tuple[bool, SliceReference | None]:
        """``(here, reference)`` of a closed entry for an aggregator: its envelope from this node's pool or
        fetched by the pool (from its signer, then live peers), judged by :meth:`input_reference`."""
        digest = entry[2]
        if digest in references:
            return True, references[digest]
        # The pool fetches it (from its signer, the close's coordinator, then live peers; a no-op
        # while prefetch_inputs' fetch is under way); fetching it beside the pool would double its bytes.
        self.pool.fetch(outer_round, stage, Announced(entry[1], entry[0], digest, entry[3]),
                        also_from=signers[0] if signers else None)
        waited = time.monotonic() + self.turn_timeout
        while self.pool.in_flight(digest) and time.monotonic() < waited and not self.stop.is_set():
            time.sleep(0.05)
        envelope = self.pool.have(outer_round, stage).get(digest)
        if envelope is None and self.host.has_blob(digest.hex()):
            envelope = self._fetch(digest, entry[1])  # fetched, but refused by the pool: judged here alike
        if envelope is None:
            return False, None
        reference = self.input_reference(outer_round, stage, entry, envelope)
        if reference is None:
            logger.warning("round %d stage %d: closed envelope %s of %s is no usable contribution: an absent "
                           "input", outer_round, stage, digest.hex()[:12], entry[1][-8:])
            # Its signer is accused when the envelope alone shows it (not when only the close misplaced it).
            self.charge_bad_bundle(outer_round, envelope, None, "no usable contribution")
            # Bound by the close and (through its announce) by its signer: keep it.
            keep_evidence(self.evidence_dir / f"round-{outer_round:08d}-stage{stage}-{digest.hex()}.envelope",
                          envelope)
        else:
            self.pool.add(outer_round, stage, digest, envelope)  # archived with the round, served
        references[digest] = reference
        return True, reference

    def _aggregate(self, outer_round, stage, j, close, references: dict[bytes, SliceReference | None], root,
                   members, turn, fetched: dict[tuple[bytes, int], bytes], signers: list[str]) -> UsedPartial | None:
        """Fetch slice j of every closed contribution, aggregate, sign, serve and announce the partial.

        Publishes only with every input here: a partial over fewer inputs would
        not bind the root the holders compute. None while an input is missing
        (the caller tries again; the next candidate's turn opens meanwhile).
        """
        inputs = self._slice_inputs(outer_round, stage, j, close, references, turn, fetched, signers)
        if inputs is None:
            return None
        result = self.worker().aggregate_slice(stage, outer_round, j, inputs)
        plan = self.worker().plans[stage]
        data = self.publish_partial(outer_round, stage, self.make_payload(j, plan.num_slices, root, members,
                                                                          result.partial))
        logger.info("round %d stage %d: partial of slice %d published (turn %d, %d of %d inputs accepted, %d bytes)",
                    outer_round, stage, j, turn, len(result.accepted), members, len(result.partial))
        return UsedPartial(j, turn, data, result.partial)

    def publish_partial(self, outer_round: int, stage: int, payload: bytes) -> bytes:
        """Sign, serve and announce a partial envelope; its bytes (a seam a fault-injection test overrides)."""
        data = self.messenger.sign(outer_round, msg.PARTIAL, payload, stage)
        serve_when_space(self.host, data, what=f"round {outer_round}'s partial of stage {stage}", stop=self.stop)
        digest = hashlib.sha256(data).digest()
        j = parse_partial(payload).slice_index
        self.messenger.gossip(outer_round, msg.PARTIAL_ANNOUNCE, msg.PartialAnnounce(j, digest, len(data)), stage)
        return data

    def _slice_inputs(self, outer_round, stage, j, close, references, turn, fetched,
                      signers: list[str]) -> list[bytes | None] | None:
        """Slice j of every closed contribution in canonical order (None each for an absent input), read as
        an aggregator reads them (the signer, then the close's coordinators); None while one is missing."""
        for entry in close.contributions:
            here, reference = self._reference(outer_round, stage, entry, references, signers)
            if not here:
                self._say_missing("envelope", outer_round, stage, j, entry[1], turn)
                return None
            if reference is None or (reference.bundle_digest, j) in fetched:
                continue
            blob = self._read_slice(reference, j, entry[1])
            for coordinator in signers:  # a member that withholds its bundle: its coordinator serves it
                if blob is not None or coordinator in (entry[1], self.peer_id):
                    break
                blob = self._read_slice(reference, j, coordinator)
            if blob is None:
                self._say_missing("input", outer_round, stage, j, entry[1], turn)
                return None
            if blob == b"":  # a bundle proven bad: an absent input, and its signer is accused
                self.charge_bad_bundle(outer_round, self.pool.have(outer_round, stage).get(entry[2], b""),
                                       self._fetch(reference.bundle_digest, entry[1]), f"slice {j} of its bundle")
            fetched[(reference.bundle_digest, j)] = blob or None  # b"": a bundle proven bad, an absent input
        return [None if references[entry[2]] is None else fetched[(references[entry[2]].bundle_digest, j)]
                for entry in close.contributions]

    def make_payload(self, slice_index: int, num_slices: int, root: bytes, members: int, blob: bytes) -> bytes:
        """The partial envelope's payload (a seam a fault-injection test overrides to publish a bad partial)."""
        return partial_payload(slice_index, num_slices, root, members, blob)
