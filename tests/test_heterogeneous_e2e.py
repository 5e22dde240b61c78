"""A time-bounded run of real node processes (issue 44): 2 replicas x 2 stages, one stage per node, a real anvil
and real gloo pipelines, ``diloco.round_budget_s`` set.

Every replica trains the inner steps that fit in the budget (the count depends on the machine's load; the
test asserts nothing about it beyond the run's range), the stages of a replica agree on the count (the first
stage decides, its partner follows), every contribution declares it inside its signed envelope, the rounds
commit with every contribution, and every node's spot checks rerun the other replica's declared steps
bit-exactly.
"""

from __future__ import annotations

import re

import pytest
from node_fixtures import TINY, assert_chain_roots, run_logs, wait_for

from node import protocol as msg
from node.store.archive import Archive
from p2p.envelope import decode_envelope
from training.codec_wire import header_steps

MAX_ROUNDS = 60
MIN_STEPS, MAX_STEPS = 2, 12
SPOT_LINE = re.compile(r"spot check of replica (\d+) round (\d+): (\w+)")


def _spot_checks(slot) -> list[tuple[int, int, str]]:
    text = "\n".join(p.read_text(errors="replace") for p in sorted(slot.data_dir.glob("node-*.log")))
    return [(int(r), int(t), v) for r, t, v in SPOT_LINE.findall(text)]


@pytest.mark.slow  # about 5 minutes at a load of 30 on 2 cores (four node processes, anvil, two gloo pipelines)
@pytest.mark.timeout(1800)
def test_a_time_bounded_split_run_declares_its_steps_and_reruns_them_exactly(make_run):
    run = make_run(replicas=2, stages=2, split=True, settings=[
        *TINY, f"diloco.inner_steps={MAX_STEPS}", "diloco.round_budget_s=0.2", f"diloco.min_inner_steps={MIN_STEPS}",
        "diloco.overlap_steps=0", f"rounds={MAX_ROUNDS}", "join_timeout=60", "spot_checks=8"])
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
