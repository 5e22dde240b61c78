"""The audit's rerun of a replica whose close left one stage's contribution out and aggregated the other.

The 60-minute soak of issue 45 (docs/P2P.md, "What the soak found"): in round 35 the joiner (replica 8, one
node holding both stages) sent its stage-1 contribution after the stage-1 leader's deadline, so the stage-1
close left it out while the stage-0 close aggregated its stage-0 one. The rerun of a replica runs its whole
pipeline and needs every stage's start state and claim, and the only copy of the left-out envelope was the
joiner's own, which sealing dropped with the other unaggregated envelopes: the audit was INCOMPLETE
("its contributions are not in the archives"). A node now keeps its own contributions, also the ones a close
left out, and names them in the round's manifest (``left_out_own``); the audit takes the missing stage from
there. Real node archives (node.store.archive.Archive, sealed as the nodes seal them), real signed envelopes,
read by the audit's own ReexecAuditor.
"""

from __future__ import annotations

import hashlib
import json
from types import SimpleNamespace

from node import protocol as msg
from node.store.archive import Archive, ArchivedContribution
from node.tools.audit_reexec import ReexecAuditor
from p2p.envelope import Envelope
from p2p.identity import Identity

RUN_ID, ROUND = 1, 35
SOLO, JOINER = Identity.from_seed(b"s" * 32), Identity.from_seed(b"j" * 32)
REPLICA_OF = {SOLO: 0, JOINER: 8}


def _contribution(identity: Identity, outer_round: int, stage: int) -> tuple[bytes, bytes]:
    """(a signed contribution envelope of ``identity``'s replica, the start-state blob it binds)."""
    state = f"start state of {REPLICA_OF[identity]} round {outer_round} stage {stage}".encode()
    body = msg.ContributionBody(hashlib.sha256(state).digest(), bytes(32), b"pseudo-gradient", msg.NO_APPLY)
    envelope = Envelope.create(identity, RUN_ID, outer_round, msg.CONTRIBUTION,
                               msg.encode_contribution_body(body), stage=stage,
                               replica=REPLICA_OF[identity]).to_bytes()
    return envelope, state


def _entry(identity: Identity, stage: int, envelope: bytes) -> ArchivedContribution:
    return ArchivedContribution(stage, REPLICA_OF[identity], identity.peer_id,
                                hashlib.sha256(envelope).digest())


def _node(root, identity: Identity, own: dict, closes: dict, received: dict) -> Archive:
    """One node's archive as its contributor and finisher leave it: its own contributions put as its own
    (``put_own``, what the contributor does), the others' it received put, and each round sealed on its
    closes."""
    archive = Archive(root / "archive", RUN_ID)
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    for outer_round in sorted(set(own) | set(closes)):
        for stage, (envelope, state) in own.get(outer_round, {}).items():
            archive.put_own(outer_round, envelope, stage, REPLICA_OF[identity], identity.peer_id)
            (root / "blobs" / hashlib.sha256(state).hexdigest()).write_bytes(state)
        for envelope in received.get(outer_round, []):
            archive.put(outer_round, envelope)
        archive.seal_round(outer_round, closes[outer_round])
    return archive


def _run(tmp_path):
    """Round 34 (replica 0 alone: the joiner enters at 35) and round 35 (stage 0 closed on replicas 0 and 8,
    stage 1 on replica 0 only: the joiner's stage-1 contribution came late) as the soak's nodes sealed
    them."""
    solo = {r: {s: _contribution(SOLO, r, s) for s in (0, 1)} for r in (34, 35)}
    joiner = {35: {s: _contribution(JOINER, 35, s) for s in (0, 1)}}
    closes = {34: [_entry(SOLO, s, solo[34][s][0]) for s in (0, 1)],
              35: [*(_entry(SOLO, s, solo[35][s][0]) for s in (0, 1)), _entry(JOINER, 0, joiner[35][0][0])]}
    late = joiner[35][1][0]
    solo_archive = _node(tmp_path / "solo", SOLO, solo, closes,
                         {35: [joiner[35][0][0], late]})  # it received both, aggregated stage 0's
    joiner_archive = _node(tmp_path / "joiner", JOINER, joiner, {34: closes[34], 35: closes[35]},
                           {34: [solo[34][s][0] for s in (0, 1)], 35: [solo[35][s][0] for s in (0, 1)]})
    return solo_archive, joiner_archive, late


class _NoCorpus:
    """The replayer's face the rerun reads before it trains; no corpus, so it stops right after its inputs."""

    cfg = SimpleNamespace(pipeline=SimpleNamespace(num_stages=2),
                          diloco=SimpleNamespace(exchange="full", sliced=False))
    corpus_problem = "none in this test"

    def _corpus(self):
        return None


def _assert_the_audit_reruns_the_joiner_from_both_stages(tmp_path, late: bytes) -> None:
    """The audit finds replica 8's envelope of both stages (stage 1's the ``late`` one) and reruns it: the
    rerun has every input of the archives (the envelopes, both start states, round 34's contributions) and
    stops only at the corpus this test does not give it; before, "its contributions are not in the
    archives"."""
    auditor = ReexecAuditor(_NoCorpus(), [tmp_path / "solo", tmp_path / "joiner"], RUN_ID, 0)
    envs = auditor._envelopes(ROUND, 8)
    assert envs is not None and [e.stage for e in envs] == [0, 1]
    assert envs[1].to_bytes() == late
    result, reason, _distance = auditor.check(ROUND, 8)
    assert result is None and reason.startswith("the run's training data is not available here"), reason


def test_the_joiner_keeps_its_left_out_stage_and_the_audit_reruns_the_replica_from_both_stages(tmp_path):
    solo, joiner, late = _run(tmp_path)
    digest = hashlib.sha256(late).digest()
    # The joiner kept it and names it; the solo node, which is not its signer, dropped its copy as before.
    assert [c.envelope_hash for c in joiner.left_out_own(ROUND)] == [digest]
    assert joiner.get(ROUND, digest) == late
    assert digest.hex() + ".env" not in [p.name for p in (solo.dir / f"round-{ROUND:08d}").iterdir()]
    assert solo.left_out_own(ROUND) == []
    # The record's contributions are still exactly the closes' (the manifest's aggregated list).
    assert [(c.stage, c.replica) for c in joiner.sealed(ROUND)] == [(0, 0), (0, 8), (1, 0)]

    _assert_the_audit_reruns_the_joiner_from_both_stages(tmp_path, late)


def test_a_second_seal_of_the_round_keeps_it(tmp_path):
    """A fork repair re-seals a round with the record's set (node/live/record/forkrepair.py): the kept
    envelope stays."""
    _solo, joiner, late = _run(tmp_path)
    joiner.seal_round(ROUND, joiner.sealed(ROUND), joiner.excluded(ROUND))
    assert [c.envelope_hash for c in joiner.left_out_own(ROUND)] == [hashlib.sha256(late).digest()]
    assert joiner.get(ROUND, hashlib.sha256(late).digest()) == late


def test_a_left_out_entry_naming_another_envelope_is_not_taken(tmp_path):
    """The ``left_out_own`` list is bound by no root on chain: an entry must name the replica's own signed
    contribution of that round and stage, or the replica is not rerun from it."""
    _solo, joiner, _late = _run(tmp_path)
    other, _state = _contribution(SOLO, ROUND, 1)  # replica 0's, listed as replica 8's
    joiner.put(ROUND, other)
    manifest = joiner.sealed_path(ROUND)
    doc = json.loads(manifest.read_text())
    doc["left_out_own"] = [[1, 8, JOINER.peer_id, hashlib.sha256(other).hexdigest()]]
    manifest.write_text(json.dumps(doc))
    auditor = ReexecAuditor(_NoCorpus(), [tmp_path / "joiner"], RUN_ID, 0)
    assert auditor._envelopes(ROUND, 8) is None


def test_a_signer_killed_before_it_sealed_the_round_still_gives_the_audit_its_left_out_stage(tmp_path):
    """The 60-minute soak's round 26 (issue 45): a one-node replica sent both stages' contributions, the
    stage-0 close aggregated its stage 0, the stage-1 close left its stage 1 out, and the node was killed
    before it sealed the round (the others committed it while it was down; a restarted node does not seal
    rounds it missed). Its archive holds the round unsealed: the envelopes and their own-contribution markers,
    no ``round.json``. The audit takes the left-out stage from the marker (it was INCOMPLETE: "its
    contributions are not in the archives")."""
    _solo, joiner, late = _run(tmp_path)
    joiner.sealed_path(ROUND).unlink()  # killed before sealing: the round's directory as put_own left it
    assert joiner.sealed(ROUND) is None and joiner.get(ROUND, hashlib.sha256(late).digest()) == late
    _assert_the_audit_reruns_the_joiner_from_both_stages(tmp_path, late)


def test_an_own_marker_naming_another_replicas_envelope_or_garbage_is_not_taken(tmp_path):
    """An own-contribution marker is bound by nothing: one that names replica 0's envelope as replica 8's, and
    unreadable ones, give no stage (the rerun stays unverifiable rather than running another's claim)."""
    _solo, joiner, late = _run(tmp_path)
    joiner.sealed_path(ROUND).unlink()
    round_dir = joiner.sealed_path(ROUND).parent
    (round_dir / f"{hashlib.sha256(late).hexdigest()}.own").unlink()
    other, _state = _contribution(SOLO, ROUND, 1)
    digest = joiner.put(ROUND, other)
    (round_dir / f"{digest.hex()}.own").write_text(json.dumps([1, 8, JOINER.peer_id]))
    (round_dir / ("ab" * 32 + ".own")).write_text("[1, 8")  # truncated
    (round_dir / ("cd" * 32 + ".own")).write_text(json.dumps({"stage": 1}))
    (round_dir / "not-hex.own").write_text(json.dumps([1, 8, JOINER.peer_id]))
    auditor = ReexecAuditor(_NoCorpus(), [tmp_path / "solo", tmp_path / "joiner"], RUN_ID, 0)
    assert auditor._envelopes(ROUND, 8) is None
