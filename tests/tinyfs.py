"""A real, tiny filesystem for disk-full tests: a tmpfs of a few MiB mounted on a test's directory.

Needs root (or CAP_SYS_ADMIN); where ``mount`` is not permitted the test fails, saying so.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def tiny_filesystem(directory: Path, size: str = "8m") -> Iterator[Path]:
    """Mount a tmpfs of ``size`` on ``directory`` (created; what it held is hidden meanwhile); unmount
    after."""
    directory.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs on {directory} (the disk-full tests need root or CAP_SYS_ADMIN, "
                    f"as the NAT tests do): {mounted.stderr.strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], capture_output=True, check=False)


def fill(directory: Path, name: str = "filler") -> Path:
    """Write one file into ``directory`` until its filesystem refuses more (ENOSPC); return the file."""
    path = directory / name
    block = b"\0" * (64 << 10)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        while True:
            try:
                os.write(fd, block[: 4096] if os.statvfs(directory).f_bavail < 16 else block)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                return path
    finally:
        os.close(fd)
