"""A run's reward pool (issue 77; contracts/src/RewardPool.sol, docs/REWARDS.md): its schedule, the shares it
pays, and a client for its calls, views and events.

The shares are computed here exactly as the contract computes them (:func:`contribution_share`,
:func:`attester_share`), so that ``dlx-node rewards`` and the audit can say what each account earned from the
record alone and compare it with what the chain paid.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eth_utils import to_checksum_address
from web3 import Web3

import contracts
from ledger.chain import DEFAULT_RETRY, RetryPolicy
from ledger.chunkproof import Factors, tree_path
from ledger.errors import LedgerInputError
from ledger.events import EventDecoder, scan_logs, topic_uint
from ledger.records import RoundRecord, check_uint
from ledger.tx import DEFAULT_FEES, FeePolicy, TransactionSender

BPS = 10_000
#: ``stage`` of an attester's claim (RewardPool.ATTESTER).
ATTESTER = 2**32 - 1
#: PoolParams.token of a pool funded and paying in native ETH.
NATIVE = "0x0000000000000000000000000000000000000000"
POOL_EVENTS = ("PoolCreated", "PoolFunded", "RoundOpened", "RewardClaimed", "RoundClosed")


@dataclass(frozen=True)
class PoolParams:
    """A pool's schedule (RewardPool.PoolParams): ``amount_per_round`` wei a final round reserves, the
    attesters' part in basis points (the rest is the contributors'), the equal slots a stage's contributor
    budget is cut into, the attester shares, the blocks a round's credits can be claimed for, and the ERC-20
    the pool is funded and pays in (:data:`NATIVE`: ETH; amounts are then the token's smallest units)."""

    amount_per_round: int
    attester_bps: int = 1_000
    contribution_slots: int = 16
    attester_slots: int = 16
    claim_blocks: int = 0
    token: str = NATIVE

    def __post_init__(self) -> None:
        check_uint("amount_per_round", self.amount_per_round, 2**128 - 1)
        check_uint("attester_bps", self.attester_bps, 2**16 - 1)
        check_uint("contribution_slots", self.contribution_slots, 2**16 - 1)
        check_uint("attester_slots", self.attester_slots, 2**16 - 1)
        check_uint("claim_blocks", self.claim_blocks, 2**64 - 1)
        if not Web3.is_address(self.token):
            raise LedgerInputError(f"token: {self.token!r} is not an address")
        object.__setattr__(self, "token", to_checksum_address(self.token))

    @property
    def is_token(self) -> bool:
        return int(self.token, 16) != 0

    def fields(self) -> tuple:
        return (self.amount_per_round, self.attester_bps, self.contribution_slots, self.attester_slots,
                self.claim_blocks, self.token)

    @classmethod
    def from_fields(cls, values) -> PoolParams:
        *numbers, token = values
        return cls(*(int(value) for value in numbers), token=str(token))


#: RunParams.commitments of a run whose factors bind contributions to members (RewardPool._NORMED).
NORMED_COMMITMENTS = 3


def pool_param_problems(params: PoolParams, funding: int, *, commitments: int, max_contributions: int,
                        unbonding_blocks: int) -> list[str]:
    """Why ``createPool`` would refuse ``params`` with ``funding`` wei for a run of these values: the
    contract's rules (RewardPool._checkParams), each as one line, so a command refuses them all at once before
    any transaction; empty when it would take them. No parameter can pay before finality (a round opens only
    when the ledger says it is final), so none is checked for it."""
    problems = []
    if params.amount_per_round == 0:
        problems.append("the amount per round is zero")
    elif funding < params.amount_per_round:
        problems.append(f"the funding ({funding} wei) does not cover one round's amount "
                        f"({params.amount_per_round} wei): a round's rewards would exceed what the pool "
                        "holds")
    if params.attester_bps > BPS:
        problems.append(f"attester_bps={params.attester_bps} is above 10000")
    elif params.attester_bps < BPS:
        if commitments != NORMED_COMMITMENTS:
            problems.append(f"contributions are paid only in a normed run (commitments {NORMED_COMMITMENTS}; "
                            f"this run's is {commitments}): set attester_bps=10000 (attesters only)")
        elif params.contribution_slots == 0 or params.contribution_slots < max_contributions:
            problems.append(f"contribution_slots={params.contribution_slots} is below the run's "
                            f"max_contributions ({max_contributions}): dropping contributions would raise "
                            "the others' shares")
    if params.attester_bps > 0 and params.attester_slots == 0:
        problems.append("attester_slots is zero with an attesters' part")
    if params.claim_blocks < unbonding_blocks:
        problems.append(f"claim_blocks={params.claim_blocks} is shorter than the run's unbonding "
                        f"({unbonding_blocks} blocks)")
    return problems


def contribution_share(params: PoolParams, num_stages: int, inner_steps: int, listed: int,
                       steps: int | None) -> int:
    """What one listed contribution of a stage earns: the stage's contributor budget over
    max(contribution_slots, listed) slots, times min(steps, H) / H in a run bounded by time (``steps`` None:
    fixed H, a whole slot). Dropping another listed contribution never raises it (while listed <= slots)."""
    slots = max(params.contribution_slots, listed)
    budget = params.amount_per_round * (BPS - params.attester_bps) // BPS
    weight = inner_steps if steps is None else min(steps, inner_steps)
    return budget * weight // (num_stages * slots * inner_steps)


def attester_share(params: PoolParams, attesters: int) -> int:
    """What one listed attester of a round earns: the attesters' budget over max(attester_slots,
    attesters)."""
    return params.amount_per_round * params.attester_bps // BPS // max(params.attester_slots, attesters)


def stage_claim_args(record: RoundRecord, stage_leaves: list[bytes], stage: int, factors: bytes,
                     index: int) -> tuple:
    """claimContribution's arguments: the committed ``record``, stage ``stage``'s leaf and path among
    the round's
    ``stage_leaves`` (encoded StageLeaf), the stage's factors and the claimer's place in them."""
    if not 0 <= stage < len(stage_leaves):
        raise LedgerInputError(f"stage {stage}: the round has {len(stage_leaves)} stage leaves")
    return (record.fields(), stage, stage_leaves[stage], tree_path(stage_leaves, stage), factors, index)


def listed_contributions(factors: bytes) -> list[tuple[str, int | None]]:
    """(contributor, declared steps or None in a fixed-H run) of each contribution version-3 ``factors``
    list."""
    decoded = Factors.decode(factors)
    if decoded.norms is None:
        raise LedgerInputError("factors: not version 3 (they bind no contribution to a member)")
    steps = decoded.norms.steps or (None,) * len(decoded.norms.contributors)
    return list(zip(decoded.norms.contributors, steps, strict=True))


def _erc20_function(name: str, inputs: list[tuple[str, str]], output: str, view: bool) -> dict:
    return {"type": "function", "name": name, "stateMutability": "view" if view else "nonpayable",
            "inputs": [{"name": n, "type": t} for n, t in inputs], "outputs": [{"name": "", "type": output}]}


#: The ERC-20 calls a token pool needs (EIP-20).
ERC20_ABI = [
    _erc20_function("balanceOf", [("account", "address")], "uint256", True),
    _erc20_function("allowance", [("owner", "address"), ("spender", "address")], "uint256", True),
    _erc20_function("decimals", [], "uint8", True),
    _erc20_function("approve", [("spender", "address"), ("amount", "uint256")], "bool", False),
]


class RewardPoolClient:
    """Calls, views and events of one RewardPool as ``account`` (None: read-only)."""

    def __init__(self, w3: Web3, account: Any, pool_address: str, *, retry: RetryPolicy = DEFAULT_RETRY,
                 receipt_timeout: float = 60.0, fees: FeePolicy = DEFAULT_FEES, from_block: int = 0,
                 log_page_blocks: int = 10_000):
        abi = contracts.artifact("RewardPool")["abi"]
        self.w3 = w3
        self.sender = TransactionSender(w3, account, retry=retry, receipt_timeout=receipt_timeout, fees=fees)
        self.contract = w3.eth.contract(address=to_checksum_address(pool_address), abi=abi)
        self.events = EventDecoder(abi)
        self.from_block = from_block
        self.log_page_blocks = log_page_blocks

    @staticmethod
    def deploy(w3: Web3, account: Any, ledger_address: str, **kwargs) -> str:
        """Deploy a RewardPool reading the TrainingLedger at ``ledger_address``; its address."""
        sender = TransactionSender(w3, account, **kwargs)
        return sender.deploy(contracts.artifact("RewardPool"), (to_checksum_address(ledger_address),))

    @property
    def address(self) -> str:
        return self.contract.address

    @property
    def account_address(self) -> str:
        return self.sender.address

    def _send(self, name: str, args: tuple, what: str, value: int = 0) -> dict:
        return self.sender.transact(self.contract, name, args, what, value)

    # calls ----------------------------------------------------------------------------------------------
    def create_pool(self, run_id: int, params: PoolParams, funding: int) -> dict:
        """createPool with ``funding``: sent as wei, or, for a token pool, pulled by the pool from this
        account (approve it first: :meth:`approve`)."""
        return self._send("createPool", (run_id, params.fields(), funding),
                          f"create the pool of run {run_id}", 0 if params.is_token else funding)

    def fund(self, run_id: int, amount: int, token: str | None = None) -> dict:
        """Top run ``run_id``'s pool up with ``amount`` in its currency (``token``: the pool's, read when
        None; a token pool pulls it from this account: approve it first)."""
        if token is None:
            token = self.pool_of(run_id)["params"].token
        return self._send("fund", (run_id, amount), f"fund the pool of run {run_id}",
                          0 if int(token, 16) else amount)

    def token(self, token: str):
        """The ERC-20 ``token`` (a contract bound to the minimal ERC-20 ABI)."""
        return self.w3.eth.contract(address=to_checksum_address(token), abi=ERC20_ABI)

    def approve(self, token: str, amount: int) -> dict:
        """Allow the pool to pull ``amount`` of ``token`` from this account (before createPool or fund)."""
        return self.sender.transact(self.token(token), "approve", (self.address, amount),
                                    f"allow the reward pool {amount} of token {token}")

    def open(self, run_id: int, round: int) -> dict:
        return self._send("open", (run_id, round), f"open round {round} of run {run_id}'s pool")

    def sweep(self, run_id: int, round: int) -> dict:
        return self._send("sweep", (run_id, round), f"sweep round {round} of run {run_id}'s pool")

    def claim_contribution(self, record: RoundRecord, stage_leaves: list[bytes], stage: int, factors: bytes,
                           index: int) -> dict:
        args = stage_claim_args(record, stage_leaves, stage, factors, index)
        return self._send("claimContribution", args,
                          f"claim stage {stage} of round {record.round} of run {record.run_id}")

    def claim_attestation(self, run_id: int, round: int, attesters: list[str],
                          index: int | None = None) -> dict:
        attesters = [to_checksum_address(a) for a in attesters]
        if index is None:
            index = attesters.index(to_checksum_address(self.account_address))
        return self._send("claimAttestation", (run_id, round, attesters, index),
                          f"claim the attestation of round {round} of run {run_id}")

    # views ----------------------------------------------------------------------------------------------
    def _call(self, name: str, args: tuple = ()):
        return self.sender.call(self.contract, name, args, name)

    def pool_of(self, run_id: int) -> dict:
        """The pool's fields by name (amountPerRound zero: no pool)."""
        (params, first, next_round, stages, inner, funded, free, claimed) = self._call("poolOf", (run_id,))
        return {"params": PoolParams.from_fields(params), "firstRound": first, "nextRound": next_round,
                "numStages": stages, "innerSteps": inner, "funded": funded, "free": free, "claimed": claimed}

    def has_pool(self, run_id: int) -> bool:
        return self._call("poolOf", (run_id,))[0][0] != 0

    def round_of(self, run_id: int, round: int) -> dict:
        budget, paid, opened_at, swept = self._call("roundOf", (run_id, round))
        return {"budget": budget, "paid": paid, "openedAt": opened_at, "swept": swept}

    def claimed_of(self, run_id: int, round: int, stage: int, account: str) -> bool:
        return self._call("claimedOf", (run_id, round, stage, to_checksum_address(account)))

    def contribution_share(self, record: RoundRecord, stage_leaves: list[bytes], stage: int, factors: bytes,
                           index: int, account: str) -> int:
        args = stage_claim_args(record, stage_leaves, stage, factors, index)
        return self._call("contributionShare", (*args, to_checksum_address(account)))

    def attester_share(self, run_id: int, round: int, attesters: list[str], index: int, account: str) -> int:
        return self._call("attesterShare", (run_id, round, [to_checksum_address(a) for a in attesters], index,
                                            to_checksum_address(account)))

    def balance(self, token: str = NATIVE) -> int:
        """What the pool contract holds of ``token`` (NATIVE: wei), every run's pool in it together."""
        if int(token, 16) == 0:
            return self.w3.eth.get_balance(self.address)
        return self.sender.call(self.token(token), "balanceOf", (self.address,), "balanceOf")

    def pool_events(self, run_id: int, to_block: int | None = None) -> list:
        """The pool's events of ``run_id`` in chain order (decoded: ``.name``, ``.args``)."""
        topics = [[self.events.topic(name) for name in POOL_EVENTS], topic_uint(run_id)]
        end = self.w3.eth.block_number if to_block is None else to_block
        logs = scan_logs(self.w3, self.address, topics, self.from_block, end, self.log_page_blocks,
                         self.sender.rpc)
        return [event for event in (self.events.decode(log) for log in logs) if event is not None]
