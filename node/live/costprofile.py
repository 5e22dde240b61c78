"""Where a node's threads spend their time, by component: a sampling profile (issue 75's scale benchmark).

The round clock (node/live/state/roundclock.py) times the training thread's phases; the work on the
other threads (the round lane's encode and seal, the prefetch's aggregation, libp2p, the chain's
committer, the spot checks) overlaps them and is not split there by component. With
``DLX_COST_PROFILE=1`` in its environment a node process starts one daemon thread that, every
``DLX_COST_PROFILE_INTERVAL`` seconds (0.05), reads every thread's Python stack
(``sys._current_frames``) and counts the sample under one component (:data:`COMPONENTS`), or ``idle``
when the thread waits (a lock, a queue, a selector, a sleep, a collective's ``wait``). Every 2 s
and at exit it writes the counts to ``cost_profile.json`` in the node's data directory
(bench/bench_scale_system.py reads them). Nothing else reads it: it changes nothing the node computes.

A sample names the component of the innermost frame that belongs to one (so the hashing a codec
calls counts as hashing), except that anything under a spot check's rerun counts as ``spot_checks``
and anything under the start state's capture as ``start_state``. A thread inside C code (a torch
kernel, sha256) shows the Python frame that called it, so CPU-bound work is counted where it is
called from. It is a sampling estimate: shares, not exact seconds.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from pathlib import Path

from node.fsutil import write_diagnostic_json

ENV = "DLX_COST_PROFILE"
ENV_INTERVAL = "DLX_COST_PROFILE_INTERVAL"
FILE_NAME = "cost_profile.json"
#: How often the counts are written (a benchmark reads them while the node runs).
WRITE_EVERY_S = 2.0

#: (component, path fragments of its frames), matched innermost frame first, in this order per frame.
COMPONENTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "hashing",
        (
            "/training/hashing.py",
            "/training/chunks.py",
            "/node/commitments/",
            "/training/fingerprint.py",
            "/training/host_tensors.py",
            "hashlib",
        ),
    ),
    (
        "codec",
        (
            "/training/codec/",
            "/training/compression.py",
            "/training/codec_wire.py",
            "/training/codec_exact.py",
            "/training/exact_codec.py",
            "/training/exact_fused.py",
            "/training/exact_kernel",
        ),
    ),
    (
        "outer_step",
        (
            "/training/diloco.py",
            "/training/robust.py",
            "/training/outer_optimizers.py",
            "/training/screening.py",
            "/training/screen_rules.py",
            "/training/delay_correction.py",
            "/training/butterfly.py",
        ),
    ),
    ("archive", ("/node/store/", "/node/fsutil.py", "/safetensors/", "/node/live/record/checkpointbuild.py")),
    (
        "chain",
        (
            "/ledger/",
            "/web3/",
            "/eth_account/",
            "/eth_abi/",
            "/eth_utils/",
            "/node/live/chain/",
            "/node/live/record/committer.py",
            "/node/live/record/quorumcommit.py",
        ),
    ),
    ("exchange", ("/p2p/", "/libp2p/", "/node/live/exchange/", "/multiaddr/", "/trio/", "/node/live/peers/")),
    ("rng", ("/training/portable_rng.py",)),
    (
        "inner_steps",
        (
            "/training/pipeline",
            "/training/llama.py",
            "/training/gpt2.py",
            "/training/model.py",
            "/training/inner_optimizers.py",
            "/training/muon.py",
            "/torch/optim/",
            "/torch/distributed/pipelining/",
            "/training/data.py",
            "/training/sharded_corpus.py",
        ),
    ),
)
#: Components decided by any frame of the stack, before the innermost-first match.
ENCLOSING: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "start_state",
        (
            "/training/replica_capture.py",
            "/node/live/checks/heldstates.py",
            "/node/live/worker/contributor.py:_capture_start_state",
        ),
    ),
    ("spot_checks", ("/node/live/checks/", "/training/reexec", "/training/rerun_child.py")),
)
#: Innermost function names of a thread that waits (for a lock, a queue, the network, a peer).
WAIT_FUNCTIONS = frozenset(
    {
        "wait",
        "wait_for",
        "select",
        "poll",
        "sleep",
        "acquire",
        "_wait_for_tstate_lock",
        "get_events",
        "epoll_wait",
        "accept",
        "join",
        "get",
        "recv",
        "recv_into",
        "_worker",
        "serve_forever",
        "readline",
    }
)
WAIT_FILES = (
    "/threading.py",
    "/queue.py",
    "/selectors.py",
    "/concurrent/futures/",
    "/trio/_core/_io_epoll.py",
    "/trio/_core/_thread_cache.py",
    "/socket.py",
    "/ssl.py",
)
IDLE = "idle"
OTHER = "other"


def classify(stack: list[tuple[str, str]]) -> str:
    """The component of one thread's sample; ``stack`` is (filename, function) innermost first."""
    if not stack:
        return IDLE
    filename, function = stack[0]
    if function in WAIT_FUNCTIONS or any(part in filename for part in WAIT_FILES):
        return IDLE
    for name, parts in ENCLOSING:
        for frame_file, frame_function in stack:
            where = f"{frame_file}:{frame_function}"
            if any(part in where for part in parts):
                return name
    for frame_file, _ in stack:
        for name, parts in COMPONENTS:
            if any(part in frame_file for part in parts):
                return name
    return OTHER


def _stack(frame) -> list[tuple[str, str]]:
    out = []
    while frame is not None:
        code = frame.f_code
        out.append((code.co_filename.replace(os.sep, "/"), code.co_name))
        frame = frame.f_back
    return out


class CostProfiler:
    """Samples every thread of this process (see module docstring)."""

    def __init__(self, path: Path, interval: float = 0.05, memory=None) -> None:
        self.path = path
        self.memory = memory  # a node.live.memprofile.MemoryProbe, or None
        self.interval = interval
        self.counts: dict[str, int] = {}
        self.samples = 0
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cost-profile", daemon=True)

    def start(self) -> CostProfiler:
        self._thread.start()
        atexit.register(self.close)
        return self

    def sample(self) -> None:
        own = threading.get_ident()
        # the frames go before the stacks are classified: a frame held while its function returns keeps
        # that function's locals (a slice of a mapped file, say) alive as long as it is held
        stacks = [(ident, _stack(frame)) for ident, frame in sys._current_frames().items() if ident != own]
        classified = [(ident, classify(stack), stack) for ident, stack in stacks]
        for _, name, _ in classified:
            self.counts[name] = self.counts.get(name, 0) + 1
        self.samples += 1
        if self.memory is not None:
            self.memory.observe(classified, IDLE)

    def _run(self) -> None:
        last_write = time.monotonic()
        while not self._stop.wait(self.interval):
            try:
                self.sample()
            except Exception:  # a profile must never stop the node  # noqa: BLE001
                continue
            if time.monotonic() - last_write >= WRITE_EVERY_S:
                self.write()
                last_write = time.monotonic()

    def document(self) -> dict:
        """The counts, and each as thread-seconds: a sample stands for the wall time between samples (on a
        loaded machine longer than ``interval``)."""
        wall = time.monotonic() - self.started
        per_sample = wall / self.samples if self.samples else self.interval
        return {
            "interval_s": self.interval,
            "samples": self.samples,
            "wall_s": round(wall, 3),
            "counts": dict(sorted(self.counts.items())),
            "thread_seconds": {
                name: round(count * per_sample, 3) for name, count in sorted(self.counts.items())
            },
        }

    def write(self) -> None:
        write_diagnostic_json(self.path, self.document())
        if self.memory is not None:
            self.memory.write()

    def close(self) -> None:
        self._stop.set()
        self.write()


def start_from_env(data_dir: str | Path) -> CostProfiler | None:
    """Start the profile when ``DLX_COST_PROFILE=1``; None otherwise."""
    if os.environ.get(ENV, "") not in ("1", "true", "yes"):
        return None
    from node.live.memprofile import probe_from_env

    interval = float(os.environ.get(ENV_INTERVAL, "0.05") or 0.05)
    memory = probe_from_env(Path(data_dir))
    return CostProfiler(Path(data_dir) / FILE_NAME, interval=max(0.005, interval), memory=memory).start()
