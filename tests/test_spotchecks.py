"""Spot checks at the node's boundaries: the contribution body, the accusation/verdict payloads, and the
re-execution worker process (a real child interpreter running real reruns of a tiny model)."""

from __future__ import annotations

import hashlib

import pytest

from node import protocol as msg
from node.config import load_config
from node.live.checks.spotcheck import RerunWorker, SpotCheckFailed, SpotCheckJob
from node.live.state.topology import Seat
from node.tools.audit_reexec import sample_contributions
from training.data import corpus_from_config
from training.reexec import data_commitment, reexecute, round_meta
from training.replica_capture import initial_replica_state


def test_contribution_body_round_trips_and_refuses_what_is_not_one():
    body = msg.ContributionBody(b"s" * 32, b"d" * 32, b"codec blob")
    data = msg.encode_contribution_body(body)
    assert data.startswith(msg.CONTRIBUTION_MAGIC) and msg.decode_contribution_body(data) == body
    for bad in (b"", data[:-len(b"codec blob")], b"x" + data[1:], data[:40]):
        with pytest.raises(msg.ProtocolError):
            msg.decode_contribution_body(bad)
    with pytest.raises(msg.ProtocolError):
        msg.encode_contribution_body(msg.ContributionBody(b"short", b"d" * 32, b"blob"))


def test_accusation_verdict_and_evidence_payloads_are_strict():
    accusation = msg.Accusation(3, b"a" * 20, "12D3KooW", 1, b"e" * 32, 1000)
    assert msg.decode_payload(msg.ACCUSATION, msg.encode_payload(accusation)) == accusation
    verdict = msg.VerdictSignature(b"a" * 20, b"e" * 32, True, b"b" * 20, b"s" * 65)
    assert msg.decode_payload(msg.VERDICT, msg.encode_payload(verdict)) == verdict
    evidence = msg.Evidence(b"a" * 20, 1, [b"env0", b"env1"], "mismatch", "distance 0.2", [0.2, 0.1])
    assert msg.decode_payload(msg.EVIDENCE, msg.encode_payload(evidence)) == evidence
    for kind, bad in (
        (msg.ACCUSATION, msg.Accusation(-1, b"a" * 20, "p", 1, b"e" * 32, 1000)),
        (msg.ACCUSATION, msg.Accusation(3, b"a" * 19, "p", 1, b"e" * 32, 1000)),
        (msg.ACCUSATION, msg.Accusation(3, b"a" * 20, "p", 1, b"e" * 32, 0)),
        (msg.VERDICT, msg.VerdictSignature(b"a" * 20, b"e" * 32, 1, b"b" * 20, b"s" * 65)),  # 1 is not a bool
        (msg.VERDICT, msg.VerdictSignature(b"a" * 20, b"e" * 32, True, b"b" * 20, b"s" * 64)),
        (msg.EVIDENCE, msg.Evidence(b"a" * 20, 1, [b"env0"], "mismatch", "r", [0.2, 0.1])),
        (msg.EVIDENCE, msg.Evidence(b"a" * 20, 1, [], "mismatch", "r", [])),
    ):
        with pytest.raises(msg.ProtocolError):
            msg.decode_payload(kind, msg.encode_payload(bad))


def _honest_job(tmp_path):
    cfg = load_config(None, ["model.preset=tiny", "diloco.inner_steps=2", "training.batch_size=2", "rounds=3",
                             "pipeline.num_stages=2", f"data_dir={tmp_path}"])
    corpus = corpus_from_config(cfg.training, cfg.model)
    meta = round_meta(0, 0, cfg.model, cfg.diloco, run_rounds=cfg.rounds, num_stages=2, threads=1)
    state = initial_replica_state(meta, cfg.model, cfg.training, cfg.diloco, cfg.compression)
    rerun = reexecute(state, corpus, cfg.model, cfg.training, cfg.diloco, cfg.compression)
    data = data_commitment(corpus, cfg.training, cfg.model, cfg.diloco, 0, 0)
    claims = [(part.stage_index, part.state_hash(), data, rerun.payloads[part.stage_index], bytes(32))
              for part in state.stages]
    return cfg, state, claims


def test_rerun_worker_reproduces_an_honest_round_catches_a_changed_one_and_survives_garbage(tmp_path):
    cfg, state, claims = _honest_job(tmp_path)
    worker = RerunWorker(tmp_path / "worker.log")
    try:
        honest = tmp_path / "honest"
        SpotCheckJob(cfg.to_dict(), 0, 0, claims, [p.to_bytes() for p in state.stages]).write(honest)
        result = worker.run(honest, timeout=300)
        assert result.verdict == "exact" and result.honest and set(result.distances) == {0, 1}

        garbage = tmp_path / "garbage"
        garbage.mkdir()
        (garbage / "job.json").write_bytes(b"{not json")
        with pytest.raises(SpotCheckFailed, match="spot check failed"):
            worker.run(garbage, timeout=300)

        # A contribution that is not what its start state produces: another replica's data.
        stage, state_hash, data, payload, applied = claims[1]
        other = tmp_path / "other"
        # stage 0's payload sent as stage 1's
        cheat = [claims[0], (stage, state_hash, data, claims[0][3], applied)]
        SpotCheckJob(cfg.to_dict(), 0, 0, cheat, [p.to_bytes() for p in state.stages]).write(other)
        assert not worker.run(other, timeout=300).honest

        # The same worker is still up and still right.
        (honest / "result.json").unlink()
        assert worker.run(honest, timeout=300).verdict == "exact"
    finally:
        worker.close()


def test_audit_samples_contributions_from_the_chain_head():
    pairs = [(r, i) for r in range(10) for i in range(4)]
    first = sample_contributions(pairs, b"h" * 32, 5)
    assert len(first) == 5 and set(first) <= set(pairs)
    assert sample_contributions(pairs, b"h" * 32, 5) == first  # anyone can recompute it
    assert sample_contributions(pairs, b"g" * 32, 5) != first
    assert sample_contributions(pairs, b"h" * 32, -1) == sorted(pairs)


def test_hostile_verdicts_are_refused_and_k_guilty_verdicts_eject_on_chain(deployment, tmp_path):
    """Verdict signatures from outsiders, from the accused, naming another account or not verifying are
    refused one by one; two members' guilty verdicts resolve the accusation on chain and eject the accused."""
    import threading
    import time
    from types import SimpleNamespace

    from ledger_fixtures import digest

    from ledger.records import Verdict
    from node.live.chain.onchain import NodeChain
    from node.live.checks.verifier import SpotChecker, VerifierContext

    run = deployment.member_run((1, 2, 3), quorum=2, min_stake=10**15)
    accused = run.client(3)
    evidence = digest("spot check evidence")
    run.client(1).accuse(run.run_id, accused.address, evidence)
    ejected: list[bytes] = []
    stop = threading.Event()
    ctx = VerifierContext(
        cfg=SimpleNamespace(spot_checks=0.0, pipeline=SimpleNamespace(num_stages=1),
                            p2p=SimpleNamespace(max_blob_bytes=1 << 20)), run_id=run.run_id,
        peer_id="verifier", chain=NodeChain(run.client(1)), host=None, archive=None, membership=None,
        gossip=None, sign_envelope=None, stage_hashes=None, own_replica=lambda: 0, current_round=lambda: 0,
        work_dir=tmp_path / "work", evidence_dir=tmp_path / "ev", stop=stop,
        on_ejected=lambda peer, account: ejected.append(account))
    checker = SpotChecker(ctx)
    accused_bytes = bytes.fromhex(accused.address[2:])
    checker._accusations[evidence] = (0, msg.Accusation(0, accused_bytes, "accused-peer", 2, evidence, 100))
    guilty = Verdict(run.run_id, accused.address, evidence, True)

    def signed(client, account=None, signature=None):
        return msg.VerdictSignature(accused_bytes, evidence, True,
                                    bytes.fromhex((account or client.address)[2:]),
                                    signature or client.sign_verdict(guilty))

    outsider = deployment.register(6)
    try:
        for bad in (signed(outsider), signed(accused), signed(run.client(1), account=run.client(2).address),
                    signed(run.client(1), signature=b"\x01" * 65)):
            with pytest.raises(msg.ProtocolError):
                checker.on_verdict(None, bad)
        assert not ejected
        checker.on_verdict(None, signed(run.client(1)))
        time.sleep(0.5)
        assert accused.accusation_status(run.run_id, accused.address, evidence) == "open"  # one is not enough
        checker.on_verdict(None, signed(run.client(2)))
        deadline = time.monotonic() + 60
        while not ejected and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ejected == [accused_bytes]
        assert accused.accusation_status(run.run_id, accused.address, evidence) == "guilty"
        assert accused.member(run.run_id, accused.address).status == "slashed"
    finally:
        stop.set()
        checker.close()


def test_an_accusation_seen_only_on_chain_whose_evidence_is_never_served_is_cleared(deployment, tmp_path,
                                                                                    monkeypatch):
    """Issue 28: a member accuses on chain and gossips nothing, serving no evidence. An honest node watching
    AccusationOpened fetches the evidence by its hash, finds nothing and signs not guilty; with a second
    member's verdict it resolves the accusation on chain: cleared, the accuser's bond forfeited."""
    import threading
    import time
    from types import SimpleNamespace

    from ledger_fixtures import digest

    from ledger.records import Verdict
    from node.live.chain.onchain import NodeChain
    from node.live.checks import tribunal, verifier
    from node.live.checks.verifier import SpotChecker, VerifierContext
    from p2p.errors import BlobUnavailable

    monkeypatch.setattr(verifier, "ACCUSATION_POLL_S", 0.2)
    monkeypatch.setattr(tribunal, "CHAIN_ACCUSATION_GRACE_S", 0.0)
    run = deployment.member_run((1, 2, 3, 4), quorum=2, min_stake=10**15)
    accused = run.client(4)
    evidence = digest("evidence nobody serves")
    run.client(1).accuse(run.run_id, accused.address, evidence)
    bond = run.client(1).accusation(run.run_id, accused.address, evidence).bond
    assert bond == 10**14

    class Host:  # nobody serves the evidence
        def fetch_blob(self, digest, dest, providers=None, timeout=None):
            raise BlobUnavailable(f"blob {digest[:16]}: no provider")

    gossiped = []
    stop = threading.Event()
    chain = NodeChain(run.client(2))
    ctx = VerifierContext(
        cfg=SimpleNamespace(spot_checks=0.0, p2p=SimpleNamespace(max_blob_bytes=1 << 20),
                            pipeline=SimpleNamespace(num_stages=1)), run_id=run.run_id,
        peer_id="member-2", chain=chain, host=Host(), archive=None,
        membership=SimpleNamespace(book=SimpleNamespace(live_peers=lambda _age: {})),
        gossip=lambda *a: gossiped.append(a), sign_envelope=None, stage_hashes=None, own_replica=lambda: 0,
        current_round=lambda: 0, work_dir=tmp_path / "work", evidence_dir=tmp_path / "ev", stop=stop,
        on_ejected=lambda *_a: None)
    checker = SpotChecker(ctx)
    try:
        deadline = time.monotonic() + 60
        while not gossiped and time.monotonic() < deadline:
            time.sleep(0.1)
        [(_round, kind, signed)] = gossiped
        assert kind == msg.VERDICT and (signed.evidence_hash, signed.guilty) == (evidence, False)
        assert chain.accusation_status(run.run_id, accused.address, evidence) == "open"  # one is not a quorum
        cleared = Verdict(run.run_id, accused.address, evidence, False)
        member3 = run.client(3)
        checker.on_verdict(None, msg.VerdictSignature(bytes.fromhex(accused.address[2:]), evidence, False,
                                                      bytes.fromhex(member3.address[2:]),
                                                      member3.sign_verdict(cleared)))
        while chain.accusation_status(run.run_id, accused.address, evidence) != "cleared":
            assert time.monotonic() < deadline, "the accusation was not cleared on chain"
            time.sleep(0.2)
    finally:
        stop.set()
        checker.close()
    assert run.client(1).forfeited_total() == bond


def test_accusations_from_outsiders_are_refused_and_unserved_or_malformed_evidence_is_not_guilty(tmp_path):
    """An accusation from a peer that is not placed is refused at the inbox. Evidence that is not served, or
    is garbage, gets a not-guilty verdict (the accuser must show its case; issue 28); evidence naming
    contributions this node did not seal, which it cannot check, gets no verdict from it."""
    import threading
    from types import SimpleNamespace

    from ledger.records import Verdict
    from node.live.checks.verifier import SpotChecker, VerifierContext
    from node.live.inbox import GossipInbox
    from node.live.peers.membership import Membership
    from node.live.state.roundbook import RoundBook
    from p2p.envelope import Envelope, EnvelopeValidator
    from p2p.errors import BlobUnavailable
    from p2p.identity import Identity

    book = RoundBook()
    membership = Membership("me", "c0", 1, 1, book, seat=lambda _a, _k: Seat((0, 0), 0))
    outsider = Identity.generate()
    accusation = msg.Accusation(0, b"a" * 20, "peer", 1, b"e" * 32, 100)
    inbox = GossipInbox(7, EnvelopeValidator(7, max_size=1 << 16), book, membership, None,
                        held_stages=lambda: ())
    data = Envelope.create(outsider, 7, 0, msg.ACCUSATION, msg.encode_payload(accusation)).to_bytes()
    with pytest.raises(msg.ProtocolError, match="not a placed member"):
        inbox.handle(data)

    served: dict[str, bytes] = {}

    class Host:  # the blob boundary: serves what the test put there
        def fetch_blob(self, digest, dest, providers=None, timeout=None):
            if digest not in served:
                raise BlobUnavailable(f"blob {digest[:16]}: no provider served it")
            dest.write_bytes(served[digest])

        def provide_blob(self, *_a, **_k):
            raise AssertionError("bad evidence must not be served onward")

    class Chain:  # the signing boundary: a verdict signature is the verdict's fields
        account_bytes = b"m" * 20

        def sign_verdict(self, verdict: Verdict) -> bytes:
            return verdict.evidence_hash + bytes([verdict.guilty])

        def accusation(self, *_a):
            return None  # not on chain here: the run's k is the quorum

        def run_info(self, _run_id):
            return SimpleNamespace(quorum=2)

    signed = []
    ctx = VerifierContext(
        cfg=SimpleNamespace(spot_checks=0.0, p2p=SimpleNamespace(max_blob_bytes=1 << 20),
                            pipeline=SimpleNamespace(
            num_stages=1)), run_id=7, peer_id="me", chain=Chain(), host=Host(),
        archive=SimpleNamespace(sealed=lambda _r: [], recorded=lambda _r: None, get=lambda *_a: b""),
        membership=membership,
        gossip=lambda *a: signed.append(a), sign_envelope=None, stage_hashes=None, own_replica=lambda: 0,
        current_round=lambda: 0, work_dir=tmp_path, evidence_dir=tmp_path, stop=threading.Event(),
        on_ejected=None)
    checker = SpotChecker(ctx)
    try:
        accuser = Identity.generate()
        evidence = msg.Evidence(b"a" * 20, 1, [b"not an envelope"], "mismatch", "r", [0.3])
        unsealed = Envelope.create(accuser, 7, 0, msg.EVIDENCE, msg.encode_payload(evidence)).to_bytes()
        for blob, served_here in ((b"never served", False), (b"garbage", True), (unsealed, True)):
            digest = hashlib.sha256(blob).hexdigest()
            if served_here:
                served[digest] = blob
            checker._confirm(0, accuser.peer_id,
                             msg.Accusation(0, b"a" * 20, "peer", 1, bytes.fromhex(digest),
                                            len(blob)))
        verdicts = [message for _round, kind, message in signed if kind == msg.VERDICT]
        assert [(v.evidence_hash, v.guilty) for v in verdicts] == [
            (hashlib.sha256(b"never served").digest(), False),
            (hashlib.sha256(b"garbage").digest(), False),
        ]  # and nothing for the evidence this node cannot check
    finally:
        ctx.stop.set()
        checker.close()


def test_chain_evidence_must_name_the_sealed_envelopes_of_both_rounds(tmp_path):
    """A broken chain's evidence is round t's sealed envelopes followed by round t+1's. Evidence that
    appends anything else (another envelope of t+1, round t's replayed as t+1's, or t+1 envelopes this
    node did not seal) makes the confirming node sign nothing and serve nothing; the honest shape passes
    that gate and reaches the rerun."""

    from node.live.checks.verifier import SpotChecker
    from node.store.archive import ArchivedContribution
    from p2p.envelope import Envelope
    from p2p.identity import Identity

    accused, accuser = Identity.generate(), Identity.generate()

    def contribution(outer_round: int, blob: bytes) -> bytes:
        body = msg.ContributionBody(bytes([outer_round]) * 32, b"d" * 32, blob)
        return Envelope.create(accused, 7, outer_round, msg.CONTRIBUTION, msg.encode_contribution_body(body),
                               stage=0).to_bytes()

    sealed_env = {0: contribution(0, b"r0"), 1: contribution(1, b"r1")}
    unsealed = contribution(1, b"another round-1 contribution")
    envelopes = {hashlib.sha256(e).digest(): e for e in [*sealed_env.values(), unsealed]}
    sealed = {r: [ArchivedContribution(0, 1, accused.peer_id, hashlib.sha256(e).digest())]
              for r, e in sealed_env.items()}
    served: dict[str, bytes] = {}
    provided = []

    class Host:  # the blob boundary
        def fetch_blob(self, digest, dest, providers=None, timeout=None):
            dest.write_bytes(served[digest])

        def provide_blob(self, data, announce=True):
            provided.append(data)

    rerun = []
    signed = []
    ctx = one_stage_verifier(tmp_path, Host(), sealed, envelopes, gossip=lambda *a: signed.append(a))
    checker = SpotChecker(ctx)
    # stop at the rerun: None = could not rerun
    checker._check = lambda r, replica: rerun.append((r, replica))

    def confirm(contributions: list[bytes]) -> None:
        evidence = msg.Evidence(b"a" * 20, 1, contributions, "state_mismatch", "r",
                                [0.0] * len(contributions))
        blob = Envelope.create(accuser, 7, 0, msg.EVIDENCE, msg.encode_payload(evidence)).to_bytes()
        digest = hashlib.sha256(blob).hexdigest()
        served[digest] = blob
        checker._confirm(0, accuser.peer_id, msg.Accusation(0, b"a" * 20, accused.peer_id, 1,
                                                            bytes.fromhex(digest), len(blob)))

    try:
        for hostile in ([sealed_env[0], unsealed], [sealed_env[0], sealed_env[0]],
                        [sealed_env[0], sealed_env[1], sealed_env[1]]):
            confirm(hostile)
        assert (signed, provided, rerun) == ([], [], [])
        sealed.pop(1)  # round 1 not sealed here: its envelopes cannot be checked, nothing is signed
        confirm([sealed_env[0], sealed_env[1]])
        assert (signed, provided, rerun) == ([], [], [])
        sealed[1] = [ArchivedContribution(0, 1, accused.peer_id, hashlib.sha256(sealed_env[1]).digest())]
        # the honest shape is served onward and rerun (on the rerun thread)
        confirm([sealed_env[0], sealed_env[1]])
        checker.drain(60)
        assert len(provided) == 1 and rerun == [(0, 1)] and signed == []
    finally:
        ctx.stop.set()
        checker.close()


def test_a_result_with_malformed_next_state_hashes_is_refused():
    from node.live.checks.spotcheck import parse_result

    good = {"verdict": "exact", "reason": "r", "distances": {"0": 0.0}, "seconds": 1.0}
    assert parse_result(json_bytes(good)).next_state_hashes is None
    assert parse_result(json_bytes({**good, "next_state_hashes": ["ab" * 32]})).next_state_hashes \
        == [b"\xab" * 32]
    for bad in (["ab"], ["zz" * 32], "ab" * 32, [1]):
        with pytest.raises(SpotCheckFailed):
            parse_result(json_bytes({**good, "next_state_hashes": bad}))


def json_bytes(doc) -> bytes:
    import json

    return json.dumps(doc).encode()


def test_the_audit_judges_a_chain_link_from_the_archives_and_never_trusts_a_served_state(tmp_path):
    """``dlx-node audit --reexecute``'s chain check (``ReexecAuditor.chain_broken``): a link is judged
    only from an exact rerun; round t+1 starting where the rerun ends holds; otherwise the claimed start
    state must be in the archives and look like a restart from the record. A state that carries training
    history, a garbage state that hashes to its claim, or a state missing from the archives never passes
    as a restart: the first two break the chain, the last is unverifiable."""
    from types import SimpleNamespace

    from node.tools.audit_reexec import ReexecAuditor
    from node.tools.audit_reexec_checks import split_chain_evidence

    cfg, state, _claims = _honest_job(tmp_path / "data")
    corpus = corpus_from_config(cfg.training, cfg.model)
    rerun = reexecute(state, corpus, cfg.model, cfg.training, cfg.diloco, cfg.compression)
    assert rerun.next_state is not None
    trained = rerun.next_state  # round 1's start state after round 0's training: AdamW state, a residual
    archive = tmp_path / "archive-node"
    (archive / "blobs").mkdir(parents=True)

    def store(data: bytes) -> bytes:
        digest = hashlib.sha256(data).digest()
        (archive / "blobs" / digest.hex()).write_bytes(data)
        return digest

    auditor = ReexecAuditor(SimpleNamespace(cfg=cfg), [archive], run_id=1, run_rounds=cfg.rounds)

    def envelopes_binding(hashes):
        from p2p.envelope import Envelope, decode_envelope
        from p2p.identity import Identity

        who = Identity.generate()
        return [decode_envelope(Envelope.create(
            who, 1, 1, msg.CONTRIBUTION,
            msg.encode_contribution_body(msg.ContributionBody(h, b"d" * 32, b"blob")), stage=s).to_bytes(),
                                1 << 20) for s, h in enumerate(hashes)]

    exact = SimpleNamespace(next_state_hashes=trained.stage_hashes())
    broken, reason, stages = auditor.chain_broken(0, SimpleNamespace(next_state_hashes=None), [])
    assert broken is None and "not bit-exact" in reason
    broken, _, stages = auditor.chain_broken(0, exact, envelopes_binding(trained.stage_hashes()))
    assert broken is False

    forged = [b"f" * 32 for _ in trained.stage_hashes()]  # a state nobody can produce: not archived
    broken, reason, stages = auditor.chain_broken(0, exact, envelopes_binding(forged))
    assert broken is None and "not in the archives" in reason

    garbage = [store(b"garbage that hashes to its claim %d" % s) for s in range(len(forged))]
    broken, reason, stages = auditor.chain_broken(0, exact, envelopes_binding(garbage))
    assert broken is True and "malformed" in reason and stages == (0, 1)
    # Judged stage by stage (a split replica's stages have different signers): only the stage whose state
    # does not follow is named.
    broken, reason, stages = auditor.chain_broken(0, exact, envelopes_binding([trained.stage_hashes()[0],
                                                                               garbage[1]]))
    assert broken is True and stages == (1,) and "malformed" in reason

    # Another replica's trained state (here: the same shape, rerun from another replica's start) is
    # history, not a restart.
    other_meta = round_meta(0, 1, cfg.model, cfg.diloco, run_rounds=cfg.rounds, num_stages=2, threads=1)
    other = reexecute(initial_replica_state(other_meta, cfg.model, cfg.training, cfg.diloco, cfg.compression),
                      corpus, cfg.model, cfg.training, cfg.diloco, cfg.compression).next_state
    claimed = [store(part.to_bytes()) for part in other.stages]
    assert claimed == other.stage_hashes()
    broken, reason, stages = auditor.chain_broken(0, exact, envelopes_binding(claimed))
    assert broken is True and "carries state a restart does not have" in reason

    # The evidence's shape: round t's envelopes (one per stage), optionally followed by round t+1's.
    def at(rnd, stages):
        return [SimpleNamespace(round=rnd, stage=s) for s in range(stages)]

    assert split_chain_evidence(at(4, 2), 2, 4) == (at(4, 2), [])
    assert split_chain_evidence(at(4, 2) + at(5, 2), 2, 4) == (at(4, 2), at(5, 2))
    for hostile in (at(4, 1), at(4, 2) + at(4, 2), at(4, 2) + at(6, 2), at(4, 2) + at(5, 1), at(3, 2),
                    at(4, 2) + at(5, 2) + at(5, 2), []):
        with pytest.raises(ValueError):
            split_chain_evidence(hostile, 2, 4)


def test_a_chain_link_is_checked_however_far_behind_the_chain_the_node_is(tmp_path, caplog):
    """Round t-1's exact rerun is linked into round t even when the node is many rounds behind the chain.

    On a loaded machine every link's turn came after its round's checks had put the node more than
    MAX_LAG_ROUNDS behind, and the link was skipped with them: a member forging its start state between
    rounds (tests/adversary.py forge-state) went uncaught until the run ended (round 94 of 100, load 30).
    The rerun, the costly half, is already done; the link must be made. A chained link counts; a broken
    one is accused, lag or not."""

    from node.live.checks.spotcheck import SpotCheckResult
    from node.live.checks.verifier import MAX_LAG_ROUNDS, SpotChecker
    from node.store.archive import ArchivedContribution
    from p2p.envelope import Envelope
    from p2p.identity import Identity

    member = Identity.generate()
    led_to, forged = b"\x11" * 32, b"\x22" * 32  # where round 0's rerun ended; a start state bound elsewhere

    def contribution(outer_round: int, state_hash: bytes) -> bytes:
        body = msg.ContributionBody(state_hash, b"d" * 32, b"blob")
        return Envelope.create(member, 7, outer_round, msg.CONTRIBUTION, msg.encode_contribution_body(body),
                               stage=0).to_bytes()

    envelopes: dict[bytes, bytes] = {}
    sealed: dict[int, list] = {}

    def seal(outer_round: int, state_hash: bytes) -> None:
        env = contribution(outer_round, state_hash)
        envelopes[hashlib.sha256(env).digest()] = env
        sealed[outer_round] = [ArchivedContribution(0, 1, member.peer_id, hashlib.sha256(env).digest())]

    class Host:  # the forged state is not served: the chain check must still say why, and accuse nobody
        def fetch_blob(self, digest, dest, providers=None, timeout=None):
            from p2p.errors import P2PError

            raise P2PError(f"blob {digest[:12]} is not served")

        def remove_blob(self, digest):
            pass

    ctx = one_stage_verifier(tmp_path, Host(), sealed, envelopes, gossip=lambda *a: None)
    checker = SpotChecker(ctx)
    accused = []
    checker._court.put = lambda *job: accused.append(job)  # the tribunal's queue: what the link hands over
    try:
        for t in (1, 2):  # round t's link of replica 1 from an exact rerun of round t-1
            checker._results[(t - 1, 1)] = SpotCheckResult("exact", "r", {0: 0.0}, 1.0,
                                                           next_state_hashes=[led_to])
        checker._newest = 2 + MAX_LAG_ROUNDS + 10  # far behind the chain
        seal(1, led_to)
        checker._link(1, {1: {member.peer_id}})
        assert (checker.chain_checks, checker.mismatches, accused) == (1, 0, [])  # chained, counted
        seal(2, forged)
        checker._link(2, {1: {member.peer_id}})
        # Not chained and the state not served: the link was
        # made (not skipped) and could not tell: nobody accused.
        assert (checker.chain_checks, checker.mismatches, accused) == (1, 0, [])
        assert "chain check of replica 1 round 2 not done: blob 222222222222 is not served" in caplog.text
    finally:
        ctx.stop.set()
        checker.close()


def one_stage_verifier(tmp_path, host, sealed: dict, envelopes: dict, gossip):
    """A spot checker's context over one-stage rounds: ``sealed`` (round -> archived entries) and
    ``envelopes`` (hash -> bytes) are the archive, ``host`` the blob boundary; nothing samples (spot_checks
    0)."""
    import threading
    from types import SimpleNamespace

    from node.live.checks.verifier import VerifierContext
    from node.live.peers.membership import Membership
    from node.live.state.roundbook import RoundBook

    membership = Membership("me", "c0", 1, 1, RoundBook(), seat=lambda _a, _k: Seat((0, 0), 0))
    return VerifierContext(
        cfg=SimpleNamespace(spot_checks=0.0, p2p=SimpleNamespace(max_blob_bytes=1 << 20),
                            pipeline=SimpleNamespace(
            num_stages=1)), run_id=7, peer_id="me", chain=None, host=host,
        archive=SimpleNamespace(sealed=lambda r: sealed.get(r), recorded=lambda _r: None,
                                get=lambda _r, h: envelopes[h]),
        membership=membership, gossip=gossip, sign_envelope=None, stage_hashes=None,
        own_replica=lambda: 0, current_round=lambda: 0, work_dir=tmp_path, evidence_dir=tmp_path,
        stop=threading.Event(), on_ejected=None)
