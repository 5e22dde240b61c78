"""A node defends its own contributions (issue 78, docs/FRAUD_PROOF.md "The node defends its contributions"),
on py-evm and on anvil: the node's case defender (node/live/fraud/defender.py), built from the node's own
parts (its NodeChain over its account, its ChunkedStates holding the round's start, the reward sources its
data directory kept), notices a case opened against a contribution its account signed, posts the run claim
it computes from what it kept (the run's program file, node/stepprogram.py, run from the committed start)
and answers every move of every game on it, one poll at a time, against challengers it does not control.

What is tested: an adversarial opener's case on the node's honest contribution, with a lying challenger
(random answers at every level), one that disputes the claim's start and one that walks away, is dismissed:
every challenger loses its bond to the node, the opener's bond too, and the node withdraws them; a challenger
that goes silent is timed out by the node; a case the node cannot answer (no program, another program than
the run's, its start not held) is logged as an error naming why, and a case on another member's contribution
is left to it; the node's own thread, under CPU load, answers a full game within the clock (the chain's
blocks, mined steadily while it plays). The claims are the toy program's (tests/step_binding_fixtures.py): a
model's step is not a program yet (docs/FRAUD_PROOF.md "Not done", 2).
"""

from __future__ import annotations

import logging
import random
import threading
from types import SimpleNamespace

import pytest
import torch
from eth_abi import decode

from ledger.stepcase import CaseClient, ledger_step_prover, run_stake
from ledger.stepproof import PHASES, StepProverClient
from node.commitments.registry import scheme_named
from node.live.chain.onchain import NodeChain
from node.live.fraud.chunkstate import ChunkedStates
from node.live.fraud.defender import CaseDefender
from node.stepprogram import StepProgram
from node.store.rewardsources import REWARD_SOURCES_DIR, write_leaves
from tests.fraud_fixtures import commit
from tests.ledger_fixtures import deploy as deploy_ledger
from tests.ledger_fixtures import mine
from tests.step_binding_fixtures import STAKE, TOY_STEPS, fix_program, subject_of, toy_origins, toy_round
from tests.test_step_case import SALT, _address, _lands_at, _named
from tests.test_step_proof import COPIES, PROGRAM, _backend

CLOCK, WINDOW = 32, 200  # the run's accusationBlocks (each side's clock) and disputeBlocks
NODE = 3  # the defending node: member 3 signed round 1's contribution 2 and attests nothing
OWN = 2
OPENER, LIAR, START, QUITTER = 8, 5, 7, 9  # dev accounts outside the run


def toy_program() -> StepProgram:
    """The toy step as the run's program file holds it (its origins: the committed stage's tensors)."""
    origins = tuple(tuple(decode(["uint32", "uint64", "uint64", "uint64"], o)) for o in toy_origins())
    return StepProgram(tuple(PROGRAM), tuple(COPIES), 3, origins)


def _setup(w3, tmp_path, clock: int = CLOCK, window: int = WINDOW, end_rule: bool = False, round_=None,
           program: tuple | None = None, data=None):
    """A run whose round 0 commits the toy's start and round 1 lists three contributions (member ``j + 1``
    signed contribution ``j``), its program the toy's; and the parts of member ``NODE``'s node that a defense
    reads: its chain, its states (round 0's, the start) and its data directory's reward sources.
    ``end_rule``: the run's creator sets the plain end rule too (StepProver.setEndRule); ``round_``: another
    round than ``toy_round()``'s; ``program``: another program's ``RunClaim`` fields (same state); ``data``:
    the run's data terms (``ledger.stepdata.DataTerms``, StepProver.setData; None: none)."""
    from ledger.stepdata import DataClient

    round_ = round_ or toy_round()
    deployment = deploy_ledger(w3, min_stake=STAKE)
    client = StepProverClient(w3, ledger_step_prover(w3, deployment.ledger))
    fix = fix_program(client, program, toy_origins())

    def before(run):
        fix(run)
        creator = run.deployment.client(run.members[0]).address
        if end_rule:
            client.set_end_rule(creator, run.run_id)
        if data is not None:
            DataClient(client).set_data(creator, run.run_id, data)

    committed = commit(deployment, round_, round_.honest, stake=STAKE, accusation_blocks=clock,
                       dispute_blocks=window, inner_steps=TOY_STEPS, before=before)
    client.bond = run_stake(w3, deployment.ledger, committed.run_id)
    cfg = SimpleNamespace(commitment_scheme=scheme_named("normed"))
    states = ChunkedStates(cfg=cfg, host=None, layout=None, config_hash=b"",
                           sources_dir=tmp_path / REWARD_SOURCES_DIR, keeps_starts=True)
    for outer_round, state in enumerate(committed.states):  # what the finisher and the committer keep
        states.replace(outer_round, 0, state)
        write_leaves(tmp_path / REWARD_SOURCES_DIR, outer_round,
                     [leaf.encode() for leaf in committed.stages[outer_round]])
    return client, CaseClient(client), committed, states


#: The program a node is given by default here: the run's.
RUNS = "the run's"


def _defender(committed, states, tmp_path, program: StepProgram | None | str = RUNS, member: int = NODE,
              **kwargs) -> CaseDefender:
    """Member ``member``'s case defender (``program``: its step program file's, None for none)."""
    chain = NodeChain(committed.deployment.client(member))
    return CaseDefender(run_id=committed.run_id, chain=chain, states=states,
                        program=toy_program() if program == RUNS else program, data_dir=tmp_path,
                        stop=threading.Event(), **kwargs)


def _open(cases, committed, index: int = OWN):
    """An outsider's case against round 1's contribution ``index``: its subject and the case."""
    opener = _address(committed.deployment.w3, OPENER)
    subject = subject_of(committed, index)
    cases.commit(opener, subject, SALT)
    cases.open(opener, subject, SALT)
    return subject, cases.case(subject)


def _claim_of(client, cases, subject, defender: str) -> bytes:
    """The id of ``defender``'s run claim on the subject's contribution (from its RunClaimed log)."""
    events = client.contract.events.RunClaimed().get_logs(from_block=0)
    ids = [bytes(e.args.claimId) for e in events
           if bytes(e.args.payloadRoot) == subject.payload_root and e.args.defender == defender]
    assert len(ids) == 1, ids
    return ids[0]


def _liar(rng: random.Random, program=PROGRAM):
    """A challenger that answers every level at random (a dispute of the copy or the trace, each root and
    sum agreed or not, any element of ``program``'s op)."""
    def move(client, game_id: bytes, state: dict, challenger: str) -> None:
        phase = PHASES[state["phase"]]
        if phase == "Steps":
            client._send("judgeStateRoot", challenger, game_id, rng.random() < 0.5)
        elif phase == "TraceEnd":
            if rng.random() < 0.3:
                client._send("disputeCopy", challenger, game_id, rng.randrange(8))
            else:
                client._send("disputeTrace", challenger, game_id)
        elif phase == "Ops":
            client._send("judgeRoot", challenger, game_id, rng.random() < 0.5)
        elif phase == "Pick":
            _kind, rows, _inner, cols, *_ = program[state["lo"]]
            client._send("pickElement", challenger, game_id, rng.randrange(rows * cols))
        elif phase == "Sums":
            client._send("judge", challenger, game_id, rng.random() < 0.5)
    return move


def _fixed(judgment: bool, dispute: str):
    """A challenger that gives one judgment everywhere and one kind of dispute at the trace's end (``copy``:
    a random state leaf of the end tree)."""
    rng = random.Random(1)

    def move(client, game_id: bytes, state: dict, challenger: str) -> None:
        phase = PHASES[state["phase"]]
        if phase == "TraceEnd":
            if dispute == "copy":
                client._send("disputeCopy", challenger, game_id, rng.randrange(8))
            else:
                client._send("disputeTrace", challenger, game_id)
        elif phase == "Pick":
            _kind, rows, _inner, cols, *_ = PROGRAM[state["lo"]]
            client._send("pickElement", challenger, game_id, rows * cols - 1)
        else:
            name = {"Steps": "judgeStateRoot", "Ops": "judgeRoot", "Sums": "judge"}[phase]
            client._send(name, challenger, game_id, judgment)
    return move


def _play(client, defender: CaseDefender, games: dict, mine_each: bool = False) -> None:
    """Alternate the node's polls and the challengers' moves (``games``: game id -> (challenger, its move
    policy, or None for one that never moves)) until no game waits for a challenger that moves."""
    for _ in range(400):
        defender.poll()
        waiting = False
        for game_id, (challenger, policy) in games.items():
            state = client.game(game_id)
            if state["phase"] == PHASES.index("Done") or state["defenderTurn"] or policy is None:
                continue
            waiting = True
            policy(client, game_id, state, challenger)
        if not waiting and all(client.game(g)["phase"] == PHASES.index("Done") or policy is None
                               for g, (_c, policy) in games.items()):
            return
    raise AssertionError("the games did not end in 400 polls")


#: py-evm's runs of the games take three times anvil's: in the slow tier.
BACKENDS = [pytest.param("pyevm", marks=pytest.mark.slow), "anvil"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_node_defends_its_contribution_and_every_challenger_loses_its_bond(request, backend, tmp_path):
    w3 = _backend(request, backend)
    client, cases, committed, states = _setup(w3, tmp_path, window=600)  # room for a second case
    stake, node = client.bond, _address(w3, NODE)
    defender = _defender(committed, states, tmp_path)
    subject, case = _open(cases, committed)
    defender.poll()  # the node notices the case and claims its contribution
    claim_id = _claim_of(client, cases, subject, node)
    assert cases.case(subject)["claims"] == 1 and not client.wrong(claim_id)
    liar, start, quitter = (_address(w3, i) for i in (LIAR, START, QUITTER))
    client._send("challengeRun", liar, claim_id, value=stake)
    client._send("challengeStart", start, claim_id, 1, 5, value=stake)  # W[5] of the start disputed
    client._send("challengeRun", quitter, claim_id, value=stake)
    game = {a: bytes(client.contract.functions.gameIdOf(claim_id, a).call()) for a in (liar, start, quitter)}
    _play(client, defender, {game[liar]: (liar, _liar(random.Random(7))), game[start]: (start, None),
                             game[quitter]: (quitter, None)})
    assert client.game(game[liar])["phase"] == PHASES.index("Done")
    assert client.game(game[start])["phase"] == PHASES.index("Done")  # the node opened the committed W[5]
    # the quitter walked away: once its clock is spent the node takes its game
    quit_state = client.game(game[quitter])
    _lands_at(w3, quit_state["turnSince"] + quit_state["challengerLeft"] + 2)  # its head is past the clock
    defender.poll()
    assert client.game(game[quitter])["phase"] == PHASES.index("Done") and not client.wrong(claim_id)
    assert client.contract.functions.balanceOf(node).call() == 3 * stake  # every challenger's bond
    assert _named(client, "overturnContribution", liar, cases.key(subject), []) == "ProverStepClaimStands"
    # from the case's end on the node dismisses it (the opener's bond is its) and withdraws
    _lands_at(w3, max(case["ends"] + 1, w3.eth.block_number + 1))  # the head at the case's end
    before = w3.eth.get_balance(node)
    defender.poll()
    assert cases.case(subject)["opener"] == "0x" + "00" * 20
    assert client.contract.functions.balanceOf(node).call() == 0
    assert w3.eth.get_balance(node) - before > 4 * stake - 10**16  # four bonds, less two transactions' gas
    reader = committed.deployment.client(0)
    assert reader.invalid_from(committed.run_id) is None
    # the same case opened again: the standing claim counts for it, and its bond is the node's too
    opener, salt = _address(w3, OPENER), b"\x5b" * 32
    cases.commit(opener, subject, salt)
    cases.open(opener, subject, salt)
    again = cases.case(subject)
    assert (again["claims"], again["refuted"]) == (1, 0)
    defender.poll()
    _lands_at(w3, again["deadline"] + 1)
    assert _named(client, "overturnContribution", opener, cases.key(subject), []) == "ProverStepClaimStands"
    _lands_at(w3, again["ends"] + 1)
    defender.poll()
    assert cases.case(subject)["opener"] == "0x" + "00" * 20
    assert client.contract.functions.balanceOf(node).call() == 0  # dismissed, paid and withdrawn
    assert reader.invalid_from(committed.run_id) is None


def test_every_kind_of_lying_challenger_loses_to_the_node(request, tmp_path):
    """Five challengers at once on the node's claim: one that agrees with everything, one that disagrees
    with everything, one that disputes a copy of the end tree, two that answer at random."""
    w3 = _backend(request, "anvil")
    # each side's clock 200 blocks: here every transaction is a block of its own, so five games at once
    # spend five blocks of each game's clock a round of moves (on a chain with timed blocks the node's moves
    # of one poll share blocks: ledger.tx send_all)
    client, cases, committed, states = _setup(w3, tmp_path, clock=200, window=1000)
    stake, node = client.bond, _address(w3, NODE)
    defender = _defender(committed, states, tmp_path)
    subject, _case = _open(cases, committed)
    defender.poll()
    claim_id = _claim_of(client, cases, subject, node)
    policies = {4: _fixed(True, "trace"), 5: _fixed(False, "trace"), 6: _fixed(False, "copy"),
                7: _liar(random.Random(21)), 9: _liar(random.Random(22))}
    games = {}
    for index, policy in policies.items():
        challenger = _address(w3, index)
        client._send("challengeRun", challenger, claim_id, value=stake)
        games[bytes(client.contract.functions.gameIdOf(claim_id, challenger).call())] = (challenger, policy)
    _play(client, defender, games)
    assert all(client.game(g)["phase"] == PHASES.index("Done") for g in games) and not client.wrong(claim_id)
    assert client.contract.functions.balanceOf(node).call() == 5 * stake


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_silent_challenger_is_timed_out_by_the_node(request, backend, tmp_path):
    w3 = _backend(request, backend)
    client, cases, committed, states = _setup(w3, tmp_path)
    node, silent = _address(w3, NODE), _address(w3, LIAR)
    defender = _defender(committed, states, tmp_path)
    subject, _case = _open(cases, committed)
    defender.poll()
    claim_id = _claim_of(client, cases, subject, node)
    client._send("challengeRun", silent, claim_id, value=client.bond)
    game_id = bytes(client.contract.functions.gameIdOf(claim_id, silent).call())
    defender.poll()  # the node posts its first state root; the challenger never answers
    state = client.game(game_id)
    assert not state["defenderTurn"] and state["midPosted"]
    _lands_at(w3, state["turnSince"] + state["challengerLeft"])  # its clock's last block: not yet
    defender.poll()
    assert client.game(game_id)["phase"] == PHASES.index("Steps")
    mine(w3, 2)
    defender.poll()  # once the head is past the clock, the node's timeout is taken
    assert client.game(game_id)["phase"] == PHASES.index("Done") and not client.wrong(claim_id)
    assert client.contract.functions.balanceOf(node).call() == client.bond


def test_a_case_the_node_cannot_answer_is_logged_with_why(request, tmp_path, caplog):
    w3 = _backend(request, "anvil")
    client, cases, committed, states = _setup(w3, tmp_path)
    caplog.set_level(logging.INFO, logger="node.live.fraud.defender")
    # a case on another member's contribution is left to its contributor: no claim
    subject, _case = _open(cases, committed, index=0)
    _defender(committed, states, tmp_path).poll()
    assert cases.case(subject)["claims"] == 0 and "not this node's" in caplog.text
    subject, _case = _open(cases, committed)
    for program, why in ((None, "no step program configured"), (_other_program(), "not the run's")):
        caplog.clear()
        _defender(committed, states, tmp_path, program=program).poll()
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and "CANNOT DEFEND" in errors[0] and why in errors[0], errors
    # its start dropped (a restart): said so
    caplog.clear()
    empty = ChunkedStates(cfg=SimpleNamespace(commitment_scheme=scheme_named("normed")), host=None,
                          layout=None, config_hash=b"")
    _defender(committed, empty, tmp_path).poll()
    assert "no longer holds its state of round 0" in caplog.text
    assert cases.case(subject)["claims"] == 0


def test_in_a_run_whose_end_is_disputed_the_node_posts_no_claim_it_cannot_answer(request, tmp_path, caplog):
    """In a run with the plain end rule the node checks its claim's end against its payload before it claims
    (tests/test_case_defense_end.py: one that codes it is defended): a payload that is not the program's end
    (here a random contribution) is said and no claim is posted (it would lose its bond to the first end
    dispute)."""
    w3 = _backend(request, "pyevm")
    client, cases, committed, states = _setup(w3, tmp_path, end_rule=True)
    caplog.set_level(logging.INFO, logger="node.live.fraud.defender")
    subject, _case = _open(cases, committed)
    _defender(committed, states, tmp_path).poll()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "CANNOT DEFEND" in errors[0] and "end dispute" in errors[0], errors
    assert "does not code the program's end fl(S - E) (state tensor 0 element 0: raw piece" in errors[0]
    assert cases.case(subject)["claims"] == 0


def _other_program() -> StepProgram:
    """The toy program with its update added instead of subtracted: not the run's."""
    ops = list(PROGRAM)
    ops[3] = (1, *ops[3][1:])
    program = toy_program()
    return StepProgram(tuple(ops), program.copies, program.depth, program.origins)


def _load(stop: threading.Event) -> None:
    """CPU work on the node's machine: products in torch's threads while the GIL is taken in between."""
    a = torch.randn(256, 256)
    while not stop.is_set():
        a = torch.tanh(a @ a.T * 1e-3)
        sum(i * i for i in range(2000))


@pytest.mark.slow
def test_the_nodes_thread_under_load_answers_within_the_clock(request, tmp_path):
    """Anvil mines a block every tick whatever the node does; the node's own thread plays a random liar's
    full game (its clock 200 blocks for all its moves) while three threads load the CPU."""
    w3 = _backend(request, "anvil")
    client, cases, committed, states = _setup(w3, tmp_path, clock=200, window=1000)
    node, liar = _address(w3, NODE), _address(w3, LIAR)
    defender = _defender(committed, states, tmp_path, every_s=0.2)
    stop = threading.Event()
    threads = [threading.Thread(target=_load, args=(stop,), daemon=True) for _ in range(3)]
    threads.append(threading.Thread(target=defender.run, daemon=True))
    defender.stop = stop
    for thread in threads:
        thread.start()
    try:
        subject, _case = _open(cases, committed)
        claim_id = None
        while claim_id is None:  # the node's thread claims; blocks go on meanwhile
            w3.provider.make_request("evm_mine", [])
            stop.wait(0.25)
            if cases.case(subject)["claims"]:
                claim_id = _claim_of(client, cases, subject, node)
        client._send("challengeRun", liar, claim_id, value=client.bond)
        game_id = bytes(client.contract.functions.gameIdOf(claim_id, liar).call())
        policy = _liar(random.Random(11))
        while (state := client.game(game_id))["phase"] != PHASES.index("Done"):
            if not state["defenderTurn"]:
                policy(client, game_id, state, liar)
            else:
                w3.provider.make_request("evm_mine", [])
            stop.wait(0.25)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
    assert not client.wrong(claim_id)
    assert client.contract.functions.balanceOf(node).call() == client.bond


class _ClosedThrough:
    """Proof windows closed for every round up to ``closed`` (the chain's, set by hand)."""

    def __init__(self, closed: int) -> None:
        self.closed = closed

    def open(self, outer_round: int) -> bool:
        return outer_round > self.closed

    def forget(self, outer_round: int) -> None:
        pass


def test_a_defending_node_keeps_a_round_while_a_case_on_the_next_round_can_open():
    """Round 0's state is the start of round 1's contributions: a node that defends them keeps it until round
    1's proof window closes, not only round 0's; one that does not defend drops it with round 0's window."""
    state = toy_round().prev
    for keeps in (False, True):
        window = _ClosedThrough(0)
        states = ChunkedStates(cfg=SimpleNamespace(commitment_scheme=scheme_named("normed")), host=None,
                               layout=None, config_hash=b"", window=window, keeps_starts=keeps)
        for outer_round in range(7):
            states.replace(outer_round, 0, state)
        states.forget_before(6)  # rounds 0 and 1 are past the published rounds
        assert (states.state(0, 0) is not None) == keeps
        window.closed = 1
        states.forget_before(6)
        assert states.state(0, 0) is None and states.state(2, 0) is not None


class _Unwaited:
    """A challenger's client that sends a move and does not wait for its block (a chain with timed blocks:
    several challengers' moves share one)."""

    def __init__(self, client) -> None:
        self.client = client

    def _send(self, name: str, sender: str, *args, value: int = 0) -> None:
        getattr(self.client.contract.functions, name)(*args).transact(
            {"from": sender, "value": value, "gas": 5_000_000})


@pytest.mark.slow
def test_on_timed_blocks_the_node_answers_six_games_at_once_within_the_clock(request, tmp_path):
    """Anvil mines a block a second, as a real chain; six challengers (random liars) play at once, their
    moves sharing blocks; the node's own thread, its clock 32 blocks a game, sends each poll's moves together
    and wins every game."""
    w3 = _backend(request, "anvil")
    client, cases, committed, states = _setup(w3, tmp_path)
    stake, node = client.bond, _address(w3, NODE)
    subject, _case = _open(cases, committed)
    defender = _defender(committed, states, tmp_path, every_s=0.3)
    defender.poll()
    claim_id = _claim_of(client, cases, subject, node)
    games = {}
    for index in (4, 5, 6, 7, 8, 9):
        challenger = _address(w3, index)
        client._send("challengeRun", challenger, claim_id, value=stake)
        games[bytes(client.contract.functions.gameIdOf(claim_id, challenger).call())] = (
            challenger, _liar(random.Random(index)))
    w3.provider.make_request("evm_setIntervalMining", [1])
    thread = threading.Thread(target=defender.run, daemon=True)
    thread.start()
    unwaited, answered = _Unwaited(client), {}
    try:
        for _ in range(600):
            states_now = {g: client.game(g) for g in games}
            if all(s["phase"] == PHASES.index("Done") for s in states_now.values()):
                break
            for game_id, state in states_now.items():
                if state["phase"] == PHASES.index("Done") or state["defenderTurn"]:
                    continue
                if answered.get(game_id) != state["moves"]:  # one move a turn, not again before it is mined
                    answered[game_id] = state["moves"]
                    challenger, policy = games[game_id]
                    policy(unwaited, game_id, state, challenger)
            defender.stop.wait(0.3)
    finally:
        defender.stop.set()
        thread.join(timeout=30)
    assert all(client.game(g)["phase"] == PHASES.index("Done") for g in games)
    assert not client.wrong(claim_id)
    assert client.contract.functions.balanceOf(node).call() == 6 * stake
