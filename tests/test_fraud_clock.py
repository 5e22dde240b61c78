"""Issue 62, the clock, the reward and the answers (docs/FRAUD_PROOF.md, "The data-availability challenge"),
each adversary's move on py-evm and on a real anvil:

- a coalition that answers every availability challenge in the last block of its window does not stop the
  bisection: each answer gives the challenger's game a fresh window, up to the run's ``maxGameSteps``, and the
  winning challenger gets back the bonds of its answered steps;
- a challenge in the last block of a round's dispute window keeps the round from being final: "final" is never
  undone;
- a coalition that leaves right after committing is still staked when the proof comes (unbonding covers the
  proof window), and a proof after the window is refused;
- a front-runner that copies a pending proof gains nothing: the honest prover's earlier commitment is paid;
- an answer sent through a relay contract is read, path and all, from the event log;
- a proof of round t through a wrong round t - 1 waits until t - 1 can no longer be overturned: the honest
  members of round t lose nothing.
"""

from __future__ import annotations

import dataclasses

import pytest
from eth_abi import encode

import contracts
from ledger import errors
from ledger.account import dev_account
from ledger.availability import WEIGHTS, availability_answer, availability_target
from ledger.chunkproof import build_proof, chunked_weights_root
from ledger.runparams import proof_window_bound
from node.commitments import stage_state
from tests.chain_backends import fees_since
from tests.fraud_fixtures import DILOCO, aggregated_round, changed, commit, contribution, tensors
from training.diloco import aggregate_with_report
from tests.ledger_fixtures import mine

SHAPES = {"a.weight": (16, 80), "b.bias": (70,)}  # 22 chunks: a bisection takes 5 steps
STAKE = 10**18
WINDOWS = {"accusation_blocks": 8, "dispute_blocks": 8, "max_game_steps": 4}


@pytest.fixture(scope="module")
def round_():
    return aggregated_round(SHAPES,
                            [contribution(SHAPES, "lowrank", 20, rank=4), contribution(SHAPES, "quant", 21)])


def _committed(w3, deploy_, round_, state, **params):
    return commit(deploy_(w3), round_, state, stake=STAKE, **{**WINDOWS, **params})


@pytest.fixture
def deployer():
    from tests.ledger_fixtures import deploy

    return lambda w3: deploy(w3, min_stake=STAKE)


def land_at(w3, block: int) -> None:
    """Mine so that the next transaction lands in ``block`` (it must be ahead)."""
    assert block > w3.eth.block_number, (block, w3.eth.block_number)
    if block > w3.eth.block_number + 1:
        mine(w3, block - w3.eth.block_number - 1)


def head_at(w3, block: int) -> None:
    """Mine so that the head (where a view is read) is ``block`` (or later, if it is already)."""
    if block > w3.eth.block_number:
        mine(w3, block - w3.eth.block_number)


def target(committed, chunk: int):
    return availability_target(committed.records[1], committed.stages[1], committed.states[1].factors, 0,
                               WEIGHTS, chunk)


def fee(receipt) -> int:
    return receipt["gasUsed"] * receipt["effectiveGasPrice"]


def test_last_block_answers_do_not_stop_the_game_and_the_winner_gets_its_bonds(chain_w3, deployer, round_):
    committed = _committed(chain_w3, deployer, round_, changed(round_.honest, 1, 17))
    w3, run_id = chain_w3, committed.run_id
    challenger, coalition = committed.prover(), committed.deployment.client(1)
    run = challenger.run_struct(run_id)
    bond, window = run["bond"], run["accusationBlocks"]
    closed_at = challenger.commit_block_of(run_id, 1) + run["disputeBlocks"]
    before, start = challenger.balance(), w3.eth.block_number
    land_at(w3, closed_at - 1)  # the game starts in the dispute window's last block
    for step in range(WINDOWS["max_game_steps"] - 1):
        challenge = challenger.challenge_availability(target(committed, step))
        deadline = challenger.challenge_of(challenge)["deadline"]
        land_at(w3, deadline - 1)  # the coalition answers in the last block it may
        coalition.answer_challenge(challenge, *availability_answer(committed.states[1], WEIGHTS, step))
        assert w3.eth.block_number > closed_at  # long after the dispute window
        assert not challenger.is_final(run_id, 1)
        land_at(w3, w3.eth.block_number + window - 1)  # and the challenger goes on in its window's last block
    game = challenger.game_of(run_id, 1, 0)
    assert game["escrow"] == 3 * bond and game["steps"] == 3
    # another account has no game with a fresh window: too late for it
    with pytest.raises(errors.ProverChallengeTooLate):
        committed.deployment.client(7).challenge_availability(target(committed, 10))
    last = challenger.challenge_availability(target(committed, 3))
    with pytest.raises(errors.ProverGameTooLong):  # the run's bound on one game
        challenger.challenge_availability(target(committed, 4))
    mine(w3, window)
    receipt = challenger.expire_challenge(last)  # unanswered: the round falls
    assert challenger.invalid_from(run_id) == 1
    assert challenger.game_of(run_id, 1, 0)["escrow"] == 0
    assert receipt["status"] == 1
    # every bond came back (3 answered, escrowed; the last returned) and half of two stakes on top: the game
    # cost the honest challenger its gas only, to the wei
    gas = fees_since(w3, challenger.address, start)
    assert challenger.balance() - before + gas == len(committed.attesters) * STAKE // 2
    for index in committed.attesters:  # the coalition lost its stakes (its answers' bonds with them)
        assert challenger.member(run_id, committed.deployment.client(index).address).stake == 0
    assert challenger.member(run_id, committed.deployment.client(3).address).stake == STAKE


def test_a_challenge_in_the_last_block_of_the_window_keeps_the_round_from_final(chain_w3, deployer, round_):
    # a right round
    committed = _committed(chain_w3, deployer, round_, round_.honest)
    w3, run_id = chain_w3, committed.run_id
    challenger, member = committed.prover(), committed.deployment.client(1)
    run = challenger.run_struct(run_id)
    closed_at = challenger.commit_block_of(run_id, 1) + run["disputeBlocks"]
    land_at(w3, closed_at - 1)
    challenge = challenger.challenge_availability(target(committed, 2))
    assert w3.eth.block_number == closed_at - 1
    assert not challenger.is_final(run_id, 1)  # the dispute window closed; a game on the round did not
    deadline = challenger.challenge_of(challenge)["deadline"]
    land_at(w3, deadline - 1)
    member.answer_challenge(challenge, *availability_answer(committed.states[1], WEIGHTS, 2))
    live_until = challenger.sender.call(challenger._prover, "liveUntil", (run_id, 1))
    _opens, closes = challenger.proof_window_of(run_id, 1)
    assert closes == live_until
    head_at(w3, closes - 1)
    assert not challenger.is_final(run_id, 1)
    head_at(w3, closes)
    assert challenger.is_final(run_id, 1)  # final now, and for good:
    with pytest.raises(errors.ProverChallengeTooLate):
        challenger.challenge_availability(target(committed, 3))
    assert challenger.is_final(run_id, 1)


def test_an_unanswered_last_block_challenge_falls_before_the_round_is_final(chain_w3, deployer, round_):
    committed = _committed(chain_w3, deployer, round_, round_.honest)
    w3, run_id = chain_w3, committed.run_id
    challenger = committed.prover()
    closed_at = challenger.commit_block_of(run_id, 1) + challenger.run_struct(run_id)["disputeBlocks"]
    land_at(w3, closed_at - 1)
    challenge = challenger.challenge_availability(target(committed, 2))
    deadline = challenger.challenge_of(challenge)["deadline"]
    for _ in range(deadline - w3.eth.block_number):  # it was never final on the way
        assert not challenger.is_final(run_id, 1)
        mine(w3, 1)
    challenger.expire_challenge(challenge)  # nobody kept the leaves: the round falls, never having been final
    assert challenger.invalid_from(run_id) == 1 and not challenger.is_final(run_id, 1)


def test_an_expiry_after_the_proof_window_is_refused(chain_w3, deployer, round_):
    committed = _committed(chain_w3, deployer, round_, round_.honest)
    challenger = committed.prover()
    challenge = challenger.challenge_availability(target(committed, 2))
    _opens, closes = challenger.proof_window_of(committed.run_id, 1)
    land_at(chain_w3, closes)
    with pytest.raises(errors.ProverProofWindowClosed):  # the challenger slept: the round is final
        challenger.expire_challenge(challenge)
    head_at(chain_w3, closes)
    assert challenger.is_final(committed.run_id, 1)


def test_a_coalition_that_leaves_at_once_is_still_slashed_by_a_proof(chain_w3, deployer, round_):
    committed = _committed(chain_w3, deployer, round_, changed(round_.honest, 1, 17))
    w3, run_id = chain_w3, committed.run_id
    prover = committed.prover()
    coalition = [committed.deployment.client(index) for index in committed.attesters]
    for member in coalition:
        member.leave_run(run_id)
    info = prover.run_info(run_id)
    assert info.unbonding_blocks == proof_window_bound(8, 8, WINDOWS["max_game_steps"])
    _opens, closes = prover.proof_window_of(run_id, 1)
    proof = committed.proof(1)
    prover.commit_proof(proof)
    land_at(w3, closes - 1)  # the proof window's last block: the coalition cannot have withdrawn yet
    for member in coalition:
        assert prover.member(run_id, member.address).unbonding_end > closes - 1
        with pytest.raises(errors.LedgerStillUnbonding):
            member.withdraw_stake(run_id)
    land_at(w3, closes - 1)
    before = prover.balance()
    receipt = prover.prove_wrong_aggregation(proof)
    assert prover.balance() - before + fee(receipt) == len(coalition) * STAKE // 2
    for member in coalition:
        assert prover.member(run_id, member.address).status == "slashed"


def test_a_proof_after_its_window_is_refused(chain_w3, deployer, round_):
    committed = _committed(chain_w3, deployer, round_, changed(round_.honest, 1, 17))
    prover = committed.prover()
    _opens, closes = prover.proof_window_of(committed.run_id, 1)
    land_at(chain_w3, closes)  # one block late (the last one it had: test_a_coalition_that_leaves_at_once...)
    with pytest.raises(errors.ProverProofWindowClosed):
        prover.prove_wrong_aggregation(committed.proof(1), commit=False)
    head_at(chain_w3, closes)
    assert prover.is_final(committed.run_id, 1)  # a wrong round nobody proved in time stands


def _send_raw(w3, index: int, to: str, data: bytes, tip: int) -> bytes:
    account = dev_account(index, w3.eth.chain_id)
    base = w3.eth.get_block("latest")["baseFeePerGas"]
    tx = {"to": to, "data": data, "value": 0, "gas": 8_000_000, "nonce": w3.eth.get_transaction_count(
        account.address, "pending"), "chainId": w3.eth.chain_id, "maxPriorityFeePerGas": tip,
        "maxFeePerGas": 2 * base + tip, "type": 2}
    return w3.eth.send_raw_transaction(account.sign_transaction(tx).raw_transaction)


def test_a_front_runner_copying_a_pending_proof_gains_nothing(chain_w3, deployer, round_):
    committed = _committed(chain_w3, deployer, round_, changed(round_.honest, 1, 17))
    w3, run_id = chain_w3, committed.run_id
    honest, thief = committed.prover(), committed.deployment.client(7)
    proof = committed.proof(1)
    honest.commit_proof(proof)  # a block (or more) before: nothing of the proof is shown by it
    calldata = honest.proof_calldata(proof)
    thief_before = thief.balance()
    anvil = "anvil" in type(w3.provider).__name__.lower() or hasattr(w3.provider, "endpoint_uri")
    if anvil:  # a real mempool: the copy pays a higher tip and is mined first, in the same block
        w3.provider.make_request("evm_setAutomine", [False])
        try:
            honest_tx = _send_raw(w3, committed.prover_index, honest.prover_address, calldata, 10**9)
            thief_tx = _send_raw(w3, 7, honest.prover_address, calldata, 50 * 10**9)
            w3.provider.make_request("evm_mine", [])
        finally:
            w3.provider.make_request("evm_setAutomine", [True])
        honest_receipt = w3.eth.get_transaction_receipt(honest_tx)
        thief_receipt = w3.eth.get_transaction_receipt(thief_tx)
        assert thief_receipt["blockNumber"] == honest_receipt["blockNumber"]
        assert thief_receipt["transactionIndex"] < honest_receipt["transactionIndex"]
        assert honest_receipt["status"] == 0  # the round was already overturned by the copy
    else:  # py-evm mines each transaction alone: the copy first
        thief_receipt = w3.eth.get_transaction_receipt(
            _send_raw(w3, 7, honest.prover_address, calldata, 50 * 10**9))
        with pytest.raises(errors.LedgerRunHalted):
            honest.prove_wrong_aggregation(proof)
    assert thief_receipt["status"] == 1  # the round fell all the same (safety first)
    assert honest.invalid_from(run_id) == 1
    held = honest.claim_of(run_id, 1)
    assert held["reward"] == len(committed.attesters) * STAKE // 2
    assert held["prover"] == thief.address
    with pytest.raises(errors.ProverNotClaimant):  # it committed nothing before: the window is the honest's
        thief.claim_reward(run_id, 1)
    before = honest.balance()
    receipt = honest.claim_reward(run_id, 1)
    assert honest.balance() - before + fee(receipt) == len(committed.attesters) * STAKE // 2
    mine(w3, WINDOWS["accusation_blocks"])
    with pytest.raises(errors.ProverNoClaim):  # after the window: nothing left for the copier
        thief.claim_reward(run_id, 1)
    assert thief.balance() < thief_before  # it paid gas and gained nothing


def test_a_bare_proof_keeps_its_reward_for_its_sender_after_the_claim_window(chain_w3, deployer, round_):
    committed = _committed(chain_w3, deployer, round_, changed(round_.honest, 1, 17))
    prover = committed.prover()
    prover.prove_wrong_aggregation(committed.proof(1), commit=False)
    with pytest.raises(errors.ProverNotClaimant):  # held for earlier committers first
        prover.claim_reward(committed.run_id, 1)
    mine(chain_w3, WINDOWS["accusation_blocks"])
    before = prover.balance()
    receipt = prover.claim_reward(committed.run_id, 1)
    assert prover.balance() - before + fee(receipt) == len(committed.attesters) * STAKE // 2


def test_an_answer_through_a_relay_is_read_from_the_log(chain_w3, deployer, round_):
    committed = _committed(chain_w3, deployer, round_, round_.honest)
    challenger, relayer = committed.prover(), committed.deployment.client(2)
    relay_artifact = contracts.artifact("AnswerRelay")
    relay = relayer.sender.deploy(relay_artifact, (), "deploy AnswerRelay")
    challenge = challenger.challenge_availability(target(committed, 5))
    leaf, path = availability_answer(committed.states[1], WEIGHTS, 5)
    contract = chain_w3.eth.contract(address=relay, abi=relay_artifact["abi"])
    packed = encode(["bytes", "bytes32[]"], [leaf, path])
    relayer.sender.transact(contract, "relay", (challenger.prover_address, challenge, packed), "relay")
    assert challenger.challenge_of(challenge)["settled"]
    # the outer calldata is the relay's: the answer, path and all, comes from AvailabilityAnswered
    assert challenger.availability_answer(challenge) == (leaf, [bytes(p) for p in path])


def test_a_proof_through_a_wrong_parent_pays_nothing_from_honest_stakes(chain_w3, deployer, round_):
    """Point 6: a coalition (members 1, 2) commits a wrong round 1; the honest members (3, 4) commit round 2
    from their own state; the coalition's proof of round 2 against round 1 waits while round 1 can be
    overturned, the honest members overturn it by a dispute verdict, and the proof then pays nothing."""
    w3 = chain_w3
    deployment = deployer(w3)
    run = deployment.member_run((1, 2, 3, 4), quorum=2, min_stake=STAKE, **WINDOWS)
    honest_prev, honest_1, wrong_1 = round_.prev, round_.honest, changed(round_.honest, 1, 17)
    honest_2 = _next_round()  # round 2, right: from the honest round 1
    states = [honest_prev, wrong_1, honest_2]
    signers = [(1, 2, 3, 4), (1, 2), (3, 4)]
    records, stages = [], []
    for number, (state, who) in enumerate(zip(states, signers, strict=True)):
        if number == 2:  # the honest members dispute round 1 with their own record at once
            own_1 = dataclasses.replace(records[1], weights_root=chunked_weights_root(
                [honest_1.leaf(), round_.other.leaf()]))
            for index in (3, 4):
                deployment.client(index).dispute(own_1, deployment.client(index).sign_record(own_1))
        leaves = [state.leaf(), round_.other.leaf()]
        record = dataclasses.replace(run.next_record(), weights_root=chunked_weights_root(leaves))
        run.client(who[0]).commit_round(record, run.sign(record, who))
        records.append(record)
        stages.append(leaves)
    coalition = deployment.client(1)
    proof = build_proof(records[1], records[2], stages[1], stages[2], wrong_1, honest_2, 1)
    assert coalition.proof_holds(proof)  # against the wrong round 1, the honest round 2 "differs"
    with pytest.raises(errors.ProverParentOpen):  # round 1 can still be overturned
        coalition.prove_wrong_aggregation(proof)
    # the members counted at round 1 overturn it by a verdict on the disputes
    verdict = [deployment.client(index).sign_round_verdict_for(records[1], False) for index in (3, 4)]
    deployment.client(3).resolve_dispute(records[1], False, verdict,
                                         deployment.client(3).commit_record(run.run_id, 1).attesters)
    assert coalition.invalid_from(run.run_id) == 1
    opens, _closes = coalition.proof_window_of(run.run_id, 2)
    head_at(w3, opens)  # (a preflight reads the head's block)
    with pytest.raises(errors.LedgerRunHalted):  # round 2 is invalid with its parent: nobody is slashed by it
        coalition.prove_wrong_aggregation(proof)
    for index in (3, 4):
        member = coalition.member(run.run_id, deployment.client(index).address)
        assert member.status == "active" and member.stake >= STAKE  # not slashed; bonds returned
    for index in (1, 2):
        assert coalition.member(run.run_id, deployment.client(index).address).status == "slashed"


def _next_round():
    """A right round 2: two contributions aggregated onto round 1's honest weights and momentum (as
    :func:`tests.fraud_fixtures.aggregated_round` makes round 1)."""
    weights, momentum = tensors(1, SHAPES), tensors(2, SHAPES, scale=0.1)
    blobs_1 = [contribution(SHAPES, "lowrank", 20, rank=4), contribution(SHAPES, "quant", 21)]
    first = aggregate_with_report(weights, momentum, blobs_1, DILOCO, stage_index=0, outer_round=1)
    blobs_2 = [contribution(SHAPES, "quant", seed, outer_round=2) for seed in (30, 31)]
    second = aggregate_with_report(first.new_global, first.new_momentum, blobs_2, DILOCO, stage_index=0,
                                   outer_round=2)
    return stage_state(0, second, blobs_2, DILOCO, 2, decode_args={"stage_index": 0, "outer_round": 2})
