"""A member that publishes hostile partials in the sliced exchange, run as a real process by the tests.

    python tests/sliced_adversary.py ATTACK [dlx-node arguments...]

The node is built from a subclass of the sliced exchange (or of the worker) for
ATTACK, as tests/adversary.py builds its attackers.

- ``wrong-root``: every partial it aggregates binds an inputs root of zeros
  (validly signed; every holder must refuse it and take the fallback's).
- ``wrong-blob``: every partial it aggregates binds the right inputs but
  carries 5 x the honest average, re-encoded (decodes, binds: the holders
  apply it alike; only the auditor's replay of the slice catches it).
- ``bad-slice``: its slice bundle's last slice does not match its record
  (the reference it signs names that bundle): the aggregator of that slice
  reads the whole bundle, keeps it as evidence and aggregates without that
  input; everyone, the auditor included, agrees.
- ``bad-reference``: the reference its contribution envelopes sign names one
  slice too many (no usable contribution). An honest coordinator refuses it
  when it fetches it and closes without it; when this member coordinates, its
  close names it (placed, announced: the holders, who fetch no envelope, accept
  the close) and every aggregator and the auditor take it as an absent input.
- ``withhold``: it announces its contribution envelopes and serves them, but never serves
  the bundle they reference (it keeps it in its archive). An honest coordinator, which
  fetches every bundle before closing, closes without it at the deadline; when it
  coordinates, it closes with its own entry (it holds its bundle), no aggregator can read
  its slices, every candidate's turn passes, the holders refuse its close and take the
  next coordinator's, which names the honest members only.
- ``two-partials``: as the aggregator of a slice it signs two partials that bind the
  right inputs, a wrong one (5 x the average) and the honest one, announces both and
  serves them a moment later: every holder holds two bound partials that differ,
  replays the slice, applies the honest one and keeps the wrong one as evidence.
- ``slices-huge-1e3`` / ``slices-huge-1e6`` / ``slices-sign-flip`` / ``slices-noise`` /
  ``slices-zero`` / ``slices-stale``: the full exchange's forged contributions
  (tests/adversary.py, whose forgeries change the whole blob a sliced run never sends) for a
  sliced run: each slice of its bundle is the honest slice forged (times 1e3 or 1e6, negated,
  noise of its norm, zeros, the previous round's honest slice) and re-encoded, so every
  aggregator's per-slice exclusion and norm rule meets it.
- ``slices-malformed``: the full exchange's ``malformed-payload``: every slice blob of its
  bundle is bytes of the same length that do not decode, in a well-formed bundle whose records
  and root match them (validly signed), so every aggregator reads the slice and excludes it.
- ``slices-copy``: the full exchange's ``copy``: a free rider that waits for another
  member's contribution of the round, fetches its envelope and bundle (both served), and
  publishes that member's slices, decoded and re-encoded, as its own bundle.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adversary import run_with  # tests/ is on the path: this file's directory

FORGED = ("slices-huge-1e3", "slices-huge-1e6", "slices-sign-flip", "slices-noise", "slices-zero",
          "slices-stale", "slices-malformed")
ATTACKS = ("wrong-root", "wrong-blob", "bad-slice", "bad-reference", "withhold", "two-partials", *FORGED,
           "slices-copy")


def sliced(exchange) -> dict:
    from node.live.exchange.registry import EXCHANGES

    return {"exchanges": {**EXCHANGES, "sliced": exchange}}


def wrong_root() -> dict:
    from node.live.exchange.sliced import SlicedExchange
    from training.slicemessages import partial_payload

    class WrongRoot(SlicedExchange):
        def make_payload(self, slice_index, num_slices, root, members, blob):
            return partial_payload(slice_index, num_slices, bytes(32), members, blob)

    return sliced(WrongRoot)


def wrong_blob_worker():
    import torch

    from node.live.worker.replica import ReplicaWorker
    from training.compression import encode_contribution

    class WrongBlobWorker(ReplicaWorker):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.honest = {}  # (stage, round, slice) -> the honest partial blob

        def aggregate_slice(self, stage, outer_round, slice_index, blobs):
            result = super().aggregate_slice(stage, outer_round, slice_index, blobs)
            self.honest[(stage, outer_round, slice_index)] = result.partial
            if result.decoded is not None:
                scaled = {name: torch.mul(value, 5.0) for name, value in result.decoded.items()}
                result.partial, result.decoded, _ = encode_contribution(
                    scaled, self.cfg.compression, stage_index=stage, outer_round=outer_round)
            return result

    return WrongBlobWorker


def wrong_blob() -> dict:
    return {"worker": wrong_blob_worker()}


def bad_slice() -> dict:
    import hashlib

    from node.live.exchange.sliced import SlicedExchange
    from training import slicebundle

    class BadSlice(SlicedExchange):
        def publish(self, outer_round, stage, blobs):
            bundle, reference = slicebundle.slice_bundle(blobs)
            tampered = bundle[:-1] + bytes([bundle[-1] ^ 1])  # the last byte belongs to the last slice
            root = reference[-32:]
            reference = slicebundle.REFERENCE_PREFIX + slicebundle._REFERENCE.pack(
                len(blobs), hashlib.sha256(tampered).digest(), len(tampered), root)
            self.archive.put_blob(outer_round, tampered, "slice")
            self.host.provide_blob(tampered, announce=False)
            return reference

    return sliced(BadSlice)


def bad_reference() -> dict:
    from node.live.exchange.sliced import SlicedExchange
    from p2p.envelope import decode_envelope
    from training import slicebundle

    class BadReference(SlicedExchange):
        def publish(self, outer_round, stage, blobs):
            bundle, reference = slicebundle.slice_bundle(blobs)
            self.archive.put_blob(outer_round, bundle, "slice")
            self.host.provide_blob(bundle, announce=False)
            count, digest, size, root = slicebundle._REFERENCE.unpack_from(reference,
                                                                           len(slicebundle.REFERENCE_PREFIX))
            return slicebundle.REFERENCE_PREFIX + slicebundle._REFERENCE.pack(count + 1, digest, size, root)

        def close_inputs_held(self, outer_round, stage, digest, envelope):
            if decode_envelope(envelope, self.max_blob_bytes).sender_peer_id == self.peer_id:
                return True  # its own (unusable) envelope: it closes with it (the honest check would raise)
            return super().close_inputs_held(outer_round, stage, digest, envelope)

    return sliced(BadReference)


def withhold() -> dict:
    from node.live.exchange.sliced import SlicedExchange
    from p2p.envelope import decode_envelope
    from training import slicebundle

    class Withhold(SlicedExchange):
        def publish(self, outer_round, stage, blobs):
            bundle, reference = slicebundle.slice_bundle(blobs)
            self.archive.put_blob(outer_round, bundle, "slice")  # kept (the auditor reads it), never served
            return reference

        def close_inputs_held(self, outer_round, stage, digest, envelope):
            if decode_envelope(envelope, self.max_blob_bytes).sender_peer_id == self.peer_id:
                return True  # its own bundle: it holds it (and serves it to nobody)
            return super().close_inputs_held(outer_round, stage, digest, envelope)

    return sliced(Withhold)


def two_partials() -> dict:
    import hashlib
    import time

    from node import protocol as msg
    from node.live.exchange.sliced import SlicedExchange
    from training.slicemessages import parse_partial, partial_payload

    class TwoPartials(SlicedExchange):
        def publish_partial(self, outer_round, stage, payload):
            wrong = parse_partial(payload)
            honest = self.worker().honest[(stage, outer_round, wrong.slice_index)]
            envelopes = []
            for blob in (wrong.blob, honest):
                data = self.messenger.sign(outer_round, msg.PARTIAL, partial_payload(
                    wrong.slice_index, wrong.num_slices, wrong.inputs_root, wrong.num_inputs, blob), stage)
                envelopes.append(data)
                self.messenger.gossip(outer_round, msg.PARTIAL_ANNOUNCE, msg.PartialAnnounce(
                    wrong.slice_index, hashlib.sha256(data).digest(), len(data)), stage)
            time.sleep(3.0)  # both announces reach every holder before either partial can be fetched
            for data in envelopes:
                self.host.provide_blob(data, announce=False)
            return envelopes[0]

    return {"worker": wrong_blob_worker(), **sliced(TwoPartials)}


def forged_slices(attack: str) -> dict:
    import torch

    from node.live.worker.replica import ReplicaWorker
    from training.codec_wire import decode_contribution
    from training.compression import encode_contribution

    kind = attack.removeprefix("slices-")

    def forge(value, generator):
        if kind.startswith("huge-"):
            return value * float(kind.removeprefix("huge-"))
        if kind == "sign-flip":
            return -value
        if kind == "noise":
            noise = torch.randn(value.shape, generator=generator)
            return noise * (value.norm() / noise.norm().clamp_min(1e-12))
        return torch.zeros_like(value)  # "zero"

    class ForgingSlicesWorker(ReplicaWorker):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.rounds = {}  # stage -> the round last encoded
            self.previous = {}  # stage -> the last round's honest decoded slices (slices-stale)

        def encode(self, stage, outer_round):
            self.rounds[stage] = outer_round
            return super().encode(stage, outer_round)

        def last_slices(self, stage):
            outer_round, plan = self.rounds[stage], self.plans[stage]
            generator = torch.Generator().manual_seed(1000 * outer_round + stage)
            if kind == "malformed":  # same lengths, no longer decodable: the bundle is built over these
                return [bytes(b ^ 0x5A for b in blob) for blob in super().last_slices(stage)]
            forged, honest_slices = [], []
            for j, blob in enumerate(super().last_slices(stage)):
                honest = decode_contribution(blob, plan.slice_shapes(j), stage_index=stage,
                                             outer_round=outer_round)
                honest_slices.append(honest)
                # the previous round's honest slice (the first round's own: nothing older)
                if kind == "stale":
                    values = self.previous.get(stage, honest_slices)[j]
                else:
                    values = {name: forge(value, generator) for name, value in honest.items()}
                try:
                    blob = encode_contribution(values, self.cfg.compression, stage_index=stage,
                                               outer_round=outer_round)[0]
                except torch.linalg.LinAlgError:  # a decoded low-rank slice, negated: its Gram matrix may not
                    # factorize (training/codec); the forgery with a 1e-6 jitter does
                    values = {name: value + 1e-6 * value.abs().max() * torch.randn(value.shape,
                                                                                   generator=generator)
                              for name, value in values.items()}
                    blob = encode_contribution(values, self.cfg.compression, stage_index=stage,
                                               outer_round=outer_round)[0]
                forged.append(blob)
            self.previous[stage] = honest_slices
            return forged

    return {"worker": ForgingSlicesWorker}


def copy_slices() -> dict:
    import logging
    import time

    from node.live.exchange.sliced import SlicedExchange
    from node.protocol import decode_contribution_body
    from p2p.envelope import decode_envelope
    from training.codec_wire import decode_contribution
    from training.compression import encode_contribution
    from training.slicebundle import bundle_slices, parse_slice_reference

    logger = logging.getLogger("sliced_adversary")

    class CopySlices(SlicedExchange):
        def publish(self, outer_round, stage, blobs):
            copied = self.copied(outer_round, stage)
            return super().publish(outer_round, stage, blobs if copied is None else copied)

        def copied(self, outer_round, stage):
            """Another member's slices of (round, stage), decoded and re-encoded, or None within 30 s."""
            plan = self.worker().plans[stage]
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                for announced in self.pool.book.snapshot_announces(outer_round, stage).values():
                    if announced.peer_id == self.peer_id:
                        continue
                    envelope = self._fetch(announced.envelope_hash, announced.peer_id)
                    if envelope is None:
                        continue
                    env = decode_envelope(envelope, self.max_blob_bytes)
                    reference = parse_slice_reference(decode_contribution_body(env.payload).blob,
                                                      plan.num_slices, self.max_blob_bytes)
                    bundle = self._fetch(reference.bundle_digest, announced.peer_id)
                    if bundle is None:
                        continue
                    theirs = bundle_slices(bundle, reference)
                    if any(blob is None for blob in theirs):
                        continue
                    logger.warning("adversary: round %d stage %d: publishing %s's slices as its own",
                                   outer_round, stage, announced.peer_id[-8:])
                    return [encode_contribution(
                        decode_contribution(blob, plan.slice_shapes(j), stage_index=stage,
                                            outer_round=outer_round),
                        self.worker().cfg.compression, stage_index=stage, outer_round=outer_round)[0]
                        for j, blob in enumerate(theirs)]
                time.sleep(0.2)
            return None

    return sliced(CopySlices)


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in ATTACKS:
        print(f"usage: sliced_adversary.py {{{'|'.join(ATTACKS)}}} [dlx-node arguments]", file=sys.stderr)
        return 2
    attack = sys.argv.pop(1)
    return run_with({"wrong-root": wrong_root, "wrong-blob": wrong_blob, "bad-slice": bad_slice,
                     "bad-reference": bad_reference, "withhold": withhold,
                     "two-partials": two_partials, "slices-copy": copy_slices,
                     **{name: (lambda name=name: forged_slices(name)) for name in FORGED}}[attack]())


if __name__ == "__main__":
    sys.exit(main())
