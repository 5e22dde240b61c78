"""Reads of the two contracts' event logs: registrations, runs, checkpoints and a run's whole history.

Events are read with ``eth_getLogs`` paginated by block range (:func:`ledger.events.scan_logs`) from the
deployment block on and decoded into the dataclasses of :mod:`ledger.records`. :class:`EventReads` is a
mixin of :class:`ledger.client.LedgerClient`, whose other methods are calls and transactions.
"""

from __future__ import annotations

from ledger.errors import LedgerError
from ledger.events import (
    EventDecoder,
    checkpoint_from,
    commit_record_from,
    dispute_from,
    run_info_from,
    scan_logs,
    topic_uint,
)
from ledger.records import CheckpointRecord, Registration, RunHistory, RunInfo, check_bytes32


class EventReads:
    """Mixin of :class:`ledger.client.LedgerClient`: everything read from event logs.

    Expects of the client: ``w3``, ``from_block``, ``log_page_blocks``, ``ledger_address``, ``head_of``,
    ``_run_struct``, ``_sender`` (:class:`ledger.tx.TransactionSender`), ``_registry``, ``_ledger`` and
    their :class:`ledger.events.EventDecoder` ``_registry_events``, ``_ledger_events``.
    """

    def registrations(self) -> list[Registration]:
        """Every registration ever made, in chain order, marking the ones later unregistered."""
        logs = self._scan(
            self._registry,
            [
                [
                    self._registry_events.topic("NodeRegistered"),
                    self._registry_events.topic("NodeUnregistered"),
                ]
            ],
        )
        registrations: list[Registration] = []
        open_by_account: dict[str, int] = {}
        for event in (self._registry_events.decode(log) for log in logs):
            if event is None:
                continue
            account = event.args["account"]
            if event.name == "NodeRegistered":
                open_by_account[account] = len(registrations)
                registrations.append(
                    Registration(
                        account=account,
                        pubkey=bytes(event.args["pubkey"]),
                        signature=bytes(event.args["signature"]),
                        stake=event.args["stake"],
                        block_number=event.block_number,
                        tx_hash=event.tx_hash,
                    )
                )
            elif account in open_by_account:
                index = open_by_account.pop(account)
                old = registrations[index]
                registrations[index] = Registration(
                    **{**old.__dict__, "unregistered_block": event.block_number}
                )
        return registrations

    def run_info(self, run_id: int) -> RunInfo:
        """Run ``run_id`` as created (from its RunCreated event); raises LedgerError if it does not exist."""
        logs = self._scan(self._ledger, [self._ledger_events.topic("RunCreated"), topic_uint(run_id)])
        if not logs:
            raise LedgerError(f"run {run_id} does not exist on ledger {self.ledger_address}")
        return run_info_from(self._ledger_events.decode(logs[0]))

    def find_runs(self, config_hash: bytes) -> list[RunInfo]:
        """Every run created with ``config_hash``, oldest first (to reuse a run instead of creating one)."""
        config_hash = check_bytes32("config_hash", config_hash)
        logs = self._scan(self._ledger, [self._ledger_events.topic("RunCreated")])
        runs = [run_info_from(self._ledger_events.decode(log)) for log in logs]
        return [run for run in runs if run.config_hash == config_hash]

    def latest_checkpoint(self, run_id: int) -> CheckpointRecord | None:
        """The checkpoint of the highest round published for ``run_id`` (with its URI), or None."""
        run = self._run_struct(run_id)
        if run["checkpointCount"] == 0:
            return None
        logs = self._scan(
            self._ledger,
            [
                self._ledger_events.topic("CheckpointPublished"),
                topic_uint(run_id),
                topic_uint(run["latestCheckpointRound"]),
            ],
        )
        return checkpoint_from(self._ledger_events.decode(logs[0])) if logs else None

    def history(self, run_id: int, with_registrations: bool = True) -> RunHistory:
        """Everything the chain records about ``run_id``, read from events (paginated by block range).

        Raises:
            LedgerError: The run does not exist.
        """
        to_block = self._block_number()
        head = self.head_of(run_id)
        names = ("RunCreated", "RoundCommitted", "CheckpointPublished", "RoundDisputed")
        logs = self._scan(
            self._ledger, [[self._ledger_events.topic(name) for name in names], topic_uint(run_id)], to_block
        )
        run = None
        commits, checkpoints, disputes = [], [], []
        for event in (self._ledger_events.decode(log) for log in logs):
            if event is None:
                continue
            if event.name == "RunCreated":
                run = run_info_from(event)
            elif event.name == "RoundCommitted":
                commits.append(commit_record_from(event))
            elif event.name == "CheckpointPublished":
                checkpoints.append(checkpoint_from(event))
            else:
                disputes.append(dispute_from(event))
        if run is None:
            raise LedgerError(f"run {run_id} does not exist on ledger {self.ledger_address}")
        registrations = self.registrations() if with_registrations else []
        return RunHistory(
            run=run,
            head_hash=head,
            commits=commits,
            checkpoints=checkpoints,
            disputes=disputes,
            registrations=registrations,
        )

    def _block_number(self) -> int:
        return self._sender.rpc(lambda: self.w3.eth.block_number, "eth_blockNumber")

    def _scan(self, contract, topics: list, to_block: int | None = None) -> list[dict]:
        if to_block is None:
            to_block = self._block_number()
        return scan_logs(
            self.w3,
            contract.address,
            topics,
            self.from_block,
            to_block,
            self.log_page_blocks,
            self._sender.rpc,
        )

    def _first_tx(self, contract, decoder: EventDecoder, name: str, topics: list, last: bool = False) -> str:
        logs = self._scan(contract, [decoder.topic(name), *topics])
        if not logs:
            raise LedgerError(f"no {name} event found for {topics} on {contract.address}")
        event = decoder.decode(logs[-1] if last else logs[0])
        return event.tx_hash
