"""What this node's case defender keeps on disk, so that a restarted node still defends the contributions it
made before (issue 78; docs/FRAUD_PROOF.md "The node defends its contributions").

A defense of this node's contribution to round ``t`` of a stage needs its state of round ``t - 1`` (the
committed start's weight chunk leaves) and, in a run with the plain end rule, the contribution's payload
pieces; a game in progress needs what the defender remembers of it (the step and the op its bisections
ended on: ``ledger.stepdefense.GameMemory``). The node's stage states are in memory or in spill files that a
restart drops (node/live/fraud/chunkstate.py), so the defender copies, for every round whose factors name this
node's account as a contributor, these into ``<data_dir>/case-defense/`` (:data:`DEFENSE_DIR`):

- ``round-<t>-stage-<s>.kept``: msgpack of the payload root, the start's weight chunk leaves and the
  contribution's codec blob with the stage's shapes (its pieces are cut from it again); nothing in it is
  trusted: the defender checks the leaves against the claim's ``startWeights`` and the pieces against the
  payload root before it uses them;
- ``claim-<t>-<s>-<claim id>.json``: each game's remembered step and op, written before the defender's move
  of a poll is sent.

Bounded: a round's files are removed once its proof window has closed (no case on it can open) and no defense
of it is still being played by this process. A file that does not read is treated as absent.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import msgpack

from node.fsutil import atomic_write_bytes
from ledger.stepdefense import GameMemory

logger = logging.getLogger(__name__)

#: The defender's directory under the node's data directory.
DEFENSE_DIR = "case-defense"
_KEPT = re.compile(r"round-(\d+)-stage-(\d+)\.kept")


@dataclass(frozen=True)
class KeptDefense:
    """What one contribution's defense needs, as kept on disk (unchecked: the defender checks it)."""

    round: int
    stage: int
    payload_root: bytes
    start: list[bytes]  # the start's weight chunk leaves (this node's state of round - 1)
    blob: bytes  # the contribution's codec blob (empty: not kept)
    shapes: dict  # the stage's tensor shapes, to cut the pieces from the blob

    def pieces(self):
        """The contribution's payload pieces (training.chunks.CutPayload), or None if no blob was kept or it
        does not cut."""
        from training.chunks import CutPayload

        if not self.blob:
            return None
        try:
            return CutPayload(self.blob, self.shapes)
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            logger.warning("round %d stage %d: the kept payload does not cut (%s)", self.round, self.stage,
                           exc)
            return None


class DefenseFiles:
    """The defender's files in ``directory`` (module docstring)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def _kept_path(self, outer_round: int, stage: int) -> Path:
        return self.directory / f"round-{outer_round:08d}-stage-{stage}.kept"

    def has(self, outer_round: int, stage: int) -> bool:
        return self._kept_path(outer_round, stage).is_file()

    def keep(self, outer_round: int, stage: int, payload_root: bytes, start: list[bytes], blob: bytes,
             shapes: dict) -> None:
        """Keep a defense's inputs (written whole or not at all)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        value = {"round": outer_round, "stage": stage, "payload_root": bytes(payload_root),
                 "start": [bytes(leaf) for leaf in start], "blob": bytes(blob),
                 "shapes": {name: list(shape) for name, shape in shapes.items()}}
        atomic_write_bytes(self._kept_path(outer_round, stage), msgpack.packb(value, use_bin_type=True))

    def kept(self, outer_round: int, stage: int) -> KeptDefense | None:
        """The kept inputs of round ``outer_round``'s contribution to ``stage``, or None."""
        path = self._kept_path(outer_round, stage)
        try:
            value = msgpack.unpackb(path.read_bytes(), raw=False)
            kept = KeptDefense(int(value["round"]), int(value["stage"]), bytes(value["payload_root"]),
                               [bytes(leaf) for leaf in value["start"]], bytes(value["blob"]),
                               {str(n): tuple(int(d) for d in s) for n, s in value["shapes"].items()})
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
            logger.warning("defense file %s unreadable (%s): not used", path.name, exc)
            return None
        return kept if (kept.round, kept.stage) == (outer_round, stage) else None

    def _claim_path(self, outer_round: int, stage: int, claim_id: bytes) -> Path:
        return self.directory / f"claim-{outer_round:08d}-{stage}-{bytes(claim_id).hex()}.json"

    def memories(self, outer_round: int, stage: int, claim_id: bytes) -> dict[bytes, GameMemory]:
        """The games' memories kept for claim ``claim_id`` on round ``outer_round``'s contribution to
        ``stage`` (empty if none)."""
        try:
            value = json.loads(self._claim_path(outer_round, stage, claim_id).read_text())
            return {bytes.fromhex(game): GameMemory(step, op) for game, (step, op) in value.items()}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, TypeError) as exc:
            logger.warning("defense memories of claim %s unreadable (%s)", bytes(claim_id).hex()[:12], exc)
            return {}

    def remember(self, outer_round: int, stage: int, claim_id: bytes,
                 memories: dict[bytes, GameMemory]) -> None:
        """Keep the games' memories of claim ``claim_id`` (on round ``outer_round``'s contribution to
        ``stage``)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        value = {game.hex(): [m.step, m.op] for game, m in memories.items()}
        atomic_write_bytes(self._claim_path(outer_round, stage, claim_id),  # survives a kill, not a power cut
                           json.dumps(value, sort_keys=True).encode(), durable=False)

    def rounds(self) -> list[tuple[int, int]]:
        """The ``(round, stage)`` pairs kept."""
        if not self.directory.is_dir():
            return []
        found = (_KEPT.fullmatch(p.name) for p in self.directory.iterdir())
        return sorted((int(m.group(1)), int(m.group(2))) for m in found if m)

    def drop(self, outer_round: int, stage: int) -> None:
        """Remove a round's kept inputs and its claims' memories."""
        self._kept_path(outer_round, stage).unlink(missing_ok=True)
        for path in self.directory.glob(f"claim-{outer_round:08d}-{stage}-*.json"):
            path.unlink(missing_ok=True)
