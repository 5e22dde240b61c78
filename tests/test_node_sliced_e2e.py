"""End to end, ``diloco.exchange = "sliced"``: real anvil, real node processes, partials instead of
contributions.

One-node replicas of a one-stage tiny model (the stage is cut into one slice
per replica); every node must compute the chain's weights root every round, a
member publishing partials that do not bind the close's inputs must be refused
(the fallback aggregator publishes the slice instead), and a member whose
envelope or bundle is unusable costs only its own input.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from node_fixtures import TINY, node_state, run_logs

from ledger.account import dev_account
from node.tools.audit import FAIL, OK, audit_run

ADVERSARY = [sys.executable, str(Path(__file__).resolve().parent / "sliced_adversary.py")]
SETTINGS = [*TINY, "join_timeout=60", "diloco.exchange=sliced", "p2p.transfer_timeout=20"]


def _logs(slots) -> str:
    return "\n".join(p.read_text() for slot in slots for p in slot.data_dir.glob("node-*.log"))


def _assert_guilty(run, attacker) -> None:
    """The chain found ``attacker`` guilty and slashed it, and nobody else: an accusation of an honest
    member (the attacker's own spot checks replay with its wrong rule) is judged by the others' replay."""
    client = run.client()
    history = client.history(run.run_id)
    account = dev_account(attacker.account, client.chain_id).address.lower()
    guilty = {a.accused.lower() for a in history.accusations if a.guilty}
    assert guilty == {account}, (history.accusations, run_logs(run))
    assert [s.account.lower() for s in history.slashings] == [account]


def _run(make_run, replicas: int, rounds: int, adversary: str | None = None, extra: tuple = ()):
    run = make_run(replicas=replicas, stages=1, split=False, settings=[*SETTINGS, f"rounds={rounds}", *extra],
                   attest_quorum=2)
    if adversary is not None:
        run.nodes[-1].command = [*ADVERSARY, adversary]
    run.start()
    honest = run.nodes[:-1] if adversary is not None else run.nodes
    for slot in honest:
        assert slot.process.wait(timeout=400) == 0, run_logs(run)
    commits = run.client().history(run.run_id).commits
    assert [c.commit.round for c in commits] == list(range(rounds)), run_logs(run)
    for slot in honest:
        roots = node_state(slot)["weights_roots"]
        assert [roots[str(c.commit.round)] for c in commits] == [c.commit.weights_root.hex()
                                                                 for c in commits], \
            slot.name + "\n" + run_logs(run)
    return run, honest, commits


@pytest.mark.timeout(420)
def test_sliced_run_of_three_replicas_agrees_every_round(make_run):
    run, honest, commits = _run(make_run, replicas=3, rounds=2)
    assert all(c.commit.num_contributors == 3 for c in commits)
    logs = _logs(honest)
    # Every node aggregated a slice and used partials (three slices of a 42,880-element stage).
    for slot in honest:
        assert "partial of slice" in _logs([slot]), slot.name
    assert "refused" not in logs
    # The auditor replays every round from the archives: each partial from its slice blobs, bit for bit;
    # with --reexecute all it reruns every contribution against the slices its reference binds (the
    # member's archived bundle), round 1 applying round 0 from its partials: each reproduces bit for bit.
    report = audit_run(run.client(), run.run_id, archives=[slot.data_dir for slot in run.nodes], reexecute=-1)
    assert report.ok, [c.line() for c in report.all_checks() if c.status != OK]
    for verdict in report.rounds:
        replays = [c for c in verdict.checks if c.name.endswith("(replay)") and c.name.startswith("partial")]
        assert len(replays) == 3 and all(c.status == OK for c in replays), verdict.checks
    reruns = [c for c in report.general if c.name.startswith("re-execution of round")]
    assert len(reruns) == 3 * len(commits), report.general
    assert all(c.status == OK and c.reason.startswith("reproduced (exact") for c in reruns), reruns


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_partial_that_does_not_bind_the_inputs_is_refused_and_the_fallback_publishes(make_run):
    run, honest, commits = _run(make_run, replicas=3, rounds=2, adversary="wrong-root")
    for slot in honest:
        log = _logs([slot])
        assert "inputs root differs" in log, slot.name
        assert list((slot.data_dir / "evidence").glob("*.partial")), slot.name
    # Someone published the attacker's slices as a fallback (turn 1).
    assert "(turn 1," in _logs(honest)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_wrong_partial_over_the_right_inputs_is_applied_alike_the_audit_names_it_and_spot_checks_accuse_it(
        make_run):
    """The limit of checking bindings only: holders agree on the poisoned slice; the replay catches it. With
    spot checks on (every holder replays every other partial here), the holders accuse the aggregator on
    chain with the signed partial as evidence and it is found guilty."""
    run, honest, commits = _run(make_run, replicas=3, rounds=3, adversary="wrong-blob",
                                extra=["spot_checks=2"])
    report = audit_run(run.client(), run.run_id, archives=[slot.data_dir for slot in run.nodes])
    assert not report.ok
    attacker = run.nodes[-1].peer_id
    for verdict in report.rounds:
        # The holders applied the attacker's partial alike: the weights root replays from it...
        assert next(c for c in verdict.checks if c.name == "weights root (replay)").status == OK, \
            verdict.checks
        # ...and the replay of the attacker's slice names it.
        wrong = [c for c in verdict.checks if c.status == FAIL]
        assert all(c.name.startswith("partial") and attacker in c.reason for c in wrong), verdict.checks
    # Round 0 at least holds its wrong partial (once it is ejected, later rounds may not).
    assert any(c.status == FAIL for c in report.rounds[0].checks), report.rounds[0].checks
    assert "spot check: the partial of" in _logs(honest)
    _assert_guilty(run, run.nodes[-1])


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_slice_that_does_not_match_its_signed_bundle_costs_only_its_signer(make_run):
    """A replica whose bundle holds a slice its record does not prove: that input is absent for the
    aggregator (which reads the whole bundle and keeps it) and for the auditor alike, and its signer is
    accused on chain with the bundle as evidence."""
    run, honest, commits = _run(make_run, replicas=3, rounds=2, adversary="bad-slice")
    logs = _logs(honest)
    assert "does not check" in logs and "that input is absent" in logs
    assert any(list((slot.data_dir / "evidence").glob("bundle-*.slices")) for slot in honest)
    # The bundle proves its signer wrong: the aggregator that read it accuses it (bad-bundle evidence, judged
    # by its own rule first; whether the verdict lands before the 2 rounds end is load's business).
    assert "slice 2 of its bundle is not the one its signed record proves): accusing it" in logs, logs[-4000:]
    report = audit_run(run.client(), run.run_id, archives=[slot.data_dir for slot in run.nodes])
    assert report.ok, [c.line() for c in report.all_checks() if c.status != OK]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_an_envelope_whose_reference_does_not_fit_costs_only_its_signer(make_run):
    """Holders fetch no envelope to judge a close: a member whose envelopes carry an unusable reference is
    refused by an honest coordinator's fetch, and when it closes a round itself, its own entry is an absent
    input for every aggregator and for the auditor alike; the honest nodes agree and the audit passes."""
    run, honest, commits = _run(make_run, replicas=3, rounds=2, adversary="bad-reference")
    logs = _logs(honest)
    assert "no usable contribution" in logs or "rejected" in logs
    report = audit_run(run.client(), run.run_id, archives=[slot.data_dir for slot in run.nodes])
    assert report.ok, [c.line() for c in report.all_checks() if c.status != OK]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_member_that_withholds_its_bundle_costs_only_itself_also_when_it_coordinates(make_run):
    """Withholding costs only the withholder (docs/PROTOCOL.md, "Sliced exchange"): a member that signs
    references to bundles it never serves is left out by every honest coordinator (which fetches each
    bundle before closing); in the rounds it coordinates, its close names its own entry, no partial can
    come, every honest holder refuses that close and takes the next coordinator's. Every honest node
    keeps going and ends every round on the chain's roots."""
    rounds = 2
    run = make_run(replicas=3, stages=1, split=False, settings=SETTINGS + [f"rounds={rounds}"],
                   attest_quorum=2)
    # The attacker is the first coordinator of every round: stage 0's rotation is its holders in the order
    # of their chain seats (Membership.seat_order), and the launcher seats the nodes in seating_order().
    attacker = run.seating_order()[0]
    first = attacker.peer_id
    attacker.command = [*ADVERSARY, "withhold"]
    run.start()
    honest = [slot for slot in run.nodes if slot is not attacker]
    for slot in honest:
        assert slot.process.wait(timeout=840) == 0, run_logs(run)
    commits = run.client().history(run.run_id).commits
    assert [c.commit.round for c in commits] == list(range(rounds)), run_logs(run)
    for slot in honest:
        roots = node_state(slot)["weights_roots"]
        assert [roots[str(c.commit.round)] for c in commits] == [c.commit.weights_root.hex()
                                                                 for c in commits], \
            slot.name + "\n" + run_logs(run)
    # The withholder is in no committed round: only the two honest replicas contributed.
    assert all(c.commit.num_contributors == 2 for c in commits), [c.commit for c in commits]
    for slot in honest:
        log = _logs([slot])
        # Its close was refused for the partials that never came; the next coordinator's applied.
        assert f"close of {first[-8:]} refused: no valid partial" in log, slot.name
    assert "not closed with its contribution" in _logs(honest)  # an honest coordinator left it out
    report = audit_run(run.client(), run.run_id, archives=[slot.data_dir for slot in run.nodes])
    assert report.ok, [c.line() for c in report.all_checks() if c.status != OK]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_bound_partials_that_differ_are_settled_by_replaying_the_slice(make_run):
    """An aggregator that signs two partials of its slice over the right inputs, a wrong one and the honest
    one: each holder holds both, replays the slice from its inputs, applies the one equal to its replay
    and keeps the other as evidence. The honest nodes end on the chain's roots, which the auditor replays
    from the right partials; its replay names the attacker's wrong partial (the attacker applied it). The
    holders accuse it on chain with the signed partial, the inputs it binds and the close as evidence
    (node.slicedproof); each judges the other's evidence by replaying it, and the verdict is guilty. The
    auditor (``--reexecute``) judges that ejection by the same rule from the archived proof: justified."""
    run, honest, commits = _run(make_run, replicas=3, rounds=3, adversary="two-partials")
    attacker = run.nodes[-1].peer_id
    for slot in honest:
        log = _logs([slot])
        assert "bound partials differ: replaying the slice" in log, slot.name
        assert f"the partial of {attacker[-8:]}" in log and "differs from the replay" in log, slot.name
        assert list((slot.data_dir / "evidence").glob("*.wrong.partial")), slot.name
    _assert_guilty(run, run.nodes[-1])
    report = audit_run(run.client(), run.run_id, archives=[slot.data_dir for slot in run.nodes], reexecute=1)
    ejections = [c for c in report.general if c.name.startswith("ejection of")]
    assert ejections and all(c.status == OK and c.reason.startswith("wrong-partial proof holds: round")
                             for c in ejections), ejections
    for verdict in report.rounds:
        # The committed weights are the replay's: no honest holder applied the wrong partial.
        assert next(c for c in verdict.checks if c.name == "weights root (replay)").status == OK, \
            verdict.checks
        wrong = [c for c in verdict.checks if c.status == FAIL]
        assert all(c.name.startswith("partial") and attacker in c.reason for c in wrong), verdict.checks
    assert "on chain: slice" in _logs(honest)  # SpotChecker.charge: the reason is the slice's


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_member_killed_mid_run_restarts_and_every_round_after_commits_with_equal_roots(make_run):
    """kill -9 of one node of a sliced run, then a restart: the others go on meanwhile (its slices come
    from the coordinators that held its bundles, its partials from the next candidates); it re-enters
    from the chain, and every round is committed once, with the chain's roots on every node that
    applied it. Spot checks run all along (every node reruns every other replica): the restarted
    replica's fresh start state is no broken chain, and nobody is accused."""
    import signal
    import time

    rounds = 8
    run = make_run(replicas=3, stages=1, split=False, attest_quorum=2,
                   settings=[*SETTINGS, f"rounds={rounds}", "spot_checks=8"])
    run.start()
    client = run.client()
    deadline = time.monotonic() + 400
    while not any(c.commit.round >= 1 for c in client.history(run.run_id).commits):
        assert time.monotonic() < deadline and run.running(), "round 1 not committed\n" + run_logs(run)
        time.sleep(1.0)
    victim = run.nodes[1]
    run.kill(victim, signal.SIGKILL)
    time.sleep(2)
    run.start_node(victim)
    assert run.wait(780, progress=True), run_logs(run)
    for slot in run.nodes:
        assert slot.process.returncode == 0, slot.name + "\n" + run_logs(run)
    history = client.history(run.run_id)
    commits = history.commits
    assert [c.commit.round for c in commits] == list(range(rounds)), run_logs(run)
    chain = {c.commit.round: c.commit.weights_root.hex() for c in commits}
    for slot in run.nodes:
        roots = node_state(slot)["weights_roots"]
        applied = {int(r): root for r, root in roots.items() if int(r) in chain}
        assert applied and all(root == chain[r] for r, root in applied.items()), \
            slot.name + "\n" + run_logs(run)
        assert max(applied) == rounds - 1, slot.name
    assert "from the chain-verified checkpoint of round" in _logs([victim]), _logs([victim])[-4000:]
    assert commits[-1].commit.num_contributors == 3, [c.commit for c in commits]  # the victim is back
    assert not history.accusations and not history.disputes, run_logs(run)
