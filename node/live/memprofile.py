"""What a node's threads were doing when its resident set grew: a memory probe beside the cost profile.

With ``DLX_COST_PROFILE=1`` the cost profile (node/live/costprofile.py) samples every thread's Python stack
20 times a second; with ``DLX_MEMORY_PROFILE=1`` as well, each of those samples also reads the process's
resident set (``/proc/self/statm``) and hands it here with the threads' stacks. The probe keeps:

- the peak: its resident set, glibc's heap figures at that moment (``mallinfo2``, node/arenas.py: bytes
  in use in the arenas, free in them, mapped on their own) and every busy thread's name, component and
  innermost frames of this repository (what ran at the peak, and so what overlapped);
- a timeline, one entry a second: that second's largest resident set and its busy threads;
- the growth by site: each rise of the resident set between two samples, split evenly over the sites (a
  thread's innermost repository frame) busy in that sample; a site whose work allocates is where the
  resident set grew (an estimate, as the cost profile's shares are);
- the largest resident set seen while each component ran on some thread.

It writes ``memory_profile.json`` in the node's data directory when the cost profile writes its counts. It
changes nothing the node computes (bench/bench_scale_system.py copies its peak into the run's result).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from node.arenas import heap_figures, heap_trimmer, resident_bytes
from node.fsutil import write_diagnostic_json

ENV = "DLX_MEMORY_PROFILE"
FILE_NAME = "memory_profile.json"
#: Innermost repository frames kept per busy thread.
FRAMES = 4
#: The repository's packages, whose frames name a site.
PACKAGES = ("/node/", "/training/", "/p2p/", "/ledger/")


def repo_frames(stack: list[tuple[str, str]], keep: int = FRAMES) -> list[str]:
    """The innermost ``keep`` frames of ``stack`` ((filename, function), innermost first) that belong to
    this repository's packages, as ``package/module.py:function``."""
    out = []
    for filename, function in stack:
        cut = max(filename.rfind(part) for part in PACKAGES)
        if cut < 0 or "/site-packages/" in filename:
            continue
        out.append(f"{filename[cut + 1:]}:{function}")
        if len(out) == keep:
            break
    return out


class MemoryProbe:
    """The resident set against the busy threads (module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.started = time.monotonic()
        self.peak: dict = {"rss": 0}
        self.timeline: dict[int, dict] = {}
        self.growth: dict[str, int] = {}
        self.by_component: dict[str, int] = {}
        self._last = 0

    def observe(self, samples: list[tuple[int, str, list[tuple[str, str]]]], idle: str) -> None:
        """One sample: (thread ident, component, stack) of every thread but the profiler's."""
        rss = resident_bytes()
        if not rss:
            return
        names = {thread.ident: thread.name for thread in threading.enumerate()}
        busy = [
            {"thread": names.get(ident, str(ident)), "component": component, "frames": repo_frames(stack)}
            for ident, component, stack in samples
            if component != idle
        ]
        for entry in busy:
            name = entry["component"]
            self.by_component[name] = max(self.by_component.get(name, 0), rss)
        rise, self._last = rss - self._last if self._last else 0, rss
        if rise > 0 and busy:
            sites = [(entry["frames"] or [entry["component"]])[0] for entry in busy]
            for site in sites:
                self.growth[site] = self.growth.get(site, 0) + rise // len(sites)
        second = int(time.monotonic() - self.started)
        if rss > self.timeline.get(second, {}).get("rss", 0):
            self.timeline[second] = {"rss": rss, "busy": [f"{e['thread']}: {e['component']} "
                                                          f"{(e['frames'] or ['-'])[0]}" for e in busy]}
        if rss > self.peak["rss"]:
            self.peak = {"rss": rss, "t_s": round(time.monotonic() - self.started, 2), "busy": busy,
                         "malloc": heap_figures()}

    def document(self) -> dict:
        ranked = sorted(self.growth.items(), key=lambda item: -item[1])
        trimmer = heap_trimmer()
        return {
            "heap_trims": None if trimmer is None else {"trims": trimmer.trims,
                                                        "seconds": round(trimmer.seconds, 3)},
            "peak": self.peak,
            "growth_by_site_bytes": dict(ranked[:40]),
            "max_rss_while_component_bytes": dict(sorted(self.by_component.items())),
            "timeline": [{"t_s": t, **entry} for t, entry in sorted(self.timeline.items())],
        }

    def write(self) -> None:
        write_diagnostic_json(self.path, self.document())


def probe_from_env(data_dir: Path) -> MemoryProbe | None:
    """A probe when ``DLX_MEMORY_PROFILE=1``; None otherwise."""
    if os.environ.get(ENV, "") not in ("1", "true", "yes"):
        return None
    return MemoryProbe(Path(data_dir) / FILE_NAME)
