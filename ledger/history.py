"""Reads of the two contracts' event logs: registrations, runs, members, commits and a run's whole history.

Events are read with ``eth_getLogs`` paginated by block range (:func:`ledger.events.scan_logs`) from the
deployment block on and decoded into the dataclasses of :mod:`ledger.records`. :class:`EventReads` is a
mixin of :class:`ledger.client.LedgerClient`, whose other methods are calls and transactions.
"""

from __future__ import annotations

from dataclasses import replace

from ledger.errors import LedgerError
from ledger.events import (
    DecodedEvent,
    EventDecoder,
    accusation_from,
    commit_record_from,
    dispute_from,
    equivocation_from,
    run_info_from,
    scan_logs,
    slash_from,
    topic_uint,
)
from ledger.eventrecords import AccusationRecord, CheckpointRecord, DisputeRecord, RunHistory, checkpoint_uri
from ledger.records import CommitRecord, Membership, Registration, check_bytes32, end_of_block
from ledger.runparams import RunInfo

#: The TrainingLedger events of one run (all carry the run id as their first topic).
_RUN_EVENTS = (
    "RunCreated",
    "RoundCommitted",
    "RoundDisputed",
    "MemberJoined",
    "MemberLeft",
    "StakeWithdrawn",
    "MemberSlashed",
    "EquivocationReported",
    "AccusationOpened",
    "AccusationResolved",
    "AccusationExpired",
    "MemberEjected",
    "BondForfeited",
    "BondReturned",
    "MemberCounted",
    "RoundAttested",
    "DisputeResolved",
    "DisputeLapsed",
    "RunHalted",
    "ProverRewarded",
)
#: The events that tell a run's accusations.
_ACCUSATION_EVENTS = ("AccusationOpened", "AccusationResolved", "AccusationExpired")


def checkpoint_of_commit(record: CommitRecord) -> CheckpointRecord:
    """The checkpoint a commit published (its record's ``checkpoint_hash`` must be nonzero)."""
    commit = record.commit
    return CheckpointRecord(
        run_id=commit.run_id,
        round=commit.round,
        content_hash=commit.checkpoint_hash,
        uri=checkpoint_uri(commit.checkpoint_hash),
        publisher=record.submitter,
        block_number=record.block_number,
        tx_hash=record.tx_hash,
    )


def memberships_from(events: list[DecodedEvent]) -> list[Membership]:
    """The membership periods told by a run's decoded events in chain order (other events are skipped).

    MemberJoined opens a period; MemberLeft and MemberSlashed end it as a signer (MemberEjected, which a
    MemberLeft follows, marks it ejected); StakeWithdrawn closes it (the account may join again: a new
    period).
    """
    periods: list[Membership] = []
    current: dict[str, int] = {}  # account -> index of its period still holding a stake
    for event in events:
        args = event.args
        position = (event.block_number, event.log_index)
        if event.name == "MemberJoined":
            current[args["account"]] = len(periods)
            periods.append(
                Membership(
                    run_id=args["runId"],
                    account=args["account"],
                    node_key=bytes(args["nodeKey"]),
                    stake=args["stake"],
                    joined=position,
                    joined_tx=event.tx_hash,
                    platform=bytes(args["platform"]),
                )
            )
        elif event.name == "MemberCounted" and args["account"] in current:
            index = current[args["account"]]
            periods[index] = replace(periods[index], counted=position)
        elif event.name in ("MemberLeft", "MemberEjected", "MemberSlashed", "StakeWithdrawn") and (
            args["account"] in current
        ):
            index = current[args["account"]]
            if event.name == "MemberEjected":
                periods[index] = replace(periods[index], ejected=position)
            elif event.name == "MemberLeft":
                periods[index] = replace(periods[index], left=position, unbonding_end=args["unbondingEnd"])
            elif event.name == "MemberSlashed":
                periods[index] = replace(periods[index], slashed=position)
                del current[args["account"]]
            else:
                periods[index] = replace(periods[index], withdrawn_block=event.block_number)
                del current[args["account"]]
    return periods


def accusations_from(
    events: list[DecodedEvent], into: dict[tuple[str, bytes], AccusationRecord] | None = None
) -> dict[tuple[str, bytes], AccusationRecord]:
    """The accusations told by decoded events in chain order, by (accused, evidence hash); other events
    skipped.

    AccusationOpened opens one; AccusationResolved or AccusationExpired ends it.
    """
    accusations = {} if into is None else into
    for event in events:
        args = event.args
        if event.name == "AccusationOpened":
            record = accusation_from(event)
            accusations[(record.accused, record.evidence_hash)] = record
            continue
        key = (args.get("accused"), bytes(args.get("evidenceHash", b"")))
        if key not in accusations:
            continue
        if event.name == "AccusationResolved":
            accusations[key] = replace(
                accusations[key],
                resolved_block=event.block_number,
                guilty=args["guilty"],
                signers=tuple(args["signers"]),
            )
        elif event.name == "AccusationExpired":
            accusations[key] = replace(accusations[key], expired_block=event.block_number)
    return accusations


class EventReads:
    """Mixin of :class:`ledger.client.LedgerClient`: everything read from event logs.

    Expects of the client: ``w3``, ``from_block``, ``log_page_blocks``, ``ledger_address``, ``head_of``,
    ``record_hash_of``, ``run_struct``, ``sender`` (:class:`ledger.tx.TransactionSender`),
    ``registry_contract``, ``ledger_contract`` and
    their :class:`ledger.events.EventDecoder` ``registry_events``, ``ledger_events``.
    """

    def registrations(self) -> list[Registration]:
        """Every registration ever made, in chain order, marking the ones later unregistered."""
        logs = self._scan(
            self.registry_contract,
            [
                [
                    self.registry_events.topic("NodeRegistered"),
                    self.registry_events.topic("NodeUnregistered"),
                ]
            ],
        )
        registrations: list[Registration] = []
        open_by_account: dict[str, int] = {}
        for event in (self.registry_events.decode(log) for log in logs):
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
        logs = self._scan(self.ledger_contract, [self.ledger_events.topic("RunCreated"), topic_uint(run_id)])
        if not logs:
            raise LedgerError(f"run {run_id} does not exist on ledger {self.ledger_address}")
        return run_info_from(self.ledger_events.decode(logs[0]))

    def find_runs(self, config_hash: bytes) -> list[RunInfo]:
        """Every run created with ``config_hash``, oldest first (to reuse a run instead of creating one)."""
        config_hash = check_bytes32("config_hash", config_hash)
        logs = self._scan(self.ledger_contract, [self.ledger_events.topic("RunCreated")])
        runs = [run_info_from(self.ledger_events.decode(log)) for log in logs]
        return [run for run in runs if run.config_hash == config_hash]

    def latest_checkpoint(self, run_id: int) -> CheckpointRecord | None:
        """The checkpoint of the highest round that published one for ``run_id`` (with its URI), or None."""
        end = self.run_struct(run_id)["checkpointEnd"]  # 1 + the latest checkpoint round; 0: none
        if end == 0:
            return None
        record = self.commit_record(run_id, end - 1)
        return checkpoint_of_commit(record) if record is not None else None

    def commit_record(self, run_id: int, round: int) -> CommitRecord | None:
        """The RoundCommitted event of ``round`` of ``run_id`` (record, submitter, attesters), or None."""
        if self.record_hash_of(run_id, round) is None:
            return None
        topics = [self.ledger_events.topic("RoundCommitted"), topic_uint(run_id), topic_uint(round)]
        # The commit's own block (commitBlockOf) first: one block, not the deployment's whole history (an RPC
        # provider caps eth_getLogs' range, and py-evm's scan is linear in the chain); the whole range only if
        # a reorg moved the commit between the two reads. The latest event: a round overturned and committed
        # again has two.
        block = self.commit_block_of(run_id, round)  # ledger.disputes.DisputeCalls, beside this in the client
        logs = self._scan(self.ledger_contract, topics, block, block) if block is not None else []
        if not logs:
            logs = self._scan(self.ledger_contract, topics)
        return commit_record_from(self.ledger_events.decode(logs[-1])) if logs else None

    def memberships(self, run_id: int, to_block: int | None = None) -> list[Membership]:
        """Every membership period of ``run_id`` up to ``to_block`` (default: latest), in join order."""
        names = ("MemberJoined", "MemberLeft", "MemberEjected", "StakeWithdrawn", "MemberSlashed")
        logs = self._scan(
            self.ledger_contract, [[self.ledger_events.topic(name) for name in names], topic_uint(run_id)],
            to_block
        )
        return memberships_from([self.ledger_events.decode(log) for log in logs])

    def members_at(self, run_id: int, block: int | None = None) -> list[Membership]:
        """The members of ``run_id`` able to sign at the end of ``block`` (default: latest), from events
        alone."""
        block = self.head_block() if block is None else block
        return [m for m in self.memberships(run_id, block) if m.in_force(end_of_block(block))]

    def accusations(self, run_id: int, from_block: int | None = None) -> list[AccusationRecord]:
        """The accusations of ``run_id`` opened from ``from_block`` on (default: the client's ``from_block``),
        in the order they were opened, each with its resolution or expiry if any (what a node watches)."""
        logs = scan_logs(
            self.w3,
            self.ledger_contract.address,
            [[self.ledger_events.topic(name) for name in _ACCUSATION_EVENTS], topic_uint(run_id)],
            self.from_block if from_block is None else from_block,
            self.head_block(),
            self.log_page_blocks,
            self.sender.rpc,
        )
        events = [event for event in (self.ledger_events.decode(log) for log in logs) if event is not None]
        return list(accusations_from(events).values())

    def disputes(self, run_id: int, round: int | None = None) -> list[DisputeRecord]:
        """The RoundDisputed events of ``run_id`` (of ``round`` only if given), in chain order: each
        disputer's signed record. ``disputers_of`` is the same list of disputers read from the contract's
        state."""
        topics = [self.ledger_events.topic("RoundDisputed"), topic_uint(run_id)]
        if round is not None:
            topics.append(topic_uint(round))
        return [dispute_from(self.ledger_events.decode(log))
                for log in self._scan(self.ledger_contract, topics)]

    def history(self, run_id: int, with_registrations: bool = True) -> RunHistory:
        """Everything the chain records about ``run_id``, read from events (paginated by block range).

        Raises:
            LedgerError: The run does not exist.
        """
        to_block = self.head_block()
        head = self.head_of(run_id)
        logs = self._scan(
            self.ledger_contract,
            [[self.ledger_events.topic(name) for name in _RUN_EVENTS], topic_uint(run_id)],
            to_block,
        )
        events = [event for event in (self.ledger_events.decode(log) for log in logs) if event is not None]
        run = None
        commits, disputes, equivocations, slashings = [], [], [], []
        outcomes: dict[int, str] = {}
        accusations: dict[tuple[str, bytes], AccusationRecord] = {}
        for event in events:
            if event.name == "RunCreated":
                run = run_info_from(event)
            elif event.name == "RoundCommitted":
                commits.append(commit_record_from(event))
            elif event.name == "RoundDisputed":
                disputes.append(dispute_from(event))
            elif event.name == "EquivocationReported":
                equivocations.append(equivocation_from(event))
            elif event.name == "MemberSlashed":
                slashings.append(slash_from(event))
            elif event.name == "DisputeResolved":
                outcomes[event.args["round"]] = "upheld" if event.args["upheld"] else "overturned"
            elif event.name == "DisputeLapsed":
                outcomes[event.args["round"]] = "lapsed"
            elif event.name == "ProverRewarded":  # a fraud proof overturned the round (docs/FRAUD_PROOF.md)
                outcomes[event.args["round"]] = "proven wrong"
            elif event.name in _ACCUSATION_EVENTS:
                accusations_from([event], accusations)  # updates ``accusations`` in place
        if run is None:
            raise LedgerError(f"run {run_id} does not exist on ledger {self.ledger_address}")
        registrations = self.registrations() if with_registrations else []
        return RunHistory(
            run=run,
            head_hash=head,
            commits=commits,
            checkpoints=[checkpoint_of_commit(c) for c in commits if c.commit.has_checkpoint],
            memberships=memberships_from(events),
            disputes=disputes,
            equivocations=equivocations,
            accusations=list(accusations.values()),
            slashings=slashings,
            registrations=registrations,
            dispute_outcomes=outcomes,
            block_number=to_block,
        )

    def head_block(self) -> int:
        """The chain's head block, read like every other call: retried through an RPC outage, then
        ChainUnavailable (never the HTTP library's own exception)."""
        return self.sender.rpc(lambda: self.w3.eth.block_number, "eth_blockNumber")

    def _scan(self, contract, topics: list, to_block: int | None = None,
              from_block: int | None = None) -> list[dict]:
        if to_block is None:
            to_block = self.head_block()
        return scan_logs(
            self.w3,
            contract.address,
            topics,
            self.from_block if from_block is None else max(from_block, self.from_block),
            to_block,
            self.log_page_blocks,
            self.sender.rpc,
        )

    def first_tx(self, contract, decoder: EventDecoder, name: str, topics: list, last: bool = False) -> str:
        logs = self._scan(contract, [decoder.topic(name), *topics])
        if not logs:
            raise LedgerError(f"no {name} event found for {topics} on {contract.address}")
        event = decoder.decode(logs[-1] if last else logs[0])
        return event.tx_hash
