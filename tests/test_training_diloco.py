"""The per-stage DiLoCoX engine: outer step, equivalences, the delay rule, checkpoints."""

from __future__ import annotations

import copy

import pytest
import torch

from training.codec_wire import decode_contribution
from training.compression import encode_contribution
from training.config import DilocoConfig
from training.config_compression import CompressionConfig
from training.diloco import aggregate, average_contributions, outer_step
from training.errors import AggregationError, EngineStateError, RoundOrderError
from training.stage_engine import StageEngine

RAW = CompressionConfig(enabled=False)


def test_outer_step_by_hand():
    theta, delta, zero = {"w": torch.tensor([1.0])}, {"w": torch.tensor([0.5])}, {"w": torch.tensor([0.0])}
    cfg = DilocoConfig(outer_lr=0.7, outer_momentum=0.9, nesterov=True)
    new, momentum = outer_step(theta, zero, delta, cfg)
    # m = 0.9*0 + 0.5 = 0.5; u = 0.5 + 0.9*0.5 = 0.95; theta = 1 - 0.7*0.95 = 0.335
    assert momentum["w"].item() == pytest.approx(0.5)
    assert new["w"].item() == pytest.approx(0.335, abs=1e-7)
    plain, _ = outer_step(theta, {"w": torch.tensor([1.0])}, delta,
                          DilocoConfig(outer_lr=0.7, outer_momentum=0.9, nesterov=False))
    # m = 0.9*1 + 0.5 = 1.4; theta = 1 - 0.7*1.4 = 0.02
    assert plain["w"].item() == pytest.approx(0.02, abs=1e-7)


@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_step_matches_torch_sgd(nesterov):
    g = torch.Generator().manual_seed(0)
    start = torch.randn(5, 3, generator=g)
    param = torch.nn.Parameter(start.clone())
    sgd = torch.optim.SGD([param], lr=0.7, momentum=0.9, nesterov=nesterov)
    cfg = DilocoConfig(outer_lr=0.7, outer_momentum=0.9, nesterov=nesterov)
    weights, momentum = {"w": start.clone()}, {"w": torch.zeros(5, 3)}
    for _ in range(4):
        delta = torch.randn(5, 3, generator=g)
        param.grad = delta.clone()
        sgd.step()
        weights, momentum = outer_step(weights, momentum, {"w": delta}, cfg)
    assert torch.allclose(weights["w"], param.detach(), atol=1e-6)


def test_average_is_fixed_order_float32_sum_then_divide():
    parts = [{"w": torch.tensor([0.1, 1e8])}, {"w": torch.tensor([0.2, 1.0])},
             {"w": torch.tensor([0.3, -1e8])}]
    expected = ((parts[0]["w"] + parts[1]["w"]) + parts[2]["w"]) / torch.tensor(3.0)
    assert torch.equal(average_contributions(parts)["w"], expected)
    with pytest.raises(AggregationError):
        average_contributions([])


def test_aggregate_is_pure_and_refuses_bad_input():
    weights, momentum = {"w": torch.ones(4, 4)}, {"w": torch.zeros(4, 4)}
    blob = encode_contribution({"w": torch.full((4, 4), 0.5)}, RAW, stage_index=0, outer_round=0)[0]
    before = (weights["w"].clone(), momentum["w"].clone())
    new, new_momentum, digest = aggregate(weights, momentum, [blob, blob], DilocoConfig())
    assert torch.equal(weights["w"], before[0]) and torch.equal(momentum["w"], before[1])
    assert len(digest) == 32 and not torch.equal(new["w"], weights["w"])
    with pytest.raises(AggregationError):
        aggregate(weights, momentum, [], DilocoConfig())
    # A malformed contribution costs only itself: the round is the one of the others.
    assert torch.equal(aggregate(weights, momentum, [blob, b"junk"], DilocoConfig())[0]["w"],
                       aggregate(weights, momentum, [blob], DilocoConfig())[0]["w"])
    # Nothing acceptable (here: the wrong round): a no-op, not a crash.
    same, same_momentum, _ = aggregate(weights, momentum, [blob], DilocoConfig(), outer_round=1)
    assert torch.equal(same["w"], weights["w"]) and torch.equal(same_momentum["w"], momentum["w"])


# --------------------------------------------------------------------------- DiLoCo == data-parallel SGD


def _toy_stages(seed: int) -> list[torch.nn.Linear]:
    torch.manual_seed(seed)
    return [torch.nn.Linear(4, 6), torch.nn.Linear(6, 2)]


def _loss(stages, x, y):
    return ((stages[1](torch.tanh(stages[0](x))) - y) ** 2).mean()


def _sgd_step(stages, x, y, lr):
    for stage in stages:
        stage.zero_grad()
    _loss(stages, x, y).backward()
    with torch.no_grad():
        for stage in stages:
            for p in stage.parameters():
                p -= lr * p.grad


def test_diloco_h1_sgd_outer_lr1_no_momentum_equals_data_parallel_sgd():
    replicas, lr, rounds = 3, 0.1, 6
    g = torch.Generator().manual_seed(1)
    data = [[(torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)) for _ in range(replicas)]
            for _ in range(rounds)]
    reference = _toy_stages(0)
    for batches in data:  # DP-SGD: the gradient averaged over replicas
        for stage in reference:
            stage.zero_grad()
        grads = []
        for x, y in batches:
            for stage in reference:
                stage.zero_grad()
            _loss(reference, x, y).backward()
            grads.append([p.grad.clone() for stage in reference for p in stage.parameters()])
        with torch.no_grad():
            for i, p in enumerate(p for stage in reference for p in stage.parameters()):
                p -= lr * torch.stack([grad[i] for grad in grads]).mean(0)

    cfg = DilocoConfig(inner_steps=1, outer_lr=1.0, outer_momentum=0.0, one_step_delay=False,
                       num_replicas=replicas)
    models = [_toy_stages(0) for _ in range(replicas)]
    engines = [[StageEngine(s, dict(stage.named_parameters()), cfg, RAW) for s, stage in enumerate(m)]
               for m in models]
    for outer_round, batches in enumerate(data):
        for model, (x, y) in zip(models, batches):
            _sgd_step(model, x, y, lr)
        blobs = [[engines[r][s].encode_contribution(outer_round)[0] for r in range(replicas)]
                 for s in range(2)]
        for r in range(replicas):
            for s in range(2):
                engines[r][s].apply_round(outer_round, blobs[s])
    for model in models:
        for ours, theirs in zip(model, reference):
            assert torch.allclose(ours.weight, theirs.weight, atol=1e-6)
            assert torch.allclose(ours.bias, theirs.bias, atol=1e-6)


# --------------------------------------------------------------------------- one-step delay


def _decode(blob, shape):
    return decode_contribution(blob, {"w": shape})["w"]


def test_delay_rule_rebases_local_progress_and_pseudo_gradient_is_the_round_progress():
    g = torch.Generator().manual_seed(2)
    init = torch.randn(3, 4, generator=g)
    steps = [0.1 * torch.randn(3, 4, generator=g) for _ in range(3)]
    cfg = DilocoConfig(one_step_delay=True, outer_lr=0.7, outer_momentum=0.9)

    def run(apply_first: bool):
        param = init.clone()
        engine = StageEngine(0, {"w": param}, cfg, RAW)
        param -= steps[0]  # round 0 trains
        blob0, _ = engine.encode_contribution(0)
        end0 = param.clone()
        param -= steps[1]  # round 1 trains while round 0 is exchanged
        local_now = param.clone()
        if apply_first:
            engine.apply_round(0, [blob0])
            blob1, _ = engine.encode_contribution(1)
        else:
            blob1, _ = engine.encode_contribution(1)
            engine.apply_round(0, [blob0])
        theta0 = engine.global_weights["w"].clone()
        assert torch.equal(param, torch.add(theta0, torch.sub(local_now, end0)))  # theta^0 + (L - E_0)
        return engine, param, blob0, blob1, theta0

    engine, param, blob0, blob1, theta0 = run(apply_first=False)
    other = run(apply_first=True)
    assert torch.allclose(_decode(blob0, (3, 4)), steps[0], atol=1e-6)  # Delta^0 = theta_init - E_0
    assert torch.allclose(_decode(blob1, (3, 4)), steps[1], atol=1e-6)  # Delta^1 = progress of round 1
    assert torch.allclose(_decode(other[3], (3, 4)), steps[1], atol=1e-6)  # same either call order
    expected0, _ = outer_step({"w": init}, {"w": torch.zeros(3, 4)}, {"w": _decode(blob0, (3, 4))}, cfg)
    assert torch.equal(theta0, expected0["w"])

    param -= steps[2]  # round 2 trains while round 1 is exchanged
    blob2, _ = engine.encode_contribution(2)
    momentum = engine.momentum["w"].clone()
    engine.apply_round(1, [blob1])
    expected1, _ = outer_step({"w": theta0}, {"w": momentum}, {"w": _decode(blob1, (3, 4))}, cfg)
    assert torch.equal(engine.global_weights["w"], expected1["w"])  # Delta^1 is applied to theta^0
    assert torch.allclose(_decode(blob2, (3, 4)), steps[2], atol=1e-6)
    engine.apply_round(2, [blob2])  # flush: no training since round 2 ended
    assert torch.equal(param, engine.global_weights["w"])


def test_without_delay_local_weights_become_the_global_weights():
    param = torch.ones(2, 2)
    engine = StageEngine(0, {"w": param}, DilocoConfig(one_step_delay=False), RAW)
    param -= 0.25
    engine.apply_round(0, [engine.encode_contribution(0)[0]])
    assert torch.equal(param, engine.global_weights["w"])
    with pytest.raises(RoundOrderError):
        engine.encode_contribution(0)  # repeated
    engine.encode_contribution(1)
    with pytest.raises(RoundOrderError):
        engine.encode_contribution(2)  # round 1 not applied yet (no delay)
    with pytest.raises(RoundOrderError):
        engine.apply_round(2, [])  # skipped round 1


def test_delay_allows_exactly_one_outstanding_round():
    engine = StageEngine(0, {"w": torch.zeros(2)}, DilocoConfig(one_step_delay=True), RAW)
    engine.encode_contribution(0)
    engine.encode_contribution(1)
    with pytest.raises(RoundOrderError):
        engine.encode_contribution(2)
    with pytest.raises(RoundOrderError):
        engine.apply_round(1, [])


def test_bad_contribution_is_excluded_and_the_round_goes_on():
    engines, params = [], []
    for _ in range(2):
        param = torch.ones(3)
        engine = StageEngine(0, {"w": param}, DilocoConfig(one_step_delay=False), RAW)
        param -= 0.5
        engines.append(engine)
        params.append(param)
    good, _ = engines[0].encode_contribution(0)
    engines[1].encode_contribution(0)
    result = engines[0].apply_round(0, [good, b"\x80"])
    alone = engines[1].apply_round(0, [good])
    assert result.weights_hash == alone.weights_hash and torch.equal(params[0], params[1])
    assert [(r.index, r.accepted, r.reason) for r in result.contributions] == [(0, True, ""),
                                                                               (1, False, "undecodable")]
    assert result.num_contributions == 2 and result.num_accepted == 1


# --------------------------------------------------------------------------- checkpoints


def test_state_dict_round_trip_continues_identically():
    cfg = DilocoConfig(one_step_delay=True)
    compression = CompressionConfig(error_budget=0.3, min_compress_numel=16)
    g = torch.Generator().manual_seed(4)
    steps = [0.01 * torch.randn(8, 6, generator=g) for _ in range(4)]
    param = torch.randn(8, 6, generator=g)
    engine = StageEngine(3, {"w": param}, cfg, compression)
    param -= steps[0]
    blob0, _ = engine.encode_contribution(0)
    param -= steps[1]
    engine.encode_contribution(1)  # round 1 outstanding, error feedback non-zero
    state = engine.state_dict()

    twin_param = param.clone()
    twin = StageEngine(3, {"w": twin_param}, cfg, compression)
    twin.load_state_dict(copy.deepcopy(state))
    for eng, p in ((engine, param), (twin, twin_param)):
        eng.apply_round(0, [blob0])
        p -= steps[2]
    assert torch.equal(param, twin_param)
    assert engine.encode_contribution(2)[0] == twin.encode_contribution(2)[0]

    wrong_stage = StageEngine(2, {"w": torch.zeros(8, 6)}, cfg, compression)
    with pytest.raises(EngineStateError):
        wrong_stage.load_state_dict(state)
    wrong_shape = StageEngine(3, {"w": torch.zeros(6, 8)}, cfg, compression)
    with pytest.raises(EngineStateError):
        wrong_shape.load_state_dict(state)
    with pytest.raises(EngineStateError):
        twin.load_state_dict({"version": 1})


def test_reset_correction_restarts_from_the_global_weights():
    cfg = DilocoConfig(one_step_delay=True, delay_correction="reset")
    param = torch.zeros(4)
    engine = StageEngine(0, {"w": param}, cfg, RAW)
    param -= 1.0
    blob0, _ = engine.encode_contribution(0)
    param -= 2.0  # round 1's progress: dropped locally, it travels in Delta^1
    blob1, _ = engine.encode_contribution(1)
    engine.apply_round(0, [blob0])
    assert torch.equal(param, engine.global_weights["w"])
    assert torch.allclose(_decode(blob1, (4,)), torch.full((4,), 2.0))


def test_config_rejects_unknown_delay_correction():
    from training.errors import TrainingConfigError

    with pytest.raises(TrainingConfigError, match="delay_correction"):
        DilocoConfig(delay_correction="rewind")


@pytest.mark.parametrize("correction", ["lookahead", "eager"])
def test_lookahead_with_one_replica_is_synchronous_diloco(correction):
    # One replica, lossless: its own estimate of theta^t IS theta^t, so overlapping the
    # exchange changes nothing but float rounding of the re-basing.
    g = torch.Generator().manual_seed(9)
    steps = [0.1 * torch.randn(6, generator=g) for _ in range(4)]
    init = torch.randn(6, generator=g)
    results = []
    for cfg in (DilocoConfig(one_step_delay=False),
                DilocoConfig(one_step_delay=True, delay_correction=correction)):
        param = init.clone()
        engine = StageEngine(0, {"w": param}, cfg, RAW)
        pending = None
        for outer_round, step in enumerate(steps):
            param -= step * (1 + 0.1 * param.abs())  # weight-dependent "training"
            if pending is not None:
                engine.apply_round(outer_round - 1, [pending])
            blob, _ = engine.encode_contribution(outer_round)
            if cfg.one_step_delay:
                pending = blob
                with pytest.raises(RoundOrderError):
                    engine.encode_contribution(outer_round + 1)  # must apply round t first
            else:
                engine.apply_round(outer_round, [blob])
        if pending is not None:
            engine.apply_round(len(steps) - 1, [pending])
        results.append(engine.global_weights["w"])
    assert torch.allclose(results[0], results[1], atol=1e-6)


def test_reset_refuses_to_drop_unencoded_progress():
    param = torch.zeros(3)
    engine = StageEngine(0, {"w": param}, DilocoConfig(delay_correction="reset"), RAW)
    param -= 1.0
    blob0, _ = engine.encode_contribution(0)
    param -= 1.0  # round 1 trained but not encoded
    with pytest.raises(RoundOrderError, match="reset"):
        engine.apply_round(0, [blob0])


def test_eager_starts_from_own_plus_the_others_previous_contribution():
    # Two replicas; after round 0 is applied, replica 0's start for round 2 is the outer step
    # from theta^0 with (own_1 + other_0) / 2 (arXiv 2502.12996), not own_1 alone.
    # unequal norms on purpose
    cfg = DilocoConfig(delay_correction="eager", outer_lr=0.7, outer_momentum=0.9, norm_clip=0)
    param = torch.zeros(3)
    engine = StageEngine(0, {"w": param}, cfg, RAW)
    other = encode_contribution({"w": torch.tensor([1.0, 2.0, 3.0])}, RAW, stage_index=0, outer_round=0)[0]
    param -= 0.5
    own0, _ = engine.encode_contribution(0)
    param -= 0.25
    engine.apply_round(0, [own0, other])
    global0, momentum0 = engine.global_weights["w"].clone(), engine.momentum["w"].clone()
    engine.encode_contribution(1)  # own_1 = 0.25 (progress of round 1)
    expected, _ = outer_step({"w": global0}, {"w": momentum0},
                             {"w": (torch.full((3,), 0.25) + torch.tensor([1.0, 2.0, 3.0])) / 2}, cfg)
    assert torch.allclose(param, expected["w"], atol=1e-6)
