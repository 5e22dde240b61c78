"""Fixtures for the ledger tests: a session-wide real anvil, and fresh deployments on py-evm or anvil.

Loaded from tests/conftest.py via ``pytest_plugins``. ``chain_w3`` is parametrized over both backends, so a
test that uses ``deployment`` runs once on py-evm and once on a real anvil node.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from dataclasses import dataclass, field

import pytest
import requests
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from eth.constants import BLANK_ROOT_HASH
from web3 import HTTPProvider, Web3

import contracts
from ledger.account import dev_account
from ledger.chain import RetryPolicy, connect_pyevm, connect_rpc, estimate_gas_from_use
from ledger.anvil import AnvilProcess
from ledger.client import LedgerClient
from ledger.records import ZERO_HASH, RoundRecord

FAST_RETRY = RetryPolicy(total_seconds=2.0, initial_delay=0.1, max_delay=0.5)


def digest(label: str) -> bytes:
    """sha256 of a label: a stand-in 32-byte hash or root."""
    return hashlib.sha256(label.encode()).digest()


def make_record(
    run_id: int,
    round: int,
    prev_head: bytes,
    label: str = "",
    contributors: int = 4,
    checkpoint_hash: bytes = ZERO_HASH,
) -> RoundRecord:
    """A distinct, deterministic RoundRecord for ``round`` on top of ``prev_head`` (``label`` varies its
    roots)."""
    return RoundRecord(
        run_id=run_id,
        round=round,
        prev_head=prev_head,
        weights_root=digest(f"w{round}{label}"),
        contributions_root=digest(f"c{round}{label}"),
        train_loss_micro=3_500_000 - round,
        eval_loss_micro=3_600_000 - round,
        tokens=4096 * (round + 1),
        num_contributors=contributors,
        checkpoint_hash=checkpoint_hash,
    )


#: Blocks per ``anvil_mine`` request, and how long one may take: mining the thousands of blocks of an
#: unbonding period in one request took longer than the client's 10 s read timeout at a load of 26 on
#: 2 cores (tests/test_ledger_members.py's anvil cases failed so); a slow machine makes it slower only.
MINE_CHUNK_BLOCKS = 1000
MINE_REQUEST_TIMEOUT_S = 300.0

#: ``create_run`` keywords for the shortest unbonding a run may have: both windows at their floor (8 blocks)
#: and one game step, an unbonding of 8 + 4 x 8 = 40 blocks (LedgerCore.proofWindowBound) instead of the
#: defaults' 64 + 50 x 64 = 3,264. For tests that mine a whole unbonding period for a property that does not
#: depend on its length: py-evm mines about 100 empty blocks a second on this project's 2-core machine.
SHORT_WINDOWS = {"accusation_blocks": 8, "dispute_blocks": 8, "max_game_steps": 1}


def deploy_library(w3: Web3, name: str):
    """Library ``name`` deployed on its own (its functions called directly), after the library it links, if
    any (``contracts.MATH_LIBRARIES``: StepProverMath links Float64Functions): a web3 contract there."""
    linked = {}
    for needed in contracts.linked_libraries(contracts.artifact(name)):
        linked[needed] = deploy_library(w3, needed).address
    artifact = contracts.artifact(name)
    factory = w3.eth.contract(abi=artifact["abi"], bytecode=contracts.link(artifact, linked))
    tx = factory.constructor().transact({"from": w3.eth.accounts[0]})
    receipt = w3.eth.wait_for_transaction_receipt(tx)
    return w3.eth.contract(address=receipt["contractAddress"], abi=artifact["abi"])


def mine(w3: Web3, blocks: int) -> None:
    """Advance the chain ``blocks`` empty blocks (``anvil_mine`` on anvil, ``evm_mine`` on py-evm)."""
    before = w3.eth.block_number
    if isinstance(w3.provider, HTTPProvider):
        left = blocks
        while left > 0:
            chunk = min(left, MINE_CHUNK_BLOCKS)
            reply = requests.post(w3.provider.endpoint_uri, timeout=MINE_REQUEST_TIMEOUT_S, json={
                "jsonrpc": "2.0", "id": 1, "method": "anvil_mine", "params": [hex(chunk)]})
            reply.raise_for_status()
            assert "error" not in reply.json(), reply.json()
            left -= chunk
    else:
        w3.testing.mine(blocks)
    assert w3.eth.block_number == before + blocks


@contextlib.contextmanager
def mining_meanwhile(w3: Web3, every: float = 0.5):
    """A block every ``every`` seconds while the ``with`` body runs (anvil mines only on a transaction)."""
    stop = threading.Event()

    def run():
        while not stop.wait(every):
            w3.provider.make_request("evm_mine", [])

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@pytest.fixture(scope="session")
def anvil_session():
    """One real anvil for the whole test session (each test deploys its own contracts on it)."""
    anvil = AnvilProcess()
    anvil.start()
    yield anvil
    anvil.stop()


@pytest.fixture(scope="session")
def anvil_resettable():
    """A second session anvil, handed out only by :func:`fresh_anvil_w3`, which resets it to its genesis
    for each test: no fixture keeps contracts on it across tests."""
    anvil = AnvilProcess()
    anvil.start()
    yield anvil
    anvil.stop()


def fresh_anvil_w3(request, timeout: float) -> Web3:
    """A Web3 on the session's resettable anvil, reset to block 0 (``anvil_reset``) for this test.

    anvil's cost per mined block grows with the chain's length (1,000 blocks: 1.4 s at block 0, 48 s past
    block 7,000 on this project's loaded 2-core machine): on a chain that every earlier test of the session
    had lengthened, a test that mined an unbonding period waited minutes for it. The reset takes
    milliseconds; the dev accounts are funded again as at genesis."""
    w3 = connect_rpc(request.getfixturevalue("anvil_resettable").url, timeout=timeout)
    # Its chain id is read once (web3's request cache, eth_chainId alone): web3 asks it before each call,
    # estimate and transaction, a round trip each (a quarter of a commit's wall time at a load of 12).
    w3.provider.cache_allowed_requests = True
    w3.provider.cacheable_requests = {"eth_chainId"}
    reply = w3.provider.make_request("anvil_reset", [])
    assert "error" not in reply, reply
    assert w3.eth.block_number == 0
    return w3


@pytest.fixture(params=["pyevm", "anvil"])
def chain_w3(request) -> Web3:
    """A Web3 on a fresh py-evm chain, or on a fresh (reset) anvil chain."""
    if request.param == "pyevm":
        return connect_pyevm()
    return fresh_anvil_w3(request, timeout=10.0)


def node_key(seed: int) -> Ed25519PrivateKey:
    """A deterministic ed25519 node key for tests."""
    return Ed25519PrivateKey.from_private_bytes(seed.to_bytes(32, "big"))


def raw_public_key(key: Ed25519PrivateKey) -> bytes:
    """The raw 32-byte public key."""
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


@dataclass
class Deployment:
    """Contracts freshly deployed by dev account 0, with a client per dev account on demand."""

    w3: Web3
    registry: str
    ledger: str
    min_stake: int = 0
    _clients: dict[int, LedgerClient] = field(default_factory=dict)
    #: (:func:`_genesis_key`, the block its deployment ended at): made by :func:`deploy` on a genesis chain
    kept_as: tuple | None = None

    def client(self, index: int, **kwargs) -> LedgerClient:
        """A LedgerClient acting as dev account ``index`` (cached when no options are given)."""
        if kwargs:
            return self._new_client(index, **kwargs)
        if index not in self._clients:
            self._clients[index] = self._new_client(index)
        return self._clients[index]

    def _new_client(self, index: int, **kwargs) -> LedgerClient:
        kwargs.setdefault("retry", FAST_RETRY)
        account = dev_account(index, self.w3.eth.chain_id)
        return LedgerClient(self.w3, account, self.registry, self.ledger, **kwargs)

    def register(self, index: int, seed: int | None = None) -> LedgerClient:
        """Register dev account ``index`` with a valid binding signature of node key ``seed`` (default
        index+1)."""
        client = self.client(index)
        key = node_key(index + 1 if seed is None else seed)
        client.register(raw_public_key(key), key.sign(client.my_binding_message()), stake=self.min_stake)
        return client

    def member_run(
        self,
        members: tuple[int, ...] = (1, 2, 3, 4),
        quorum: int = 3,
        *,
        min_stake: int = 0,
        unbonding_blocks: int | None = None,
        max_rounds: int = 0,
        label: str = "config",
        config_hash: bytes | None = None,
        inner_steps: int = 50,
        **params,
    ) -> MemberRun:
        """A new run (created by the first member) that dev accounts ``members`` registered for and joined.

        ``params``: further ``create_run`` keywords (quorum_bps, bond, accusation_blocks, dispute_blocks,
        inactivity_rounds, tenure_rounds); ``unbonding_blocks=None`` is the contract's floor. The quorum is
        k alone (quorum_bps 0) unless given, and weak runs are allowed: these runs test the mechanics; the
        model's defaults are tested by tests/test_trust_model.py.
        """
        params.setdefault("quorum_bps", 0)
        params.setdefault("allow_weak_quorum", True)
        args = (tuple(members), quorum, min_stake, unbonding_blocks, max_rounds, config_hash or digest(label),
                inner_steps, sorted(params.items()))
        key = self._kept_key(args)
        if key in _MEMBER_RUNS:
            saved, run_id = _MEMBER_RUNS[key]
            _load_chain(self.w3, saved)
            return MemberRun(self, run_id, tuple(members), quorum)
        for index in members:
            if not self.client(index).is_registered():
                self.register(index)
        run_id = self.client(members[0]).create_run(
            config_hash or digest(label),
            2,
            inner_steps,
            "file:///run.toml",
            min_stake=min_stake,
            quorum=quorum,
            unbonding_blocks=unbonding_blocks,
            max_rounds=max_rounds,
            **params,
        )
        for index in members:
            self.client(index).join_run(run_id)
        if key is not None:
            _MEMBER_RUNS[key] = (_saved_chain(self.w3), run_id)
        return MemberRun(self, run_id, tuple(members), quorum)

    def _kept_key(self, args: tuple) -> tuple | None:
        """What :meth:`member_run` with ``args`` on this deployment is kept under (:data:`_MEMBER_RUNS`), or
        None: a deployment not kept by :func:`deploy`, a chain a transaction moved on since (its block), an
        argument not plain data (its repr might not tell it apart)."""
        if self.kept_as is None or not _plain(args) or self.w3.eth.block_number != self.kept_as[1]:
            return None
        return (self.kept_as, repr(args))


@dataclass
class MemberRun:
    """A run with members: builds the next record, signs it with chosen members, commits it."""

    deployment: Deployment
    run_id: int
    members: tuple[int, ...]
    quorum: int

    def client(self, index: int) -> LedgerClient:
        return self.deployment.client(index)

    @property
    def reader(self) -> LedgerClient:
        return self.client(self.members[0])

    def next_record(self, label: str = "", **kwargs) -> RoundRecord:
        """The record of the run's next round on top of its current head."""
        reader = self.reader
        return make_record(
            self.run_id, reader.commit_count(self.run_id), reader.head_of(self.run_id), label, **kwargs
        )

    def sign(self, record: RoundRecord, signers: tuple[int, ...] | None = None) -> list[bytes]:
        """Signatures of ``record`` by dev accounts ``signers`` (default: the first ``quorum`` members)."""
        if signers is None:
            signers = self.members[: self.quorum]
        return [self.client(index).sign_record(record) for index in signers]

    def commit(self, label: str = "", signers: tuple[int, ...] | None = None, submitter: int | None = None,
               **kwargs) -> tuple[RoundRecord, str]:
        """Commit the next round signed by ``signers``, sent by ``submitter`` (default: the first member)."""
        record = self.next_record(label, **kwargs)
        tx = self.client(self.members[0] if submitter is None else submitter).commit_round(
            record, self.sign(record, signers)
        )
        return record, tx


def deploy(w3: Web3, min_stake: int = 0) -> Deployment:
    """Deploy a fresh NodeRegistry + TrainingLedger from dev account 0.

    On a chain still at its genesis block (a fresh py-evm chain, the reset session anvil), the first
    deployment of each ``min_stake`` in this process is made by :meth:`LedgerClient.deploy` and its chain
    kept; later ones load that chain (:data:`_DEPLOYED`): the same blocks, contracts, addresses and
    balances as a deployment of their own, without its 11 transactions (issue 80 point 10: 0.3 CPU s on
    py-evm, 0.6-1 s of waiting on anvil, per test that deploys)."""
    key = _genesis_key(w3, min_stake)
    if key in _DEPLOYED:
        saved, registry, ledger = _DEPLOYED[key]
        _load_chain(w3, saved)
        assert w3.eth.get_code(ledger), "the loaded chain holds no ledger"
    else:
        registry, ledger = LedgerClient.deploy(w3, dev_account(0, w3.eth.chain_id), min_stake,
                                               retry=FAST_RETRY)
        if key is not None:
            _DEPLOYED[key] = (_saved_chain(w3), registry, ledger)
    kept_as = None if key is None else (key, w3.eth.block_number)
    return Deployment(w3, registry, ledger, min_stake, kept_as=kept_as)


#: The chain after :func:`deploy`'s first deployment on a genesis chain, by :func:`_genesis_key`: py-evm's
#: database (a copy of its key-value store) or anvil's ``anvil_dumpState``; the registry and the ledger.
_DEPLOYED: dict[tuple, tuple[object, str, str]] = {}
_COMMITTED_ARTIFACT = contracts.artifact


#: The chain after :meth:`Deployment.member_run` on a deployment :func:`deploy` had just made, by
#: :meth:`Deployment._kept_key`: the chain (:func:`_saved_chain`) and the run's id. A test whose run has the
#: same members and parameters as an earlier one's starts from that run's chain (9 transactions fewer).
_MEMBER_RUNS: dict[tuple, tuple[object, int]] = {}


def _plain(value) -> bool:
    """Whether ``value`` is plain data (numbers, strings, bytes, None and tuples, lists and dicts of them)."""
    if value is None or isinstance(value, (bool, int, str, bytes)):
        return True
    if isinstance(value, (tuple, list)):
        return all(_plain(item) for item in value)
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return False


def _genesis_key(w3: Web3, min_stake: int) -> tuple | None:
    """What a deployment on ``w3`` is kept under, or None: a chain past its genesis block (a test's earlier
    transactions on it), a py-evm chain with pending transactions or a gas estimator of the test's
    (tests/test_pyevm_gas.py counts the deployment's estimates), or a provider other than py-evm and HTTP.
    An anvil is told by its URL and its genesis block's settings (gas limit, base fee: another anvil's
    command line)."""
    if w3.eth.block_number != 0 or contracts.artifact is not _COMMITTED_ARTIFACT:  # a test's own contracts
        return None
    tester = getattr(w3.provider, "ethereum_tester", None)
    if tester is not None:
        chain = tester.backend.chain
        if (chain.header.transaction_root != BLANK_ROOT_HASH
                or chain.gas_estimator is not estimate_gas_from_use):
            return None  # pending transactions, or a test's own estimator that must see the deployment
        return ("pyevm", w3.eth.chain_id, min_stake)
    if not isinstance(w3.provider, HTTPProvider):
        return None
    genesis = w3.eth.get_block(0)
    return ("anvil", w3.provider.endpoint_uri, w3.eth.chain_id, genesis["gasLimit"],
            genesis.get("baseFeePerGas"), min_stake)


def _saved_chain(w3: Web3) -> object:
    tester = getattr(w3.provider, "ethereum_tester", None)
    if tester is not None:
        return dict(tester.backend.chain.chaindb.db.wrapped_db.kv_store)
    reply = w3.provider.make_request("anvil_dumpState", [])
    assert "error" not in reply, reply
    return reply["result"]


def _load_chain(w3: Web3, saved: object) -> None:
    """``w3``'s chain (at its genesis) replaced by ``saved`` (:func:`_saved_chain`): py-evm's chain object
    rebuilt on a copy of the saved database, keeping its class and gas estimator (ledger.chain.connect_pyevm);
    anvil's through ``anvil_loadState``, which restores the blocks too."""
    tester = getattr(w3.provider, "ethereum_tester", None)
    if tester is not None:
        from eth.db.atomic import AtomicDB
        from eth.db.backends.memory import MemoryDB

        old = tester.backend.chain
        chain = type(old)(AtomicDB(MemoryDB(dict(saved))))
        chain.gas_estimator = old.gas_estimator
        tester.backend.chain = chain
        return
    reply = w3.provider.make_request("anvil_loadState", [saved])
    assert reply.get("result") is True, reply


@pytest.fixture
def deployment(chain_w3) -> Deployment:
    """A fresh deployment without stake on the parametrized chain."""
    return deploy(chain_w3)
