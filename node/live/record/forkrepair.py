"""Healing a fork: a node whose outer step left the run's committed record re-bases on the record.

docs/PROTOCOL.md, "When a node's weights leave the record". A node aggregated
another set of round t than the quorum did (it took another close, or a local
fault changed its sum): its attestation differs, the quorum commits the others'
record, and every later round of this node's would differ too. When the
committer reads the committed record back and its roots differ
(:meth:`ForkRepair.diverged`, on the committer thread):

1. the record's per-stage results are found among the round's attestations and
   closes (the combination whose weights root and contributions root are the
   record's);
2. for every held stage, the committed close's contributions (this node fetched
   and archived them, or fetches them now) are aggregated on the global state
   this node held before round t (kept by :meth:`remember_base`); the result
   must be the record's stage hash, else the record is not what its
   contributions give and nothing is re-based;
3. the node's own result is judged the same way: if its own close differs from
   the committed one and aggregating it again gives what it attested, its
   computation was right and its signed record goes on chain as a dispute
   (evidence of the fork); if not (a local fault), no dispute;
4. the re-base is queued; the training thread takes it before it applies round
   t+1 (:meth:`due`, :meth:`apply`): the engines take the record's state (local
   progress kept), the archive re-seals round t with the committed set, and the
   node trains the next round with its peers. A round whose start state was taken before the re-base
   (with the overlap, the one in progress) is not announced (RoundFinisher), and the round it trained
   on its forked apply was left out by every holder (node/binding.py).

Two things wait on how round t stands (:meth:`ForkRepair.standing`): until the chain's
verdict of round t is here, or the attestations heard of every held stage confirm this
node's result (:func:`~node.live.record.standing.attested_standing`: a quorum of the round's
expected attesters name it and no other result has that many), at most a round timeout:

- the apply of round t+1 (:meth:`due`), so that a forked round t is re-based in place,
  never found only after round t+1 was applied on it, whenever the peers' attestations
  and the chain's record come;
- the announcement of a round whose start state holds round t (:meth:`announceable`:
  round t+2 with the delay), so that a round begun on a forked result is never announced,
  whenever the verdict comes: it is announced on a confirmed or agreed round t only,
  withheld on a forked one and when the wait runs out.

A fork found only after round t+1 was applied (the wait ran out), or one whose record this
node cannot re-derive (the sliced exchange holds only its slices), falls back to re-entering
from the chain's latest checkpoint (:meth:`node.live.peers.lifecycle.Lifecycle.diverged`).
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass, field

from ledger.errors import LedgerInputError
from ledger.merkle import merkle_root
from ledger.records import RoundRecord
from node.live.state.base import NodeBase
from node import protocol as msg
from node.binding import other_result_exclusions
from node.errors import DLX_ERRORS, NodeError
from node.fsutil import retry_on_full_disk
from node.live.exchange.coordination import RoundCoordinator
from node.live.exchange.protocol import Exchange
from node.live.peers.lifecycle import Lifecycle
from node.live.peers.membership import Membership
from node.live.chain.onchain import NodeChain
from node.store.archive import ArchivedContribution
from p2p.envelope import decode_envelope
from training.hashing import stage_weights_hash
from node.live.record.standing import RoundStanding

logger = logging.getLogger(__name__)

#: Rounds of pre-apply global states kept (the verdict of round t comes a round or two after its apply).
BASES_KEPT = 3
#: At most this many combinations of attested stage results are tried against a record.
MAX_COMBINATIONS = 256


class ForkError(NodeError):
    """A committed record this node cannot re-derive from its contributions (nothing is re-based)."""


@dataclass
class StageRebase:
    """One held stage of a re-base: the record's state of the round and the set it aggregates."""

    stage: int
    weights: dict
    momentum: dict
    weights_hash: bytes
    close: msg.Close
    envelopes: list[bytes]
    excluded: list[list]  # [stage, replica, peer id, envelope hash, reason, detail]


@dataclass
class Rebase:
    """A round whose committed record this node re-derived, to take before it applies the next round."""

    outer_round: int
    weights_root: bytes
    stages: list[StageRebase] = field(default_factory=list)


class ForkRepair(RoundStanding):
    """See module docstring."""

    def __init__(self, base: NodeBase, *, chain: NodeChain, coordinator: RoundCoordinator, exchange: Exchange,
                 lifecycle: Lifecycle, membership: Membership) -> None:
        self.cfg = base.cfg
        self.station = base.station
        self.book = base.book
        self.coordinator = coordinator
        self.exchange = exchange
        self.archive = base.archive
        self.rounds = base.rounds
        self.chain = chain
        self.lifecycle = lifecycle
        self.state = base.state
        self.progress = base.progress
        self.membership = membership
        self.stop = base.stop
        self._cond = threading.Condition()
        self._bases: dict[tuple[int, int], tuple[dict, dict]] = {}  # (round, stage) -> (weights, momentum)
        self._settled: set[int] = set()  # rounds whose chain verdict this node has
        self._forked: set[int] = set()  # of those, the rounds whose committed roots differ from ours
        self._pending: dict[int, Rebase] = {}
        self._quorum: tuple[int, float] | None = None  # (the chain's quorum, when read)

    # -- the finisher, before each outer step --------------------------------------------
    def remember_base(self, outer_round: int, stage: int, base: tuple[dict, dict]) -> None:
        """The global state (weights, momentum) a stage held before ``outer_round``'s outer step.

        The engine replaces its state objects at every step (never changes them in place), so
        keeping the references costs one state per round kept, no copy."""
        with self._cond:
            self._bases[(outer_round, stage)] = base
            for key in [k for k in self._bases if k[0] < outer_round - BASES_KEPT]:
                del self._bases[key]
            self._settled = {r for r in self._settled if r >= outer_round - BASES_KEPT}
            self._forked = {r for r in self._forked if r >= outer_round - BASES_KEPT}

    # -- the committer thread -------------------------------------------------------------
    def agreed(self, outer_round: int) -> None:
        """The chain's record of ``outer_round`` is known and nothing of it is re-based: the global state
        held before it (:meth:`remember_base`) is let go at once, since only a fork of that round reads it
        (issue 75: with the outer state on disk each one is an unnamed file of 2 x the stage's bytes, and
        the last :data:`BASES_KEPT` + 1 rounds' were held whether or not their verdicts had come)."""
        self._read_quorum()
        with self._cond:
            self._settled.add(outer_round)
            for key in [k for k in self._bases if k[0] == outer_round]:
                del self._bases[key]
            self._cond.notify_all()

    def holds_base(self, outer_round: int) -> bool:
        """Whether the global state before ``outer_round`` is still held for a fork of it (some stage)."""
        with self._cond:
            return any(k[0] == outer_round for k in self._bases)

    def diverged(self, outer_round: int, onchain: RoundRecord, mine: RoundRecord,
                 signature: bytes | None) -> None:
        """The committed roots of ``outer_round`` differ from this node's: judge, dispute if ours stood,
        re-base."""
        try:
            rebase, own_right = self._plan(outer_round, onchain)
        except (ForkError, *DLX_ERRORS) as exc:
            logger.error("round %d: the committed record cannot be re-derived here (%s)", outer_round, exc)
            rebase, own_right = None, True
        if own_right and self.left_record_before(outer_round):
            # Its round was computed on weights the record never had: whether its own aggregate "stands"
            # says nothing about the record (the earlier fork is the difference), so no dispute.
            logger.warning(
                "round %d: committed roots differ from ours, but our round %d had already left the "
                "committed record; no dispute (this difference follows from that one)", outer_round,
                outer_round - 1)
        elif own_right and signature is not None:
            logger.error(
                "round %d: committed roots differ from ours, and our own aggregate of our close stands; "
                "filing a dispute", outer_round)
            try:
                self.chain.dispute(mine, signature)
            except DLX_ERRORS as exc:
                logger.error("round %d: dispute not filed: %s", outer_round, exc)
        elif own_right:
            logger.error(
                "round %d: committed roots differ from ours; no signed record of ours to dispute with",
                outer_round)
        else:
            logger.warning(
                "round %d: our own aggregate of round %d was not what our close gives (a local fault); "
                "no dispute", outer_round, outer_round)
        with self._cond:
            if rebase is not None:
                self._pending[outer_round] = rebase
                self.rounds.rebasing.add(outer_round)  # rounds begun from now on hold the forked result
                for begun in self.rounds.withhold_on(outer_round, self.cfg.diloco):
                    logger.warning(
                        "round %d: trained on our result of round %d, which leaves for the record's; our "
                        "contribution of it is not announced", begun, outer_round)
            self._settled.add(outer_round)
            self._forked.add(outer_round)
            self._cond.notify_all()
        if rebase is None:
            self.lifecycle.diverged(outer_round)

    def left_record_before(self, outer_round: int) -> bool:
        """Whether this node's weights root of the round before ``outer_round`` differs from the chain's
        record of it (it was not re-based on it: the fork of that round carried over)."""
        own = self.state.get("weights_roots", {}).get(str(outer_round - 1))
        if own is None:
            return False
        try:
            record = self.chain.commit_of(self.cfg.ledger.run_id, outer_round - 1)
        except DLX_ERRORS as exc:
            logger.debug("round %d: record not read (%s)", outer_round - 1, exc)
            return False
        return record is not None and record.weights_root.hex() != own

    def _plan(self, outer_round: int, onchain: RoundRecord) -> tuple[Rebase | None, bool]:
        """(the re-base of the held stages, whether this node's own result stood)."""
        if not self.exchange.holds_all_envelopes:
            raise ForkError("this exchange holds only its slices of a round; re-entering from the chain")
        committed = self._committed_stages(outer_round, onchain)
        worker = self.station.worker()
        rebase, own_right = Rebase(outer_round, onchain.weights_root), False
        for stage in worker.stages:
            weights_hash, close = committed[stage]
            own_hash = self.rounds.stage_hashes.get(outer_round, {}).get(stage)
            if own_hash == weights_hash:
                continue
            with self._cond:
                base = self._bases.get((outer_round, stage))
            if base is None:
                raise ForkError(
                    f"the global state before round {outer_round} stage {stage} is no longer held")
            envelopes = self.exchange.pool.collect(outer_round, stage, close)
            base_hash = stage_weights_hash(base[0])
            derived = worker.derive(stage, outer_round, base, self._payloads(envelopes),
                                    self._others(outer_round, envelopes, base_hash))
            if derived.weights_hash != weights_hash:
                raise ForkError(
                    f"stage {stage}: the committed close gives weights {derived.weights_hash.hex()[:12]}, "
                    f"not the record's {weights_hash.hex()[:12]}")
            own_close = self.coordinator.accepted(outer_round, stage)
            if own_close is not None and own_hash is not None and \
                    self._root(own_close) != self._root(close):
                own = self.exchange.pool.collect(outer_round, stage, own_close)
                own_right |= worker.derive(stage, outer_round, base, self._payloads(own),
                                           self._others(outer_round, own, base_hash)).weights_hash == own_hash
            excluded = [[stage, close.contributions[r.index][0], close.contributions[r.index][1],
                         close.contributions[r.index][2].hex(), r.reason, r.detail]
                        for r in derived.contributions if not r.accepted]
            rebase.stages.append(StageRebase(stage, derived.new_global, derived.new_momentum, weights_hash,
                                             close, envelopes, excluded))
        return (rebase if rebase.stages else None), own_right

    def _committed_stages(self, outer_round: int, onchain: RoundRecord) -> dict[int, tuple[bytes, msg.Close]]:
        """Stage -> (weights hash, close) of the committed record, from the attestations and closes heard."""
        num_stages = self.cfg.pipeline.num_stages
        scheme = self.cfg.commitment_scheme
        options = []
        for stage in range(num_stages):
            closes = {self._root(c): c for c, _data in self.book.snapshot_closes(outer_round, stage).values()}
            accepted = self.coordinator.accepted(outer_round, stage)
            if accepted is not None:
                closes.setdefault(self._root(accepted), accepted)
            # A chunked run's results are also the stage leaves (node/live/fraud/chunkstate.py).
            results = sorted({(a.weights_hash, a.contributions_root, scheme.attested_leaf(a, stage) or b"")
                              for a in self.book.snapshot_attestations(outer_round, stage).values()})
            options.append([(h, closes[root], leaf) for h, root, leaf in results if root in closes])
        for combination in itertools.islice(itertools.product(*options), MAX_COMBINATIONS):
            try:
                root = scheme.weights_root([h for h, _c, _l in combination],
                                           [leaf for _h, _c, leaf in combination])
            except LedgerInputError:
                continue  # a stage leaf missing from an attestation of a chunked run
            if root != onchain.weights_root:
                continue
            leaves = [entry[2] for _h, close, _l in combination for entry in close.contributions]
            if merkle_root(leaves) == onchain.contributions_root:
                return {stage: (h, close) for stage, (h, close, _l) in enumerate(combination)}
        raise ForkError("no attested result and close of each stage heard here gives the committed roots")

    def _payloads(self, envelopes: list[bytes]) -> list[bytes]:
        max_bytes = self.cfg.p2p.max_blob_bytes
        return [msg.decode_contribution_body(decode_envelope(e, max_bytes).payload).blob for e in envelopes]

    def _others(self, outer_round: int, envelopes: list[bytes], base_hash: bytes) -> dict[int,
                                                                                          tuple[str, str]]:
        """The envelopes built on another result of the round before than ``base_hash`` (left out, as at the
        apply)."""
        max_bytes = self.cfg.p2p.max_blob_bytes
        applied = [msg.decode_contribution_body(decode_envelope(e, max_bytes).payload).applied_hash
                   for e in envelopes]
        return other_result_exclusions(self.cfg.diloco, outer_round, applied, base_hash)

    @staticmethod
    def _root(close: msg.Close) -> bytes:
        return merkle_root([entry[2] for entry in close.contributions])

    # -- the training thread ----------------------------------------------------------------
    def due(self, next_round: int) -> list[Rebase]:
        """The re-bases to take before applying ``next_round``; first waits (at most a round timeout) until
        round ``next_round - 1`` stands (:meth:`standing`): its chain verdict is here, or the attestations
        confirm this node's result. A forked round is then re-based in place, whenever the peers' attestations
        and the chain's record come (docs/PROTOCOL.md, "When a node's weights leave the record")."""
        self.standing(next_round - 1, f"applying round {next_round}")
        with self._cond:
            ready = [self._pending.pop(r) for r in sorted(self._pending) if r < next_round]
        return ready

    def apply(self, rebase: Rebase) -> bool:
        """Take the record's state of ``rebase.outer_round`` (call between rounds: nothing else touches the
        engines); False if later rounds were applied meanwhile (then the node re-enters from the chain)."""
        outer_round, worker = rebase.outer_round, self.station.worker()
        own = self.rounds.stage_hashes.get(outer_round, {})
        if self.progress.last_finished != outer_round or \
                any(worker.global_hash(s.stage) != own.get(s.stage) for s in rebase.stages):
            logger.error("round %d: this node applied later rounds before the chain's record of it came; "
                         "re-entering from the chain instead of re-basing", outer_round)
            self.lifecycle.diverged(outer_round)
            return False
        self.rounds.rebasing.discard(outer_round)
        for stage in rebase.stages:
            worker.move_global(stage.stage, stage.weights, stage.momentum)
            self.rounds.stage_hashes.setdefault(outer_round, {})[stage.stage] = stage.weights_hash
        rebased = [*self.state.get("rebased", [])[-15:], outer_round]

        def persist() -> None:  # idempotent: a full disk pauses it until space is freed (issue 45)
            for stage in rebase.stages:
                for envelope in stage.envelopes:
                    self.archive.put(outer_round, envelope)
            self._reseal(rebase)
            self.state.record_round(outer_round, rebase.weights_root, False)
            self.state.update(rebased=rebased)

        retry_on_full_disk(persist, what=f"round {outer_round}'s re-base (archive, state.json)",
                           kind="re-base", stop=self.stop)
        self.progress.weights_root = rebase.weights_root.hex()
        logger.warning(
            "round %d: re-based stage(s) %s on the committed record (weights root %s); training goes "
            "on from it", outer_round, [s.stage for s in rebase.stages], rebase.weights_root.hex()[:12])
        return True

    def _reseal(self, rebase: Rebase) -> None:
        """Seal the round again with the committed set of the re-based stages (a restart re-applies that)."""
        outer_round = rebase.outer_round
        moved = {s.stage for s in rebase.stages}
        kept = [c for c in self.archive.sealed(outer_round) or [] if c.stage not in moved]
        excluded = [e for e in self.archive.excluded(outer_round) if e[0] not in moved]
        for stage in rebase.stages:
            kept += [ArchivedContribution(stage.stage, replica, peer_id, digest)
                     for replica, peer_id, digest, _size in stage.close.contributions]
            excluded += stage.excluded
        self.archive.seal_round(outer_round, kept, excluded=excluded,
                                all_held=self.exchange.holds_all_envelopes)
