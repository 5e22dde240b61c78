"""Retention: how a node bounds what it keeps on disk (``[storage]`` of node.toml).

Three kinds of files grow with a run, one set a round: the archive (one directory of signed contribution
envelopes per sealed round, :mod:`node.store.archive`), the start states a node serves for the spot checks
of its contributions (node/live/checks/heldstates.py) and the checkpoints (a full checkpoint
``round-<t>.safetensors`` and a shard per held stage ``shard-<t>-stage<s>.safetensors`` per checkpoint
round, in ``<data_dir>/checkpoints``). All are also served to peers as blobs, so what is deleted stops
being served first (``forget_blob``). (A chunked run's published stage states follow the same windows on
their own: node/live/fraud/chunkstate.py.)

The default, ``storage.retention = "windows"`` (:class:`Retention`), decides from the chain, never from a
clock. Round ``t``'s archive and start states are kept while any of these holds:

* ``t`` is not committed on chain yet (a restart re-applies the rounds it sealed; every round commits once);
* ``t``'s own window on chain is open (its dispute window, its open disputes' deadline, its availability
  games: where ``TrainingLedger.proofWindowOf(t + 1)`` opens), or an older held round's is: rounds go
  oldest first, so what is kept is always one span of rounds. A verifier draws its spot checks of a round
  once it is on chain and fetches the claimant's start state and the round's envelopes then (its chain
  check of ``t`` follows with round ``t + 1``); what it finds counts only inside ``t``'s window (an
  accusation after it is refused on chain), so the window is what the spot checks need too;
* ``t`` is the newest committed round, or, on a node without a chain to ask, one of the newest
  :data:`SPOT_CHECK_ROUNDS` committed rounds (a fixed span where the windows cannot be read; before issue 75
  it applied with a chain too, and held 8 rounds' start states on a chain whose rounds outlast its windows);
* ``t`` is among the newest ``keep_rounds`` (0: no more).

A node's own start states are listed by round on disk (:data:`SERVED_STATES_FILE`), so a restarted node
prunes those it served before the restart as well.

What a fraud proof of ``t`` and its availability games read, the chunked run's published stage states, is
kept until ``t``'s proof window closes, by node/live/fraud/chunkstate.py. Checkpoints: the newest *final*
committed full checkpoint (its proof window closed: nothing can overturn it, so a joiner can always start
from it), the newest committed one, every round not committed yet and the newest ``keep_checkpoints``;
everything while no full checkpoint is final. A committed round's shards go where its full file repeats them
(:func:`redundant_shards`; in a one-stage run the newest committed round's too).

So a node keeps one span of ``W`` rounds: the rounds not committed yet (at most ``max_rounds_ahead``),
the newest committed one, and those whose own window is open (``disputeBlocks`` over the blocks a round
takes, longer only while a dispute or an availability game runs), plus two checkpoints.
Per round that is the node's start state of each held stage (what a rerun starts from: weights, AdamW
state and outer state, about 10 x the stage's parameter bytes; kept as a packed blob whose tensors' data
are pieces shared with the node's other start states, p2p/blobpack.py: the round-start and last-encode
snapshots are the live weights, the decoded update of round ``r - 1`` is the previous state's, so about
7 x of new bytes a round) and its signed contributions, and in a
chunked run, over the longer proof window ``P`` rounds, its published stage state (weights and momentum,
2 x; with ``storage.start_states = "rebuild"`` written only when a peer asks or its round leaves memory, four
rounds behind the committer: node/live/fraud/stateserve.py) with the version-3 factors and sum trees beside
it and its spilled chunk leaves: so its disk is about
``W`` start states plus ``P`` published states plus two checkpoints, however many rounds run, where ``W``
and ``P`` are the chain's windows in blocks over the blocks a round takes (a few rounds for rounds of
minutes; tens in the retention bench, whose rounds take a block or two). docs/PROTOCOL.md, "Archive and
retention", gives the measured figures.

``storage.retention = "all"`` keeps every round (0 and 0 of the older settings): what an audit of the whole
run from this node's files needs; it grows by about one start state of each held stage a round.

Deletion is crash-safe: blobs are forgotten first (a crash then leaves a file that the next
pruning deletes), an archive round directory is renamed out of the archive's namespace in one
``rename`` before it is removed (a crash never leaves a half-deleted round that looks sealed),
and leftovers of an interrupted removal are swept the next time.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from pathlib import Path

from node.fsutil import atomic_write_bytes
from node.store.archive import Archive
from p2p.blobstore import hash_file

logger = logging.getLogger(__name__)

#: Committed rounds whose archive and start states a node without a chain to ask keeps: a verifier draws its
#: spot checks of a round once it is on chain and fetches the claimant's start state then
#: (node/live/checks/heldstates.py serves them; its chain check of round t comes with round t + 1). With a
#: chain, the rounds whose own window is open are kept instead (:meth:`Retention.rounds_floor`).
SPOT_CHECK_ROUNDS = 8

#: The file (in the spot checker's work directory) listing the blobs of this node's own start states by round
#: (node/live/checks/heldstates.py): a restarted node still forgets them when their rounds leave the span.
SERVED_STATES_FILE = "served-start-states.json"

# a full checkpoint, a stage shard, or a checkpoint kept split (its header and the list of this node's shards
# that serve it: node/store/checkpoint_split.py); a "round-" file marks a round with a checkpoint of its own
_CHECKPOINT_FILE = re.compile(
    r"^(?:round-(\d{8})(?:\.safetensors|\.head|\.split\.json)|shard-(\d{8})-stage\d+\.safetensors)$")


def checkpoint_files(checkpoint_dir: Path) -> dict[int, list[Path]]:
    """The checkpoint files (full checkpoints, shards, split checkpoints' headers and listings) of
    ``checkpoint_dir``, by round."""
    out: dict[int, list[Path]] = {}
    if not checkpoint_dir.is_dir():
        return out
    for path in checkpoint_dir.iterdir():
        match = _CHECKPOINT_FILE.match(path.name)
        if match:
            out.setdefault(int(match.group(1) or match.group(2)), []).append(path)
    return out


def prune_archive(archive: Archive, keep_rounds: int, committed_through: int,
                  forget_blob: Callable[[str], object] = lambda _hex: None) -> list[int]:
    """Delete sealed rounds beyond the newest ``keep_rounds``, never one after ``committed_through``.

    ``keep_rounds`` 0 keeps everything. Returns the rounds deleted; each deleted envelope's blob is
    forgotten (``forget_blob(sha256 hex)``) before its file goes (:meth:`Archive.prune`).
    """
    doomed = sorted(archive.prune(keep_rounds, committed_through, forget_blob))
    if doomed:
        logger.info("retention: pruned archive rounds %s (keep_rounds=%d)", _span(doomed), keep_rounds)
    return doomed


def prune_checkpoints(checkpoint_dir: Path, keep_checkpoints: int, committed_through: int,
                      forget_blob: Callable[[str], object] = lambda _hex: None) -> list[int]:
    """Delete checkpoint rounds beyond the newest ``keep_checkpoints`` committed ones.

    Rounds after ``committed_through`` are always kept, and so is the newest committed round that
    has a full checkpoint file (what a joiner downloads) even if shard-only rounds are newer.
    ``keep_checkpoints`` 0 keeps everything. Returns the rounds deleted.
    """
    if keep_checkpoints <= 0:
        return []
    files = checkpoint_files(checkpoint_dir)
    committed = sorted(r for r in files if r <= committed_through)
    keep = set(committed[-keep_checkpoints:])
    full = [r for r in committed if any(p.name.startswith("round-") for p in files[r])]
    if full:
        keep.add(full[-1])
    doomed = [r for r in committed if r not in keep]
    for round_index in doomed:
        for path in sorted(files[round_index]):
            _remove_served(path, forget_blob)
    if doomed:
        logger.info("retention: pruned checkpoints of rounds %s (keep_checkpoints=%d)",
                    _span(doomed), keep_checkpoints)
    return doomed


def _span(rounds: list[int]) -> str:
    return f"{rounds[0]}..{rounds[-1]}" if len(rounds) > 1 else str(rounds[0])


def _remove_served(path: Path, forget_blob: Callable[[str], object]) -> None:
    """Stop serving the file at ``path`` (hashed in 4 MiB reads, never read whole), then delete it."""
    try:
        digest = hash_file(path)
    except OSError:
        return
    forget_blob(digest)
    path.unlink(missing_ok=True)


class Retention:
    """The default retention, ``storage.retention = "windows"`` (module docstring): which rounds a node may
    delete, from the chain's windows.

    ``own_open(t)``: whether round ``t`` itself can still be disputed or have an availability game on it
    (node.live.fraud.window.DisputeWindow.own_open); ``proof_open(t)``: whether a fraud proof of ``t`` can
    still be taken (DisputeWindow.open: once closed, ``t`` is final). Both answer True when the chain cannot
    be asked. None: no chain (every committed round older than the spot checks' goes; no checkpoint is final).
    """

    def __init__(self, storage, own_open: Callable[[int], bool] | None,
                 proof_open: Callable[[int], bool] | None = None) -> None:
        self.storage = storage  # node.config.StorageConfig
        self.own_open = own_open
        self.proof_open = proof_open if proof_open is not None else own_open
        # Rounds before this were found closed already (a closed window stays closed): not asked again, so
        # the archive rounds kept only for a start state's replay (node/live/checks/staterebuild.py) cost no
        # chain calls
        self._settled = 0

    @property
    def keeps_all(self) -> bool:
        return self.storage.retention == "all"

    def rounds_floor(self, newest: int, committed_through: int, held: list[int]) -> int:
        """The oldest round whose archive and start states are kept: rounds before it may go.

        ``newest``: the round being finished; ``committed_through``: the newest round this node knows is on
        chain; ``held``: the rounds it holds anything of (the oldest are asked about their windows)."""
        if self.keeps_all:
            return 0
        committed_kept = SPOT_CHECK_ROUNDS if self.own_open is None else 1
        floor = min(committed_through + 1, min(newest, committed_through) - committed_kept + 1)
        if self.storage.keep_rounds > 0:
            floor = min(floor, newest - self.storage.keep_rounds + 1)
        for outer_round in sorted(r for r in set(held) if self._settled <= r < floor):
            if self.own_open is not None and self.own_open(outer_round):
                self._settled = max(self._settled, outer_round)
                return max(0, outer_round)  # it and every newer round stay: one span, oldest first
        if self.own_open is not None:
            self._settled = max(self._settled, floor)
        return max(0, floor)

    def checkpoints_kept(self, checkpoint_dir: Path, committed_through: int, rounds_floor: int) -> set[int]:
        """The checkpoint rounds kept: the newest final committed full checkpoint (nothing overturns it: a
        joiner can always start from it), the next one to become final, the newest committed full one (what
        the chain names now), every round not committed yet (a restart, and the assembly of a round's full
        checkpoint from its holders' shards, read them) and the newest ``keep_checkpoints``. Everything while
        no full checkpoint is final.

        Not the checkpoints of every round still inside a window (``rounds_floor``, kept until issue 75's
        measurement: 18 of each at 25 rounds of the retention bench, 2 x the stage's bytes each): nothing on
        chain reads a checkpoint inside a window (a fraud proof and its games read the published stage
        states, node/live/fraud/chunkstate.py; a spot check the start states), and an auditor reads older
        ones from the seeders' and archives' copies (docs/AUDIT.md)."""
        return self.checkpoint_plan(checkpoint_dir, committed_through)[0]

    def checkpoint_plan(self, checkpoint_dir: Path, committed_through: int, one_stage: bool = False
                        ) -> tuple[set[int], list[Path]]:
        """(:meth:`checkpoints_kept`, the stage shards of those rounds that go: :func:`redundant_shards`,
        ``one_stage`` as there; none while everything is kept)."""
        files = checkpoint_files(checkpoint_dir)
        if self.keeps_all:
            return set(files), []
        committed = sorted(r for r in files if r <= committed_through)
        full = [r for r in committed if any(p.name.startswith("round-") for p in files[r])]
        final = next((r for r in reversed(full) if self.proof_open is None or not self.proof_open(r)), None)
        if final is None:
            return set(files), []
        keep = {r for r in files if r > committed_through} | {final, full[-1]}
        # The next final one: the oldest full checkpoint after ``final`` (its proof window still open), kept
        # until its window closes and it takes ``final``'s place. Without it every newer checkpoint went
        # before its window closed and the final one never moved on (issue 75: round 0's at round 100 of
        # the retention bench, a joiner's fallback 100 rounds back, past every archive).
        later = [r for r in full if r > final]
        if later:
            keep.add(later[0])
        if self.storage.keep_checkpoints > 0:
            keep |= set(committed[-self.storage.keep_checkpoints:])
        return keep, [p for p in redundant_shards(checkpoint_dir, committed_through, one_stage)
                      if _round_of(p) in keep]


def _round_of(path: Path) -> int:
    match = _CHECKPOINT_FILE.match(path.name)
    return int(match.group(1) or match.group(2)) if match else -1


def prune_archive_before(archive: Archive, floor: int, committed_through: int,
                         forget_blob: Callable[[str], object] = lambda _hex: None) -> list[int]:
    """Delete the archive's rounds before ``floor`` (:meth:`Retention.rounds_floor`), never one after
    ``committed_through``; sealed or not (a round this node never sealed and the chain holds is nobody's
    restart). Returns the rounds deleted; their envelopes' blobs are forgotten first."""
    doomed = sorted(archive.prune(0, committed_through, forget_blob, before=floor))
    if doomed:
        logger.info("retention: pruned archive rounds %s (kept from round %d: open windows)", _span(doomed),
                    floor)
    return doomed


def redundant_shards(checkpoint_dir: Path, committed_through: int, one_stage: bool = False) -> list[Path]:
    """The stage shards a full checkpoint file of the same round repeats, for every committed round but the
    newest committed one with a full file: the file holds the same stages' weights and momentum (the agreed
    ones), and a joiner, a restart, an auditor, ``pull`` and a seeder read the file (or, kept split, the
    shards: a round kept split has no full file and keeps them). The newest committed round keeps its
    shards for a committer still assembling its file from its holders; rounds not committed keep theirs.
    On a node of one stage of S, a shard is 1/(S+1) of what a checkpoint round keeps (half at S = 1).

    ``one_stage``: the run has one stage, so every node holds it and builds each full file from its own
    shard (another's is fetched only by a node whose own is not the agreed one, which takes the committed
    file instead): the newest committed round's shards go too (issue 75: 2 x the stage's weights of the
    retention bench's 12 x of checkpoints); rounds not committed keep theirs (a committer that failed
    before its commit builds the file again from them)."""
    files = checkpoint_files(checkpoint_dir)
    full = sorted(r for r, paths in files.items()
                  if r <= committed_through and checkpoint_dir / f"round-{r:08d}.safetensors" in paths)
    doomed = full if one_stage else full[:-1]
    return sorted(p for r in doomed for p in files[r] if p.name.startswith("shard-"))


def prune_shards(doomed: list[Path], forget_blob: Callable[[str], object] = lambda _hex: None) -> None:
    """Delete the stage shards ``doomed`` (:meth:`Retention.checkpoint_plan`), each served no more first."""
    for path in doomed:
        _remove_served(path, forget_blob)
    if doomed:
        logger.info("retention: dropped %d stage shards the kept full checkpoints repeat", len(doomed))


def prune_checkpoints_except(checkpoint_dir: Path, keep: set[int], committed_through: int,
                             forget_blob: Callable[[str], object] = lambda _hex: None) -> list[int]:
    """Delete the checkpoint rounds not in ``keep`` (:meth:`Retention.checkpoints_kept`), never one after
    ``committed_through``. Returns the rounds deleted."""
    files = checkpoint_files(checkpoint_dir)
    doomed = sorted(r for r in files if r not in keep and r <= committed_through)
    for round_index in doomed:
        for path in sorted(files[round_index]):
            _remove_served(path, forget_blob)
    if doomed:
        logger.info("retention: pruned checkpoints of rounds %s (%d rounds kept)", _span(doomed), len(keep))
    return doomed


def load_served_states(path: Path) -> dict[int, list[str]]:
    """The start-state blobs a node served before (round -> sha256 hex), as :func:`save_served_states` left
    them; {} when there is no file. A damaged or foreign file is refused with a warning and read as {} (the
    node goes on; those blobs then stay until deleted by hand: the warning names the file)."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        logger.warning("retention: %s unreadable (%s): start states served before this start are not "
                       "pruned", path, exc)
        return {}
    try:
        out = {int(r): [str(d) for d in digests] for r, digests in raw["rounds"].items()}
        if raw.get("v") != 1 or any(int(r) < 0 for r in out) or any(
                not re.fullmatch(r"[0-9a-f]{64}", d) for ds in out.values() for d in ds):
            raise ValueError("not a list of rounds and sha256 hashes, version 1")
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        logger.warning("retention: %s is not a served-states list (%s): start states served before this "
                       "start are not pruned", path, exc)
        return {}
    return out


def save_served_states(path: Path, served: dict[int, list[str]]) -> None:
    """Record ``served`` (round -> sha256 hex of this node's start-state blobs) at ``path``, atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"v": 1, "rounds": {str(r): list(d) for r, d in sorted(served.items())}}
    atomic_write_bytes(path, json.dumps(body, sort_keys=True).encode() + b"\n")
