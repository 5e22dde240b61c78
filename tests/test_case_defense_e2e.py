"""A real node process defends its contribution (issue 78, docs/FRAUD_PROOF.md "The node defends its
contributions").

Two node processes on a real anvil, one replica each, a normed run of the tiny model whose step program the
run's creator fixed before the first commit (a one-op program over the stage's smallest tensor, the weights
squared element by element each inner step: a documented program of StepProver's operations, not the model's
step, which no program expresses yet) and which every node is given (``ledger.step_program``). Once round 2
is committed, an outsider opens a case against round 1's first listed contribution and a challenger answers
every level at random: the contributor's node notices the case, claims its contribution from what it kept
and plays the whole game from its own process; the challenger loses its bond to it. In a run drawn by account
whose creator fixed the data terms too, the node's claim commits its batches (the windows of its account) and
answers a data dispute of its first token, and, killed and started again, one of its last token opened while
it was down.
"""

from __future__ import annotations

import random
import signal
import time

import pytest

from ledger.account import dev_account
from ledger.client import LedgerClient
from ledger.stepcase import ledger_step_prover, run_stake
from ledger.stepdata import DataClient, batch_root
from ledger.stepproof import MUL, PHASES, StepProverClient
from node.casesubject import kept_case, open_case
from node.config import load_config
from node.dataterms import own_terms
from node.runconfig import config_hash, run_document
from node.stepprogram import StepProgram
from node.store.checkpoint import RunLayout
from tests.node_fixtures import TINY, run_logs, wait_for
from training.chunks import stage_layout

OPENER, LIAR = 8, 5  # dev accounts outside the run
STAKE = 10**18


def _program(run) -> StepProgram:
    """The run's program: its stage 0's smallest tensor squared, element by element, each step."""
    cfg = load_config(None, run._base_settings())
    document = run_document(cfg)
    shapes = RunLayout.of_document(run.run_id, config_hash(document), document).stage_shapes[0]
    places = stage_layout(shapes)
    first = {p.tensor: p.index for p in reversed(places)}
    sizes = {p.tensor: 0 for p in places}
    for p in places:
        sizes[p.tensor] += p.count
    tensor = min(sizes, key=lambda t: (sizes[t], t))
    n = sizes[tensor]
    return StepProgram(((MUL, n, 0, 1, n, n, 0, 0),), (1,), 1, ((tensor, n, first[tensor], len(places)),))


def _opened(make_run, tmp_path, accusation_blocks: int, dispute_blocks: int = 1000, data: bool = False):
    """A run of two tiny nodes whose program the creator fixed, round 2 committed, and an outsider's case on
    round 1's first listed contribution claimed by its author's node: (run, prover client, claim id, the
    author's address, the program). ``data``: a run drawn by account whose data terms the creator fixed
    too."""
    program_file = tmp_path / "program.json"
    windows = ["training.data_windows=account"] if data else []
    run = make_run(replicas=2, stages=1, split=False, stake_wei=STAKE, accusation_blocks=accusation_blocks,
                   dispute_blocks=dispute_blocks,
                   settings=[*TINY, "join_timeout=90", "rounds=40", f"ledger.step_program={program_file}",
                             *windows])
    program = _program(run)
    program_file.write_text(program.to_json())
    w3 = run.client().w3
    client = StepProverClient(w3, ledger_step_prover(w3, run.ledger))
    creator = dev_account(0, w3.eth.chain_id).address
    client.set_program(creator, run.run_id, program.head(), program.origin_leaves())
    if data:
        DataClient(client).set_data(creator, run.run_id, own_terms(load_config(None, run._base_settings())))
    run.start()
    reader = run.client()
    wait_for(lambda: reader.commit_count(run.run_id) >= 3, 600, "round 2's commit", run)
    opener_client = LedgerClient(w3, dev_account(OPENER, w3.eth.chain_id), run.registry, run.ledger)
    kept = kept_case([slot.data_dir for slot in run.nodes], opener_client, run.run_id, 1, 0)
    subject = kept.subject(0)
    author = kept.factors_parsed().norms.contributors[0]
    stake = run_stake(w3, run.ledger, run.run_id)
    open_case(opener_client, client.contract, subject, stake)
    key = bytes(client.contract.functions.contributionOf(*subject.fields()[:4]).call())
    wait_for(lambda: client.contract.functions.caseOf(key).call()[2] >= 1, 120, "the author's claim", run)
    claimed = client.contract.events.RunClaimed().get_logs(from_block=0)
    assert [(bytes(e.args.payloadRoot), e.args.defender.lower()) for e in claimed] == [
        (subject.payload_root, author.lower())]
    client.bond = stake
    return run, client, bytes(claimed[0].args.claimId), author, program


def _liar_moves(program: StepProgram, seed: int) -> dict:
    """A challenger's move for each phase of the one-op program's game: at random."""
    rng, n = random.Random(seed), program.ops[0][1]
    return {"Steps": ("judgeStateRoot", lambda: (rng.random() < 0.5,)),
            "TraceEnd": ("disputeTrace", tuple), "Ops": ("judgeRoot", lambda: (rng.random() < 0.5,)),
            "Pick": ("pickElement", lambda: (rng.randrange(n),))}


def _node_logs(run) -> str:
    return "\n".join(p.read_text() for slot in run.nodes for p in slot.data_dir.glob("node-*.log"))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_node_process_defends_its_contribution_against_a_lying_challenger(make_run, tmp_path):
    run, client, claim_id, author, program = _opened(make_run, tmp_path, 60)
    liar = dev_account(LIAR, client.w3.eth.chain_id).address
    client._send("challengeRun", liar, claim_id, value=client.bond)
    game_id = bytes(client.contract.functions.gameIdOf(claim_id, liar).call())
    moves = _liar_moves(program, 3)
    deadline = time.monotonic() + 300
    while (state := client.game(game_id))["phase"] != PHASES.index("Done"):
        assert time.monotonic() < deadline, f"the game stalled in {PHASES[state['phase']]}\n{run_logs(run)}"
        if not state["defenderTurn"]:
            name, args = moves[PHASES[state["phase"]]]
            client._send(name, liar, game_id, *args())
        time.sleep(0.5)
    assert not client.wrong(claim_id), run_logs(run)
    assert client.contract.functions.balanceOf(author).call() == client.bond
    logs = _node_logs(run)
    assert "claimed this node's contribution 0" in logs and "CANNOT DEFEND" not in logs


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_a_node_process_killed_mid_game_plays_it_on_after_its_restart(make_run, tmp_path):
    """The author's node is killed (SIGKILL) once it has posted its trace of the split step, and started
    again: its new life holds none of its states, finds the case and its standing claim, reads what it kept
    in ``case-defense/`` (the start's leaves, the game's step) and plays the game on to its end."""
    run, client, claim_id, author, program = _opened(make_run, tmp_path, 150, 3000)
    liar = dev_account(LIAR, client.w3.eth.chain_id).address
    slot = next(s for s in run.nodes
                if dev_account(s.account, client.w3.eth.chain_id).address.lower() == author.lower())
    client._send("challengeRun", liar, claim_id, value=client.bond)
    game_id = bytes(client.contract.functions.gameIdOf(claim_id, liar).call())
    moves, restarted = _liar_moves(program, 4), False
    deadline = time.monotonic() + 600
    while (state := client.game(game_id))["phase"] != PHASES.index("Done"):
        assert time.monotonic() < deadline, f"the game stalled in {PHASES[state['phase']]}\n{run_logs(run)}"
        phase = PHASES[state["phase"]]
        if phase == "TraceEnd" and not restarted:  # its trace posted: the step is in its memory only
            run.kill(slot, signal.SIGKILL)
            assert list((slot.data_dir / "case-defense").glob("claim-*.json")), "no game memory kept"
            run.start_node(slot)
            restarted = True
        if not state["defenderTurn"]:
            name, args = moves[phase]
            client._send(name, liar, game_id, *args())
        time.sleep(0.5)
    assert restarted, "the game ended before the trace was posted"
    assert not client.wrong(claim_id), run_logs(run)
    assert client.contract.functions.balanceOf(author).call() == client.bond
    second = slot.log_path.read_text()
    assert slot.starts == 2 and "found its standing claim (posted before) on this node's contribution 0" \
        in second, second[-3000:]
    assert "defense inputs read from its kept copy (case-defense/)" in second
    assert "CANNOT DEFEND" not in _node_logs(run)


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_a_node_process_answers_data_disputes_before_and_after_a_restart(make_run, tmp_path):
    """A run drawn by account with data terms: the author's claim commits the batches of its own account's
    windows; a data dispute of the first token is answered; the node is killed (SIGKILL), a dispute of the
    last step's last token opened while it is down, and its next life (no state held) answers it from its
    kept copy and its dataset. Both challengers' bonds are the node's."""
    from tests.test_case_defense_data import claimed
    from training.data import corpus_from_config
    from training.data_binding import batch_leaves, claim_batches

    run, client, claim_id, author, _program_ = _opened(make_run, tmp_path, 150, 3000, data=True)
    w3 = client.w3
    terms = DataClient(client).terms_of(run.run_id)
    cfg = load_config(None, run._base_settings())
    steps = claimed(client, claim_id)["steps"]
    corpus = corpus_from_config(cfg.training, cfg.model)
    batches = claim_batches(corpus, terms.seed, bytes.fromhex(author[2:]), 1, steps, terms.rows, terms.window)
    assert bytes(claimed(client, claim_id)["batchRoot"]) == batch_root([batch_leaves(b) for b in batches])
    slot = next(s for s in run.nodes
                if dev_account(s.account, w3.eth.chain_id).address.lower() == author.lower())

    def disputed(challenger: int, dispute: tuple) -> bytes:
        account = dev_account(challenger, w3.eth.chain_id).address
        client._send("challengeData", account, claim_id, *dispute, value=client.bond)
        return bytes(client.contract.functions.gameIdOf(claim_id, account).call())

    first = disputed(LIAR, (0, 0, 0))
    wait_for(lambda: client.game(first)["phase"] == PHASES.index("Done"), 120, "the first data answer", run)
    run.kill(slot, signal.SIGKILL)
    second = disputed(OPENER + 1, (steps - 1, terms.rows - 1, terms.window))
    run.start_node(slot)
    wait_for(lambda: client.game(second)["phase"] == PHASES.index("Done"), 300,
             "the answer after the restart", run)
    assert not client.wrong(claim_id), run_logs(run)
    assert client.contract.functions.balanceOf(author).call() == 2 * client.bond
    second_life = slot.log_path.read_text()
    assert "found its standing claim (posted before) on this node's contribution 0" in second_life
    assert "its batches committed (data key" in _node_logs(run) and "CANNOT DEFEND" not in _node_logs(run)
