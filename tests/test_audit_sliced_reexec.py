"""``dlx-node audit --reexecute`` on a sliced run (``diloco.exchange = "sliced"``, docs/PROTOCOL.md).

A sliced contribution envelope carries a constant-size slice reference, not a codec blob: the audit
must never judge it by the full exchange's codec (which FAILed every honest member). Real tiny-model
reruns (training.reexec) over real archive files, no mocks.
"""

from __future__ import annotations

import hashlib
import json
from types import SimpleNamespace

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger.merkle import merkle_root
from node import protocol as msg
from node.config import load_config
from node.runconfig import run_document
from node.slicedproof import RunSliceRules, bad_bundle_evidence, wrong_partial_evidence
from node.tools.audit_reexec_checks import reexec_checks
from node.tools.audit_replay import Replayer
from node.tools.audit_slicedproof import SlicedProofAuditor
from node.tools.report import FAIL, OK, UNVERIFIABLE
from p2p.envelope import Envelope
from p2p.identity import Identity
from training import slicebundle
from training.data import corpus_from_config
from training.reexec import data_commitment, reexecute, round_meta
from training.replica_capture import initial_replica_state
from training.slicebundle import bundle_slices, parse_slice_reference, slice_bundle
from training.slicemessages import partial_payload

RUN_ID = 1


def _state(cfg, replica):
    meta = round_meta(0, replica, cfg.model, cfg.diloco, run_rounds=cfg.rounds, num_stages=2, threads=1)
    return initial_replica_state(meta, cfg.model, cfg.training, cfg.diloco, cfg.compression)


@pytest.fixture(scope="module")
def sliced_round(tmp_path_factory):
    """Round 0 of a two-replica, two-stage sliced run: replica 0's slice blobs per stage (rerun)."""
    tmp = tmp_path_factory.mktemp("sliced-audit")
    cfg = load_config(None, ["model.preset=tiny", "diloco.inner_steps=2", "training.batch_size=2", "rounds=3",
                             "pipeline.num_stages=2", "diloco.num_replicas=2", "diloco.exchange=sliced",
                             f"data_dir={tmp / 'data'}"])
    corpus = corpus_from_config(cfg.training, cfg.model)
    rerun = reexecute(_state(cfg, 0), corpus, cfg.model, cfg.training, cfg.diloco, cfg.compression)
    slices = {stage: msgpack.unpackb(payload, raw=False) for stage, payload in rerun.payloads.items()}
    return cfg, corpus, slices


def _archive(root, cfg, corpus, slices_by_replica, bundles=True, tampered=(), who_of=None):
    """A node data directory holding round 0 sealed: per replica and stage its envelope (a slice reference),
    its start state and (if ``bundles``) its slice bundle. A ``tampered`` replica's bundle has its last byte
    flipped and its signed reference names those bytes (a bundle that fails its own record); ``who_of``
    (a dict) receives each replica's identity."""
    run_dir = root / "archive" / f"run-{RUN_ID}" / "round-00000000"
    run_dir.mkdir(parents=True)
    (root / "blobs").mkdir()
    entries = []
    for replica, slices in slices_by_replica.items():
        who = Identity.generate()
        if who_of is not None:
            who_of[replica] = who
        data = data_commitment(corpus, cfg.training, cfg.model, cfg.diloco, replica, 0)
        for part in _state(cfg, replica).stages:
            (root / "blobs" / part.state_hash().hex()).write_bytes(part.to_bytes())
            bundle, reference = slice_bundle(slices[part.stage_index]) if slices \
                else (b"", b"garbage reference")
            if replica in tampered:
                bundle = bundle[:-1] + bytes([bundle[-1] ^ 1])  # the last slice's last byte
                reference = slicebundle.REFERENCE_PREFIX + slicebundle._REFERENCE.pack(
                    len(slices[part.stage_index]), hashlib.sha256(bundle).digest(), len(bundle),
                    reference[-32:])
            if bundles and bundle:
                (run_dir / f"{hashlib.sha256(bundle).hexdigest()}.slice").write_bytes(bundle)
            body = msg.encode_contribution_body(msg.ContributionBody(part.state_hash(), data, reference))
            env = Envelope.create(who, RUN_ID, 0, msg.CONTRIBUTION, body, stage=part.stage_index,
                                  replica=replica).to_bytes()
            digest = hashlib.sha256(env).hexdigest()
            (run_dir / f"{digest}.env").write_bytes(env)
            entries.append([part.stage_index, replica, who.peer_id, digest])
    (run_dir / "round.json").write_text(json.dumps({"round": 0, "contributions": entries}))
    return root


def _audit(cfg, archive, accusations=(), memberships=(), count=-1, leads=None):
    history = SimpleNamespace(run=SimpleNamespace(run_id=RUN_ID, max_rounds=cfg.rounds),
                              accusations=list(accusations), head_hash=b"h" * 32,
                              memberships=list(memberships),
                              # Round 0 committed (the audit judges committed rounds), at a position where no
                              # seat holds a declared platform to hold a claim to.
                              commits=[SimpleNamespace(commit=SimpleNamespace(round=0), position=None)],
                              members_at=lambda position: [])
    report = SimpleNamespace(general=[], notes=[])  # what reexec_checks appends to (an AuditReport's lists)
    reexec_checks(report, history, Replayer(run_document(cfg), None), [archive], count)
    if leads is not None:  # the contributions found wrong or not rerun (node/tools/audit_cases.py)
        leads.extend(report.case_leads)
    return {c.name: c for c in report.general}


def test_a_sliced_contribution_is_rerun_from_its_archived_bundle(sliced_round, tmp_path):
    """An honest member's slices reproduce bit for bit; slices its start state does not produce (here: the
    other replica's) fail the audit. (Before the fix every honest sliced contribution FAILed: its reference
    was compared with a codec blob.)"""
    cfg, corpus, slices = sliced_round
    leads = []
    checks = _audit(cfg, _archive(tmp_path / "node", cfg, corpus, {0: slices, 1: slices}), leads=leads)
    honest = checks["re-execution of round 0 replica 0"]
    assert honest.status == OK and "reproduced (exact" in honest.reason, honest.reason
    cheat = checks["re-execution of round 0 replica 1"]
    assert cheat.status == FAIL and "does not reproduce (mismatch" in cheat.reason, cheat.reason
    # the platform rule's line (issue 42): the claims are this process's platform, so rerun here, bit-exact
    assert "judged exact" in honest.reason and "judged exact" in cheat.reason, (honest.reason, cheat.reason)
    # the cheat alone is a case lead (each of its stages); round 0 starts from the genesis: no case (issue 78)
    assert {(lead.round, lead.replica, lead.finding) for lead in leads} == {(0, 1, "wrong")}
    assert all(not lead.command and "genesis" in lead.no_case for lead in leads)


def test_a_sliced_contribution_without_its_inputs_is_unverifiable_never_failed(sliced_round, tmp_path):
    """No bundle in the archives, or a reference that is no slice reference: not rerun (the replay judges a
    bad reference; nobody is failed for missing inputs)."""
    cfg, corpus, slices = sliced_round
    checks = _audit(cfg, _archive(tmp_path / "node", cfg, corpus, {0: slices, 1: None}, bundles=False))
    missing, garbage = checks["re-execution of round 0 replica 0"], \
        checks["re-execution of round 0 replica 1"]
    assert missing.status == UNVERIFIABLE and "sliced contribution: stage 0: its slice bundle" \
        in missing.reason
    assert garbage.status == UNVERIFIABLE and "no usable slice reference" in garbage.reason, garbage.reason
    # A bundle that is not the referenced one (same name, other bytes) is not read.
    run_dir = tmp_path / "other" / "archive" / f"run-{RUN_ID}" / "round-00000000"
    _archive(tmp_path / "other", cfg, corpus, {0: slices})
    for path in run_dir.glob("*.slice"):
        path.write_bytes(path.read_bytes()[:-1] + b"x")
    checks = _audit(cfg, tmp_path / "other")
    assert checks["re-execution of round 0 replica 0"].status == UNVERIFIABLE


def test_a_bundle_that_fails_its_own_signed_record_is_a_failing_rerun(sliced_round, tmp_path):
    """The archived bundle is the one the member's signed reference names (sha256 checked) and a slice of it
    is not the one its record proves: nothing honest can be rerun from it, the member's own fault. It fails
    the audit unless the run found its member guilty (then ok): never unverifiable (bench_byzantine
    bad-slice)."""
    cfg, corpus, slices = sliced_round
    who_of: dict = {}
    archive = _archive(tmp_path / "node", cfg, corpus, {0: slices, 1: slices}, tampered={1}, who_of=who_of)
    checks = _audit(cfg, archive)
    assert checks["re-execution of round 0 replica 0"].status == OK
    bad = checks["re-execution of round 0 replica 1"]
    assert bad.status == FAIL and "does not prove its own record" in bad.reason, bad.reason
    assert "the run did not catch it" in bad.reason
    account = "0x" + _account(who_of[1]).hex()
    memberships = [SimpleNamespace(node_key=who.public_key_bytes, account="0x" + _account(who).hex())
                   for who in who_of.values()]
    caught = SimpleNamespace(guilty=True, accused=account, evidence_hash=b"\x00" * 32, accuser="")
    checks = _audit(cfg, archive, [caught], memberships)
    bad = checks["re-execution of round 0 replica 1"]
    assert bad.status == OK and "found guilty on chain" in bad.reason, bad.reason


def test_a_sliced_proof_on_chain_is_not_taken_for_a_rerun_evidence(sliced_round, tmp_path):
    """A guilty accusation whose evidence is a sliced proof (a bad bundle, a wrong partial: a signed proof, no
    rerun) is not rerun as a contribution (whose envelopes it does not hold): judged as a proof, and garbage
    in its place holds nothing, so the chain ejected a member on a proof that does not hold: FAIL."""
    cfg, corpus, slices = sliced_round
    archive = _archive(tmp_path / "node", cfg, corpus, {0: slices})
    (archive / "evidence").mkdir()
    accused = b"a" * 20
    checks = {}
    for verdict in ("bad-bundle", "wrong-partial"):
        evidence = msg.Evidence(accused, 0, [b"an envelope", b"a bundle"], verdict, "r", [0.0, 0.0])
        blob = Envelope.create(Identity.generate(), RUN_ID, 0, msg.EVIDENCE,
                               msg.encode_payload(evidence)).to_bytes()
        digest = hashlib.sha256(blob).digest()
        (archive / "evidence" / f"{verdict}-{digest.hex()}.envelope").write_bytes(blob)
        accusation = SimpleNamespace(guilty=True, accused="0x" + accused.hex(), evidence_hash=digest,
                                     accuser="0xb0b")
        checks.update(_audit(cfg, archive, [accusation], count=0))
        check = next(c for name, c in checks.items() if name.startswith("ejection of")
                     and digest.hex()[:16] in name)
        assert check.status == FAIL \
            and f"{verdict} proof does not hold (the proof's first item is no signed " \
            "envelope" in check.reason and "accused by 0xb0b" in check.reason, check


# -- ejections on sliced proofs, judged from the archives (node/tools/audit_slicedproof.py) ---------------


def _account(identity):
    return hashlib.sha256(identity.public_key_bytes).digest()[:20]


class _ProofRound:
    """Round 0, stage 0 of a two-replica sliced run as the archives hold it: each replica's contribution
    envelope and bundle (the fixture's real slices), the coordinator's close, the round sealed; and the
    members' seats (node key -> account) for the audit's history."""

    def __init__(self, root, cfg, slices):
        self.cfg, self.root = cfg, root
        self.identities = [Identity.generate() for _ in range(3)]  # replicas 0, 1; 2 is no member
        self.run_dir = root / "archive" / f"run-{RUN_ID}" / "round-00000000"
        self.run_dir.mkdir(parents=True)
        (root / "evidence").mkdir()
        self.envelopes, self.bundles, self.references, entries, sealed = [], [], [], [], []
        for replica, who in enumerate(self.identities[:2]):
            bundle, reference = slice_bundle(slices[0])
            body = msg.encode_contribution_body(msg.ContributionBody(b"s" * 32, b"d" * 32, reference))
            env = Envelope.create(who, RUN_ID, 0, msg.CONTRIBUTION, body, stage=0, replica=replica).to_bytes()
            digest = hashlib.sha256(env).digest()
            (self.run_dir / f"{digest.hex()}.env").write_bytes(env)
            (self.run_dir / f"{hashlib.sha256(bundle).hexdigest()}.slice").write_bytes(bundle)
            self.envelopes.append(env)
            self.bundles.append(bundle)
            self.references.append(parse_slice_reference(reference, len(slices[0]), 1 << 30))
            entries.append([replica, who.peer_id, digest, len(env)])
            sealed.append([0, replica, who.peer_id, digest.hex()])
        (self.run_dir / "round.json").write_text(json.dumps({"round": 0, "contributions": sealed}))
        self.entries = entries
        self.close = self.signed_close(self.identities[0], entries)
        self.rules = RunSliceRules(cfg)
        self.memberships = [SimpleNamespace(node_key=who.public_key_bytes, account="0x" + _account(who).hex())
                            for who in self.identities[:2]]

    def signed_close(self, who, entries):
        return Envelope.create(who, RUN_ID, 0, msg.CLOSE, msg.encode_payload(msg.Close(entries)),
                               stage=0).to_bytes()

    def inputs(self, j):
        return [bundle_slices(bundle, reference)[j]
                for bundle, reference in zip(self.bundles, self.references)]

    def partial(self, j, blob, who=1):
        root = merkle_root([hashlib.sha256(e).digest() for e in self.envelopes])
        payload = partial_payload(j, self.rules.num_slices(0), root, len(self.envelopes), blob)
        return Envelope.create(self.identities[who], RUN_ID, 0, msg.PARTIAL, payload, stage=0,
                               replica=who).to_bytes()

    def eject(self, evidence, accused=1):
        """The accuser (replica 0) keeps its signed evidence; the chain found ``accused`` guilty on it."""
        blob = Envelope.create(self.identities[0], RUN_ID, 0, msg.EVIDENCE,
                               msg.encode_payload(evidence)).to_bytes()
        digest = hashlib.sha256(blob).digest()
        (self.root / "evidence" / f"{evidence.verdict}-round-00000000-{digest.hex()}.envelope").write_bytes(
            blob)
        return SimpleNamespace(guilty=True, accused="0x" + _account(self.identities[accused]).hex(),
                               evidence_hash=digest, accuser="0x" + _account(self.identities[0]).hex())

    def audit(self, accusation):
        checks = _audit(self.cfg, self.root, [accusation], self.memberships, count=0)
        return next(c for name, c in checks.items()
                    if name.startswith("ejection of") and accusation.evidence_hash.hex()[:16] in name)


def _wrong_partial(proof, j=0, *, honest=False, bundles=None, close=None, partial=None):
    # A wrong partial over the right inputs: the replay's bytes with one changed (it binds them all the same).
    blob = proof.rules.replay(0, 0, j, proof.inputs(j))
    blob = blob if honest else blob[:-1] + bytes([blob[-1] ^ 1])
    partial = partial or proof.partial(j, blob)
    return wrong_partial_evidence(_account(proof.identities[1]), 1, partial, proof.envelopes,
                                  proof.bundles if bundles is None else bundles, close or proof.close,
                                  "slice differs")


def test_an_ejection_on_a_wrong_partial_proof_is_judged_by_replaying_the_slice(sliced_round, tmp_path):
    """The members' rule from the run document: a partial that differs from the replay of the inputs it binds
    justifies its signer's ejection (ok); one equal to its replay ejected an honest member (FAIL naming it and
    its accuser)."""
    cfg, _corpus, slices = sliced_round
    proof = _ProofRound(tmp_path / "node", cfg, slices)
    check = proof.audit(proof.eject(_wrong_partial(proof)))
    assert check.status == OK \
        and "wrong-partial proof holds: round 0 stage 0: the partial of slice 0 differs" \
        in check.reason, check
    accusation = proof.eject(_wrong_partial(proof, honest=True))
    check = proof.audit(accusation)
    assert check.status == FAIL and "equals its replay" in check.reason, check
    assert f"{accusation.accused} was ejected on it (accused by {accusation.accuser})" in check.reason


def test_a_tampered_sliced_proof_is_refused_not_trusted(sliced_round, tmp_path):
    """Hostile archives and proofs: an archived evidence file whose bytes are not the chain's evidence hash is
    refused (never read); a bundle inside the proof that is not the referenced one is refused and the archived
    one judged; a close signed by no member, or one that misnames an input against the sealed record, or a
    partial whose signature does not verify holds nothing: the ejection on it FAILs."""
    cfg, _corpus, slices = sliced_round
    proof = _ProofRound(tmp_path / "node", cfg, slices)
    accusation = proof.eject(_wrong_partial(proof))
    (path,) = (proof.root / "evidence").glob(f"*{accusation.evidence_hash.hex()}.envelope")
    path.write_bytes(path.read_bytes()[:-1] + b"x")
    check = proof.audit(accusation)
    assert check.status == UNVERIFIABLE and "refused" in check.reason and path.name in check.reason, check

    forged_bundle = proof.bundles[0][:-1] + bytes([proof.bundles[0][-1] ^ 1])
    check = proof.audit(proof.eject(_wrong_partial(proof, bundles=[forged_bundle, proof.bundles[1]])))
    assert check.status == OK and "holds other bytes than the bundle of" in check.reason \
        and "the archived one is used" in check.reason, check

    outsider = proof.signed_close(proof.identities[2], proof.entries)
    check = proof.audit(proof.eject(_wrong_partial(proof, close=outsider)))
    assert check.status == FAIL and "no member of the run" in check.reason, check
    misnamed = [list(e) for e in proof.entries]
    misnamed[0][0] = 5  # an absent input for the judge: an honest aggregator that used it would be framed
    check = proof.audit(proof.eject(_wrong_partial(proof, honest=True,
                                                   close=proof.signed_close(proof.identities[0], misnamed))))
    assert check.status == FAIL and "the archived record as replica 0" in check.reason, check

    partial = bytearray(proof.partial(0, b"whatever"))
    partial[-1] ^= 1
    check = proof.audit(proof.eject(_wrong_partial(proof, partial=bytes(partial))))
    assert check.status == FAIL and "no signed envelope" in check.reason, check


def test_a_sliced_proof_without_its_inputs_is_unverifiable_never_failed(sliced_round, tmp_path):
    """An input neither the proof nor the archives hold: the slice cannot be replayed, nobody is failed."""
    cfg, _corpus, slices = sliced_round
    proof = _ProofRound(tmp_path / "node", cfg, slices)
    for path in proof.run_dir.glob("*.slice"):
        path.unlink()
    check = proof.audit(proof.eject(_wrong_partial(proof, bundles=[b"", proof.bundles[1]])))
    assert check.status == UNVERIFIABLE and "lacks the bundle" in check.reason and "no archive holds it" in \
        check.reason, check
    evidence = bad_bundle_evidence(_account(proof.identities[1]), 1, proof.envelopes[1], None, "claimed")
    check = proof.audit(proof.eject(evidence))
    assert check.status == UNVERIFIABLE and "lacks the bundle" in check.reason, check


def test_an_ejection_on_a_bad_bundle_proof_is_judged_by_the_members_rule(sliced_round, tmp_path):
    """A bundle whose slice its signed record does not prove justifies the ejection; a sound one, judged from
    the archives where the proof holds the envelope alone, ejected an honest member."""
    cfg, _corpus, slices = sliced_round
    proof = _ProofRound(tmp_path / "node", cfg, slices)
    who = proof.identities[1]
    bundle, reference = slice_bundle(slices[0])
    tampered = bundle[:-1] + bytes([bundle[-1] ^ 1])  # the last slice's last byte
    forged = slicebundle.REFERENCE_PREFIX + slicebundle._REFERENCE.pack(
        len(slices[0]), hashlib.sha256(tampered).digest(), len(tampered), reference[-32:])
    body = msg.encode_contribution_body(msg.ContributionBody(b"s" * 32, b"d" * 32, forged))
    bad = Envelope.create(who, RUN_ID, 0, msg.CONTRIBUTION, body, stage=0, replica=1).to_bytes()
    check = proof.audit(proof.eject(bad_bundle_evidence(_account(who), 1, bad, tampered, "bad slice")))
    assert check.status == OK and "of its bundle is not the one its signed record proves" in check.reason, \
        check
    check = proof.audit(proof.eject(bad_bundle_evidence(_account(who), 1, proof.envelopes[1], None,
                                                        "claimed")))
    assert check.status == FAIL and "sound" in check.reason \
        and "the archived one is judged" in check.reason, check


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(items=st.lists(st.binary(max_size=200), max_size=5),
       verdict=st.sampled_from(["wrong-partial", "bad-bundle"]))
def test_hostile_sliced_proofs_never_raise_and_never_pass(sliced_round, items, verdict):
    """Whatever bytes a proof holds, the auditor answers with a check (not ok: nothing proven), never an
    error."""
    cfg, _corpus, _slices = sliced_round
    accuser, accused = Identity.generate(), b"\x22" * 20
    env = Envelope.create(accuser, RUN_ID, 0, msg.EVIDENCE, b"")
    evidence = msg.Evidence(accused, 0, items, verdict, "hostile", [0.0] * len(items))
    auditor = SlicedProofAuditor(cfg, RUN_ID, SimpleNamespace(round_blob=lambda *_: None), {}, {})
    check = auditor.check("ejection", SimpleNamespace(accused="0x" + accused.hex(), accuser=""), env,
                          evidence)
    assert check.status in (FAIL, UNVERIFIABLE) and check.reason
