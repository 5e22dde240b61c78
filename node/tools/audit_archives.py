"""The node data directories an audit reads (``--archive``): sealed rounds, envelopes, blobs and evidence.

Everything read here is checked against its content hash before use; a file named for a hash whose bytes do
not hash to it is never read (:meth:`AuditArchives.refused` lists them). Split from
:mod:`node.tools.audit_reexec`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from p2p.blobpack import read_packed
from training.jsonbound import loads_bounded


class AuditArchives:
    """Sealed rounds, envelopes, blobs and evidence found under the given node data directories."""

    def __init__(self, dirs, run_id: int) -> None:
        self.dirs = [Path(d) for d in dirs]
        self.run_id = run_id

    def _round_dirs(self, round_index: int, sealed: bool = True):
        """Each archive's directory of the round: those that sealed it, or (``sealed=False``) every one."""
        for d in self.dirs:
            path = d / "archive" / f"run-{self.run_id}" / f"round-{round_index:08d}"
            if (path / "round.json").exists() or (not sealed and path.is_dir()):
                yield path

    def sealed(self) -> dict[int, list[list]]:
        """round -> [[stage, replica, peer id, hash hex], ...]: every archive's sealed entries, merged.

        A node of a split cluster seals only the stages it holds, so a replica's contributions of a
        round are spread over its stage holders' archives: each round's list is the union of every
        archive's, whatever the order of ``--archive`` (the audit's contributions item checks the
        lists against the committed root).
        """
        out: dict[int, set[tuple]] = {}
        for d in self.dirs:
            for path in sorted((d / "archive" / f"run-{self.run_id}").glob("round-*/round.json")):
                try:
                    doc = _read_json(path)
                    entries = {(int(s), int(r), str(p), str(h).lower())
                                   for s, r, p, h in doc["contributions"]}
                    out.setdefault(int(doc["round"]), set()).update(entries)
                except (ValueError, KeyError, TypeError, OSError):
                    continue
        return {r: [list(e) for e in sorted(entries)] for r, entries in out.items()}

    def excluded(self, round_index: int) -> list[list]:
        """The round's excluded entries from every archive that sealed it, merged."""
        merged: list[list] = []
        for path in self._round_dirs(round_index):
            try:
                for entry in _read_json(path / "round.json").get("excluded", []):
                    if list(entry) not in merged:
                        merged.append(list(entry))
            except (ValueError, OSError, AttributeError, TypeError):
                continue
        return merged

    def left_out_own(self, round_index: int) -> list[list]:
        """The round's contributions their signers kept though its close left them out, merged: [[stage,
        replica, peer id, hash hex], ...]: ``left_out_own`` of each archive that sealed it, and the
        own-contribution markers (``<hash>.own``, node/store/archive.py) of each archive that holds the round,
        sealed or not (a node killed after it sent the round's contributions and before it sealed the round,
        which the others committed while it was down: the 60-minute soak's round 26). The caller takes an
        entry only for a stage no close named, and only if its envelope is the replica's own signed
        contribution of that round and stage."""
        merged: list[list] = []

        def add(stage, replica, peer, hash_hex) -> None:
            entry = [int(stage), int(replica), str(peer), str(hash_hex).lower()]
            if entry not in merged:
                merged.append(entry)

        for path in self._round_dirs(round_index):
            try:
                for stage, replica, peer, hash_hex in _read_json(path / "round.json").get(
                        "left_out_own", []):
                    add(stage, replica, peer, hash_hex)
            except (ValueError, OSError, AttributeError, TypeError, OverflowError, RecursionError):
                continue
        for path in self._round_dirs(round_index, sealed=False):
            for marker in sorted(path.glob("*.own")):
                try:
                    stage, replica, peer = _read_json(marker)
                    bytes.fromhex(marker.stem)
                    add(stage, replica, peer, marker.stem)
                except (ValueError, OSError, TypeError, OverflowError, RecursionError):
                    continue  # a marker only points at an envelope, which the caller checks
        return merged

    def envelope(self, round_index: int, hash_hex: str) -> bytes | None:
        """The envelope of that sha256 from any archive that holds the round (sealed or not), checked."""
        for path in self._round_dirs(round_index, sealed=False):
            candidate = path / f"{hash_hex}.env"
            if candidate.exists() and hashlib.sha256(candidate.read_bytes()).hexdigest() == hash_hex:
                return candidate.read_bytes()
        return None

    def round_blobs(self, round_index: int, suffix: str) -> list[bytes]:
        """Every archive's ``*.<suffix>`` blobs of a round (the sliced exchange's partials), unchecked."""
        return [path.read_bytes() for d in self._round_dirs(round_index)
                for path in sorted(d.glob(f"*.{suffix}"))
                if path.is_file()]

    def round_blob(self, round_index: int, hash_hex: str, suffix: str) -> bytes | None:
        """A round's ``<hash_hex>.<suffix>`` (a slice bundle) from any archive that holds it, checked."""
        for d in self._round_dirs(round_index):
            candidate = d / f"{hash_hex}.{suffix}"
            if candidate.is_file():
                data = candidate.read_bytes()
                if hashlib.sha256(data).hexdigest() == hash_hex:
                    return data
        return None

    def _named(self, hash_hex: str):
        for d in self.dirs:
            yield from (d / "blobs" / hash_hex, *(d / "evidence").glob(f"*{hash_hex}.envelope"),
                        d / "evidence" / f"state-{hash_hex}.part")

    def blob(self, hash_hex: str) -> bytes | None:
        """A blob by content hash from any archive's blob store (a file, or a packed blob: a node's own start
        states, p2p/blobpack.py) or evidence directory (checked)."""
        for candidate in self._named(hash_hex):
            if candidate.is_file():
                data = candidate.read_bytes()
                if hashlib.sha256(data).hexdigest() == hash_hex:
                    return data
        for d in self.dirs:
            data = read_packed(d / "blobs", hash_hex)
            if data is not None:
                return data
        return None

    def refused(self, hash_hex: str) -> list[str]:
        """The archived files named for ``hash_hex`` whose bytes do not hash to it (tampered: never read)."""
        return [str(path) for path in self._named(hash_hex)
                if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() != hash_hex]


def _read_json(path) -> object:
    """An archive's JSON file (a round.json, an own-contribution marker: 3 levels deep), refused (ValueError)
    past 8 levels before it is decoded: training/jsonbound.py says why."""
    return loads_bounded(path.read_bytes(), 8)
