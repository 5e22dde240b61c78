"""The replay of a sliced round (``diloco.exchange = "sliced"``, docs/PROTOCOL.md "Sliced exchange").

A sliced round's contribution envelopes carry references (a slice bundle's
hash and the Merkle root of its slices); the holders applied the average
assembled from one partial per slice. Per stage the auditor computes the
inputs root (the Merkle root of the closed envelope hashes, as the holders
did), takes every archived partial envelope that
binds it and is signed by one of the slice's candidates: that is the partial
every holder had to apply, so the weights root is replayed from it. When the
contributors' archives hold the slice bundles (each checked against its
reference, each slice read as an aggregator reads it), each partial is also
replayed (:func:`training.butterfly.replay_partial`, bit for bit): one that
differs is a FAIL naming its signer (an aggregator that poisoned its slice).
Without the bundles the partial is used unreplayed and the round's note says so.
A closed envelope that is no usable contribution (``node.live.exchange.sliced.usable_reference``:
its reference does not fit the plan, or it is not a contribution at all) is an absent
input here as for the aggregators, and so is a slice its bundle does not prove.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

from node.tools.report import FAIL, OK, Check


class SlicedEvidenceMissing(Exception):
    """No archive holds a partial (or the inputs) of a slice: the round cannot be replayed here."""


def _partials(sources: list, round_index: int) -> list[bytes]:
    seen, out = set(), []
    for source in sources:
        for data in getattr(source, "round_blobs", lambda *_: [])(round_index, "partial"):
            digest = hashlib.sha256(data).digest()
            if digest not in seen:
                seen.add(digest)
                out.append(data)
    return out


def _slice_blob(sources: list, round_index: int, digest: bytes) -> bytes | None:
    for source in sources:
        getter = getattr(source, "round_blob", None)
        data = getter(round_index, digest.hex(), "slice") if getter is not None else None
        if data is not None and hashlib.sha256(data).digest() == digest:
            return data
    return None


def sliced_average(cfg: Any, run_id: int, round_index: int, stage: int, shapes: dict, references: list[bytes],
                   peers: list[str], sources: list, notes: list[str], checks: list,
                   hashes: list[bytes]) -> dict | None:
    """The average the holders of ``stage`` had to apply in ``round_index``, re-derived (module docstring):
    :func:`average_of_partials` of :func:`applied_partials` (same arguments)."""
    from training.butterfly import average_of_partials
    from training.slice_plan import live_plan

    plan = live_plan(shapes, cfg.diloco.num_replicas, cfg.diloco.min_slice_numel)
    blobs = applied_partials(cfg, run_id, round_index, stage, shapes, references, peers, sources, notes,
                             checks, hashes)
    return average_of_partials(blobs, plan, stage_index=stage, outer_round=round_index,
                               refuse_raw=cfg.compression.enabled)


def applied_partials(cfg: Any, run_id: int, round_index: int, stage: int, shapes: dict,
                     references: list[bytes], peers: list[str], sources: list, notes: list[str], checks: list,
                     hashes: list[bytes]) -> list[bytes]:
    """The partial blob (slice order) every holder of ``stage`` had to apply in ``round_index``.

    ``references``, ``peers`` and ``hashes``: the closed contributions' references (b"" for an envelope
    that is no contribution), signers and envelope hashes in canonical order.
    Appends a check per replayed partial to ``checks`` (FAIL: a partial that differs from its replay) and
    what else it finds to ``notes``; raises SlicedEvidenceMissing when a slice has neither a bound
    partial nor its inputs.
    """
    from ledger.merkle import merkle_root
    from training.slice_plan import live_plan

    plan = live_plan(shapes, cfg.diloco.num_replicas, cfg.diloco.min_slice_numel)
    bundles = _contributor_bundles(cfg, plan, references, peers, sources, round_index, stage, notes)
    # the close's contributions root, which every partial binds
    bound = _bound_partials(cfg, run_id, round_index, stage, plan, peers, sources, merkle_root(hashes))
    numel = sum(math.prod(s) for s in shapes.values())
    budget = cfg.compression.stage_bandwidth_budget(numel, cfg.diloco.inner_steps, cfg.diloco.num_replicas)
    where = (stage, round_index)
    return [_applied_partial(cfg, plan, j, bound.get(j, {}), bundles, budget, where, checks, notes)
            for j in range(plan.num_slices)]


def _contributor_bundles(cfg: Any, plan: Any, references: list[bytes], peers: list[str], sources: list,
                         round_index: int, stage: int, notes: list[str]) -> list:
    """Each contributor's slice blobs in canonical order: a list per contributor, a list of Nones for an
    absent input, None when no archive holds a bundle that checks."""
    from training.slice_plan import SliceError
    from training.slicebundle import bundle_slices, parse_slice_reference

    absent = [None] * plan.num_slices
    bundles = []
    for index, data in enumerate(references):
        try:
            reference = parse_slice_reference(data, plan.num_slices, cfg.p2p.max_blob_bytes)
        # the aggregators' rule (node.live.exchange.sliced.usable_reference): absent
        except SliceError as exc:
            notes.append(f"stage {stage}: contribution {index} of {peers[index][-8:]} is no usable slice "
                         f"reference ({exc}): an absent input")
            bundles.append(absent)
            continue
        blob = _slice_blob(sources, round_index, reference.bundle_digest)
        try:
            bundles.append(None if blob is None else bundle_slices(blob, reference))
        except SliceError as exc:
            notes.append(f"stage {stage}: bundle {reference.bundle_digest.hex()[:12]} does not check: {exc}")
            bundles.append(None)
    return bundles


def _bound_partials(cfg: Any, run_id: int, round_index: int, stage: int, plan: Any, peers: list[str],
                    sources: list, root: bytes) -> dict[int, dict[bytes, str]]:
    """slice -> partial blob -> signer, for every archived partial of the stage and round that binds the
    close's inputs and comes from one of the slice's candidate aggregators."""
    from p2p.envelope import decode_envelope
    from p2p.errors import EnvelopeRejected
    from training.slice_plan import SliceError, candidate
    from training.slicemessages import parse_partial

    members = len(peers)
    bound: dict[int, dict[bytes, str]] = {}
    for data in _partials(sources, round_index):
        try:
            env = decode_envelope(data, cfg.p2p.max_blob_bytes)
            partial = parse_partial(env.payload)
        except (EnvelopeRejected, SliceError):
            continue
        if (env.kind, env.run_id, env.round, env.stage) != ("partial", run_id, round_index, stage):
            continue
        j = partial.slice_index
        if (partial.num_slices, partial.num_inputs) != (plan.num_slices, members) or j >= plan.num_slices:
            continue
        if partial.inputs_root != root:
            continue
        if env.sender_peer_id not in {peers[candidate(j, round_index, members, m)] for m in range(members)}:
            continue
        bound.setdefault(j, {})[partial.blob] = env.sender_peer_id
    return bound


def _applied_partial(cfg: Any, plan: Any, j: int, offers: dict[bytes, str], bundles: list, budget: int,
                     where: tuple[int, int], checks: list, notes: list[str]) -> bytes:
    """The partial every holder had to apply for slice ``j``; each bound partial checked against its
    replay."""
    from training.butterfly import replay_partial

    stage, round_index = where
    members = len(bundles)
    expected = None
    if all(bundle is not None for bundle in bundles):  # a bad slice of an archived bundle: absent
        inputs = [bundle[j] for bundle in bundles]
        expected = replay_partial(inputs, plan, j, cfg.compression, budget, norm_clip=cfg.diloco.norm_clip,
                                  stage_index=stage, outer_round=round_index,
                                  steps_range=cfg.diloco.steps_range)
        for blob, signer in offers.items():
            label = f"partial s{stage} j{j} by {signer[-8:]} (replay)"
            checks.append(Check(label, OK, f"bit for bit from {members} slice blobs") if blob == expected else
                          Check(label, FAIL, f"the partial signed by {signer} differs from its replay from "
                                f"the {members} inputs it binds (a wrong partial over the right inputs)"))
    elif offers:
        notes.append(f"stage {stage} slice {j}: slice blobs not archived; the partial is not replayed")
    if len(offers) == 1:
        return next(iter(offers))  # what every holder had to apply
    if offers and expected in offers:
        return expected  # honest fallbacks publish the replay's bytes
    if expected is not None:
        notes.append(f"stage {stage} slice {j}: {len(offers)} bound partials; the replay is used")
        return expected
    raise SlicedEvidenceMissing(f"stage {stage} slice {j}: {len(offers)} bound partials and no slice "
                                "blobs to replay them")


class SlicedInputsMissing(Exception):
    """A sliced contribution's rerun inputs are not in the archives (or do not check): not rerun."""


class SlicedBundleFails(Exception):
    """A contribution whose archived bundle is the one its signed reference names (sha256 checked) and does
    not prove that reference's record: nothing honest can be rerun from it, so it counts as a failing rerun of
    ``stage`` (its signer's fault alone, as for the aggregators and the bad-bundle judge)."""

    def __init__(self, stage: int, reason: str) -> None:
        super().__init__(reason)
        self.stage = stage


class SlicedRerunArchive:
    """What ``dlx-node audit --reexecute`` reruns a sliced contribution with, read from the archives, as the
    node's spot checker reads it from its peers (node/live/checks/sliced_rerun.py): the claims are the slices
    each envelope's reference binds, packed (:func:`training.butterfly.rerun_claim`), from the member's
    archived bundle (``<sha256>.slice``); round t-1's apply is the partial every holder had to apply per slice
    (:func:`applied_partials`, the replay's own choice). A reference that does not parse, or a bundle not
    archived, makes the contribution unverifiable here; the referenced bundle failing its own record is a
    failing rerun (:class:`SlicedBundleFails`).

    ``archives``: node.tools.audit_reexec's archives (``round_blob``/``round_blobs``/``envelope``);
    ``sealed``: round -> its sealed [stage, replica, peer id, hash hex] entries in canonical order.
    """

    def __init__(self, cfg: Any, archives: Any, sealed: dict[int, list[list]]) -> None:
        self.cfg, self.archives, self.sealed = cfg, archives, sealed
        self._previous: dict[int, dict[int, list[bytes]]] = {}

    def shapes(self, stage: int) -> dict:
        from training.stages import split_stages, stage_param_shapes

        specs = split_stages(self.cfg.model.n_layer, self.cfg.pipeline.num_stages)
        if not 0 <= stage < len(specs):
            raise SlicedInputsMissing(f"stage {stage} is not one of the run's {len(specs)}")
        return stage_param_shapes(self.cfg.model, specs[stage])

    def claims(self, round_index: int, envs: list) -> list[bytes]:
        """Per envelope (stage order), the packed slice blobs its reference binds; raises
        SlicedInputsMissing."""
        from node import protocol as msg
        from training.slice_plan import SliceError, live_plan
        from training.slicebundle import parse_slice_reference, rerun_claim

        out = []
        for env in envs:
            plan = live_plan(self.shapes(env.stage), self.cfg.diloco.num_replicas,
                             self.cfg.diloco.min_slice_numel)
            try:
                reference = parse_slice_reference(msg.decode_contribution_body(env.payload).blob,
                                                  plan.num_slices, self.cfg.p2p.max_blob_bytes)
            except (SliceError, ValueError) as exc:
                raise SlicedInputsMissing(f"stage {env.stage}: no usable slice reference ({exc})") from None
            digest = reference.bundle_digest.hex()
            bundle = self.archives.round_blob(round_index, digest, "slice")
            if bundle is None:
                raise SlicedInputsMissing(
                    f"stage {env.stage}: its slice bundle {digest[:12]} is not in the archives")
            try:
                out.append(rerun_claim(bundle, reference))
            # the referenced bytes (sha256 checked) fail the member's own signed record
            except SliceError as exc:
                raise SlicedBundleFails(
                    env.stage,
                    f"stage {env.stage}: its bundle {digest[:12]} (the one its "
                    f"signed reference names) does not prove its own record: {exc}",
                ) from None
        return out

    def previous(self, round_index: int) -> dict[int, list[bytes]]:
        """Stage -> the partial blobs (slice order) every holder had to apply in ``round_index`` ({} before
        round 0); raises SlicedInputsMissing when the archives cannot say."""
        if round_index < 0:
            return {}
        if round_index not in self._previous:
            self._previous[round_index] = {stage: self._applied(round_index, stage)
                                           for stage in range(self.cfg.pipeline.num_stages)}
        return self._previous[round_index]

    def _applied(self, round_index: int, stage: int) -> list[bytes]:
        from node import protocol as msg
        from p2p.envelope import decode_envelope
        from p2p.errors import EnvelopeRejected

        entries = [e for e in self.sealed.get(round_index, []) if int(e[0]) == stage]
        if not entries:
            raise SlicedInputsMissing(f"round {round_index} stage {stage}: not sealed in the archives")
        references, peers, hashes = [], [], []
        for _stage, _replica, peer, hash_hex in entries:
            data = self.archives.envelope(round_index, hash_hex)
            if data is None:
                raise SlicedInputsMissing(
                    f"round {round_index}: envelope {hash_hex[:12]} is not in the archives")
            try:
                references.append(msg.decode_contribution_body(
                    decode_envelope(data, self.cfg.p2p.max_blob_bytes).payload).blob)
            except (EnvelopeRejected, ValueError, msg.ProtocolError):
                references.append(b"")  # no contribution: an absent input, as for the aggregators
            peers.append(str(peer))
            hashes.append(bytes.fromhex(hash_hex))
        try:
            return applied_partials(self.cfg, self.archives.run_id, round_index, stage, self.shapes(stage),
                                    references, peers, [self.archives], [], [], hashes)
        except SlicedEvidenceMissing as exc:
            raise SlicedInputsMissing(f"round {round_index}'s apply: {exc}") from None
