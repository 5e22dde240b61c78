"""Which reward pools a run has, from the chain alone (issue 77; docs/REWARDS.md "A running node's sources").

A run's pool lives in a RewardPool contract beside its ledger that the ledger does not know (it is one
contract of its own, deployed by whoever), so a node that joined from a run link, which names only the
ledger, finds it by its ``PoolCreated(runId, ...)`` events: the logs of that topic and run id from any
address. Anyone can emit such a log, so an emitter counts only where its code is the committed RewardPool
build (immutables masked, :func:`ledger.bytecode.bytecode_problem`), it reads this run's ledger and holds a
pool for the run (``createPool`` is taken only from the run's creator, once per run and contract).
:class:`PoolFinder` scans the blocks once each, from the run's creation on.
"""

from __future__ import annotations

import logging

from eth_utils import to_checksum_address
from web3 import Web3

import contracts
from ledger.bytecode import bytecode_problem
from ledger.events import EventDecoder, topic_uint

logger = logging.getLogger(__name__)


class PoolFinder:
    """The RewardPools holding a pool of run ``run_id`` of the TrainingLedger ``ledger_address`` on ``w3``,
    found by their ``PoolCreated`` events from block ``from_block`` on (``page_blocks`` a request; ``rpc``:
    runs each request with retries, e.g. ``TransactionSender.rpc``)."""

    def __init__(self, w3: Web3, ledger_address: str, run_id: int, from_block: int, page_blocks: int, rpc):
        self.w3, self.ledger, self.run_id = w3, to_checksum_address(ledger_address), run_id
        self.page_blocks, self.rpc = max(1, page_blocks), rpc
        self.artifact = contracts.artifact("RewardPool")
        self.topic = EventDecoder(self.artifact["abi"]).topic("PoolCreated")
        self.scanned_to = from_block - 1  # every block up to here was scanned
        self.pools: list[str] = []  # the genuine pools found, in the order found
        self.refused: dict[str, str] = {}  # emitter -> why it is not the run's pool

    def scan(self) -> list[str]:
        """Scan the blocks since the last scan; every genuine pool found so far."""
        head = self.rpc(lambda: self.w3.eth.block_number, "eth_blockNumber")
        start = self.scanned_to + 1
        while start <= head:
            end = min(start + self.page_blocks - 1, head)
            query = {"fromBlock": start, "toBlock": end, "topics": [self.topic, topic_uint(self.run_id)]}
            logs = self.rpc(lambda query=query: self.w3.eth.get_logs(query), f"eth_getLogs {start}-{end}")
            for address in dict.fromkeys(to_checksum_address(log["address"]) for log in logs):
                self._consider(address)
            self.scanned_to, start = end, end + 1
        return list(self.pools)

    def _consider(self, address: str) -> None:
        if address in self.pools or address in self.refused:
            return
        why = self.problem(address)
        if why is None:
            logger.info("run %d's reward pool: %s", self.run_id, address)
            self.pools.append(address)
        else:
            logger.warning("%s emitted a PoolCreated of run %d but is not its pool: %s", address, self.run_id,
                           why)
            self.refused[address] = why

    def problem(self, address: str) -> str | None:
        """Why the emitter ``address`` is not a pool of the run (None: it is)."""
        code = bytes(self.rpc(lambda: self.w3.eth.get_code(address), "eth_getCode"))
        why = bytecode_problem(code, self.artifact, address)
        if why is not None:
            return why
        contract = self.w3.eth.contract(address=address, abi=self.artifact["abi"])
        ledger = self.rpc(lambda: contract.functions.ledger().call(), "ledger()")
        if to_checksum_address(ledger) != self.ledger:
            return f"it pays from ledger {ledger}, not {self.ledger}"
        if self.rpc(lambda: contract.functions.poolOf(self.run_id).call(), "poolOf")[0][0] == 0:
            return f"it holds no pool of run {self.run_id}"
        return None
