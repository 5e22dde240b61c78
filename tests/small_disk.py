"""A full disk for a real command: the command runs in a mount namespace of its own where a directory is a
64 KiB tmpfs (gone with the namespace, so nothing stays mounted). The suite runs as root, or where user
namespaces let ``unshare -r`` mount; elsewhere the probe fails the test with the reason (no skip)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

_MOUNT = 'mount -t tmpfs -o size=64k tmpfs "$0" && exec "$@"'


def small_disk_command(mount: Path, command: list[str]) -> list[str]:
    """``command`` in a mount namespace of its own where ``mount`` is a 64 KiB tmpfs."""
    userns = [] if os.geteuid() == 0 else ["-r"]
    return ["unshare", *userns, "-m", "sh", "-c", _MOUNT, str(mount), *command]


def check_small_disk(mount: Path) -> None:
    """Fail, naming why, when this machine cannot make the namespace (the tests need it: not root and no user
    namespaces, or no ``unshare``)."""
    probe = subprocess.run(small_disk_command(mount, ["true"]), capture_output=True, text=True, timeout=60,
                           check=False)
    assert probe.returncode == 0, ("a 64 KiB tmpfs in a mount namespace could not be made here (run the "
                                   f"suite as root, or allow user namespaces): {probe.stderr.strip()}")
