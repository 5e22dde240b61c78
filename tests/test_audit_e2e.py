"""``dlx-node audit`` against a real short run (tests/short_run_fixtures.py).

The module's run is shared by every test here. Tests that change the chain (a
second run committed by a quorum of lying members, a forged registration)
create what they audit and never touch run 1's record, except the
forged-registration test, which runs last because the registry is shared.
``dlx-node pull`` is tested against its own run of the same kind in tests/test_pull_e2e.py.

The audit PASSES only with every item verified; without the evidence it is
INCOMPLETE (never PASSED), and a contradiction makes it FAIL.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from browser import rendered_dom
from short_run_fixtures import ROUNDS, cli_args, client, node_archives, run  # noqa: F401 (client, run: fixtures)

from ledger.account import dev_account
from ledger.checks import check_chain_record
from ledger.client import LedgerClient
from ledger.errors import LedgerNotMember
from ledger.merkle import merkle_root
from ledger.records import RoundRecord
from node import protocol as msg
from node.live.fraud.contribution_binding import bindings_of
from node.cli import exit_code_for
from node.tools.audit import (ATTESTED, FAIL, FAILED, INCOMPLETE, OK, UNVERIFIABLE, AuditFailed,
                              AuditIncomplete, audit_run)
from node.tools.audit_cli import run_audit
from node.tools.audit_replay import Replayer
from node.tools.evidence import PeerFetcher
from p2p.envelope import Envelope, decode_envelope
from p2p.identity import Identity

BIG = 1 << 30


def _copy_node_dir(slot, dest: Path) -> Path:
    for sub in ("archive", "checkpoints"):
        shutil.copytree(slot.data_dir / sub, dest / sub)
    return dest


def _round_dir(node_dir: Path, run_id: int, round_index: int) -> Path:
    return node_dir / "archive" / f"run-{run_id}" / f"round-{round_index:08d}"


# ---------------------------------------------------------------------- audit
@pytest.mark.timeout(120, func_only=True)
def test_audit_passes_with_every_archive(run, client):
    report = audit_run(client, run.run_id, archives=node_archives(run))
    assert report.ok, [c.line() for c in report.all_checks() if c.status != OK]
    assert report.counts()[UNVERIFIABLE] == 0 and report.counts()[FAIL] == 0
    assert [r.round for r in report.rounds] == list(range(ROUNDS))
    node_accounts = {dev_account(slot.account, client.chain_id).address for slot in run.nodes}
    for verdict in report.rounds:
        assert verdict.status == OK
        # Signed by the run's quorum of members (the nodes' accounts), as the chain's event says.
        assert len(verdict.attesters) >= report.quorum >= 1 and set(verdict.attesters) <= node_accounts
        assert next(c for c in verdict.checks if c.name == ATTESTED).status == OK
        names = [c.name for c in verdict.checks]
        assert "weights root (replay)" in names and "contributions root" in names
        # Both stages aggregated (a round may close with a quorum: not every replica every round).
        assert {c.stage for c in verdict.contributors} == {0, 1} and all(
            c.account for c in verdict.contributors
        )
        assert len({c.peer_id for c in verdict.contributors}) == verdict.num_contributors
        assert verdict.replay_seconds is not None and verdict.replay_seconds > 0
    # Every checkpoint was compared with the replayed weights and momentum of its round.
    assert len(report.checkpoints) == ROUNDS
    assert all(c.status == OK and "replayed state" in c.reason for c in report.checkpoints)


@pytest.mark.timeout(60, func_only=True)
def test_audit_without_evidence_reports_unverifiable_not_ok(run, client):
    report = audit_run(client, run.run_id)
    assert report.verdict == INCOMPLETE and not report.ok  # nothing contradicts the chain...
    assert all(r.status == UNVERIFIABLE for r in report.rounds)  # ...but nothing off-chain was checked
    run_document = next(c for c in report.general if c.name == "run document")
    assert run_document.status == UNVERIFIABLE
    assert all(c.status == UNVERIFIABLE for c in report.checkpoints)
    assert report.counts()[UNVERIFIABLE] >= 2 * ROUNDS


@pytest.mark.timeout(120, func_only=True)
def test_flipped_byte_in_one_contribution_fails_naming_its_round(run, client, tmp_path):
    node_copy = _copy_node_dir(run.nodes[0], tmp_path / "r0")
    victim = max(_round_dir(node_copy, run.run_id, 1).glob("*.env"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))

    report = audit_run(client, run.run_id, archives=[node_copy])
    assert not report.ok
    assert report.first_bad_round == 1
    # Round 2 still replays: from round 1's checkpoint (content hash and weights root verified).
    assert [r.status for r in report.rounds] == [OK, FAIL, OK]
    failure = report.first_failure()
    assert victim.stem[:12] in failure.name and "hash to" in failure.reason
    # The CLI turns it into exit code 8 naming the round.
    args = cli_args(
        run,
        archive=[str(node_copy)],
        json_out="",
        html_out="",
        no_replay=False,
    )
    with pytest.raises(AuditFailed, match="first bad round 1") as failed:
        run_audit(args)
    assert exit_code_for(failed.value) == 8
    # An intact copy elsewhere supersedes the corrupt one (noted, not trusted).
    report = audit_run(client, run.run_id, archives=[node_copy, run.nodes[1].data_dir])
    assert report.ok and report.counts()[UNVERIFIABLE] == 0
    assert any("corrupt copy ignored" in note for note in report.rounds[1].notes)


@pytest.mark.timeout(120, func_only=True)
def test_replay_resumes_from_a_verified_checkpoint_after_a_gap(run, client, tmp_path):
    node_copy = _copy_node_dir(run.nodes[0], tmp_path / "r0")
    shutil.rmtree(_round_dir(node_copy, run.run_id, 0))  # as if pruned by retention_rounds
    report = audit_run(client, run.run_id, archives=[node_copy])
    assert report.verdict == INCOMPLETE
    assert [r.status for r in report.rounds] == [UNVERIFIABLE, OK, OK]
    replay_1 = next(c for c in report.rounds[1].checks if c.name == "weights root (replay)")
    assert replay_1.reason == "from checkpoint of round 0"


@pytest.mark.timeout(120, func_only=True)
def test_archives_of_nodes_holding_different_stages_are_merged(run, client, tmp_path):
    """As when one node holds each stage: each archive lists only its stage; together they give the root."""
    source = run.nodes[0].data_dir / "archive" / f"run-{run.run_id}"
    for stage in (0, 1):
        target = tmp_path / f"stage{stage}" / "archive" / f"run-{run.run_id}"
        target.mkdir(parents=True)
        shutil.copy(source / "run.json", target / "run.json")
        for round_dir in sorted(source.glob("round-*")):
            manifest = json.loads((round_dir / "round.json").read_text())
            mine = [e for e in manifest["contributions"] if e[0] == stage]
            (target / round_dir.name).mkdir()
            for entry in mine:
                shutil.copy(round_dir / f"{entry[3]}.env", target / round_dir.name / f"{entry[3]}.env")
            manifest["contributions"] = mine
            (target / round_dir.name / "round.json").write_text(json.dumps(manifest))
    merged = audit_run(client, run.run_id, archives=[tmp_path / "stage0", tmp_path / "stage1"])
    assert all(r.status == OK for r in merged.rounds)
    assert merged.verdict == INCOMPLETE  # no checkpoint files were copied: those items are unverifiable
    alone = audit_run(client, run.run_id, archives=[tmp_path / "stage1"])
    assert alone.verdict == INCOMPLETE  # incomplete evidence is unverifiable, never a failure, never a pass
    assert all(r.status == UNVERIFIABLE for r in alone.rounds)
    assert "stage(s) [0]" in alone.rounds[0].first_problem().reason


@pytest.mark.timeout(180, func_only=True)
def test_audit_over_libp2p_with_no_local_archive(run, client, tmp_path):
    """Everything off-chain comes from a peer: run document, close lists (gossip), envelopes, checkpoints."""
    from node import protocol as msg
    from node.protocol import run_topic
    from p2p.config import P2PConfig
    from p2p.host import P2PHost

    archive = run.nodes[0].data_dir / "archive" / f"run-{run.run_id}"
    peer = P2PHost.start(P2PConfig(listen_port=0), Identity.generate(), data_dir=tmp_path / "peer")
    fetcher = None
    try:
        peer.provide_blob(archive / "run.json", announce=False)
        for path in sorted((run.nodes[0].data_dir / "checkpoints").glob("round-*.safetensors")):
            peer.provide_blob(path, announce=False)
        for round_index in range(ROUNDS):
            manifest = json.loads((archive / f"round-{round_index:08d}" / "round.json").read_text())
            for stage in (0, 1):
                entries = [
                    [r, p, bytes.fromhex(h), 1] for s, r, p, h in manifest["contributions"] if s == stage
                ]
                for _r, _p, digest, _size in entries:
                    peer.provide_blob(
                        archive / f"round-{round_index:08d}" / f"{digest.hex()}.env", announce=False
                    )
                close = Envelope.create(
                    peer.identity,
                    run.run_id,
                    round_index,
                    msg.CLOSE,
                    msg.encode_payload(msg.Close(entries)),
                    stage=stage,
                )
                peer.publish(run_topic(run.run_id), close.to_bytes())
        fetcher = PeerFetcher.start(peer.listen_addrs[:1])
        report = audit_run(client, run.run_id, fetcher=fetcher)
    finally:
        if fetcher is not None:
            fetcher.close()
        peer.close()
    assert report.sources == ["peers"]
    assert report.ok and report.counts()[UNVERIFIABLE] == 0, [
        c.line() for c in report.all_checks() if c.status != OK
    ]


@pytest.mark.timeout(180, func_only=True)
def test_cli_writes_json_and_an_html_report_chromium_renders(run, tmp_path):
    out_json, out_html = tmp_path / "audit.json", tmp_path / "audit.html"
    cmd = [
        sys.executable,
        "-m",
        "node.cli",
        "audit",
        "--rpc",
        run.url,
        "--run",
        str(run.run_id),
        "--deployment",
        str(run.workdir / "deployment.json"),
        "--json",
        str(out_json),
        "--html",
        str(out_html),
    ]
    for archive in node_archives(run):
        cmd += ["--archive", str(archive)]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stdout + done.stderr
    for round_index in range(ROUNDS):
        assert f"round {round_index}: ok" in done.stdout
    assert "PASSED" in done.stdout and "0 unverifiable" in done.stdout
    data = json.loads(out_json.read_text())
    assert data["ok"] is True and data["first_bad_round"] is None and len(data["rounds"]) == ROUNDS
    assert data["verdict"] == "PASSED" and all(r["attesters"] for r in data["rounds"])

    dom = rendered_dom(out_html.resolve().as_uri(), tmp_path / "chromium", virtual_time_ms=None, timeout=90)
    assert "Audit of run" in dom and 'data-verdict="PASSED"' in dom
    assert '<svg class="loss-curve"' in dom and 'class="unverified"' not in dom
    for series in ("eval-loss", "train-loss"):
        assert f'class="{series}" data-points="{ROUNDS}"' in dom
    assert dom.count('<tr class="round"') == ROUNDS

    # Without evidence: INCOMPLETE, its own exit code, and every round marked unverified on the chart.
    cmd = cmd[: cmd.index("--archive")] if "--archive" in cmd else cmd
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=150)
    assert done.returncode == exit_code_for(AuditIncomplete("x")) == 13, done.stdout + done.stderr
    assert "INCOMPLETE" in done.stdout and "first unverified round 0" in done.stderr
    page = out_html.read_text()
    assert 'data-verdict="INCOMPLETE"' in page and page.count('class="unverified"') == ROUNDS


@pytest.mark.timeout(180, func_only=True)
def test_an_outsider_cannot_commit_and_a_quorum_signed_lie_is_caught_naming_its_round(run, client, tmp_path):
    """The nodes' accounts, a full quorum of a second run, sign the true contributions but a false weights
    root in round 1; an account without a seat cannot commit at all."""
    history = client.history(run.run_id, with_registrations=False)
    members = [
        LedgerClient(client.w3, dev_account(slot.account, client.chain_id), run.registry, run.ledger)
        for slot in run.nodes
    ]
    run2 = members[0].create_run(
        history.run.config_hash, history.run.num_stages, history.run.inner_steps, quorum=len(members)
    )
    for member in members:
        member.join_run(run2)
    # Run 2's contributions: run 1's payloads re-signed by the same node keys for run 2 (the signed header
    # binds the run id, so run 1's envelopes cannot be reused as they are).
    identities = {}
    for slot in run.nodes:
        identity = Identity.load(slot.data_dir / "identity.key")
        identities[identity.peer_id] = identity
    source = run.nodes[0].data_dir / "archive" / f"run-{run.run_id}"
    target = tmp_path / "liar" / "archive" / f"run-{run2}"
    target.mkdir(parents=True)
    shutil.copy(source / "run.json", target / "run.json")
    outsider = LedgerClient(client.w3, dev_account(7, client.chain_id), run.registry, run.ledger)
    # A chunked run's weights root binds the contributions' envelope digests (docs/FRAUD_PROOF.md): run 2's
    # true roots are replayed from its re-signed envelopes (the same payloads, so the same weights).
    replayer = Replayer(json.loads((source / "run.json").read_bytes()))
    replayer.start_from_initial()
    for record in history.commits:
        round_index = record.commit.round
        manifest = json.loads((source / f"round-{round_index:08d}" / "round.json").read_text())
        entries = []
        for stage, replica, peer_id, hash_hex in manifest["contributions"]:
            old = decode_envelope((source / f"round-{round_index:08d}" / f"{hash_hex}.env").read_bytes(), BIG)
            new = Envelope.create(
                identities[peer_id],
                run2,
                round_index,
                old.kind,
                old.payload,
                stage=stage,
                replica=replica,
                timestamp_ms=old.timestamp_ms,
            ).to_bytes()
            digest = hashlib.sha256(new).hexdigest()
            (target / f"round-{round_index:08d}").mkdir(exist_ok=True)
            (target / f"round-{round_index:08d}" / f"{digest}.env").write_bytes(new)
            entries.append([stage, replica, peer_id, digest])
        entries.sort()
        (target / f"round-{round_index:08d}" / "round.json").write_text(
            json.dumps({"round": round_index, "contributions": entries})
        )
        bodies = {e[3]: msg.decode_contribution_body(decode_envelope(
            (target / f"round-{round_index:08d}" / f"{e[3]}.env").read_bytes(), BIG).payload)
                      for e in entries}
        stages = range(history.run.num_stages)
        weights_root = replayer.apply(
            round_index, [[bodies[e[3]].blob for e in entries if e[0] == s] for s in stages],
            [[bodies[e[3]].applied_hash for e in entries if e[0] == s] for s in stages],
            [[bytes.fromhex(e[3]) for e in entries if e[0] == s] for s in stages],
            # a version-3 run's factors carry each body's binding (issue 62), as the audit's replay reads them
            [bindings_of([bodies[e[3]] for e in entries if e[0] == s]) for s in stages])
        if not replayer.scheme.chunked:
            assert weights_root == record.commit.weights_root  # version 1: the weights' hashes alone
        if round_index == 1:
            weights_root = hashlib.sha256(b"what the liars want the model to be").digest()
        lie = RoundRecord(
            run2,
            round_index,
            members[0].head_of(run2),
            weights_root,
            merkle_root([bytes.fromhex(e[3]) for e in entries]),
            record.commit.train_loss_micro,
            record.commit.eval_loss_micro,
            record.commit.tokens,
            record.commit.num_contributors,
        )
        signatures = [member.sign_record(lie) for member in members]
        if round_index == 1:
            # the quorum's signatures do not make a non-member a submitter
            with pytest.raises(LedgerNotMember):
                outsider.commit_round(lie, signatures)
        members[0].commit_round(lie, signatures)

    report = audit_run(client, run2, archives=[tmp_path / "liar"])
    assert report.verdict == FAILED and report.failed
    assert report.first_bad_round == 1
    assert [r.status for r in report.rounds] == [OK, FAIL, OK]  # round 2 follows from the honest state
    failure = report.first_failure()
    assert failure.name == "weights root (replay)" and "!= committed" in failure.reason
    # The chain accepted it (a full quorum signed it) and the contributions themselves were all genuine.
    assert all(c.status == OK for c in report.rounds[1].checks if c.name not in ("weights root (replay)",
                                                                                  "fraud proof"))
    # A chunked run's wrong round gets its fraud-proof item: none can be built from these archives (the lie
    # has no stage leaves behind its root and no checkpoint), and nothing was submitted.
    proof = next(c for c in report.rounds[1].checks if c.name == "fraud proof")
    assert proof.status == UNVERIFIABLE and "not yet submitted" in proof.reason, proof
    assert sorted(report.rounds[1].attesters) == sorted(m.address for m in members)


# ---------------------------------------------------------------------- last: changes the shared registry
@pytest.mark.timeout(120, func_only=True)
def test_a_forged_registration_is_caught(run, client):
    forger = LedgerClient(client.w3, dev_account(8, client.chain_id), run.registry, run.ledger)
    forger.register(os.urandom(32), os.urandom(64))  # the contract cannot check ed25519: the auditor does
    # Anyone can write a bogus registration to the shared registry: it is a note, not this run's failure.
    report = audit_run(client, run.run_id, archives=node_archives(run))
    assert not report.failed and report.first_bad_round is None
    assert not [c for c in report.general if c.status == FAIL]
    chain = check_chain_record(client, client.history(run.run_id), check_code=False)
    assert [note for note in chain.notes if note.startswith(f"registration {forger.address}")]
    # ...a registration alone gives no right to commit...
    record = RoundRecord(run.run_id, ROUNDS, client.head_of(run.run_id), b"\x01" * 32, b"\x02" * 32, 1, 1, 1,
                         1)
    with pytest.raises(LedgerNotMember):
        forger.commit_round(record, [forger.sign_record(record)])
    # ...and once a seat is taken with the squatted key,
    # the run uses it: the registration and the member fail.
    forger.join_run(run.run_id)
    report = audit_run(client, run.run_id, archives=node_archives(run))
    assert report.failed
    forged = [c for c in report.general if c.status == FAIL
              and c.name.startswith(f"registration {forger.address}")]
    assert len(forged) == 1
    member = [c for c in report.general if c.status == FAIL and c.name.startswith(f"member {forger.address}")]
    assert len(member) == 1 and "no registration with a valid binding" in member[0].reason
