"""A contribution case (issue 78, docs/FRAUD_PROOF.md "The contribution case"), on py-evm and on anvil: the
ledger's StepProver (its AggregationProver's) takes a bonded case against one contribution a committed round
lists; run claims on it are taken until the case's deadline; if every one is proven wrong (or none is made)
the round is overturned through the ledger, its attesters slashed, and the opener paid; a claim that stands
dismisses the case and is paid the opener's bond.

Rules, each on both backends: the coalition (the round's attesters) defends a contribution with a wrong claim
and an outsider refutes it and overturns the round; the coalition opens a case against an honest contribution
and its challengers (one lying, one walking away, at once) cannot refute the honest defender's claim: the case
is dismissed and the defender paid; a front-runner's copy of `openCase` is refused, and its copy of the
overturn pays the opener, not itself; the last block of each window (claims, overturn, dismissal, opening,
the round's proof window) still counts and the next one does not. The claims are the toy program's
(tests/test_step_proof_run.py): what a model's step is on chain is not built yet (docs/FRAUD_PROOF.md).
"""

from __future__ import annotations

import random

import pytest
from web3.logs import DISCARD

import contracts
from ledger.account import dev_account
from ledger.reverts import decode_revert
from ledger.stepcase import CaseClient, ledger_step_prover, run_stake
from ledger.stepproof import PHASES, StepProverClient, run_claim, run_game, state_roots
from tests.chain_backends import GAS, one_block
from tests.fraud_fixtures import commit
from tests.ledger_fixtures import deploy as deploy_ledger
from tests.ledger_fixtures import mine
from tests.step_binding_fixtures import STAKE, TOY_STEPS, fix_program, honest_round, subject_of
from tests.test_step_proof import _backend
from tests.test_step_proof_run import _honest_policy, _random_policy, _run, _start_state, _traces

CLOCK = 32  # the run's accusationBlocks: each side's clock in a game of the ledger's StepProver
WINDOW = 200  # the run's disputeBlocks: round 1's proof window
OUTSIDER, FRONT, HONEST_DEFENDER = 8, 5, 4  # dev accounts outside the run
SALT = b"\x5a" * 32


def _setup(w3):
    """The ledger's StepProver over a run whose round 1 (members 1 and 2 attest) lists three contributions."""
    round_ = honest_round()
    deployment = deploy_ledger(w3, min_stake=STAKE)
    client = StepProverClient(w3, ledger_step_prover(w3, deployment.ledger))
    committed = commit(deployment, round_, round_.honest, stake=STAKE, accusation_blocks=CLOCK,
                       dispute_blocks=WINDOW, inner_steps=TOY_STEPS, before=fix_program(client))
    client.bond = run_stake(w3, deployment.ledger, committed.run_id)
    return client, CaseClient(client), committed


def _address(w3, index: int) -> str:
    return dev_account(index, w3.eth.chain_id).address


def _named(client, name: str, sender: str, *args, value: int = 0) -> str:
    """The error ``name(*args)`` reverts with if sent now (an eth_call: nothing is mined)."""
    with pytest.raises(Exception) as info:
        getattr(client.contract.functions, name)(*args).call({"from": sender, "value": value})
    revert = decode_revert(info.value, name)
    return type(revert).__name__ if revert is not None else repr(info.value)


def _lands_at(w3, block: int) -> None:
    """Mine so that the next transaction is mined in ``block``."""
    mine(w3, block - 1 - w3.eth.block_number)


def _open(w3, cases, opener: str, subject) -> dict:
    cases.commit(opener, subject, SALT)
    cases.open(opener, subject, SALT)
    return cases.case(subject)


def _ledger_state(committed):
    reader = committed.deployment.client(0)
    attesters = reader.commit_record(committed.run_id, 1).attesters
    return reader, attesters


@pytest.mark.parametrize("backend", ["pyevm", "anvil"])
def test_a_coalitions_wrong_claim_is_refuted_and_the_outsiders_case_overturns_the_round(request, backend):
    w3 = _backend(request, backend)
    client, cases, committed = _setup(w3)
    stake = client.bond
    outsider, front, defender = _address(w3, OUTSIDER), _address(w3, FRONT), _address(w3, 1)
    subject = subject_of(committed, 0)
    case = _open(w3, cases, outsider, subject)
    assert (case["opener"], case["claims"], case["refuted"], case["stake"]) == (outsider, 0, 0, stake)
    # a member of the coalition defends the contribution with a claim one ulp off in step 3's add
    truth, cheat = _run(_start_state()), _run(_start_state(), 3, 1)
    claim = run_claim(_traces(cheat), subject)
    client._send("claimRun", defender, claim, subject.binding, value=stake)
    claim_id = bytes(client.contract.functions.runIdOf(claim, defender).call())
    assert _named(client, "overturnContribution", front, cases.key(subject), []) == "ProverStepCaseRunning"
    truth_roots = state_roots(_traces(truth))
    won, _ = run_game(client, _traces(cheat), defender, outsider, subject=subject, claimed=True,
                      judge_state=lambda i, root: root == truth_roots[i],
                      step_policy=_honest_policy(truth, cheat))
    assert not won and client.wrong(claim_id)
    assert (cases.case(subject)["claims"], cases.case(subject)["refuted"]) == (1, 1)
    reader, attesters = _ledger_state(committed)
    if w3.eth.block_number + 1 < case["deadline"]:  # the game may outlast the claims' deadline
        _lands_at(w3, case["deadline"])
    outsider_before = w3.eth.get_balance(outsider)
    receipt = cases.overturn(front, subject, attesters)  # sent by a front-runner: the opener is paid
    rewarded = reader.ledger_contract.events.ProverRewarded().process_receipt(receipt, errors=DISCARD)
    assert [(e.args.runId, e.args.round, e.args.prover) for e in rewarded] == [
        (committed.run_id, 1, outsider)]
    reward = rewarded[0].args.reward
    # the opener is paid, not the sender
    assert reward > 0 and w3.eth.get_balance(outsider) - outsider_before == reward
    assert client.contract.functions.balanceOf(front).call() == 0
    # the opener's bond back and the defender's bond from the game; the defender holds nothing
    assert client.contract.functions.balanceOf(outsider).call() == 3 * stake
    assert client.contract.functions.balanceOf(defender).call() == 0
    assert reader.invalid_from(committed.run_id) == 1
    for address in attesters:
        assert reader.member(committed.run_id, address).status == "slashed"
    assert _named(client, "overturnContribution", front, cases.key(subject), attesters) == "ProverStepNoCase"


@pytest.mark.parametrize("backend", ["pyevm", "anvil"])
def test_a_coalitions_case_against_an_honest_contribution_is_dismissed_and_pays_the_defender(
        request, backend):
    w3 = _backend(request, backend)
    client, cases, committed = _setup(w3)
    stake = client.bond
    opener, liar, quitter = (_address(w3, i) for i in (2, 1, 3))  # the coalition: members of the run
    defender = _address(w3, HONEST_DEFENDER)  # not a member: it holds the contribution's inputs
    subject = subject_of(committed, 1)
    case = _open(w3, cases, opener, subject)
    honest = _run(_start_state())
    claim = run_claim(_traces(honest), subject)
    client._send("claimRun", defender, claim, subject.binding, value=stake)
    claim_id = bytes(client.contract.functions.runIdOf(claim, defender).call())
    # two coalition challengers at once: neither game waits for the other
    client._send("challengeRun", quitter, claim_id, value=stake)
    won, _ = run_game(client, _traces(honest), defender, liar, subject=subject, claimed=True,
                      judge_state=lambda i, root: False, step_policy=_random_policy(random.Random(5), honest))
    assert won
    quit_game = bytes(client.contract.functions.gameIdOf(claim_id, quitter).call())
    client._send("postStateRoot", defender, quit_game, state_roots(_traces(honest))[3])
    state = client.game(quit_game)
    _lands_at(w3, state["turnSince"] + state["challengerLeft"] + 1)
    client._send("timeout", defender, quit_game)
    assert client.game(quit_game)["phase"] == PHASES.index("Done") and not client.wrong(claim_id)
    key = cases.key(subject)
    assert _named(client, "overturnContribution", opener, key, []) == "ProverStepClaimStands"
    # the case's last block before its end: not dismissed; in its end block it is
    _lands_at(w3, case["ends"] - 1)
    with pytest.raises(RuntimeError):
        cases.dismiss(opener, subject, claim_id)
    receipt = cases.dismiss(opener, subject, claim_id)
    assert receipt["blockNumber"] == case["ends"]
    # the two challengers' bonds and the opener's
    assert client.contract.functions.balanceOf(defender).call() == 3 * stake
    assert client.contract.functions.balanceOf(opener).call() == 0
    reader, _ = _ledger_state(committed)
    assert reader.invalid_from(committed.run_id) is None
    assert cases.case(subject)["opener"] == "0x" + "00" * 20


def _copied_open_in_one_block(w3, client, cases, subject, first: int, second: int) -> list[int]:
    """``first`` (a front-runner, the higher tip) and ``second`` (the committed opener) send the same
    openCase in one block; their receipts' statuses."""
    from ledger.stepcase import case_claim

    data = bytes.fromhex(client.contract.encode_abi("openCase", args=(case_claim(subject), subject.binding,
                                                                        SALT))[2:])
    hashes = []
    with one_block(w3):
        base = w3.eth.get_block("latest")["baseFeePerGas"]
        for position, index in enumerate((first, second)):
            account = dev_account(index, w3.eth.chain_id)
            tip = (2 - position) * 10**9
            tx = {"to": client.contract.address, "data": data, "value": client.bond, "gas": GAS, "type": 2,
                  "chainId": w3.eth.chain_id, "nonce": w3.eth.get_transaction_count(account.address),
                  "maxPriorityFeePerGas": tip, "maxFeePerGas": 2 * base + tip}
            hashes.append(w3.eth.send_raw_transaction(account.sign_transaction(tx).raw_transaction))
    receipts = [w3.eth.get_transaction_receipt(h) for h in hashes]
    assert receipts[0]["blockNumber"] == receipts[1]["blockNumber"]
    return [r["status"] for r in receipts]


@pytest.mark.parametrize("backend", ["pyevm", "anvil"])
def test_the_windows_last_blocks_and_a_front_runners_copied_case(request, backend):
    w3 = _backend(request, backend)
    client, cases, committed = _setup(w3)
    stake = client.bond
    outsider, front = _address(w3, OUTSIDER), _address(w3, FRONT)
    subject = subject_of(committed, 2)
    cases.commit(outsider, subject, SALT)
    assert _copied_open_in_one_block(w3, client, cases, subject, FRONT, OUTSIDER) == [0, 1]
    case = cases.case(subject)
    assert case["opener"] == outsider and client.contract.functions.balanceOf(front).call() == 0
    assert _named(client, "openCase", front, *_open_args(subject), value=stake) == "ProverStepNotCommitted"
    # claims: the deadline's last block takes one, the deadline's own block refuses the next
    traces = _traces(_run(_start_state()))
    claim = run_claim(traces, subject)
    _lands_at(w3, case["deadline"] - 1)
    client._send("claimRun", _address(w3, 1), claim, subject.binding, value=stake)
    with pytest.raises(RuntimeError):
        client._send("claimRun", _address(w3, 3), claim, subject.binding, value=stake)
    assert _named(client, "claimRun", _address(w3, 3), claim, subject.binding,
                  value=stake) == "ProverStepClaimsClosed"
    assert cases.case(subject)["claims"] == 1
    # opening: a case whose course ends in the proof window's last block is taken, one block later refused
    reader, _ = _ledger_state(committed)
    _, closes_at = reader.ledger_contract.functions.proofWindowOf(committed.run_id, 1).call()
    last_open = closes_at - 4 * CLOCK - 2
    late, later = subject_of(committed, 0), subject_of(committed, 1)
    for opener_subject in (late, later):
        cases.commit(outsider, opener_subject, SALT)
    _lands_at(w3, last_open)
    cases.open(outsider, late, SALT)
    assert cases.case(late)["ends"] == closes_at - 1
    with pytest.raises(RuntimeError):
        cases.open(outsider, later, SALT)
    assert _named(client, "openCase", outsider, *_open_args(later), value=stake) == "ProverStepWindowClosed"
    # a run claim in the proof window's last block is taken; in its first block past it, refused
    _lands_at(w3, closes_at - 1)
    client._send("claimRun", _address(w3, 2), run_claim(traces, later), later.binding, value=stake)
    with pytest.raises(RuntimeError):
        client._send("claimRun", _address(w3, 3), run_claim(traces, later), later.binding, value=stake)
    assert _named(client, "claimRun", _address(w3, 3), run_claim(traces, later), later.binding,
                  value=stake) == "ProverStepWindowClosed"


def _open_args(subject) -> tuple:
    from ledger.stepcase import case_claim

    return case_claim(subject), subject.binding, SALT


@pytest.mark.parametrize("backend", ["pyevm", "anvil"])
def test_an_undefended_contribution_is_overturned_and_the_ledgers_prover_takes_only_run_claims(
        request, backend):
    """A contribution nobody claims by the deadline loses (its contributor could not show its inputs); the
    ledger's StepProver takes no op or step claim, and only it may overturn through the AggregationProver."""
    w3 = _backend(request, backend)
    client, cases, committed = _setup(w3)
    outsider = _address(w3, OUTSIDER)
    subject = subject_of(committed, 1)
    case = _open(w3, cases, outsider, subject)
    reader, attesters = _ledger_state(committed)
    prover = reader.ledger_contract.functions.prover().call()
    aggregation = w3.eth.contract(address=prover, abi=contracts.artifact("AggregationProver")["abi"])
    with pytest.raises(Exception) as info:
        aggregation.functions.overturnByStep(committed.run_id, 1, attesters, outsider).call(
            {"from": outsider})
    assert type(decode_revert(info.value, "overturnByStep")).__name__ == "ProverNotStepProver"
    op = (1, 4, 0, 1, 4, 4, b"\x01" * 32, b"\x02" * 32, b"\x03" * 32)
    assert _named(client, "claim", outsider, op) == "ProverStepBadOp"
    assert _named(client, "overturnContribution", outsider, cases.key(subject), attesters) == \
        "ProverStepCaseRunning"
    _lands_at(w3, case["deadline"] - 1)  # the deadline's last block: refused; its own block: overturned
    with pytest.raises(RuntimeError):
        cases.overturn(outsider, subject, attesters)
    assert cases.overturn(outsider, subject, attesters)["blockNumber"] == case["deadline"]
    assert reader.invalid_from(committed.run_id) == 1
    assert client.contract.functions.balanceOf(outsider).call() == client.bond
