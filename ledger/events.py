"""Reading contract events: paginated ``eth_getLogs`` by block range, decoded with eth-abi.

Pagination keeps each request within what public RPC providers accept (they cap the block range or the
number of results); decoding straight from the ABI with eth-abi is cheaper than web3's per-log processing,
which matters when an auditor reads thousands of rounds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from eth_abi import decode
from eth_abi.exceptions import DecodingError
from eth_utils import keccak, to_checksum_address
from web3 import Web3

from ledger.errors import LedgerDecodeError
from ledger.eventrecords import AccusationRecord, DisputeRecord, EquivocationRecord, SlashRecord
from ledger.records import CommitRecord, RoundRecord
from ledger.runparams import RunInfo, RunParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodedEvent:
    """One decoded log: event name, arguments by name, and where it happened."""

    name: str
    args: dict[str, Any]
    block_number: int
    log_index: int
    tx_hash: str
    address: str


def abi_type(item: dict) -> str:
    """The canonical ABI type of an ABI input (a struct ``tuple`` becomes ``(t1,t2,...)``)."""
    kind = item["type"]
    if kind.startswith("tuple"):
        return "(" + ",".join(abi_type(component) for component in item["components"]) + ")" + kind[5:]
    return kind


class EventDecoder:
    """Decodes the logs of one contract ABI by their first topic."""

    def __init__(self, abi: list[dict]):
        self._events: dict[bytes, tuple[str, list[dict]]] = {}
        self.topics: dict[str, bytes] = {}
        for entry in abi:
            if entry["type"] != "event":
                continue
            signature = f"{entry['name']}({','.join(abi_type(item) for item in entry['inputs'])})"
            topic = keccak(text=signature)
            self._events[topic] = (entry["name"], entry["inputs"])
            self.topics[entry["name"]] = topic

    def topic(self, name: str) -> str:
        """The 0x-hex first topic of event ``name``."""
        return "0x" + self.topics[name].hex()

    def decode(self, log: dict) -> DecodedEvent | None:
        """Decode ``log``; None if its first topic is not an event of this ABI.

        Raises :class:`~ledger.errors.LedgerDecodeError` if its topics or data do not decode as that event.
        """
        topics = [bytes(topic) for topic in log["topics"]]
        if not topics or topics[0] not in self._events:
            return None
        name, inputs = self._events[topics[0]]
        indexed = [item for item in inputs if item.get("indexed")]
        plain = [item for item in inputs if not item.get("indexed")]
        try:
            values = dict(
                zip(
                    [item["name"] for item in plain],
                    decode([abi_type(item) for item in plain], bytes(log["data"]))
                )
            )
            for item, topic in zip(indexed, topics[1:], strict=True):
                values[item["name"]] = decode([item["type"]], topic)[0]
        except (DecodingError, ValueError, OverflowError) as exc:
            # ValueError: a topic count that is not the event's; OverflowError: an offset past any index.
            # The RPC is not trusted to return well-formed logs: one that does not decode is refused by name.
            raise LedgerDecodeError(
                f"{name} log does not decode: {type(exc).__name__}: {exc}"[:300]) from None
        for item in inputs:
            if item["type"] == "address":
                values[item["name"]] = to_checksum_address(values[item["name"]])
            elif item["type"] == "address[]":
                values[item["name"]] = tuple(to_checksum_address(value) for value in values[item["name"]])
        tx_hash = log["transactionHash"]
        return DecodedEvent(
            name=name,
            args=values,
            block_number=int(log["blockNumber"]),
            log_index=int(log["logIndex"]),
            tx_hash=tx_hash.to_0x_hex() if hasattr(tx_hash, "to_0x_hex") else str(tx_hash),
            address=to_checksum_address(log["address"]),
        )


def topic_uint(value: int) -> str:
    """A uint as a 0x-hex 32-byte topic."""
    return "0x" + value.to_bytes(32, "big").hex()


def topic_address(address: str) -> str:
    """An address as a 0x-hex 32-byte topic."""
    return "0x" + bytes(12).hex() + address[2:].lower()


def scan_logs(
    w3: Web3,
    address: str,
    topics: list,
    from_block: int,
    to_block: int,
    page_blocks: int,
    rpc: Callable[[Callable[[], Any], str], Any],
) -> list[dict]:
    """All logs of ``address`` matching ``topics`` in [from_block, to_block], ``page_blocks`` blocks per call.

    ``rpc`` runs each request (with retries), e.g. ``TransactionSender.rpc``.
    """
    logs: list[dict] = []
    start = from_block
    while start <= to_block:
        end = min(start + page_blocks - 1, to_block)
        query = {"address": address, "fromBlock": start, "toBlock": end, "topics": topics}
        logs.extend(rpc(lambda query=query: w3.eth.get_logs(query), f"eth_getLogs {start}-{end}"))
        start = end + 1
    logs.sort(key=lambda log: (int(log["blockNumber"]), int(log["logIndex"])))
    return logs


def run_info_from(event: DecodedEvent) -> RunInfo:
    """The RunInfo of a decoded RunCreated event."""
    args = event.args
    params = RunParams(*args["params"])
    return RunInfo(
        run_id=args["runId"],
        config_hash=params.config_hash,
        creator=args["creator"],
        num_stages=params.num_stages,
        inner_steps=params.inner_steps,
        min_stake=params.min_stake,
        quorum=params.quorum,
        unbonding_blocks=params.unbonding_blocks,
        max_rounds=params.max_rounds,
        genesis_head=bytes(args["genesisHead"]),
        config_uri=args["configUri"],
        block_number=event.block_number,
        tx_hash=event.tx_hash,
        quorum_bps=params.quorum_bps,
        bond=params.bond,
        accusation_blocks=params.accusation_blocks,
        dispute_blocks=params.dispute_blocks,
        inactivity_rounds=params.inactivity_rounds,
        tenure_rounds=params.tenure_rounds,
        commitments=params.commitments,
        **{name: getattr(params, name) for name in RunParams.VALUES},
        max_game_steps=params.max_game_steps,
    )


def commit_record_from(event: DecodedEvent) -> CommitRecord:
    """The CommitRecord of a decoded RoundCommitted event."""
    args = event.args
    return CommitRecord(
        commit=RoundRecord.from_fields(args["record"]),
        submitter=args["submitter"],
        attesters=tuple(args["attesters"]),
        head_hash=bytes(args["headHash"]),
        block_number=event.block_number,
        log_index=event.log_index,
        tx_hash=event.tx_hash,
    )


def dispute_from(event: DecodedEvent) -> DisputeRecord:
    """The DisputeRecord of a decoded RoundDisputed event."""
    args = event.args
    return DisputeRecord(
        run_id=args["runId"],
        round=args["round"],
        disputer=args["disputer"],
        record=RoundRecord.from_fields(args["record"]),
        signature=bytes(args["signature"]),
        block_number=event.block_number,
        tx_hash=event.tx_hash,
    )


def equivocation_from(event: DecodedEvent) -> EquivocationRecord:
    """The EquivocationRecord of a decoded EquivocationReported event."""
    args = event.args
    return EquivocationRecord(
        run_id=args["runId"],
        round=args["round"],
        account=args["account"],
        record_hash_a=bytes(args["recordHashA"]),
        record_hash_b=bytes(args["recordHashB"]),
        reporter=args["reporter"],
        block_number=event.block_number,
        tx_hash=event.tx_hash,
    )


def accusation_from(event: DecodedEvent) -> AccusationRecord:
    """The AccusationRecord of a decoded AccusationOpened event (still open: no resolution read yet)."""
    args = event.args
    return AccusationRecord(
        run_id=args["runId"],
        accused=args["accused"],
        accuser=args["accuser"],
        evidence_hash=bytes(args["evidenceHash"]),
        opened_block=event.block_number,
        opened_tx=event.tx_hash,
        bond=args["bond"],
        deadline=args["deadline"],
        quorum=args["quorum"],
    )


def slash_from(event: DecodedEvent) -> SlashRecord:
    """The SlashRecord of a decoded MemberSlashed event."""
    args = event.args
    return SlashRecord(
        run_id=args["runId"],
        account=args["account"],
        stake=args["stake"],
        block_number=event.block_number,
        log_index=event.log_index,
        tx_hash=event.tx_hash,
    )
