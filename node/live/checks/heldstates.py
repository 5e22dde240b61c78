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
import time
from pathlib import Path

from node.errors import NodeError
from node.fsutil import atomic_write_bytes, keep_evidence, serve_when_space
from node.live.checks.staterebuild import RebuildFailed
from node.store.retention import SERVED_STATES_FILE, SPOT_CHECK_ROUNDS, load_served_states, save_served_states
from p2p.envelope import Envelope
from p2p.blobstore import hash_file
from p2p.errors import P2PError
from training.replica_state import check_stage_state_file

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
#: Seconds a request for a start state being rebuilt for another waits for that rebuild before it is refused
#: (slowly: the asker asks again) rather than hold a thread of the host's for the whole rebuild.
REBUILD_WAIT_S = 10.0
#: Seconds a start state whose rebuild failed is not tried again (each ask of it would start one).
REBUILD_RETRY_AFTER_S = 60.0
#: Seconds between asks for a start state its claimant has not served yet (it may be rebuilding it).
REFETCH_AFTER_S = 3.0
#: A failed ask that took at least this long waited on the claimant (a rebuild past the blob protocol's stall
#: timeout, 15 s) and is asked again; a quicker failure is its answer.
SLOW_REFUSAL_S = 5.0


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
        self._known: frozenset[str] = frozenset()  # every digest of _served, for :meth:`knows`
        self._reindex()
        self._part_bytes: dict[int, int] = {}  # stage -> size of this node's last start-state part of it
        # storage.start_states = "rebuild" (node/live/checks/staterebuild.py): keep one state every
        # ``_every`` rounds on disk, rebuild the others when asked; 0: keep every one served
        self._every = 0
        self._replay = None  # StateReplay: (anchor round, anchor files, target round) -> target files
        self._first_round: int | None = None  # the first round this process served: an anchor
        self._broken = False  # the next round served is an anchor (discontinuity)
        self._decided: dict[int, bool] = {}  # round -> whether its state is kept (keeps)
        self._rebuild_lock = threading.Lock()  # one rebuild at a time
        self._rebuilt: dict[str, int] = {}  # rebuilt blob -> prunings it has outlived (dropped at the 2nd)
        self.rebuild_failures = 0
        self._failed: dict[str, float] = {}  # a blob whose rebuild failed -> when it may be tried again

    def rebuild_others(self, every: int, replay) -> None:
        """Keep one start state every ``every`` rounds on disk and rebuild the others with ``replay`` when a
        peer asks for one (:mod:`node.live.checks.staterebuild`); the host asks :meth:`knows` and
        :meth:`rebuild` for a blob it does not hold. A host that cannot serve a rebuilt blob (no
        ``set_blob_rebuilder``) keeps every state."""
        hook = getattr(self.host, "set_blob_rebuilder", None)
        if hook is None:
            logger.info("this host cannot serve rebuilt start states: every start state is kept")
            return
        self._every, self._replay = every, replay
        hook(self)

    def serve(self, outer_round: int, parts: dict[int, bytes | Path], keep_rounds: int) -> dict[int, bytes]:
        """Serve this node's start-state parts of ``outer_round``; stage -> state hash (what the envelope
        binds). A part is its bytes or a file written under :attr:`writing_dir`, kept as a packed blob (its
        tensors' data as pieces shared with this node's other start states: p2p/blobpack.py), then its name
        here removed: the state is never read whole into memory. A part may also be a function giving its
        bytes in order as ``(bytes, is a tensor's data)`` (:meth:`training.replica_capture.StartStateCapture.
        streams`, where :meth:`streams_parts`): packed the same way straight from the tensors, no file of the
        whole state written first (issue 75: that file, 10 x the stage's weights, sat beside the pieces
        packed from it, the largest part of the retention bench's largest samples).
        ``keep_rounds``: ``storage.keep_rounds`` (0 keeps every round's)."""
        hashes = {}
        for stage, data in parts.items():
            cuts = state_cuts(data) if isinstance(data, Path) else None
            digest = serve_when_space(self.host, data,
                                      what=f"round {outer_round}'s start state of stage {stage}",
                                      stop=self.stop, cuts=cuts)
            self._part_bytes[stage] = self._size_of(data, digest)
            if isinstance(data, Path):
                data.unlink(missing_ok=True)  # the blob store holds its pieces
            with self._served_lock:
                self._served.setdefault(outer_round, []).append(digest)
                self._save_served()
                self._reindex()
            hashes[stage] = bytes.fromhex(digest)
        if self._every and not self.keeps(outer_round, len(parts)):
            for digest in hashes.values():  # served from now on by a rebuild when asked
                self.host.remove_blob(digest.hex())
        # Kept as long as the archive keeps the round's contributions: an audit's --reexecute needs
        # both (storage.keep_rounds = 0 keeps everything, so nothing is dropped then).
        if keep_rounds > 0:
            self.forget_before(outer_round - max(keep_rounds, STATE_ROUNDS_KEPT))
        return hashes

    def streams_parts(self) -> bool:
        """Whether this node's start states go into its blob store straight from their tensors (:meth:`serve`
        with functions): its host keeps packed blobs from their parts (``provide_packed_parts``)."""
        return hasattr(self.host, "provide_packed_parts")

    def _size_of(self, data, digest: str) -> int:
        """The bytes of a start-state part just served (``data`` as :meth:`serve` takes it)."""
        if isinstance(data, Path):
            return data.stat().st_size if data.exists() else 0
        if not callable(data):
            return len(data)
        packed = self.host.store.packed(digest)
        return 0 if packed is None else packed.size

    def _reindex(self) -> None:
        """Renew :attr:`_known` from ``_served`` (under ``_served_lock``): one assignment, read unlocked."""
        self._known = frozenset(d for digests in self._served.values() for d in digests)

    def _save_served(self) -> None:
        """Write the served list (under ``_served_lock``); a failed write only costs the pruning of these
        blobs after a restart."""
        try:
            save_served_states(self._served_file, self._served)
        except OSError as exc:
            logger.warning("list of served start states not written (%s): after a restart they are not "
                           "pruned", exc)

    def serve_hashes(self, outer_round: int, hashes: dict[int, bytes]) -> dict[int, bytes]:
        """Serve this node's start state of ``outer_round`` by its hashes alone (stage -> sha256, as
        :meth:`serve` returns them), its bytes never written: a round :meth:`keeps` does not keep, rebuilt
        when asked (node/live/checks/staterebuild.py)."""
        with self._served_lock:
            self._served.setdefault(outer_round, []).extend(h.hex() for _s, h in sorted(hashes.items()))
            self._save_served()
            self._reindex()
        return dict(hashes)

    def keeps(self, outer_round: int, stages: int) -> bool:
        """Whether this node keeps its start state of ``outer_round`` (of ``stages`` stages) on disk:
        always, unless it rebuilds start states (:meth:`rebuild_others`: then :meth:`_is_anchor`); decided
        once a round."""
        if not self._every:
            return True
        if outer_round not in self._decided:
            self._decided = {r: k for r, k in self._decided.items() if r > outer_round - 8}
            self._decided[outer_round] = self._is_anchor(outer_round, stages)
        return self._decided[outer_round]

    def _is_anchor(self, outer_round: int, stages: int) -> bool:
        """Whether this node keeps its start state of ``outer_round`` on disk under "rebuild": every
        ``_every``-th round, the first this process served (a restart's or a joiner's state does not follow
        from an earlier one by a replay), the first after a round it served none of (a gap), and a round
        whose state does not hold every stage (a split node's: a stage is not replayed alone), and the first
        after a :meth:`discontinuity`."""
        if self._first_round is None:
            self._first_round = outer_round
        with self._served_lock:
            gap = outer_round - 1 not in self._served
        broken, self._broken = self._broken, False
        return (outer_round % self._every == 0 or outer_round == self._first_round or gap or broken
                or stages != self.num_stages)

    def discontinuity(self) -> None:
        """The node's engines changed between rounds other than by a round's own steps (a re-base onto the
        chain's record, node/live/record/forkrepair.py): the next start state it serves is kept, since a
        replay of the rounds before would not give it."""
        self._broken = True

    def _on_disk(self, outer_round: int) -> bool:
        """Whether every stage of this node's start state of ``outer_round`` is in its blob store (under
        ``_served_lock``)."""
        digests = self._served.get(outer_round, [])
        return len(digests) == self.num_stages and all(self._held(d) for d in digests)

    def _held(self, digest: str) -> bool:
        return self.host.has_blob(digest) or self.host.store.packed(digest) is not None

    def oldest_kept(self) -> int | None:
        """The oldest round whose start state this node serves or can rebuild (None: none): the retention
        keeps the archive from the round before it (a replay of round r reads round r - 1's
        contributions)."""
        with self._served_lock:
            return min(self._served, default=None)

    def archive_floor(self, floor: int) -> int:
        """The oldest archive round the retention keeps, given its ``floor``: under "rebuild", the round
        before the oldest start state this node serves or rebuilds (a replay of round r reads round r - 1's
        contributions), else ``floor``."""
        oldest = self.oldest_kept() if self._every else None
        return floor if oldest is None else max(0, min(floor, oldest - 1))

    def forget_before(self, floor: int) -> list[int]:
        """Stop serving (and delete) this node's start states of rounds before ``floor`` (the retention's:
        node/store/retention.py); the rounds dropped. Under "rebuild" the newest state kept on disk at or
        before ``floor`` stays (the rounds from it on are rebuilt from it), and a rebuilt state goes at the
        second pruning after its rebuild (an asker's fetch had a round to read it)."""
        if self._every:
            self._drop_rebuilt()
        with self._served_lock:
            if self._every:  # a kept one, not a rebuilt copy (those go)
                anchors = [r for r in self._served if r <= floor and self._on_disk(r)
                           and not set(self._served[r]) & set(self._rebuilt)]
                floor = max(anchors, default=floor)
            old = sorted(r for r in list(self._served) if r < floor)
            for outer_round in old:
                for digest in self._served[outer_round]:
                    self.host.remove_blob(digest)  # a blob already gone (a crash after it) is no error
                del self._served[outer_round]
            self._reindex()
            if old:
                self._save_served()
        return old

    def _drop_rebuilt(self) -> None:
        """Drop the rebuilt states that outlived a pruning already (anchors stay: they are not rebuilt)."""
        for digest, prunings in list(self._rebuilt.items()):
            if prunings >= 1:
                self.host.remove_blob(digest)
                del self._rebuilt[digest]
            else:
                self._rebuilt[digest] = prunings + 1

    def _round_of(self, digest: str) -> tuple[int, int] | None:
        """(round, stage) of this node's start state ``digest`` (under ``_served_lock``); None if not its."""
        for outer_round, digests in self._served.items():
            if digest in digests:
                return outer_round, digests.index(digest)
        return None

    def knows(self, digest: str) -> bool:
        """Whether ``digest`` is one of this node's start states that a rebuild can serve (the blob server
        asks, for a blob it does not hold: p2p/blob_server.py)."""
        # On the host's event loop: never waits for ``_served_lock``, which a pruning holds while it asks that
        # loop to forget a blob (waiting here deadlocked a node at round 89 of the retention bench).
        return bool(self._every) and digest in self._known

    def rebuild(self, digest: str) -> bool:
        """Rebuild this node's start state ``digest`` and serve it (module :mod:`node.live.checks.
        staterebuild`); False if it cannot be (the reason logged): the asker is told it is not here. Runs on
        a thread of the host's, one rebuild at a time; a blob another asker's rebuild made meanwhile is
        simply served."""
        # A thread of the host's waits here at most REBUILD_WAIT_S: an asker whose ask fails after waiting
        # asks again (:meth:`_fetch_until`), so a long rebuild holds few threads.
        if not self._rebuild_lock.acquire(timeout=REBUILD_WAIT_S):
            return False
        try:
            return self._rebuild_locked(digest)
        finally:
            self._rebuild_lock.release()

    def _rebuild_locked(self, digest: str) -> bool:
        """:meth:`rebuild`, under ``_rebuild_lock``."""
        if self._held(digest):
            return True
        if time.monotonic() < self._failed.get(digest, 0.0):
            return False  # it failed a moment ago: the reason was logged then
        with self._served_lock:
            found = self._round_of(digest)
            # a kept state, or a copy rebuilt since the last pruning (not dropped under the replay)
            anchors = [] if found is None else [
                r for r in self._served if r <= found[0] and self._on_disk(r)
                and not any(self._rebuilt.get(d, 0) for d in self._served[r])]
            anchor = max(anchors, default=None)
            anchor_digests = list(self._served.get(anchor, []))
            target_digests = [] if found is None else list(self._served[found[0]])
        if found is None or anchor is None:
            logger.warning("start state %s asked for: %s", digest[:16],
                           "not one of ours" if found is None else "no kept state before its round")
            return False
        try:
            self._rebuild_round(anchor, anchor_digests, found[0], target_digests)
        except (NodeError, P2PError, OSError) as exc:
            self.rebuild_failures += 1
            self._failed = {d: t for d, t in self._failed.items() if t > time.monotonic()}
            self._failed[digest] = time.monotonic() + REBUILD_RETRY_AFTER_S
            logger.warning("start state of round %d not rebuilt from round %d's: %s", found[0], anchor,
                           exc)
            return False
        return True

    def _rebuild_round(self, anchor: int, anchor_digests: list[str], target: int,
                       target_digests: list[str]) -> None:
        """Replay from ``anchor``'s kept state to ``target``'s, check each stage's bytes hash to what this
        node bound, and serve the child's files (hard-linked into the blob store)."""
        job = self._replay.job_dir(target)
        shutil.rmtree(job, ignore_errors=True)  # a crashed rebuild's leftovers
        job.mkdir(parents=True)
        try:
            files = self._replay(anchor, self.host.store.root, anchor_digests, target)
            for stage, (path, digest) in enumerate(zip(files, target_digests)):
                if hash_file(path) != digest:
                    raise RebuildFailed(f"the replay's stage {stage} is not the state this node bound "
                                        f"({digest[:16]})")
            # Linked into the blob store as it is, not packed: packing copied its pieces beside the child's
            # file until the job was removed (issue 75: 10 x the stage's weights at once, the retention
            # bench's largest sample), and the copy lives two prunings only.
            for stage, (path, digest) in enumerate(zip(files, target_digests)):
                serve_when_space(self.host, path, stop=self.stop,
                                 what=f"round {target}'s rebuilt start state of stage {stage}")
                self._rebuilt[digest] = 0
        finally:
            shutil.rmtree(job, ignore_errors=True)

    def close(self) -> None:
        """End the rebuilds' child process, if one was started."""
        if self._replay is not None:
            self._replay.close()

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
            self._fetch_until(state_hash.hex(), dest, env.sender_peer_id,
                              state_fetch_timeout(self.expected_part_bytes(env.stage)))
            paths.append(dest)
        return paths

    def _fetch_until(self, digest: str, dest: Path, provider: str, timeout: float) -> None:
        """Fetch ``digest`` from ``provider``, asked again every few seconds until ``timeout`` while the asks
        fail after one failed slowly: a claimant that rebuilds the state (node/live/checks/staterebuild.py)
        answers its first ask only once the replay is done, and an ask that waited past the blob protocol's
        stall timeout fails meanwhile. A quick first refusal (the blob is not there) is final at once, as
        before."""
        deadline, left, rebuilding = time.monotonic() + timeout, timeout, False
        while True:
            asked = time.monotonic()
            try:
                self.host.fetch_blob(digest, dest, providers=[provider], timeout=left)
                return
            except P2PError as exc:
                # A quick first refusal is the claimant's answer (not here). An ask that waited shows a
                # rebuild under way: from then on every failure is asked again (a piece asked for while the
                # rebuild ran may be refused quickly after it).
                now = time.monotonic()
                rebuilding = rebuilding or now - asked >= SLOW_REFUSAL_S
                if not rebuilding or deadline - now < 2 * REFETCH_AFTER_S or self.stop.is_set():
                    raise
                logger.debug("start state %s not served yet (%s): asked again", digest[:16], exc)
                self.stop.wait(REFETCH_AFTER_S)
                left = deadline - time.monotonic()

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
