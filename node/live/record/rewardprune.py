"""A running node prunes the reward sources it keeps (issue 77; docs/REWARDS.md "Where a contribution's proof
comes from").

A node of a normed run writes each round's stage leaves and factors to ``<data_dir>/rewards/`` (about 1 KB a
round and held stage, node/store/rewardsources.py) so that its contributions can be claimed once final. Where
the run has a reward pool, the node removes those no claim and no contribution case can use any more (the
rule of :func:`node.store.rewardsources.prune_sources`, as ``dlx-node rewards --prune`` applies it), so its
disk stays bounded by the rounds still owed; where it has none, nothing changes (nothing is paid from them,
and an audit or a case may still read them). The node finds the run's pools from the chain
(ledger/poolfind.py: ``PoolCreated`` events of the run from a contract holding the committed RewardPool
build that reads this run's ledger), since a run link names only the ledger.

Each round the committer handles earns a look at :data:`ROUNDS_A_PASS` kept rounds (the next ones after the
last pass, round-robin), so a pass costs a bounded number of chain reads however long the run; its chain
reads take the node's chain lock one call at a time, never across the pass. :class:`PassSchedule` says when:
as soon as the committer has no round waiting, else once :data:`PASS_WAITS_AT_MOST` rounds were handled
without one (a pass then looks at what they earned). Passes made only while the committer is idle starved:
a committer that runs one round behind its training (a round always waiting, seen on an idle 2-core machine
with 1.5 s rounds) made none, and a claimed round's files stayed for as long as the run lasted. With the
look earned per handled round the round-robin goes round however busy the committer is: a round's files are
looked at again within ``kept / (ROUNDS_A_PASS - 1)`` handled rounds (``kept`` rounds of files, growing one a
round while none can go).
"""

from __future__ import annotations

import logging
import re
import threading
from pathlib import Path

from ledger.errors import LedgerError
from node.errors import DLX_ERRORS

logger = logging.getLogger(__name__)

#: Rounds whose kept files one pass looks at, per round handled (their chain reads: a few per round and listed
#: contribution).
ROUNDS_A_PASS = 4
#: Rounds the committer handles with a round waiting before it makes the pass they owe anyway.
PASS_WAITS_AT_MOST = 4
_ROUND_OF_FILE = re.compile(r"round-(\d{8})-(?:stage-\d{1,6}|leaves)\.json")


class _OneCallAtATime:
    """``target``'s methods, each call holding ``lock`` (the node's chain lock: web3 sessions are not shared
    across threads safely), never across calls."""

    def __init__(self, target, lock: threading.Lock):
        self._target, self._lock = target, lock

    def __getattr__(self, name: str):
        value = getattr(self._target, name)
        if not callable(value):
            return value

        def locked(*args, **kwargs):
            with self._lock:
                return value(*args, **kwargs)

        return locked


class PassSchedule:
    """When the committer makes a pass (module docstring): :meth:`handled` after each round it handled."""

    def __init__(self, waits_at_most: int = PASS_WAITS_AT_MOST):
        self.waits_at_most = max(1, waits_at_most)
        self.owed = 0  # rounds handled since the last pass

    def handled(self, idle: bool) -> int:
        """A round was handled (``idle``: no round waits); how many rounds' passes to make now (0: none)."""
        self.owed += 1
        if not idle and self.owed < self.waits_at_most:
            return 0
        owed, self.owed = self.owed, 0
        return owed


class RewardSourcePruner:
    """Prunes ``<directory>/rewards/`` of run ``run_id`` against the pools ``finder`` (a
    ledger.poolfind.PoolFinder) finds; ``reader``: a LedgerClient; ``lock``: held for each chain read."""

    def __init__(self, directory: Path, reader, run_id: int, finder, lock: threading.Lock | None = None,
                 rounds_a_pass: int = ROUNDS_A_PASS):
        self.directory, self.run_id, self.finder = Path(directory), run_id, finder
        self.lock = lock if lock is not None else threading.Lock()
        self.reader = _OneCallAtATime(reader, self.lock)
        self.rounds_a_pass = max(1, rounds_a_pass)
        self.after = -1  # the last round a pass looked at
        self.removed = 0  # files removed in this life

    @classmethod
    def for_node(cls, cfg, chain, run_id: int) -> RewardSourcePruner | None:
        """The pruner of a node (``cfg``: its NodeConfig; ``chain``: its NodeChain); None where its run keeps
        no reward sources (a run whose factors bind no contribution to a member)."""
        from ledger.poolfind import PoolFinder

        if not cfg.commitment_scheme.proves_factors:
            return None
        client = chain.client
        start = chain.run_info(run_id).block_number
        finder = PoolFinder(client.w3, client.ledger_address, run_id, start, client.log_page_blocks,
                            client.sender.rpc)
        return cls(cfg.path("."), client, run_id, finder, chain.rpc_lock)

    def kept_rounds(self) -> list[int]:
        """The rounds of which files are kept now."""
        folder = self.directory / "rewards"
        names = [path.name for path in folder.iterdir()] if folder.is_dir() else []
        return sorted({int(m[1]) for name in names if (m := _ROUND_OF_FILE.fullmatch(name))})

    def after_round(self, rounds_handled: int = 1) -> list[str]:
        """One bounded pass (module docstring) over ``rounds_handled`` x ``rounds_a_pass`` kept rounds; the
        names removed. A chain that does not answer, or answers wrong, skips the pass (logged): the files
        stay until a later one."""
        from ledger.rewards import RewardPoolClient
        from node.store.rewardsources import prune_sources

        kept = self.kept_rounds()
        if not kept:
            return []
        try:
            with self.lock:
                pools = self.finder.scan()
            if not pools:
                return []  # no pool: nothing changes
            size = self.rounds_a_pass * max(1, rounds_handled)
            batch = [r for r in kept if r > self.after][:size]
            if len(batch) < size:  # wrap around
                batch += [r for r in kept if r not in batch][: size - len(batch)]
            clients = [_OneCallAtATime(RewardPoolClient(self.reader.w3, None, address), self.lock)
                       for address in pools]
            removed = prune_sources(self.directory, clients, self.reader, self.run_id, rounds=set(batch))
        except (*DLX_ERRORS, LedgerError) as exc:
            logger.warning("reward sources not pruned this round (kept): %s", exc)
            return []
        self.after = batch[-1]  # the next pass goes on after it (the wrapped part's last, if it wrapped)
        if removed:
            self.removed += len(removed)
            logger.info("pruned %d reward source file(s) no claim or case can use any more: %s", len(removed),
                        ", ".join(removed))
        return removed
