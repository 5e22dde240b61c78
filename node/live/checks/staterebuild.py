"""Rebuilding this node's own start states when a peer asks for one it no longer keeps (issue 75).

With ``storage.start_states = "rebuild"`` (the default) a node keeps on disk only one start state every
``storage.start_state_every`` rounds (an *anchor*; also the first it serves after a start or a gap in its
rounds), serving the hash of every other one as before (its envelopes bind it) but not its bytes. Asked for
one of those (a spot check, a dispute, an auditor: ``/dlx/blob/1.0.0`` by its hash), it replays its own
rounds from the newest anchor before it, in a child process: for each round ``r`` from the anchor's to the
one asked, the rerun of a spot check (:func:`training.reexec.reexecute`, the same inner steps and the same
delayed outer step from round ``r - 1``'s contributions in its archive) whose capture of the next round's
start state is what a verifier's chain check compares with the next envelope bit for bit
(:func:`training.reexec.check_state_chain`). The rebuilt state is served only if it hashes to what this
node bound; else nothing is served (the asker's check is not done, as for any state not served).

Why a child: the rerun sets torch's process-wide thread count and may drop compiled graphs, and holds a
second copy of the replica while it runs; none of that may touch the node's own training (the same reason
spot checks run in one, node/live/checks/spotcheck.py).

What it costs: the inner steps of up to ``start_state_every - 1`` rounds (H each) and their outer steps,
on the node asked, only when asked; the child stays up between rebuilds (its first start imports torch and
reads the corpus: seconds). It needs the
schedule's one-step delay (a rerun of round ``r`` then ends with round ``r + 1``'s start state; without it
the node keeps every state) and round ``r - 1``'s contributions of every stage for each round replayed: the
retention keeps the archive from the round before the oldest anchor (node/live/round/finisher.py).

    python -m node.live.checks.staterebuild JOB_DIR    # one job: writes its states and result.json
    python -m node.live.checks.staterebuild --serve    # job dirs on stdin, one "ok"/"error ..." line each
"""

from __future__ import annotations

import hashlib
import json
import logging
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from node.errors import NodeError
from node.fsutil import atomic_write_bytes
from node.live.checks.spotcheck import child_env, job_config_and_corpus, serve_jobs
from p2p.blobpack import read_packed

logger = logging.getLogger(__name__)

JOB_FILE = "rebuild.json"
_CORPORA: dict[str, tuple] = {}  # the child's: configuration -> (NodeConfig, corpus)
RESULT_FILE = "result.json"
#: A rebuild that takes longer than this is abandoned (nothing is served).
REBUILD_TIMEOUT_S = 900.0


class RebuildFailed(NodeError):
    """A start state could not be rebuilt (inputs missing, the child failed, or its bytes are not the ones
    this node bound)."""


@dataclass
class ReplayRound:
    """What the replay of round ``r`` reads besides the state: round ``r - 1`` as this node applied it."""

    previous: dict[int, list[bytes]] = field(default_factory=dict)  # stage -> payloads, canonical order
    excluded: dict[int, dict[int, str]] = field(default_factory=dict)  # stage -> screened indices
    dropped: list[int] = field(default_factory=list)  # stages whose close left this replica out
    partials: dict[int, list[bytes]] = field(default_factory=dict)  # a sliced run's: stage -> partials
    declared_steps: int | None = None  # a time-bounded run's: the steps round r's contribution declares
    data_key: bytes | None = None  # a run keyed by account's: the replica's key (its stage-0 signer's)


def write_job(directory: Path, config: dict, blobs: Path, anchor: list[str], target_round: int,
              rounds: dict[int, ReplayRound]) -> list[Path]:
    """Write a rebuild job to ``directory``: where the anchor's stages are (their sha256 in the blob store
    ``blobs``: the child reads them there, packed or not, with no copy on disk), every replayed round's
    inputs; returns where the child writes the target's stage files (stage order)."""
    directory.mkdir(parents=True, exist_ok=True)
    names: dict[str, object] = {"config": config, "target": target_round, "blobs": str(blobs),
                                "anchor": list(anchor), "rounds": {}}
    for outer_round, inputs in rounds.items():
        excluded = {str(s): {str(i): r for i, r in ex.items()} for s, ex in inputs.excluded.items()}
        entry = {"excluded": excluded, "dropped": list(inputs.dropped),
                 "declared_steps": inputs.declared_steps,
                 "data_key": None if inputs.data_key is None else inputs.data_key.hex()}
        for kind, payloads in (("previous", inputs.previous), ("partials", inputs.partials)):
            entry[kind] = {}
            for stage, blobs in payloads.items():
                entry[kind][str(stage)] = []
                for index, blob in enumerate(blobs):
                    name = f"{kind}-{outer_round}-{stage}-{index}.bin"
                    (directory / name).write_bytes(blob)
                    entry[kind][str(stage)].append(name)
        names["rounds"][str(outer_round)] = entry
    names["out"] = [f"state-{stage}.bin" for stage in range(len(anchor))]
    atomic_write_bytes(directory / JOB_FILE, json.dumps(names, sort_keys=True).encode())
    return [directory / name for name in names["out"]]


class ReplayWorker:
    """A child process that replays rebuild jobs one at a time, kept between jobs (importing torch and
    reading the corpus cost more than a small model's replay: 16-20 s a rebuild of one round of ``tiny``
    under load when each started a child) and replaced if it dies or overruns; its log is ``log_path``."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def run(self, directory: Path, timeout: float = REBUILD_TIMEOUT_S) -> list[bytes]:
        """Run the job in ``directory``; the sha256 of each stage file the child wrote."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self.log_path.parent.mkdir(parents=True, exist_ok=True)
                with open(self.log_path, "ab") as log:
                    self._proc = subprocess.Popen(
                        [sys.executable, "-m", "node.live.checks.staterebuild", "--serve"], env=child_env(),
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1)
            proc = self._proc
            try:
                proc.stdin.write(f"{directory}\n")
                proc.stdin.flush()
                ready, _, _ = select.select([proc.stdout], [], [], timeout)
                line = proc.stdout.readline() if ready else None
            except (OSError, ValueError) as exc:
                self._kill()
                raise RebuildFailed(f"the replay's child failed: {exc}") from None
            if not line:
                self._kill()
                raise RebuildFailed(f"the replay ran past {timeout:.0f} s" if line is None else
                                    f"the replay's child exited (see {self.log_path})")
        if line.strip() != "ok":
            raise RebuildFailed(f"the replay failed: {line.strip()}")
        try:
            doc = json.loads((directory / RESULT_FILE).read_text())
            return [bytes.fromhex(h) for h in doc["hashes"]]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise RebuildFailed(f"the replay's child wrote no result: {exc}") from None

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        """End the child (a job it runs is cut short)."""
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                try:
                    self._proc.stdin.close()
                    self._proc.wait(timeout=5)
                except (OSError, subprocess.TimeoutExpired):
                    pass
            self._kill()


def replay(directory: Path) -> dict:
    """Child side: replay the job in ``directory`` from its anchor to its target round, write the target's
    stage files and return the result document."""
    from training.reexec import reexecute
    from training.replica_state import ReplicaStartState, parse_stage_state

    doc = json.loads((directory / JOB_FILE).read_text())
    key = json.dumps(doc["config"], sort_keys=True)
    if key not in _CORPORA:  # one node's jobs: one configuration, read once per child
        _CORPORA.clear()
        _CORPORA[key] = job_config_and_corpus(doc["config"])
    cfg, corpus = _CORPORA[key]
    read = lambda name: (directory / name).read_bytes()  # noqa: E731
    state = ReplicaStartState(tuple(parse_stage_state(_kept_blob(Path(doc["blobs"]), digest))
                                    for digest in doc["anchor"]))
    target = int(doc["target"])
    started, rounds = time.perf_counter(), 0
    while state.meta.outer_round < target:
        outer_round = state.meta.outer_round
        entry = doc["rounds"][str(outer_round)]
        previous = {int(s): [read(n) for n in names] for s, names in entry["previous"].items()}
        partials = {int(s): [read(n) for n in names] for s, names in entry["partials"].items()}
        excluded = {int(s): {int(i): r for i, r in ex.items()} for s, ex in entry["excluded"].items()}
        # Not consumed: a consumed rerun's next state is the live tensors themselves, for hashing, and the
        # next round's rerun starts from it (copies cost this child one more state while it runs)
        rerun = reexecute(
            state, corpus, cfg.model, cfg.training, cfg.diloco, cfg.compression,
            previous_contributions=previous or None, previous_excluded=excluded,
            previous_dropped=[int(s) for s in entry["dropped"]], previous_partials=partials or None,
            declared_steps=entry["declared_steps"], processes=cfg.compute.processes,
            data_key=None if entry.get("data_key") is None else bytes.fromhex(entry["data_key"]))
        if rerun.next_state is None:
            raise RebuildFailed(f"round {outer_round}'s rerun gave no next start state (no one-step delay?)")
        state, rounds = rerun.next_state, rounds + 1
    hashes = []
    for part, name in zip(state.stages, doc["out"]):
        with open(directory / name, "wb") as out:
            hashes.append(part.write_to(out).hex())
    return {"hashes": hashes, "rounds": rounds, "seconds": round(time.perf_counter() - started, 3)}


def rebuilds_start_states(cfg) -> bool:
    """Whether a node of configuration ``cfg`` rebuilds its start states when asked (module docstring):
    ``storage.start_states = "rebuild"``, a retention that prunes (``"all"`` keeps every state anyway) and a
    schedule with the one-step delay. A configuration without those sections (a test's) does not."""
    storage, diloco = getattr(cfg, "storage", None), getattr(cfg, "diloco", None)
    return (storage is not None and diloco is not None and storage.start_states == "rebuild"
            and storage.retention != "all" and bool(diloco.one_step_delay))


def _kept_blob(blobs: Path, digest: str) -> bytes:
    """The kept state ``digest`` of the blob store at ``blobs`` (packed, or a file), checked; RebuildFailed
    where it is gone (pruned meanwhile) or not those bytes."""
    data = read_packed(blobs, digest)
    if data is None:
        try:
            data = (blobs / digest).read_bytes()
        except OSError as exc:
            raise RebuildFailed(f"the kept start state {digest[:16]} is not readable: {exc}") from None
    if hashlib.sha256(data).hexdigest() != digest:
        raise RebuildFailed(f"the kept start state {digest[:16]} does not hash to its name")
    return data


class StateReplay:
    """The node's side of a rebuild: the inputs from its archive, the job, the child (module docstring)."""

    def __init__(self, config: dict, work_dir: Path, round_inputs: Callable[[int], ReplayRound]) -> None:
        self.config = config  # NodeConfig.to_dict(): what the child rebuilds it from
        self.work_dir = work_dir
        self.worker = ReplayWorker(work_dir / "rebuild.log")
        self.round_inputs = round_inputs  # r -> what replaying round r reads (the SpotChecker's archive)
        self.rebuilt = 0
        self.seconds = 0.0

    def __call__(self, anchor_round: int, blobs: Path, anchor: list[str], target_round: int) -> list[Path]:
        """The target round's stage files (left in a job directory the caller made and removes:
        :meth:`job_dir`), replayed from the anchor round's stages (their sha256 in the blob store ``blobs``).
        """
        started = time.monotonic()
        rounds = {r: self.round_inputs(r) for r in range(anchor_round, target_round)}
        out = write_job(self.job_dir(target_round), self.config, blobs, anchor, target_round, rounds)
        self.worker.run(self.job_dir(target_round))
        self.rebuilt += 1
        self.seconds += time.monotonic() - started
        logger.info("start state of round %d rebuilt from round %d's (%d rounds replayed, %.1f s)",
                    target_round, anchor_round, target_round - anchor_round, time.monotonic() - started)
        return out

    def job_dir(self, target_round: int) -> Path:
        return self.work_dir / f"rebuild-{target_round:08d}"

    def close(self) -> None:
        self.worker.close()


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if argv == ["--serve"]:
        return serve_jobs(replay)
    if len(argv) != 1:
        print("usage: python -m node.live.checks.staterebuild (JOB_DIR | --serve)", file=sys.stderr)
        return 2
    directory = Path(argv[0])
    atomic_write_bytes(directory / RESULT_FILE, json.dumps(replay(directory)).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
