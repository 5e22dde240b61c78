"""A defense that survives a restart (issue 78, docs/FRAUD_PROOF.md "The node defends its contributions";
node/live/fraud/defensefiles.py).

The node's case defender copies what a defense of each of its contributions needs (its start's weight chunk
leaves, its codec blob) to ``<data_dir>/case-defense/`` while its states hold them, and each game's memory
(the step and op its bisections ended on) before each move is sent. A restarted node holds none of its states
(a restart drops its spilled ones), so it reads the copies.

What is tested, on anvil with the node's own parts: a defender whose game against a lying challenger is past
the steps' bisection is replaced by a new one over empty states and the same data directory (a restart):
the new one finds the case and its standing claim, plays the game on from the kept memory and wins it; in a
run with the plain end rule, a case opened after a restart on a contribution made before it is claimed and
its end disputes answered from the kept blob (the 2-bit coding). A copy that does not match (another payload
root, a start whose leaves are not the claim's) is not used: the case is logged as one the node cannot
answer. The copies of a round go once its proof window closes. With real
node processes, killed and restarted mid-game: tests/test_case_defense_e2e.py.
"""

from __future__ import annotations

import logging
import random
from types import SimpleNamespace

import pytest

from ledger.stepproof import PHASES
from node.commitments.registry import scheme_named
from node.live.fraud.chunkstate import ChunkedStates
from node.live.fraud.defensefiles import DEFENSE_DIR, DefenseFiles
from tests.step_binding_fixtures import end_subject, toy_end_round
from tests.test_case_defense import LIAR, NODE, _claim_of, _defender, _liar, _open, _play, _setup
from tests.test_case_defense_end import CHALLENGERS, DISPUTED
from tests.test_step_case import _address
from tests.test_step_proof import _backend


def _empty() -> ChunkedStates:
    """A restarted node's states: none held."""
    return ChunkedStates(cfg=SimpleNamespace(commitment_scheme=scheme_named("normed")), host=None,
                         layout=None, config_hash=b"")


def test_a_restarted_node_plays_its_game_on_from_what_it_kept(request, tmp_path, caplog):
    w3 = _backend(request, "anvil")
    client, cases, committed, states = _setup(w3, tmp_path, clock=200, window=1000)
    stake, node, liar = client.bond, _address(w3, NODE), _address(w3, LIAR)
    files = DefenseFiles(tmp_path / DEFENSE_DIR)
    first = _defender(committed, states, tmp_path, files=files)
    first.poll()  # no case yet: its own contribution's inputs are kept
    assert files.rounds() == [(1, 0)]
    subject, _case = _open(cases, committed)
    first.poll()
    claim_id = _claim_of(client, cases, subject, node)
    client._send("challengeRun", liar, claim_id, value=stake)
    game_id = bytes(client.contract.functions.gameIdOf(claim_id, liar).call())
    liar_moves = _liar(random.Random(9))

    def policy(client, game_id, state, challenger):  # the liar, disputing the trace (not a copy) at its end
        if PHASES[state["phase"]] == "TraceEnd":
            client._send("disputeTrace", challenger, game_id)
        else:
            liar_moves(client, game_id, state, challenger)
    while PHASES[client.game(game_id)["phase"]] in ("Steps", "Trace", "TraceEnd"):
        first.poll()
        state = client.game(game_id)
        if not state["defenderTurn"] and state["phase"] != PHASES.index("Done"):
            policy(client, game_id, state, liar)
    assert client.game(game_id)["phase"] != PHASES.index("Done")  # past the steps, in the step's game
    # the restart: nothing held in memory, the same data directory
    second = _defender(committed, _empty(), tmp_path, files=DefenseFiles(tmp_path / DEFENSE_DIR))
    _play(client, second, {game_id: (liar, policy)})
    assert client.game(game_id)["phase"] == PHASES.index("Done") and not client.wrong(claim_id)
    assert client.contract.functions.balanceOf(node).call() == stake
    # a node that kept nothing (another data directory) cannot play it on: said so
    caplog.set_level(logging.INFO, logger="node.live.fraud.defender")
    _defender(committed, _empty(), tmp_path, files=DefenseFiles(tmp_path / "elsewhere")).poll()
    assert "nor a copy in case-defense/" in caplog.text


@pytest.mark.slow
def test_a_restarted_node_answers_end_disputes_from_its_kept_blob(request, tmp_path):
    w3 = _backend(request, "anvil")
    round_, blob = toy_end_round("quant")
    client, cases, committed, states = _setup(w3, tmp_path, window=600, end_rule=True, round_=round_)
    subject, _pieces = end_subject(committed, blob)
    index = list(committed.states[1].factors.payload_roots).index(subject.payload_root)
    files = DefenseFiles(tmp_path / DEFENSE_DIR)
    _defender(committed, states, tmp_path, member=index + 1, files=files).poll()  # kept before the restart
    kept = files.kept(1, 0)
    assert kept is not None and kept.blob == blob and kept.payload_root == subject.payload_root
    restarted = _defender(committed, _empty(), tmp_path, member=index + 1, files=files)
    _open(cases, committed, index=index)
    restarted.poll()
    claim_id = _claim_of(client, cases, subject, _address(w3, index + 1))
    games = {}
    for challenger, (q, elem) in zip(CHALLENGERS, DISPUTED):
        account = _address(w3, challenger)
        client._send("challengeEnd", account, claim_id, q, elem, value=client.bond)
        games[bytes(client.contract.functions.gameIdOf(claim_id, account).call())] = (account, None)
    _play(client, restarted, games)
    assert all(client.game(g)["phase"] == PHASES.index("Done") for g in games) and not client.wrong(claim_id)


def test_a_kept_copy_that_is_not_the_contributions_is_not_used(request, tmp_path, caplog):
    w3 = _backend(request, "anvil")
    client, cases, committed, states = _setup(w3, tmp_path)
    files = DefenseFiles(tmp_path / DEFENSE_DIR)
    kept_start = list(committed.states[0].weight_leaves)
    # a start whose first leaf is another chunk's: its root is not the claim's startWeights
    payload = committed.states[1].factors.payload_roots[2]
    files.keep(1, 0, payload, [kept_start[1], *kept_start[1:]], b"", {})
    caplog.set_level(logging.INFO, logger="node.live.fraud.defender")
    subject, _case = _open(cases, committed)
    _defender(committed, _empty(), tmp_path, files=files).poll()
    assert "is not the committed start" in caplog.text and cases.case(subject)["claims"] == 0
    # another payload root's copy is not this contribution's: as if none were kept
    caplog.clear()
    files.keep(1, 0, bytes(32), kept_start, b"", {})
    _defender(committed, _empty(), tmp_path, files=files).poll()
    assert "nor a copy in case-defense/" in caplog.text and cases.case(subject)["claims"] == 0


class _ClosedThrough:
    """Proof windows closed for every round up to ``closed``."""

    def __init__(self, closed: int) -> None:
        self.closed = closed

    def open(self, outer_round: int) -> bool:
        return outer_round > self.closed


def test_the_kept_copies_of_a_round_go_once_its_window_closes(tmp_path):
    import threading

    from ledger.stepdefense import GameMemory
    from node.live.fraud.defender import CaseDefender

    files = DefenseFiles(tmp_path / DEFENSE_DIR)
    for outer_round in (1, 2):
        files.keep(outer_round, 0, bytes(32), [b"leaf"], b"", {})
        files.remember(outer_round, 0, bytes([outer_round]) * 32, {b"\x01" * 32: GameMemory(3, 1)})
    states = _empty()
    states.window = _ClosedThrough(1)
    defender = CaseDefender(run_id=1, chain=None, states=states, program=None, data_dir=tmp_path,
                            stop=threading.Event(), files=files)
    defender._prune()
    assert files.rounds() == [(2, 0)] and files.kept(1, 0) is None
    assert files.memories(1, 0, b"\x01" * 32) == {}
    assert files.memories(2, 0, b"\x02" * 32) == {b"\x01" * 32: GameMemory(3, 1)}
