"""The chain checks (ledger.checks) on a real deployment: a run's record, binding signatures, bytecode."""

from __future__ import annotations

from dataclasses import replace

import pytest
from ledger_fixtures import SHORT_WINDOWS, deploy, digest, mine, node_key, raw_public_key

import contracts
from ledger.account import dev_account
from ledger.chain import connect_pyevm
from ledger.bytecode import bytecode_problem, linked_addresses, verify_bytecode
from ledger.checks import check_chain_record
from ledger.errors import AuditError


def test_audit_of_an_honest_run_is_clean(deployment):
    run = deployment.member_run((1, 2, 3), quorum=2)
    client = run.client(1)
    for _ in range(3):
        run.commit()
    committed = client.commit_of(run.run_id, 1)
    mine = replace(committed, weights_root=digest("x"))
    run.client(3).dispute(mine, run.client(3).sign_record(mine))
    checks = check_chain_record(client, client.history(run.run_id))
    assert checks.ok, checks.problems
    assert len(checks.hash_chain.links) == len(checks.attesters) == 3
    names = [item.name.split()[0] for item in checks.contracts]
    assert names == ["bytecode", "bytecode", "bytecode", "ledger"]  # registry, ledger, prover
    assert len(checks.registrations) == 3 and all(item.ok for item in checks.registrations)
    assert len(checks.members) == 3 and all(item.ok for item in checks.members)
    assert checks.disputed_rounds == [1]


def test_audit_flags_members_with_a_forged_binding(deployment):
    honest = deployment.register(1)
    forger = deployment.client(2)
    victim_key = raw_public_key(node_key(42))
    # Squatting someone's key with a signature the key never made: the contract cannot tell, auditors can.
    forger.register(victim_key, bytes(range(64)))
    run = deployment.member_run((1, 2), quorum=2)
    run.commit()
    checks = check_chain_record(honest, honest.history(run.run_id))
    assert not checks.ok
    forged = [item for item in checks.registrations if not item.ok]
    assert len(forged) == 1 and forger.address in forged[0].name and "forged registration" in forged[0].reason
    assert list(checks.valid) == [honest.address]
    assert [item.ok for item in checks.members] == [True, False]
    assert forger.address in checks.members[1].name
    assert checks.hash_chain.ok and all(item.ok for item in checks.attesters)  # the chain itself is intact


def test_audit_accepts_commits_made_before_leaving_and_unregistering(deployment):
    run = deployment.member_run((1,), quorum=1, **SHORT_WINDOWS)
    client = run.client(1)
    run.commit()
    client.leave_run(run.run_id)
    mine(deployment.w3, client.run_info(run.run_id).unbonding_blocks)
    client.withdraw_stake(run.run_id)
    client.unregister()
    checks = check_chain_record(client, client.history(run.run_id), check_code=False)
    assert checks.ok and checks.contracts is None, checks.problems  # the commit predates the exit


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


def test_verify_bytecode_checks_the_linked_libraries(monkeypatch):
    from ledger.client import LedgerClient

    w3 = connect_pyevm()
    libraries = {}
    registry, ledger = LedgerClient.deploy(w3, dev_account(0, w3.eth.chain_id), libraries=libraries)
    assert list(libraries) == list(contracts.LIBRARIES)
    ledger_artifact = contracts.artifact("TrainingLedger")
    linked = linked_addresses(bytes(w3.eth.get_code(ledger)), ledger_artifact)
    own = ("LedgerMembership", "LedgerDisputes", "LedgerAccusations")  # the prover's are in the prover's code
    assert linked == {name: libraries[name] for name in own}
    # A library holds its own address: its code is not that library anywhere else.
    disputes = bytes(w3.eth.get_code(libraries["LedgerDisputes"]))
    disputes_artifact = contracts.artifact("LedgerDisputes")
    assert bytecode_problem(disputes, disputes_artifact, libraries["LedgerDisputes"]) is None
    assert "not there" in bytecode_problem(disputes, disputes_artifact, registry)
    # A linked library whose code is not the committed one fails the ledger's check, named.
    committed = contracts.artifact

    def tampered(name: str) -> dict:
        artifact = committed(name)
        if name == "LedgerDisputes":
            code = bytearray.fromhex(artifact["deployedBytecode"][2:])
            code[40] ^= 0xFF
            artifact["deployedBytecode"] = "0x" + code.hex()
        return artifact

    monkeypatch.setattr(contracts, "artifact", tampered)
    with pytest.raises(AuditError, match="links library LedgerDisputes: code at .* differs"):
        verify_bytecode(w3, ledger, ledger_artifact)


def test_a_read_only_client_audits_but_cannot_send(deployment):
    from ledger.client import LedgerClient
    from ledger.errors import AccountError

    run = deployment.member_run((1,), quorum=1)
    run.commit()
    auditor = LedgerClient(deployment.w3, None, deployment.registry, deployment.ledger)
    assert auditor.last_round(run.run_id) == 0
    assert check_chain_record(auditor, auditor.history(run.run_id)).ok
    with pytest.raises(AccountError, match="read-only"):
        auditor.create_run(digest("other"), 1, 1)
