"""The chain side of each finished round: sign the record, gather a quorum, commit, verify, dispute.

Runs on its own thread so chain latency never stalls training. Rounds are
handled in order (the chain takes round t only right after round t-1). For
round t every node:

1. waits for attestations covering every stage (its own included);
2. derives the round record: ``weights_root`` over the stage weight hashes (version 1) or, in a
   chunked run, over the attested stage leaves (version 2: docs/FRAUD_PROOF.md),
   ``contributions_root`` (Merkle root of every aggregated envelope hash in
   canonical order), mean losses, tokens, number of contributors;
3. on checkpoint rounds assembles the full checkpoint from the stage shards
   (node/live/record/checkpointbuild.py) (every node builds the same bytes, so every node can serve it) and
   puts its content hash in the record;
4. once round t-1 is on chain, completes the record with the chain head
   (``prev_head``), signs it with its Ethereum key (EIP-712, docs/LEDGER.md),
   at most one record per round in any life, and gossips the signature;
5. waits for the run's quorum ``k`` of member signatures over one record, then
   submits it if it is first in the round's committer rotation, or if the
   previous committers left the round uncommitted for a grace period each;
6. reads the round back from the chain (node/live/chain/readback.py); in a chunked run a wrong committed
   weights root is proven on chain (node/live/fraud/prover.py); if the committed roots differ from
   what it computed itself, node/live/record/forkrepair.py files a dispute with its
   own signed record when its own result stood, and the node re-bases on the
   chain's record: the quorum's record is the run's history, and weights that
   left it would only make every later round of this node's disagree too.

A member seen signing two different records of one round is reported on chain
(``reportEquivocation``), which slashes its stake.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from ledger.chain import OUTAGE
from ledger.errors import (ChainUnavailable, TransactionTimeout)
from ledger.merkle import merkle_root
from ledger.records import RoundRecord, to_micro
from node.config import NodeConfig
from node.errors import DLX_ERRORS
from node.fsutil import retry_on_full_disk
from node.live.record.checkpointbuild import CheckpointBuilder
from node.live.state.closesteps import record_tokens
from node.live.exchange.coordination import RoundCoordinator
from node.live.record.forkrepair import ForkRepair
from node.live.peers.membership import Membership
from node.live.chain.onchain import NodeChain
from node.live.state.roundbook import RoundBook
from node.live.state.status import Progress, StateFile
from node.live.checks.verifier import SpotChecker
from node.store.checkpoint import RunLayout
from node.store.rewardsources import REWARD_SOURCES_DIR, write_leaves
from p2p.host import P2PHost
from node.live.fraud.prover import FraudProver
from node.live.chain.readback import EquivocationReports, ReadBack
from node.live.record.quorumcommit import QuorumCommit, WAIT_REPORT_S
from node.live.record.rewardprune import PassSchedule, RewardSourcePruner

logger = logging.getLogger(__name__)

#: While waiting for a round's attestations, the chain is asked this often whether the round is committed.
ON_CHAIN_CHECK_S = 15.0
#: What :meth:`Committer._attestations` returns for a round the chain holds while some stage's
#: attestations never reached this node.
ON_CHAIN = "on chain"
#: A round whose chain step met an unreachable RPC is tried again after this, doubling up to the max.
CHAIN_RETRY_MIN_S = 1.0
CHAIN_RETRY_MAX_S = 15.0


@dataclass
class CommitterContext:
    """What the committer reads and whom it tells (it never sees the whole node).

    Once this node derived a round's record (and committed it, if it was its turn) it shows in
    ``progress`` and ``state`` and the ``spot_checks`` draw their checks of it; once the round is
    read back from the chain, ``progress.last_commit``; when the committed roots of a round differ
    from this node's, ``forks.diverged`` (else ``forks.agreed``).
    """

    cfg: NodeConfig
    run_id: int
    peer_id: str
    book: RoundBook
    chain: NodeChain
    host: P2PHost
    coordinator: RoundCoordinator
    membership: Membership
    checkpoint_dir: Path
    incoming_dir: Path
    stop_event: threading.Event
    state: StateFile
    gossip: Callable[..., bytes]  # gossip(round, kind, message) signs and publishes a run message
    layout: RunLayout  # the run document's checkpoint metadata and stage tensors
    progress: Progress
    spot_checks: SpotChecker
    forks: ForkRepair  # a committed record that differs from this node's: dispute, re-base
    # a chunked run's: proves a committed round wrong on chain (node/live/fraud/prover.py)
    fraud: FraudProver | None = None

    def on_recorded(self, outer_round: int, weights_root: bytes, committed_by_me: bool) -> None:
        self.progress.weights_root = weights_root.hex()
        self.state.record_round(outer_round, weights_root, committed_by_me)
        self.spot_checks.on_recorded(outer_round, weights_root)

    def on_confirmed(self, outer_round: int) -> None:
        self.progress.last_commit = max(self.progress.last_commit, outer_round)


class Committer(QuorumCommit):
    """The committer thread of one node (see module docstring)."""

    def __init__(self, node: CommitterContext) -> None:
        self.node = node
        self.checkpoints = CheckpointBuilder(node)
        self._queue: queue.Queue[int | None] = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        # Every round up to this one has been handled: committed, found committed, or given up for good (its
        # attestations never came before a stop); a round whose step met a full disk is not, until it was
        # tried again. The finisher keeps what the rounds after it need until then.
        self.handled_through = -1
        self.readback = ReadBack(node, self.checkpoints, self._wait)
        self.equivocations = EquivocationReports(node)
        # a run with a reward pool: its kept reward sources pruned once no claim can use them (issue 77);
        # built at its first pass (it reads the chain), None where the run keeps no sources; a pass each few
        # rounds handled (rewardprune.PassSchedule)
        self.reward_pruner: RewardSourcePruner | None = None
        self._pruner_built = False
        self._prune_schedule = PassSchedule()
        self._thread = threading.Thread(target=self._loop, name="committer", daemon=True)
        self._thread.start()

    def submit(self, outer_round: int) -> None:
        self._idle.clear()
        self._queue.put(outer_round)

    def drain(self, timeout: float) -> bool:
        """Wait until every submitted round is handled.

        ``timeout`` counts only while the chain answers: rounds queued behind an RPC
        outage are waited for until the chain is back (or the node is asked to stop),
        so a run that ends during an outage still commits what it trained.
        """
        deadline = time.monotonic() + timeout
        while not self._idle.is_set():
            if OUTAGE.down_since is not None and not self.node.stop_event.is_set():
                deadline = max(deadline, time.monotonic() + timeout)
            elif time.monotonic() >= deadline:
                break
            self._idle.wait(0.5)
        return self._idle.is_set()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                # A full disk (the checkpoint, state.json) pauses the round and tries it again once space is
                # freed: every step of handle is idempotent, and the rounds after it wait (the chain takes
                # them in order), so none is skipped (issue 45).
                retry_on_full_disk(lambda: self.handle(item), what=f"round {item}'s chain step",
                                   kind="chain step", stop=self.node.stop_event)
            except DLX_ERRORS as exc:
                logger.error("round %d: chain step failed: %s", item, exc)
            except Exception:  # thread boundary: the committer's thread takes the next round
                logger.exception("round %d: chain step crashed", item)
            self.handled_through = max(self.handled_through, item)
            idle = self._queue.empty()
            if rounds_handled := self._prune_schedule.handled(idle):
                self._prune_reward_sources(rounds_handled)
            if idle and self._queue.empty():
                self._idle.set()

    def _prune_reward_sources(self, rounds_handled: int) -> None:
        """A bounded pass of the reward sources' pruning for the ``rounds_handled`` rounds since the last
        (node/live/record/rewardprune.py); its failure never stops the committer."""
        if self.node.stop_event.is_set():
            return
        try:
            if not self._pruner_built:  # built once it read the chain; a failed build is tried again
                node = self.node
                self.reward_pruner = RewardSourcePruner.for_node(node.cfg, node.chain, node.run_id)
                self._pruner_built = True
            if self.reward_pruner is not None:
                self.reward_pruner.after_round(rounds_handled)
        except Exception:  # thread boundary: the files stay; the next round's pass tries again
            logger.exception("reward sources: pruning crashed (kept)")

    # ------------------------------------------------------------------ one round
    def _attestations(self, outer_round: int):
        node = self.node
        num_stages = node.cfg.pipeline.num_stages

        def all_stages():
            atts = {s: node.book.snapshot_attestations(outer_round, s) for s in range(num_stages)}
            return atts if all(atts.values()) else None

        # Never given up on while the round is open: the chain takes rounds strictly in order,
        # so a round this node stopped waiting for could only stall every later round's record.
        # A stage's attestation can come late (its only contributor crashed and re-applies the
        # round from its archive after a restart); the record pauses meanwhile, training does
        # not. But once the round is on chain, its record no longer needs this node: a node
        # restarted after the attestations were gossiped (and dropped from its peers' sync
        # caches) would otherwise wait for them forever and never sign a later round.
        started = last_report = time.monotonic()
        while not node.stop_event.is_set():
            atts = node.book.wait_for(all_stages, timeout=ON_CHAIN_CHECK_S, stop=node.stop_event)
            if atts is not None:
                return atts
            missing = [s for s in range(num_stages) if not node.book.snapshot_attestations(outer_round, s)]
            try:
                committed = node.chain.commit_of(node.run_id, outer_round) is not None
            except DLX_ERRORS as exc:
                logger.debug("round %d: chain read failed (%s); still waiting for attestations", outer_round,
                             exc)
                committed = False
            if committed:
                logger.warning(
                    "round %d: committed on chain while attestations of stage(s) %s never reached this "
                    "node; it takes the chain's record", outer_round, missing)
                return ON_CHAIN
            if missing and not node.stop_event.is_set() and time.monotonic() - last_report >= WAIT_REPORT_S:
                last_report = time.monotonic()
                logger.warning("round %d: waiting for attestations of stage(s) %s (%.0fs so far)",
                               outer_round, missing, time.monotonic() - started)
        return None

    def record(self, outer_round: int):
        """(record, attestations, agreed stage hashes, agreed stage leaves) of the round as this node derives
        it (``prev_head`` still zero; the leaves are a chunked run's, else empty); the record is None if
        attestations are missing."""
        node = self.node
        atts = self._attestations(outer_round)
        if atts is None:
            logger.info("round %d: stopped before every stage was attested; this node will not commit it",
                        outer_round)
            return None, None, [], []
        if atts is ON_CHAIN:
            return None, ON_CHAIN, [], []
        scheme = node.cfg.commitment_scheme
        stage_hashes, stage_roots, stage_leaves = [], [], []
        for stage in range(node.cfg.pipeline.num_stages):
            mine = atts[stage].get(node.peer_id)
            # A chunked run's result is also the stage leaf (its weights and momentum chunk roots, its
            # factors: node/live/fraud/chunkstate.py); an attestation
            # without a leaf that parses counts for nothing there.
            results = {p: (a.weights_hash, a.contributions_root, scheme.attested_leaf(a, stage))
                       for p, a in atts[stage].items()}
            results = {p: r for p, r in results.items() if r[2] is not None}
            if not results:
                logger.warning("round %d stage %d: no attestation carries a stage leaf", outer_round, stage)
                return None, None, [], []
            votes = Counter(results.values())
            # Most votes, a tie to the smallest: every node that heard the same attestations takes the
            # same result, whichever of them arrived first.
            chosen = min(votes, key=lambda result: (-votes[result], result))
            if mine is not None and node.peer_id in results:
                chosen = results[node.peer_id]
                if set(results.values()) - {chosen}:
                    logger.warning("round %d stage %d: peers attested a different result than ours",
                                   outer_round, stage)
            stage_hashes.append(chosen[0])
            stage_roots.append(chosen[1])
            stage_leaves.append(chosen[2])
        closes = []
        for stage in range(node.cfg.pipeline.num_stages):
            close = node.coordinator.accepted(outer_round, stage) or self._close_matching(outer_round, stage,
                                                                                           stage_roots[stage])
            if close is None:
                logger.warning("round %d stage %d: no close matching the attested root", outer_round, stage)
                return None, None, [], []
            closes.append((stage, close))
        leaves = [digest for _stage, close in closes for (_r, _p, digest, _s) in close.contributions]
        contributors = {peer for _stage, close in closes for (_r, peer, _d, _s) in close.contributions}
        last = node.cfg.pipeline.num_stages - 1
        last_replicas = {r for (r, _p, _d, _s) in dict(closes)[last].contributions}
        reporters = self._loss_reporters(outer_round, last, last_replicas, stage_hashes[last])
        train = [a.train_loss for _peer, a in reporters if not math.isnan(a.train_loss)]
        evals = [a.eval_loss for _peer, a in reporters if not math.isnan(a.eval_loss)]
        tokens = record_tokens(dict(closes)[last], node.cfg.diloco.inner_steps,
                               node.cfg.training.batch_size * node.cfg.model.block_size,
                               node.cfg.diloco.budgeted)
        commit = RoundRecord(
            run_id=node.run_id,
            round=outer_round,
            prev_head=bytes(32),  # completed once round t-1 is on chain (handle)
            weights_root=scheme.weights_root(stage_hashes, stage_leaves),
            contributions_root=merkle_root(leaves),
            train_loss_micro=to_micro(sum(train) / len(train)) if train else 0,
            eval_loss_micro=to_micro(sum(evals) / len(evals)) if evals else 0,
            tokens=tokens,
            num_contributors=len(contributors),
        )
        return commit, atts, stage_hashes, [leaf for leaf in stage_leaves if leaf]  # none in a hashed run

    def _loss_reporters(self, outer_round: int, last: int, replicas: set[int], weights_hash: bytes):
        """The last-stage attestations the record's loss figures are the mean of, in peer-id order.

        Those of the replicas aggregated in the round whose weights agree with the record's:
        every honest member derives the same set and sums it in the same order, so they sign
        the same record. A member that reported other weights (it aggregated something else)
        does not count. Waits for every aggregated replica's attestation up to the round deadline:
        members that averaged different sets sign different records, one each, and the round never
        commits (a 10 s wait did that over 20-200 ms links: docs/P2P.md, "What the soak found").
        """
        node = self.node

        def agreeing(complete: bool):
            placements = node.membership.placements
            atts = node.book.snapshot_attestations(outer_round, last)
            heard = {placements[p].replica for p in atts if p in placements}
            if complete and not replicas <= heard:
                return None
            return [(p, a) for p, a in sorted(atts.items()) if p in placements
                    and placements[p].replica in replicas
                    and a.weights_hash == weights_hash and not math.isnan(a.eval_loss)]

        found = node.book.wait_for(lambda: agreeing(True), timeout=node.cfg.round_timeout,
                                   stop=node.stop_event)
        return found if found is not None else agreeing(False)

    def _close_matching(self, outer_round: int, stage: int, root: bytes):
        for close, _data in self.node.book.snapshot_closes(outer_round, stage).values():
            if merkle_root([c[2] for c in close.contributions]) == root:
                return close
        return None

    def handle(self, outer_round: int) -> None:
        """Derive the round's record (no chain needed), then settle it on chain, through any RPC outage.

        The record and checkpoint are derived once; only the chain part is tried again
        while the RPC is unreachable, so an outage never changes what this node signs.
        Every chain step is idempotent (a commit already on chain with this record is
        success), so a retry after an answer lost in the outage never commits twice.
        """
        node = self.node
        derived, atts, stage_hashes, stage_leaves = self.record(outer_round)
        if atts is ON_CHAIN:  # committed by the others; nothing of this node's to sign or dispute
            onchain = node.chain.commit_of(node.run_id, outer_round)
            node.on_recorded(outer_round, onchain.weights_root, False)
            node.on_confirmed(outer_round)
            node.forks.agreed(outer_round)
            return
        if derived is None:
            return
        if stage_leaves and node.cfg.commitment_scheme.proves_factors:  # its contributors' reward claims
            write_leaves(node.cfg.path(REWARD_SOURCES_DIR), outer_round, stage_leaves)
        checkpoint_hash = None
        if (outer_round + 1) % node.cfg.checkpoint_every == 0:
            checkpoint_hash = self.checkpoints.assemble(outer_round, atts, stage_hashes, stage_leaves)
        delay = CHAIN_RETRY_MIN_S
        while not node.stop_event.is_set():
            try:
                self._settle(outer_round, derived, checkpoint_hash)
                return
            except (ChainUnavailable, TransactionTimeout) as exc:
                # ledger.chain logs the outage itself, at a bounded rate; the round stays queued.
                logger.debug("round %d: chain unreachable (%s); trying again in %.0fs", outer_round, exc,
                             delay)
                node.stop_event.wait(delay)
                delay = min(2 * delay, CHAIN_RETRY_MAX_S)

    def prev_head(self, outer_round: int) -> tuple[RoundRecord | None, bytes]:
        """(the round's commit or None, the chain head before the round) once round t-1 is on chain.

        The head is read only while the round is not committed, and the round is looked up again after it:
        a commit that lands between the two reads makes the head round t's own, and a record over it could
        never be committed nor credit this node (seen in tests/test_byzantine_e2e.py, ``other-momentum``)."""
        node = self.node
        onchain = node.chain.commit_of(node.run_id, outer_round)
        if onchain is None:
            head = node.chain.head_of(node.run_id)
            onchain = node.chain.commit_of(node.run_id, outer_round)
            if onchain is None:
                return None, head
        return onchain, onchain.prev_head

    def _settle(self, outer_round: int, derived: RoundRecord, checkpoint_hash: bytes | None) -> None:
        """Sign, commit (if it is this node's turn), read back and verify the round on chain."""
        node = self.node
        # The chain takes round t only right after round t-1: wait for it (a round without its
        # quorum of signatures pauses the record, never the training).
        if not self._wait_reporting(lambda: node.chain.last_round(node.run_id) >= outer_round - 1,
                                    f"round {outer_round}: waiting for round {outer_round - 1} on chain"):
            return
        onchain, prev_head = self.prev_head(outer_round)
        mine = replace(derived, prev_head=prev_head, checkpoint_hash=checkpoint_hash or bytes(32))
        signature = self._sign(mine)
        committed_by_me = False
        if onchain is None:
            committed_by_me = self._commit_with_quorum(outer_round, mine, signature)
        node.on_recorded(outer_round, mine.weights_root, committed_by_me)
        self.readback.verify(outer_round, mine, signature)
        self.equivocations.report()


