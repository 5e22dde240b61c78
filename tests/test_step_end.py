"""A run claim's end is the contribution's payload (issue 78, docs/FRAUD_PROOF.md "The claim's end"), on
py-evm and on anvil, in a run whose end rule is set (StepProver.setEndRule: nothing carried between rounds,
no low-rank piece): anyone may bond that one element of a claim's end state is not what the contribution's
payload codes (StepProver.challengeEnd, the state tensor and element named); the defender must open the end
element, the committed start's and the payload's piece of that chunk within its clock, and the contract
recomputes ``v = fl(S - E)`` and checks the piece (raw: ``v``; quant: ``clamp(rne(fl(v / max(s, tiny))))``),
or the claim is proven wrong.

The round (tests/step_binding_fixtures.py ``toy_end_round``) starts from the toy's state and lists, first, the
run's encoder's coding of the toy's honest ``S - E``. A coalition that defends a payload one element off with
the true run from the committed start (every step right, the start right) had its claim stand before the end
was bound; now the honest challenger names that element, the defender cannot answer, the clock decides and
the case overturns the round, also when the claim came in the last block that takes claims. An honest claim
answers every element a challenger names.

Default tier: every test on py-evm and the coalition's on anvil; the other anvil runs are in the slow tier.
"""

from __future__ import annotations

import msgpack
import pytest

from ledger.account import dev_account
from ledger.chunkproof import tree_path
from ledger.stepcase import CaseClient, ledger_step_prover, run_stake
from ledger.stepdefense import DefenseSide, GameMemory, defender_move
from ledger.stepproof import PHASES, StepProverClient, end_opening, run_claim
from tests.chain_backends import GAS, one_block
from tests.fraud_fixtures import commit
from tests.ledger_fixtures import deploy as deploy_ledger
from tests.step_binding_fixtures import (
    STAKE,
    TOY_SHAPES,
    TOY_STEPS,
    end_subject,
    fix_program,
    toy_end_round,
    toy_origins,
)
from tests.test_step_case import CLOCK, OUTSIDER, WINDOW, _address, _lands_at, _ledger_state, _named, _open
from tests.test_step_proof import _backend
from tests.test_step_proof_run import _run, _start_state, _traces

FRONT = 9


def _setup(w3, codec: str = "raw", off: int | None = None, end_rule: bool = True):
    """The ledger's StepProver over a run whose round 0 commits the toy's start and round 1 lists the coding
    of the toy's S - E (``off``: one element of W off) and two others; the run's program, origins and (with
    ``end_rule``) end rule set by its creator before the first commit."""
    round_, blob = toy_end_round(codec, off)
    deployment = deploy_ledger(w3, min_stake=STAKE)
    client = StepProverClient(w3, ledger_step_prover(w3, deployment.ledger))
    program = fix_program(client, None, toy_origins())

    def before(run):
        program(run)
        if end_rule:
            client.set_end_rule(run.deployment.client(run.members[0]).address, run.run_id)

    committed = commit(deployment, round_, round_.honest, stake=STAKE, accusation_blocks=CLOCK,
                       dispute_blocks=WINDOW, inner_steps=TOY_STEPS, before=before)
    client.bond = run_stake(w3, deployment.ledger, committed.run_id)
    subject, pieces = end_subject(committed, blob)
    bits = {n: e.get("b", 0) for n, e in ((e["n"], e) for e in msgpack.unpackb(blob, raw=False)["t"])}
    return client, CaseClient(client), committed, subject, pieces, [bits[n] for n in TOY_SHAPES]


def _claim(w3, client, subject, defender: str):
    traces = _traces(_run(_start_state()))
    claim = run_claim(traces, subject)
    client._send("claimRun", defender, claim, subject.binding, value=client.bond)
    return bytes(client.contract.functions.runIdOf(claim, defender).call()), traces


def _challenge_end(client, claim_id: bytes, challenger: str, q: int, elem: int) -> bytes:
    client._send("challengeEnd", challenger, claim_id, q, elem, value=client.bond)
    return bytes(client.contract.functions.gameIdOf(claim_id, challenger).call())


def _opening(committed, traces, pieces, bits, q: int, elem: int, *, state=None, committed_chunk=None,
             piece=None, width=None) -> tuple:
    """``proveEnd``'s arguments after the game id (``state``, ``committed_chunk``, ``piece``, ``width``:
    another end element, committed chunk, payload piece or bit width than the true one)."""
    weights = committed.states[0].weight_leaves
    opening, true_piece, true_bits = end_opening(traces[-1], toy_origins(), q, elem, weights, pieces, bits[q])
    opening = list(opening)
    opening[4] = state or opening[4]
    opening[5] = committed_chunk or opening[5]
    return tuple(opening), piece or true_piece, true_bits if width is None else width


@pytest.mark.parametrize("backend", ["pyevm", "anvil"])
def test_a_coalitions_true_run_whose_end_is_not_its_payload_is_refuted_and_overturned(request, backend):
    w3 = _backend(request, backend)
    client, cases, committed, subject, pieces, bits = _setup(w3, off=5)
    stake = client.bond
    outsider, member = _address(w3, OUTSIDER), _address(w3, 1)
    case = _open(w3, cases, outsider, subject)
    claim_id, traces = _claim(w3, client, subject, member)  # the true run from the committed start
    # the payload codes the claim's end everywhere but at W[5]: another element is answered
    game = _challenge_end(client, claim_id, _address(w3, 5), 1, 4)
    client._send("proveEnd", member, game, *_opening(committed, traces, pieces, bits, 1, 4))
    assert client.game(game)["phase"] == PHASES.index("Done") and not client.wrong(claim_id)
    # the honest challenger names W[5]: no opening makes the piece the coding of S - E there
    game = _challenge_end(client, claim_id, outsider, 1, 5)
    assert _named(client, "proveEnd", member, game,
                  *_opening(committed, traces, pieces, bits, 1, 5)) == "ProverStepBadOpening"
    state = client.game(game)
    _lands_at(w3, state["turnSince"] + state["defenderLeft"])  # the defender's clock's last block: running
    with pytest.raises(RuntimeError):
        client._send("timeout", outsider, game)
    receipt = client._send("timeout", outsider, game)
    assert receipt["blockNumber"] == state["turnSince"] + state["defenderLeft"] + 1
    assert client.wrong(claim_id)
    assert (cases.case(subject)["claims"], cases.case(subject)["refuted"]) == (1, 1)
    reader, attesters = _ledger_state(committed)
    _lands_at(w3, max(case["deadline"], w3.eth.block_number + 1))
    cases.overturn(outsider, subject, attesters)
    assert reader.invalid_from(committed.run_id) == 1
    assert all(reader.member(committed.run_id, a).status == "slashed" for a in attesters)
    assert client.contract.functions.balanceOf(outsider).call() == 3 * stake


def test_without_the_end_rule_the_end_is_not_disputed_and_the_rule_is_the_creators_once(request):
    w3 = _backend(request, "pyevm")
    client, _cases, committed, subject, _pieces, _bits = _setup(w3, off=5, end_rule=False)
    claim_id, _traces_ = _claim(w3, client, subject, _address(w3, 1))
    assert _named(client, "challengeEnd", _address(w3, 5), claim_id, 1, 5,
                  value=client.bond) == "ProverStepEndUnbound"
    assert _named(client, "challengeEnd", _address(w3, 5), b"\x01" * 32, 1, 5,
                  value=client.bond) == "ProverStepUnknownClaim"
    creator = committed.deployment.client(1).address
    # after the first commit, nobody (the creator included) sets it
    assert client.contract.functions.endRuleOf(committed.run_id).call() == 0
    for sender in (creator, _address(w3, 5)):
        assert _named(client, "setEndRule", sender, committed.run_id, 1) == "ProverStepProgramFixed"


def _answers_every(w3, client, committed, subject, pieces, bits, elements) -> tuple[bytes, str]:
    defender = _address(w3, 4)  # not a member: it holds the contribution's inputs
    claim_id, traces = _claim(w3, client, subject, defender)
    assert _named(client, "challengeEnd", _address(w3, 5), claim_id, 3, 0,
                  value=client.bond) == "ProverStepBadElement"
    # the node's defender's moves (ledger.stepdefense.defender_move), from what it holds
    side = DefenseSide(traces, toy_origins(), committed.states[0].weight_leaves, lambda *_: 0, pieces, bits)
    for n, (q, elem) in enumerate(elements):
        game = _challenge_end(client, claim_id, _address(w3, 5 + n % 3), q, elem)  # a Done game is replaced
        move = defender_move(game, client.game(game), side, GameMemory())
        assert move == ("proveEnd", (game, *_opening(committed, traces, pieces, bits, q, elem)))
        client._send(move[0], defender, *move[1])
        assert client.game(game)["phase"] == PHASES.index("Done")
    assert not client.wrong(claim_id)
    assert client.contract.functions.balanceOf(defender).call() == len(elements) * client.bond
    return claim_id, defender


#: The first and last element of each toy tensor (x: 12, W: 32, bias: 8 elements) and one past bias.
EDGES = ((0, 0), (0, 11), (1, 0), (1, 31), (2, 0), (2, 7), (2, 8))


@pytest.mark.parametrize("backend", ["pyevm", pytest.param("anvil", marks=pytest.mark.slow)])
def test_an_honest_raw_claim_answers_every_end_dispute_and_a_wrong_opening_is_refused(request, backend):
    w3 = _backend(request, backend)
    client, _cases, committed, subject, pieces, bits = _setup(w3)
    claim_id, defender = _answers_every(w3, client, committed, subject, pieces, bits, (*EDGES, (1, 5)))
    traces = _traces(_run(_start_state()))
    game = _challenge_end(client, claim_id, _address(w3, 5), 1, 9)
    weights = committed.states[0].weight_leaves
    wrong = ({"committed_chunk": (weights[0], [])},  # another tensor's committed chunk
             {"piece": (pieces[0], tree_path(pieces, 0))},  # another chunk's payload piece
             {"state": _opening(committed, traces, pieces, bits, 0, 9)[0][4]})  # another tensor's end element
    for change in wrong:
        opening = _opening(committed, traces, pieces, bits, 1, 9, **change)
        assert _named(client, "proveEnd", defender, game, *opening) == "ProverStepBadOpening"
    client._send("proveEnd", defender, game, *_opening(committed, traces, pieces, bits, 1, 9))
    assert not client.wrong(claim_id)


def _quant_pieces(pieces: list[bytes], first: int, count: int) -> list[int]:
    """The i16 integers of a quant tensor's chunks from ``first`` (``count`` elements)."""
    out: list[int] = []
    chunk = first
    while len(out) < count:
        n = int.from_bytes(pieces[chunk][1:5], "big")
        out += [int.from_bytes(pieces[chunk][5 + 2 * i:7 + 2 * i], "big", signed=True) for i in range(n)]
        chunk += 1
    return out


@pytest.mark.parametrize("backend", ["pyevm", pytest.param("anvil", marks=pytest.mark.slow)])
def test_an_honest_quant_claim_answers_the_clamped_elements_and_keeps_its_bit_width(request, backend):
    w3 = _backend(request, backend)
    client, _cases, committed, subject, pieces, bits = _setup(w3, codec="quant")
    assert bits == [2, 2, 2]  # the run's encoder's choice at its error budget: q in {-1, 0, 1}
    from tests.step_binding_fixtures import toy_start_and_end

    start, end = toy_start_and_end()
    w_q = _quant_pieces(pieces, 1, 32)  # W's chunk: stage chunk 1
    v = (start["b"] - end["b"]).reshape(-1)
    clamped = [e for e in range(32) if abs(w_q[e]) == 1 and abs(float(v[e])) > 0]
    zero = [e for e in range(32) if w_q[e] == 0]
    assert clamped and zero, (w_q, v)
    claim_id, defender = _answers_every(w3, client, committed, subject, pieces, bits,
                                        (*EDGES, (1, clamped[0]), (1, clamped[-1])))
    # the bit width is fixed by the first answer on a tensor: another is refused even where it codes the same
    traces = _traces(_run(_start_state()))
    game = _challenge_end(client, claim_id, _address(w3, 5), 1, zero[0])
    other = _opening(committed, traces, pieces, bits, 1, zero[0], width=4)
    assert _named(client, "proveEnd", defender, game, *other) == "ProverStepBadOpening"
    client._send("proveEnd", defender, game, *_opening(committed, traces, pieces, bits, 1, zero[0]))
    assert not client.wrong(claim_id)


def _copied_challenge_in_one_block(w3, client, claim_id: bytes, first: int, second: int) -> list[int]:
    """``first`` (a front-runner, the higher tip) and ``second`` send the same challengeEnd in one block."""
    return copied_in_one_block(w3, client, "challengeEnd", (claim_id, 1, 5), first, second)


def copied_in_one_block(w3, client, name: str, args: tuple, first: int, second: int) -> list[int]:
    """``first`` (a front-runner, the higher tip) and ``second`` send the same StepProver call ``name(*args)``
    with the claim's bond in one block; their receipts' statuses."""
    data = bytes.fromhex(client.contract.encode_abi(name, args=args)[2:])
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


@pytest.mark.parametrize("backend", ["pyevm", pytest.param("anvil", marks=pytest.mark.slow)])
def test_a_front_runners_copied_end_challenge_runs_beside_the_honest_one(request, backend):
    w3 = _backend(request, backend)
    client, _cases, _committed, subject, _pieces, _bits = _setup(w3, off=5)
    stake, outsider, front = client.bond, _address(w3, OUTSIDER), _address(w3, FRONT)
    claim_id, _traces_ = _claim(w3, client, subject, _address(w3, 1))
    assert _copied_challenge_in_one_block(w3, client, claim_id, FRONT, OUTSIDER) == [1, 1]
    games = [bytes(client.contract.functions.gameIdOf(claim_id, who).call()) for who in (outsider, front)]
    assert all(client.game(g)["phase"] == PHASES.index("End") for g in games)
    state = client.game(games[0])
    _lands_at(w3, state["turnSince"] + state["defenderLeft"] + 1)
    client._send("timeout", outsider, games[0])  # the honest challenger's game decides first
    client._send("timeout", front, games[1])
    assert client.wrong(claim_id)
    balance = client.contract.functions.balanceOf
    assert (balance(outsider).call(), balance(front).call()) == (2 * stake, stake)


@pytest.mark.parametrize("backend", ["pyevm", pytest.param("anvil", marks=pytest.mark.slow)])
def test_an_answer_in_the_clocks_last_block_is_taken_and_one_block_later_refused(request, backend):
    w3 = _backend(request, backend)
    client, _cases, committed, subject, pieces, bits = _setup(w3)
    defender = _address(w3, 4)
    claim_id, traces = _claim(w3, client, subject, defender)
    late, later = (_challenge_end(client, claim_id, _address(w3, i), 1, 3) for i in (5, 6))
    for game, extra in ((late, 0), (later, 1)):
        state = client.game(game)
        _lands_at(w3, max(w3.eth.block_number + 1, state["turnSince"] + state["defenderLeft"] + 2 * extra))
        opening = _opening(committed, traces, pieces, bits, 1, 3)
        if extra:
            assert _named(client, "proveEnd", defender, game, *opening) == "ProverStepClockOut"
            client._send("timeout", _address(w3, 6), game)
        else:
            client._send("proveEnd", defender, game, *opening)
    assert client.wrong(claim_id)
    assert client.contract.functions.balanceOf(defender).call() == client.bond


def test_a_claim_in_the_deadlines_last_block_is_refuted_by_its_end_before_the_case_ends(request):
    """The case's course (docs/FRAUD_PROOF.md "The contribution case"): a coalition's claim in the last block
    that takes claims, whose payload is one element off, is challenged at its end and refuted by the clock
    before the case's end, so the round is overturned and the coalition cannot dismiss the case."""
    w3 = _backend(request, "pyevm")
    client, cases, committed, subject, _pieces, _bits = _setup(w3, off=5)
    outsider, member = _address(w3, OUTSIDER), _address(w3, 1)
    case = _open(w3, cases, outsider, subject)
    _lands_at(w3, case["deadline"] - 1)
    claim_id, _traces_ = _claim(w3, client, subject, member)
    game = _challenge_end(client, claim_id, outsider, 1, 5)
    state = client.game(game)
    _lands_at(w3, state["turnSince"] + state["defenderLeft"] + 1)
    client._send("timeout", outsider, game)
    assert client.wrong(claim_id) and w3.eth.block_number < case["ends"]
    _lands_at(w3, case["ends"] + 1)  # from the case's end a standing claim would dismiss it; not this one
    assert _named(client, "dismissCase", member, cases.key(subject), claim_id) == "ProverStepClaimClosed"
    reader, attesters = _ledger_state(committed)
    cases.overturn(outsider, subject, attesters)
    assert reader.invalid_from(committed.run_id) == 1
