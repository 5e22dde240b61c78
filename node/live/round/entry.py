"""Where a node enters the run: at start, and again after its split cluster's pipeline re-formed.

A node enters at round 0 of a fresh run, or after the chain's latest
checkpoint that verifies (restoring its stages from it), never at a round it
already contributed to and never past a round nobody else would close; a
split cluster's members agree on the round (the max of their proposals). When
a partner dies, the node sits rounds out as a non-contributor until the
pipeline re-forms (:meth:`RunEntry.await_partner`), then enters the round the
others train as its restarted partner does, from the record: both hold the
global state of the round that round trains from (the survivor its own held
one, :meth:`RunEntry.reenter`; the partner that round's checkpoint, preferred
over a newer one), and train it from start states a restart would have
(docs/PROTOCOL.md, "A split cluster that loses a node").
"""

from __future__ import annotations

import logging
import os

from node.live.state.base import NodeBase
from node.live.rooms import Rooms
from node.errors import DLX_ERRORS, NetworkUnreachable, StateError
from node.live.worker.contributor import Contributor, PipelineBroken
from node.live.exchange.coordination import CloseInterrupted, RoundStopped
from node.live.round.finisher import RoundFinisher
from node.live.state.station import NOT_CONTRIBUTING
from node.live.worker.replica import PipelineRejoin, ReplicaWorker
from node.progress import host_progress
from node.store.checkpoint import Checkpoint, checkpoint_problems, read_checkpoint
from node.store.checkpoint_split import (file_range, head_path, header_key, keeps_split, read_split,
                                         shard_path, split_path, split_stages, stage_key)
from node.store.checkpoint_stage import fetch_checkpoint_stages
from p2p.errors import BlobError, P2PError
from training.errors import PipelineError
from training.schedule import pending_after_round

logger = logging.getLogger(__name__)


class RunEntry:
    """Decides and agrees where this node enters the run (see module docstring)."""

    def __init__(self, base: NodeBase, rooms: Rooms, *, worker: ReplicaWorker, contributor: Contributor,
                 finisher: RoundFinisher) -> None:
        self.cfg = base.cfg
        self.run_id = base.run_id
        self.chain = rooms.chain
        self.host = rooms.host
        self.membership = rooms.membership
        self.book = base.book
        self.coordinator = rooms.coordinator
        self.worker = worker
        self.contributor = contributor
        self.finisher = finisher
        self.station = base.station
        self.state = base.state
        self.layout = base.layout
        self.progress = base.progress
        self.reporter = base.reporter
        self.checkpoint_dir = base.checkpoint_dir
        self.incoming_dir = base.incoming_dir
        self.stop = base.stop

    # -- at start -----------------------------------------------------------------------
    def entry_point(self) -> tuple[int, list[int]]:
        """Where this node enters: round 0 of a fresh run, or after the latest checkpoint."""
        last_committed = self.chain.last_round(self.run_id)
        live_round = self.membership.live_training_round(last_committed, self.round_window())
        contributed = self.state.get("last_contributed", -1)
        if last_committed < 0 and contributed < 0 and (live_round <= 0 or not self._round_closed(0)):
            # A fresh run whose round 0 is still open: a founding replica whose cluster formed
            # later than the others (a slow or loaded machine) still enters at round 0, and
            # the others wait for it up to the round deadline, as for any expected replica.
            # Not a node that signed round 0 in an earlier life (killed in its exchange before
            # any commit, as slow links make likely): it re-announces round 0 and goes on.
            return 0, []
        # Round t trains from the global weights of round t - 1 - pending (the one-step delay): the checkpoint
        # of that round lets this node train the open round; a newer one only a later round.
        not_before = contributed + 1
        reach = max(self.open_round(live_round), not_before) - 1 - pending_after_round(self.cfg.diloco)
        ckpt = self._entry_checkpoint(reach)
        base = -1
        if ckpt is not None:
            for stage in self.worker.stages:
                weights, momentum = ckpt.stage_state(self.worker.stage_names(stage))
                self.worker.load_global(stage, weights, momentum, ckpt.round)
            base = ckpt.round
            logger.info("restored stages %s from the chain-verified checkpoint of round %d",
                        list(self.worker.stages), base)
        floor = max(base + 1, self.state.get("last_contributed", -1) + 1)
        # Round t trains from the global weights of round t - 1 - pending (the one-step delay): from the
        # checkpoint of round `base` on, that is reachable from round base + 1 + pending on. (A round no
        # replica would ever close, from `floor` on, is still entered: no_orphan_round.)
        trainable = max(base + 1 + pending_after_round(self.cfg.diloco), floor)
        start = self.no_orphan_round(floor, max(self.open_round(live_round), trainable), last_committed)
        return start, list(range(base + 1, start))

    def open_round(self, live_round: int) -> int:
        """The first round this node can still be waited for in: the round the other replicas train now
        (``live_round``) while none of its contributions is announced and it is not closed, else the next.

        Its coordinators then wait for this replica (its hello names that round as its first, up to
        the round deadline) instead of it sitting out a round it could have made: a restarted node
        is back in the round being trained when it is ready (issue 30, "back within two rounds").
        Once a replica announced its contribution the others are done training it, and waiting for
        this node's whole round would stall them.
        """
        if live_round < 0:
            return 0
        stages = range(self.cfg.pipeline.num_stages)
        if self._round_closed(live_round) or any(self.book.snapshot_announces(live_round, s) for s in stages):
            return live_round + 1
        return live_round

    def agree(self, proposal: int) -> int | None:
        """The entry round the cluster agrees on; if a partner dies meanwhile, wait until the pipeline
        re-forms (the partner restarted, or another member took the seat) and agree again. None if
        the node is asked to stop first."""
        if 0 < self.cfg.rounds <= proposal:
            return proposal  # every round of the run is trained: nothing to agree on with the partner
        while True:
            try:
                return self.worker.agree_on_round(proposal)
            except PipelineError as exc:
                logger.warning("pipeline of cluster %r broke while entering the run (%s); waiting for the "
                               "partner to come back", self.cfg.cluster, exc)
            self.reporter.set_state("waiting for partner")
            self.worker.leave_pipeline()
            rejoin = PipelineRejoin(self.worker, self.cfg.round_timeout * 2 + 60, self.stop)
            while not rejoin.done.wait(1.0):
                if self.stop.is_set():
                    return None
            self.reporter.set_state("joining")

    def no_orphan_round(self, floor: int, proposal: int, last_committed: int) -> int:
        """``proposal``, or the first round in [floor, proposal) that would otherwise stay open forever.

        Entering after the highest round another replica trains is right while that replica
        goes on; but if it breaks in that round (a split cluster losing a node) before anyone
        announced a contribution, and re-enters after the round this replica now trains, the
        round has no contributor at all and never closes: every replica waits for it (seen
        in bench_chaos.py: two clusters re-formed around each other's stale claims and both
        skipped round 88). Such a round, not closed, not committed, with no announced
        contribution and in no live replica's claimed range, is the one to enter at.
        """
        claims = self.membership.claimed_rounds(last_committed, self.round_window())
        for outer_round in range(max(floor, last_committed + 1), proposal):
            if self._round_closed(outer_round) or any(first <= outer_round <= now for first, now in claims):
                continue
            if any(self.book.snapshot_announces(outer_round, stage)
                   for stage in range(self.cfg.pipeline.num_stages)):
                continue
            logger.info(
                "round %d: no replica trains or contributed to it and it is not closed; entering there "
                "rather than at round %d", outer_round, proposal)
            return outer_round
        return proposal

    def round_window(self) -> int:
        """How many rounds past the last committed one a peer can honestly be (delay, commit lag,
        catch-up)."""
        return 8 + 2 * self.cfg.checkpoint_every

    def _round_closed(self, outer_round: int) -> bool:
        """Whether a valid close of ``outer_round`` (any stage) has reached this node.

        Only a close that passes the checks counts: an empty or otherwise invalid close a
        member publishes at the start must not make a founder believe round 0 is over and
        enter as a catch-up node.
        """
        for stage in range(self.cfg.pipeline.num_stages):
            for coordinator, (close, _data) in self.book.snapshot_closes(outer_round, stage).items():
                if self.coordinator.judge(outer_round, stage, coordinator, close) is None:
                    return True
        return False

    # -- the checkpoint it enters from ----------------------------------------------------
    def _entry_checkpoint(self, reach: int | None = None) -> Checkpoint | None:
        """The newest published checkpoint that verifies against the run and its record, preferring those
        upstream of every dispute, and those of round ``reach`` or older; None if the run has published none.

        ``reach``: the newest round whose checkpoint still lets this node train the round the others
        train (it starts from the global weights of round ``reach``): a newer one makes it sit that
        round out (issue 30, "back within two rounds"), an older one only costs catch-up rounds.

        A checkpoint that cannot be fetched, or whose metadata or tensors disagree with the run
        document or the attested record, is passed over for the next older one (a member serving
        doctored bytes cannot keep nodes from entering). One at or after a round another member
        disputed is taken only when no undisputed one verifies: entering before the disputed
        round makes this node re-apply that round itself.
        """
        published = self.chain.checkpoints(self.run_id)
        if not published:
            return None
        disputed = self.chain.disputed_rounds(self.run_id, exclude=self.chain.client.address)
        first_disputed = min(disputed, default=None)
        # Those of round `reach` or older first (newest first), then the newer ones (oldest first).
        newest_first = sorted(published, key=lambda c: (reach is not None and c.round > reach,
                                                        c.round if reach is not None and c.round > reach
                                                        else -c.round))
        undisputed = [c for c in newest_first if first_disputed is None or c.round < first_disputed]
        downstream = [c for c in newest_first if first_disputed is not None and c.round >= first_disputed]
        refused, unfetched = [], 0
        for candidate in undisputed + downstream:
            try:
                ckpt, problems = self._candidate(candidate)
            except DLX_ERRORS as exc:
                problems = [str(exc)]
                unfetched += isinstance(exc, P2PError)
            if problems:
                refused.append(f"round {candidate.round}: {'; '.join(problems)}")
                logger.error(
                    "the checkpoint of round %d does not verify against the run (%s); trying an older one",
                    candidate.round, "; ".join(problems))
                continue
            if candidate in downstream:
                logger.warning(
                    "entering from the checkpoint of round %d, at or after disputed round(s) %s: no "
                    "checkpoint before them verified", candidate.round, sorted(disputed))
            return ckpt
        if unfetched == len(refused):  # none could be fetched: the network's fault, not the node's state
            raise NetworkUnreachable("no published checkpoint of the run could be fetched (check [p2p] "
                                     "bootstrap and that a peer serving the run is reachable): "
                                     + " | ".join(refused)[:2000])
        raise StateError("no published checkpoint verifies against the run: " + " | ".join(refused)[:2000])

    def _candidate(self, candidate) -> tuple[Checkpoint | None, list[str]]:
        """``candidate``'s checkpoint and why it is not the run's (empty: it verifies). In a chunked run only
        the stages this node holds, fetched by range from a live peer (:meth:`_held_stages`); the whole file
        in a hashed run (whose momentum only the file's hash vouches for), where it is on disk already (a
        restart's) or where no live peer is known (the DHT is asked for the file)."""
        path = self.checkpoint_dir / f"round-{candidate.round:08d}.safetensors"
        providers = self.membership.live_providers()
        kept_split = split_path(self.checkpoint_dir, candidate.round).exists()
        by_stages = (providers or kept_split) and not path.exists() and self.layout.chunked
        if by_stages or self.layout.header_hashed:  # a header-hashed record names no whole file
            record = self.chain.commit_of(self.run_id, candidate.round)
            if record is None:
                return None, ["its round is not committed"]
            return self._held_stages(candidate, record.weights_root, providers), []  # checked against it
        ckpt = self._download_checkpoint(candidate.round, candidate.content_hash)
        record = self.chain.commit_of(self.run_id, candidate.round)
        return ckpt, (["its round is not committed"] if record is None else
                      checkpoint_problems(ckpt, self.layout, candidate.round, record.weights_root))

    def _held_stages(self, candidate, weights_root: bytes, providers: list[str]) -> Checkpoint:
        """The stages this node holds of ``candidate``'s checkpoint in a chunked run, fetched by range from
        the first of ``providers`` that serves them and checked against the record
        (node/store/checkpoint_stage.py: its stage leaves commit each stage's weights and momentum), not the
        whole model's file. Where the run's checkpoints are kept split (always in a header-hashed run, whose
        record names no whole file) the split is tried first. StateError if every peer served something else,
        P2PError if none answered."""
        digest, refused, wrong = candidate.content_hash.hex(), [], False
        split_first = self.layout.header_hashed or keeps_split(self.cfg.storage.checkpoints, self.layout)
        if split_first:
            try:
                return self._split_stages(candidate, weights_root, providers)
            except StateError as exc:
                refused.append(f"split: {exc}")
            if self.layout.header_hashed:  # no live peer and no split of its own: the network's fault
                kept = split_path(self.checkpoint_dir, candidate.round).exists()
                raise (StateError if providers or kept else BlobError)(" | ".join(refused)[:2000])
        with host_progress(self.host, f"stages {list(self.worker.stages)} of round {candidate.round}'s "
                                      "checkpoint"):
            for peer in providers:
                def fetch_range(offset: int, length: int, peer: str = peer) -> bytes:
                    return self.host.fetch_blob_range(digest, offset, length, peer,
                                                      timeout=self.cfg.p2p.transfer_timeout)
                try:
                    ckpt = fetch_checkpoint_stages(fetch_range, self.layout, candidate.round, weights_root,
                                                   self.worker.stages)
                except (StateError, P2PError) as exc:
                    wrong |= isinstance(exc, StateError)
                    refused.append(f"{peer[-8:]}: {exc}")
                    continue
                logger.info("round %d's checkpoint: stages %s fetched by range from %s and checked against "
                            "the record (not the whole model's file)", candidate.round,
                            list(self.worker.stages), peer[-8:])
                return ckpt
        if not split_first:  # kept split by others (storage.checkpoints = "stages"): the holders' keys
            try:
                return self._split_stages(candidate, weights_root, providers)
            except StateError as exc:
                refused.append(f"split: {exc}")
        raise (StateError if wrong else BlobError)(" | ".join(refused)[:2000])

    def _split_stages(self, candidate, weights_root: bytes, providers: list[str]) -> Checkpoint:
        """The held stages of a checkpoint kept split (node/store/checkpoint_split.py): its header and each
        held stage's shard from this node's directory (a restart's own) or from the peers that serve them
        under their keys, each checked against the record. StateError if none verifies."""
        digest, folder, timeout = candidate.content_hash, self.checkpoint_dir, self.cfg.p2p.transfer_timeout

        def remote(key: str) -> list:
            return [lambda offset, length, peer=peer: self.host.fetch_blob_range(key, offset, length, peer,
                                                                                timeout=timeout)
                    for peer in providers]

        listing = split_path(folder, candidate.round)
        split = read_split(listing) if listing.exists() else None
        own = split["stages"] if split is not None and split["content_hash"] == digest else {}
        headers = [file_range(head_path(folder, candidate.round))] if own else []
        headers += remote(header_key(digest))

        def shards(stage: int) -> list:
            local = [file_range(shard_path(folder, candidate.round, stage))] if stage in own else []
            return local + remote(stage_key(digest, stage))

        ckpt = split_stages(headers, shards, self.layout, candidate.round, weights_root, self.worker.stages,
                            digest)
        logger.info("round %d's checkpoint: stages %s from its header and stage shards (kept split), checked "
                    "against the record", candidate.round, list(self.worker.stages))
        return ckpt

    def _download_checkpoint(self, round_index: int, content_hash: bytes) -> Checkpoint:
        path = self.checkpoint_dir / f"round-{round_index:08d}.safetensors"
        if path.exists():
            try:  # read from the file, never whole in memory (issue 75)
                return read_checkpoint(path, content_hash)
            except StateError:
                pass  # not the chain's bytes: fetched again
        staged = self.incoming_dir / f"{content_hash.hex()}.part"
        staged.parent.mkdir(parents=True, exist_ok=True)
        # Every node assembles and serves the checkpoint: ask the live peers first (parallel
        # ranges from all of them), the DHT only if none of them has it.
        providers = self.membership.live_providers()
        # a line on a terminal, 2 in logs
        with host_progress(self.host, f"checkpoint of round {round_index}"):
            try:
                self.host.fetch_blob(content_hash.hex(), staged, providers=providers or None,
                                     timeout=self.cfg.p2p.transfer_timeout)
            except P2PError as exc:
                logger.info("checkpoint not fetched from live peers (%s); asking the DHT", exc)
                self.host.fetch_blob(content_hash.hex(), staged, timeout=self.cfg.p2p.transfer_timeout)
        try:
            ckpt = read_checkpoint(staged, content_hash)  # refuses anything but the chain's bytes
            with open(staged, "rb") as f:
                os.fsync(f.fileno())
            path.parent.mkdir(parents=True, exist_ok=True)
            os.replace(staged, path)  # the checked file itself, not a copy of its bytes held in memory
        finally:
            staged.unlink(missing_ok=True)
        return ckpt

    # -- after the pipeline broke ----------------------------------------------------------
    def await_partner(self, broken: PipelineBroken, unfinished: list[int]) -> tuple[int, list[int]] | None:
        """Sit rounds out until the cluster's pipeline is formed again; return where to re-enter (None: asked
        to stop, or the run's last round finished meanwhile).

        The round being trained is abandoned (nothing was sent for it). Meanwhile the node
        finishes every round the other replicas close, as a non-contributor (its stage stays
        current, it still coordinates, attests and signs records), and its hellos say it
        trains and contributes to no round, so nobody waits for this replica. Once the
        restarted partner is back, both agree on the entry round as at a start (the max of
        their proposals: the round the other replicas train while it is open, and no round
        this node contributed to), and this node re-enters it as its partner does, from the
        record: :meth:`reenter`.
        """
        logger.warning("round %d: pipeline of cluster %r broke (%s); waiting for the partner to come back",
                       broken.outer_round, self.cfg.cluster, broken.reason)
        self.contributor.abandon(broken.outer_round)
        next_round = min([*unfinished, self.progress.last_finished + 1])
        unfinished.clear()
        timeout = self.cfg.round_timeout * 2 + 60
        while not self.stop.is_set():
            # Hellos now say: training no round, contributing to none. A restarted partner then
            # enters at the first round nobody else trains (a round no replica contributed to
            # could never close), and coordinators do not wait for this replica.
            self.station.contribute_from(NOT_CONTRIBUTING)
            self.progress.round = -1
            self.reporter.set_state("waiting for partner")
            self.worker.leave_pipeline()
            rejoin = PipelineRejoin(self.worker, timeout, self.stop)
            with self.coordinator.interruptible(rejoin.done.is_set):
                try:
                    while not rejoin.done.is_set():
                        if 0 < self.cfg.rounds <= next_round:
                            logger.info("the run's last round is finished here; not waiting for the partner "
                                        "to train more")
                            return None
                        self.finisher.finish(next_round)
                        next_round += 1
                except CloseInterrupted:
                    pass
                except RoundStopped:
                    return None
            held = self.finisher.held_states()
            start_round = self.agree_again(next_round, held)
            if start_round is None:
                continue
            try:
                catch_up = self.reenter(next_round, start_round, held)
            except RoundStopped:
                return None
            self.station.contribute_from(start_round)
            logger.info(
                "pipeline of cluster %r re-formed; entering at round %d (applying %s at the schedule's "
                "point)", self.cfg.cluster, start_round, catch_up or "nothing")
            return start_round, catch_up
        return None

    def agree_again(self, next_round: int, held: dict[int, dict] | None = None) -> int | None:
        """The round the re-formed pipeline agrees to enter at; None if it broke again meanwhile.

        ``held``: round -> the global state this node held after it (RoundFinisher.held_states); every
        round before ``next_round`` is applied here.
        """
        last_committed = self._last_committed()
        floor = max(next_round, self.state.get("last_contributed", -1) + 1)
        # Round t trains from the global weights of round t - 1 - pending: from the oldest held state on
        # (else from those of round next_round - 1, the ones it holds); an orphan round from `floor` on is
        # still entered (no_orphan_round).
        oldest = min([next_round - 1, *(r for r in (held or {}) if r < next_round)])
        trainable = max(oldest + 1 + pending_after_round(self.cfg.diloco), floor)
        live_round = self.membership.live_training_round(last_committed, self.round_window())
        proposal = self.no_orphan_round(floor, max(self.open_round(live_round), trainable), last_committed)
        try:
            return self.worker.agree_on_round(proposal)
        except PipelineError as exc:
            logger.warning("pipeline of cluster %r broke again while re-forming (%s)", self.cfg.cluster, exc)
            return None

    def reenter(self, next_round: int, start_round: int, held: dict[int, dict]) -> list[int]:
        """Put this node's stages where ``start_round`` starts, as its restarted partner's: the rounds still
        to apply before it (at the schedule's point) returned.

        Round t trains from the global weights of round ``base = t - 1 - pending``. Rounds up to
        ``base`` not finished here yet are caught up now; then every held stage restarts from the
        global state of ``base`` (:meth:`ReplicaWorker.restart_from`: local = global, a fresh
        inner optimizer, a zero residual), which is what the partner restored from the checkpoint of
        ``base``, so both train the round from states the record alone gives (their start states are
        bound and re-executed as a restart's, training.reexec.restart_state_reason). A survivor
        that had applied past ``base`` while sitting rounds out (it finishes the rounds the others
        close) goes back to its held state of ``base``, and the rounds after it that it finished
        are absorbed again from the results it had (RoundFinisher.replay): fetched, sealed,
        attested and signed once only. Without a held state of ``base`` (an orphan round,
        no_orphan_round) it keeps its weights and enters as before.
        """
        base = start_round - 1 - pending_after_round(self.cfg.diloco)
        # nothing applied in this life yet: the engines hold that round's state
        if next_round - 1 not in held:
            held = {**held, next_round - 1: {stage: self.worker.global_state(stage)
                                                 for stage in self.worker.stages}}
        for outer_round in range(next_round, base + 1):
            if self.stop.is_set():
                raise RoundStopped("stopped while catching up to re-enter")
            self.finisher.finish(outer_round)
        held = {**held, **self.finisher.held_states()}
        # Finished here already (a replay registered before and not consumed yet, the pipeline breaking
        # again before that round's apply, counts: progress.last_finished does not move back).
        finished = max(next_round - 1, self.progress.last_finished)
        replayed = range(base + 1, min(finished + 1, start_round))
        if base < 0 or any(r not in held for r in (base, *replayed)):
            logger.warning(
                "round %d: no global state of round %d held here; re-entering with the weights held "
                "(rounds from %d applied)", start_round, base, next_round - 1)
            return list(range(max(next_round, base + 1), start_round))
        self.contributor.join_engine_work()  # nothing on the lane reads the engines while they restart
        for stage in self.worker.stages:
            weights, momentum = held[base][stage]
            self.worker.restart_from(stage, weights, momentum, base)
        for outer_round in replayed:
            self.finisher.replay(outer_round, held[outer_round])
        return list(range(base + 1, start_round))

    def _last_committed(self) -> int:
        """The chain's last committed round (this node's committer may lag it), or the last it saw."""
        try:
            return self.chain.last_round(self.run_id)
        except DLX_ERRORS as exc:
            logger.debug("chain read failed (%s); using the last commit this node saw", exc)
            return self.progress.last_commit
