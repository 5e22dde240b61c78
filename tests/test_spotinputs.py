"""A spot check's inputs on a split cluster (node/live/checks/spotinputs.py): the round's contributions of
every stage bound to the chain's roots, envelopes fetched from the stage holders and refused when they are not
the ones the record binds, and the verdict of a confirming member that judges only the accused's own stages.

Real archives on disk and real signed envelopes; the blob transfer and the chain are boundaries here (the
multi-process runs are tests/test_split_spotchecks_e2e.py)."""

from __future__ import annotations

import hashlib
import threading
from types import SimpleNamespace

import pytest

from ledger.merkle import merkle_root
from node import protocol as msg
from node.commitments import scheme_named
from node.errors import StateError
from node.live.checks.spotinputs import (
    HeardRound,
    InputRefused,
    InputsUnavailable,
    ReplicaInputs,
    bind_to_record,
    heard_round,
    parse_fetched_contribution,
)
from node.live.state.topology import Seat
from node.store.archive import Archive, ArchivedContribution
from p2p.envelope import Envelope, decode_envelope
from p2p.errors import BlobUnavailable
from p2p.identity import Identity
from training.hashing import weights_root

HASHED = scheme_named("hashed")

RUN = 7


def _contribution(who: Identity, outer_round: int, stage: int, replica: int, blob: bytes) -> bytes:
    body = msg.ContributionBody(bytes([stage + 1]) * 32, b"d" * 32, blob)
    return Envelope.create(who, RUN, outer_round, msg.CONTRIBUTION, msg.encode_contribution_body(body),
                           stage=stage, replica=replica).to_bytes()


class _Split:
    """Round 3 of a 2 x 2 split cluster: four signers, one envelope each."""

    def __init__(self) -> None:
        self.who = {(r, s): Identity.generate() for r in range(2) for s in range(2)}
        self.envelopes = {(r, s): _contribution(self.who[(r, s)], 3, s, r, b"payload %d %d" % (r, s))
                          for r in range(2) for s in range(2)}
        self.entries = [ArchivedContribution(s, r, self.who[(r, s)].peer_id,
                                             hashlib.sha256(self.envelopes[(r, s)]).digest())
                        for s in range(2) for r in range(2)]
        self.closes = {s: [tuple((e.replica, e.peer_id, e.envelope_hash) for e in self.entries
                                 if e.stage == s)]
                       for s in range(2)}
        self.root = merkle_root([e.envelope_hash for e in self.entries])
        self.hashes = [b"\x01" * 32, b"\x02" * 32]


def test_a_recorded_round_is_bound_to_the_records_roots_whatever_else_was_heard():
    split = _Split()
    # an equivocating coordinator's
    forged_close = tuple((r, p, b"\xee" * 32) for r, p, _h in split.closes[1][0])
    heard = HeardRound({0: split.closes[0], 1: [forged_close, *split.closes[1]]},
                       {0: [b"\x09" * 32, split.hashes[0]], 1: [split.hashes[1]]}, HASHED)
    entries, hashes = bind_to_record(heard, 2, split.root, weights_root(split.hashes))
    assert entries == split.entries and hashes == split.hashes
    with pytest.raises(InputsUnavailable, match="contributions root"):
        bind_to_record(HeardRound({0: split.closes[0], 1: [forged_close]}, heard.attested, HASHED), 2,
                       split.root, weights_root(split.hashes))
    with pytest.raises(InputsUnavailable, match="contributions root"):
        bind_to_record(HeardRound({0: split.closes[0]}, heard.attested, HASHED), 2, split.root,
                       weights_root(split.hashes))
    with pytest.raises(InputsUnavailable, match="weights root"):
        bind_to_record(heard, 2, split.root, weights_root([b"\x09" * 32, b"\x09" * 32]))

    # From the book's snapshots: duplicates collapse, this node's own stage hash comes first.
    close = msg.Close([[r, p, h, 100] for r, p, h in split.closes[0][0]])
    att = SimpleNamespace(weights_hash=split.hashes[1], stage_leaf=b"")  # a hashed run's
    snap = heard_round(3, 2, lambda _t, s: {"a": (close, b""), "b": (close, b"")} if s == 0 else {},
                       lambda _t, s: {"x": att, "y": att} if s == 1 else {}, {0: split.hashes[0]}, HASHED)
    assert snap.closes == {0: split.closes[0], 1: []} and snap.attested == {0: [split.hashes[0]],
                                                                            1: [split.hashes[1]]}


def test_the_archive_keeps_a_sealed_rounds_record_and_refuses_a_corrupt_one(tmp_path):
    split = _Split()
    archive = Archive(tmp_path, RUN)
    with pytest.raises(StateError, match="not sealed"):
        archive.record_round(3, split.entries, split.hashes)
    archive.put(3, split.envelopes[(0, 0)])
    archive.seal_round(3, [e for e in split.entries if e.stage == 0], all_held=False)
    assert archive.recorded(3) is None
    archive.record_round(3, split.entries, split.hashes)
    assert archive.recorded(3) == (split.entries, split.hashes)
    (archive.dir / "round-00000003" / "recorded.json").write_text('{"round": 3, "contributions": [[0, 1]]}')
    with pytest.raises(StateError, match="corrupt"):
        archive.recorded(3)
    (archive.dir / "round-00000003" / "recorded.json").write_text(
        '{"round": 4, "contributions": [], "stage_hashes": []}')
    with pytest.raises(StateError, match="not round 3"):
        archive.recorded(3)


def test_envelopes_of_other_stages_are_fetched_checked_and_archived_and_wrong_ones_refused(tmp_path):
    """A split node holds stage 0 of round 3; the check of replica 1 needs its stage-1 envelope too."""
    split = _Split()
    archive = Archive(tmp_path / "archive", RUN)
    for r in range(2):
        archive.put(3, split.envelopes[(r, 0)])
    archive.seal_round(3, [e for e in split.entries if e.stage == 0], all_held=False)
    archive.record_round(3, split.entries, split.hashes)
    served: dict[str, bytes] = {}
    asked, removed = [], []

    class Host:  # the blob boundary: what a holder serves under a hash (the real one checks it too)
        def fetch_blob(self, digest, dest, providers=None, timeout=None):
            asked.append(list(providers))
            if digest not in served:
                raise BlobUnavailable(f"blob {digest[:16]}: no provider served it")
            dest.write_bytes(served[digest])

        def remove_blob(self, digest):
            removed.append(digest)

    stage1_holder = SimpleNamespace(stages=(1,))
    placements = {split.who[(0, 1)].peer_id: stage1_holder, split.who[(1, 1)].peer_id: stage1_holder,
                  "me": SimpleNamespace(stages=(0,))}
    inputs = ReplicaInputs(archive=archive, host=Host(), membership=SimpleNamespace(placements=placements),
                           run_id=RUN, peer_id="me", num_stages=2, max_blob_bytes=1 << 20,
                           work_dir=tmp_path / "w")
    wanted = split.entries[3]  # stage 1, replica 1
    assert (wanted.stage, wanted.replica) == (1, 1)

    with pytest.raises(InputsUnavailable, match="not served by its 2 holder"):
        inputs.envelopes(3, 1)
    assert asked[-1] == [split.who[(1, 1)].peer_id, split.who[(0, 1)].peer_id]  # its signer first
    served[wanted.envelope_hash.hex()] = split.envelopes[(0, 1)]  # another envelope under its hash
    with pytest.raises(InputRefused, match="do not hash"):
        inputs.envelopes(3, 1)
    assert removed == [wanted.envelope_hash.hex()]
    with pytest.raises(StateError):
        archive.get(3, wanted.envelope_hash)  # nothing refused is archived

    served[wanted.envelope_hash.hex()] = split.envelopes[(1, 1)]
    envs = inputs.envelopes(3, 1)
    assert [e.to_bytes() for e in envs] == [split.envelopes[(1, 0)], split.envelopes[(1, 1)]]
    assert archive.get(3, wanted.envelope_hash) == split.envelopes[(1, 1)] and inputs.fetched == 1
    before = len(asked)
    inputs.envelopes(3, 1)  # archived now: no second fetch
    assert len(asked) == before
    with pytest.raises(InputsUnavailable, match="replica 5"):
        inputs.envelopes(3, 5)

    # Bytes that hash right but are not what the record binds at that place are refused, each for its reason.
    hello = Envelope.create(split.who[(1, 1)], RUN, 3, msg.HELLO, b"\x80", stage=1, replica=1).to_bytes()
    for data, entry, reason in (
        (hello, ArchivedContribution(1, 1, split.who[(1, 1)].peer_id, hashlib.sha256(hello).digest()),
         "not a contribution"),
        (split.envelopes[(1, 1)], ArchivedContribution(0, 1, split.who[(1, 1)].peer_id, wanted.envelope_hash),
         "not"),
        (split.envelopes[(1, 1)], ArchivedContribution(1, 1, split.who[(0, 1)].peer_id, wanted.envelope_hash),
         "signed by"),
        (split.envelopes[(1, 1)], ArchivedContribution(1, 0, split.who[(1, 1)].peer_id, wanted.envelope_hash),
         "not"),
    ):
        with pytest.raises(InputRefused, match=reason):
            parse_fetched_contribution(data, entry, 3, RUN, 1 << 20)
    with pytest.raises(InputRefused, match="signed by"):
        parse_fetched_contribution(split.envelopes[(1, 1)], wanted, 4, RUN, 1 << 20)  # another round
    assert parse_fetched_contribution(split.envelopes[(1, 1)], wanted, 3, RUN, 1 << 20).stage == 1


def test_a_confirming_member_judges_only_the_accused_members_own_stages(tmp_path):
    """Replica 1's rerun fails in stage 1 only. An accusation of the stage-1 signer gets a guilty verdict; one
    of its honest stage-0 partner, with the same evidence, a not-guilty one; a failure that names no stage of
    a split replica names nobody, and nothing is signed."""
    from ledger.records import Verdict
    from node.live.peers.membership import Membership
    from node.live.state.roundbook import RoundBook
    from node.live.checks.spotcheck import SpotCheckResult
    from node.live.checks.verifier import SpotChecker, VerifierContext
    from node.live.peers.membership import Membership
    from node.live.state.roundbook import RoundBook

    split = _Split()
    archive = Archive(tmp_path / "archive", RUN)
    for envelope in split.envelopes.values():
        archive.put(3, envelope)
    archive.seal_round(3, split.entries)
    accounts = {key: bytes([16 * key[0] + key[1] + 1]) * 20 for key in split.who}

    class Chain:  # the chain boundary: seats bind accounts to node keys; a verdict signature is its fields
        account_bytes = b"m" * 20

        def seat(self, _run, account, public_key, current=True):
            return next((True for key, who in split.who.items()
                         if accounts[key] == account and who.public_key_bytes == public_key), None)

        def sign_verdict(self, verdict: Verdict) -> bytes:
            return verdict.evidence_hash + bytes([verdict.guilty])

        def accusation(self, *_a):
            return None

        def run_info(self, _run_id):
            return SimpleNamespace(quorum=3)

    class Host:
        def fetch_blob(self, digest, dest, providers=None, timeout=None):
            dest.write_bytes(served[digest])

        def provide_blob(self, data, announce=True):
            pass

    served: dict[str, bytes] = {}
    signed = []
    ctx = VerifierContext(
        cfg=SimpleNamespace(spot_checks=0.0, p2p=SimpleNamespace(max_blob_bytes=1 << 20),
                            pipeline=SimpleNamespace(num_stages=2)), run_id=RUN, peer_id="me", chain=Chain(),
        host=Host(), archive=archive, membership=Membership("me", "c0", 1, 2, RoundBook(),
                                                          seat=lambda _a, _k: Seat((0, 0), 0)),
        gossip=lambda *a: signed.append(a), sign_envelope=None, stage_hashes=None, own_replica=lambda: 0,
        current_round=lambda: 5, work_dir=tmp_path / "work", evidence_dir=tmp_path / "ev",
        stop=threading.Event(), on_ejected=None)
    checker = SpotChecker(ctx)
    outcome = [SpotCheckResult("mismatch", "stage 1 off by 0.05", {0: 0.0, 1: 0.05}, 1.0, failed_stages=(1,))]
    checker._check = lambda _r, _replica: outcome[0]  # the rerun's verdict (tests/test_spotchecks.py reruns)
    accuser = Identity.generate()

    def confirm(accused_key) -> list[bool]:
        evidence = msg.Evidence(accounts[accused_key], 1, [split.envelopes[(1, 0)], split.envelopes[(1, 1)]],
                                "mismatch", "r", [0.0, 0.05])
        blob = Envelope.create(accuser, RUN, 3, msg.EVIDENCE, msg.encode_payload(evidence)).to_bytes()
        served[hashlib.sha256(blob).hexdigest()] = blob
        signed.clear()
        checker._confirm(3, accuser.peer_id,
                         msg.Accusation(3, accounts[accused_key], split.who[accused_key].peer_id,
                                        1, hashlib.sha256(blob).digest(), len(blob)))
        checker.drain(60)  # the rerun and the verdict after it run on the rerun thread
        return [m.guilty for _round, kind, m in signed if kind == msg.VERDICT]

    try:
        assert confirm((1, 1)) == [True]
        assert confirm((1, 0)) == [False]
        outcome[0] = SpotCheckResult("state_mismatch", "the stages disagree", {}, 0.0)
        assert confirm((1, 1)) == []
        assert decode_envelope(split.envelopes[(1, 1)], 1 << 20).stage == 1
    finally:
        ctx.stop.set()
        checker.close()
