"""A page as a real browser renders it: headless chromium's DOM after its scripts ran (the explorer's and the
audit's HTML tests)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def rendered_dom(url: str, profile: Path, *, virtual_time_ms: int | None = 10_000,
                 timeout: float = 120) -> str:
    """The DOM chromium dumps for ``url`` (profile in ``profile``); fails the test if chromium is absent."""
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.fail("Debian package 'chromium' is absent (a test dependency): run scripts/setup.sh")
    command = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--no-first-run", f"--user-data-dir={profile}"]
    if virtual_time_ms is not None:
        command.append(f"--virtual-time-budget={virtual_time_ms}")
    return subprocess.run([*command, "--dump-dom", url], check=False, capture_output=True, text=True,
                          timeout=timeout).stdout
