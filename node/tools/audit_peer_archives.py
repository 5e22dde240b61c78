"""What ``audit LINK --reexecute`` reruns from when it has no ``--archive``: the run's peers (a seeder, the
nodes), read through the audit's :class:`node.tools.evidence.PeerFetcher` with
:class:`node.tools.audit_archives.AuditArchives`' interface, so that :class:`node.tools.audit_reexec.
ReexecAuditor` reruns from them as from a node's files (issue 80 point 1).

* **The rounds' lists** are the ones the audit's round checks verified against each commit's
  ``contributionsRoot`` (a round whose list or envelopes did not verify has none here, and its reruns say so);
* **envelopes, start states and evidence** are fetched by their sha256 (the blob protocol checks the bytes;
  they are checked again here); a seeder serves them (node/commands/seeder.py);
* **the exclusions of round t-1** (screened contributions, contributions built on another result), which the
  rerun of round t needs to rebuild its start and which only the nodes' own ``round.json`` lists: no message
  of the run carries them (the ``close`` gossip lists what a stage aggregated, not what it left out). They are
  taken from the audit's own replay of round t-1, which re-derives every exclusion from the contributions,
  the run's held-out data and the replayed weights (node/tools/audit_replay.py), and only when that replay
  reproduced the committed weights root: then they are the ones the run applied, whoever serves the files. A
  round whose replay did not reproduce has no known exclusions, and the rerun of the next round says why;
* **not available through peers**: a stage its close left out and its signer kept (``left_out_own``, a node's
  own files only) and a sliced run's partials and slice bundles (their reruns say which input is missing).
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

logger = logging.getLogger(__name__)

#: Envelopes kept in memory between reruns (each rerun of round t reads every envelope of rounds t and t-1).
MAX_CACHED_BYTES = 256 << 20


class PeerArchives:
    """The audit's verified round lists, the replay's exclusions and the peers' blobs (module docstring)."""

    #: what a rerun's item says when an input is missing (ReexecAuditor.check)
    no_contributions = ("the run's peers did not serve every stage's contribution of it (or its round's list "
                        "did not verify against the chain; a stage its close left out is kept only in its "
                        "signer's own files: pass --archive)")
    no_start_state = "the run's peers did not serve its start state (a seeder serves what its nodes kept)"
    where = "what the run's peers served (verified against the chain)"

    def __init__(self, fetcher: Any, report: Any, replayer: Any, run_id: int) -> None:
        self.fetcher = fetcher
        self.run_id = run_id
        self.dirs: list = []
        self._verdicts = {v.round: v for v in report.rounds}
        self._sealed = {v.round: sorted([c.stage, c.replica, c.peer_id, c.envelope] for c in v.contributors)
                        for v in report.rounds if v.contributors}
        self._replayer = replayer
        self._cache: dict[str, bytes] = {}
        self._cached = 0

    def sealed(self) -> dict[int, list[list]]:
        """round -> [[stage, replica, peer id, hash hex], ...]: each committed round whose list the audit
        verified against the chain."""
        return {r: [list(e) for e in entries] for r, entries in self._sealed.items()}

    def exclusions_unknown(self, round_index: int) -> str:
        """Why round ``round_index``'s exclusions are not known here ("" when they are: the audit's replay of
        the round reproduced its committed weights root)."""
        if round_index in getattr(self._replayer, "exclusions", {}):
            return ""
        verdict = self._verdicts.get(round_index)
        replayed = next((c for c in verdict.checks if c.name == "weights root (replay)"), None) \
            if verdict is not None else None
        why = "the round was not audited" if verdict is None else \
            "it was not replayed" if replayed is None else \
            f"its replay is {replayed.status}" + (f": {replayed.reason}" if replayed.reason else "")
        return (f"round {round_index}'s exclusions (which the next round's start needs) are known only from "
                f"the audit's replay of it, and {why}")

    def excluded(self, round_index: int) -> list[list]:
        """[[stage, replica, peer id, hash hex, reason, detail], ...] the audit's replay re-derived."""
        return [list(e) for e in getattr(self._replayer, "exclusions", {}).get(round_index, [])]

    def left_out_own(self, round_index: int) -> list[list]:
        return []  # a node's own files only (module docstring)

    def _fetch(self, hash_hex: str, cache: bool) -> bytes | None:
        if hash_hex in self._cache:
            return self._cache[hash_hex]
        data = self.fetcher.fetch(hash_hex)
        if data is None or hashlib.sha256(data).hexdigest() != hash_hex:
            return None
        if cache and self._cached + len(data) <= MAX_CACHED_BYTES:
            self._cache[hash_hex] = data
            self._cached += len(data)
        return data

    def envelope(self, round_index: int, hash_hex: str) -> bytes | None:
        return self._fetch(hash_hex, cache=True)

    def blob(self, hash_hex: str) -> bytes | None:
        return self._fetch(hash_hex, cache=False)

    def round_blobs(self, round_index: int, suffix: str) -> list[bytes]:
        return []  # a sliced run's partials: a node's files only (module docstring)

    def round_blob(self, round_index: int, hash_hex: str, suffix: str) -> bytes | None:
        return self._fetch(hash_hex, cache=False)

    def refused(self, hash_hex: str) -> list[str]:
        return []  # the blob protocol refuses bytes that do not hash to what was asked

    def why_missing(self, hash_hex: str) -> str:
        """Why the peers gave no copy of ``hash_hex`` (the fetcher's last error), for the rerun's item."""
        return self.fetcher.errors.get(hash_hex, "")
