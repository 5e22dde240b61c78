"""One re-execution spot check, run in a child process (docs/DILOCOX.md section 11).

The parent (:class:`node.live.checks.verifier.SpotChecker`) writes a job directory:
``job.json`` (the node's configuration, the round, the replica, the claims and
the committed weights hashes) plus the raw inputs it names (start-state parts
served by the claimant, the claimant's codec payloads, round t-1's closed
payloads). The child reruns the replica's round with
:func:`training.reexec.verify_contribution` and writes ``result.json``.

Why a child: the rerun sets torch's process-wide thread count to the
claimant's, and a rerun that fails in any way (a crafted state, a crash in a
library) must cost only itself, never the node's own training. The child
stays up between checks (:class:`RerunWorker`: importing torch costs more
than a small model's rerun) and is replaced if it dies or overruns.

    python -m node.live.checks.spotcheck JOB_DIR    # one job
    python -m node.live.checks.spotcheck --serve    # job dirs on stdin, one "ok"/"error ..." line each
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import select
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from node.arenas import map_large_blocks, start_heap_trimmer, trim_heap
from node.errors import NodeError
from node.fsutil import atomic_write_bytes
from node.live.checks.admission import resident_bytes

logger = logging.getLogger(__name__)

JOB_FILE = "job.json"
RESULT_FILE = "result.json"
#: A rerun child that keeps more resident memory than this after a job is ended
#: (RerunWorker._retire_if_large).
RETIRE_RSS_BYTES = 1 << 30
VERDICTS = ("exact", "within_tolerance", "undecided", "mismatch", "state_mismatch", "data_mismatch",
            "other_result")


class SpotCheckFailed(NodeError):
    """The rerun could not produce a verdict (the child crashed, timed out or wrote nonsense)."""


@dataclass
class SpotCheckJob:
    """What one check reads; every bytes value goes to its own file of the job directory."""

    config: dict
    outer_round: int
    replica: int
    # (stage, state_hash, data_commitment, codec payload, applied_hash)
    claims: list[tuple[int, bytes, bytes, bytes, bytes]]
    state_parts: list[bytes | Path]  # per stage, stage order: bytes, or a file that write() moves in
    # stage -> round t-1 payloads, canonical order
    previous: dict[int, list[bytes]] = field(default_factory=dict)
    previous_excluded: dict[int, dict[int, str]] = field(default_factory=dict)  # stage -> screened indices
    committed_weights: dict[int, dict[int, bytes]] = field(default_factory=dict)  # round -> stage -> hash
    # stages whose round t-1 close left this replica out
    previous_dropped: list[int] = field(default_factory=list)
    # A sliced run's round t-1: stage -> the A partial blobs every holder applied, slice order (``previous``
    # stays empty; the claims' payloads are the claimant's slice blobs, packed: training.reexec).
    previous_partials: dict[int, list[bytes]] = field(default_factory=dict)
    # A run whose windows are keyed by account (training.data_windows = "account"): the replica's key, the
    # account of the signer of its stage-0 contribution (node.live.checks.rerun); None: by replica index.
    data_key: bytes | None = None

    def state_paths(self, directory: Path) -> list[Path]:
        """Where :meth:`write` puts the start-state parts (stage order)."""
        return [directory / f"state-{i}.bin" for i in range(len(self.state_parts))]

    def write(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)

        def put(name: str, data: bytes | Path) -> str:
            if isinstance(data, Path):  # a fetched part: moved (or copied) in, never read here
                if data.parent.resolve() == directory.resolve():
                    os.replace(data, directory / name)
                else:
                    staged = directory / f".{name}.tmp"
                    shutil.copyfile(data, staged)
                    os.replace(staged, directory / name)
            else:
                atomic_write_bytes(directory / name, data)
            return name

        doc = {
            "config": self.config,
            "round": self.outer_round,
            "replica": self.replica,
            "claims": [[stage, state.hex(), data.hex(), put(f"payload-{stage}.bin", payload), applied.hex()]
                       for stage, state, data, payload, applied in self.claims],
            "states": [put(path.name, part)
                       for path, part in zip(self.state_paths(directory), self.state_parts)],
            "previous": {str(stage): [put(f"previous-{stage}-{i}.bin", p) for i, p in enumerate(payloads)]
                         for stage, payloads in self.previous.items()},
            "previous_excluded": {str(s): {str(i): r for i, r in ex.items()}
                                  for s, ex in self.previous_excluded.items()},
            "committed": {str(r): {str(s): h.hex() for s, h in stages.items()}
                          for r, stages in self.committed_weights.items()},
            "previous_dropped": sorted(self.previous_dropped),
            "previous_partials": {str(stage): [put(f"partial-{stage}-{j}.bin", p)
                                               for j, p in enumerate(partials)]
                                  for stage, partials in self.previous_partials.items()},
            "data_key": None if self.data_key is None else self.data_key.hex(),
        }
        atomic_write_bytes(directory / JOB_FILE, json.dumps(doc).encode())


@dataclass(frozen=True)
class SpotCheckResult:
    verdict: str
    reason: str
    distances: dict[int, float]
    seconds: float
    # per stage: the start state round t+1 must bind (exact reruns)
    next_state_hashes: list[bytes] | None = None
    failed_stages: tuple[int, ...] = ()  # the stages whose own claim fails (whose signers a mismatch accuses)

    @property
    def honest(self) -> bool:
        return self.verdict in ("exact", "within_tolerance")

    @property
    def undecided(self) -> bool:
        """Another platform's rerun that neither passes nor convicts (training.fingerprint.UNDECIDED): nobody
        is accused, and the check needs a verifier of the claimant's platform."""
        return self.verdict == "undecided"

    @property
    def elsewhere(self) -> bool:
        """Built on another result of round t-1 than the record's (a forked member's round): not a cheat."""
        return self.verdict == "other_result"


def job_config_and_corpus(config: dict):
    """(the node configuration of a child's job, the corpus it reads): a relative ``training.data_path`` is
    the node's (resolved against its configuration's directory)."""
    from dataclasses import replace

    from node.config import config_from_dict
    from training.data import corpus_from_config

    cfg = config_from_dict(config)
    training_cfg = cfg.training
    if training_cfg.data_path:
        training_cfg = replace(training_cfg, data_path=str(cfg.path(training_cfg.data_path)))
    return cfg, corpus_from_config(training_cfg, cfg.model)


def run_job(directory: Path) -> dict:
    """Child side: rerun the job in ``directory`` and return the result document."""
    from training.reexec import ContributionClaim
    from training.replica_state import mapped_state_files

    doc = json.loads((directory / JOB_FILE).read_text())
    cfg, corpus = job_config_and_corpus(doc["config"])
    read = lambda name: (directory / name).read_bytes()  # noqa: E731
    claims = [ContributionClaim(int(stage), bytes.fromhex(state), bytes.fromhex(data), read(payload),
                                bytes.fromhex(applied))
              for stage, state, data, payload, applied in doc["claims"]]
    with mapped_state_files([directory / name for name in doc["states"]]) as states:
        check = _verify_job(doc, cfg, corpus, claims, states, read)
    return {"verdict": check.verdict, "reason": check.reason,
            "distances": {str(s): d for s, d in check.distances.items()}, "seconds": check.reexec_seconds,
            "next_state_hashes": None if check.next_state_hashes is None
                else [h.hex() for h in check.next_state_hashes],
            "failed_stages": list(check.failed_stages)}


def _verify_job(doc: dict, cfg, corpus, claims, states, read):
    """:func:`training.reexec.verify_contribution` of the job ``doc`` on the mapped ``states``."""
    from training.reexec import verify_contribution

    return verify_contribution(
        states, claims, corpus, cfg.model, cfg.training, cfg.diloco,
        cfg.compression, outer_round=int(doc["round"]), replica=int(doc["replica"]), run_rounds=cfg.rounds,
        previous_contributions={int(s): [read(n) for n in names] for s, names in doc["previous"].items()}
        or None,
        previous_excluded={int(s): {int(i): r for i, r in ex.items()}
                               for s, ex in doc["previous_excluded"].items()},
        committed_weights={int(r): {int(s): bytes.fromhex(h) for s, h in st.items()}
                           for r, st in doc["committed"].items()},
        previous_dropped=[int(s) for s in doc.get("previous_dropped", [])],
        previous_partials={int(s): [read(n) for n in names]
                           for s, names in doc.get("previous_partials", {}).items()} or None,
        # a cluster's claim of N <= this node's processes reruns on N ranks (training/cluster_rerun.py)
        processes=cfg.compute.processes,
        data_key=None if doc.get("data_key") is None else bytes.fromhex(doc["data_key"]),
    )


def parse_result(data: bytes) -> SpotCheckResult:
    """The child's result, checked (a child is ours, but a result file is still a file)."""
    try:
        doc = json.loads(data)
        verdict, reason, seconds = doc["verdict"], str(doc["reason"])[:400], float(doc["seconds"])
        distances = {int(s): float(d) for s, d in doc["distances"].items()}
        following = doc.get("next_state_hashes")
        next_hashes = None if following is None else [bytes.fromhex(h) for h in following]
        failed_stages = tuple(sorted({int(s) for s in doc.get("failed_stages", [])}))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SpotCheckFailed(f"spot check result is malformed: {exc}") from None
    if verdict not in VERDICTS or any(math.isnan(d) for d in distances.values()):
        raise SpotCheckFailed(f"spot check result has verdict {verdict!r}")
    if next_hashes is not None and any(len(h) != 32 for h in next_hashes):
        raise SpotCheckFailed("spot check result has malformed next-state hashes")
    if any(s < 0 for s in failed_stages):
        raise SpotCheckFailed("spot check result names a negative stage")
    return SpotCheckResult(verdict, reason, distances, seconds, next_hashes, failed_stages)


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


class RerunWorker:
    """Long-lived children that run spot-check jobs one at a time (see module docstring).

    One child per CPU kernel set: a job whose claimant trained on this CPU model under another ATen
    capability this CPU has (lower, or higher than this process's where the CPU has it), or under another
    math-library code path (``MKL_CBWR``, ...), runs in a child started with the claimant's settings
    (:func:`training.claimant_kernels.kernels_to_emulate`), so its rerun uses the claimant's kernels and must
    be bit-exact; every other job runs in the child of this process's own kernels.
    """

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self._procs: dict[tuple | None, subprocess.Popen] = {}
        self._lock = threading.Lock()

    def _start(self, kernels: tuple | None) -> subprocess.Popen:
        from training.claimant_kernels import emulated_environment

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = child_env()
        if kernels is not None:
            env = emulated_environment(dict(kernels), env)
        with open(self.log_path, "ab") as log:
            return subprocess.Popen([sys.executable, "-m", "node.live.checks.spotcheck", "--serve"], env=env,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                    bufsize=1)

    @staticmethod
    def kernels_for(directory: Path) -> tuple | None:
        """The settings (:func:`training.claimant_kernels.kernels_to_emulate`, as sorted items) of the kernels
        the job's claimant trained under, where this machine should rerun under them."""
        import torch

        from training.errors import TrainingError
        from training.fingerprint import fingerprint
        from training.claimant_kernels import kernels_to_emulate, native_cpu_capability
        from training.replica_state import check_stage_state_file

        try:
            doc = json.loads((directory / JOB_FILE).read_text())
            # its header only, every check made, no tensor read: the state is the claimant's whole stage
            meta = check_stage_state_file(directory / doc["states"][0]).meta
        except (OSError, ValueError, KeyError, IndexError, TypeError, TrainingError):
            return None  # the child reads the job again and gives the verdict its problems deserve
        if meta.platform is None:
            return None
        kernels = kernels_to_emulate(meta.platform, fingerprint(torch.device("cpu"), meta.platform.precision),
                                     native_cpu_capability())
        return None if kernels is None else tuple(sorted(kernels.items()))

    def run(self, directory: Path, timeout: float,
            on_start: Callable[[int], None] | None = None) -> SpotCheckResult:
        """Run the job in ``directory``; raise SpotCheckFailed unless it gives a verdict. ``on_start`` is
        given the pid of the child that runs it (the host's rerun admission counts its memory as taken)."""
        kernels = self.kernels_for(directory)
        with self._lock:
            proc = self._procs.get(kernels)
            if proc is None or proc.poll() is not None:
                proc = self._procs[kernels] = self._start(kernels)
            if on_start is not None:
                on_start(proc.pid)
            try:
                proc.stdin.write(f"{directory}\n")
                proc.stdin.flush()
                ready, _, _ = select.select([proc.stdout], [], [], timeout)
                line = proc.stdout.readline() if ready else None
            except (OSError, ValueError) as exc:
                self._kill(kernels)
                raise SpotCheckFailed(f"spot-check worker failed: {exc}") from None
            if line is None:
                self._kill(kernels)
                raise SpotCheckFailed(f"spot check did not finish within {timeout:.0f}s")
            if not line:
                code = proc.poll()
                self._kill(kernels)
                raise SpotCheckFailed(f"spot-check worker died (exit {code}); see {self.log_path}")
            self._retire_if_large(kernels, proc)
            if not line.startswith("ok"):
                raise SpotCheckFailed(f"spot check failed: {line.strip()[:300]}")
        try:
            return parse_result((directory / RESULT_FILE).read_bytes())
        except OSError as exc:
            raise SpotCheckFailed(f"spot check wrote no result: {exc}") from None

    def _retire_if_large(self, kernels: tuple | None, proc: subprocess.Popen) -> None:
        """End a child that kept more than RETIRE_RSS_BYTES after its job: the allocator keeps a large
        rerun's freed memory, the host gets it back only when the process ends, and a new child costs an
        import of torch (a few seconds) beside a rerun that large."""
        rss = resident_bytes(proc.pid)
        if rss is not None and rss > RETIRE_RSS_BYTES:
            logger.info("spot-check worker keeps %.2f GiB after its job: ended, to give it back", rss / 2**30)
            self._procs.pop(kernels, None)
            try:
                proc.stdin.close()  # the worker ends at end of input
                proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait(timeout=10)

    def _kill(self, kernels: tuple | None) -> None:
        proc = self._procs.pop(kernels, None)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)

    def close(self) -> None:
        procs, self._procs = list(self._procs.values()), {}
        for proc in procs:
            if proc.poll() is None:
                try:
                    proc.stdin.close()  # the worker ends at end of input
                    proc.wait(timeout=5)
                except (OSError, subprocess.TimeoutExpired):
                    proc.kill()


def serve_jobs(run: Callable[[Path], dict]) -> int:
    """A job child's loop: a job directory a line on stdin, ``run(directory)``'s result written to its
    RESULT_FILE, "ok" or "error <why>" a line on stdout; the freed pages go back to the host after each job
    (node/arenas.py) before the parent looks."""
    for line in sys.stdin:
        directory = Path(line.strip())
        try:
            result = run(directory)
            atomic_write_bytes(directory / RESULT_FILE, json.dumps(result).encode())
            reply = "ok"
        # the child's boundary: one bad job costs only itself; the parent logs the line
        except Exception as exc:  # noqa: BLE001
            logger.debug("job %s failed", directory, exc_info=True)
            reply = "error " + " ".join(f"{type(exc).__name__}: {exc}".split())[:500]
        result = None
        gc.collect()
        trim_heap()
        print(reply, flush=True)
    return 0


def main(argv: list[str]) -> int:
    map_large_blocks()  # a rerun's large temporaries go back as they are freed (node/arenas.py)
    start_heap_trimmer()  # and the smaller ones within a second
    if argv == ["--serve"]:
        return serve_jobs(run_job)
    if len(argv) != 1:
        print("usage: python -m node.live.checks.spotcheck JOB_DIR | --serve", file=sys.stderr)
        return 2
    directory = Path(argv[0])
    result = run_job(directory)
    atomic_write_bytes(directory / RESULT_FILE, json.dumps(result).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
