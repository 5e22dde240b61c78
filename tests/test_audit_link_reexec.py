"""``audit LINK --reexecute`` without an archive (issue 80 point 1): the reruns read the run's peers.

A real seeder (:class:`ArchiveSeeder`) over real node archives (sealed as the nodes seal them, real signed
envelopes) serves the start states the archived contributions bind and the evidence files, and nothing else
of a node's blob store; a real :class:`PeerFetcher` reads them through :class:`PeerArchives`, whose round
lists are the audit's verified ones and whose exclusions of a round are the ones the audit's replay of it
re-derived (none known for a round whose replay did not reproduce the commit: the rerun of the next round says
so). The whole command on a real run: tests/test_journeys_printed.py and tests/test_init_from_e2e.py.
"""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest

from node import protocol as msg
from node.commands.seeder import ArchiveSeeder
from node.store.archive import Archive, ArchivedContribution
from node.tools.audit_peer_archives import PeerArchives
from node.tools.audit_reexec import ReexecAuditor
from node.tools.evidence import PeerFetcher
from node.tools.report import OK, UNVERIFIABLE, Check, Contributor, RoundVerdict
from p2p.blobstore import BlobStore
from p2p.envelope import Envelope, decode_envelope
from p2p.identity import Identity

pytestmark = pytest.mark.timeout(120)
RUN_ID = 3
MEMBERS = [Identity.from_seed(bytes([n]) * 32) for n in (1, 2)]


def _contribution(replica: int, outer_round: int) -> tuple[bytes, bytes]:
    state = f"start state of replica {replica} round {outer_round}".encode() * 400
    body = msg.ContributionBody(hashlib.sha256(state).digest(), bytes(32), f"delta {replica}".encode(),
                                msg.NO_APPLY)
    envelope = Envelope.create(MEMBERS[replica], RUN_ID, outer_round, msg.CONTRIBUTION,
                               msg.encode_contribution_body(body), stage=0, replica=replica).to_bytes()
    return envelope, state


@pytest.fixture
def node(tmp_path):
    """One node's directory: rounds 0 and 1 of two replicas sealed, their start states in its blob store
    (replica 1's of round 1 packed, as a node keeps its own: p2p/blobpack.py) beside a blob no contribution
    binds, and one evidence file."""
    root = tmp_path / "node"
    archive = Archive(root / "archive", RUN_ID)
    (root / "blobs").mkdir(parents=True)
    (root / "evidence").mkdir()
    made = {}
    for outer_round in (0, 1):
        entries = []
        for replica in (0, 1):
            envelope, state = _contribution(replica, outer_round)
            archive.put(outer_round, envelope)
            (root / "blobs" / hashlib.sha256(state).hexdigest()).write_bytes(state)
            if (outer_round, replica) == (1, 1):
                (tmp_path / "state").write_bytes(state)
                (root / "blobs" / hashlib.sha256(state).hexdigest()).unlink()
                BlobStore(root / "blobs", 1 << 24).put_packed(tmp_path / "state", [(64, len(state) - 64)])
            entries.append(ArchivedContribution(0, replica, MEMBERS[replica].peer_id,
                                                hashlib.sha256(envelope).digest()))
            made[outer_round, replica] = envelope, state
        archive.seal_round(outer_round, entries)
    (root / "blobs" / hashlib.sha256(b"a chunk state").hexdigest()).write_bytes(b"a chunk state")
    (root / "evidence" / "accusation.envelope").write_bytes(b"signed evidence")
    return root, made


def _verdict(outer_round: int, made: dict, replay: Check) -> RoundVerdict:
    verdict = RoundVerdict(outer_round, "", 0, 0.0, 0.0, 0, 2, "", "")
    verdict.contributors = [Contributor(0, r, MEMBERS[r].peer_id, hashlib.sha256(made[outer_round, r][0])
                                        .hexdigest()) for r in (0, 1)]
    verdict.checks = [Check("contributions root", OK), replay]
    return verdict


def test_the_reruns_read_the_seeders_start_states_and_the_replays_exclusions(node):
    root, made = node
    seeder = ArchiveSeeder.start([root], RUN_ID)
    try:
        served = set(seeder.served)
        for (outer_round, replica), (envelope, state) in made.items():
            assert {hashlib.sha256(envelope).hexdigest(), hashlib.sha256(state).hexdigest()} <= served
        assert hashlib.sha256(b"signed evidence").hexdigest() in served
        assert hashlib.sha256(b"a chunk state").hexdigest() not in served  # bound by no contribution
        fetcher = PeerFetcher.start([seeder.multiaddr])
        try:
            screened = hashlib.sha256(made[0, 1][0]).hexdigest()
            skipped = Check("weights root (replay)", UNVERIFIABLE, "replay skipped (--no-replay)")
            report = SimpleNamespace(rounds=[
                _verdict(0, made, Check("weights root (replay)", OK, "from initial weights")),
                _verdict(1, made, skipped)])
            # what the audit's replay of round 0 re-derived (node/tools/audit_replay.py, check_replay)
            one_stage = SimpleNamespace(pipeline=SimpleNamespace(num_stages=1))
            replayer = SimpleNamespace(cfg=one_stage, exclusions={
                0: [[0, 1, MEMBERS[1].peer_id, screened, "screened", "loss 9.1 > 4.0"]]})
            peers = PeerArchives(fetcher, report, replayer, RUN_ID)
            auditor = ReexecAuditor(replayer, peers, RUN_ID, 2)
            assert auditor.sealed == {r: sorted([0, p, MEMBERS[p].peer_id, hashlib.sha256(made[r, p][0])
                                                  .hexdigest()] for p in (0, 1)) for r in (0, 1)}
            previous, excluded = auditor._previous(0)
            bodies = [msg.decode_contribution_body(decode_envelope(made[0, r][0], 1 << 20).payload)
                      for r in (0, 1)]
            assert previous == {0: [body.blob for body in bodies]}
            assert excluded == {0: {1: "loss 9.1 > 4.0"}}  # by the envelope's place in the stage's list
            assert auditor._previous(1) == (None, "round 1's exclusions (which the next round's start needs) "
                                            "are known only from the audit's replay of it, and its replay is "
                                            "unverifiable: replay skipped (--no-replay)")
            for replica in (0, 1):  # a file, and a packed blob
                state = made[1, replica][1]
                assert peers.blob(hashlib.sha256(state).hexdigest()) == state
            assert [e.replica for e in auditor._envelopes(1, 0)] == [0]
        finally:
            fetcher.close()
    finally:
        seeder.close()
