"""The security model (docs/TRUST.md) fuzzed as a whole: tests/trust_machine.py drives the real contract on
py-evm with honest members, a coalition below the quorum fraction and outsiders, checking every invariant
after every step. A short run here; the long one is slow (``pytest -m slow``)."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

from tests.trust_machine import TrustMachine

_SETTINGS = dict(deadline=None, suppress_health_check=list(HealthCheck), derandomize=False, database=None)


@pytest.mark.timeout(900)
def test_the_model_holds_in_a_short_fuzz():
    TrustMachine.TestCase.settings = settings(max_examples=2, stateful_step_count=20, **_SETTINGS)
    TrustMachine.TestCase().runTest()


@pytest.mark.slow
@pytest.mark.timeout(0)
def test_the_model_holds_in_a_long_fuzz():
    examples = int(os.environ.get("DLX_TRUST_FUZZ_EXAMPLES", "400"))
    TrustMachine.TestCase.settings = settings(max_examples=examples, stateful_step_count=250, **_SETTINGS)
    TrustMachine.TestCase().runTest()
