"""A factors challenge kept across lives of the node (issue 62; docs/FRAUD_PROOF.md, "The late game").

A node that challenged a round's withheld factors (``FACTORS``: node/live/fraud/factors.py) and then stops (a
crash, a restart) would lose the game: a coalition answering in the last block of the window wins when nobody
follows the answer. So the prover keeps what following it needs, beside the proofs it kept
(``proofs/games/<challenge id>.json``: the round's record, its committed stage leaves and its parent's, as the
values proof needs them) and the next life resumes it (:meth:`KeptGames._resume_games`): it follows the answer
to what the factors alone prove (the run's values, the binding), as for a round of other contributions, since
it no longer holds this life's state of the round. The file goes once the challenge is followed, or the round
is overturned. A walk of a withheld state or sum tree needs this life's state of the round: it is not kept
(the re-entry waits for it instead, node/live/peers/lifecycle.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging

from ledger.chunkproof import hexed, unhexed
from ledger.records import RoundRecord
from node.fraudproof import parse_stage_leaf
from node.fsutil import atomic_write_bytes
from training.jsonbound import loads_bounded

logger = logging.getLogger("node.live.fraud.prover")

#: The deepest nesting a kept game or proof file may have (a proof nests a few levels; deeper is refused
#: before decoding: training/jsonbound.py says why).
KEPT_DEPTH = 16
#: Where the kept games are, under the prover's proofs directory.
GAMES_DIR = "games"


class KeptGames:
    """The kept factors challenges of :class:`node.live.fraud.prover.FraudProver` (module docstring); the
    prover holds the state (``proofs_dir``, ``_factor_opens``, ``_parents``, ``_pending``, ``_foreign``,
    ``log``) and the hooks (``overturned``, ``_remember``, ``_ensure_settling``)."""

    def _keep_game(self, outer_round: int, challenge_id: bytes) -> None:
        """Keep the factors challenge ``challenge_id`` of ``outer_round`` (nothing for another challenge)."""
        opened, parent = self._factor_opens.get(challenge_id), self._parents.get(outer_round)
        if opened is None or parent is None or self.proofs_dir is None:
            return
        stage, record, leaves = opened[:3]
        document = {"round": outer_round, "stage": stage, "record": _record_json(record),
                    "leaves": hexed(list(leaves)), "parent_leaves": hexed(list(parent[1])),
                    "parent_record": None if parent[0] is None else _record_json(parent[0])}
        try:
            (self.proofs_dir / GAMES_DIR).mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(self.proofs_dir / GAMES_DIR / f"{challenge_id.hex()}.json",
                               json.dumps(document, sort_keys=True).encode())
        except OSError as exc:
            logger.warning("round %d: the factors challenge was not kept on disk: %s", outer_round, exc)

    def _forget_game(self, challenge_id: bytes) -> None:
        if self.proofs_dir is not None:
            (self.proofs_dir / GAMES_DIR / f"{challenge_id.hex()}.json").unlink(missing_ok=True)

    def _resume_games(self) -> None:
        """Follow again the factors challenges an earlier life kept (module docstring)."""
        if self.proofs_dir is None or not (self.proofs_dir / GAMES_DIR).is_dir():
            return
        resumed = False
        for path in sorted((self.proofs_dir / GAMES_DIR).glob("*.json")):
            try:
                challenge_id = bytes.fromhex(path.stem)
                document = loads_bounded(path.read_bytes(), KEPT_DEPTH)
                outer_round, stage = int(document["round"]), int(document["stage"])
                record = RoundRecord(*unhexed(document["record"]))
                leaves = [bytes(leaf) for leaf in unhexed(document["leaves"])]
                parent = document["parent_record"]
                parent = (None if parent is None else RoundRecord(*unhexed(parent)),
                          [bytes(leaf) for leaf in unhexed(document["parent_leaves"])])
                leaf = parse_stage_leaf(leaves[stage], stage)
            except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
                logger.warning("a kept factors challenge %s is not read: %s", path.name, exc)
                continue
            if len(challenge_id) != 32 or self.overturned(outer_round):
                path.unlink(missing_ok=True)
                continue
            logger.warning("round %d stage %d: following the factors challenge %s an earlier life opened",
                           outer_round, stage, challenge_id.hex()[:12])
            with self._lock:
                self._parents[outer_round] = parent
                self._factor_opens[challenge_id] = (stage, record, leaves, leaf, None)
                self._pending[challenge_id] = outer_round
                self._foreign.add(outer_round)  # no own state of the round here: what the factors alone show
                self.log.wrong[outer_round] = f"stage {stage}: its committed factors are challenged"
            self.log.challenges[outer_round] = challenge_id
            self._remember(outer_round, leaves)
            resumed = True
        if resumed:
            self._ensure_settling()


def _record_json(record: RoundRecord) -> list:
    return hexed(list(dataclasses.astuple(record)))
