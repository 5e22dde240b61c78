"""Issue 62's moves in the trust fuzzer's sum-tree walks (tests/trust_sums.py, mixed into
:class:`tests.trust_machine.TrustMachine`): the coalition that committed a lied round plays the clock, the
answers' channel, the reward and its stakes; one honest walker (the live node's FraudProver) must still
overturn the round, alone, at no net cost.

The coalition's moves:

* it answers a walk's challenge in the **last block** of its window (``late``): the chess clock gives the
  walker a fresh window after each answer, so the walk goes on past the round's dispute window (the captured
  run's is short: ``CAPTURED_DISPUTE_BLOCKS``);
* it answers **through a relay contract** (``relay``, contracts/src/test/AnswerRelay.sol): the outer calldata
  is the relay's, and the walker reads the leaf and path from ``AvailabilityAnswered``;
* a coalition **copier** watches the mempool: once the walker has committed to its proof, the copier's copy of
  the proof's calldata (a higher tip) is mined first; the round falls all the same, the walker's earlier
  commitment claims the held reward, and the copier gains nothing;
* it **leaves** the captured run right after committing and tries to withdraw at every step: no stake of an
  attester of a standing wrong round ever leaves (unbonding >= proof window + the longest game);
* (issue 79) a **squatter** copies each challenge of the walk from the mempool into a game of its own (its
  copy mined first) and answers each copy in the last block of its window: challenge ids name the challenger,
  so the walker's own steps still open and its clock is its own.

Invariants (``game_bounds_hold``, from ``sum_walks_hold`` after every step), G1 of issue 62:

* G1 and W (bound): a lied round whose walk has not ended is inside its proof window (the live walker
  overturns it before the window closes, squatted or not), and no walk gives up;
* G2 (no net cost): once overturned, the walker's reward and returned bonds exceed what the walk cost it (its
  gas and bonds); every attester is slashed (S1);
* G3 (front-running): a copier's gas and claims net it nothing.
"""

from __future__ import annotations

from eth_abi import encode
from hypothesis.stateful import precondition, rule

import contracts
from ledger.account import dev_account
from ledger.availability import availability_answer
from tests.ledger_fixtures import mine
from tests.trust_params import BOND, CAPTURED_REWARD, COALITION, COALITION_JOINER, HONEST, REFUSED

COPIER = COALITION[0]  # the coalition's front-runner (its wallet: its stake is slashed all the same)
SQUATTER = COALITION_JOINER  # the coalition's squatter (issue 79): a wallet of no captured run's


def send_raw(w3, index: int, to: str, data: bytes, tip: int):
    """Send ``data`` to ``to`` from dev account ``index`` with priority fee ``tip``; the receipt."""
    account = dev_account(index, w3.eth.chain_id)
    base = w3.eth.get_block("latest")["baseFeePerGas"]
    tx = {"to": to, "data": data, "value": 0, "gas": 8_000_000,
          "nonce": w3.eth.get_transaction_count(account.address, "pending"), "chainId": w3.eth.chain_id,
          "maxPriorityFeePerGas": tip, "maxFeePerGas": 2 * base + tip, "type": 2}
    return w3.eth.wait_for_transaction_receipt(
        w3.eth.send_raw_transaction(account.sign_transaction(tx).raw_transaction))


def fee(receipt) -> int:
    return receipt["gasUsed"] * receipt["effectiveGasPrice"]


class CopiedClient:
    """The walker's LedgerClient as a front-runner meets it: each proof it sends is committed first (mined,
    as the client does), then the copier's copy of its calldata, with a higher tip, is mined before it (py-evm
    and anvil with automine mine each transaction alone: the copy's goes first). Everything else is the
    client's."""

    def __init__(self, client, machine, case) -> None:
        self._client, self._machine, self._case = client, machine, case

    def __getattr__(self, name):
        return getattr(self._client, name)

    def prove_wrong_norm(self, proof, attesters=None, *, commit: bool = True):
        return self._copied(self._client.prove_wrong_norm, proof, attesters)

    def prove_wrong_aggregation(self, proof, attesters=None, *, commit: bool = True):
        return self._copied(self._client.prove_wrong_aggregation, proof, attesters)

    def _copied(self, send, proof, attesters):
        client = self._client
        if client.proof_committed_at(client.proof_commitment(proof, attesters)) is None:
            client.commit_proof(proof, attesters)
        copier = self._machine.client(COPIER)
        before = copier.balance()
        calldata = client.proof_calldata(proof, attesters)
        receipt = send_raw(self._machine.w3, COPIER, client.prover_address, calldata, 50 * 10**9)
        self._case.copier_gain += copier.balance() - before + fee(receipt)
        GameMoves.copies += receipt["status"] == 1
        return send(proof, attesters)


class SquattedClient:
    """The walker's LedgerClient as a squatter meets it (issue 79 point 2): the coalition copies each
    challenge the walker sends (from the mempool: its copy, with a higher tip, is mined first) into a game of
    its own, from a wallet of its own, and answers its copy in the last block of the copy's window
    (``GameMoves.squatter_answers``). Challenge ids name the challenger, so the walker's own challenge must
    still open and its clock must not be spent by the squatter's moves. Everything else is the client's."""

    def __init__(self, client, machine, case) -> None:
        self._client, self._machine, self._case = client, machine, case

    def __getattr__(self, name):
        return getattr(self._client, name)

    def challenge_availability(self, target):
        try:
            self._case.squats.append(self._machine.client(SQUATTER).challenge_availability(target))
            GameMoves.squats += 1
        except REFUSED:  # its own game's rules (its first step only within the dispute window)
            GameMoves.squats_refused += 1
        return self._client.challenge_availability(target)


class GameMoves:
    """The coalition's issue-62 moves and their invariants (see the module docstring)."""

    late_answers = 0  # answers sent in the last block of their window
    relayed_answers = 0  # answers sent through the relay contract
    copies = 0  # proofs a copier sent first
    withdrawals_refused = 0  # withdrawals of a lied round's attesters refused while it stood
    squats = 0  # the walker's challenges a squatter copied into its own game first (issue 79)
    squats_refused = 0  # copies the contract refused (the squatter's game past the dispute window)
    squats_answered_late = 0  # squatted challenges the coalition answered in their window's last block

    def answer_as_coalition(self, event: dict, leaf: bytes, path, how: str) -> None:
        """Answer the challenge ``event`` truthfully: at once, in the last block of its window (``late``) or
        through the relay contract (``relay``)."""
        answerer = self.client(COALITION[1])
        challenge = bytes(event["id"])
        if how == "late":  # each transaction is mined in a block of its own: this one in deadline - 1
            deadline = answerer.challenge_of(challenge)["deadline"]
            mine(self.w3, max(0, deadline - 2 - self.w3.eth.block_number))
            GameMoves.late_answers += 1
        if how != "relay":
            answerer.answer_challenge(challenge, leaf, path)
            return
        artifact = contracts.artifact("AnswerRelay")
        if getattr(self, "relay_address", None) is None:
            self.relay_address = answerer.sender.deploy(artifact, (), "deploy AnswerRelay")
        relay = self.w3.eth.contract(address=self.relay_address, abi=artifact["abi"])
        answerer.sender.transact(relay, "relay", (answerer.prover_address, challenge,
                                                  encode(["bytes", "bytes32[]"], [leaf, path])), "relay")
        GameMoves.relayed_answers += 1

    def walker_client(self, case):
        """The client the walker's chain uses on ``case``: its challenges squatted, its proof copied by a
        front-runner, where the case says so."""
        client = self.client(0)  # WALKER
        if case is not None and case.squatter:
            client = SquattedClient(client, self, case)
        return CopiedClient(client, self, case) if case is not None and case.copier else client

    def squatter_answers(self, case) -> None:
        """The squatter answers each open copy of the walker's challenges truthfully in the last block of the
        copy's window (the blocks pass meanwhile for the walker's challenge too)."""
        answerer = self.client(SQUATTER)
        for challenge in case.squats:
            state = answerer.challenge_of(challenge)
            if state["settled"] or self.w3.eth.block_number + 1 >= state["deadline"]:
                continue
            (event,) = [e for e in self.challenges_since(case.run_id, case.commit_block)
                        if bytes(e["id"]) == challenge]
            mine(self.w3, max(0, state["deadline"] - 2 - self.w3.eth.block_number))
            answerer.answer_challenge(challenge, *availability_answer(case.committed, event["which"],
                                                                      event["chunk"]))
            GameMoves.squats_answered_late += 1

    def coalition_leaves(self, case) -> None:
        """The lied round's attesters leave the captured run at once."""
        for index in COALITION:
            self.client(index).leave_run(case.run_id)
        case.left = True

    @precondition(lambda self: any(case.left for case in getattr(self, "lied_rounds", ())))
    @rule()
    def captured_coalition_withdraws(self) -> None:
        """Each attester that left a captured run tries to withdraw (a rule: any step): refused while its
        wrong round stands."""
        reader = self.client(HONEST[0])
        for case in self.lied_rounds:
            if not case.left:
                continue
            for index in COALITION:
                client = self.client(index)
                seat = client.member(case.run_id, client.address)
                if seat is None or seat.status != "unbonding":
                    continue
                try:
                    client.withdraw_stake(case.run_id)
                except REFUSED:
                    GameMoves.withdrawals_refused += 1
                    continue
                assert reader.invalid_from(case.run_id) is not None, \
                    f"G2: an attester of run {case.run_id}'s lied round withdrew while it stood"

    def walker_stays_live(self) -> None:
        """The walker acts after blocks pass (it is live): the next step, an expiry, a held proof."""
        case = self.lied_in_flight()
        if case is not None:
            self.walker_acts(case.prover.settle_challenges, case)
            self.count_end(case)
            self.after_walk(case)

    def after_walk(self, case) -> None:
        """Once a copied walk ended, the copier tries to take the reward: the walker's claim came first."""
        if not case.copier or case.copier_checked or not case.ended():
            return
        case.copier_checked = True
        copier = self.client(COPIER)
        before = copier.balance()
        try:
            receipt = copier.claim_reward(case.run_id, 1)
        except REFUSED:  # ProverNoClaim (the walker claimed) or ProverNotClaimant
            return
        case.copier_gain += copier.balance() - before + fee(receipt)

    def game_bounds_hold(self) -> None:
        """G1-G3 of the module docstring."""
        reader = self.client(HONEST[0])
        block = self.w3.eth.block_number
        for case in self.lied_rounds:
            log = case.prover.log if case.prover is not None else None
            # W (issue 79): the honest walk completes within the window, whoever squats its challenges
            assert log is None or not log.unprovable, \
                f"W/G1: the honest walk of run {case.run_id} gave up: {log.unprovable}"
            invalid = reader.invalid_from(case.run_id)
            if invalid is None:
                _opens, closes = reader.proof_window_of(case.run_id, 1)
                assert block < closes, \
                    (f"W/G1: the honest walk of run {case.run_id} did not complete within its proof window "
                     f"(closed at {closes}; squatted {len(case.squats)} times)")
                continue
            walker = self.client(0).address
            challenges = self.challenges_since(case.run_id, case.commit_block)
            bonds = BOND * sum(1 for event in challenges if event["challenger"] == walker)
            got = CAPTURED_REWARD + bonds
            assert got > case.paid, \
                f"G2: the walk of run {case.run_id} cost {case.paid} wei (gas and bonds) and paid back {got}"
            assert case.copier_gain == 0, \
                f"G3: the copier of run {case.run_id}'s proof gained {case.copier_gain}"
