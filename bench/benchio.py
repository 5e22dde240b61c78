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
import resource
import subprocess
import sys
import time
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
    temporary.write_text(scrub_paths(json.dumps(result, indent=1, default=str)) + "\n")
    os.replace(temporary, path)
    return path


#: The benchmarks' default corpus: a dataset of node/datafetch.py, where ``dlx-node data fetch`` keeps it.
CORPUS = "tinyshakespeare"


def default_corpus() -> str:
    """The benchmarks' default corpus, tinyshakespeare, as ``dlx-node data fetch tinyshakespeare`` keeps it
    (``$DLX_DATA_DIR``, else ``~/.cache/dlx-node/data``): fetched now and checked against its pinned sha256
    when it is not there yet; else exit saying how to get it. Nothing outside the clone and that cache is
    read (``--data FILE`` gives another text)."""
    from node.datafetch import cached_path, default_cache_dir, fetch
    from node.errors import DataFetchError

    cached = cached_path(CORPUS)
    if cached is not None:
        return str(cached)
    try:
        return str(fetch(CORPUS)[0])
    except DataFetchError as exc:
        raise SystemExit(f"no {CORPUS} corpus in {default_cache_dir()} and it could not be fetched ({exc}); "
                         f"run 'dlx-node data fetch {CORPUS}' (--from FILE takes a copy made elsewhere, "
                         "--url a mirror) or give --data FILE") from None


def scrub_paths(text: str) -> str:
    """``text`` with this machine's paths made relative: the clone's (``bench/...``), its parent's
    (``../...``), the data cache's (``$DLX_DATA_DIR/...``) and the home directory's (``~/...``), so that a
    recorded result names no directory of the machine it ran on (tests/test_no_machine_paths.py)."""
    from node.datafetch import default_cache_dir

    prefixes = [(default_cache_dir(), "$DLX_DATA_DIR"), (REPO, "."), (REPO.parent, ".."), (Path.home(), "~")]
    for prefix, name in sorted(prefixes, key=lambda p: -len(str(p[0]))):
        if len(prefix.parts) > 1:  # never "/" itself
            text = text.replace(f"{prefix}/", f"{name}/").replace(f'"{prefix}"', f'"{name}"')
    return text


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM): ``ru_maxrss`` survives the exec of a spawned process, so it
    would report the launcher's peak."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def least_cpu_seconds(function, repeats: int, clock=time.process_time) -> float:
    """The least CPU seconds (``clock``: the process's, or ``time.thread_time``) of ``repeats`` calls."""
    best = float("inf")
    for _ in range(repeats):
        started = clock()
        function()
        best = min(best, clock() - started)
    return best
