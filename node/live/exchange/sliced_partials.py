"""Gathering a round's partials: each slice's from its candidate aggregators, turn by turn,
checked and settled (SlicedExchange's)."""

from __future__ import annotations

import logging
import time

from ledger.merkle import merkle_root
from node import protocol as msg
from node.fsutil import keep_evidence, retry_on_full_disk
from node.live.checks.sliced import UsedPartial, close_signers
from node.live.exchange.protocol import InputsWithheld
from node.live.exchange.coordination import RoundStopped
from node.live.state.roundbook import Announced
from p2p.envelope import decode_envelope
from p2p.errors import EnvelopeRejected
from training.slice_plan import SliceError, candidate
from training.codec_wire import decode_contribution
from training.errors import ContributionDecodeError
from training.slicebundle import SliceReference
from training.slicemessages import parse_partial

logger = logging.getLogger(__name__)


#: Candidates of a slice that get a turn (the aggregator and its first fallbacks). After their turns every
#: holder replays a slice still missing; waiting for all n candidates made a withheld close cost
#: (n + 1) x p2p.transfer_timeout per stage, linear in the replicas.
CANDIDATE_TURNS = 3


class SlicedPartials:
    """How a holder gathers a round's partials (see the module docstring)."""

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
                raise InputsWithheld(
                    f"no valid partial for slices {sorted(set(range(plan.num_slices)) - set(used))}"
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
                    replica, peer_id, _digest, \
                        _size = close.contributions[candidate(j, outer_round, members, m)]
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
                               what=f"round {outer_round}'s partials of stage {stage}", kind="archive",
                               stop=self.stop)
        return [used[j] for j in range(plan.num_slices)]

    def _archived_partials(self, outer_round: int, stage: int, close: msg.Close, root: bytes,
                           plan) -> dict[int, UsedPartial]:
        """The valid candidates' partials of the close this node archived (as applied) in an earlier life."""
        members = len(close.contributions)
        found: dict[int, UsedPartial] = {}
        for data in self.archive.blobs(outer_round, "partial"):
            for j in range(plan.num_slices):
                for m in range(members):
                    replica, peer_id, _digest, \
                        _size = close.contributions[candidate(j, outer_round, members, m)]
                    try:
                        blob = self._check_partial(data, outer_round, stage, j, peer_id, replica, members,
                                                   root, plan)
                    except (EnvelopeRejected, SliceError, ContributionDecodeError, ValueError):
                        continue
                    found.setdefault(j, UsedPartial(j, m, data, blob))
        if found:
            logger.info("round %d stage %d: %d partial(s) of an earlier life reused", outer_round, stage,
                        len(found))
        return found

    def _replayed(self, outer_round, stage, j, close, references, root, fetched,
                  signers) -> UsedPartial | None:
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
            other = self._from_candidate(outer_round, stage, j, m, peer_id, replica, members, root, plan,
                                         tried, wait=self.turn_timeout)
            if isinstance(other, UsedPartial):
                rivals.append(other)
        if len({rival.blob for rival in rivals}) == 1:
            return got
        references, fetched, signers = reading
        logger.warning("round %d stage %d slice %d: %d bound partials differ: replaying the slice",
                       outer_round, stage, j, len({rival.blob for rival in rivals}))
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
                logger.warning(
                    "round %d stage %d slice %d: the partial of %s (turn %d) differs from the replay "
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
        """The partial's blob if the envelope is candidate ``peer_id``'s valid partial of slice j; raises
        otherwise."""
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
            decode_contribution(partial.blob, plan.slice_shapes(j), stage_index=stage,
                                outer_round=outer_round, refuse_raw=self.worker().cfg.compression.enabled)
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
                   members, turn, fetched: dict[tuple[bytes, int], bytes],
                   signers: list[str]) -> UsedPartial | None:
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
        logger.info(
            "round %d stage %d: partial of slice %d published (turn %d, %d of %d inputs accepted, %d bytes)",
            outer_round, stage, j, turn, len(result.accepted), members, len(result.partial))
        return UsedPartial(j, turn, data, result.partial)

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
                                       self._fetch(reference.bundle_digest, entry[1]),
                                       f"slice {j} of its bundle")
            fetched[(reference.bundle_digest, j)] = blob or None  # b"": a bundle proven bad, an absent input
        return [None if references[entry[2]] is None else fetched[(references[entry[2]].bundle_digest, j)]
                for entry in close.contributions]
