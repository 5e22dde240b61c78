"""What a re-execution spot check of a sliced contribution reads (docs/PROTOCOL.md, "Sliced exchange").

The full exchange's spot checker (:class:`node.live.checks.verifier.SpotChecker`) reruns
a replica's round with :func:`training.reexec.verify_contribution` and compares
the payloads its envelopes carry. A sliced contribution envelope carries only a
constant-size reference to the replica's slice bundle, so the rerun's claims are
the slices that reference binds: the bundle is fetched by its sha256 from the
member, else from the coordinators whose close named the envelope (each held
every closed bundle before closing: "Withholding costs only the withholder"),
every slice is read as an aggregator reads it, and the claim is the msgpack array
of the slice blobs, which is what the sliced encoder returns
(:class:`training.butterfly.SlicedErrorFeedbackCompressor`): a bit-exact rerun
gives the same bytes. Round t-1's apply is the outer step on the partials every
holder applied, read from this node's archive (``<sha256>.partial``).

A bundle or reference that proves its signer wrong (a slice its record does not
prove, a slice that does not decode, a reference that does not fit the plan)
is charged as a bad bundle (:func:`node.slicedproof.judge_bad_bundle`) and
the check is not done; a bundle nobody serves makes the check not done: nobody is
accused for missing inputs.
"""

from __future__ import annotations

import hashlib
import logging

from node import protocol as msg
from node.live.checks.spotinputs import InputsUnavailable
from node.slicedproof import bundle_fault
from p2p.envelope import Envelope, decode_envelope
from p2p.errors import EnvelopeRejected, P2PError
from training.slice_plan import SliceError
from training.slicebundle import parse_slice_reference, rerun_claim
from training.slicemessages import parse_partial

logger = logging.getLogger(__name__)


class SlicedRerunInputs:
    """The claims and round t-1's partials of a sliced contribution's rerun (module docstring).

    ``exchange``: the node's :class:`node.live.exchange.sliced.SlicedExchange` (its plans, host, book,
    archive, fetches and charges).
    """

    def __init__(self, exchange) -> None:
        self.exchange = exchange

    def claims(self, outer_round: int, envs: list[Envelope]) -> list[bytes]:
        """Per envelope (stage order), the packed slice blobs its reference binds; raises
        InputsUnavailable."""
        return [self._claimed_slices(outer_round, env) for env in envs]

    def _claimed_slices(self, outer_round: int, env: Envelope) -> bytes:
        exchange = self.exchange
        plan = exchange.worker().plans.get(env.stage)
        if plan is None:
            raise InputsUnavailable(f"round {outer_round} stage {env.stage}: no slice plan here")
        data = env.to_bytes()
        fault = bundle_fault(env, env.payload, None, plan.num_slices, exchange.decodes)
        if fault is not None:
            exchange.charge_bad_bundle(outer_round, data, None, fault)
            raise InputsUnavailable(f"round {outer_round} stage {env.stage}: {env.sender_peer_id[-8:]}'s "
                                    f"contribution is bad: {fault}")
        try:
            reference = parse_slice_reference(msg.decode_contribution_body(env.payload).blob, plan.num_slices,
                                              exchange.max_blob_bytes)
        except SliceError as exc:  # above this node's blob limit: it cannot fetch it
            raise InputsUnavailable(
                f"round {outer_round} stage {env.stage}: bundle not fetched: {exc}") from None
        digest = reference.bundle_digest.hex()
        held = exchange.host.has_blob(digest)
        bundle = exchange.fetch_first(reference.bundle_digest,
                                      [env.sender_peer_id, *self._closers(outer_round, env.stage, data)])
        if bundle is None:
            raise InputsUnavailable(f"round {outer_round} stage {env.stage}: bundle {digest[:12]} of "
                                    f"{env.sender_peer_id[-8:]} not served")
        try:
            fault = bundle_fault(env, env.payload, bundle, plan.num_slices, exchange.decodes)
            if fault is None:
                return rerun_claim(bundle, reference)
        except (SliceError, ValueError) as exc:  # (the fetch checked the sha256: not reached)
            raise InputsUnavailable(
                f"round {outer_round} stage {env.stage}: bundle {digest[:12]}: {exc}") from None
        finally:
            if not held:  # another replica's bundle: not kept in the blob store once read
                self._forget(digest)
        exchange.charge_bad_bundle(outer_round, data, bundle, fault)
        raise InputsUnavailable(f"round {outer_round} stage {env.stage}: {env.sender_peer_id[-8:]}'s bundle "
                                f"is bad: {fault}")

    def _closers(self, outer_round: int, stage: int, envelope: bytes) -> list[str]:
        """The coordinators whose close of (round, stage) names ``envelope`` (each held its whole bundle)."""
        digest = hashlib.sha256(envelope).digest()
        return [coordinator for coordinator, (close, _data)
                in self.exchange.pool.book.snapshot_closes(outer_round, stage).items()
                if any(entry[2] == digest for entry in close.contributions)]

    def _forget(self, digest: str) -> None:
        try:
            self.exchange.host.remove_blob(digest)
        except (P2PError, OSError, ValueError) as exc:
            logger.debug("fetched bundle %s not removed: %s", digest[:16], exc)

    def previous(self, outer_round: int) -> dict[int, list[bytes]]:
        """Stage -> the partial blobs this node applied in ``outer_round``, slice order ({} before round 0);
        raises InputsUnavailable when a stage it holds lacks one (pruned, or not applied here)."""
        if outer_round < 0:
            return {}
        exchange = self.exchange
        found: dict[int, dict[int, bytes]] = {}
        for data in exchange.archive.blobs(outer_round, "partial"):
            try:
                env = decode_envelope(data, exchange.max_blob_bytes)
                partial = parse_partial(env.payload)
            except (EnvelopeRejected, SliceError, ValueError):
                continue  # the archive holds what this node applied; anything else is not a partial of it
            if (env.kind, env.run_id, env.round) == (msg.PARTIAL, exchange.run_id, outer_round):
                found.setdefault(env.stage, {}).setdefault(partial.slice_index, partial.blob)
        previous = {}
        for stage, plan in exchange.worker().plans.items():
            slices = found.get(stage, {})
            if sorted(slices) != list(range(plan.num_slices)):
                raise InputsUnavailable(
                    f"round {outer_round} stage {stage}: {len(slices)} of {plan.num_slices} "
                    "applied partials archived here")
            previous[stage] = [slices[j] for j in range(plan.num_slices)]
        return previous
