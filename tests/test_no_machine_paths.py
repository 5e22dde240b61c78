"""Nothing in the repository names a directory of the machine it was made on (issue 65 point 15).

Every tracked text file but this one is read: no absolute path under a home or work directory (``/home/``,
``/Users/``, ``/root/``, ``/work/``), no device machine's interpreter (``/opt/torch/``), and no path to the
corpus beside a developer's clone (``../shared/``, ``shared/data``): benchmarks take the data ``dlx-node data
fetch`` keeps, and a recorded result names the cache as ``$DLX_DATA_DIR`` (bench/benchio.py ``scrub_paths``).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

#: A machine's directories: not after a word character, ``$`` or ``}`` (``$PREFIX/root/proc`` is a path
#: inside an install prefix, not the machine's ``/root``).
MACHINE_PATH = re.compile(r"(?<![\w$}.])/(?:home|Users|root|work)/[\w.-]|/opt/torch/|\.\./shared/"
                          r"|shared/data/")


def _tracked_files() -> list[Path]:
    done = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=False)
    if done.returncode != 0:  # not a git checkout (an unpacked sdist): every file under the tree
        return [p for p in REPO.rglob("*") if p.is_file() and ".git" not in p.parts]
    return [REPO / name for name in done.stdout.decode().split("\0") if name]


def test_no_tracked_file_names_a_path_of_a_developers_machine():
    found = []
    for path in _tracked_files():
        if not path.is_file() or path.stat().st_size > 20_000_000 or path == Path(__file__).resolve():
            continue
        data = path.read_bytes()
        if b"\0" in data[:4096]:  # binary
            continue
        for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            if MACHINE_PATH.search(line):
                found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()[:160]}")
    assert not found, "\n".join(found[:40])


@pytest.mark.parametrize("text", ["corpus /home/alice/data/x.txt", '"out": "/work/main/bench/results/a.json"',
                                  "--data ../shared/data/tinyshakespeare/input.txt",
                                  "/opt/torch/.venv/bin/python3 bench/x.py"])
def test_the_check_catches_a_machines_path(text):
    assert MACHINE_PATH.search(text)


def test_a_recorded_result_names_no_directory_of_this_machine(tmp_path, monkeypatch):
    from bench.benchio import REPO as BENCH_REPO
    from bench.benchio import scrub_paths

    monkeypatch.setenv("DLX_DATA_DIR", str(tmp_path / "cache"))
    # a path beside neither the clone nor home, kept as it is (a clone in /tmp itself makes /tmp "..")
    elsewhere = next(p for p in ("/tmp/dlx-x", "/var/tmp/dlx-x", "/srv/dlx-x")
                     if not any(str(d) in p for d in (BENCH_REPO.parent, Path.home())))
    text = (f'{{"data": "{tmp_path}/cache/tinyshakespeare/input.txt", '
            f'"out": "{BENCH_REPO}/bench/results/x.json", "beside": "{BENCH_REPO.parent}/other/file", '
            f'"home": "{Path.home()}/notes.txt", "tmp": "{elsewhere}"}}')
    scrubbed = scrub_paths(text)
    assert scrubbed == ('{"data": "$DLX_DATA_DIR/tinyshakespeare/input.txt", '
                        '"out": "./bench/results/x.json", "beside": "../other/file", '
                        f'"home": "~/notes.txt", "tmp": "{elsewhere}"}}')
