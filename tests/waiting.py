"""Polling for tests that wait on real hosts and processes (a bound on the wait, never on how fast)."""

from __future__ import annotations

import time


def wait_until(predicate, timeout: float, what: str, interval: float = 0.2) -> None:
    """Poll ``predicate`` every ``interval`` s until true; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
