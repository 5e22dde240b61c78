"""The node's per-round work on the background lane (node/live/state/lane.py) gives the inline run's bytes.

Two replica workers with the same seed run the same rounds of the one-step delay: one does
everything on the test's thread in the node's old order, the other as the node does now
(copies on the training thread, compress/serialise/eval on a lane thread while the next round
trains). Every start state, contribution, held-out loss and weights hash must be equal, bit for bit.
"""

from __future__ import annotations

import threading

import pytest
import torch

from node.config import load_config
from node.live.state.lane import RoundLane
from node.live.worker.replica import ReplicaWorker
from training.config import DilocoConfig
from training.config_compression import CompressionConfig
from training.errors import RoundOrderError
from training.stage_engine import StageEngine

ROUNDS = 4


def _worker(correction: str = "rebase", delay: bool = True) -> ReplicaWorker:
    cfg = load_config(None, ["model.preset=tiny", "diloco.inner_steps=3", "training.batch_size=2",
                             f"rounds={ROUNDS}", "torch_threads=1",
                             f"diloco.one_step_delay={str(delay).lower()}", "diloco.overlap_steps=0",
                             f"diloco.delay_correction={correction}", "pipeline.num_stages=2"])
    worker = ReplicaWorker(cfg, 0, (0, 1), 0)
    worker.start(10, 10)
    return worker


def _peer_blob(worker: ReplicaWorker, stage: int, outer_round: int, blob: bytes) -> list[bytes]:
    """The round's contributions: this replica's and a second, fixed one (another replica's stand-in)."""
    return [blob, blob]


def _inline_run(worker: ReplicaWorker) -> dict:
    out = {"states": [], "blobs": [], "evals": [], "hashes": []}
    pending: dict[int, dict[int, bytes]] = {}
    for outer_round in range(ROUNDS):
        out["states"].append(worker.capture_start_states(outer_round))
        worker.train_round(outer_round)
        out["evals"].append(worker.eval_loss())
        blobs = {stage: worker.encode(stage, outer_round)[0] for stage in worker.stages}
        out["blobs"].append(blobs)
        if outer_round >= 1:
            for stage in worker.stages:
                out["hashes"].append(worker.apply(stage, outer_round - 1,
                                                  _peer_blob(worker, stage, outer_round - 1,
                                                             pending[stage])).weights_hash)
        pending = blobs
    for stage in worker.stages if worker.cfg.diloco.delay_correction != "reset" else ():  # see _lane_run
        out["hashes"].append(worker.apply(stage, ROUNDS - 1,
                                          _peer_blob(worker, stage, ROUNDS - 1, pending[stage])).weights_hash)
    return out


def _lane_run(worker: ReplicaWorker) -> dict:
    out = {"states": [], "blobs": [], "evals": [], "hashes": []}
    lane = RoundLane()
    threads: set[str] = set()

    def on_lane(task):
        def run():
            threads.add(threading.current_thread().name)
            return task()
        return lane.submit(run)

    evals, encodes, captures = [], [], []
    try:
        for outer_round in range(ROUNDS):
            captures.append(on_lane(worker.start_state_capture(outer_round)))
            worker.train_round(outer_round)  # trains while the lane serialises this round's start state
            evals.append(on_lane(worker.eval_snapshot()))
            lane.join(captures[-1])
            if encodes:
                lane.join(encodes[-1])
            assert all(worker.prepare_encode(stage, outer_round) for stage in worker.stages)
            encodes.append(on_lane(lambda r=outer_round: {s: worker.encode(s, r)[0] for s in worker.stages}))
            if outer_round >= 1:  # applied while this round's contribution is compressed on the lane
                previous = lane.join(encodes[-2])
                for stage in worker.stages:
                    out["hashes"].append(worker.apply(stage, outer_round - 1,
                                                      _peer_blob(worker, stage, outer_round - 1,
                                                                 previous[stage])).weights_hash)
        last = lane.join(encodes[-1])
        # ("reset" applies no round after the last one's encode: its params are no longer that round's end.)
        for stage in worker.stages if worker.cfg.diloco.delay_correction != "reset" else ():
            out["hashes"].append(worker.apply(stage, ROUNDS - 1, _peer_blob(worker, stage, ROUNDS - 1,
                                                                            last[stage])).weights_hash)
        out["states"] = [lane.join(f) for f in captures]
        out["evals"] = [lane.join(f) for f in evals]
        out["blobs"] = [lane.join(f) for f in encodes]
    finally:
        lane.close()
    assert threads == {"round-lane"}
    return out


@pytest.mark.parametrize("correction", ["rebase", "reset"])
def test_lane_gives_the_inline_bytes(correction):
    inline = _inline_run(_worker(correction))
    laned = _lane_run(_worker(correction))
    assert laned["states"] == inline["states"]  # what the contributions bind, served to spot checkers
    assert laned["blobs"] == inline["blobs"]  # contribution bytes
    assert laned["hashes"] == inline["hashes"]  # weights after every outer step
    assert [x.hex() for x in map(lambda v: torch.tensor(v, dtype=torch.float64).numpy().tobytes(),
                                 laned["evals"])] \
                                 == [torch.tensor(v, dtype=torch.float64).numpy().tobytes().hex()
                                     for v in inline["evals"]]
    assert len(set(inline["evals"])) == ROUNDS  # the eval saw the weights move: a stale copy would repeat


def test_eval_snapshot_is_frozen_while_training_goes_on():
    worker = _worker()
    worker.train_round(0)
    snapshot = worker.eval_snapshot()
    before = worker.eval_loss()
    worker.train_round(1)
    assert snapshot() == before != worker.eval_loss()


def test_prepared_encode_refuses_out_of_order_and_lookahead():
    param = torch.nn.Parameter(torch.ones(3))
    engine = StageEngine(0, {"w": param}, DilocoConfig(one_step_delay=True), CompressionConfig(enabled=False))
    engine.prepare_encode(0)
    with pytest.raises(RoundOrderError):
        engine.prepare_encode(1)  # round 0 not encoded yet
    with pytest.raises(RoundOrderError):
        engine.encode_contribution(1)
    engine.encode_contribution(0)
    lookahead = StageEngine(0, {"w": param}, DilocoConfig(one_step_delay=True, delay_correction="lookahead"),
                            CompressionConfig(enabled=False))
    assert not lookahead.can_prepare
    with pytest.raises(RoundOrderError):
        lookahead.prepare_encode(0)


def test_lookahead_worker_keeps_the_whole_encode_inline():
    worker = _worker("lookahead")
    worker.train_round(0)
    assert not any(worker.prepare_encode(stage, 0) for stage in worker.stages)
    worker.encode(0, 0)  # the whole encode still works after a refused prepare


def test_lane_runs_in_order_and_a_failure_poisons_it():
    lane = RoundLane()
    order: list[int] = []
    gate = threading.Event()
    first = lane.submit(lambda: (gate.wait(5), order.append(1)))
    second = lane.submit(lambda: order.append(2) or "two")
    gate.set()
    assert lane.join(second) == "two" and order == [1, 2] and first.done()

    def boom():
        raise ValueError("encode failed")

    lane.submit(boom)
    after = lane.submit(lambda: order.append(3))
    with pytest.raises(ValueError, match="encode failed"):
        lane.join(after)
    with pytest.raises(ValueError, match="encode failed"):
        lane.join(second)  # an earlier success still surfaces the failure at the next join
    assert order == [1, 2]  # nothing ran after the failure
    lane.close()
    with pytest.raises(RuntimeError):
        lane.submit(lambda: None)


def _engine_pair():
    from training.compression import encode_contribution

    engines = []
    for _ in range(2):
        param = torch.nn.Parameter(torch.arange(12, dtype=torch.float32).reshape(4, 3) / 7)
        engines.append((StageEngine(0, {"w": param}, DilocoConfig(one_step_delay=True, outer_lr=0.7,
                                                                   outer_momentum=0.9),
                                    CompressionConfig(enabled=False)), param))
    blobs = [encode_contribution({"w": torch.full((4, 3), v)}, CompressionConfig(enabled=False),
                                 stage_index=0, outer_round=0)[0] for v in (0.25, -0.125)]
    return engines, blobs


def test_prepared_aggregation_on_another_thread_equals_the_inline_outer_step():
    ((inline, p_inline), (prepped, p_prepped)), blobs = _engine_pair()
    for engine, param in ((inline, p_inline), (prepped, p_prepped)):
        with torch.no_grad():
            param.add_(0.5)
        engine.encode_contribution(0)
        with torch.no_grad():
            param.add_(0.25)  # round 1 trained while round 0 is exchanged
        engine.encode_contribution(1)
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("p", prepped.prepare_aggregation(0, blobs)))
    thread.start()
    thread.join()
    assert prepped.prepared_valid(box["p"], 0) and not prepped.prepared_valid(box["p"], 1)
    a = inline.apply_round(0, blobs)
    b = prepped.apply_round(0, blobs, prepared=box["p"])
    assert a.weights_hash == b.weights_hash and torch.equal(p_inline.detach(), p_prepped.detach())
    assert all(torch.equal(inline.momentum[n], prepped.momentum[n]) for n in inline.momentum)
    assert not prepped.prepared_valid(box["p"], 0)  # the global state moved on: a stale result is not used


def test_a_stale_prepared_aggregation_is_recomputed_not_used():
    engines, blobs = _engine_pair()
    engine, _param = engines[0]
    engine.encode_contribution(0)
    stale = engine.prepare_aggregation(0, blobs)
    engine.global_weights = {"w": engine.global_weights["w"].clone()}  # e.g. a checkpoint load in between
    result = engine.apply_round(0, blobs, prepared=stale)
    assert result.weights_hash != b"" and engine.global_weights["w"] is not stale.aggregation.new_global["w"]
