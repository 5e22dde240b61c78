"""The evidence of a wrong partial in the sliced exchange, and its judgement (docs/PROTOCOL.md, "Sliced
exchange").

A partial is a pure function of the inputs its signed ``inputs_root`` binds, so a
holder that replays a slice and finds a candidate's signed partial different
has a self-contained proof: the signed partial envelope, the closed contribution
envelopes (whose sha256 Merkle root is that ``inputs_root``; each signed by its
member and carrying the reference of its bundle) and those bundles (each checked
against the sha256 the signed reference names). Anyone can check it without the
round's state: bind, read slice ``j`` of every input as an aggregator reads it,
replay (:func:`training.butterfly.aggregate_slice`), compare. The accusation on
chain names the sha256 of an :data:`node.protocol.EVIDENCE` envelope whose
:class:`node.protocol.Evidence` carries, with ``verdict`` = :data:`WRONG_PARTIAL`:

    contributions = [partial envelope, pack(closed envelopes), pack(one bundle or b"" per input),
                     close envelope]

The close (signed by its coordinator, naming the same envelope hashes in the same order)
gives each input's entry, with which the aggregators judged it (an entry whose replica or
peer differs from its envelope's header is an absent input); without it an accuser could
present such an input as usable and frame an honest aggregator.

``b""`` stands for an input the aggregators take as absent from the envelope's bytes alone
(no usable reference: :func:`usable_reference`); a bundle whose slice ``j``
does not prove is absent too (:func:`training.butterfly.bundle_slices`), as for the aggregators.
Evidence that does not make its case (does not bind, a missing bundle, a partial equal to
its replay) is a not-guilty verdict: the accuser must show its case.

A *bad bundle* is proven by what its member signed alone: ``verdict`` = :data:`BAD_BUNDLE`,

    contributions = [contribution envelope] or [contribution envelope, bundle]

The envelope is the accused's signed contribution of the run; guilty when its body is no contribution
body or its reference does not fit its stage's plan (:func:`bundle_fault`), or when the bundle, which
must be the one the reference names (sha256 and size), holds a slice that its record does not prove
or that does not decode strictly for the slice's shapes. Aggregators take such an input as absent
(it costs only its signer); the accusation makes it cost its signer's stake too.

The judges are pure given a stage's plan, the aggregators' replay and the strict decode: the live node
passes its worker's (node/live/checks/sliced.py), ``dlx-node audit --reexecute`` the ones
:class:`RunSliceRules` derives from the run document alone (node/tools/audit_slicedproof.py), so a node
and an auditor judge a proof by one rule.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Callable
from typing import Any, NamedTuple

from ledger.merkle import merkle_root
from node import protocol as msg
from p2p.envelope import decode_envelope
from p2p.errors import EnvelopeRejected
from training.butterfly import replay_partial
from training.slice_plan import SliceError, SlicePlan, live_plan
from training.codec_wire import decode_contribution
from training.errors import ContributionDecodeError
from training.slicebundle import SliceReference, bundle_slices, parse_slice_reference
from training.slicemessages import parse_partial

#: ``Evidence.verdict`` of a wrong partial's evidence (the verifier dispatches on it).
WRONG_PARTIAL = "wrong-partial"
#: ``Evidence.verdict`` of a bad bundle's or a malformed contribution envelope's evidence.
BAD_BUNDLE = "bad-bundle"
#: A reference is judged for its form only: a size above a node's own blob limit is no proof of anything.
_ANY_SIZE = 1 << 62

_COUNT = struct.Struct(">I")

#: ``close_standing(round, stage, signer, close) -> (stands, why)`` of :func:`judge_wrong_partial`.
CloseStanding = Callable[[int, int, str, msg.Close], tuple[bool | None, str]]


def usable_reference(envelope: bytes, entry, run_id: int, outer_round: int, stage: int, num_slices: int,
                     max_blob_bytes: int) -> SliceReference | None:
    """The slice reference a closed envelope carries, or None when it is no usable contribution of
    ``entry`` = ``[replica, peer id, envelope hash, size]`` in (round, stage): an envelope that does not
    verify, whose signed header names another kind, run, round, stage, replica or signer, whose body is
    not a contribution body, or whose reference does not fit the plan. Pure (the aggregators' and the
    auditor's rule): never raises on hostile bytes."""
    replica, peer_id = entry[0], entry[1]
    try:
        env = decode_envelope(envelope, max_blob_bytes)
        if (env.kind, env.run_id, env.round, env.stage, env.replica, env.sender_peer_id) != (
                msg.CONTRIBUTION, run_id, outer_round, stage, replica, peer_id):
            return None
        return parse_slice_reference(msg.decode_contribution_body(env.payload).blob, num_slices,
                                     max_blob_bytes)
    except (EnvelopeRejected, msg.ProtocolError, SliceError, ValueError):
        return None


def pack_items(items: list[bytes]) -> bytes:
    """``u32 count || (u32 length || bytes)*``: several blobs in one evidence item."""
    return _COUNT.pack(len(items)) + b"".join(_COUNT.pack(len(item)) + item for item in items)


def unpack_items(data: bytes, max_items: int) -> list[bytes]:
    """The blobs :func:`pack_items` packed; raises ValueError on anything else (hostile bytes included)."""
    if len(data) < 4:
        raise ValueError("packed items: shorter than their count")
    (count,), offset, items = _COUNT.unpack_from(data), 4, []
    if count > max_items:
        raise ValueError(f"packed items: {count} of at most {max_items}")
    for _ in range(count):
        if offset + 4 > len(data):
            raise ValueError("packed items: truncated")
        (size,) = _COUNT.unpack_from(data, offset)
        offset += 4
        if offset + size > len(data):
            raise ValueError("packed items: truncated")
        items.append(data[offset:offset + size])
        offset += size
    if offset != len(data):
        raise ValueError("packed items: trailing bytes")
    return items


def wrong_partial_evidence(accused: bytes, replica: int, partial: bytes, envelopes: list[bytes],
                           bundles: list[bytes], close: bytes, reason: str) -> msg.Evidence:
    """The :class:`node.protocol.Evidence` against the signer of ``partial`` (module docstring)."""
    items = [partial, pack_items(envelopes), pack_items(bundles), close]
    return msg.Evidence(accused, replica, items, WRONG_PARTIAL, reason, [0.0] * len(items))


class WrongPartialProof(NamedTuple):
    """The decoded pieces of wrong-partial evidence (:func:`wrong_partial_evidence`'s layout)."""

    partial_header: Any  # the partial's signed envelope header (p2p.envelope)
    partial: Any  # training.slicemessages parse_partial's result
    closing: Any  # the close's signed envelope header
    close: msg.Close
    envelopes: list[bytes]  # one per input of the partial, in the close's order
    bundles: list[bytes]


def decode_wrong_partial(evidence: msg.Evidence, max_blob_bytes: int) -> WrongPartialProof:
    """Decode wrong-partial evidence without judging it (the live judge and the audit both read it so).

    Raises:
        ValueError, EnvelopeRejected, SliceError, msg.ProtocolError: on any malformed piece.
    """
    partial_env, packed_envelopes, packed_bundles, close_env = evidence.contributions
    header = decode_envelope(partial_env, max_blob_bytes)
    partial = parse_partial(header.payload)
    closing = decode_envelope(close_env, max_blob_bytes)
    close = msg.decode_payload(msg.CLOSE, closing.payload)
    envelopes = unpack_items(packed_envelopes, partial.num_inputs)
    bundles = unpack_items(packed_bundles, partial.num_inputs)
    return WrongPartialProof(header, partial, closing, close, envelopes, bundles)


def judge_wrong_partial(evidence: msg.Evidence, accused_peer: str, *, run_id: int, max_blob_bytes: int,
                        num_slices: Callable[[int], int | None],
                        replay: Callable[[int, int, int, list[bytes | None]], bytes],
                        close_standing: CloseStanding) -> tuple[bool | None, str]:
    """``(guilty, why)`` for wrong-partial evidence against ``accused_peer``; ``(None, why)`` when this node
    cannot judge it (it holds no plan of that stage, or cannot tell whether the proof's close stands). Pure
    given ``num_slices(stage)`` (the stage's plan, None if not held), ``replay(stage, round, slice, inputs)``
    (the aggregators' function) and ``close_standing(round, stage, signer, close)``: whether the proof's close
    is one the round's aggregators went by (True), is not (False: not guilty) or cannot be told here (None),
    with why. The judge takes each input's entry from that close, so a close any member could sign, made up
    to misname an input, would frame an honest aggregator. Never raises on hostile bytes."""
    try:
        env, partial, closing, close, envelopes, bundles = decode_wrong_partial(evidence, max_blob_bytes)
    except (ValueError, EnvelopeRejected, SliceError, msg.ProtocolError) as exc:
        return False, f"no signed partial, close, envelopes and bundles in the evidence: {exc}"
    if (env.kind, env.run_id, env.sender_peer_id, env.replica) != (msg.PARTIAL, run_id, accused_peer,
                                                                    evidence.replica):
        return False, "the partial is not the accused's partial of this run"
    slices = num_slices(env.stage)
    if slices is None:
        return None, f"stage {env.stage} is not held here"
    if (partial.num_slices, len(envelopes), len(bundles)) != (slices, partial.num_inputs, partial.num_inputs):
        return False, "the evidence does not hold one envelope and one bundle per input of the partial"
    hashes = [hashlib.sha256(e).digest() for e in envelopes]
    if merkle_root(hashes) != partial.inputs_root:
        return False, "the envelopes do not bind the partial's inputs root"
    if (closing.kind, closing.run_id, closing.round, closing.stage) != (msg.CLOSE, run_id, env.round,
                                                                        env.stage) \
            or [entry[2] for entry in close.contributions] != hashes:
        return False, "the close is not a close of the partial's round and stage naming its inputs"
    stands, why = close_standing(env.round, env.stage, closing.sender_peer_id, close)
    if not stands:
        return stands, f"the close of {closing.sender_peer_id[-8:]} is not known to stand: {why}"
    inputs = []
    for entry, envelope, bundle in zip(close.contributions, envelopes, bundles):
        blob, why = _input_of(entry, envelope, bundle, run_id, env.round, env.stage, partial.slice_index,
                              slices, max_blob_bytes)
        if why is not None:
            return False, why
        inputs.append(blob)
    if replay(env.stage, env.round, partial.slice_index, inputs) == partial.blob:
        return False, f"the partial of slice {partial.slice_index} equals its replay"
    return True, \
        (f"round {env.round} stage {env.stage}: the partial of slice {partial.slice_index} differs from "
         f"its replay from the {len(inputs)} inputs it binds")


def _input_of(entry, envelope: bytes, bundle: bytes, run_id: int, outer_round: int, stage: int, j: int,
              slices: int, max_blob_bytes: int) -> tuple[bytes | None, str | None]:
    """(slice j of one closed input or None if it is absent, None) or (None, why the evidence fails)."""
    reference = usable_reference(envelope, entry, run_id, outer_round, stage, slices, max_blob_bytes)
    if reference is None:
        return None, None  # no usable contribution: an absent input for every aggregator
    if hashlib.sha256(bundle).digest() != reference.bundle_digest:
        return None, f"the evidence lacks the bundle of {entry[1][-8:]}'s input"
    try:
        return bundle_slices(bundle, reference)[j], None  # None: a slice its record does not prove
    except SliceError as exc:
        return None, f"bundle of {entry[1][-8:]}: {exc}"


def bad_bundle_evidence(accused: bytes, replica: int, envelope: bytes, bundle: bytes | None,
                        reason: str) -> msg.Evidence:
    """The :class:`node.protocol.Evidence` against the signer of a contribution ``envelope`` whose reference
    (no ``bundle``) or whose ``bundle`` is bad (module docstring)."""
    items = [envelope] if bundle is None else [envelope, bundle]
    return msg.Evidence(accused, replica, items, BAD_BUNDLE, reason, [0.0] * len(items))


def bundle_fault(envelope_header, body_payload: bytes, bundle: bytes | None, num_slices: int,
                 decodes: Callable[[int, int, int, bytes], bool]) -> str | None:
    """Why the signed contribution (its header and payload) or its ``bundle`` is bad, None if nothing
    shows it: its body or reference is malformed (no bundle needed); the bundle, which must be the
    referenced one, holds a slice its record does not prove or that does not decode
    (``decodes(stage, round, slice, blob)``). Raises ValueError when ``bundle`` is not the referenced one."""
    try:
        body = msg.decode_contribution_body(body_payload)
    except msg.ProtocolError as exc:
        return f"its contribution body is malformed: {exc}"
    try:
        reference = parse_slice_reference(body.blob, num_slices, _ANY_SIZE)
    except SliceError as exc:
        return f"its reference does not fit the plan: {exc}"
    if bundle is None:
        return None
    try:
        slices = bundle_slices(bundle, reference)
    except SliceError as exc:
        raise ValueError(str(exc)) from None
    for j, blob in enumerate(slices):
        if blob is None:
            return (
                f"slice {j} of its bundle is not the one its signed record proves (or declares other inner "
                "steps than its reference)"
            )
        if not decodes(envelope_header.stage, envelope_header.round, j, blob):
            return f"slice {j} of its bundle does not decode for the slice's shapes"
    return None


def judge_bad_bundle(evidence: msg.Evidence, accused_peer: str, *, run_id: int, max_blob_bytes: int,
                     num_slices: Callable[[int], int | None],
                     decodes: Callable[[int, int, int, bytes], bool]) -> tuple[bool | None, str]:
    """``(guilty, why)`` for bad-bundle evidence against ``accused_peer``; ``(None, why)`` when this node
    holds no plan of the envelope's stage. Pure given the callables; never raises on hostile bytes."""
    if len(evidence.contributions) not in (1, 2):
        return False, "bad-bundle evidence holds an envelope and at most its bundle"
    try:
        env = decode_envelope(evidence.contributions[0], max_blob_bytes)
    except (EnvelopeRejected, ValueError) as exc:
        return False, f"no signed envelope in the evidence: {exc}"
    if (env.kind, env.run_id, env.sender_peer_id, env.replica) != (msg.CONTRIBUTION, run_id, accused_peer,
                                                                    evidence.replica):
        return False, "the envelope is not the accused's contribution of this run"
    slices = num_slices(env.stage)
    if slices is None:
        return None, f"stage {env.stage} is not held here"
    bundle = evidence.contributions[1] if len(evidence.contributions) == 2 else None
    try:
        fault = bundle_fault(env, env.payload, bundle, slices, decodes)
    except ValueError as exc:
        return False, f"the evidence's bundle is not the one the reference names: {exc}"
    if fault is None:
        return False, "the contribution and its bundle are sound"
    return True, f"round {env.round} stage {env.stage}: {fault}"


def decodes_strictly(blob: bytes, plan: SlicePlan, j: int, *, stage_index: int, outer_round: int,
                     refuse_raw: bool) -> bool:
    """Whether slice blob ``j`` decodes strictly for the slice's shapes under ``plan`` (an aggregator's first
    test, :func:`training.codec_wire.decode_contribution`)."""
    try:
        decode_contribution(blob, plan.slice_shapes(j), stage_index=stage_index, outer_round=outer_round,
                            refuse_raw=refuse_raw)
        return True
    except (ContributionDecodeError, SliceError, ValueError):
        return False


class RunSliceRules:
    """A sliced run's plans, its aggregators' replay and its strict decode, derived from the run's settings
    alone (``cfg``: a node config of the run document: model, pipeline, diloco, compression): the judges'
    callables for whoever holds no worker, an auditor. Each equals the live node's: a stage's plan is
    :func:`training.slice_plan.live_plan` of its shapes and the aggregators' byte budget is the stage
    engine's (``stage_bandwidth_budget`` of the stage's size)."""

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self._plans: dict[int, tuple[SlicePlan, int]] = {}

    def plan(self, stage: int) -> tuple[SlicePlan, int] | None:
        """(the plan, the aggregators' byte budget) of ``stage``; None for a stage the run does not have."""
        from training.stages import split_stages, stage_param_shapes

        if stage not in self._plans:
            specs = split_stages(self.cfg.model.n_layer, self.cfg.pipeline.num_stages)
            if not 0 <= stage < len(specs):
                return None
            shapes = stage_param_shapes(self.cfg.model, specs[stage])
            diloco = self.cfg.diloco
            numel = sum(math.prod(shape) for shape in shapes.values())
            budget = self.cfg.compression.stage_bandwidth_budget(numel, diloco.inner_steps,
                                                                 diloco.num_replicas)
            self._plans[stage] = live_plan(shapes, diloco.num_replicas, diloco.min_slice_numel), budget
        return self._plans[stage]

    def num_slices(self, stage: int) -> int | None:
        held = self.plan(stage)
        return None if held is None else held[0].num_slices

    def replay(self, stage: int, outer_round: int, j: int, inputs: list[bytes | None]) -> bytes:
        """The partial an honest aggregator of slice ``j`` publishes for ``inputs`` (``replay_partial``)."""
        plan, budget = self.plan(stage)
        return replay_partial(inputs, plan, j, self.cfg.compression, budget,
                              norm_clip=self.cfg.diloco.norm_clip, stage_index=stage, outer_round=outer_round,
                              steps_range=self.cfg.diloco.steps_range)

    def decodes(self, stage: int, outer_round: int, j: int, blob: bytes) -> bool:
        plan, _budget = self.plan(stage)
        return decodes_strictly(blob, plan, j, stage_index=stage, outer_round=outer_round,
                                refuse_raw=self.cfg.compression.enabled)
