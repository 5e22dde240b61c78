"""tests/pyevm_logs.py: the fuzzers' index of a py-evm chain's logs answers every query as eth-tester does."""

from __future__ import annotations

from dataclasses import replace

from ledger.chain import connect_pyevm
from ledger.events import topic_uint
from tests.ledger_fixtures import deploy, digest, mine
from tests.pyevm_logs import index_logs

STAKE, BOND = 10**15, 10**14


def test_the_log_index_answers_as_eth_tester_and_reads_each_block_once():
    deployment = deploy(connect_pyevm())
    w3 = deployment.w3
    run = deployment.member_run((1, 2, 3), quorum=2, min_stake=STAKE, bond=BOND)
    committed, _ = run.commit(signers=(1, 2))
    mine(w3, 5)
    disputer = run.client(3)
    mine_ = replace(committed, checkpoint_hash=digest("mine"))
    disputer.dispute(mine_, disputer.sign_record(mine_))
    reader = run.client(1)
    plain_history = reader.history(run.run_id)
    head = w3.eth.block_number
    ours, other = topic_uint(run.run_id), topic_uint(run.run_id + 1)
    queries = [{"fromBlock": 0, "toBlock": head},
               {"address": deployment.ledger, "fromBlock": 0, "toBlock": "latest"},
               {"address": [deployment.ledger], "fromBlock": 3, "toBlock": head - 1,
                "topics": [None, ours]},
               {"address": deployment.ledger, "fromBlock": 0, "toBlock": head,
                "topics": [None, [ours, other]]},
               {"address": deployment.ledger, "fromBlock": 0, "toBlock": head, "topics": [None, other]},
               {"address": deployment.registry, "fromBlock": head, "toBlock": head}]
    plain = [w3.eth.get_logs(query) for query in queries]
    assert plain[2] and plain[3] and not plain[4] and len(plain[1]) < len(plain[0])  # the filters bite
    index = index_logs(w3)
    assert [w3.eth.get_logs(query) for query in queries] == plain
    assert index.blocks_read == head + 1  # the first query read every block; the others none
    indexed_history = reader.history(run.run_id)
    assert replace(indexed_history, block_number=0) == replace(plain_history, block_number=0)
    mine(w3, 3)
    run.commit(signers=(1, 2))  # new blocks: read once, on the next query
    assert reader.history(run.run_id).commits[-1].commit.round == 1
    assert index.blocks_read == w3.eth.block_number + 1
