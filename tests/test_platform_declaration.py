"""A member declares its platform on chain when it joins; spot checks and the audit hold every claim to it,
and route a claimant's checks to verifiers of its declared platform (issue 42, docs/DILOCOX.md section 11).

On a real EVM (py-evm and anvil: the ``deployment`` fixture): ``joinRun``'s platform in ``MemberJoined``, the
node's join (:meth:`NodeChain.ensure_member`) and its reads (:meth:`NodeChain.declared_platforms`), a real
start state's claimed fingerprint held to the declaration (the live check, :func:`undeclared_claim`, and the
audit's, :meth:`ReexecAuditor.declared_platform`). The routing itself is a pure function of chain data
(:func:`node.live.checks.routing.draw_checks`), tested without a network.
"""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch
from ledger_fixtures import MemberRun, node_key, raw_public_key

from ledger.errors import LedgerInputError
from node.config import load_config
from node.errors import NotRegistered
from node.live.chain.onchain import NodeChain
from node.live.checks.routing import draw_checks, routed_verifiers
from node.platforms import own_platform, own_platforms, undeclared_claim
from node.tools.audit_reexec import ReexecAuditor
from p2p.identity import peer_id_from_public_key
from training.declaration import NO_PLATFORM, platform_declaration, platform_hash
from training.fingerprint import fingerprint
from training.claimant_kernels import native_cpu_capability
from training.reexec import round_meta, sample_replicas
from training.replica_capture import initial_replica_state

OTHER_CPU = "Some Other CPU @ 9.99GHz"


def _peer(index: int) -> str:
    """The peer id of dev account ``index``'s node key (ledger_fixtures registers seed index + 1)."""
    return peer_id_from_public_key(raw_public_key(node_key(index + 1)))


def _run(deployment, members=(1, 2, 3)) -> int:
    for index in members:
        deployment.register(index)
    return deployment.client(members[0]).create_run(b"c" * 32, 2, 50, "file:///run.toml", quorum=1,
                                                    quorum_bps=0, allow_weak_quorum=True)


def _start_state(tmp_path, **platform_changes) -> list[bytes]:
    """A real replica start state (tiny, 2 stages) whose parts record this process's fingerprint, or one
    relabelled with ``platform_changes``."""
    cfg = load_config(None, ["model.preset=tiny", "diloco.inner_steps=2", "training.batch_size=2", "rounds=3",
                             "pipeline.num_stages=2", f"data_dir={tmp_path}"])
    platform = dataclasses.replace(fingerprint(torch.device("cpu"), "fp32"), **platform_changes)
    meta = round_meta(0, 0, cfg.model, cfg.diloco, run_rounds=cfg.rounds, num_stages=2, threads=1,
                      platform=platform)
    state = initial_replica_state(meta, cfg.model, cfg.training, cfg.diloco, cfg.compression)
    return [part.to_bytes() for part in state.stages]


def test_a_member_declares_its_platform_in_join_run_and_the_node_reads_it(deployment):
    run_id = _run(deployment)
    here = own_platform(load_config(None, ["training.device=cpu"]).training)
    assert here == platform_declaration(fingerprint(torch.device("cpu"), "fp32"), native_cpu_capability())
    assert here != NO_PLATFORM
    NodeChain(deployment.client(1)).ensure_member(run_id, here)
    deployment.client(2).join_run(run_id)  # a raw client that declares nothing
    history = deployment.client(3).history(run_id)
    assert {m.account: m.platform for m in history.memberships} == {
        deployment.client(1).address: here, deployment.client(2).address: NO_PLATFORM}

    reader = NodeChain(deployment.client(3))
    assert reader.declared_platforms(run_id, [_peer(1), _peer(2), _peer(3), "not a peer id"]) == {
        _peer(1): here, _peer(2): NO_PLATFORM}  # account 3 registered but holds no seat
    deployment.client(3).join_run(run_id, platform=b"\x07" * 32)
    assert reader.declared_platforms(run_id, [_peer(3)]) == {_peer(3): b"\x07" * 32}  # a new seat: read again

    member = NodeChain(deployment.client(1))
    member.ensure_member(run_id, here)  # the same platform: the seat it holds
    # Another instruction set than this CPU's own (an AVX-512 CPU, AMD or Intel, is tested against AVX2).
    native = fingerprint(torch.device("cpu"), "fp32")
    other = next(capability for capability in ("AVX512", "AVX2") if capability != native.capability)
    with pytest.raises(NotRegistered, match="declared platform .* when it joined run .* trains on platform"):
        member.ensure_member(run_id, platform_declaration(dataclasses.replace(native, capability=other)))
    deployment.register(4)
    with pytest.raises(LedgerInputError, match="platform: must be 32 bytes"):
        deployment.client(4).join_run(run_id, platform=b"\x01" * 31)
    assert deployment.client(4).member(run_id, deployment.client(4).address) is None  # nothing was sent

    # A seat a node declared before version-2 declarations holds this platform's version-1 hash: still its own
    declaration, legacy = own_platforms(load_config(None, ["training.device=cpu"]).training)
    assert (declaration, legacy) == (here, platform_hash(fingerprint(torch.device("cpu"), "fp32")))
    deployment.client(4).join_run(run_id, platform=legacy)
    NodeChain(deployment.client(4)).ensure_member(run_id, declaration, also=(legacy,))
    with pytest.raises(NotRegistered, match="declared platform"):
        NodeChain(deployment.client(4)).ensure_member(run_id, declaration)


def test_a_claim_of_another_platform_than_the_declared_one_is_refused(deployment, tmp_path):
    """Live (undeclared_claim over NodeChain's reads) and in the audit (the seat in force at the round's
    commit)."""
    run_id = _run(deployment, (1, 2))
    parts = _start_state(tmp_path / "honest")
    declared = platform_declaration(fingerprint(torch.device("cpu"), "fp32"), native_cpu_capability())
    NodeChain(deployment.client(1)).ensure_member(run_id, declared)
    deployment.client(2).join_run(run_id)  # declared no platform
    reader = NodeChain(deployment.client(2))
    seats = reader.declared_platforms(run_id, [_peer(1), _peer(2)])

    assert undeclared_claim([(0, _peer(1), parts[0]), (1, _peer(1), parts[1])], seats) is None
    moved = _start_state(tmp_path / "moved", device_name=OTHER_CPU)
    stage, why = undeclared_claim([(0, _peer(1), parts[0]), (1, _peer(1), moved[1])], seats)
    assert stage == 1 and why.startswith("declared platform: stage 1's signer claims cpu " + OTHER_CPU)
    assert declared.hex()[:16] in why
    lowered = _start_state(tmp_path / "lowered", capability="DEFAULT" if
                           fingerprint(torch.device("cpu"), "fp32").capability != "DEFAULT" else "AVX2")
    stage, why = undeclared_claim([(0, _peer(1), lowered[0])], seats)  # another instruction set, same CPU
    assert stage == 0 and "the same CPU model and build under" in why
    legacy = {_peer(1): platform_hash(fingerprint(torch.device("cpu"), "fp32"))}  # a version-1 declaration
    assert undeclared_claim([(0, _peer(1), parts[0]), (1, _peer(1), parts[1])], legacy) is None
    assert undeclared_claim([(0, _peer(1), lowered[0])], legacy)[0] == 0
    stage, why = undeclared_claim([(0, _peer(2), parts[0])], seats)
    assert stage == 0 and "declared no platform when it joined" in why
    assert undeclared_claim([(0, _peer(2), b"not a start state")], seats) is None  # the rerun judges that one
    assert undeclared_claim([(0, _peer(1), moved[0])], {}) is None  # no declaration read: nothing to hold to

    MemberRun(deployment, run_id, (1, 2), 1).commit("round 0")
    history = deployment.client(2).history(run_id)
    auditor = ReexecAuditor(SimpleNamespace(cfg=None), [], run_id, 3, history)
    assert auditor.declared_platform(_peer(1), 0) == declared
    assert auditor.declared_platform(_peer(2), 0) == NO_PLATFORM
    assert auditor.declared_platform(_peer(3), 0) is None  # no seat
    assert auditor.declared_platform(_peer(1), 1) is None  # round 1 is not committed
    assert ReexecAuditor(SimpleNamespace(cfg=None), [], run_id, 3).declared_platform(_peer(1), 0) is None


# ----------------------------------------------------------------------------- routing (pure)

A, B, C = b"\xaa" * 32, b"\xbb" * 32, b"\xcc" * 32


def _signers(n: int) -> dict[int, set[str]]:
    return {replica: {f"peer-{replica}"} for replica in range(n)}


def test_one_platform_routes_nothing_the_draw_is_the_plain_sample():
    signers, declared = _signers(5), {f"peer-{i}": A for i in range(5)}
    for outer_round in range(50):
        record = bytes([outer_round]) * 32
        for verifier in range(5):
            drawn = draw_checks(record, f"peer-{verifier}", outer_round, signers, declared, 1.0, verifier)
            plain = sample_replicas(record, f"peer-{verifier}".encode(), outer_round, range(5), 1.0 / 4,
                                    own_replica=verifier)
            assert [d.replica for d in drawn] == plain and not any(d.same_platform for d in drawn)


def test_a_claimant_is_checked_by_verifiers_of_its_declared_platform():
    """Replicas 0-2 declared A, 3-4 B, 5 C (nobody else), 6 nothing: with spot_checks = 1, replica 3 is
    checked by peer-4 in every round, replica 0 by one of peer-1/peer-2 per round on average, replicas 5 and 6
    only by the plain draw; nobody ever checks its own replica."""
    signers = _signers(7)
    declared = {"peer-0": A, "peer-1": A, "peer-2": A, "peer-3": B, "peer-4": B, "peer-5": C,
                "peer-6": NO_PLATFORM}
    assert routed_verifiers(3, signers, declared) == ["peer-4"]
    assert routed_verifiers(0, signers, declared) == ["peer-1", "peer-2"]
    assert routed_verifiers(5, signers, declared) == routed_verifiers(6, signers, declared) == []
    rounds = 2000
    by_same = {replica: 0 for replica in range(7)}
    everyone = {replica: 0 for replica in range(7)}
    for outer_round in range(rounds):
        record = outer_round.to_bytes(32, "big")
        for verifier in range(7):
            for check in draw_checks(record, f"peer-{verifier}", outer_round, signers, declared, 1.0,
                                     verifier):
                assert check.replica != verifier
                everyone[check.replica] += 1
                if f"peer-{verifier}" in routed_verifiers(check.replica, signers, declared):
                    by_same[check.replica] += 1
                elif check.same_platform:
                    raise AssertionError(
                        f"peer-{verifier} routed to replica {check.replica} of another platform")
    assert by_same[3] == rounds  # peer-4 alone shares B: it checks replica 3 every round
    assert 0.9 * rounds < by_same[0] < 1.1 * rounds  # about one check per round by peer-1 or peer-2
    assert by_same[5] == by_same[6] == 0
    for replica in (5, 6):  # the plain draw only: 6 verifiers at 1/6 each
        assert 0.9 * rounds < everyone[replica] < 1.1 * rounds


def test_the_draw_depends_on_chain_data_only_not_on_the_order_it_was_heard_in():
    # split clusters: 2 signers each
    signers = {0: {"a0", "b0"}, 1: {"a1", "b1"}, 2: {"a2", "b2"}, 3: {"a3", "b3"}}
    declared = {"a0": A, "b0": B, "a1": A, "b1": A, "a2": B, "b2": B, "a3": C, "b3": C}
    rng = random.Random(7)
    for outer_round in range(30):
        record = rng.randbytes(32)
        for verifier in sorted(declared):
            own = int(verifier[1])
            expected = draw_checks(record, verifier, outer_round, signers, declared, 1.0, own)
            shuffled_signers = dict(rng.sample(sorted(signers.items()), len(signers)))
            shuffled_declared = dict(rng.sample(sorted(declared.items()), len(declared)))
            assert draw_checks(record, verifier, outer_round, shuffled_signers, shuffled_declared, 1.0, own) \
                == expected
            assert all(check.replica != own for check in expected)
    # A stage signer of replica 0 declared B: replica 0's
    # checks go to B verifiers too (a2, b2), never to its own
    assert routed_verifiers(0, signers, declared) == ["a1", "a2", "b1", "b2"]
    assert draw_checks(b"r" * 32, "a0", 0, signers, declared, 0.0, 0) == []
