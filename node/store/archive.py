"""The archive: the exact signed contribution bytes a node aggregated, per round.

Layout under ``<data_dir>/archive/run-<run_id>/``::

    run.json                        the run document (its sha256 is the chain's configHash)
    round-00000003/
        <envelope sha256 hex>.env   one signed contribution envelope, byte for byte
        <envelope sha256 hex>.own   [stage, replica, peer_id]: the envelope is this node's own contribution
        round.json                  {"round": 3,
                                     "contributions": [[stage, replica, peer_id, hash], ...],
                                     "excluded": [...],
                                     "left_out_own": [[stage, replica, peer_id, hash], ...]}
                                    in canonical aggregation order (stage, replica, peer id, hash)
        recorded.json               the round's contributions of every stage and its stage weights hashes,
                                    as the chain's record binds them (spot checks; a split node seals only
                                    the stages it holds and fetches the other stages' envelopes by hash)

The archive is what lets an auditor re-derive every round: the contributions
root on chain is the Merkle root of the envelope hashes in canonical order,
and replaying the aggregation over them must give the committed weights root.
A node keeps every contribution of its own, also one the round's close left out (it came after the
coordinator's deadline): a one-node replica whose stage 0 was aggregated and whose stage 1 was not is
rerun by the audit from both its stages' envelopes (the pipeline's backward pass runs through both), and
only its own archive holds the one no close named (the 60-minute soak's round 35, docs/P2P.md).
Pruning keeps the newest ``storage.keep_rounds`` sealed rounds (0 keeps everything) and
never a round not yet committed on chain (node/store/retention.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from node.errors import StateError
from node.fsutil import atomic_write_bytes, atomic_write_json

logger = logging.getLogger(__name__)

RECORDED_FILE = "recorded.json"
TRASH_PREFIX = ".pruned-"  # a round directory being removed; not a round any more (rounds() skips it)


@dataclass(frozen=True)
class ArchivedContribution:
    stage: int
    replica: int
    peer_id: str
    envelope_hash: bytes  # sha256 of the envelope bytes

    def key(self) -> tuple[int, int, str, bytes]:
        return (self.stage, self.replica, self.peer_id, self.envelope_hash)


class Archive:
    """Per-run store of signed contribution envelopes, keyed by round and hash."""

    def __init__(self, root: str | Path, run_id: int) -> None:
        self.dir = Path(root) / f"run-{run_id}"
        self.dir.mkdir(parents=True, exist_ok=True)

    def _round_dir(self, round_index: int) -> Path:
        return self.dir / f"round-{round_index:08d}"

    def sealed_path(self, round_index: int) -> Path:
        """The manifest (``round.json``) of a round: it exists once the round is sealed."""
        return self._round_dir(round_index) / "round.json"

    def write_run_document(self, data: bytes) -> None:
        atomic_write_bytes(self.dir / "run.json", data)

    def run_document(self) -> bytes | None:
        path = self.dir / "run.json"
        return path.read_bytes() if path.exists() else None

    def put(self, round_index: int, envelope: bytes) -> bytes:
        """Store one envelope (idempotent); return its sha256."""
        digest = hashlib.sha256(envelope).digest()
        path = self._round_dir(round_index) / f"{digest.hex()}.env"
        if not path.exists():
            atomic_write_bytes(path, envelope)
        return digest

    def put_own(self, round_index: int, envelope: bytes, stage: int, replica: int, peer_id: str) -> bytes:
        """Store one of this node's own contribution envelopes (idempotent) and mark it as its own, so that
        sealing keeps it even when the round's close left it out (module docstring); return its sha256."""
        digest = self.put(round_index, envelope)
        marker = self._round_dir(round_index) / f"{digest.hex()}.own"
        if not marker.exists():
            atomic_write_json(marker, [int(stage), int(replica), str(peer_id)])
        return digest

    def _own(self, round_index: int) -> list[ArchivedContribution]:
        """This node's own contributions of a round (:meth:`put_own`) whose envelope is here; unreadable
        markers are skipped (a marker only keeps an envelope, it never makes one)."""
        out = []
        for marker in sorted(self._round_dir(round_index).glob("*.own")):
            if not marker.with_suffix(".env").exists():
                continue
            try:
                stage, replica, peer_id = json.loads(marker.read_text())
                out.append(ArchivedContribution(int(stage), int(replica), str(peer_id),
                                                bytes.fromhex(marker.stem)))
            except (ValueError, TypeError, OverflowError, RecursionError):
                logger.warning("round %d: unreadable own-contribution marker %s ignored", round_index,
                               marker.name)
        return out

    def put_blob(self, round_index: int, data: bytes, suffix: str) -> bytes:
        """Store a round's blob that is not a contribution envelope, as ``<sha256>.<suffix>`` (idempotent;
        the sliced exchange's ``slice`` blobs and ``partial`` envelopes, docs/PROTOCOL.md). Sealing keeps
        them."""
        digest = hashlib.sha256(data).digest()
        path = self._round_dir(round_index) / f"{digest.hex()}.{suffix}"
        if not path.exists():
            atomic_write_bytes(path, data)
        return digest

    def blobs(self, round_index: int, suffix: str) -> list[bytes]:
        """Every blob :meth:`put_blob` stored for a round with ``suffix``, in file-name order."""
        return [path.read_bytes() for path in sorted(self._round_dir(round_index).glob(f"*.{suffix}"))]

    def envelopes(self, round_index: int) -> list[bytes]:
        """Every envelope stored for a round (sealed or not), in file-name order."""
        return [path.read_bytes() for path in sorted(self._round_dir(round_index).glob("*.env"))]

    def get(self, round_index: int, envelope_hash: bytes) -> bytes:
        path = self._round_dir(round_index) / f"{envelope_hash.hex()}.env"
        try:
            return path.read_bytes()
        except FileNotFoundError:
            raise StateError(
                f"archive has no envelope {envelope_hash.hex()} for round {round_index}") from None

    def find(self, envelope_hash: bytes) -> Path | None:
        """Locate an envelope by hash in any round (used to serve it to peers)."""
        hits = list(self.dir.glob(f"round-*/{envelope_hash.hex()}.env"))
        return hits[0] if hits else None

    def seal_round(self, round_index: int, contributions: list[ArchivedContribution],
                   excluded: list[list] | None = None, all_held: bool = True) -> None:
        """Record which envelopes were aggregated in round ``round_index``, in canonical order.

        ``excluded`` lists the closed contributions the aggregation left out (training.robust:
        undecodable, wrong shape, non-finite, forbidden codec, screened) as ``[stage, replica,
        peer id, envelope hash hex, reason, detail]``; an auditor re-derives them.
        ``all_held=False``: some envelopes are not archived here (a sliced exchange's holder
        fetches only those it aggregates; each contributor archives its own).
        """
        ordered = sorted(contributions, key=ArchivedContribution.key)
        for c in ordered if all_held else ():
            if not (self._round_dir(round_index) / f"{c.envelope_hash.hex()}.env").exists():
                raise StateError(f"cannot seal round {round_index}: envelope {c.envelope_hash.hex()} missing")
        aggregated = {c.envelope_hash for c in ordered}
        left_out_own = sorted((c for c in self._own(round_index) if c.envelope_hash not in aggregated),
                              key=ArchivedContribution.key)
        atomic_write_json(
            self._round_dir(round_index) / "round.json",
            {
                "round": round_index,
                "contributions": [[c.stage, c.replica, c.peer_id, c.envelope_hash.hex()] for c in ordered],
                "excluded": list(excluded or []),
                "left_out_own": [[c.stage, c.replica, c.peer_id, c.envelope_hash.hex()]
                                 for c in left_out_own],
            },
        )
        for c in left_out_own:
            logger.info("round %d stage %d: keeping our contribution %s, which the close left out (an audit "
                        "reruns the replica from it)", round_index, c.stage, c.envelope_hash.hex()[:12])
        # Other envelopes received but not aggregated (late, duplicate) are dropped here.
        keep = {f"{h.hex()}.env" for h in aggregated | {c.envelope_hash for c in left_out_own}}
        for path in self._round_dir(round_index).glob("*.env"):
            if path.name not in keep:
                logger.info("round %d: dropping unaggregated envelope %s", round_index, path.name[:16])
                path.unlink()

    def sealed(self, round_index: int) -> list[ArchivedContribution] | None:
        path = self._round_dir(round_index) / "round.json"
        if not path.exists():
            return None
        try:
            doc = json.loads(path.read_text())
            return [ArchivedContribution(int(s), int(r), str(p), bytes.fromhex(h)) for s, r, p, h in
                    doc["contributions"]]
        except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as exc:
            # OverflowError: int() of an infinite JSON number; RecursionError: deeply nested JSON.
            raise StateError(
                f"archive manifest {path} is corrupt: {type(exc).__name__}: {exc}"[:300]) from None

    def left_out_own(self, round_index: int) -> list[ArchivedContribution]:
        """This node's own contributions of a sealed round that its close left out (kept, see
        :meth:`seal_round`); [] for a round not sealed here or sealed before the archive kept them."""
        path = self.sealed_path(round_index)
        try:
            doc = json.loads(path.read_text())
            return [ArchivedContribution(int(s), int(r), str(p), bytes.fromhex(h))
                    for s, r, p, h in doc.get("left_out_own", [])]
        except FileNotFoundError:
            return []
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError) as exc:
            raise StateError(
                f"archive manifest {path} is corrupt: {type(exc).__name__}: {exc}"[:300]) from None

    def record_round(self, round_index: int, contributions: list[ArchivedContribution],
                     stage_hashes: list[bytes]) -> None:
        """Keep the contributions of every stage of a sealed round and its stage weights hashes, as the
        chain's record binds them (node.live.checks.spotinputs checks both against the record's roots
        first)."""
        if not self.sealed_path(round_index).exists():
            raise StateError(f"round {round_index} is not sealed here: its record is not kept")
        atomic_write_json(self._round_dir(round_index) / RECORDED_FILE, {
            "round": round_index,
            "contributions": [[c.stage, c.replica, c.peer_id, c.envelope_hash.hex()] for c in contributions],
            "stage_hashes": [h.hex() for h in stage_hashes],
        })

    def recorded(self, round_index: int) -> tuple[list[ArchivedContribution], list[bytes]] | None:
        """(contributions of every stage, stage weights hashes) kept by :meth:`record_round`, or None."""
        path = self._round_dir(round_index) / RECORDED_FILE
        if not path.exists():
            return None
        try:
            doc = json.loads(path.read_text())
            entries = [ArchivedContribution(int(s), int(r), str(p), bytes.fromhex(h))
                       for s, r, p, h in doc["contributions"]]
            hashes = [bytes.fromhex(h) for h in doc["stage_hashes"]]
        except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as exc:
            raise StateError(f"archive record {path} is corrupt: {type(exc).__name__}: {exc}"[:300]) from None
        if int(doc.get("round", -1)) != round_index or any(len(h) != 32 for h in
                                                            [*hashes, *(c.envelope_hash for c in entries)]):
            raise StateError(f"archive record {path} is not round {round_index}'s or holds malformed hashes")
        return entries, hashes

    def excluded(self, round_index: int) -> list[list]:
        """The sealed round's exclusions, ``[stage, replica, peer id, envelope hash hex, reason, detail]``."""
        path = self._round_dir(round_index) / "round.json"
        try:
            entries = json.loads(path.read_text()).get("excluded", [])
        except FileNotFoundError:
            return []
        except (ValueError, AttributeError) as exc:
            raise StateError(f"archive manifest {path} is corrupt: {exc}") from None
        if not isinstance(entries, list) or not all(isinstance(e, list) and len(e) == 6 for e in entries):
            raise StateError(f"archive manifest {path}: 'excluded' must be a list of 6-item lists")
        return entries

    def set_aside_from(self, round_index: int) -> list[int]:
        """Unseal the rounds from ``round_index`` on: each ``round.json`` becomes ``round.forked.json``.

        A life whose weights left the run's record and that could not re-base re-enters from the
        chain's checkpoint (node/live/peers/lifecycle.py): what it sealed of those rounds (another close or
        exclusions computed on its forked weights) is not the record, so no restart adopts it, no
        spot check reruns from it and no audit merges it. The envelopes stay (they are the signed
        contributions, served on). Returns the rounds set aside.
        """
        moved = []
        for r in self.rounds():
            path = self.sealed_path(r)
            if r >= round_index and path.exists():
                os.replace(path, path.with_name("round.forked.json"))
                moved.append(r)
        return moved

    def rounds(self) -> list[int]:
        out = []
        for p in self.dir.glob("round-*"):
            try:
                out.append(int(p.name.split("-")[1]))
            except (IndexError, ValueError):
                continue
        return sorted(out)

    def prune(self, retention_rounds: int, committed_through: int | None = None,
              forget_blob: Callable[[str], object] | None = None, before: int | None = None
              ) -> dict[int, list[bytes]]:
        """Delete all but the newest ``retention_rounds`` sealed rounds; 0 keeps everything. With ``before``
        instead (node/store/retention.py, the windows' retention): every round before it, sealed or not.

        Rounds after ``committed_through`` (when given) are kept whatever their age: a restart
        re-applies sealed rounds that are not on chain yet. Each deleted envelope's blob is
        forgotten first (``forget_blob(sha256 hex)``), then the round directory leaves the archive
        in one ``rename`` and is removed: a crash never leaves half a round that still looks sealed
        (leftovers are swept on the next call). Returns the envelope hashes deleted, by round.
        """
        for leftover in self.dir.glob(TRASH_PREFIX + "*"):
            shutil.rmtree(leftover, ignore_errors=True)
        if before is not None:
            candidates = [r for r in self.rounds() if r < before]
        elif retention_rounds > 0:
            candidates = [r for r in self.rounds() if self.sealed_path(r).exists()][:-retention_rounds]
        else:
            return {}
        doomed = {}
        for r in candidates:
            if committed_through is not None and r > committed_through:
                continue
            round_dir = self._round_dir(r)
            doomed[r] = [bytes.fromhex(p.stem) for p in round_dir.glob("*.env")]
            if forget_blob is not None:
                for digest in doomed[r]:
                    forget_blob(digest.hex())
                for served in round_dir.glob("*.slice"):  # the sliced exchange's blobs, served too
                    forget_blob(served.stem)
                for served in round_dir.glob("*.partial"):
                    forget_blob(served.stem)
            trash = round_dir.with_name(TRASH_PREFIX + round_dir.name)
            round_dir.rename(trash)
            shutil.rmtree(trash, ignore_errors=True)
        return doomed
