"""Start states a verifying node holds: its own it serves, others' it fetches, and those it keeps.

Split from :mod:`node.live.checks.verifier` (the spot checker owns one :class:`HeldStates`). A node serves its
start-state parts as blobs for as long as its archive keeps the round (an audit's ``--reexecute`` needs
both); it fetches a claimant's parts from their signer for one check and drops the copy afterwards; it
keeps the parts a failed check used under ``evidence/`` (the audit reads them there), and holds those of
an exact rerun of round t until round t+1's chain check (``linkable/``: the other half of its evidence).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
from pathlib import Path

from node.fsutil import atomic_write_bytes, keep_evidence, serve_when_space
from node.store.retention import SERVED_STATES_FILE, SPOT_CHECK_ROUNDS, load_served_states, save_served_states
from p2p.envelope import Envelope
from training.replica_state import check_stage_state_file
from p2p.errors import P2PError

logger = logging.getLogger(__name__)

#: Rounds of start states a node keeps serving at least (a verifier checks round t once it is on chain); the
#: retention keeps more while the chain's windows are open (node/store/retention.py).
STATE_ROUNDS_KEPT = SPOT_CHECK_ROUNDS
#: How long a node waits for the claimant's start state before giving the check up: at least this, and at
#: least the time the state takes at STATE_FETCH_MIN_RATE (issue 75: a llama-20m stage's state, about 600 MB,
#: did not arrive within 60 s on a loaded machine, and every such check was left undone).
STATE_FETCH_TIMEOUT_S = 60.0
#: The slowest transfer rate (bytes/s) a start state's fetch is given time for.
STATE_FETCH_MIN_RATE = 2 << 20


def state_fetch_timeout(expected_bytes: int) -> float:
    """Seconds to wait for a start state of about ``expected_bytes`` (0: unknown)."""
    return max(STATE_FETCH_TIMEOUT_S, expected_bytes / STATE_FETCH_MIN_RATE)


def state_cuts(path: Path) -> list[tuple[int, int]]:
    """Where each tensor's data lies in the start-state file ``path``: what the blob store keeps as pieces
    shared with this node's other start states (p2p/blobpack.py; issue 75: of a state's eleven copies of the
    stage, the round-start and last-encode snapshots are the live weights, and the decoded update of round
    ``r - 1`` is the previous state's). The file was written by this node: a parse error is a bug, raised."""
    ranges: list[tuple[int, int]] = []
    check_stage_state_file(path, data_ranges=ranges)
    return ranges


class HeldStates:
    """The start states of one node's spot checks (module docstring)."""

    def __init__(self, host, work_dir: Path, evidence_dir: Path, num_stages: int,
                 stop: threading.Event) -> None:
        self.host = host  # P2PHost
        self.stop = stop  # the node's: a serve paused by a full disk gives up when it is set
        self.evidence_dir = evidence_dir
        self.num_stages = num_stages
        self._linkable_dir = work_dir / "linkable"
        #: Where this node's own start states are written before they are served (StartStateCapture.write).
        self.writing_dir = work_dir / "start-states"
        # round -> blob hashes of this node's start states; on disk too, so that a restarted node still
        # forgets those it served before (node/store/retention.py)
        self._served_file = work_dir / SERVED_STATES_FILE
        self._served: dict[int, list[str]] = load_served_states(self._served_file)
        self._served_lock = threading.Lock()
        self._part_bytes: dict[int, int] = {}  # stage -> size of this node's last start-state part of it

    def serve(self, outer_round: int, parts: dict[int, bytes | Path], keep_rounds: int) -> dict[int, bytes]:
        """Serve this node's start-state parts of ``outer_round``; stage -> state hash (what the envelope
        binds). A part is its bytes or a file written under :attr:`writing_dir`, kept as a packed blob (its
        tensors' data as pieces shared with this node's other start states: p2p/blobpack.py), then its name
        here removed: the state is never read whole into memory.
        ``keep_rounds``: ``storage.keep_rounds`` (0 keeps every round's)."""
        hashes = {}
        for stage, data in parts.items():
            self._part_bytes[stage] = data.stat().st_size if isinstance(data, Path) else len(data)
            cuts = state_cuts(data) if isinstance(data, Path) else None
            digest = serve_when_space(self.host, data,
                                      what=f"round {outer_round}'s start state of stage {stage}",
                                      stop=self.stop, cuts=cuts)
            if isinstance(data, Path):
                data.unlink(missing_ok=True)  # the blob store holds its pieces
            with self._served_lock:
                self._served.setdefault(outer_round, []).append(digest)
                self._save_served()
            hashes[stage] = bytes.fromhex(digest)
        # Kept as long as the archive keeps the round's contributions: an audit's --reexecute needs
        # both (storage.keep_rounds = 0 keeps everything, so nothing is dropped then).
        if keep_rounds > 0:
            self.forget_before(outer_round - max(keep_rounds, STATE_ROUNDS_KEPT))
        return hashes

    def _save_served(self) -> None:
        """Write the served list (under ``_served_lock``); a failed write only costs the pruning of these
        blobs after a restart."""
        try:
            save_served_states(self._served_file, self._served)
        except OSError as exc:
            logger.warning("list of served start states not written (%s): after a restart they are not "
                           "pruned", exc)

    def forget_before(self, floor: int) -> list[int]:
        """Stop serving (and delete) this node's start states of rounds before ``floor`` (the retention's:
        node/store/retention.py); the rounds dropped."""
        with self._served_lock:
            old = sorted(r for r in list(self._served) if r < floor)
            for outer_round in old:
                for digest in self._served[outer_round]:
                    self.host.remove_blob(digest)  # a blob already gone (a crash after it) is no error
                del self._served[outer_round]
            if old:
                self._save_served()
        return old

    def served_rounds(self) -> list[int]:
        """The rounds whose start states this node serves (those served before a restart too)."""
        with self._served_lock:
            return sorted(self._served)

    def fetch(self, envs: list[Envelope], state_hashes: list[bytes], job_dir: Path) -> list[bytes]:
        """The start-state part each envelope binds, fetched from its signer (stage order)."""
        return [path.read_bytes() for path in self.fetch_files(envs, state_hashes, job_dir)]

    def fetch_files(self, envs: list[Envelope], state_hashes: list[bytes], job_dir: Path) -> list[Path]:
        """:meth:`fetch`, each part left in its file under ``job_dir`` (the blob store checked its hash): a
        spot check hands the files to its child without reading them (issue 75: the claimant's whole start
        state, about 40 bytes per parameter of the model)."""
        paths = []
        for env, state_hash in zip(envs, state_hashes):
            dest = job_dir / f"fetch-{env.stage}.part"
            self.host.fetch_blob(state_hash.hex(), dest, providers=[env.sender_peer_id],
                                 timeout=state_fetch_timeout(self.expected_part_bytes(env.stage)))
            paths.append(dest)
        return paths

    def expected_part_bytes(self, stage: int) -> int:
        """About how large another replica's start-state part of ``stage`` is: this node's own of that stage
        (the same shapes and the same copies), else its largest; 0 before it served any."""
        return self._part_bytes.get(stage) or max(self._part_bytes.values(), default=0)

    def drop_fetched(self, hashes: list[bytes]) -> None:
        """Remove other replicas' start states from the blob store once checked (a fetch keeps a copy there;
        1000 rounds of spot checks grew it by 75 MB). Never this node's own, which it serves."""
        # training thread adds
        with self._served_lock:
            own = {digest for digests in self._served.values() for digest in digests}
        for state_hash in hashes:
            if state_hash.hex() not in own:
                try:
                    self.host.remove_blob(state_hash.hex())
                except (P2PError, OSError) as exc:
                    logger.debug("fetched start state %s not removed: %s", state_hash.hex()[:16], exc)

    def keep_evidence(self, parts: list[bytes]) -> None:
        """Keep start-state parts under ``evidence/state-<sha256>.part`` (the audit reads them there)."""
        for data in parts:
            keep_evidence(self.evidence_dir / f"state-{hashlib.sha256(data).hexdigest()}.part", data)

    def _linkable_path(self, outer_round: int, replica: int, stage: int) -> Path:
        return self._linkable_dir / f"round-{outer_round:08d}-replica{replica}-{stage}.part"

    def hold_linkable(self, outer_round: int, replica: int, parts: list[bytes | Path]) -> None:
        """Hold the start state of an exact rerun of round t until round t+1's chain check: if the
        replica's round t+1 state does not follow, this is the other half of the evidence. A part is its
        bytes or a file (hard-linked, or copied in chunks where it cannot be, through a temporary name: issue
        75, the fetched file is the blob store's and goes with the check, so a link keeps one copy on disk
        where a copy kept two, each a whole start state)."""
        try:
            for stage, data in enumerate(parts):
                target = self._linkable_path(outer_round, replica, stage)
                if isinstance(data, Path):
                    target.parent.mkdir(parents=True, exist_ok=True)
                    staged = target.with_name(f".{target.name}.tmp")
                    staged.unlink(missing_ok=True)
                    try:
                        os.link(data, staged)
                    except OSError:
                        shutil.copyfile(data, staged)
                    os.replace(staged, target)
                else:
                    atomic_write_bytes(target, data)
        except OSError as exc:
            logger.warning("start state of replica %d round %d not held for its chain check: %s", replica,
                           outer_round, exc)

    def linkable(self, outer_round: int, replica: int) -> list[bytes]:
        """The held start state of (round, replica), every stage's part ([] if it was not held)."""
        parts = []
        for stage in range(self.num_stages):
            try:
                parts.append(self._linkable_path(outer_round, replica, stage).read_bytes())
            except OSError:
                logger.warning("start state of replica %d round %d was not held: the evidence lacks it",
                               replica, outer_round)
                return []
        return parts

    def forget_linkable(self, before: int) -> None:
        """Drop held start states of rounds before ``before`` (their chain checks are done or skipped)."""
        for path in self._linkable_dir.glob("round-*.part"):
            try:
                if int(path.name[len("round-"):len("round-") + 8]) < before:
                    path.unlink()
            except (ValueError, OSError):
                continue
