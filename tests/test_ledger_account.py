"""The node's Ethereum account: dev keys on local chains only, encrypted keystores, config loading."""

from __future__ import annotations

import os
import stat

import pytest

from ledger.account import (
    DEV_ACCOUNT_COUNT,
    DEV_ACCOUNT_LIMIT,
    create_keystore,
    dev_account,
    fund_accounts,
    load_account,
    load_keystore,
)
from ledger.chain import ANVIL_CHAIN_ID, PYEVM_CHAIN_ID, connect_pyevm, connect_rpc
from ledger.config import LedgerConfig
from ledger.errors import AccountError


def test_dev_accounts_are_the_chains_funded_accounts(anvil_session):
    for w3 in (connect_pyevm(), connect_rpc(anvil_session.url)):
        chain_id = w3.eth.chain_id
        assert chain_id in (ANVIL_CHAIN_ID, PYEVM_CHAIN_ID)
        expected = w3.eth.accounts[:DEV_ACCOUNT_COUNT]
        assert [dev_account(i, chain_id).address for i in range(DEV_ACCOUNT_COUNT)] == expected


def test_dev_accounts_are_refused_on_other_chains():
    for chain_id in (1, 11155111, 8453):
        with pytest.raises(AccountError, match="refused"):
            dev_account(0, chain_id)
    with pytest.raises(AccountError, match="refused"):
        dev_account(DEV_ACCOUNT_COUNT, 1)
    with pytest.raises(AccountError, match=f"dev_account={DEV_ACCOUNT_LIMIT}"):
        dev_account(DEV_ACCOUNT_LIMIT, ANVIL_CHAIN_ID)
    with pytest.raises(AccountError, match="dev_account=-1"):
        dev_account(-1, ANVIL_CHAIN_ID)


def test_generated_dev_accounts_are_distinct_unfunded_and_funded_once():
    w3 = connect_pyevm()
    chain_id = w3.eth.chain_id
    generated = [dev_account(i, chain_id).address for i in range(DEV_ACCOUNT_COUNT, DEV_ACCOUNT_COUNT + 6)]
    funded_at_genesis = set(w3.eth.accounts)
    assert len(set(generated)) == 6 and not funded_at_genesis & set(generated)
    # The same keys on both local chains: a run's accounts do not depend on its backend.
    assert generated[0] == dev_account(DEV_ACCOUNT_COUNT, ANVIL_CHAIN_ID).address
    assert all(w3.eth.get_balance(a) == 0 for a in generated)
    funder = dev_account(0, chain_id)
    w3_balance = w3.eth.get_balance(funder.address)
    assert fund_accounts(w3, funder, generated, 10**18) == generated
    assert all(w3.eth.get_balance(a) == 10**18 for a in generated)
    assert w3.eth.get_balance(funder.address) < w3_balance - 6 * 10**18
    assert fund_accounts(w3, funder, generated, 10**18) == []  # already funded: nothing sent
    assert fund_accounts(w3, funder, generated[:1], 3 * 10**18) == generated[:1]  # topped up to the amount
    assert w3.eth.get_balance(generated[0]) == 3 * 10**18


def test_keystore_round_trip(tmp_path):
    path = tmp_path / "keys" / "node.json"
    account = create_keystore(path, "correct horse", kdf="pbkdf2", iterations=2)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert account.key.hex() not in path.read_text()
    assert load_keystore(path, "correct horse").address == account.address
    with pytest.raises(AccountError, match="wrong password"):
        load_keystore(path, "wrong")
    with pytest.raises(AccountError, match="already exists"):
        create_keystore(path, "x", kdf="pbkdf2", iterations=2)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(AccountError, match="JSON"):
        load_keystore(tmp_path / "bad.json", "x")


def test_load_account_from_config(tmp_path, monkeypatch):
    path = tmp_path / "node.json"
    account = create_keystore(path, "secret", kdf="pbkdf2", iterations=2)
    password_file = tmp_path / "password"
    password_file.write_text("secret\n")
    password_file.chmod(0o600)
    config = LedgerConfig(backend="pyevm", keystore=str(path), password_file=str(password_file))
    assert load_account(config, 1).address == account.address  # a keystore works on any chain

    monkeypatch.setenv("DLX_LEDGER_PASSWORD", "secret")
    assert load_account(LedgerConfig(backend="pyevm", keystore=str(path)), 1).address == account.address
    monkeypatch.delenv("DLX_LEDGER_PASSWORD")
    with pytest.raises(AccountError, match="password_file"):
        load_account(LedgerConfig(backend="pyevm", keystore=str(path)), 1)

    assert load_account(LedgerConfig(backend="pyevm", dev_account=2), PYEVM_CHAIN_ID) == dev_account(
        2, PYEVM_CHAIN_ID
    )
    with pytest.raises(AccountError, match="refused"):
        load_account(LedgerConfig(backend="pyevm", dev_account=2), 1)
    with pytest.raises(AccountError, match="no ledger account"):
        load_account(LedgerConfig(backend="pyevm"), PYEVM_CHAIN_ID)


def test_client_from_config_uses_its_settings():
    from ledger.client import LedgerClient
    from ledger.errors import LedgerInputError

    w3 = connect_pyevm()
    config = LedgerConfig(
        backend="pyevm",
        registry_address="0x" + "11" * 20,
        ledger_address="0x" + "22" * 20,
        retry_seconds=3.0,
        receipt_timeout=7.0,
        from_block=5,
        log_page_blocks=50,
    )
    client = LedgerClient.from_config(w3, dev_account(0, PYEVM_CHAIN_ID), config)
    assert (client.from_block, client.log_page_blocks) == (5, 50)
    assert client.sender.retry.total_seconds == 3.0 and client.sender.receipt_timeout == 7.0
    with pytest.raises(LedgerInputError, match="registry_address"):
        LedgerClient.from_config(w3, dev_account(0, PYEVM_CHAIN_ID), LedgerConfig(backend="pyevm"))
