"""What a node keeps so that its contributions can be paid (issue 77; docs/REWARDS.md, "Where a contribution's
proof comes from").

A listed contribution is claimed from a run's reward pool with the round's stage leaves (its stage's leaf and
the Merkle path to the record's ``weightsRoot``) and the stage's version-3 factors, which list it. Neither is
on chain, and the node's published stage states (node/live/fraud/chunkstate.py) are dropped once the round's
proof window closes, before the round can pay (a round pays only once final). So a node writes them here, in
``<data_dir>/rewards/``, as it derives them, and keeps them (about 1 KB a round and held stage):

* ``round-<t>-stage-<s>.json``: its stage leaf and factors of each held stage (``ChunkedStates.record``);
* ``round-<t>-leaves.json``: every stage's leaf of the record it derived (the committer), so a node holding
  one stage of several still has the path.

:func:`prune_sources` removes a round's files once no claim can use them any more (bounded disk): a stage's
file once every contribution it lists is claimed, forfeited (its account convicted) or pays nothing, and
every file of a round the pool will never pay again (before the pool's first round, overturned, or swept);
never while a contribution case of the round or the next can still read them. ``dlx-node rewards --prune``
runs it, and so does a running node whose run has a pool (node/live/record/rewardprune.py).

:func:`read_sources` reads them back from any node directories and keeps only what the chain's record of the
round vouches for (the leaves' root is its ``weightsRoot``, the factors' sha256 its stage leaf's
``factorsHash``): ``round -> (stage leaves, factors per stage or None)``, what ``ledger.rewardstatement``
takes as ``sources``. A file that does not parse, or that the chain does not vouch for, is skipped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path

from node.fsutil import atomic_write_bytes

logger = logging.getLogger(__name__)

REWARD_SOURCES_DIR = "rewards"
_STAGE_FILE = re.compile(r"round-(\d{8})-stage-(\d{1,6})\.json")
_LEAVES_FILE = re.compile(r"round-(\d{8})-leaves\.json")


def _write(directory: Path, name: str, value: dict, what: str) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(directory / name, json.dumps(value).encode())
    except OSError as exc:  # never stops the round: the contribution is then claimable only from a peer's
        logger.warning("%s not kept for its reward claim: %s", what, exc)


def write_stage(directory: Path, outer_round: int, stage: int, leaf: bytes, factors: bytes) -> None:
    """Keep this node's stage leaf and factors of ``stage`` after ``outer_round``."""
    _write(directory, f"round-{outer_round:08d}-stage-{stage}.json",
           {"round": outer_round, "stage": stage, "leaf": leaf.hex(), "factors": factors.hex()},
           f"round {outer_round} stage {stage}'s factors")


def write_leaves(directory: Path, outer_round: int, leaves: list[bytes]) -> None:
    """Keep every stage's leaf of the record this node derived for ``outer_round``."""
    _write(directory, f"round-{outer_round:08d}-leaves.json",
           {"round": outer_round, "leaves": [leaf.hex() for leaf in leaves]},
           f"round {outer_round}'s stage leaves")


def _load(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _scan(directories) -> tuple[dict, dict]:
    """(round -> [candidate leaf lists], round -> stage -> {leaf bytes: factors bytes}) from the files."""
    lists: dict[int, list[list[bytes]]] = {}
    stages: dict[int, dict[int, dict[bytes, bytes]]] = {}
    for directory in directories:
        folder = Path(directory) / REWARD_SOURCES_DIR
        for path in sorted(folder.glob("round-*.json")) if folder.is_dir() else []:
            value = _load(path)
            try:
                if (match := _STAGE_FILE.fullmatch(path.name)) and value is not None:
                    by_leaf = stages.setdefault(int(match[1]), {}).setdefault(int(match[2]), {})
                    by_leaf[bytes.fromhex(value["leaf"])] = bytes.fromhex(value["factors"])
                elif (match := _LEAVES_FILE.fullmatch(path.name)) and value is not None:
                    lists.setdefault(int(match[1]), []).append([bytes.fromhex(h) for h in value["leaves"]])
            except (KeyError, TypeError, ValueError):
                logger.warning("%s: not a reward source; skipped", path)
    return lists, stages


def read_sources(directories, reader, run_id: int) -> dict[int, tuple[list[bytes], list[bytes | None]]]:
    """What node ``directories`` kept, checked against the chain (``reader``: a LedgerClient): round ->
    (every stage leaf, each stage's factors or None where none kept matches its leaf)."""
    from eth_abi.exceptions import DecodingError

    from ledger.chunkproof import StageLeaf, chunked_weights_root
    from ledger.errors import LedgerError

    lists, stages = _scan(directories)
    sources = {}
    for r in sorted(set(lists) | set(stages)):
        commit = reader.commit_of(run_id, r)
        if commit is None:
            continue
        held = stages.get(r, {})
        candidates = list(lists.get(r, []))
        if held and all(len(held.get(s, {})) == 1 for s in range(max(held) + 1)):
            candidates.append([next(iter(held[s])) for s in range(max(held) + 1)])
        for leaves in candidates:
            try:
                parsed = [StageLeaf.decode(leaf) for leaf in leaves]
                if chunked_weights_root(parsed) != commit.weights_root:
                    continue
            except (LedgerError, DecodingError, ValueError, OverflowError):
                continue
            factors = []
            for s, leaf in enumerate(parsed):
                kept = held.get(s, {}).get(leaves[s])
                factors.append(kept if kept is not None and hashlib.sha256(kept).digest() == leaf.factors_hash
                               else None)
            sources[r] = (leaves, factors)
            break
    return sources


def prune_sources(directory, pool, reader, run_id: int, rounds=None) -> list[str]:
    """Remove what ``<directory>/rewards/`` keeps that no claim of run ``run_id``'s pool (``pool``: a
    RewardPoolClient, or a list of them: what every one of them is done with; ``reader``: a LedgerClient) and
    no contribution case can use any more; the names removed. ``rounds``: only those rounds' files (None:
    all).

    A round's files all go once the pool will never pay the round again: before its first round, overturned
    (never final) or swept (its claim window closed and its remainder returned). Before that, a stage's file
    goes once every contribution its factors list is claimed (``claimedOf``), forfeited (the account
    convicted) or pays nothing by the rule, and the round's leaves file once the files of every stage of the
    round were here and all went. A round not overturned is kept until the next round is final (or, the
    run's last round, itself): a contribution case of a round reads the round's and the previous round's
    files (node/commands/challenge.py) while its proof window is open. A round not committed yet, or a file
    that does not parse, is kept."""
    pools = list(pool) if isinstance(pool, list | tuple) else [pool]
    done = None
    for one in pools:
        paths = set(_prunable(Path(directory) / REWARD_SOURCES_DIR, one, reader, run_id, rounds))
        done = paths if done is None else done & paths
    removed = []
    for path in sorted(done or ()):
        try:
            path.unlink()
        except OSError as exc:
            logger.warning("%s: not pruned: %s", path, exc)
            continue
        removed.append(path.name)
    return removed


def _prunable(folder: Path, pool, reader, run_id: int, rounds) -> list[Path]:
    """The files of ``folder`` no claim of ``pool`` and no contribution case can use
    (:func:`prune_sources`)."""
    if not folder.is_dir():
        return []
    by_round: dict[int, list[tuple[Path, int | None]]] = {}
    for path in sorted(folder.glob("round-*.json")):
        if match := _STAGE_FILE.fullmatch(path.name):
            by_round.setdefault(int(match[1]), []).append((path, int(match[2])))
        elif match := _LEAVES_FILE.fullmatch(path.name):
            by_round.setdefault(int(match[1]), []).append((path, None))
    if rounds is not None:
        by_round = {r: files for r, files in by_round.items() if r in rounds}
    if not by_round:
        return []
    view = pool.pool_of(run_id)
    run = reader.run_struct(run_id)
    invalid_from, max_rounds = run["invalidFrom"], run["maxRounds"]
    committed = reader.commit_count(run_id)
    prunable = []
    for r, files in sorted(by_round.items()):
        if r >= committed:
            continue
        overturned = invalid_from != 0 and r + 1 >= invalid_from
        if not overturned and not _cases_over(reader, run_id, r, committed, max_rounds):
            continue
        over = overturned or r < view["firstRound"] or pool.round_of(run_id, r)["swept"]
        stages = {stage: over or _stage_done(path, pool, reader, run_id, r, stage, view)
                  for path, stage in files if stage is not None}
        leaves_done = over or (len(stages) == view["numStages"] and all(stages.values()))
        prunable.extend(path for path, stage in files if (leaves_done if stage is None else stages[stage]))
    return prunable


def _cases_over(reader, run_id: int, r: int, committed: int, max_rounds: int) -> bool:
    """Whether no contribution case of round ``r`` or ``r + 1`` can still be opened: ``r + 1`` final (it and
    its parent past their proof windows), or ``r`` final where it is the run's last round."""
    if max_rounds and r + 1 == max_rounds:
        return reader.is_final(run_id, r)
    return r + 1 < committed and reader.is_final(run_id, r + 1)


def _stage_done(path: Path, pool, reader, run_id: int, r: int, stage: int, view: dict) -> bool:
    """Whether every contribution the stage file ``path`` lists is claimed, forfeited or worth nothing."""
    from ledger.errors import LedgerError
    from ledger.rewards import contribution_share, listed_contributions

    value = _load(path)
    try:
        listed = listed_contributions(bytes.fromhex(value["factors"]))
    except (LedgerError, KeyError, TypeError, ValueError):
        return False
    for account, steps in listed:
        share = contribution_share(view["params"], view["numStages"], view["innerSteps"], len(listed), steps)
        if share == 0 or pool.claimed_of(run_id, r, stage, account):
            continue
        member = reader.member(run_id, account)
        if member is None or member.status != "slashed":
            return False
    return True
