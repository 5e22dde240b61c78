"""A checkpoint round's full checkpoint, built from the stage shards its holders attested (committer step 3).

Every node builds the same bytes from the same verified tensors, so every node can serve the
checkpoint the record names, and every node applies one rule to every stage, its own included (its
own shard is one of the attested shards, read from its disk, never privileged): a stage's state is
taken from the shards its holders attested with the round's agreed weights hash, each re-hashed; in
a chunked run, the shard whose momentum the agreed stage leaf commits (one holder serving other
momentum is dropped, not a lost checkpoint); in a hashed run, where the momentum is in no record,
only when every verified shard agrees on it. The metadata comes from the run document, never from a
peer's shard. A round whose committed checkpoint this node did not build is fetched and checked
against the run and the record instead (:meth:`CheckpointBuilder.committed_problems`).

In a header-hashed run (``diloco.checkpoint_hash = "header"``, node/store/checkpoint_hash.py) the record names
the hash of the checkpoint's header, which every node builds from the run document and the agreed stage
hashes and leaves: a node verifies only the stages it holds, by the same rule, and fetches no other stage's
shard (:meth:`CheckpointBuilder._header_hashed`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from ledger.errors import LedgerInputError
from node.errors import DLX_ERRORS, StateError
from node.live.exchange.pool import serve_blob
from node.store.checkpoint_hash import checkpoint_header, header_hash, metadata_only
from node.store.checkpoint_split import (alias_split, assemble_checkpoint, checkpoint_digest, header_key,
                                         keeps_split, shard_path, split_stages, stage_key, write_split)
from node.store.readback import moved
from node.store.checkpoint_stage import check_stage
from node.store.checkpoint import (build_checkpoint, checkpoint_problems, chunked_problems, read_checkpoint,
                                   stage_problems, write_checkpoint)
from node.fraudproof import parse_stage_leaf
from p2p.blobstore import hash_file
from training.hashing import stage_weights_hash
from training.spilled import spill_float32

logger = logging.getLogger(__name__)


def _momentum_root(momentum) -> bytes:
    """The chunk root of a stage's momentum, as a chunked run's stage leaf commits it (training.chunks)."""
    from ledger.chunkproof import tree_root
    from training.chunks import tensor_leaves

    return tree_root(tensor_leaves(momentum))


class CheckpointBuilder:
    """Builds, serves and checks a round's full checkpoint for one node's committer (module docstring)."""

    def __init__(self, node) -> None:
        # the committer's node.live.record.committer.CommitterContext (not imported: no cycle)
        self.node = node
        self.chosen: dict[int, bytes] = {}  # stage -> the shard hash its state came from (the last build)

    def assemble(self, outer_round: int, atts, stage_hashes: list[bytes],
                 stage_leaves: list[bytes] = ()) -> bytes | None:
        """Build the full checkpoint from stage states verified against the round's agreed stage hashes;
        serve it; return its content hash (None: no checkpoint this round).

        Every stage, held here or not, comes from the shards its holders attested with the agreed
        weights hash (this node's own among them, read from its disk: it is not privileged, so every
        node that heard the same attestations decides alike): each is re-hashed, and one whose weights
        are not the agreed ones (or not the run's stage) is dropped. In a chunked run the agreed stage
        leaf commits the momentum, so the first shard whose momentum is the leaf's is taken (every such
        shard gives the same bytes) and any other is dropped: one holder serving other momentum costs the
        round nothing. In a hashed run the momentum is in no record, so it is taken only when every
        verified shard agrees on it; otherwise the round has no checkpoint, for every node alike. The
        metadata is written from the run document, never copied from a peer's shard, so every node that
        verified the same tensors builds the same bytes.
        """
        node = self.node
        layout = node.layout
        states = {}
        self.chosen = {}
        if layout.header_hashed:
            return self._header_hashed(outer_round, atts, stage_hashes, list(stage_leaves))
        for stage in range(layout.num_stages):
            leaf = stage_leaves[stage] if layout.chunked and stage < len(stage_leaves) else None
            state = self._verified_stage(outer_round, stage, atts, stage_hashes[stage], leaf)
            if state is None:
                return None
            states[stage] = self._spilled(outer_round, stage, state)
            del state
        full = build_checkpoint(layout, outer_round, states, dict(enumerate(stage_leaves)))
        # a chunked run's stage leaves commit the momentum too: the whole must be the agreed leaves
        if layout.chunked:
            problems = chunked_problems(full, layout, None)
            if problems:
                logger.warning(
                    "round %d: the verified shards are not the agreed stage leaves (%s); no checkpoint",
                    outer_round, "; ".join(problems))
                return None
        if keeps_split(node.cfg.storage.checkpoints, layout):
            return self._keep_split(outer_round, *checkpoint_digest(full))  # hashed as it would be written
        path = node.checkpoint_dir / f"round-{outer_round:08d}.safetensors"
        digest = write_checkpoint(path, full)
        serve_blob(node.host, path, link=True)  # one copy on disk: the store links the file
        for stage, shard in self.chosen.items():  # this node's state read back from its shard: from here
            own = node.book.snapshot_attestations(outer_round, stage).get(node.peer_id)
            if own is not None and own.shard_hash == shard:  # the file holds the bytes of this node's shard
                moved(shard_path(node.checkpoint_dir, outer_round, stage), path)
        logger.info("round %d: checkpoint %s (%d bytes)", outer_round, digest.hex()[:12], path.stat().st_size)
        return digest

    def _header_hashed(self, outer_round: int, atts, stage_hashes: list[bytes],
                       stage_leaves: list[bytes]) -> bytes | None:
        """A header-hashed run's checkpoint (``diloco.checkpoint_hash = "header"``, node/store/
        checkpoint_hash.py): only the stages this node holds are verified, each by :meth:`assemble`'s rule
        (its own shard from its disk first) and against its agreed leaf and weights hash; the header is
        built from the run document and the round's agreed stage hashes and leaves, and its hash is the
        record's. No other stage's shard is fetched: its holders vouch for it, its leaf commits it, and
        whoever reads it checks it against that leaf. Keeps the header and this node's shards (split)."""
        node = self.node
        layout = node.layout
        if len(stage_leaves) != layout.num_stages or len(stage_hashes) != layout.num_stages:
            logger.warning("round %d: %d agreed stage leaves for %d stages; no checkpoint", outer_round,
                           len(stage_leaves), layout.num_stages)
            return None
        meta = metadata_only(layout, outer_round, dict(enumerate(stage_hashes)),
                             dict(enumerate(stage_leaves)))
        held = {s for s in range(layout.num_stages)
                if node.peer_id in node.membership.holders(s) or self._own_hash(outer_round, s) is not None}
        for stage in sorted(held):
            state = self._verified_stage(outer_round, stage, atts, stage_hashes[stage], stage_leaves[stage])
            try:
                if state is None:
                    raise StateError(f"no shard of stage {stage} verified")
                check_stage(meta, layout, stage, parse_stage_leaf(stage_leaves[stage], stage), *state)
            except (StateError, LedgerInputError) as exc:
                logger.warning("round %d: this node's stage %d is not the agreed state (%s); no checkpoint",
                               outer_round, stage, exc)
                return None
            del state
        header = checkpoint_header(layout, meta)
        return self._keep_split(outer_round, header_hash(header), header)

    def _keep_split(self, outer_round: int, digest: bytes, header: bytes) -> bytes:
        """``storage.checkpoints = "stages"`` (always in a header-hashed run): keep and serve the checkpoint's
        header and this node's own shards of the stages whose verified state they are, not the whole file
        (node/store/checkpoint_split.py), under the keys of ``digest``, the content hash the record names."""
        node = self.node
        own = {stage: shard.hex() for stage, shard in self.chosen.items()
               if shard == self._own_hash(outer_round, stage)}
        head, _listing = write_split(node.checkpoint_dir, outer_round, digest, header, own)
        header_sha = serve_blob(node.host, head, link=True)
        alias_split(node.host, digest, header_sha, own)
        logger.info("round %d: checkpoint %s kept as its header and this node's stage shards %s (not whole)",
                    outer_round, digest.hex()[:12], sorted(own))
        return digest

    def _spilled(self, outer_round: int, stage: int, state):
        """A verified stage's (weights, momentum) moved to an unnamed file until the checkpoint is written
        (training/spilled.py): the node holds one stage at a time, not the whole model (issue 75: 8 bytes per
        parameter of the model, S times a stage of an S-stage run). A disk that cannot take them keeps them
        in RAM (said)."""
        try:
            return tuple(spill_float32(part, self.node.checkpoint_dir) for part in state)
        except OSError as exc:
            logger.warning("round %d: stage %d's verified state kept in RAM for the checkpoint (not "
                           "spilled: %s)", outer_round, stage, exc)
            return state

    def _verified_stage(self, outer_round: int, stage: int, atts, weights_hash: bytes,
                        stage_leaf: bytes | None = None):
        """(weights, momentum) of ``stage`` from its holders' shards, verified (see :meth:`assemble`);
        ``stage_leaf``: a chunked run's agreed leaf of the stage, which names the momentum to take.

        In a chunked run the first shard that verifies against the leaf is the stage's state, whatever else
        is offered (its own shard first, read from disk): the holders are waited for only if none of the
        shards heard so far does. In a hashed run every verified shard must agree, so every live holder is
        waited for first."""
        momentum_root = self._leaf_momentum_root(outer_round, stage, stage_leaf)
        judged: set[bytes] = set()
        verified = {}
        own_hash = self._own_hash(outer_round, stage)
        for wait in ((False, True) if momentum_root is not None else (True,)):
            if wait:
                self._wait_for_holders(outer_round, stage)
            offered = self._offered(outer_round, stage, atts, weights_hash)
            order = sorted(set(offered) - judged, key=lambda h: (h != own_hash, -len(offered[h]), h))
            for shard_hash in order:
                judged.add(shard_hash)
                state = self._judged(outer_round, stage, shard_hash, offered[shard_hash], weights_hash,
                                     momentum_root)
                if state is not None and momentum_root is not None:
                    self.chosen[stage] = shard_hash
                    return state
                if state is not None:
                    verified[stage_weights_hash(state[1])] = state
        if not judged:
            logger.warning("round %d: no shard of stage %d attested with the agreed weights; no checkpoint",
                           outer_round, stage)
            return None
        if len(verified) != 1:
            logger.warning("round %d: %s; no checkpoint this round", outer_round,
                           f"no shard of stage {stage} verified" if not verified else
                           f"the verified shards of stage {stage} hold {len(verified)} different momenta")
            return None
        return next(iter(verified.values()))

    def _wait_for_holders(self, outer_round: int, stage: int) -> None:
        """Wait for every live holder's attestation of ``stage`` (attestations still in flight), so a shard
        is judged against all of them: the more holders heard, the likelier an honest shard is among the
        offers and a disagreement on the momentum is seen. Members that judged different sets could sign
        different records (one built a checkpoint, another saw two momenta), so the wait lasts up to the
        round deadline, not a fixed moment that a slow link outlasts (docs/P2P.md)."""
        node = self.node
        expected = set(node.membership.holders(stage)) & (node.membership.alive() | {node.peer_id})
        node.book.wait_for(lambda: expected <= set(node.book.snapshot_attestations(outer_round, stage))
                           or None,
                           timeout=self.holders_wait(outer_round, stage), stop=node.stop_event)

    def _offered(self, outer_round: int, stage: int, atts, weights_hash: bytes) -> dict[bytes, list[str]]:
        """shard hash -> the peers that attested it with the agreed weights hash, of what was heard."""
        heard = {**atts[stage], **self.node.book.snapshot_attestations(outer_round, stage)}
        offered: dict[bytes, list[str]] = {}
        for peer, att in sorted(heard.items()):
            if att.shard_hash and att.weights_hash == weights_hash:
                offered.setdefault(att.shard_hash, []).append(peer)
        return offered

    def _judged(self, outer_round: int, stage: int, shard_hash: bytes, peers: list[str], weights_hash: bytes,
                momentum_root: bytes | None):
        """(weights, momentum) of the attested shard ``shard_hash`` if it is the agreed state of the stage
        (its momentum the leaf's, in a chunked run), else None (logged with its attesters)."""
        holders = ", ".join(p[-8:] for p in peers)
        shard = self._shard(outer_round, stage, shard_hash, holders)
        if shard is None:
            return None
        problems = stage_problems(self.node.layout, stage, shard.weights, shard.momentum, weights_hash)
        if not problems and momentum_root is not None and _momentum_root(shard.momentum) != momentum_root:
            problems = [f"its momentum is not the one stage {stage}'s agreed leaf commits"]
        if problems:
            logger.error("round %d: shard %s of stage %d, attested by %s, is not the agreed state: %s",
                         outer_round, shard_hash.hex()[:12], stage, holders, "; ".join(problems))
            return None
        return shard.weights, shard.momentum

    def _leaf_momentum_root(self, outer_round: int, stage: int, stage_leaf: bytes | None) -> bytes | None:
        """The momentum chunk root ``stage_leaf`` commits (None: a hashed run's stage, or a leaf that does not
        parse, which chunked_problems then names)."""
        if not stage_leaf:
            return None
        try:
            return parse_stage_leaf(stage_leaf, stage).momentum_root
        except LedgerInputError as exc:
            logger.warning("round %d: the agreed leaf of stage %d does not parse: %s", outer_round, stage,
                           exc)
            return None

    def _local(self, outer_round: int, stage: int) -> Path:
        """Where this node's own shard of ``stage`` is (the bytes it attested, if it holds the stage)."""
        return self.node.checkpoint_dir / f"shard-{outer_round:08d}-stage{stage}.safetensors"

    def _own_hash(self, outer_round: int, stage: int) -> bytes | None:
        """sha256 of this node's own shard of ``stage`` (hashed in reads), None if it holds none."""
        try:
            return bytes.fromhex(hash_file(self._local(outer_round, stage)))
        except FileNotFoundError:
            return None

    def _shard(self, outer_round: int, stage: int, shard_hash: bytes, holders: str):
        """The attested shard ``shard_hash`` of ``stage``: this node's own from its disk (the same bytes it
        attested), any other fetched from its holders; None if not fetched. Read from the file, never whole
        in memory (read_checkpoint)."""
        local = self._local(outer_round, stage)
        if local.exists():
            try:
                return read_checkpoint(local, shard_hash)
            except StateError:
                pass  # not the attested bytes (or unreadable): fetched from the holders instead
        try:
            return self._fetch_checkpoint_file(shard_hash)
        except DLX_ERRORS as exc:
            logger.warning("round %d: shard %s of stage %d (attested by %s) not fetched: %s", outer_round,
                           shard_hash.hex()[:12], stage, holders, exc)
            return None

    def holders_wait(self, outer_round: int, stage: int, now: float | None = None) -> float:
        """Seconds left to wait for the attestations of ``stage``'s holders: until the round deadline,
        ``round_timeout`` after the stage's first close reached this node (measured by the book; the
        whole ``round_timeout`` where no close was seen). Holders attest after aggregating the closed
        set, so an honest one is in by then whatever its link; a committer catching up after an RPC
        outage, long past the deadline, does not wait at all."""
        node = self.node
        closed_at = node.book.first_close_at(outer_round, stage)
        if closed_at is None:
            return node.cfg.round_timeout
        now = time.monotonic() if now is None else now
        return max(0.0, closed_at + node.cfg.round_timeout - now)

    def _fetch_checkpoint_file(self, content_hash: bytes):
        """A checkpoint or stage shard from the peers, by its content hash (nothing of it kept on disk)."""
        node = self.node
        dest = node.incoming_dir / f"{content_hash.hex()}.part"
        dest.parent.mkdir(parents=True, exist_ok=True)
        held = node.host.has_blob(content_hash.hex())  # this node serves it already (its own): kept
        try:
            node.host.fetch_blob(content_hash.hex(), dest, timeout=node.cfg.p2p.transfer_timeout)
            return read_checkpoint(dest, content_hash)
        finally:
            dest.unlink(missing_ok=True)
            if not held:  # the fetch kept a copy in the blob store: never pruned with the checkpoints, so
                node.host.remove_blob(content_hash.hex())  # dropped (the holders serve their shards)

    def _fetch_split(self, outer_round: int, content_hash: bytes, weights_root: bytes, stages=None):
        """The checkpoint ``content_hash`` from its header and stage shards as the live peers serve them under
        their keys (node/store/checkpoint_split.py), each checked; nothing kept on disk. Assembled whole and
        checked against the record's hash in a file-hashed run; in a header-hashed run only ``stages`` are
        fetched (the header's hash is the record's, each stage is checked against its leaf)."""
        node = self.node
        peers = node.membership.live_providers()
        timeout = node.cfg.p2p.transfer_timeout

        def remote(key: str) -> list:
            return [lambda offset, length, peer=peer: node.host.fetch_blob_range(key, offset, length, peer,
                                                                                timeout=timeout)
                    for peer in peers]

        def shards(stage: int) -> list:
            return remote(stage_key(content_hash, stage))

        if node.layout.header_hashed:
            return split_stages(remote(header_key(content_hash)), shards, node.layout, outer_round,
                                weights_root, stages or (), content_hash)
        dest = node.incoming_dir / f"{content_hash.hex()}.assembled"
        try:
            assemble_checkpoint(remote(header_key(content_hash)), shards, node.layout, outer_round,
                                weights_root, content_hash, dest)
            return read_checkpoint(dest, content_hash)
        finally:
            dest.unlink(missing_ok=True)

    def committed_problems(self, outer_round: int, content_hash: bytes, weights_root: bytes) -> list[str]:
        """Why the committed checkpoint of a round is not the run's (empty: it verifies).

        For a round this node built no checkpoint of (a momentum disagreement, a shard not
        fetched): fetch the committed one and check it against the run document and the record,
        and this node's own stages against its own state (momentum included). In a header-hashed run
        only its header and this node's stages are fetched (the header commits every stage's leaf); where
        the run's nodes keep checkpoints split, the split is tried before the whole file.
        """
        node = self.node
        layout = node.layout
        held = [s for s in range(layout.num_stages) if self._local(outer_round, s).exists()]
        if layout.header_hashed:
            try:
                ckpt = self._fetch_split(outer_round, content_hash, weights_root, held)
            except DLX_ERRORS as exc:
                return [f"not fetched from its stages' holders: {exc}"]
            problems = []
        else:
            ckpt, why = self._fetched_whole_or_split(outer_round, content_hash, weights_root)
            if ckpt is None:
                return [why]
            problems = checkpoint_problems(ckpt, layout, outer_round, weights_root)
        for stage in held:
            if problems:
                break
            own = read_checkpoint(self._local(outer_round, stage))
            names = layout.stage_names(stage)
            if stage_weights_hash({n: ckpt.momentum[n] for n in names}) != stage_weights_hash(own.momentum):
                problems.append(f"its stage {stage} momentum is not this node's")
        return problems

    def _fetched_whole_or_split(self, outer_round: int, content_hash: bytes, weights_root: bytes):
        """(the file-hashed checkpoint ``content_hash``, "") fetched whole or assembled from its stages'
        holders, the split first where this node keeps the run's checkpoints split (its peers then hold no
        whole file to ask each of for); (None, why neither was fetched)."""
        node = self.node
        ways = [("not fetched", lambda: self._fetch_checkpoint_file(content_hash))]
        if node.layout.chunked:  # its holders may keep it split (storage.checkpoints = "stages")
            split = ("nor assembled from its stages' holders",
                     lambda: self._fetch_split(outer_round, content_hash, weights_root))
            first = keeps_split(node.cfg.storage.checkpoints, node.layout)
            ways = [split, *ways] if first else [*ways, split]
        errors = []
        for what, fetch in ways:
            try:
                return fetch(), ""
            except DLX_ERRORS as exc:
                errors.append(f"{what}: {exc}")
        return None, "; ".join(errors)
