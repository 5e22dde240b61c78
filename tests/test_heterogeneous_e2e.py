"""Time-bounded runs of real node processes (issue 44), a real anvil. First: 2 replicas x 2 stages, one stage
per node, real gloo pipelines, ``diloco.round_budget_s`` set.

Every replica trains the inner steps that fit in the budget (the count depends on the machine's load; the
test asserts nothing about it beyond the run's range), the stages of a replica agree on the count (the first
stage decides, its partner follows), every contribution declares it inside its signed envelope, the rounds
commit with every contribution, and every node's spot checks rerun the other replica's declared steps
bit-exactly. Then the sliced exchange's shape with a replica under a cgroup cpu quota, audited with every
contribution rerun; and a replica that declares more steps than it trained, convicted by spot checks.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from node_fixtures import KEEP_ALL, TINY, assert_chain_roots, run_logs, wait_for

from ledger.account import dev_account
from node import protocol as msg
from node.commands.throttle import unavailable
from node.store.archive import Archive
from node.tools.audit import audit_run
from node.tools.report import OK
from p2p.envelope import decode_envelope
from training.codec_wire import header_steps
from training.slicebundle import reference_steps

MAX_ROUNDS = 60
MIN_STEPS, MAX_STEPS = 2, 12
SPOT_LINE = re.compile(r"spot check of replica (\d+) round (\d+): (\w+)")


def _spot_checks(slot) -> list[tuple[int, int, str]]:
    text = "\n".join(p.read_text(errors="replace") for p in sorted(slot.data_dir.glob("node-*.log")))
    return [(int(r), int(t), v) for r, t, v in SPOT_LINE.findall(text)]


# about 5 minutes at a load of 30 on 2 cores (four node processes, anvil, two gloo pipelines)
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_time_bounded_split_run_declares_its_steps_and_reruns_them_exactly(make_run):
    # attest_quorum=4: every record needs all four members' signatures over the same bytes, tokens included.
    run = make_run(replicas=2, stages=2, split=True, attest_quorum=4, settings=[
        *TINY, *KEEP_ALL, f"diloco.inner_steps={MAX_STEPS}", "diloco.round_budget_s=0.2",
        f"diloco.min_inner_steps={MIN_STEPS}", "diloco.overlap_steps=0", f"rounds={MAX_ROUNDS}",
        "join_timeout=60", "spot_checks=8"])
    run.start()

    def checked() -> bool:
        assert all(s.process.poll() is None for s in run.nodes), "a node exited:\n" + run_logs(run)
        return all(len([c for c in _spot_checks(s) if c[2] == "exact"]) >= 1 for s in run.nodes)

    wait_for(checked, 1200, "a spot check done by every node", run)
    run.stop_nodes()
    history = run.client().history(run.run_id)
    rounds = len(history.commits)
    assert rounds >= 1 and [c.commit.round for c in history.commits] == list(range(rounds))
    assert all(c.commit.num_contributors == 4 for c in history.commits)
    assert not history.accusations and not history.disputes
    assert_chain_roots(run, history.commits)
    for slot in run.nodes:  # every rerun reproduced exactly what the other replica declared
        checks = _spot_checks(slot)
        assert checks and all(verdict == "exact" for _r, _t, verdict in checks), run_logs(run)

    # Each committed round's contributions, as every node archived them: one declared count per replica, the
    # same on both of its stages, inside the run's range.
    declared: dict[tuple[int, int], set[int]] = {}
    for slot in run.nodes:
        archive = Archive(slot.data_dir / "archive", run.run_id)
        for outer_round in range(rounds):
            for data in archive.envelopes(outer_round):
                envelope = decode_envelope(data, len(data))
                if envelope.kind != msg.CONTRIBUTION:
                    continue
                steps = header_steps(msg.decode_contribution_body(envelope.payload).blob)
                declared.setdefault((outer_round, envelope.replica), set()).add(steps)
    assert {round_ for round_, _replica in declared} == set(range(rounds))
    for (outer_round, replica), counts in declared.items():
        assert len(counts) == 1, (outer_round, replica, counts)
        (count,) = counts
        assert count is not None and MIN_STEPS <= count <= MAX_STEPS, (outer_round, replica, count)
    # Every member signed the same exact tokens (the quorum is all four), those of stage 0's nodes included
    # (they hold no last-stage envelope: the last stage's close
    # names the counts): the steps both replicas declared.
    document = json.loads((run.workdir / "run.json").read_text())
    per_step = document["training"]["batch_size"] * document["model"]["block_size"]
    for commit in history.commits:
        steps = sum(next(iter(declared[(commit.commit.round, replica)])) for replica in range(2))
        assert commit.commit.tokens == steps * per_step, (commit.commit.round, commit.commit.tokens, steps)


# ----------------------------------------------------------------------------- a throttled replica, a cheat

ADVERSARY = [sys.executable, str(Path(__file__).resolve().parent / "adversary.py")]
#: The throttled replica's node process may use this many
#: CPUs (a cgroup v1 cpu quota: node/commands/throttle.py).
THROTTLED_CPUS = 0.2


def _declared_counts(run, rounds: int) -> dict[tuple[int, int], set[int | None]]:
    """(round, replica) -> the counts its archived contribution envelopes declare (slice references
    included)."""
    declared: dict[tuple[int, int], set[int | None]] = {}
    for slot in run.nodes:
        archive = Archive(slot.data_dir / "archive", run.run_id)
        for outer_round in range(rounds):
            for data in archive.envelopes(outer_round):
                envelope = decode_envelope(data, len(data))
                if envelope.kind == msg.CONTRIBUTION:
                    blob = msg.decode_contribution_body(envelope.payload).blob
                    declared.setdefault((outer_round, envelope.replica), set()).add(reference_steps(blob))
    return declared


@pytest.mark.slow  # several minutes on a loaded machine: three node processes, one at a fifth of a CPU
@pytest.mark.timeout(1800)
def test_a_throttled_replica_contributes_to_every_round_of_a_time_bounded_sliced_run_and_the_audit_replays_it(
        make_run):
    """The sliced exchange's e2e shape (tests/test_node_sliced_e2e.py) with a time budget and replica 2's node
    under a cgroup cpu quota: every round commits with the throttled replica's contribution, each record's
    tokens are the steps the last stage's contributions declared, and the audit replays every partial and
    reruns every contribution (exactly its declared steps) bit for bit."""
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"no throttled replica here: {reason}")
    rounds = 3
    # round_timeout: a close waits for every expected replica up to it; the throttled one is expected.
    run = make_run(replicas=3, stages=1, split=False, attest_quorum=2, cpu_limits={2: THROTTLED_CPUS},
                   settings=[
        *TINY, *KEEP_ALL, "join_timeout=180", "diloco.exchange=sliced", "p2p.transfer_timeout=30",
        "round_timeout=600",
        f"rounds={rounds}", f"diloco.inner_steps={MAX_STEPS}", "diloco.round_budget_s=0.3",
        f"diloco.min_inner_steps={MIN_STEPS}", "diloco.overlap_steps=0"])
    run.start()
    assert run.cpu_groups[2].cpus == THROTTLED_CPUS
    for slot in run.nodes:
        assert slot.process.wait(timeout=1500) == 0, run_logs(run)
    history = run.client().history(run.run_id)
    assert [c.commit.round for c in history.commits] == list(range(rounds)), run_logs(run)
    # the throttled one too
    assert all(c.commit.num_contributors == 3 for c in history.commits), run_logs(run)
    assert not history.accusations and not history.disputes
    assert_chain_roots(run, history.commits)

    declared = _declared_counts(run, rounds)
    document = json.loads((run.workdir / "run.json").read_text())
    tokens_per_step = document["training"]["batch_size"] * document["model"]["block_size"]
    for commit in history.commits:
        counts = []
        for replica in range(3):
            # one count per contribution, in every archive
            (count,) = declared[(commit.commit.round, replica)]
            assert count is not None and MIN_STEPS <= count <= MAX_STEPS, (commit.commit.round, replica,
                                                                           count)
            counts.append(count)
        assert commit.commit.tokens == sum(counts) * tokens_per_step, (commit.commit.round, counts)

    report = audit_run(run.client(), run.run_id, archives=[slot.data_dir for slot in run.nodes], reexecute=-1)
    assert report.ok, [c.line() for c in report.all_checks() if c.status != OK]
    for verdict in report.rounds:
        assert [c.status for c in verdict.checks if c.name == "tokens"] == [OK], verdict.checks
        replays = [c for c in verdict.checks if c.name.startswith("partial") and c.name.endswith("(replay)")]
        assert replays and all(c.status == OK for c in replays), verdict.checks
    reruns = [c for c in report.general if c.name.startswith("re-execution of round")]
    assert len(reruns) == 3 * rounds, report.general
    assert all(c.status == OK and c.reason.startswith("reproduced (exact") for c in reruns), reruns


@pytest.mark.slow  # until a spot check accuses the cheater and the quorum convicts it: minutes
@pytest.mark.timeout(1800)
def test_a_replica_that_declares_more_steps_than_it_trained_is_convicted_by_a_spot_check(make_run):
    """tests/adversary.py ``over-declare``: trains what fits in the budget and declares 2 more steps (its data
    commitment agrees with the declaration): every aggregation check lets it through; the honest members'
    reruns of its declared steps do not reproduce it, they accuse it and the run's quorum convicts it."""
    run = make_run(replicas=3, stages=1, split=False, attest_quorum=2, settings=[
        *TINY, *KEEP_ALL, "join_timeout=120", "rounds=100", "spot_checks=8",
        f"diloco.inner_steps={MAX_STEPS}",
        "diloco.round_budget_s=0.05", f"diloco.min_inner_steps={MIN_STEPS}", "diloco.overlap_steps=0"])
    cheater = run.nodes[-1]
    cheater.command = [*ADVERSARY, "over-declare"]
    run.start()
    client = run.client()
    account = dev_account(cheater.account, client.chain_id).address.lower()

    def convicted() -> bool:
        assert all(s.process.poll() is None for s in run.nodes[:-1]), \
            "an honest node exited:\n" + run_logs(run)
        return any(a.guilty and a.accused.lower() == account for a in client.history(run.run_id).accusations)

    wait_for(convicted, 1500, "the over-declaring replica convicted", run)
    run.stop_nodes()
    history = client.history(run.run_id)
    assert {a.accused.lower() for a in history.accusations} == {account}, history.accusations
    # The replica the run placed the cheater on (its signed
    # envelopes say), which is what the honest reruns name.
    replicas = {decode_envelope(data, len(data)).replica for slot in run.nodes[:-1]
                for data in Archive(slot.data_dir / "archive", run.run_id).envelopes(0)
                if decode_envelope(data, len(data)).sender_peer_id == cheater.peer_id}
    assert len(replicas) == 1, replicas
    (replica,) = replicas
    checks = [c for slot in run.nodes[:-1] for c in _spot_checks(slot)]
    assert any(r == replica and verdict == "mismatch" for r, _t, verdict in checks), run_logs(run)
    assert all(verdict == "exact" for r, _t, verdict in checks if r != replica), checks


@pytest.mark.slow  # a few minutes on a loaded machine: three node processes, the full exchange, screening on
@pytest.mark.timeout(1800)
def test_a_screened_time_bounded_run_is_audited_bit_for_bit(make_run):
    """Three replicas of one stage (every node holds the whole model, so every round is screened, here by
    version 3, docs/DILOCOX.md section 13), the full exchange: every round commits with all three
    contributions, and the audit re-derives every round's screening and aggregation and reruns every
    contribution (exactly its declared steps) bit for bit."""
    rounds = 3
    run = make_run(replicas=3, stages=1, split=False, attest_quorum=2, settings=[
        *TINY, *KEEP_ALL, "join_timeout=180", "round_timeout=600", f"rounds={rounds}",
        f"diloco.inner_steps={MAX_STEPS}",
        "diloco.round_budget_s=0.3", f"diloco.min_inner_steps={MIN_STEPS}", "diloco.overlap_steps=0",
        "diloco.screen_rule=paired"])
    run.start()
    for slot in run.nodes:
        assert slot.process.wait(timeout=1500) == 0, run_logs(run)
    document = json.loads((run.workdir / "run.json").read_text())
    assert document["diloco"]["screen_rule"] == "paired" and "exchange" not in document["diloco"]
    history = run.client().history(run.run_id)
    assert [c.commit.round for c in history.commits] == list(range(rounds)), run_logs(run)
    assert not history.accusations and not history.disputes
    assert_chain_roots(run, history.commits)
    report = audit_run(run.client(), run.run_id, archives=[slot.data_dir for slot in run.nodes], reexecute=-1)
    assert report.ok, [c.line() for c in report.all_checks() if c.status != OK]
    reruns = [c for c in report.general if c.name.startswith("re-execution of round")]
    assert reruns and all(c.status == OK and c.reason.startswith("reproduced (exact") for c in reruns), reruns
    # issue 80 point 1: through a seeder alone (no archive), the same reruns: round t-1's screening
    # exclusions from the audit's own replay of it, start states and envelopes from the seeder
    from node.commands.seeder import ArchiveSeeder
    from node.tools.evidence import PeerFetcher

    seeder = ArchiveSeeder.start([slot.data_dir for slot in run.nodes], run.run_id)
    try:
        fetcher = PeerFetcher.start([seeder.multiaddr])
        try:
            linked = audit_run(run.client(), run.run_id, fetcher=fetcher, reexecute=-1)
        finally:
            fetcher.close()
    finally:
        seeder.close()
    assert linked.ok, [c.line() for c in linked.all_checks() if c.status != OK]
    assert linked.reexecution["from"] == "peers" and linked.reexecution["rerun"] == len(reruns) == 3 * rounds
