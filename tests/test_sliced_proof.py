"""The evidence of a wrong sliced partial (node/slicedproof.py): what convicts, what does not.

The replay here is a plain pure function of the inputs (the judge takes the aggregators' rule as a
parameter; the live rule, ``aggregate_slice``, is judged end to end in tests/test_node_sliced_e2e.py).
What is under test is the binding: a conviction needs the accused's signed partial, the envelopes
its inputs root binds, the close that names them and every usable input's bundle; an accuser that
leaves one out, swaps one or reorders them convicts nobody, and hostile bytes never raise.
"""

from __future__ import annotations

import hashlib

from hypothesis import given, settings
from hypothesis import strategies as st

from ledger.merkle import merkle_root
from node import protocol as msg
from node.slicedproof import (
    BAD_BUNDLE,
    WRONG_PARTIAL,
    bad_bundle_evidence,
    judge_bad_bundle,
    judge_wrong_partial,
    pack_items,
    unpack_items,
    wrong_partial_evidence,
)
from p2p.envelope import Envelope
from p2p.identity import Identity
from training import slicebundle
from training.slicebundle import slice_bundle
from training.slicemessages import partial_payload

RUN, ROUND, STAGE, SLICES = 7, 3, 0, 2
ACCOUNT = b"\x11" * 20


def replay(stage, outer_round, j, inputs):
    return hashlib.sha256(repr((stage, outer_round, j, inputs)).encode()).digest()


def _contribution(identity, replica, reference):
    body = msg.encode_contribution_body(msg.ContributionBody(b"s" * 32, b"d" * 32, reference))
    return Envelope.create(identity, RUN, ROUND, msg.CONTRIBUTION, body, stage=STAGE,
                           replica=replica).to_bytes()


def _round(members=3):
    """Members' identities, closed envelopes, bundles and the coordinator's signed close."""
    identities = [Identity.generate() for _ in range(members)]
    envelopes, bundles, entries = [], [], []
    for replica, identity in enumerate(identities):
        bundle, reference = slice_bundle([bytes([replica, j]) * (10 + j) for j in range(SLICES)])
        envelope = _contribution(identity, replica, reference)
        envelopes.append(envelope)
        bundles.append(bundle)
        entries.append([replica, identity.peer_id, hashlib.sha256(envelope).digest(), len(envelope)])
    close = Envelope.create(identities[0], RUN, ROUND, msg.CLOSE, msg.encode_payload(msg.Close(entries)),
                            stage=STAGE).to_bytes()
    return identities, envelopes, bundles, entries, close


def _partial(identity, replica, envelopes, blob, j=1):
    root = merkle_root([hashlib.sha256(e).digest() for e in envelopes])
    payload = partial_payload(j, SLICES, root, len(envelopes), blob)
    return Envelope.create(identity, RUN, ROUND, msg.PARTIAL, payload, stage=STAGE,
                           replica=replica).to_bytes()


def _inputs(bundles, j=1, absent=()):
    # slice j of each bundle as slice_bundle laid it out: the blobs _round made
    return [None if i in absent else bytes([i, j]) * (10 + j) for i in range(len(bundles))]


def _stands(_outer_round, _stage, _signer, _close):
    return True, "stands"


def _judge(evidence, accused, slices=SLICES, close_standing=_stands):
    return judge_wrong_partial(evidence, accused, run_id=RUN, max_blob_bytes=1 << 20,
                               num_slices=lambda stage: slices if stage == STAGE else None, replay=replay,
                               close_standing=close_standing)


def test_a_partial_that_differs_from_its_replay_convicts_its_signer_and_an_honest_one_does_not():
    identities, envelopes, bundles, _entries, close = _round()
    accused = identities[2]
    wrong = _partial(accused, 2, envelopes, b"five times the average")
    evidence = wrong_partial_evidence(ACCOUNT, 2, wrong, envelopes, bundles, close, "slice 1 differs")
    assert evidence.verdict == WRONG_PARTIAL
    guilty, why = _judge(evidence, accused.peer_id)
    assert guilty is True, why
    # The same evidence round-trips the wire (the EVIDENCE payload) and still convicts.
    decoded = msg.decode_payload(msg.EVIDENCE, msg.encode_payload(evidence))
    assert _judge(decoded, accused.peer_id)[0] is True
    honest = _partial(accused, 2, envelopes, replay(STAGE, ROUND, 1, _inputs(bundles)))
    guilty, why = _judge(wrong_partial_evidence(ACCOUNT, 2, honest, envelopes, bundles, close, "x"),
                         accused.peer_id)
    assert guilty is False and "equals its replay" in why
    # Evidence names the signer it accuses: another member is not convicted by it.
    assert _judge(evidence, identities[1].peer_id)[0] is False
    # A node that holds no plan of the stage does not judge.
    assert judge_wrong_partial(evidence, accused.peer_id, run_id=RUN, max_blob_bytes=1 << 20,
                               num_slices=lambda stage: None, replay=replay, close_standing=_stands)[0] \
                               is None


def test_evidence_that_does_not_bind_or_lacks_an_input_convicts_nobody():
    identities, envelopes, bundles, _entries, close = _round()
    accused = identities[2]
    wrong = _partial(accused, 2, envelopes, b"wrong")
    _ids, other_envelopes, _bundles, _e, other_close = _round()
    cases = {
        "swapped envelope": (wrong, [other_envelopes[0], *envelopes[1:]], bundles, close),
        "reordered": (wrong, [envelopes[1], envelopes[0], envelopes[2]], [bundles[1], bundles[0], bundles[2]],
                      close),
        "one envelope short": (wrong, envelopes[:2], bundles[:2], close),
        "a bundle left out": (wrong, envelopes, [b"", *bundles[1:]], close),
        "another bundle": (wrong, envelopes, [bundles[1], *bundles[1:]], close),
        "another round's close": (wrong, envelopes, bundles, other_close),
        "not a partial": (envelopes[2], envelopes, bundles, close),
    }
    for name, (partial, envs, bunds, closing) in cases.items():
        guilty, why = _judge(wrong_partial_evidence(ACCOUNT, 2, partial, envs, bunds, closing, name),
                             accused.peer_id)
        assert guilty is False, (name, why)


def test_an_input_the_close_names_under_another_replica_is_absent_for_the_judge_as_for_the_aggregators():
    """A close whose entry does not match its envelope's header makes that input absent for every aggregator
    (usable_reference); the judge reads the entries from the signed close, so an aggregator that left it out
    is not framed, and one that used it is convicted."""
    identities, envelopes, bundles, entries, _close = _round()
    entries[1] = [5, *entries[1][1:]]  # replica 5 named for replica 1's envelope
    close = Envelope.create(identities[0], RUN, ROUND, msg.CLOSE, msg.encode_payload(msg.Close(entries)),
                            stage=STAGE).to_bytes()
    accused = identities[2]
    honest = _partial(accused, 2, envelopes, replay(STAGE, ROUND, 1, _inputs(bundles, absent={1})))
    guilty, why = _judge(wrong_partial_evidence(ACCOUNT, 2, honest, envelopes, bundles, close, "x"),
                         accused.peer_id)
    assert guilty is False, why
    used_it = _partial(accused, 2, envelopes, replay(STAGE, ROUND, 1, _inputs(bundles)))
    assert _judge(wrong_partial_evidence(ACCOUNT, 2, used_it, envelopes, bundles, close, "x"),
                  accused.peer_id)[0]


def test_a_made_up_close_that_misnames_an_input_frames_no_honest_aggregator():
    """Any member can sign a close: one made up to name replica 1's envelope under another replica makes that
    input absent for the judge, so an honest aggregator's partial (which used it) would differ from the
    replay. The judge asks ``close_standing`` about the proof's close (its signer and set) and convicts only
    on a close the round's aggregators went by: not guilty where it does not stand, no verdict where that
    cannot be told here."""
    identities, envelopes, bundles, entries, real_close = _round()
    framer, accused = identities[1], identities[2]
    made_up = [list(e) for e in entries]
    made_up[1] = [5, *made_up[1][1:]]
    fake_close = Envelope.create(framer, RUN, ROUND, msg.CLOSE, msg.encode_payload(msg.Close(made_up)),
                                 stage=STAGE).to_bytes()
    honest = _partial(accused, 2, envelopes, replay(STAGE, ROUND, 1, _inputs(bundles)))
    evidence = wrong_partial_evidence(ACCOUNT, 2, honest, envelopes, bundles, fake_close, "framed")
    asked = []

    def aggregated_set(outer_round, stage, signer, close):  # the rule a holder applies: the set it aggregated
        asked.append((outer_round, stage, signer))
        same = [list(e) for e in close.contributions] == [list(e) for e in entries]
        return same, "the set aggregated" if same else "another set than the one aggregated"

    assert _judge(evidence, accused.peer_id)[0] is True  # a judge that took any member's close was framed
    guilty, why = _judge(evidence, accused.peer_id, close_standing=aggregated_set)
    assert guilty is False and "another set" in why, why
    assert asked == [(ROUND, STAGE, framer.peer_id)]
    guilty, why = _judge(evidence, accused.peer_id, close_standing=lambda *_a: (None, "round forgotten"))
    assert guilty is None and "round forgotten" in why
    # Against the close the round went by, the honest partial equals its replay and a wrong one convicts.
    real = wrong_partial_evidence(ACCOUNT, 2, honest, envelopes, bundles, real_close, "x")
    assert _judge(real, accused.peer_id, close_standing=aggregated_set)[0] is False
    wrong = _partial(accused, 2, envelopes, b"wrong")
    assert _judge(wrong_partial_evidence(ACCOUNT, 2, wrong, envelopes, bundles, real_close, "x"),
                  accused.peer_id, close_standing=aggregated_set)[0] is True


def test_packed_items_round_trip_and_refuse_what_they_did_not_pack():
    items = [b"", b"a", b"bc" * 100]
    assert unpack_items(pack_items(items), 3) == items
    for bad in (b"", b"\x00\x00\x00", pack_items(items) + b"x", pack_items(items)[:-1],
                pack_items(items * 2)):
        try:
            unpack_items(bad, 3)
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} unpacked")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=300), min_size=0, max_size=6))
def test_hostile_evidence_never_raises(items):
    identities, *_rest = _round(2)
    evidence = msg.Evidence(ACCOUNT, 0, items or [b""], WRONG_PARTIAL, "hostile", [0.0] * max(1, len(items)))
    guilty, why = _judge(evidence, identities[0].peer_id)
    assert guilty in (False, None) and why


# -- a bad bundle (node.slicedproof.judge_bad_bundle) ---------------------------------------


def _decodes(stage, outer_round, j, blob):
    return not blob.startswith(b"garbage")  # the test's strict decoder: anything but "garbage..." decodes


def _judge_bundle(evidence, accused, slices=SLICES):
    return judge_bad_bundle(evidence, accused, run_id=RUN, max_blob_bytes=1 << 20,
                            num_slices=lambda stage: slices if stage == STAGE else None, decodes=_decodes)


def _tampered(bundle: bytes) -> bytes:
    return bundle[:-1] + bytes([bundle[-1] ^ 1])  # the last byte is the last slice's


def test_a_bundle_with_a_slice_its_record_does_not_prove_convicts_its_signer_and_a_sound_one_does_not():
    identity = Identity.generate()
    bundle, reference = slice_bundle([b"slice zero", b"slice one"])
    honest = _contribution(identity, 1, reference)
    guilty, why = _judge_bundle(bad_bundle_evidence(ACCOUNT, 1, honest, bundle, "claimed bad"),
                                identity.peer_id)
    assert guilty is False and "sound" in why
    # The member signs a reference to a bundle whose last slice does not match its record.
    tampered = _tampered(bundle)
    forged = slicebundle.REFERENCE_PREFIX + slicebundle._REFERENCE.pack(
        SLICES, hashlib.sha256(tampered).digest(), len(tampered), reference[-32:])
    bad = _contribution(identity, 1, forged)
    evidence = bad_bundle_evidence(ACCOUNT, 1, bad, tampered, "slice 1")
    assert evidence.verdict == BAD_BUNDLE
    guilty, why = _judge_bundle(evidence, identity.peer_id)
    assert guilty is True and "slice 1" in why, why
    # Not the accused's envelope, or another run's, or a replica the evidence does not name: not guilty.
    assert _judge_bundle(evidence, Identity.generate().peer_id)[0] is False
    assert _judge_bundle(bad_bundle_evidence(ACCOUNT, 2, bad, tampered, ""), identity.peer_id)[0] is False
    # The accuser must show the referenced bundle: another one (or none) convicts nobody.
    assert _judge_bundle(bad_bundle_evidence(ACCOUNT, 1, bad, bundle, ""), identity.peer_id)[0] is False
    assert _judge_bundle(bad_bundle_evidence(ACCOUNT, 1, bad, None, ""), identity.peer_id)[0] is False
    # A stage this node holds no plan of: no verdict.
    assert _judge_bundle(evidence, identity.peer_id, slices=None)[0] is None


def test_a_slice_that_does_not_decode_or_a_reference_that_does_not_fit_convicts_its_signer():
    identity = Identity.generate()
    bundle, reference = slice_bundle([b"slice zero", b"garbage slice"])
    guilty, why = _judge_bundle(bad_bundle_evidence(ACCOUNT, 0, _contribution(identity, 0, reference), bundle,
                                                    ""),
                                identity.peer_id)
    assert guilty is True and "does not decode" in why
    # A reference naming one slice too many, or bytes that are no reference: the envelope alone convicts.
    _bundle, three = slice_bundle([b"a", b"b", b"c"])
    for blob in (three, b"not a reference"):
        guilty, why = _judge_bundle(bad_bundle_evidence(ACCOUNT, 0, _contribution(identity, 0, blob), None,
                                                        ""),
                                    identity.peer_id)
        assert guilty is True and "reference does not fit" in why, why
    # A body that is no contribution body at all.
    envelope = Envelope.create(identity, RUN, ROUND, msg.CONTRIBUTION, b"no body", stage=STAGE,
                               replica=0).to_bytes()
    guilty, why = _judge_bundle(bad_bundle_evidence(ACCOUNT, 0, envelope, None, ""), identity.peer_id)
    assert guilty is True and "malformed" in why
    # A close or a partial is no contribution: nobody is convicted for another kind of envelope.
    _ids, envelopes, _bundles, _entries, close = _round()
    assert _judge_bundle(bad_bundle_evidence(ACCOUNT, 0, close, None, ""), _ids[0].peer_id)[0] is False


@settings(max_examples=60, deadline=None)
@given(items=st.lists(st.binary(max_size=200), max_size=4), replica=st.integers(0, 5))
def test_hostile_bad_bundle_evidence_never_raises_and_never_convicts(items, replica):
    evidence = msg.Evidence(ACCOUNT, replica, items, BAD_BUNDLE, "", [0.0] * len(items))
    guilty, why = _judge_bundle(evidence, Identity.generate().peer_id)
    assert guilty is False and why
