"""Both chain backends for the fraud-proof tests (issue 62: each adversary move on py-evm and on a real
anvil).

A test that takes ``chain_w3`` (tests/ledger_fixtures.py) runs once per backend. A family of cases (one move
with several values) takes ``backend`` from :func:`each_on_both` instead, and :func:`chain` for its Web3:
every case runs on py-evm, the first also on anvil by default, the others on anvil under ``slow`` (the same
code path, so the default suite pays one anvil run per family). The anvil is the session's resettable
one (``anvil_resettable``), reset to its genesis for each test.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
from web3 import Web3

from ledger.account import dev_account
from ledger.chain import connect_pyevm
from tests.ledger_fixtures import fresh_anvil_w3

BACKENDS = ("pyevm", "anvil")
GAS = 2_000_000  # per transaction of a hand-mined block (a commit of seven signatures takes ~0.4M)


def chain(request, backend: str) -> Web3:
    """A fresh py-evm chain, or a Web3 on a fresh (reset) anvil chain."""
    if backend == "pyevm":
        return connect_pyevm()
    return fresh_anvil_w3(request, timeout=60.0)


def each_on_both(cases, ids) -> list:
    """``pytest.param(backend, case)`` for every case on both backends; anvil beyond the first case slow."""
    params = []
    for index, (case, name) in enumerate(zip(cases, ids, strict=True)):
        params.append(pytest.param("pyevm", case, id=f"pyevm-{name}"))
        marks = (pytest.mark.slow,) if index else ()
        params.append(pytest.param("anvil", case, id=f"anvil-{name}", marks=marks))
    return params


def fees_since(w3: Web3, address: str, block: int) -> int:
    """What ``address`` paid in gas for its transactions mined after ``block`` (a proof and, issue 62, its
    commitment a block before it)."""
    paid = 0
    for number in range(block + 1, w3.eth.block_number + 1):
        for tx in w3.eth.get_block(number, full_transactions=True)["transactions"]:
            if tx["from"].lower() == address.lower():
                receipt = w3.eth.get_transaction_receipt(tx["hash"])
                paid += receipt["gasUsed"] * receipt["effectiveGasPrice"]
    return paid


def assert_paid(deployment, run_id: int, prover, receipt_of, *, stake: int, slashed, kept=(),
                invalid_from: int = 1):
    """``receipt_of(prover)`` overturns the run from ``invalid_from``: the prover is paid half of each slashed
    attester's ``stake``, its gas (the proof and its commitment) included, to the wei; each attester of the
    wrong round loses its whole stake and pays nothing else; the members in ``kept`` lose nothing. Returns
    what ``receipt_of`` returned. The reward is paid from the run's proof fund (issue 79: the slash is burned
    whole), which dev account 0 tops up to half the slash first where its creator left it short."""
    w3 = deployment.w3
    short = len(slashed) * stake // 2 - prover.proof_fund_of(run_id)
    if short > 0:
        deployment.client(0).fund_proofs(run_id, short)
    slashed_before = prover.slashed_total()
    accounts = {index: deployment.client(index).address for index in (*slashed, *kept)}
    balances = {index: w3.eth.get_balance(address) for index, address in accounts.items()}
    before, start = prover.balance(), w3.eth.block_number
    receipt = receipt_of(prover)
    assert prover.invalid_from(run_id) == invalid_from
    paid = fees_since(w3, prover.address, start)
    assert prover.balance() - before + paid == len(slashed) * stake // 2
    assert prover.slashed_total() - slashed_before == len(slashed) * stake  # burned whole
    for index, address in accounts.items():
        member = prover.member(run_id, address)
        if index in slashed:
            assert member.status == "slashed" and member.stake == 0, (index, member)
        else:
            assert member.status == "active" and member.stake == stake, (index, member)
        assert w3.eth.get_balance(address) == balances[index]  # no transaction of theirs, nothing paid out
    return receipt


def in_one_block(w3, sends) -> int:
    """Send ``sends`` (``(dev index, data, value)``, one per sender) unmined and mine them in one block, in
    the given order (descending tips: anvil orders a block by tip, py-evm by arrival); every one must
    succeed. Returns the block's number."""
    senders = [index for index, _, _ in sends]
    assert len(set(senders)) == len(senders), "one transaction per sender: each takes the next nonce"
    hashes = []
    with one_block(w3):
        base = w3.eth.get_block("latest")["baseFeePerGas"]
        for position, (index, data, value) in enumerate(sends):
            account = dev_account(index, w3.eth.chain_id)
            tip = (len(sends) - position) * 10**9
            tx = {"to": data[0], "data": data[1], "value": value, "gas": GAS, "chainId": w3.eth.chain_id,
                  "nonce": w3.eth.get_transaction_count(account.address), "maxPriorityFeePerGas": tip,
                  "maxFeePerGas": 2 * base + tip, "type": 2}
            hashes.append(w3.eth.send_raw_transaction(account.sign_transaction(tx).raw_transaction))
    receipts = [w3.eth.get_transaction_receipt(h) for h in hashes]
    assert [r["status"] for r in receipts] == [1] * len(sends), receipts
    assert len({r["blockNumber"] for r in receipts}) == 1, "not one block"
    assert [r["transactionIndex"] for r in receipts] == sorted(r["transactionIndex"] for r in receipts)
    return receipts[0]["blockNumber"]


def batched(w3, sends, *, per_block: int = 40, gas: int = 600_000) -> list:
    """Send ``sends`` (``(dev index, (to, data), value)``, several per sender allowed) unmined, ``per_block``
    at a time, each batch mined in one block; every one must succeed. Returns the receipts. Fills a run's
    seats in seconds where one transaction a block took minutes (tests/test_proof_at_full_seats.py). py-evm
    validates a pending transaction's nonce against the last block: there a sender's second transaction
    starts the next block."""
    tester = getattr(w3.provider, "ethereum_tester", None)
    nonces: dict[int, int] = {}
    receipts = []
    for batch_sends in _blocks(sends, per_block, one_per_sender=tester is not None):
        hashes = []
        with one_block(w3):
            base = w3.eth.get_block("latest")["baseFeePerGas"]
            for index, (to, data), value in batch_sends:
                account = dev_account(index, w3.eth.chain_id)
                if index not in nonces:
                    nonces[index] = w3.eth.get_transaction_count(account.address)
                tx = {"to": to, "data": data, "value": value, "gas": gas, "chainId": w3.eth.chain_id,
                      "nonce": nonces[index], "maxPriorityFeePerGas": 10**9, "maxFeePerGas": 4 * base + 10**9,
                      "type": 2}
                nonces[index] += 1
                hashes.append(w3.eth.send_raw_transaction(account.sign_transaction(tx).raw_transaction))
        batch = [w3.eth.get_transaction_receipt(h) for h in hashes]
        assert [r["status"] for r in batch] == [1] * len(batch), batch
        receipts.extend(batch)
    return receipts


@contextmanager
def one_block(w3):
    """Automining off while the block runs; the transactions sent meanwhile are mined in one block at its end
    (``evm_mine`` on anvil; py-evm mines the pending ones when automining comes back)."""
    tester = getattr(w3.provider, "ethereum_tester", None)
    if tester is not None:
        tester.disable_auto_mine_transactions()
    else:
        w3.provider.make_request("evm_setAutomine", [False])
    try:
        yield
        if tester is None:
            w3.provider.make_request("evm_mine", [])
    finally:
        if tester is not None:
            tester.enable_auto_mine_transactions()
        else:
            w3.provider.make_request("evm_setAutomine", [True])


def _blocks(sends, per_block: int, *, one_per_sender: bool):
    """``sends`` cut into blocks of at most ``per_block``, with ``one_per_sender``: no sender twice in one."""
    block, senders = [], set()
    for send in sends:
        if len(block) == per_block or (one_per_sender and send[0] in senders):
            yield block
            block, senders = [], set()
        block.append(send)
        senders.add(send[0])
    if block:
        yield block
