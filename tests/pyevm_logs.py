"""An index of a py-evm chain's logs for the long fuzzers (tests/trust_machine.py): eth-tester answers
``eth_getLogs`` by reading every block of the range and every receipt in it (about 11 ms a block on a 2-core
Xeon, an empty one too), so a reader that scans a run's history or a challenge's answer from an early block at
every step makes a long example quadratic in its chain. :func:`index_logs` makes ``w3.eth.get_logs`` read each
block once: the logs of the blocks not yet read are fetched (one getLogs over them, every address and topic)
and kept, and each query is answered from what is kept, filtered as a node filters (address, topics with
None as a wildcard and lists as alternatives, the block range).

For a chain that only grows (the fuzzer's: it never reverts to a snapshot); a chain found shorter than what
was read is read again from block 0. A Web3 on another provider (anvil) is left alone."""

from __future__ import annotations

from typing import Any

from web3.providers.eth_tester import EthereumTesterProvider


def _as_bytes(value: Any) -> bytes:
    return bytes.fromhex(value[2:]) if isinstance(value, str) else bytes(value)


def _block(value: Any, head: int) -> int:
    if value is None or value in ("latest", "pending", "safe", "finalized"):
        return head
    if value == "earliest":
        return 0
    return int(value, 16) if isinstance(value, str) else int(value)


def _matches(log: Any, addresses: set[str] | None, topics: list) -> bool:
    if addresses is not None and log["address"].lower() not in addresses:
        return False
    found = log["topics"]
    for position, wanted in enumerate(topics):
        if wanted is None:
            continue
        choices = wanted if isinstance(wanted, (list, tuple)) else [wanted]
        if position >= len(found) or bytes(found[position]) not in {_as_bytes(c) for c in choices}:
            return False
    return True


class LogIndex:
    """``w3.eth.get_logs`` answered from every block's logs, each block read once (module docstring)."""

    def __init__(self, w3) -> None:
        self._w3 = w3
        self._fetch = w3.eth.get_logs  # eth-tester's, bound before it is shadowed
        self._logs: list = []  # every log of blocks [0, _next), in chain order
        self._next = 0
        self.blocks_read = 0

    def __call__(self, query: dict) -> list:
        head = self._w3.eth.block_number
        if head + 1 < self._next:  # the chain got shorter (a snapshot reverted): read it again
            self._logs, self._next = [], 0
        if self._next <= head:
            self._logs.extend(self._fetch({"fromBlock": self._next, "toBlock": head}))
            self.blocks_read += head + 1 - self._next
            self._next = head + 1
        start, end = _block(query.get("fromBlock"), head), _block(query.get("toBlock"), head)
        address = query.get("address")
        if address is not None:
            address = {a.lower() for a in (address if isinstance(address, (list, tuple)) else [address])}
        topics = list(query.get("topics") or [])
        return [log for log in self._logs
                if start <= log["blockNumber"] <= end and _matches(log, address, topics)]


def index_logs(w3) -> LogIndex | None:
    """Answer ``w3``'s getLogs from a :class:`LogIndex` (py-evm only); the index, or None if not py-evm."""
    if not isinstance(w3.provider, EthereumTesterProvider):
        return None
    index = LogIndex(w3)
    w3.eth.get_logs = index
    return index
