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

from node.live.state.base import NodeBase
from node import protocol as msg
from node.exchangekinds import EXCHANGE_TRAITS
from node.fsutil import retry_on_full_disk, serve_when_space
from node.live.checks.sliced import SlicedChecks, close_signers
from node.live.exchange.partialfetch import PartialFetcher
from node.live.exchange.protocol import Exchange
from node.live.exchange.sliced_partials import SlicedPartials
from node.live.exchange.sliced_reads import BUNDLE_RETRY_S, SliceReads
from node.live.state.roundbook import Announced
from node.live.state.roundstate import StageInputs
from node.slicedproof import usable_reference
from p2p.backoff import RetryBook
from p2p.envelope import Envelope, decode_envelope
from training.slice_plan import candidate
from training.codec_wire import header_steps
from training.slicebundle import SliceReference, parse_slice_reference, slice_bundle
from training.slicemessages import parse_partial, partial_payload

logger = logging.getLogger(__name__)

#: Partial announces kept per sender and per (round, stage, slice), and in all per slot.
ANNOUNCES_PER_SENDER = 4
MAX_ANNOUNCES_PER_SLOT = 4096


class SlicedExchange(SlicedPartials, SliceReads, SlicedChecks, Exchange):
    """Slice blobs out, partials in, for the stages this node holds (see module docstring).

    Its pool is lazy: a holder fetches the closed envelopes only where it may close the
    round or aggregates a slice of it (:meth:`prefetch_inputs`).
    """

    traits = EXCHANGE_TRAITS["sliced"]
    lazy_pool = traits.lazy_pool  # only a coordinator or an aggregator fetches envelopes
    holds_all_envelopes = traits.holds_all_envelopes  # a holder archives the closed envelopes it holds
    # Re-execution spot checks rerun a member against the slices its signed reference binds, and
    # round t-1 from the partials applied (node.live.checks.sliced_rerun).
    reexecutable = True
    # Withholding costs only the withholder: a coordinator closes only with the bundles it holds and serves.
    holds_inputs_to_close = True

    def __init__(self, base: NodeBase, **collaborators) -> None:
        super().__init__(base, **collaborators)
        self.peer_id = self.messenger.identity.peer_id
        self._cond = threading.Condition()
        # (round, stage, slice) -> [(sender peer id, envelope hash, size)] in arrival order
        self._announced: dict[tuple[int, int, int], list[tuple[str, bytes, int]]] = {}
        self._bundle_tried: dict[bytes, float] = {}  # bundle digest -> when its fetch last began
        self._bundle_missed: set[bytes] = set()  # bundles whose fetch failed (logged once)
        # (bundle digest, provider) -> when a read of it last failed: not asked again for BUNDLE_RETRY_S (each
        # pass of the wait asked a withholder again, ~10 requests a second per slice, for every turn)
        self._read_failed = RetryBook(BUNDLE_RETRY_S)
        # (round, stage, slice, member, turn) whose missing input was logged
        self._missing_said: set[tuple] = set()
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
        # The partials are fetched and applied at the apply
        # (no screening); an aggregator's envelopes, meanwhile.
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
        """Serve this replica's slice blobs as one bundle; return the reference its contribution envelope
        carries.

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
            logger.log(logging.WARNING if first else logging.DEBUG,
                       "round %d: bundle %s of %s not fetched: not "
                       "closed with its contribution (yet)", outer_round, bundle.hex()[:12], sender[-8:])
        else:
            # the audit reads it
            retry_on_full_disk(lambda: self.archive.put_blob(outer_round, data, "slice"),
                               what=f"round {outer_round}'s fetched bundle {bundle.hex()[:12]}",
                               kind="archive", stop=self.stop)
        with self._cond:
            self._bundle_tried[bundle] = time.monotonic()
        self.pool.book.notify()  # the coordinator's wait looks again

    def check_manifest(self, stage: int, outer_round: int, blob: bytes) -> None:
        """Raise SliceError unless ``blob`` is a slice reference for this stage's plan (the contribution
        check)."""
        parse_slice_reference(blob, self.worker().plans[stage].num_slices, self.max_blob_bytes)

    def input_reference(self, outer_round: int, stage: int, entry, envelope: bytes) -> SliceReference | None:
        """The reference of a closed entry's envelope, or None if it is no usable contribution (an absent
        input).

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

    def publish_partial(self, outer_round: int, stage: int, payload: bytes) -> bytes:
        """Sign, serve and announce a partial envelope; its bytes (a seam a fault-injection test
        overrides)."""
        data = self.messenger.sign(outer_round, msg.PARTIAL, payload, stage)
        serve_when_space(self.host, data, what=f"round {outer_round}'s partial of stage {stage}",
                         stop=self.stop)
        digest = hashlib.sha256(data).digest()
        j = parse_partial(payload).slice_index
        self.messenger.gossip(outer_round, msg.PARTIAL_ANNOUNCE, msg.PartialAnnounce(j, digest, len(data)),
                              stage)
        return data

    def make_payload(self, slice_index: int, num_slices: int, root: bytes, members: int,
                     blob: bytes) -> bytes:
        """The partial envelope's payload (a seam a fault-injection test overrides to publish a bad
        partial)."""
        return partial_payload(slice_index, num_slices, root, members, blob)
