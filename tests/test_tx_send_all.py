"""``TransactionSender.send_all`` (ledger/tx.py): independent transactions sent together, as the case
defender sends its moves of several clocked games (node/live/fraud/defender.py), on an anvil whose blocks
come on a one-second timer as a real chain's do: every one is broadcast before any receipt is awaited, so
they are mined in one block; one that reverts in its preflight is not sent and comes back as its error, in
its place."""

from __future__ import annotations

from ledger.account import dev_account
from ledger.anvil import AnvilProcess
from ledger.chain import connect_rpc
from ledger.errors import LedgerError
from ledger.tx import TransactionSender
from tests.ledger_fixtures import FAST_RETRY, deploy


def test_transactions_sent_together_share_a_block_and_a_refused_one_is_named_in_its_place():
    anvil = AnvilProcess()
    try:
        w3 = connect_rpc(anvil.start(), wait=10)
        deployment = deploy(w3)  # a contract whose unknown selector reverts
        w3.provider.make_request("evm_setIntervalMining", [1])
        sender = TransactionSender(w3, dev_account(3, w3.eth.chain_id), retry=FAST_RETRY, receipt_timeout=60)
        to = [dev_account(i, w3.eth.chain_id).address for i in (4, 5, 6)]
        requests = [({"to": to[0], "value": 1, "data": b""}, "a transfer"),
                    ({"to": deployment.ledger, "value": 0, "data": bytes.fromhex("12345678")}, "a bad call"),
                    ({"to": to[1], "value": 2, "data": b""}, "another"),
                    ({"to": to[2], "value": 3, "data": b""}, "a third")]
        results = sender.send_all(requests)
        assert isinstance(results[1], LedgerError) and "a bad call" in str(results[1])
        receipts = [results[i] for i in (0, 2, 3)]
        assert all(r["status"] == 1 for r in receipts)
        assert len({r["blockNumber"] for r in receipts}) == 1
    finally:
        anvil.stop()
