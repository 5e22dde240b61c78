"""Where a benchmark writes its one current result, and what it records beside it.

Every script under bench/ writes exactly one JSON under bench/results/ (named in
``RESULT_FILES`` of scripts/results_page.py), overwriting it; the history of a
result is the history of that file in git. ``write_result`` adds a ``recorded``
block (the command, the date, the commit, the machine and its load) that
docs/RESULTS.md shows beside each table.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"


def default_out(script: str) -> str:
    """``bench/results/<name>.json`` for ``bench/bench_<name>.py`` (the one current result of a script)."""
    stem = Path(script).stem
    return str(RESULTS / f"{stem.removeprefix('bench_')}.json")


def machine() -> dict:
    """The CPU model, core count, kernel, Python and torch (if loaded) of this machine."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": model or platform.processor(), "cpus": os.cpu_count(), "kernel": platform.release(),
            "python": platform.python_version()}
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch"] = torch.__version__
    return info


def _commit() -> str:
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip()


def recorded(load_at_start: list[float] | None = None) -> dict:
    """What docs/RESULTS.md prints under a result: command line, UTC date, commit, machine, load."""
    return {
        "command": " ".join(["python", *[a if " " not in a else repr(a) for a in sys.argv]]),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _commit(),
        "machine": machine(),
        "load_average": {"start": load_at_start, "end": list(os.getloadavg())},
    }


def write_result(path: str | Path, result: dict, load_at_start: list[float] | None = None) -> Path:
    """Write ``result`` (with its ``recorded`` block) to ``path`` atomically, replacing what was there."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    result = {**result, "recorded": recorded(load_at_start)}
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(result, indent=1, default=str) + "\n")
    os.replace(temporary, path)
    return path


#: Where the benchmarks' corpus lies beside a checkout that has the shared data (relative to the repository).
SHARED_CORPUS = "../shared/data/tinyshakespeare/input.txt"


def default_corpus() -> str:
    """The benchmarks' default corpus, tinyshakespeare: ``../shared/data`` beside the checkout when there
    (the path the recorded results name), else the copy ``dlx-node data fetch tinyshakespeare`` cached;
    else exit saying how to get it."""
    if (REPO / SHARED_CORPUS).is_file():
        return SHARED_CORPUS
    from node.datafetch import cached_path, default_cache_dir

    cached = cached_path("tinyshakespeare")
    if cached is not None:
        return str(cached)
    raise SystemExit(f"no tinyshakespeare corpus: neither {REPO / SHARED_CORPUS} nor the cache "
                     f"({default_cache_dir()}) has it; run 'dlx-node data fetch tinyshakespeare' "
                     "(or give --data FILE)")
