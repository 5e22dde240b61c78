"""``dlx-node audit`` and ``dlx-node pull`` on attested runs built in-process (py-evm and a real anvil).

Members register, join with a quorum k and sign each RoundRecord (EIP-712); rounds publish real checkpoint
files (tiny model) by their content hash. No node runs, so contributions and the replay are unverifiable: an
honest run's audit is INCOMPLETE, never PASSED. What the chain refuses to record at all (an outsider's or an
under-attested commit, a round past maxRounds) is shown refused by the chain, and the audit's and pull's pure
checks are shown on a crafted RunHistory (a client whose ``history`` is edited: fault injection by subclass).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from ledger_fixtures import FAST_RETRY, digest

from ledger.client import LedgerClient
from ledger.errors import LedgerNotMember, LedgerQuorumNotMet, LedgerRoundBeyondMax
from node.cli import exit_code_for
from node.commitments import scheme_named
from node.errors import (
    AuditFailed,
    AuditIncomplete,
    CheckpointInconsistent,
    PullRefused,
    RoundBeyondMax,
    RoundDisputed,
    RoundUnattested,
    RunDocumentMissing,
)
from node.store.checkpoint import parse_checkpoint
from node.tools import audit_cli as audit_tool
from node.tools import pull_cli as pull_tool
from node.tools.audit import (
    ATTESTED,
    FAIL,
    FAILED,
    INCOMPLETE,
    OK,
    UNVERIFIABLE,
    WITHIN_MAX_ROUNDS,
    audit_run,
)
from node.tools.pull import pull_checkpoint, round_standing
from training.config import ModelConfig

HASHED_VERSION = scheme_named("hashed").version  # its tiny run document names no commitments


# ---------------------------------------------------------------------- helpers
def tiny_checkpoint(run_id: int, round_index: int, config_hash: bytes) -> tuple[bytes, bytes]:
    """A real checkpoint file of a 2-stage tiny model for (run, round): its bytes and its weights root."""
    from node.store.checkpoint import Checkpoint
    from training.config import ModelConfig
    from training.hashing import stage_weights_hash, weights_root
    from training.model import init_state_dict
    from training.stages import split_stages, stage_param_names

    cfg = ModelConfig(preset="tiny")
    weights = init_state_dict(cfg, seed=round_index)
    stages = [stage_param_names(cfg, spec) for spec in split_stages(cfg.n_layer, 2)]
    hashes = {s: stage_weights_hash({n: weights[n] for n in names}) for s, names in enumerate(stages)}
    momentum = {n: torch.zeros_like(t) for n, t in weights.items()}
    ckpt = Checkpoint(run_id, round_index, cfg.document(), config_hash, hashes, weights, momentum)
    return ckpt.to_bytes(), weights_root([hashes[0], hashes[1]])


def tiny_run_document() -> bytes:
    """The run document of a 2-stage tiny run with H = 50 (the shape of ``member_run``'s runs); a hashed
    (version-1) run, whose checkpoints these tests forge (a chunked run's: tests/test_fraud_live.py)."""
    from node.config import config_from_dict
    from node.runconfig import canonical_json, run_document

    cfg = config_from_dict({"model": {"preset": "tiny"}, "pipeline": {"num_stages": 2},
                            "diloco": {"inner_steps": 50, "commitments": "hashed"}})
    return canonical_json(run_document(cfg))


class AttestedRun:
    """A member run of a real run document whose rounds publish checkpoints into ``archive/checkpoints``;
    the run document is in the archive unless ``with_document`` is False."""

    def __init__(self, deployment, tmp_path, members=(1, 2, 3, 4), quorum=3, max_rounds=0, with_document=True,
                 commitments=HASHED_VERSION):
        document = tiny_run_document()
        self.run = deployment.member_run(members, quorum, max_rounds=max_rounds,
                                         config_hash=hashlib.sha256(document).digest(),
                                         commitments=commitments)
        self.run_id = self.run.run_id
        self.archive = tmp_path / "archive"
        (self.archive / "checkpoints").mkdir(parents=True)
        if with_document:
            (self.archive / "run.json").write_bytes(document)
        self.config_hash = self.run.reader.run_info(self.run_id).config_hash
        self.reader = LedgerClient(deployment.w3, None, deployment.registry, deployment.ledger,
                                   retry=FAST_RETRY)
        self.records = []

    def commit(self, lie: bool = False, signers=None):
        """Commit the next round with a checkpoint; ``lie``: its record's weightsRoot is not the file's."""
        record = self.run.next_record()
        data, root = tiny_checkpoint(self.run_id, record.round, self.config_hash)
        (self.archive / "checkpoints" / f"round-{record.round:08d}.safetensors").write_bytes(data)
        record = replace(
            record,
            weights_root=digest("what the liars want the model to be") if lie else root,
            checkpoint_hash=hashlib.sha256(data).digest(),
        )
        self.run.client(self.run.members[0]).commit_round(record, self.run.sign(record, signers))
        self.records.append(record)
        return record

    def addresses(self, indices) -> list[str]:
        return sorted((self.run.client(i).address for i in indices), key=lambda a: int(a, 16))


class EditedHistory(LedgerClient):
    """A read-only client whose ``history`` passes through ``edit``: the record a broken chain could hold."""

    def __init__(self, reader: LedgerClient, edit):
        super().__init__(reader.w3, None, reader.registry_address, reader.ledger_address, retry=FAST_RETRY)
        self._edit = edit

    def history(self, run_id, with_registrations=True):
        return self._edit(super().history(run_id, with_registrations))


def _check(verdict, name):
    return next(c for c in verdict.checks if c.name == name)


# ---------------------------------------------------------------------- honest
def test_an_honest_attested_run_without_evidence_is_incomplete_never_passed(
    deployment, tmp_path, monkeypatch, capsys
):
    attested = AttestedRun(deployment, tmp_path)
    for _ in range(3):
        attested.commit()
    report = audit_run(attested.reader, attested.run_id, archives=[attested.archive])
    assert report.verdict == INCOMPLETE and not report.ok and not report.failed
    assert report.counts()[FAIL] == 0 and report.counts()[UNVERIFIABLE] > 0
    for verdict in report.rounds:
        assert verdict.attesters == attested.addresses((1, 2, 3))
        assert _check(verdict, ATTESTED).status == OK and "3 of 4 members in force" in _check(verdict,
                                                                                              ATTESTED).reason
        assert _check(verdict, "hash chain link").status == OK
        assert _check(verdict, WITHIN_MAX_ROUNDS).status == OK
        assert _check(verdict, "weights root (replay)").status == UNVERIFIABLE  # no run document, no evidence
        assert verdict.status == UNVERIFIABLE
    assert [c.status for c in report.checkpoints] == [OK] * 3  # content hash and weights root of each file
    assert all(c.status == OK for c in report.general if c.name.startswith("member "))
    version = next(c for c in report.general if c.name == "commitments version")
    assert version.status == OK and version.reason.startswith("1 (hashed) on chain, as the document says")
    # The command: INCOMPLETE has its own exit code, never 0.
    monkeypatch.setattr(audit_tool, "reader_client", lambda args: attested.reader)
    args = SimpleNamespace(
        run=attested.run_id, archive=[attested.archive], bootstrap=[], no_replay=False, json_out="",
        html_out=""
    )
    with pytest.raises(AuditIncomplete, match="first unverified round 0") as incomplete:
        audit_tool.run_audit(args)
    assert exit_code_for(incomplete.value) == 13 and exit_code_for(AuditFailed("x")) == 8
    assert "INCOMPLETE" in capsys.readouterr().out
    # Pull: the latest checkpoint, with its attesters printed.
    monkeypatch.setattr(pull_tool, "reader_client", lambda args: attested.reader)
    args = SimpleNamespace(run=attested.run_id, round=-1, archive=[attested.archive], bootstrap=[],
                           out_dir=str(tmp_path / "model"), pending=True)
    assert pull_tool.run_pull(args) == 0
    printed = capsys.readouterr().out
    assert "round 2 (block " in printed and ") attested by 3:" in printed
    assert "round 2 is NOT final (--pending)" in printed
    for attester in attested.addresses((1, 2, 3)):  # each with how long it had been a member
        assert re.search(rf"  {attester} \(member since block \d+, \d+ blocks before the commit\)", printed)
    assert (tmp_path / "model" / "model.safetensors").exists()



def test_a_run_created_with_another_commitments_version_than_its_documents_fails_the_audit(deployment,
                                                                                           tmp_path):
    """A hashed run's document on a run the chain holds as chunked: the fraud proofs would hold its rounds to
    another version than its nodes write, so the audit fails it."""
    attested = AttestedRun(deployment, tmp_path, commitments=scheme_named("chunked").version)
    attested.commit()
    report = audit_run(attested.reader, attested.run_id, archives=[attested.archive])
    version = next(c for c in report.general if c.name == "commitments version")
    assert version.status == FAIL and report.failed
    assert "diloco.commitments = 'hashed', the run was created on chain with version 2 (chunked)" \
        in version.reason

# ---------------------------------------------------------------------- forged
def test_a_quorum_signed_forged_round_fails_the_audit_and_is_never_pulled(deployment, tmp_path):
    """k members sign a record whose weightsRoot is not what its published checkpoint holds."""
    attested = AttestedRun(deployment, tmp_path)
    attested.commit()
    attested.commit()
    attested.commit(lie=True)
    report = audit_run(attested.reader, attested.run_id, archives=[attested.archive])
    assert report.verdict == FAILED and report.first_bad_round == 2
    assert report.first_failure().name.startswith("checkpoint of round 2") and "weights root" in (
        report.first_failure().reason
    )
    assert _check(report.rounds[2], ATTESTED).status == OK  # the chain accepted it: k members signed it
    # --round 2: refused, naming the check; nothing written.
    with pytest.raises(CheckpointInconsistent, match="is not the attested record's weightsRoot") as refused:
        pull_checkpoint(attested.reader, attested.run_id, tmp_path / "forged", 2, archives=[attested.archive],
                        final_only=False)
    assert refused.value.check == "consistent with its commit" and exit_code_for(refused.value) == 9
    assert not (tmp_path / "forged").exists()
    # By default: the latest checkpoint consistent with its record, saying which was passed over and why.
    result = pull_checkpoint(attested.reader, attested.run_id, tmp_path / "model",
                             archives=[attested.archive], final_only=False)
    assert result.round == 1 and len(result.skipped) == 1
    assert result.skipped[0].startswith("round 2: consistent with its commit")


# ---------------------------------------------------------------------- disputed, equivocation
def test_a_disputed_round_is_shown_with_both_records_and_not_pulled(deployment, tmp_path):
    attested = AttestedRun(deployment, tmp_path)
    attested.commit()
    committed = attested.commit()
    run = attested.run
    theirs = replace(committed, weights_root=digest("member 4's own result"))
    run.client(4).dispute(theirs, run.client(4).sign_record(theirs))
    # Member 2 attested round 1 and signs another record of it: equivocation, reported and slashed.
    other = replace(committed, eval_loss_micro=1)
    run.client(4).report_equivocation(
        committed, run.client(2).sign_record(committed), other, run.client(2).sign_record(other)
    )

    report = audit_run(attested.reader, attested.run_id, archives=[attested.archive])
    assert report.verdict == INCOMPLETE  # nothing replayable here: unverified, never PASSED
    disputed = report.rounds[1]
    assert [d.disputer for d in disputed.disputes] == [run.client(4).address]
    view = disputed.disputes[0]
    assert view.weights_root == theirs.weights_root.hex() != disputed.weights_root
    assert view.contributions_root == disputed.contributions_root and view.replays == "unknown"
    assert any(
        n.startswith(f"disputed by {run.client(4).address}") and "differs in weights_root" in n
        for n in disputed.notes
    )
    assert any(f"an attester of this round, {run.client(2).address}, signed two records" in n
               for n in disputed.notes)
    assert any(f"member {run.client(2).address} slashed" in n and "equivocation on round 1" in n
               for n in report.notes)
    assert report.rounds[0].disputes == []
    with pytest.raises(RoundDisputed, match="round 1 of run .* is disputed") as refused:
        pull_checkpoint(attested.reader, attested.run_id, tmp_path / "out", 1, archives=[attested.archive],
                        final_only=False)
    assert refused.value.check == "undisputed" and not (tmp_path / "out").exists()
    result = pull_checkpoint(attested.reader, attested.run_id, tmp_path / "model",
                             archives=[attested.archive], final_only=False)
    assert result.round == 0 and result.skipped[0].startswith("round 1: undisputed")
    # Issue 28, attack 4: a round built on the disputed one is not pulled either, by default or by --round.
    attested.commit(signers=(1, 3, 4))
    with pytest.raises(RoundDisputed, match="round 2 of run .* descends from disputed round 1"):
        pull_checkpoint(attested.reader, attested.run_id, tmp_path / "out", 2, archives=[attested.archive],
                        final_only=False)
    result = pull_checkpoint(attested.reader, attested.run_id, tmp_path / "model2",
                             archives=[attested.archive], final_only=False)
    assert result.round == 0 and result.skipped[0].startswith("round 2: undisputed") and result.cleared == {}
    assert "descends from disputed round 1" in result.skipped[0]


def test_without_the_run_document_a_checkpoint_is_never_verified(deployment, tmp_path):
    """Issue 28, attack 7: the file's own metadata proves nothing; without the run document the audit's
    checkpoint item is unverifiable (never ok) and pull installs nothing."""
    attested = AttestedRun(deployment, tmp_path, with_document=False)
    attested.commit()
    report = audit_run(attested.reader, attested.run_id, archives=[attested.archive])
    assert [c.status for c in report.checkpoints] == [UNVERIFIABLE]
    assert "no verified run document" in report.checkpoints[0].reason
    with pytest.raises(RunDocumentMissing, match="run document .* is not available") as refused:
        pull_checkpoint(attested.reader, attested.run_id, tmp_path / "out", archives=[attested.archive],
                        final_only=False)
    assert refused.value.check == "run document" and not (tmp_path / "out").exists()
    # A forged run document (another model config) in the archive is no substitute: it does not hash to the
    # chain's configHash, and an oversized or non-JSON file named run.json is refused the same way.
    forged = tiny_run_document().replace(b'"n_head":2', b'"n_head":8')
    for bogus in (forged, b"\x00" * 100_000, b"{not json"):
        (attested.archive / "run.json").write_bytes(bogus)
        with pytest.raises(RunDocumentMissing, match="a copy hashes to"):
            pull_checkpoint(attested.reader, attested.run_id, tmp_path / "out", archives=[attested.archive],
                            final_only=False)
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_whose_config_is_not_the_run_documents_is_refused(deployment, tmp_path):
    """Issue 28, attack 1: a file with the attested weights but another model config (n_head 8 where the run
    has 2) is refused by pull and fails the audit; the exported config is the run document's."""
    attested = AttestedRun(deployment, tmp_path)
    attested.commit()
    record = attested.run.next_record()
    data, root = tiny_checkpoint(attested.run_id, record.round, attested.config_hash)
    ckpt = parse_checkpoint(data)
    ckpt.model_config = {**ckpt.model_config, "n_head": 8}
    doctored = ckpt.to_bytes()
    (attested.archive / "checkpoints" / f"round-{record.round:08d}.safetensors").write_bytes(doctored)
    record = replace(record, weights_root=root, checkpoint_hash=hashlib.sha256(doctored).digest())
    attested.run.client(attested.run.members[0]).commit_round(record, attested.run.sign(record))
    report = audit_run(attested.reader, attested.run_id, archives=[attested.archive])
    assert report.failed and "model config" in report.checkpoints[1].reason
    with pytest.raises(CheckpointInconsistent, match="its model config is"):
        pull_checkpoint(attested.reader, attested.run_id, tmp_path / "out", 1, archives=[attested.archive],
                        final_only=False)
    result = pull_checkpoint(attested.reader, attested.run_id, tmp_path / "model",
                             archives=[attested.archive], final_only=False)
    assert result.round == 0 and "model config" in result.skipped[0]
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["n_head"] == ModelConfig(preset="tiny").n_head


# ---------------------------------------------------------------------- what the chain refuses to record
def test_under_attested_rounds_are_refused_by_the_chain_and_by_the_checks(deployment, tmp_path):
    attested = AttestedRun(deployment, tmp_path)
    run = attested.run
    attested.commit()
    record = run.next_record()
    with pytest.raises(LedgerQuorumNotMet):
        run.client(1).commit_round(record, run.sign(record, (1, 2)))
    deployment.register(6)  # registered, but no seat in the run
    with pytest.raises(LedgerNotMember):
        run.client(6).commit_round(record, run.sign(record, (1, 2, 3)))
    attested.commit()
    attested.commit()

    # The chain cannot hold an under-attested round, so the checks are shown on a crafted history.
    outsider = run.client(6).address

    def under_attested(history):
        commits = list(history.commits)
        commits[1] = replace(commits[1], attesters=commits[1].attesters[:2])
        commits[2] = replace(commits[2], attesters=(*commits[2].attesters[:2], outsider))
        return replace(history, commits=commits)

    crafted = EditedHistory(attested.reader, under_attested)
    report = audit_run(crafted, attested.run_id, archives=[attested.archive])
    assert report.verdict == FAILED and report.first_bad_round == 1
    assert [_check(r, ATTESTED).status for r in report.rounds] == [OK, FAIL, FAIL]
    assert "2 counted attesters, the run's quorum is 3" in _check(report.rounds[1], ATTESTED).reason
    assert outsider in _check(report.rounds[2], ATTESTED).reason
    standing = round_standing(crafted.history(attested.run_id), crafted.chain_id, crafted.ledger_address)
    assert standing[0] is None and all(isinstance(standing[r], RoundUnattested) for r in (1, 2))
    with pytest.raises(RoundUnattested, match="not attested by the quorum of counted members") as refused:
        pull_checkpoint(crafted, attested.run_id, tmp_path / "out", 2, archives=[attested.archive],
                        final_only=False)
    assert refused.value.check == "attested by k members in force" and isinstance(refused.value, PullRefused)
    result = pull_checkpoint(crafted, attested.run_id, tmp_path / "model", archives=[attested.archive],
                             final_only=False)
    assert result.round == 0 and [s.split(":")[0] for s in result.skipped] == ["round 2", "round 1"]


def test_rounds_past_max_rounds_are_refused_by_the_chain_and_by_the_checks(deployment, tmp_path):
    bounded = AttestedRun(deployment, tmp_path / "bounded", max_rounds=2)
    bounded.commit()
    bounded.commit()
    with pytest.raises(LedgerRoundBeyondMax):
        bounded.commit()

    # A run of 3 committed rounds whose history claims maxRounds 2: the chain could not have held it.
    attested = AttestedRun(deployment, tmp_path / "open")
    for _ in range(3):
        attested.commit()
    crafted = EditedHistory(attested.reader, lambda h: replace(h, run=replace(h.run, max_rounds=2)))
    report = audit_run(crafted, attested.run_id, archives=[attested.archive])
    assert report.verdict == FAILED and report.first_bad_round == 2
    assert [_check(r, WITHIN_MAX_ROUNDS).status for r in report.rounds] == [OK, OK, FAIL]
    assert "past the run's last round 1" in _check(report.rounds[2], WITHIN_MAX_ROUNDS).reason
    with pytest.raises(RoundBeyondMax, match="past the run's last round 1") as refused:
        pull_checkpoint(crafted, attested.run_id, tmp_path / "out", 2, archives=[attested.archive],
                        final_only=False)
    assert refused.value.check == "within maxRounds"
    assert pull_checkpoint(crafted, attested.run_id, tmp_path / "model", archives=[attested.archive],
                           final_only=False).round == 1
