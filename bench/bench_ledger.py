"""Ledger benchmark: gas of every contract call, and the time to read and verify a long run's history.

Runs against a real anvil started from contracts/node_modules (``npm ci --prefix contracts`` first):

    .venv/bin/python bench/bench_ledger.py [--rounds 1000] [--out bench/results/ledger.json]

Measures:
* gas used by each call (deployments: each linked library, the registry, the ledger; register with and
  without stake, createRun, joinRun, leaveRun, ejectInactive, withdrawStake, commitRound, dispute, attest,
  resolveDispute (upheld), reportEquivocation, accuse, resolveAccusation (not guilty, guilty),
  expireAccusation, unregister);
* round-commit gas by quorum k = 1, 3, 5, 8 signatures of 8 members (target <= 150k at k = 3), first commit of
  a run and a later one, with and without a checkpoint;
* round-commit gas at 3 of 4 and 10 of 16 members (the quorum from the fraction: k = 2 and quorumBps 7500 /
  6250), with 4, 64 and 4096 contributors (must not grow: contributor data is behind one root);
* time to read a run of ``--rounds`` committed rounds back from anvil (paginated event scan) and verify it
  (hash-chain replay, binding signatures, attesters and members, bytecode), target <= 5 s for 1000 rounds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import contracts
from ledger.account import dev_account, fund_accounts
from ledger.chain import connect_rpc
from ledger.anvil import AnvilProcess
from ledger.checks import check_chain_record, check_hash_chain
from ledger.client import LedgerClient
from ledger.records import ZERO_HASH, RoundRecord, Verdict

QUORUMS = (1, 3, 5, 8)
MEMBERS = range(1, 9)  # dev accounts 1-8 join every measured run
#: (signers, members, quorumBps with k = 2): the quorum comes from the fraction of the members.
FRACTIONS = ((3, 4, 7500), (10, 16, 6250))
STAKE = 10**16
BOND = 10**15


def digest(label: str) -> bytes:
    return hashlib.sha256(label.encode()).digest()


def next_record(client: LedgerClient, run_id: int, contributors: int,
                checkpoint: bytes = ZERO_HASH) -> RoundRecord:
    index = client.commit_count(run_id)
    return RoundRecord(
        run_id,
        index,
        client.head_of(run_id),
        digest(f"w{index}"),
        digest(f"c{index}"),
        3_000_000 + index,
        3_100_000 + index,
        65_536 * (index + 1),
        contributors,
        checkpoint,
    )


def commit(clients: dict, run_id: int, k: int, contributors: int = 8, checkpoint: bytes = ZERO_HASH) -> str:
    """Commit the run's next round signed by members 1..k (dev accounts), submitted by member 1."""
    record = next_record(clients[1], run_id, contributors, checkpoint)
    return clients[1].commit_round(record, [clients[i].sign_record(record) for i in range(1, k + 1)])


def gas_of(client: LedgerClient, tx_hash: str) -> int:
    return client.w3.eth.get_transaction_receipt(tx_hash)["gasUsed"]


def register(client: LedgerClient, seed: int, stake: int | None = None) -> str:
    key = Ed25519PrivateKey.from_private_bytes(seed.to_bytes(32, "big"))
    public = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return client.register(public, key.sign(client.my_binding_message()), stake=stake)


def create_run(client: LedgerClient, label: str, **params) -> int:
    params.setdefault("min_stake", STAKE)
    params.setdefault("bond", BOND)
    params.setdefault("accusation_blocks", 8)
    params.setdefault("dispute_blocks", 8)
    params.setdefault("quorum_bps", 0)  # k alone unless a fraction is given (the k = 1 point is a weak run)
    params.setdefault("allow_weak_quorum", True)
    return client.create_run(digest(label), 4, 500, "file:///run.toml", **params)


def mine(w3, blocks: int) -> None:
    w3.provider.make_request("anvil_mine", [hex(blocks)])


def measure_gas(w3) -> dict:
    chain_id = w3.eth.chain_id
    deployer = dev_account(0, chain_id)
    block = w3.eth.block_number
    registry, ledger = LedgerClient.deploy(w3, deployer)
    deploy_gas = [
        w3.eth.get_block(number, full_transactions=True)["gasUsed"]
        for number in range(block + 1, w3.eth.block_number + 1)
    ]
    clients = {i: LedgerClient(w3, dev_account(i, chain_id), registry, ledger) for i in range(17)}
    fund_accounts(w3, deployer, [clients[i].address for i in range(10, 17)], 10 * STAKE + 10**20)
    # One block each: the libraries (contracts.LIBRARIES, in order), the registry, the ledger (and its
    # prover).
    names = [*contracts.LIBRARIES, "NodeRegistry", "TrainingLedger"]
    gas = {f"deploy_{name}": used for name, used in zip(names, deploy_gas, strict=True)}
    gas["deploy_total"] = sum(deploy_gas)
    gas["register"] = gas_of(clients[1], register(clients[1], 1))
    for i in range(2, 17):
        register(clients[i], i)
    by_quorum = {}
    runs = {}
    for k in QUORUMS:
        run_id = create_run(clients[1], f"config k={k}", quorum=k)
        gas.setdefault("createRun", w3.eth.get_block("latest")["gasUsed"])  # anvil mines one tx per block
        for i in MEMBERS:
            tx = clients[i].join_run(run_id, platform=digest(f"platform {i}"))  # as a node declares its own
            gas.setdefault("joinRun", gas_of(clients[i], tx))
        runs[k] = run_id
        first = gas_of(clients[1], commit(clients, run_id, k))
        later = gas_of(clients[1], commit(clients, run_id, k))
        with_checkpoint = gas_of(clients[1], commit(clients, run_id, k, checkpoint=digest("ckpt")))
        by_quorum[str(k)] = {"first": first, "later": later, "with_checkpoint": with_checkpoint}
    gas["commitRound_by_quorum"] = by_quorum

    run_id = runs[3]
    by_contributors = {}
    for contributors in (4, 64, 4096):
        by_contributors[str(contributors)] = gas_of(clients[1], commit(clients, run_id, 3, contributors))
    gas["commitRound_k3_by_contributors"] = by_contributors
    committed = clients[1].commit_of(run_id, clients[1].commit_count(run_id) - 1)
    mine_record = RoundRecord(*committed.fields()[:3], digest("mine"), *committed.fields()[4:])
    gas["dispute"] = gas_of(clients[8], clients[8].dispute(mine_record, clients[8].sign_record(mine_record)))
    gas["attest"] = gas_of(clients[6], clients[6].attest(committed, clients[6].sign_record(committed)))
    attesters = clients[1].commit_record(run_id, committed.round).attesters
    gas["resolveDispute_k3_upheld"] = gas_of(clients[1], clients[1].resolve_dispute(
        committed, True, [clients[i].sign_round_verdict_for(committed, True) for i in (1, 2, 3)], attesters))

    by_fraction = {}
    for signers, members, bps in FRACTIONS:
        fraction_run = create_run(clients[1], f"config {signers} of {members}", quorum=2, quorum_bps=bps)
        for i in range(1, members + 1):
            clients[i].join_run(fraction_run)
        assert clients[1].quorum_of(fraction_run) == signers
        entry = {"quorum": signers, "members": members, "quorum_bps": bps,
                 "first": gas_of(clients[1], commit(clients, fraction_run, signers))}
        for contributors in (4, 64, 4096):
            entry[f"contributors_{contributors}"] = gas_of(
                clients[1], commit(clients, fraction_run, signers, contributors)
            )
        entry["with_checkpoint"] = gas_of(clients[1],
                                          commit(clients, fraction_run, signers, checkpoint=digest("c")))
        by_fraction[f"{signers}_of_{members}"] = entry
    gas["commitRound_by_fraction"] = by_fraction

    evidence = digest("evidence")
    gas["accuse"] = gas_of(clients[1], clients[1].accuse(run_id, clients[7].address, evidence))
    verdict = Verdict(run_id, clients[7].address, evidence, False)
    gas["resolveAccusation_k3_not_guilty"] = gas_of(
        clients[1],
        clients[1].resolve_accusation(verdict, [clients[i].sign_verdict(verdict) for i in (1, 2, 3)])
    )
    lapsing = digest("lapsing evidence")
    clients[1].accuse(run_id, clients[7].address, lapsing)
    mine(w3, 8)
    gas["expireAccusation"] = gas_of(clients[1], clients[1].expire_accusation(run_id, clients[7].address,
                                                                              lapsing))
    guilty_evidence = digest("guilty evidence")
    clients[1].accuse(run_id, clients[5].address, guilty_evidence)
    verdict = Verdict(run_id, clients[5].address, guilty_evidence, True)
    gas["resolveAccusation_k3_guilty"] = gas_of(
        clients[1],
        clients[1].resolve_accusation(verdict, [clients[i].sign_verdict(verdict) for i in (1, 2, 3)])
    )
    gas["leaveRun"] = gas_of(clients[7], clients[7].leave_run(run_id))
    while clients[1].commit_count(run_id) < 16:  # members 4, 6 and 8 never signed: ejectable at round 16
        commit(clients, run_id, 3)
    gas["ejectInactive"] = gas_of(clients[9], clients[9].eject_inactive(run_id, clients[4].address))
    mine(w3, clients[1].run_info(run_id).unbonding_blocks)
    gas["withdrawStake"] = gas_of(clients[7], clients[7].withdraw_stake(run_id))
    forked = RoundRecord(*committed.fields()[:3], digest("forked"), *committed.fields()[4:])
    gas["reportEquivocation"] = gas_of(
        clients[9],
        clients[9].report_equivocation(
            committed, clients[6].sign_record(committed), forked, clients[6].sign_record(forked)
        ),
    )
    gas["unregister"] = gas_of(clients[16], clients[16].unregister())

    staked_registry, staked_ledger = LedgerClient.deploy(w3, deployer, min_stake=10**18)
    staked = LedgerClient(w3, dev_account(3, chain_id), staked_registry, staked_ledger)
    gas["register_with_stake"] = gas_of(staked, register(staked, 3))
    gas["unregister_with_refund"] = gas_of(staked, staked.unregister())
    return gas


def measure_history(w3, rounds: int) -> dict:
    chain_id = w3.eth.chain_id
    registry, ledger = LedgerClient.deploy(w3, dev_account(0, chain_id))
    client = LedgerClient(w3, dev_account(4, chain_id), registry, ledger)
    register(client, 4)
    run_id = client.create_run(digest("long run"), 2, 50, quorum=1, quorum_bps=0, allow_weak_quorum=True)
    client.join_run(run_id)
    started = time.perf_counter()
    for _ in range(rounds):
        record = next_record(client, run_id, 8)
        client.commit_round(record, [client.sign_record(record)])
    commit_seconds = time.perf_counter() - started

    reader = LedgerClient(w3, dev_account(5, chain_id), registry, ledger)
    started = time.perf_counter()
    history = reader.history(run_id)
    read_seconds = time.perf_counter() - started
    started = time.perf_counter()
    problems = check_hash_chain(history, chain_id, ledger).problems
    chain_seconds = time.perf_counter() - started
    started = time.perf_counter()
    # reads again, plus bytecode, bindings, attesters
    checks = check_chain_record(reader, reader.history(run_id))
    audit_seconds = time.perf_counter() - started
    assert len(history.commits) == rounds and not problems and checks.ok, (problems, checks.problems)
    return {
        "rounds": rounds,
        "commit_all_seconds": round(commit_seconds, 3),
        "commit_per_round_ms": round(1000 * commit_seconds / rounds, 2),
        "read_history_seconds": round(read_seconds, 3),
        "verify_hash_chain_seconds": round(chain_seconds, 3),
        "full_audit_seconds": round(audit_seconds, 3),
        "read_and_verify_seconds": round(read_seconds + chain_seconds, 3),
        "target_seconds": 5.0,
        "within_target": read_seconds + chain_seconds <= 5.0 and audit_seconds <= 5.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "ledger.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    with AnvilProcess() as anvil:
        w3 = connect_rpc(anvil.url)
        gas = measure_gas(w3)
        print(json.dumps({"gas": gas}, indent=2))
        history = measure_history(w3, args.rounds)
        print(json.dumps({"history": history}, indent=2))

    contributors_gas = gas["commitRound_k3_by_contributors"]
    k3 = gas["commitRound_by_quorum"]["3"]
    fractions = gas["commitRound_by_fraction"]
    result = {
        "benchmark": "ledger",
        "chain": "anvil 1.7.1 (hardfork prague)",
        "compiler": "solc 0.8.37, optimizer runs 200",
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
        "gas": gas,
        "commit_gas_k3_max": max(*contributors_gas.values(), *k3.values()),
        "commit_gas_k3_target": 150_000,
        "commit_gas_grows_with_contributors": any(
            abs(entry["contributors_4096"] - entry["contributors_4"]) > 100
            for entry in [*fractions.values(), {"contributors_4": contributors_gas["4"],
                                               "contributors_4096": contributors_gas["4096"]}]
        ),
        "commit_gas_3_of_4": fractions["3_of_4"]["contributors_64"],
        "commit_gas_10_of_16": fractions["10_of_16"]["contributors_64"],
        "history": history,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    temporary = out.with_suffix(".tmp")
    temporary.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(temporary, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
