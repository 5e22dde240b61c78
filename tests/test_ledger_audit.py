"""The chain checks (ledger.checks) on a real deployment: a run's record, binding signatures, bytecode."""

from __future__ import annotations

import pytest
from ledger_fixtures import deploy, digest, make_commit, node_key, raw_public_key

import contracts
from ledger.account import dev_account
from ledger.checks import check_chain_record, verify_bytecode
from ledger.errors import AuditError


def test_audit_of_an_honest_run_is_clean(deployment):
    client = deployment.register(1)
    run_id = client.create_run(digest("config"), 2, 10)
    for round in range(3):
        client.commit_round(make_commit(run_id, round))
    deployment.register(2).dispute(run_id, 1, digest("x"), digest("y"))
    checks = check_chain_record(client, client.history(run_id))
    assert checks.ok, checks.problems
    assert len(checks.hash_chain.links) == len(checks.committers) == 3
    assert [item.name.split()[0] for item in checks.contracts] == ["bytecode", "bytecode", "ledger"]
    assert len(checks.registrations) == 2 and all(item.ok for item in checks.registrations)
    assert checks.disputed_rounds == [1]


def test_audit_flags_commits_from_a_forged_binding(deployment):
    honest = deployment.register(1)
    forger = deployment.client(2)
    victim_key = raw_public_key(node_key(42))
    # Squatting someone's key with a signature the key never made: the contract cannot tell, auditors can.
    forger.register(victim_key, bytes(range(64)))
    run_id = honest.create_run(digest("config"), 1, 10)
    honest.commit_round(make_commit(run_id, 0))
    forger.commit_round(make_commit(run_id, 1))
    checks = check_chain_record(honest, honest.history(run_id))
    assert not checks.ok
    forged = [item for item in checks.registrations if not item.ok]
    assert len(forged) == 1 and forger.address in forged[0].name and "forged registration" in forged[0].reason
    assert list(checks.valid) == [honest.address]
    assert [item.ok for item in checks.committers] == [True, False]
    assert forger.address in checks.committers[1].reason
    assert checks.hash_chain.ok  # the chain itself is intact: only who committed is wrong


def test_audit_accepts_commits_made_before_unregistering(deployment):
    client = deployment.register(1)
    run_id = client.create_run(digest("config"), 1, 10)
    client.commit_round(make_commit(run_id, 0))
    client.unregister()
    checks = check_chain_record(client, client.history(run_id), check_code=False)
    assert checks.ok and checks.contracts is None  # the commit predates the exit


def test_verify_bytecode_masks_immutables(chain_w3):
    first = deploy(chain_w3, min_stake=0)
    second = deploy(chain_w3, min_stake=12345)  # different immutable value, same code otherwise
    registry_artifact = contracts.artifact("NodeRegistry")
    ledger_artifact = contracts.artifact("TrainingLedger")
    for deployment in (first, second):
        verify_bytecode(chain_w3, deployment.registry, registry_artifact)
        verify_bytecode(chain_w3, deployment.ledger, ledger_artifact)
    with pytest.raises(AuditError, match="bytes"):
        verify_bytecode(chain_w3, first.registry, ledger_artifact)
    with pytest.raises(AuditError, match="no code"):
        verify_bytecode(chain_w3, dev_account(5, chain_w3.eth.chain_id).address, registry_artifact)
    tampered = dict(registry_artifact)
    code = bytearray.fromhex(tampered["deployedBytecode"][2:])
    code[10] ^= 0xFF
    tampered["deployedBytecode"] = "0x" + code.hex()
    with pytest.raises(AuditError, match="differs"):
        verify_bytecode(chain_w3, first.registry, tampered)


def test_a_read_only_client_audits_but_cannot_send(deployment):
    from ledger.client import LedgerClient
    from ledger.errors import AccountError

    writer = deployment.register(1)
    run_id = writer.create_run(digest("config"), 1, 10)
    writer.commit_round(make_commit(run_id, 0))
    auditor = LedgerClient(deployment.w3, None, deployment.registry, deployment.ledger)
    assert auditor.last_round(run_id) == 0
    assert check_chain_record(auditor, auditor.history(run_id)).ok
    with pytest.raises(AccountError, match="read-only"):
        auditor.create_run(digest("other"), 1, 1)
