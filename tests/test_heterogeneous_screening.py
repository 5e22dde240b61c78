"""Screening of a time-bounded run (issue 44; docs/DILOCOX.md section 13, "Screening"): version 2 (an option,
``diloco.screen_rule = "two_sided"``) judges each
contribution by its slope (its loss applied alone against its loss applied against itself) and its curvature
(their mean over no update) against the median's, not by its loss alone.

The recorded failure it answers: under the one-step delay every contribution, applied alone to the current
weights, landed above their loss, and the longest (the 1x replica's 179 steps against about 80 and 35) the
furthest: "loss 2.21719 -> 2.42978 alone, above the median 2.37147 + 0.0443", an honest fast replica screened
out. The shape here: a quadratic loss (above a floor of 2, the cross-entropy's scale) whose minimum the
weights have nearly reached (the outer step already moved them), honest updates whose useful part grows with
the square root of their steps and whose noise with their steps.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from node.config import NodeConfig
from node.runconfig import config_hash, node_config_from_run, run_document
from training.config import DilocoConfig, ModelConfig
from training.data import generated_corpus
from training.errors import TrainingConfigError
from training.model import GPT, init_state_dict
from training.screening import judge, model_loss_fn, screen_contributions, screening_batch

N = 4096
LR = 0.7  # the heterogeneous bench's outer lr
STEPS = [179, 80, 35]  # the recorded run's counts


def _cfg(**overrides) -> DilocoConfig:
    fields = dict(inner_steps=800, num_replicas=3, round_budget_s=40.0, min_inner_steps=4,
                  one_step_delay=True, overlap_steps=0, outer_lr=LR, outer_momentum=0.5, screen_rel_tol=0.02,
                  screen_rule="two_sided")
    fields.update(overrides)
    return DilocoConfig(**fields)


# ----------------------------------------------------------------------------- the setting


def test_version_2_is_a_time_bounded_run_option_and_other_runs_keep_their_documents():
    assert DilocoConfig().screen_rule == "one_sided"
    assert _cfg(screen_rule="auto").screen_rule == "one_sided"  # the default, time-bounded or not
    assert _cfg().screen_rule == "two_sided"
    with pytest.raises(TrainingConfigError, match="screen_rule=\"two_sided\" needs diloco.round_budget_s"):
        DilocoConfig(screen_rule="two_sided")
    with pytest.raises(TrainingConfigError, match="screen_rule='median'"):
        _cfg(screen_rule="median")
    node = NodeConfig()
    assert "screen_rule" not in run_document(node)["diloco"]
    document = run_document(dataclasses.replace(node, diloco=_cfg(exchange="full")))
    assert document["diloco"]["screen_rule"] == "two_sided"
    assert node_config_from_run(document).diloco.screen_rule == "two_sided"
    # A time-bounded run without the option (made before version 2 or since) names no rule: version 1 (its
    # document, and so its hash, what it was).
    before = run_document(dataclasses.replace(node, diloco=_cfg(exchange="full", screen_rule="one_sided")))
    assert "screen_rule" not in before["diloco"]
    assert node_config_from_run(before).diloco.screen_rule == "one_sided"
    del document["diloco"]["screen_rule"]
    assert config_hash(document) == config_hash(before)


# ----------------------------------------------------------------------------- the recorded failure's shape


def _delayed_round():
    """Weights 0.5 from the minimum along ``u``; honest updates of 179, 80 and 35 steps:
    ``d = -0.5 sqrt(k / 80) u - e``, ``|e|^2 = sqrt(k / 80)`` (``theta - lr d`` moves towards the target and
    off it)."""
    generator = torch.Generator().manual_seed(0)
    u = torch.zeros(N)
    u[0] = 1.0
    target = 0.5 * u

    def loss(weights):
        return 2.0 + float(((weights["w"].double() - target.double()) ** 2).sum())

    honest = []
    for k in STEPS:
        noise = torch.randn(N, generator=generator)
        noise[0] = 0.0
        noise *= (k / 80) ** 0.25 / float(noise.norm())
        honest.append({"w": -0.5 * math.sqrt(k / 80) * u - noise})
    return loss, {"w": torch.zeros(N)}, honest


def test_a_long_honest_contribution_under_the_delay_is_kept():
    loss, weights, honest = _delayed_round()
    v1 = screen_contributions(loss, weights, honest, _cfg(screen_rule="one_sided"), STEPS)
    # Version 1: every one lands above L_b, the longest furthest, and it is screened out (the recorded case).
    assert all(r.loss_after > r.loss_before for r in v1)
    assert [r.excluded for r in v1] == [True, False, False]
    assert "above the median" in v1[0].detail and v1[0].loss_against is None
    v2 = screen_contributions(loss, weights, honest, _cfg(), STEPS)
    assert [r.excluded for r in v2] == [False, False, False]
    # The same losses alone, bit for bit; the rule on the recorded losses is pure.
    assert [r.loss_after for r in v2] == [r.loss_after for r in v1]
    assert all(r.loss_against > r.loss_after for r in v2)
    after = {r.index: r.loss_after for r in v2}
    against = {r.index: r.loss_against for r in v2}
    assert judge(v2[0].loss_before, after, 3, _cfg(), against) == v2
    with pytest.raises(ValueError, match="against itself"):
        judge(v2[0].loss_before, after, 3, _cfg())
    # Fewer than three screened: nothing excluded, whatever the losses.
    assert not any(r.excluded for r in judge(2.0, {0: math.inf, 1: 2.0}, 2, _cfg(), {0: math.inf, 1: 9.0}))


@pytest.mark.parametrize("attack, like", [
    ("sign-flip", 0), ("sign-flip", 1), ("sign-flip", 2), ("noise", 0), ("noise", 1), ("noise", 2),
    ("scaled-4", 1), ("huge-1e3", 1), ("huge-1e6", 1),
])
def test_byzantine_contributions_are_still_excluded_in_the_delayed_round(attack, like):
    """An attack shaped like honest contribution ``like``, declaring its count (the rule reads no count)."""
    loss, weights, honest = _delayed_round()
    template = honest[like]["w"]
    if attack == "sign-flip":
        bad = -template
    elif attack == "noise":  # noise of the honest update's norm
        noise = torch.randn(N, generator=torch.Generator().manual_seed(5))
        bad = noise * (float(template.norm()) / float(noise.norm()))
    else:
        bad = float(attack.split("-")[1]) * template
    reports = screen_contributions(loss, weights, honest + [{"w": bad}], _cfg(num_replicas=4),
                                   STEPS + [STEPS[like]])
    assert [r.excluded for r in reports] == [False, False, False, True]


def _model_case():
    """The tiny GPT's case: three honest gradient steps, then a sign flip, noise of the honest norm, a
    1e6-scaled update and one that does not decode; with the loss function of its screening batch."""
    tiny = ModelConfig(preset="tiny", init="torch")
    x, y = screening_batch(generated_corpus(0, n_bytes=40_000), run_seed=7, outer_round=3, batch_size=8,
                           block_size=tiny.block_size)
    model = GPT(tiny, seed=0)
    _, value = model(x, y)
    value.backward()
    gradient = {n: 0.5 * p.grad.detach().clone() for n, p in model.named_parameters()}
    honest = [{n: v * (1 + 0.1 * k) for n, v in gradient.items()} for k in range(3)]
    norm = math.sqrt(sum(float(v.double().pow(2).sum()) for v in gradient.values()))
    g = torch.Generator().manual_seed(1)
    noise = {n: torch.randn(v.shape, generator=g) for n, v in gradient.items()}
    noise_norm = math.sqrt(sum(float(v.double().pow(2).sum()) for v in noise.values()))
    attacks = [{n: -v for n, v in gradient.items()}, {n: v * (norm / noise_norm) for n, v in noise.items()},
               {n: 1e6 * v for n, v in gradient.items()}, None]
    loss_fn = model_loss_fn(tiny, x, y)
    return tiny, loss_fn, honest, attacks


def test_the_model_case_excludes_the_same_attacks():
    """test_training_robust's case on the tiny GPT (three honest gradient steps, a sign flip, noise of the
    honest norm, a 1e6-scaled update, one that does not decode) in a time-bounded run: the same exclusions as
    version 1."""
    tiny, loss_fn, honest, attacks = _model_case()
    weights = init_state_dict(tiny, 0)
    reports = screen_contributions(loss_fn, weights, honest + attacks, _cfg(num_replicas=7, outer_lr=1.0),
                                   [8, 20, 50, 8, 20, 50, 20])
    assert [r.excluded for r in reports] == [False] * 3 + [True] * 3 + [False]
    assert reports[6].loss_after is None and reports[6].loss_against is None
    v1 = screen_contributions(loss_fn, weights, honest + attacks, DilocoConfig(outer_lr=1.0))
    assert [r.excluded for r in v1] == [r.excluded for r in reports]


# ----------------------------------------------------------------------------- version 3 ("paired")


WINDOWS = 16


def _noisy_batch_round():
    """:func:`_delayed_round`'s weights and honest updates, on a screening batch of 16 windows whose losses
    differ by a linear term ``b_w . theta`` (each window's own gradient noise) along the longest update's
    noise part: on this batch its slope is 0.0043 with a standard error of 0.061 (the node's recorded
    version-2 exclusions were slopes of 0.019 to 0.033 under a least slope of 0.045), the others' 0.70 and
    0.47 with errors near 0."""
    _, weights, honest = _delayed_round()
    u = torch.zeros(N)
    u[0] = 1.0
    noise = -(honest[0]["w"] + 0.5 * math.sqrt(STEPS[0] / 80) * u)
    direction = noise / float(noise.norm())
    spread = torch.randn(WINDOWS, generator=torch.Generator().manual_seed(1))
    spread -= spread.mean()
    linear = [(0.609 + 0.14 * float(spread[w])) * direction.double() for w in range(WINDOWS)]

    class Batch:
        """Per-window losses, as training.screening.ModelLoss gives them."""

        def windows(self, weights):
            theta = weights["w"].double()
            quadratic = 2.0 + float(((theta - 0.5 * u.double()) ** 2).sum())
            return [quadratic + float(term @ theta) for term in linear]

        def __call__(self, weights):
            values = self.windows(weights)
            return sum(values) / len(values)

    return Batch(), weights, honest


def test_version_3_is_a_time_bounded_run_option_named_in_its_document():
    assert _cfg(screen_rule="paired").screen_rule == "paired"
    with pytest.raises(TrainingConfigError, match="screen_rule=\"paired\" needs diloco.round_budget_s"):
        DilocoConfig(screen_rule="paired")
    document = run_document(dataclasses.replace(NodeConfig(),
                                                diloco=_cfg(exchange="full", screen_rule="paired")))
    assert document["diloco"]["screen_rule"] == "paired"
    assert node_config_from_run(document).diloco.screen_rule == "paired"


def test_version_3_keeps_a_long_honest_contribution_whose_slope_the_batch_cannot_tell():
    loss, weights, honest = _noisy_batch_round()
    v2 = screen_contributions(loss, weights, honest, _cfg(), STEPS)
    assert [r.excluded for r in v2] == [True, False, False]
    assert "slope 0.0043" in v2[0].detail and "not above 0.045" in v2[0].detail
    v3 = screen_contributions(loss, weights, honest, _cfg(screen_rule="paired"), STEPS)
    assert [r.excluded for r in v3] == [False, False, False]
    slopes = [r.loss_against - r.loss_after for r in v3]
    assert slopes[0] < 0.045 < 0.0043 + v3[0].slope_error and v3[0].slope_error > 0.05
    assert all(r.slope_error < 0.001 for r in v3[1:]) and min(slopes[1:]) > 0.4
    # The rule on the recorded numbers is pure: the audit's re-derivation.
    after = {r.index: r.loss_after for r in v3}
    against = {r.index: r.loss_against for r in v3}
    errors = {r.index: r.slope_error for r in v3}
    assert judge(v3[0].loss_before, after, 3, _cfg(screen_rule="paired"), against, errors) == v3
    with pytest.raises(ValueError, match="standard error"):
        judge(v3[0].loss_before, after, 3, _cfg(screen_rule="paired"), against)
    # A loss without per-window values cannot be judged by version 3.
    with pytest.raises(ValueError, match="per-window"):
        screen_contributions(_delayed_round()[0], weights, honest, _cfg(screen_rule="paired"), STEPS)


@pytest.mark.parametrize("attack, like", [
    ("sign-flip", 1), ("sign-flip", 2), ("noise", 0), ("noise", 1), ("noise", 2),
    ("scaled-4", 0), ("scaled-4", 1), ("scaled-4", 2), ("huge-1e6", 1),
])
def test_version_3_still_excludes_attacks_on_the_noisy_batch(attack, like):
    loss, weights, honest = _noisy_batch_round()
    template = honest[like]["w"]
    if attack == "sign-flip":
        bad = -template
    elif attack == "noise":
        noise = torch.randn(N, generator=torch.Generator().manual_seed(5))
        bad = noise * (float(template.norm()) / float(noise.norm()))
    else:
        bad = float(attack.split("-")[1]) * template
    reports = screen_contributions(loss, weights, honest + [{"w": bad}],
                                   _cfg(num_replicas=4, screen_rule="paired"), STEPS + [STEPS[like]])
    assert [r.excluded for r in reports] == [False, False, False, True]


def test_version_3_cannot_exclude_the_flip_of_a_contribution_whose_slope_the_batch_cannot_tell():
    """The rule's limit, written down: the batch that cannot tell the longest update's direction (its slope
    within its error of the least one) cannot tell its negation's either; a sign flip there passes, as the
    update does."""
    loss, weights, honest = _noisy_batch_round()
    reports = screen_contributions(loss, weights, honest + [{"w": -honest[0]["w"]}],
                                   _cfg(num_replicas=4, screen_rule="paired"), STEPS + [STEPS[0]])
    assert [r.excluded for r in reports] == [False, False, False, False]


def test_version_3_on_the_model_case_excludes_the_same_attacks():
    """test_the_model_case_excludes_the_same_attacks with version 3, the tiny GPT's per-window losses."""
    tiny, loss_fn, honest, attacks = _model_case()
    assert len(loss_fn.windows(init_state_dict(tiny, 0))) == 8
    reports = screen_contributions(loss_fn, init_state_dict(tiny, 0), honest + attacks,
                                   _cfg(num_replicas=7, outer_lr=1.0, screen_rule="paired"),
                                   [8, 20, 50, 8, 20, 50, 20])
    assert [r.excluded for r in reports] == [False] * 3 + [True] * 3 + [False]
    assert all(r.slope_error > 0 for r in reports[:6]) and reports[6].slope_error is None


def test_the_simulation_screens_a_version_3_run_with_each_slope_and_its_error():
    """training.simulate (the node's algorithm, one-step delay) screens every round of a version-3 run through
    screen_contributions: each report carries its loss against itself and its slope's error, and a
    sign-flipped replica is left out of every round from 1 (the node, the fork repair's derive and the audit
    call the same
    function: tests/test_heterogeneous_e2e.py audits a real run)."""
    from training.codec_wire import declare_steps, decode_contribution
    from training.compression import encode_contribution
    from training.config import PipelineConfig, TrainingConfig
    from training.config_compression import CompressionConfig
    from training.simulate import simulate

    # the fourth replica trains honestly and sends the sign flip
    def flip_replica_3(outer_round, stage, blobs):
        shapes = {n: tuple(t.shape) for n, t in init_state_dict(ModelConfig(preset="tiny"), 0).items()}
        flipped = {n: -t for n, t in decode_contribution(blobs[3], shapes, stage_index=stage,
                                                         outer_round=outer_round).items()}
        blob = encode_contribution(flipped, CompressionConfig(enabled=False), stage_index=stage,
                                   outer_round=outer_round)[0]
        return blobs[:3] + [declare_steps(blob, 6)]

    diloco = _cfg(inner_steps=6, min_inner_steps=6, round_budget_s=1.0, num_replicas=4, screen_rule="paired")
    result = simulate("diloco_x", generated_corpus(0, n_bytes=60_000), ModelConfig(preset="tiny"),
                      TrainingConfig(seed=0, batch_size=4), diloco, CompressionConfig(enabled=False),
                      PipelineConfig(num_stages=1), 4, tamper=flip_replica_3)
    applied = [a for record in result.rounds for a in record.applied]
    assert [a["outer_round"] for a in applied] == [0, 1, 2, 3]
    for round_ in applied:
        reports = round_["screening"]
        assert len(reports) == 4 and all(r["loss_against"] is not None and r["slope_error"] > 0
                                         for r in reports)
        if round_["outer_round"] >= 1:
            assert [r["excluded"] for r in reports] == [False, False, False, True], reports
