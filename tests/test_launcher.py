"""The local launcher past the chain's nine funded dev accounts: generated accounts are funded and every
member registers and stakes through the node's own chain flow (setup only, no training)."""

from __future__ import annotations

import pytest

from ledger.account import DEV_ACCOUNT_COUNT, dev_account
from node.commands.launcher import GAS_ALLOWANCE_WEI, MAX_NODES, LocalRun
from node.config import load_config
from node.errors import NodeError
from node.live.onchain import NodeChain
from node.platforms import own_platform
from node.runconfig import config_hash, run_document
from p2p.identity import Identity


def test_a_local_run_of_twelve_funds_registers_and_seats_every_member(tmp_path):
    stake = 10**17
    run = LocalRun(tmp_path / "run", replicas=12, stages=2, split=False, stake_wei=stake,
                   settings=["model.preset=tiny", "rounds=1"])
    try:
        run.setup()
        assert len(run.nodes) == 12
        assert len({slot.account for slot in run.nodes}) == 12
        assert max(slot.account for slot in run.nodes) >= DEV_ACCOUNT_COUNT
        client = run.client()
        w3 = client.w3
        for slot in run.nodes:
            address = dev_account(slot.account, run.chain_id).address
            if slot.account >= DEV_ACCOUNT_COUNT:
                assert w3.eth.get_balance(address) == stake + GAS_ALLOWANCE_WEI
            # What a starting node does before its first round: register its key, then stake its seat.
            cfg = load_config(slot.config_path)
            chain = NodeChain.connect(cfg)
            try:
                assert chain.client.address == address
                # The run the launcher created is the node's document's, its commitments version included.
                chain.check_run(run.run_id, config_hash(run_document(cfg)), cfg.rounds,
                                commitments=cfg.diloco.commitments)
                chain.ensure_registered(Identity.load_or_create(cfg.path(cfg.p2p.key_file)))
                chain.ensure_member(run.run_id, own_platform(cfg.training))
            finally:
                chain.close()
        assert client.member_count(run.run_id) == 12
        for slot in run.nodes:
            address = dev_account(slot.account, run.chain_id).address
            assert client.is_registered(address)
            seat = client.member(run.run_id, address)
            assert seat is not None and seat.active and seat.stake == stake
    finally:
        run.stop()


def test_a_local_run_refuses_more_nodes_than_it_supports(tmp_path):
    run = LocalRun(tmp_path / "run", replicas=MAX_NODES + 1, split=False)
    with pytest.raises(NodeError, match=f"{MAX_NODES + 1} nodes requested"):
        run.setup()
    assert run.anvil is None  # refused before any chain was started


def test_listen_ports_are_picked_outside_the_ephemeral_range():
    from node.commands.launcher import _ephemeral_ports, free_port

    ephemeral = _ephemeral_ports()
    ports = [free_port() for _ in range(50)]
    assert not [p for p in ports if p in ephemeral], ports  # no outgoing connection can take them meanwhile
