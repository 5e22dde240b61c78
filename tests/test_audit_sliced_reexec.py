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

from node import protocol as msg
from node.config import load_config
from node.runconfig import run_document
from node.tools.audit_reexec import reexec_checks
from node.tools.audit_replay import Replayer
from node.tools.report import FAIL, OK, UNVERIFIABLE
from p2p.envelope import Envelope
from p2p.identity import Identity
from training.slicebundle import slice_bundle
from training.data import corpus_from_config
from training.reexec import data_commitment, reexecute, round_meta
from training.replica_state import initial_replica_state

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


def _archive(root, cfg, corpus, slices_by_replica, bundles=True):
    """A node data directory holding round 0 sealed: per replica and stage its envelope (a slice reference),
    its start state and (if ``bundles``) its slice bundle."""
    run_dir = root / "archive" / f"run-{RUN_ID}" / "round-00000000"
    run_dir.mkdir(parents=True)
    (root / "blobs").mkdir()
    entries = []
    for replica, slices in slices_by_replica.items():
        who = Identity.generate()
        data = data_commitment(corpus, cfg.training, cfg.model, cfg.diloco, replica, 0)
        for part in _state(cfg, replica).stages:
            (root / "blobs" / part.state_hash().hex()).write_bytes(part.to_bytes())
            bundle, reference = slice_bundle(slices[part.stage_index]) if slices else (b"", b"garbage reference")
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


def _audit(cfg, archive, accusations=()):
    history = SimpleNamespace(run=SimpleNamespace(run_id=RUN_ID, max_rounds=cfg.rounds),
                              accusations=list(accusations), head_hash=b"h" * 32, memberships=[])
    report = SimpleNamespace(general=[])  # what reexec_checks appends to (an AuditReport's list)
    reexec_checks(report, history, Replayer(run_document(cfg), None), [archive], -1)
    return {c.name: c for c in report.general}


def test_a_sliced_contribution_is_rerun_from_its_archived_bundle(sliced_round, tmp_path):
    """An honest member's slices reproduce bit for bit; slices its start state does not produce (here: the
    other replica's) fail the audit. (Before the fix every honest sliced contribution FAILed: its reference
    was compared with a codec blob.)"""
    cfg, corpus, slices = sliced_round
    checks = _audit(cfg, _archive(tmp_path / "node", cfg, corpus, {0: slices, 1: slices}))
    honest = checks["re-execution of round 0 replica 0"]
    assert honest.status == OK and "reproduced (exact" in honest.reason, honest.reason
    cheat = checks["re-execution of round 0 replica 1"]
    assert cheat.status == FAIL and "does not reproduce (mismatch" in cheat.reason, cheat.reason


def test_a_sliced_contribution_without_its_inputs_is_unverifiable_never_failed(sliced_round, tmp_path):
    """No bundle in the archives, or a reference that is no slice reference: not rerun (the replay judges a
    bad reference; nobody is failed for missing inputs)."""
    cfg, corpus, slices = sliced_round
    checks = _audit(cfg, _archive(tmp_path / "node", cfg, corpus, {0: slices, 1: None}, bundles=False))
    missing, garbage = checks["re-execution of round 0 replica 0"], checks["re-execution of round 0 replica 1"]
    assert missing.status == UNVERIFIABLE and "sliced contribution: stage 0: its slice bundle" in missing.reason
    assert garbage.status == UNVERIFIABLE and "no usable slice reference" in garbage.reason, garbage.reason
    # A bundle that is not the referenced one (same name, other bytes) is not read.
    run_dir = tmp_path / "other" / "archive" / f"run-{RUN_ID}" / "round-00000000"
    _archive(tmp_path / "other", cfg, corpus, {0: slices})
    for path in run_dir.glob("*.slice"):
        path.write_bytes(path.read_bytes()[:-1] + b"x")
    checks = _audit(cfg, tmp_path / "other")
    assert checks["re-execution of round 0 replica 0"].status == UNVERIFIABLE


def test_a_sliced_proof_on_chain_is_not_taken_for_a_rerun_evidence(sliced_round, tmp_path):
    """A guilty accusation whose evidence is a sliced proof (a bad bundle, a wrong partial: a signed proof, no
    rerun) is not rerun as a contribution (whose envelopes it does not hold): unverifiable here, not failed."""
    cfg, corpus, slices = sliced_round
    archive = _archive(tmp_path / "node", cfg, corpus, {0: slices})
    (archive / "evidence").mkdir()
    accused = b"a" * 20
    checks = {}
    for verdict in ("bad-bundle", "wrong-partial"):
        evidence = msg.Evidence(accused, 0, [b"an envelope", b"a bundle"], verdict, "r", [0.0, 0.0])
        blob = Envelope.create(Identity.generate(), RUN_ID, 0, msg.EVIDENCE, msg.encode_payload(evidence)).to_bytes()
        digest = hashlib.sha256(blob).digest()
        (archive / "evidence" / f"{verdict}-{digest.hex()}.envelope").write_bytes(blob)
        accusation = SimpleNamespace(guilty=True, accused="0x" + accused.hex(), evidence_hash=digest)
        checks.update(_audit(cfg, archive, [accusation]))
        check = next(c for name, c in checks.items() if name.startswith("ejection of") and digest.hex()[:16] in name)
        assert check.status == UNVERIFIABLE and f"{verdict} evidence of a sliced run" in check.reason, check
