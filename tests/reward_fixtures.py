"""A normed run with a reward pool on a real EVM (issue 77): rounds whose stage leaves carry version-3 factors
listing chosen members' signed contributions, committed by chosen signers; helpers to reach finality and
claim.

The factors' roots and sums are stand-ins (the pool reads only the stage leaf, the factors' lists and the
binding: who is listed, with which steps, signed by whom); the fraud-proof tests hold real ones."""

from __future__ import annotations

import dataclasses
import hashlib

import contracts
from ledger.account import dev_account
from ledger.chunkproof import SCALE_ONE, Factors, Norms, StageLeaf, chunked_weights_root
from ledger.contribution_binding import ContributionClaim
from ledger.rewards import PoolParams, RewardPoolClient, attester_share, contribution_share, stage_claim_args
from ledger.tx import TransactionSender
from tests.ledger_fixtures import FAST_RETRY, SHORT_WINDOWS, Deployment, digest, mine

STAGES = 2
INNER_STEPS = 50  # Deployment.member_run's H
MAX_CONTRIBUTIONS = 4
AMOUNT = 10**15  # wei per round


def params(**overrides) -> PoolParams:
    base = {"amount_per_round": AMOUNT, "attester_bps": 2_000, "contribution_slots": MAX_CONTRIBUTIONS,
            "attester_slots": 4, "claim_blocks": 40}
    return PoolParams(**{**base, **overrides})


@dataclasses.dataclass
class Round:
    record: object
    leaves: list  # encoded stage leaves
    factors: list  # per stage, encoded factors
    listed: list  # per stage, [(member index, steps or None)]
    attesters: tuple[str, ...]
    tx: str = ""  # the commit's transaction hash


@dataclasses.dataclass
class RewardRun:
    deployment: Deployment
    run: object  # tests.ledger_fixtures.MemberRun
    pool_address: str | None
    params: PoolParams | None
    rounds: list = dataclasses.field(default_factory=list)

    @property
    def w3(self):
        return self.deployment.w3

    @property
    def run_id(self) -> int:
        return self.run.run_id

    def pool(self, index: int) -> RewardPoolClient:
        account = dev_account(index, self.w3.eth.chain_id)
        return RewardPoolClient(self.w3, account, self.pool_address, retry=FAST_RETRY)

    def address(self, index: int) -> str:
        return self.deployment.client(index).address

    def factors(self, round_: int, stage: int, listed, signer_of=None) -> bytes:
        """Version-3 factors of ``listed`` [(member index, steps or None)], each signed by its member (or by
        ``signer_of[index]``: another account signing in its name)."""
        n = len(listed)
        payload = tuple(digest(f"p{self.run_id}-{round_}-{stage}-{j}") for j in range(n))
        roots = tuple(digest(f"n{self.run_id}-{round_}-{stage}-{j}") for j in range(n))
        steps = tuple(step for _, step in listed) if any(step is not None for _, step in listed) else ()
        signatures = []
        for j, (index, step) in enumerate(listed):
            claim = ContributionClaim(self.run_id, round_, stage, payload[j], roots[j], step or 0)
            signer = (signer_of or {}).get(index, index)
            signatures.append(self.deployment.client(signer).sign_contribution(claim))
        norms = Norms(0, steps, roots, (1,) * n, tuple(self.address(i) for i, _ in listed), tuple(signatures))
        return Factors(0, 0, False, tuple(digest(f"e{j}") for j in range(n)), payload, (SCALE_ONE,) * n,
                       norms).encode()

    def commit(self, listed_by_stage, signers=(1, 2), label: str = "", signer_of=None) -> Round:
        """Commit the next round: stage s lists ``listed_by_stage[s]``, signed by ``signers``."""
        round_ = self.run.reader.commit_count(self.run_id)
        factors = [self.factors(round_, s, listed, signer_of) for s, listed in enumerate(listed_by_stage)]
        leaves = [StageLeaf(s, 1, digest(f"w{round_}{label}"), digest(f"m{round_}"),
        hashlib.sha256(f).digest())
                  for s, f in enumerate(factors)]
        record = dataclasses.replace(self.run.next_record(label), weights_root=chunked_weights_root(leaves))
        tx = self.run.client(signers[0]).commit_round(record, self.run.sign(record, signers))
        attesters = self.run.reader.commit_record(self.run_id, round_).attesters
        entry = Round(record, [leaf.encode() for leaf in leaves], factors, [list(x) for x in listed_by_stage],
                      attesters, tx)
        self.rounds.append(entry)
        return entry

    def is_final(self, round_: int) -> bool:
        return self.run.reader.is_final(self.run_id, round_)

    def final_at(self, round_: int) -> int:
        """The first block in which ``round_`` is final (no dispute open): the latest proof window's end of it
        and every earlier round (TrainingLedger.proofWindowOf)."""
        ledger = self.run.reader.ledger_contract
        return max(ledger.functions.proofWindowOf(self.run_id, r).call()[1] for r in range(round_ + 1))

    def mine_to_final(self, round_: int) -> int:
        """Mine until a transaction sent now lands in a block where ``round_`` is final; the blocks mined."""
        start = self.w3.eth.block_number
        # to final_at itself: anvil estimates a transaction at the head's number, py-evm at the next block's
        mine(self.w3, max(0, self.final_at(round_) - start))
        return self.w3.eth.block_number - start

    def claim(self, index: int, round_: int, stage: int, position: int | None = None, as_index: int |
    None = None):
        """Member ``index`` (or ``as_index``, sending another's claim) claims its contribution to
        ``stage``."""
        entry = self.rounds[round_]
        if position is None:
            position = [i for i, _ in entry.listed[stage]].index(index)
        client = self.pool(index if as_index is None else as_index)
        return client.claim_contribution(entry.record, entry.leaves, stage, entry.factors[stage], position)

    def claim_mined(self, index: int, round_: int, stage: int) -> int:
        """Member ``index``'s claim sent without a preflight (a fixed gas limit), mined in the next block; its
        receipt's status (1 paid, 0 reverted): what happens in that block, whatever a node's estimate says."""
        entry = self.rounds[round_]
        client = self.pool(index)
        position = [i for i, _ in entry.listed[stage]].index(index)
        data = client.contract.encode_abi("claimContribution", args=list(stage_claim_args(
            entry.record, entry.leaves, stage, entry.factors[stage], position)))
        return self.send_mined(index, data)

    def sweep_mined(self, index: int, round_: int) -> int:
        """``sweep`` sent without a preflight by ``index``, as :meth:`claim_mined`."""
        return self.send_mined(index, self.pool(index).contract.encode_abi("sweep", args=[self.run_id,
        round_]))

    def send_mined(self, index: int, data: str) -> int:
        account = dev_account(index, self.w3.eth.chain_id)
        block = self.w3.eth.get_block("latest")
        tx = {"to": self.pool_address, "data": data, "value": 0, "gas": 600_000, "chainId":
        self.w3.eth.chain_id,
              "nonce": self.w3.eth.get_transaction_count(account.address),
              "maxFeePerGas": 2 * block["baseFeePerGas"] + 10**9, "maxPriorityFeePerGas": 10**9}
        signed = account.sign_transaction(tx)
        try:
            tx_hash = self.w3.eth.send_raw_transaction(signed.raw_transaction)
        except Exception:  # noqa: BLE001 - py-evm refuses a reverting transaction at once (nothing mined)
            mine(self.w3, 1)
            return 0
        return self.w3.eth.wait_for_transaction_receipt(tx_hash, timeout=60)["status"]

    def claim_attestation(self, index: int, round_: int, as_index: int | None = None, attesters=None):
        entry = self.rounds[round_]
        attesters = list(entry.attesters if attesters is None else attesters)
        position = attesters.index(self.address(index))
        return self.pool(index if as_index is None else as_index).claim_attestation(
            self.run_id, round_, attesters, position)

    def expected_share(self, round_: int, stage: int, index: int) -> int:
        listed = self.rounds[round_].listed[stage]
        steps = dict(listed)[index]
        return contribution_share(self.params, STAGES, INNER_STEPS, len(listed), steps)

    def expected_attester_share(self, round_: int) -> int:
        return attester_share(self.params, len(self.rounds[round_].attesters))


def reward_run(deployment: Deployment, members=(1, 2, 3, 4, 5), pool: PoolParams | None = None,
               funding: int | None = None, max_contributions: int = MAX_CONTRIBUTIONS,
               **run_params) -> RewardRun:
    """A normed 2-stage run of ``members`` (k = 2, short windows, maxContributions 4) created by member
    ``members[0]``, with a pool of ``pool`` (None: no pool; a RewardPool is deployed either way)."""
    run_params = {**SHORT_WINDOWS, "values": {"max_contributions": max_contributions, "max_rank": 1},
    **run_params}
    run_params.setdefault("commitments", 3)
    run = deployment.member_run(members, quorum=2, **run_params)
    pool_address = RewardPoolClient.deploy(deployment.w3, dev_account(0, deployment.w3.eth.chain_id),
                                           deployment.ledger, retry=FAST_RETRY)
    result = RewardRun(deployment, run, pool_address, pool)
    if pool is not None:
        funding = 10 * pool.amount_per_round if funding is None else funding
        if pool.is_token:
            result.pool(members[0]).approve(pool.token, funding)
        result.pool(members[0]).create_pool(run.run_id, pool, funding)
    return result


#: QuirkyToken.Mode (contracts/src/test/QuirkyToken.sol).
PLAIN, RETURNS_NOTHING, RETURNS_FALSE, FEE_ON_TRANSFER, SENDER_FEE = range(5)


class Token:
    """A QuirkyToken on ``w3`` deployed by dev account 0: its calls as any dev account, its views."""

    def __init__(self, w3, address: str | None = None):
        self.w3 = w3
        abi = contracts.artifact("QuirkyToken")["abi"]
        if address is None:
            address = TransactionSender(w3, dev_account(0, w3.eth.chain_id), retry=FAST_RETRY).deploy(
                contracts.artifact("QuirkyToken"))
        self.contract = w3.eth.contract(address=address, abi=abi)

    @property
    def address(self) -> str:
        return self.contract.address

    def send(self, index: int, name: str, *args) -> dict:
        sender = TransactionSender(self.w3, dev_account(index, self.w3.eth.chain_id), retry=FAST_RETRY)
        return sender.transact(self.contract, name, args, f"token {name}")

    def mint(self, to: str, amount: int) -> None:
        self.send(0, "mint", to, amount)

    def set_mode(self, mode: int, fee_bps: int = 0) -> None:
        self.send(0, "setMode", mode, fee_bps)

    def balance_of(self, account: str) -> int:
        return self.contract.functions.balanceOf(account).call()

    def outcome(self) -> tuple:
        return tuple(self.contract.functions.outcome().call())


def token_run(deployment: Deployment, mode: int = PLAIN, fee_bps: int = 0, funding: int | None = None,
              minted: int = 100 * AMOUNT, members=(1, 2, 3, 4, 5), **overrides) -> tuple[RewardRun, Token]:
    """:func:`reward_run` with a pool in a fresh QuirkyToken (``mode``), ``minted`` of it to the creator
    (``members[0]``) and the funders 8 and 9 (a claimer needs none)."""
    token = Token(deployment.w3)
    for index in (members[0], 8, 9):
        token.mint(deployment.client(index).address, minted)
    token.set_mode(mode, fee_bps)
    pool = params(token=token.address, **overrides)
    return reward_run(deployment, members=members, pool=pool, funding=funding), token
