"""A restarted split-cluster node whose partner is not at the rendezvous yet waits for it, never exits.

Issue 30: the restarted node waited 180 s at the rendezvous for a partner that had not come back
(it was itself restarting, or busy finishing a round), then exited, and its replica never came
back. The real pipeline case runs in tests/test_split_cluster_e2e.py and bench/bench_chaos.py
--split; here the worker is a stand-in at the pipeline boundary whose rendezvous fails a few
times, so the rule is checked in a second.
"""

from __future__ import annotations

import threading

import pytest
from node_fixtures import TINY

from node.config import load_config
from node.live.assembly import NodeParts
from node.live.exchange.coordination import RoundStopped
from training.errors import PipelineError


class Worker:
    """Fails the rendezvous ``failures`` times (the partner not there yet), then forms the pipeline."""

    def __init__(self, failures: int, stop: threading.Event | None = None) -> None:
        self.failures = failures
        self.attempts = 0
        self.stop = stop

    def start(self, rendezvous_timeout: float, op_timeout: float, mark=None) -> None:
        self.attempts += 1
        if self.attempts > self.failures:
            return
        if self.stop is not None and self.attempts == 2:
            self.stop.set()  # SIGTERM while it waits
        raise PipelineError(f"rank 1/2: pipeline rendezvous failed: attempt {self.attempts}")


@pytest.fixture
def node(tmp_path):
    cfg = load_config(None, [*TINY, f"data_dir={tmp_path}", "cluster=c0", "cluster_size=2",
                             "pipeline.num_stages=2"])
    parts = NodeParts(cfg, stop=threading.Event())
    yield parts
    parts.close()


def test_the_rendezvous_is_tried_again_until_the_partner_is_there(node):
    worker = Worker(failures=3)
    node.start_worker(worker)
    assert worker.attempts == 4
    assert node.progress.state == "waiting for partner"  # what status.json said meanwhile


def test_a_stop_while_waiting_for_the_partner_ends_the_wait(node):
    worker = Worker(failures=10, stop=node.stop)
    with pytest.raises(RoundStopped):
        node.start_worker(worker)
    assert worker.attempts == 2
