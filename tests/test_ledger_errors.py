"""Revert decoding: every custom error of the contracts maps to a Python class, on both backends."""

from __future__ import annotations

import pytest
import requests
from eth_abi import encode
from eth_utils import keccak, to_checksum_address
from ledger_fixtures import FAST_RETRY, digest

import contracts
from ledger import errors
from ledger.account import dev_account
from ledger.client import LedgerClient
from ledger.runparams import RunParams
from ledger.reverts import ERROR_SELECTORS, decode_revert, revert_from_data
from ledger.tx import TransactionSender


def test_every_contract_error_has_a_python_class():
    names = {
        entry["name"]
        for name in contracts.NAMES
        for entry in contracts.artifact(name)["abi"]
        if entry["type"] == "error"
    }
    assert names == set(errors.REVERT_CLASSES)
    assert {name for name, _, _ in ERROR_SELECTORS.values()} == names
    for name, cls in errors.REVERT_CLASSES.items():
        base = next(
            (base for prefix, base in (("Registry", errors.RegistryError), ("Prover", errors.ProverError),
                                  ("Reward", errors.RewardError))
             if name.startswith(prefix)), errors.LedgerRevert)
        assert issubclass(cls, base), name


def test_revert_data_decoding():
    data = keccak(text="LedgerRoundNotNext(uint64,uint64)")[:4] + encode(["uint64", "uint64"], [7, 3])
    revert = revert_from_data(data, "commit")
    assert isinstance(revert, errors.LedgerRoundNotNext)
    assert revert.values == {"expected": 7, "got": 3} and revert.data == data
    assert "LedgerRoundNotNext(expected=7, got=3)" in str(revert)
    signer = "0x" + "ab" * 20
    data = keccak(text="LedgerSignerNotMember(uint256,address)")[:4] + encode(["uint256", "address"],
                                                                              [1, signer])
    assert revert_from_data(data, "commit").values["signer"] == to_checksum_address(signer)
    reason = revert_from_data(bytes.fromhex("08c379a0") + encode(["string"], ["no"]), "x")
    assert type(reason) is errors.UnknownRevert and reason.values == {"reason": "no"}
    panic = revert_from_data(bytes.fromhex("4e487b71") + encode(["uint256"], [0x11]), "x")
    assert panic.values == {"code": 0x11}
    assert type(revert_from_data(b"\xde\xad\xbe\xef", "x")) is errors.UnknownRevert
    truncated = revert_from_data(data[:10], "x")
    assert type(truncated) is errors.UnknownRevert and "malformed" in str(truncated)
    assert decode_revert(ValueError("not a revert"), "x") is None


class NoPreflightSender(TransactionSender):
    """Fault injection: skips the estimate, so a reverting transaction is mined (as after a lost race)."""

    def _gas_limit(self, request: dict, what: str) -> int:
        return 300_000


def test_a_mined_revert_is_decoded(deployment):
    run = deployment.member_run((1,), quorum=1)
    client = run.client(1)
    run.commit()
    sender = NoPreflightSender(deployment.w3, dev_account(1, deployment.w3.eth.chain_id))
    stale = run.next_record()
    stale = stale.__class__(**{**stale.__dict__, "round": 0})
    args = (stale.fields(), client.sign_record(stale))
    with pytest.raises(errors.LedgerRoundNotNext, match="block") as raised:
        sender.transact(client.ledger_contract, "commitRound", args)
    assert raised.value.values == {"expected": 1, "got": 0}
    assert client.commit_count(run.run_id) == 1


def test_wrong_addresses_and_unfunded_accounts_give_ledger_errors(deployment):
    from eth_account import Account

    w3 = deployment.w3
    stranger = LedgerClient(w3, dev_account(1, w3.eth.chain_id), "0x" + "11" * 20, "0x" + "22" * 20)
    with pytest.raises(errors.DeploymentMismatch, match="no NodeRegistry"):
        stranger.check_deployment()
    with pytest.raises(errors.DeploymentMismatch):
        stranger.last_round(1)
    swapped = LedgerClient(w3, dev_account(1, w3.eth.chain_id), deployment.ledger, deployment.registry)
    with pytest.raises(errors.LedgerError):
        swapped.check_deployment()
    deployment.client(1).check_deployment()

    unfunded = LedgerClient(w3, Account.create(), deployment.registry, deployment.ledger)
    with pytest.raises(errors.RpcRejected):
        unfunded.create_run(digest("config"), 1, 1)


class DroppedResponseSender(TransactionSender):
    """Fault injection: the first send reaches the node but its answer is lost (connection dropped)."""

    dropped = 0

    def _send_raw(self, raw_transaction: bytes) -> None:
        super()._send_raw(raw_transaction)
        if not self.dropped:
            self.dropped += 1
            raise requests.exceptions.ConnectionError("connection reset after send (injected)")


class StaleNonceSender(TransactionSender):
    """Fault injection: another sender of the same account takes the nonce between read and send."""

    stale = 0

    def _pending_nonce(self, address: str) -> int:
        nonce = super()._pending_nonce(address)
        if not self.stale and nonce > 0:
            self.stale += 1
            return nonce - 1
        return nonce


@pytest.mark.parametrize("sender_class", [DroppedResponseSender, StaleNonceSender])
def test_resent_and_raced_nonces_end_in_one_transaction(deployment, sender_class):
    w3 = deployment.w3
    client = deployment.client(1)
    client.create_run(digest("first"), 1, 1)  # the account has used a nonce
    sender = sender_class(w3, client.account, retry=FAST_RETRY)
    nonce_before = w3.eth.get_transaction_count(client.address)
    params = RunParams(digest("second"), 1, 1)
    receipt = sender.transact(client.ledger_contract, "createRun", (params.fields(), ""))
    assert receipt["status"] == 1
    assert w3.eth.get_transaction_count(client.address) == nonce_before + 1
    assert client.run_count() == 2
    assert (sender.dropped if sender_class is DroppedResponseSender else sender.stale) == 1
