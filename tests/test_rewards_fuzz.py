"""The reward pool's invariants (issue 77: solvency, budget, finality, a claim pays once, forfeits) fuzzed on
py-evm by tests/reward_machine.py: claimers, funders, sweepers, convictions and overturns in any order. A
short run here (3 x 15: hypothesis's first example is the empty one, so a single example tests nothing);
the long one is slow (``pytest -m slow``)."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

from tests.reward_machine import RewardMachine

_SETTINGS = dict(deadline=None, suppress_health_check=list(HealthCheck), derandomize=False, database=None)


@pytest.mark.timeout(900)
def test_the_pool_invariants_hold_in_a_short_fuzz():
    RewardMachine.TestCase.settings = settings(max_examples=3, stateful_step_count=15, **_SETTINGS)
    RewardMachine.TestCase().runTest()


@pytest.mark.slow
@pytest.mark.timeout(0)
def test_the_pool_invariants_hold_in_a_long_fuzz():
    examples = int(os.environ.get("DLX_REWARD_FUZZ_EXAMPLES", "50"))
    RewardMachine.TestCase.settings = settings(max_examples=examples, stateful_step_count=60, **_SETTINGS)
    RewardMachine.TestCase().runTest()
