"""A peer refuses a contribution of a version-3 run whose binding (issue 62) is missing or bad, in process:
two real libp2p hosts, a real contribution pool fetching the sender's envelope, the exchange's own payload
check (``Exchange.check_payload``) with the node's binder (node/live/fraud/contribution_binding.py), a real
EVM (py-evm) naming the EIP-712 domain."""

from __future__ import annotations

import dataclasses
import functools
import types

import pytest
from waiting import wait_until

from ledger.chain import connect_pyevm
from node import protocol as msg
from node.live.chain.onchain import NodeChain
from node.live.exchange.pool import ContributionPool
from node.live.exchange.protocol import Exchange
from node.live.fraud.contribution_binding import ContributionBinder, ContributionUnbound, bindings_in
from node.live.state.roundbook import Announced, RoundBook
from p2p.config import P2PConfig
from p2p.envelope import Envelope
from p2p.host import P2PHost
from p2p.identity import Identity
from tests.fraud_fixtures import DILOCO, contribution
from tests.ledger_fixtures import deploy

pytestmark = pytest.mark.timeout(240)

SHAPES = {"w": (2, 40)}
NORMED = dataclasses.replace(DILOCO, commitments="normed")
RUN_ID, ROUND, STAGE = 1, 1, 0


def _stand_in(binder: ContributionBinder, book: RoundBook):
    """What ``Exchange.check_payload`` reads of its exchange: the binder, the book of hellos, the worker's
    shapes; the codec check passes (the blobs are well formed)."""
    worker = types.SimpleNamespace(stage_shapes=lambda stage: SHAPES)
    station = types.SimpleNamespace(worker=lambda: worker)
    return types.SimpleNamespace(binder=binder, book=book, station=station,
                                 check_blob=lambda stage, outer_round, blob: None)


def test_a_contribution_with_a_missing_or_bad_binding_is_refused(tmp_path):
    deployment = deploy(connect_pyevm())
    sender_client, other_client = deployment.client(1), deployment.client(2)
    sender_binder = ContributionBinder(RUN_ID, NodeChain(sender_client), NORMED, refuse_raw=False)
    other_binder = ContributionBinder(RUN_ID, NodeChain(other_client), NORMED, refuse_raw=False)
    receiver_binder = ContributionBinder(RUN_ID, NodeChain(deployment.client(3)), NORMED, refuse_raw=False)
    sender_id = Identity.generate()
    hosts = [P2PHost.start(P2PConfig(listen_port=0), identity, data_dir=tmp_path / f"host{i}")
             for i, identity in enumerate((sender_id, Identity.generate()))]
    book = RoundBook()
    book.add_hello(hosts[0].peer_id, sender_id.public_key_bytes,
                   msg.Hello("c", 1, bytes.fromhex(sender_client.address[2:]), [], ROUND, ROUND))
    sent = ContributionPool(hosts[0], RoundBook(), RUN_ID, tmp_path / "in0", 1 << 22, 30.0, 2)
    check = functools.partial(Exchange.check_payload, _stand_in(receiver_binder, book))
    fetched = ContributionPool(hosts[1], RoundBook(), RUN_ID, tmp_path / "in1", 1 << 22, 30.0, 2,
                               check_payload=check)
    try:
        hosts[1].connect(hosts[0].listen_addrs[0])
        blob, other_blob = (contribution(SHAPES, "raw", seed, scale=1e-2) for seed in (1, 2))
        own = sender_binder.sign(ROUND, STAGE, blob, SHAPES)
        cases = {
            "valid": own,
            "missing": (b"", b""),
            "another account": other_binder.sign(ROUND, STAGE, blob, SHAPES),
            "other roots": (own[0], sender_binder.sign(ROUND, STAGE, other_blob, SHAPES)[1]),
        }
        digests = {}
        for replica, (name, (contributor, binding)) in enumerate(cases.items()):
            body = msg.ContributionBody(bytes(32), bytes(32), blob, bytes(32), contributor, binding)
            envelope = Envelope.create(sender_id, RUN_ID, ROUND, msg.CONTRIBUTION,
                                       msg.encode_contribution_body(body), STAGE, replica).to_bytes()
            digest = sent.serve_own(ROUND, envelope)
            digests[name] = digest
            fetched.fetch(ROUND, STAGE, Announced(hosts[0].peer_id, replica, digest, len(envelope)))
        wait_until(lambda: len(fetched.have(ROUND, STAGE)) + len(fetched.rejected(ROUND, STAGE)) == 4, 120,
                   "four contributions fetched or refused")
        assert set(fetched.have(ROUND, STAGE)) == {digests["valid"]}
        reasons = {digest: reason for digest, (_peer, reason) in fetched.rejected(ROUND, STAGE).items()}
        assert "no binding" in reasons[digests["missing"]]
        assert "not its sender's" in reasons[digests["another account"]]
        assert "recovers to" in reasons[digests["other roots"]]
        # what the committer copies into the factors: the valid one's account and signature
        held = fetched.have(ROUND, STAGE)[digests["valid"]]
        assert bindings_in([held, None]) == [(sender_client.address, own[1]), None]
    finally:
        for pool in (sent, fetched):
            pool.close()
        for host in hosts:
            host.close()


def test_the_binder_refuses_a_contribution_replayed_in_another_run():
    """A signature is over one run, round and stage: replayed in another run it recovers to another
    account."""
    deployment = deploy(connect_pyevm())
    binder = ContributionBinder(RUN_ID, NodeChain(deployment.client(1)), NORMED, refuse_raw=False)
    blob = contribution(SHAPES, "raw", 3, scale=1e-2)
    contributor, binding = binder.sign(ROUND, STAGE, blob, SHAPES)
    body = msg.ContributionBody(bytes(32), bytes(32), blob, bytes(32), contributor, binding)
    binder.check(ROUND, STAGE, body, SHAPES, contributor)
    replayed = dataclasses.replace(binder, run_id=RUN_ID + 1)
    with pytest.raises(ContributionUnbound, match="recovers to"):
        replayed.check(ROUND, STAGE, body, SHAPES, contributor)
    encoded = msg.encode_contribution_body(body)
    assert encoded.startswith(msg.BOUND_CONTRIBUTION_MAGIC) and msg.decode_contribution_body(encoded) == body
    with pytest.raises(msg.ProtocolError):
        msg.decode_contribution_body(encoded[:len(msg.BOUND_CONTRIBUTION_MAGIC) + 96 + 50])


def test_a_contribution_no_round_can_accept_is_sent_unbound_and_refused():
    """A non-finite contribution has no sum of squares, so no roots to sign: the contributor sends it unbound
    (it does not stop publishing) and every peer refuses it, as every aggregation would have left it out."""
    deployment = deploy(connect_pyevm())
    binder = ContributionBinder(RUN_ID, NodeChain(deployment.client(1)), NORMED, refuse_raw=False)
    blob = contribution(SHAPES, "raw", 4, scale=float("nan"))
    assert binder.sign(ROUND, STAGE, blob, SHAPES) == (b"", b"")
    body = msg.ContributionBody(bytes(32), bytes(32), blob, bytes(32))
    with pytest.raises(ContributionUnbound, match="no binding"):
        binder.check(ROUND, STAGE, body, SHAPES, None)
    signed = dataclasses.replace(body, contributor=b"\x01" * 20, binding=b"\x02" * 65)
    with pytest.raises(ContributionUnbound, match="no roots"):
        binder.check(ROUND, STAGE, signed, SHAPES, None)
