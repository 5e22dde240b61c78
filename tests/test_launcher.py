"""The local launcher past the chain's nine funded dev accounts: generated accounts are funded and every
member registers and stakes through the node's own chain flow (setup only, no training)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ledger.account import DEV_ACCOUNT_COUNT, dev_account
from node.commands.launcher import GAS_ALLOWANCE_WEI, MAX_NODES, LocalRun, NodeSlot
from node.config import load_config
from node.errors import NodeError
from node.live.state.topology import Declaration, Seat, assign_stages
from node.live.chain.onchain import NodeChain
from node.live.state.topology import Declaration, Seat, assign_stages
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


def _waiting_run(tmp_path) -> tuple[LocalRun, NodeSlot]:
    """A LocalRun whose one node is a real process that runs until killed (no chain, no training)."""
    slot = NodeSlot("n0", tmp_path, tmp_path / "node.toml", "peer", 0)
    slot.process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    return LocalRun(tmp_path, nodes=[slot]), slot


def test_a_wait_on_progress_counts_its_timeout_from_the_last_finished_round(tmp_path):
    # The node finishes a round (its state.json changes) at every one of the waiter's ticks (one a second) and
    # exits after eight: longer than the 3 s timeout, which a wait on progress counts from the last change.
    run, slot = _waiting_run(tmp_path)
    ticks = []

    def finish_a_round(_run):
        ticks.append(1)
        (tmp_path / "state.json").write_text(json.dumps({"rounds": len(ticks)}))
        if len(ticks) == 8:
            slot.process.kill()

    try:
        assert run.wait(3, on_tick=finish_a_round, progress=True) is False  # it ran to its end: killed, not 0
        assert len(ticks) >= 8
    finally:
        slot.process.kill()
        slot.process.wait()


def test_a_wait_gives_up_when_no_round_is_finished(tmp_path):
    run, slot = _waiting_run(tmp_path)
    ticks = []
    try:
        assert run.wait(3, on_tick=lambda _run: ticks.append(1), progress=True) is False
        assert slot.process.poll() is None  # the wait gave up on a node that still runs
    finally:
        slot.process.kill()
        slot.process.wait()


def test_nodes_started_together_are_seated_in_a_fixed_order(tmp_path):
    # A cluster's replica index is its first member's seat index, which seeds the replica's data shard:
    # LocalRun.start seats the nodes one after the other (each cluster's first node first) before starting
    # them, so the replicas' indices (hence the demo's losses) do not depend on which node process reaches
    # the chain first.
    run = LocalRun(tmp_path / "run", replicas=2, stages=2, split=True,
                   settings=["model.preset=tiny", "rounds=1"])
    try:
        run.setup()
        order = run.seating_order()
        assert [slot.name for slot in order] == ["r0n0", "r1n0", "r0n1", "r1n1"]
        run.seat(order)
        run.seat(run.nodes)  # a node that finds its seat (what each one does again at its start) keeps it
        client = run.client()
        expected = [dev_account(slot.account, run.chain_id).address.lower() for slot in order]
        assert [m.account.lower() for m in client.memberships(run.run_id)] == expected
        declarations = [Declaration(slot.peer_id, slot.cluster, 2, Seat((0, i), i))
                        for i, slot in enumerate(order)]
        placements = assign_stages(declarations, 2)
        assert {p.cluster: p.replica for p in placements.values()} == {"cluster-0": 0, "cluster-1": 1}
    finally:
        run.stop()


def test_nodes_spread_over_the_gpus_of_a_machine_with_several(monkeypatch):
    import torch

    from node.commands.launcher import spread_over_gpus

    # the CPU, or one GPU: every node keeps the run's device
    assert spread_over_gpus("cpu", 4) == [None] * 4
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert spread_over_gpus("cuda", 4) == [None] * 4
    # two GPUs, 2 replicas x 2 stages in seating order (r0n0, r0n1, r1n0, r1n1): each replica's stages on
    # different GPUs, so their pipeline can go over NCCL
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert spread_over_gpus("auto", 4) == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert spread_over_gpus("cuda:1", 4) == [None] * 4  # a device the organizer named is kept
    assert spread_over_gpus("cpu", 4) == [None] * 4
