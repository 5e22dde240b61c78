"""Each variant the config names by a string has one registry keyed by that string (issue 61)."""

import pytest

from training.config import (
    DELAY_CORRECTIONS,
    INNER_OPTIMIZERS,
    OUTER_OPTIMIZERS,
    SCREEN_RULES,
    DilocoConfig,
    TrainingConfig,
)
from training.delay_correction import DELAY_CORRECTION_KINDS, NO_DELAY, delay_correction_for
from training.errors import TrainingConfigError
from training.inner_optimizers import INNER_OPTIMIZER_KINDS
from training.outer_optimizers import OUTER_OPTIMIZER_KINDS, outer_optimizer_for
from training.screen_rules import SCREEN_RULE_KINDS, screen_rule_for


@pytest.mark.parametrize(("registry", "names"), [
    (DELAY_CORRECTION_KINDS, DELAY_CORRECTIONS), (OUTER_OPTIMIZER_KINDS, OUTER_OPTIMIZERS),
    (INNER_OPTIMIZER_KINDS, INNER_OPTIMIZERS), (SCREEN_RULE_KINDS, SCREEN_RULES),
])
def test_every_name_the_config_accepts_has_one_kind_under_that_name(registry, names):
    assert tuple(registry) == names
    assert all(kind.name == name for name, kind in registry.items())


@pytest.mark.parametrize(("build", "field", "known"), [
    (lambda: DilocoConfig(delay_correction="later"), "diloco.delay_correction", DELAY_CORRECTIONS),
    (lambda: DilocoConfig(outer_optimizer="lion"), "diloco.outer_optimizer", OUTER_OPTIMIZERS),
    (lambda: DilocoConfig(screen_rule="both"), "diloco.screen_rule", SCREEN_RULES),
    (lambda: TrainingConfig(optimizer="sgd"), "training.optimizer", INNER_OPTIMIZERS),
])
def test_an_unknown_name_fails_at_load_naming_the_known_ones(build, field, known):
    with pytest.raises(TrainingConfigError) as caught:
        build()
    assert field in str(caught.value) and all(name in str(caught.value) for name in known)


def test_the_registries_pick_by_the_config():
    assert delay_correction_for(DilocoConfig(one_step_delay=False)) is NO_DELAY
    assert delay_correction_for(DilocoConfig(delay_correction="eager")).jumps_ahead
    assert outer_optimizer_for(DilocoConfig(outer_optimizer="adam", commitments="hashed")).moments == 2
    assert screen_rule_for(DilocoConfig()).name == "one_sided"
    budgeted = DilocoConfig(round_budget_s=1.0, min_inner_steps=10, screen_rule="paired")
    assert screen_rule_for(budgeted).per_window and screen_rule_for(budgeted).against
