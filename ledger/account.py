"""The node's Ethereum account: an encrypted keystore file, or a well-known dev key on local chains only.

A private key never appears on the command line or in a config file: the config names a keystore file
(Web3 Secret Storage JSON, as geth and eth-account write it) and a file holding its password, or the index of
a dev key. Dev keys are public knowledge, so :func:`dev_account` refuses any chain id that is not a known
local dev chain (anvil 31337, eth-tester/py-evm 131277322940537). Past the chain's ten funded dev keys,
:func:`dev_account` gives generated keys (public too, derived from the index) that a local launcher funds
with :func:`fund_accounts`, so one machine can run more than nine members.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import tempfile
from pathlib import Path

from eth_account import Account
from eth_account.signers.local import LocalAccount
from eth_utils import keccak

from ledger.chain import ANVIL_CHAIN_ID, LOCAL_CHAIN_IDS, PYEVM_CHAIN_ID
from ledger.errors import AccountError
from ledger.tx import TransactionSender

logger = logging.getLogger(__name__)

#: Environment variable that may hold the keystore password when no password file is configured.
PASSWORD_ENV = "DLX_LEDGER_PASSWORD"

# anvil's default accounts: the "test test test ... junk" mnemonic, m/44'/60'/0'/0/i. Public knowledge.
_ANVIL_DEV_KEYS = (
    "0xac0974bec39a17e36ba4a6b4d238ff944bacb478cbed5efcae784d7bf4f2ff80",
    "0x59c6995e998f97a5a0044966f0945389dc9e86dae88c7a8412f4603b6b78690d",
    "0x5de4111afa1a4b94908f83103eb1f1706367c2e68ca870fc3fb9a804cdab365a",
    "0x7c852118294e51e653712a81e05800f419141751be58f605c371e15141b007a6",
    "0x47e179ec197488593b187f80a00eb0da91f1b9d0b13f8733639f19c30a34926a",
    "0x8b3a350cf5c34c9194ca85829a2df0ec3153be0318b5e2d3348e872092edffba",
    "0x92db14e403b83dfe3df233f83dfa3a0d7096f21ca9b0d6d6b8d88b2b4ec1564e",
    "0x4bbbf85ce3377467afe5d46f804f221813b2bb87f24d81f60f1fcdbf7cbf4356",
    "0xdbda1821b80551c9d65939329250298aa3472ba22feea921c0cf5d620ea67b97",
    "0x2a871d0798f97d79848a013d4936a73bf4cc922c825d33c1cf7073dff6d409c6",
)
#: Number of dev accounts each local chain funds at genesis.
DEV_ACCOUNT_COUNT = len(_ANVIL_DEV_KEYS)
#: Dev account indexes go up to this (exclusive); those past DEV_ACCOUNT_COUNT start without funds.
DEV_ACCOUNT_LIMIT = 1024
# Generated dev keys: keccak256(label || index), public knowledge like the chains' own dev keys.
_GENERATED_KEY_LABEL = b"dlx-node generated dev account"


def dev_account(index: int, chain_id: int) -> LocalAccount:
    """The dev account ``index`` (0-1023) of a local dev chain.

    Indexes 0-9 are the chain's funded accounts: on anvil its default mnemonic accounts, on py-evm
    eth-tester's (private keys 1..10). Indexes from 10 on are generated keys, the same on both chains,
    that hold nothing until funded (:func:`fund_accounts`; the local launcher does it).

    Raises:
        AccountError: ``chain_id`` is not a local dev chain, or ``index`` is out of range.
    """
    if chain_id not in LOCAL_CHAIN_IDS:
        raise AccountError(
            f"dev account {index} refused on chain id {chain_id}: dev keys are public, only local dev chains "
            f"{sorted(LOCAL_CHAIN_IDS)} accept them; use ledger.keystore with ledger.password_file"
        )
    if not 0 <= index < DEV_ACCOUNT_LIMIT:
        raise AccountError(f"ledger.dev_account={index}: must be in 0..{DEV_ACCOUNT_LIMIT - 1}")
    if index >= DEV_ACCOUNT_COUNT:
        return Account.from_key(keccak(_GENERATED_KEY_LABEL + index.to_bytes(4, "big")))
    if chain_id == ANVIL_CHAIN_ID:
        return Account.from_key(_ANVIL_DEV_KEYS[index])
    assert chain_id == PYEVM_CHAIN_ID
    return Account.from_key((index + 1).to_bytes(32, "big"))


def fund_accounts(w3, funder: LocalAccount, addresses: list[str], wei: int) -> list[str]:
    """Top up each of ``addresses`` to at least ``wei`` with a plain transfer from ``funder``.

    An account already holding ``wei`` gets nothing (a relaunch on a kept chain sends no second
    transfer). Returns the addresses that were sent funds.

    Raises:
        LedgerError: (a subclass) the transfer is refused (e.g. ``funder`` lacks the funds) or not mined.
    """
    sender = TransactionSender(w3, funder)
    funded = []
    for address in addresses:
        balance = sender.rpc(lambda address=address: w3.eth.get_balance(address), "eth_getBalance")
        if balance >= wei:
            continue
        sender.send({"to": address, "value": wei - balance}, f"fund {address}")
        funded.append(address)
    return funded


def read_password_file(path: str | os.PathLike) -> str:
    """The password stored in ``path`` (one trailing newline stripped).

    Raises:
        AccountError: The file is missing, unreadable or empty.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise AccountError(f"ledger.password_file={str(path)!r}: cannot read it: {exc}") from exc
    password = text.removesuffix("\n")
    if not password:
        raise AccountError(f"ledger.password_file={str(path)!r}: file is empty")
    mode = Path(path).stat().st_mode
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        logger.warning("password file %s is readable by other users: chmod 600 it", path)
    return password


def create_keystore(
    path: str | os.PathLike, password: str, *, kdf: str = "scrypt", iterations: int | None = None
) -> LocalAccount:
    """Create a new random account and write it encrypted to ``path`` (mode 0600, atomically).

    Args:
        path: Keystore file to create; must not exist.
        password: Encryption password (non-empty).
        kdf: ``scrypt`` (default, as geth) or ``pbkdf2``.
        iterations: KDF work factor; None for eth-account's default (lower it only in tests).

    Raises:
        AccountError: ``path`` exists, the password is empty, or the file cannot be written.
    """
    target = Path(path)
    if target.exists():
        raise AccountError(f"keystore {target} already exists: refusing to overwrite an account")
    if not password:
        raise AccountError("keystore password is empty")
    account = Account.create()
    keystore = Account.encrypt(account.key, password, kdf=kdf, iterations=iterations)
    target.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            json.dump(keystore, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temporary, 0o600)
        os.replace(temporary, target)
    except OSError as exc:
        Path(temporary).unlink(missing_ok=True)
        raise AccountError(f"cannot write keystore {target}: {exc}") from exc
    logger.info("created account %s in keystore %s", account.address, target)
    return account


def load_keystore(path: str | os.PathLike, password: str) -> LocalAccount:
    """Decrypt the keystore file ``path``.

    Raises:
        AccountError: Missing or malformed file, or wrong password.
    """
    try:
        keystore = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise AccountError(f"ledger.keystore={str(path)!r}: cannot read keystore JSON: {exc}") from exc
    try:
        key = Account.decrypt(keystore, password)
    except ValueError as exc:
        raise AccountError(f"ledger.keystore={str(path)!r}: cannot decrypt ({exc}); wrong password?") from exc
    except (KeyError, TypeError) as exc:
        raise AccountError(f"ledger.keystore={str(path)!r}: not a keystore file ({exc!r})") from exc
    return Account.from_key(key)


def load_account(config, chain_id: int) -> LocalAccount:
    """The account a :class:`ledger.config.LedgerConfig` names, for the chain ``chain_id``.

    ``config.keystore`` is decrypted with the password from ``config.password_file`` (or the
    ``DLX_LEDGER_PASSWORD`` environment variable); otherwise ``config.dev_account`` (local chains only).

    Raises:
        AccountError: Neither is configured, or loading fails.
    """
    if config.keystore:
        if config.password_file:
            password = read_password_file(config.password_file)
        elif os.environ.get(PASSWORD_ENV):
            password = os.environ[PASSWORD_ENV]
        else:
            raise AccountError(
                f"ledger.keystore={config.keystore!r} needs ledger.password_file (or ${PASSWORD_ENV})"
            )
        return load_keystore(config.keystore, password)
    if config.dev_account >= 0:
        return dev_account(config.dev_account, chain_id)
    raise AccountError("no ledger account: set ledger.keystore + ledger.password_file, or ledger.dev_account")
