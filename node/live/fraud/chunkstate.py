"""A chunked run's stage states (a scheme whose ``chunked`` is true: node/commitments/; docs/FRAUD_PROOF.md).

In a chunked run the record's weights root is version 2: the Merkle root over one stage leaf per stage
(ledger.chunkproof), each the roots of the stage's weights and outer momentum cut into chunks and the hash
of the round's factors. After a round's outer step the finisher hands this node's new state of each held
stage to :meth:`ChunkedStates.record`, which

- derives the :class:`ledger.chunkproof.StageState` (the chunk leaves, the factors, every accepted
  contribution's payload pieces: the scheme's ``stage_state_of``) and keeps it a few rounds, for the
  attestation (its stage leaf) and for a fraud proof of a later round (node/live/fraud/prover.py);
- publishes the state: the stage's weights and momentum, as a stage shard, served to any peer under the
  alias ``sha256(stage leaf)``. A prover that derived another leaf than the committed one fetches the
  committed state from an attester of that leaf (:meth:`ChunkedStates.committed_state`) and checks it
  against the leaf's roots before opening any chunk of it. The payload pieces are not published: every
  holder derives them from the contributions it aggregated, and the committed factors name their roots.
- publishes what the run's scheme adds beside it (``published_parts``): in a version-3 run the factors and
  each accepted contribution's per-chunk sums of squares under ``norms_key(stage leaf)``, which a prover
  whose own factors differ opens (:meth:`ChunkedStates.committed_norms`) to prove a wrong scale or sum.

Only the last ``PUBLISHED_ROUNDS`` rounds' states stay in memory; an older one whose dispute window is open
(or the next round's, for a node that defends its contributions: a case disputes that round's start) is
written to ``spill_dir``, read back only when a challenge asks; without its weights and momentum when the
published state holds them (the file names that blob, which lives as long: issue 75), and with the codec
blobs in place of the payload pieces when those cut back to them (in memory, a soak's largest growth).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
from collections.abc import Sequence
from pathlib import Path

from ledger.chunkproof import StageLeaf, StageState, tree_root
from ledger.normproof import SUM_BYTES, parse_norm_state
from node.commitments.chunked import norms_key
from node.config import NodeConfig
from node.errors import DLX_ERRORS
from node.live.fraud.window import DisputeWindow
from node.fsutil import atomic_write_bytes, is_disk_full, report_disk_full
from node.live.fraud.leftout import CUT_ERRORS, left_out_pieces, rejected_pieces
from node.live.fraud.spillfile import SpilledStateError, decode_spilled, encode_spilled
from node.live.fraud.stateserve import StatesOnAsk, fetch_published, states_on_ask
from node.store.checkpoint import Checkpoint, RunLayout, parse_checkpoint, stage_problems, write_checkpoint
from node.store.safetensors_stream import data_ranges
from node.store.rewardsources import write_stage
from p2p.host import P2PHost
from training.chunks import CutPayload, cut_payload, tensor_leaves
from training.robust import ContributionReport

logger = logging.getLogger(__name__)

#: Rounds of published state kept behind the oldest round the committer has not handled yet, at least; a round
#: whose availability can still be challenged on chain is kept beyond (node/live/fraud/window.py).
PUBLISHED_ROUNDS = 4
#: The directory under the node's data directory where
#: states older than PUBLISHED_ROUNDS wait for their window.
CHUNK_STATES_DIR = "chunk-states"
#: A committed state fetched from an attester is refused above this many bytes (the stage's float32 weights
#: and momentum, with the safetensors header: generously).
STATE_SLACK_BYTES = 1 << 20


def state_key(stage_leaf: bytes) -> str:
    """The alias a stage's published state is served under: ``sha256(stage leaf)`` (hex)."""
    return hashlib.sha256(stage_leaf).hexdigest()


class ChunkedStates:
    """This node's stage states of recent rounds in a chunked run, and their publication (module
    docstring)."""

    def __init__(self, *, cfg: NodeConfig, host: P2PHost, layout: RunLayout, config_hash: bytes,
                 window: DisputeWindow | None = None, spill_dir: Path | None = None,
                 evidence_dir: Path | None = None, sources_dir: Path | None = None,
                 keeps_starts: bool = False) -> None:
        self.cfg = cfg
        self.keeps_starts = keeps_starts  # also kept until round r + 1's window closes: a case disputes it
        self.scheme = cfg.commitment_scheme  # what a state holds and what is published beside it
        self.window = window  # None: rounds are kept PUBLISHED_ROUNDS only (tests without a chain)
        self.host = host
        self.layout = layout
        self.config_hash = config_hash
        self.spill_dir = spill_dir  # None: every kept state stays in memory
        # where the exchange keeps the signed envelopes it rejected (a payload that does not decode is never
        # closed here, but a quorum may list it: pieces_of cuts it from there); None: not looked at
        self.evidence_dir = evidence_dir
        # where a version-3 stage's leaf and factors are kept for its contributors' reward claims (issue 77:
        # node/store/rewardsources.py); None: not kept
        self.sources_dir = sources_dir
        self._lock = threading.Lock()
        self._states: dict[int, dict[int, StageState]] = {}  # round -> stage -> state
        self._spilled: dict[int, set[int]] = {}  # round -> stages whose state is in spill_dir, not in memory
        self._served: dict[int, list[str]] = {}  # round -> blobs published
        # round -> stage -> the blob of its published state (weights, momentum) and of what the scheme
        # publishes beside it (a version-3 stage's factors, sum trees): a spilled state names them (_thin)
        self._published: dict[int, dict[int, str]] = {}
        self._published_norms: dict[int, dict[int, str]] = {}
        # round -> stage -> the accepted contributions' codec blobs, until the round is spilled (_thin)
        self._payloads: dict[int, dict[int, list[bytes]]] = {}
        # round -> stage -> payload root -> pieces of the contributions this node closed but left out
        self._left_out: dict[int, dict[int, dict[bytes, list[bytes]]]] = {}
        # published states written only when asked or spilled (node/live/fraud/stateserve.py); None: at once
        self.on_ask: StatesOnAsk | None = None
        if spill_dir is not None:  # an earlier life's states: not this life's (it re-derives what it attests)
            spill_dir.mkdir(parents=True, exist_ok=True)
            for leftover in [*spill_dir.glob("*.state"), *spill_dir.glob("*.publish"),
                             *spill_dir.glob("*.asked")]:
                leftover.unlink(missing_ok=True)
            self.on_ask = states_on_ask(cfg, host, spill_dir, layout, config_hash, self.state, self._written)

    def record(self, outer_round: int, stage: int, weights: dict, momentum: dict,
               reports: Sequence[ContributionReport], payloads: Sequence[bytes],
               envelopes: Sequence[bytes], bindings: Sequence | None = None) -> bytes:
        """Derive, keep and publish this node's state of ``stage`` after ``outer_round``; its stage leaf
        (bytes).

        ``payloads``: the closed contributions' codec blobs, ``envelopes``: their envelope digests (the
        contributions root's leaves), both in the close's order; ``reports``: the aggregation's, one each;
        ``bindings``: each one's ``(contributor, signature)`` from its body (a version-3 run; issue 62).
        """
        state = self.scheme.stage_state_of(stage, weights, momentum, reports, payloads, self.cfg.diloco,
                                           outer_round, envelopes=envelopes, bindings=bindings,
                                           decode_args={"stage_index": stage, "outer_round": outer_round,
                                                        "refuse_raw": self.cfg.compression.enabled})
        leaf = state.leaf().encode()
        if self.sources_dir is not None and state.factors.norms is not None:
            write_stage(self.sources_dir, outer_round, stage, leaf, state.factors.encode())
        left_out = left_out_pieces(reports, payloads, weights)
        with self._lock:
            self._states.setdefault(outer_round, {})[stage] = state
            self._left_out.setdefault(outer_round, {})[stage] = left_out
            if self.spill_dir is not None:
                self._payloads.setdefault(outer_round, {})[stage] = [payloads[r.index] for r in reports
                                                                     if r.accepted]
        self.publish(outer_round, stage, leaf, weights, momentum)
        for alias, blob in self.scheme.published_parts(leaf, state):
            self.publish_part(outer_round, stage, alias, blob)
        return leaf

    def publish_part(self, outer_round: int, stage: int, alias: str, blob: bytes) -> None:
        """Serve what the run's scheme publishes beside a stage's state (a version-3 stage's factors and sum
        trees under ``norms_key(leaf)``: module docstring), compressed with a spill directory
        (:meth:`_provide`)."""
        try:
            digest = self._provide(outer_round, stage, blob)
            self.host.provide_alias(alias, digest)
        except (*DLX_ERRORS, OSError) as exc:
            logger.warning("round %d stage %d: %s not published: %s", outer_round, stage, alias[:12], exc)
            return
        with self._lock:
            self._served.setdefault(outer_round, []).append(digest)
            self._published_norms.setdefault(outer_round, {})[stage] = digest

    def publish(self, outer_round: int, stage: int, leaf: bytes, weights: dict, momentum: dict) -> None:
        """Serve the stage's state (a stage shard) under ``state_key(leaf)`` (module docstring); with
        :attr:`on_ask`, only its hash now, its bytes when asked (node/live/fraud/stateserve.py)."""
        shard = Checkpoint(self.layout.run_id, outer_round, dict(self.layout.model_config), self.config_hash,
                           {}, weights, momentum)
        if self.on_ask is not None and self.on_ask.publish(state_key(leaf), shard, stage):
            return
        try:
            digest = self._provide(outer_round, stage, shard)
            self.host.provide_alias(state_key(leaf), digest)
        except (*DLX_ERRORS, OSError, ValueError) as exc:
            logger.warning("round %d stage %d: state not published (a prover will challenge it): %s",
                           outer_round, stage, exc)
            return
        with self._lock:
            self._served.setdefault(outer_round, []).append(digest)
            self._published.setdefault(outer_round, {})[stage] = digest

    def _written(self, outer_round: int, stage: int, _key: str, digest: str) -> None:
        """A published state written when asked or spilled is served as one written when published."""
        with self._lock:
            self._served.setdefault(outer_round, []).append(digest)
            self._published.setdefault(outer_round, {})[stage] = digest

    def _provide(self, outer_round: int, stage: int, data: Checkpoint | bytes) -> str:
        """Store and serve a published state (a stage shard) or a part beside it (bytes); its sha256 hex. With
        a spill directory it is written there and kept as a packed blob (p2p/blobpack.py): a state's tensors'
        data as pieces shared by content with this node's start states, which hold the same global weights
        and momentum (issue 75: 2 of a start state's copies of the stage, kept again here for the whole proof
        window); a part (a version-3 stage's sum trees: 91-96% zero bytes) as compressed pieces."""
        if self.spill_dir is None:
            blob = data if isinstance(data, bytes) else data.to_bytes()
            return self.host.provide_blob(blob, announce=False)
        path = self.spill_dir / f"round-{outer_round:08d}-stage-{stage}.publish"
        try:
            if isinstance(data, bytes):
                atomic_write_bytes(path, data, durable=False)
                return self.host.provide_packed(path, [], compress=True)
            write_checkpoint(path, data)
            return self.host.provide_packed(path, data_ranges(path))
        finally:
            path.unlink(missing_ok=True)

    def state(self, outer_round: int, stage: int) -> StageState | None:
        """This node's state of ``stage`` after ``outer_round``, if still held (in memory, or spilled)."""
        with self._lock:
            held = self._states.get(outer_round, {}).get(stage)
            spilled = stage in self._spilled.get(outer_round, ())
        if held is not None or not spilled:
            return held
        path = self._spill_path(outer_round, stage)
        try:
            spilled = decode_spilled(path.read_bytes())
            return spilled if isinstance(spilled, StageState) else self._rejoin(outer_round, spilled)
        except FileNotFoundError:  # dropped meanwhile: its window closed
            return None
        except (OSError, SpilledStateError) as exc:  # the state is lost: answer as for a state not held
            logger.warning("spilled state of round %d stage %d unreadable (%s): not served", outer_round,
                           stage, exc)
            return None

    def pieces_of(self, outer_round: int, stage: int, payload_root: bytes) -> list[bytes] | None:
        """The payload pieces under ``payload_root`` of a contribution this node closed in the round: one it
        aggregated (its state's), or one it left out whose pieces could still be cut (a rank past the run's,
        which a quorum may list: node/live/fraud/values.py); None if neither."""
        with self._lock:
            left_out = self._left_out.get(outer_round, {}).get(stage, {})
        if payload_root in left_out:
            return left_out[payload_root]
        state = self.state(outer_round, stage)
        roots = state.factors.payload_roots if state is not None else ()
        if payload_root in roots:
            return state.payload_leaves[roots.index(payload_root)]
        if self.evidence_dir is None:
            return None
        return rejected_pieces(self.evidence_dir, outer_round, stage, self.layout.stage_shapes[stage],
                               payload_root)

    def held(self) -> list[tuple[int, int]]:
        """The ``(round, stage)`` pairs whose states are held (in memory or spilled)."""
        with self._lock:
            pairs = {(r, s) for r, stages in self._states.items() for s in stages}
            pairs |= {(r, s) for r, stages in self._spilled.items() for s in stages}
        return sorted(pairs)

    def in_memory(self) -> list[int]:
        """The rounds whose states are held in memory (not spilled)."""
        with self._lock:
            return sorted(self._states)

    def replace(self, outer_round: int, stage: int, state: StageState) -> None:
        """Hold ``state`` as this node's state of the round (a re-base on the record took it)."""
        with self._lock:
            self._states.setdefault(outer_round, {})[stage] = state
            self._spilled.get(outer_round, set()).discard(stage)
        if self.sources_dir is not None and state.factors.norms is not None:  # the record's, for claims
            write_stage(self.sources_dir, outer_round, stage, state.leaf().encode(), state.factors.encode())

    def _spill_path(self, outer_round: int, stage: int) -> Path:
        assert self.spill_dir is not None
        return self.spill_dir / f"round-{outer_round:08d}-stage-{stage}.state"

    def _spill(self, rounds: list[int]) -> None:
        """Move the states of ``rounds`` from memory to ``spill_dir`` (each file written before the memory
        copy goes, so a reader finds one or the other); a published state not written yet is written first
        (the spilled state names it for its leaves)."""
        for outer_round in rounds:
            if self.on_ask is not None:
                self.on_ask.write(outer_round)
            with self._lock:
                states = dict(self._states.get(outer_round, {}))
            for stage, state in states.items():
                thin = self._thin(outer_round, state)
                atomic_write_bytes(self._spill_path(outer_round, stage), encode_spilled(thin), durable=False)
            with self._lock:
                held = self._states.get(outer_round, {})
                for stage, state in states.items():
                    if held.get(stage) is state:  # not replaced meanwhile
                        del held[stage]
                        self._spilled.setdefault(outer_round, set()).add(stage)
                if not held:
                    self._states.pop(outer_round, None)

    def _published_leaves(self, digest: str) -> tuple[list[bytes], list[bytes]]:
        """The weight and momentum leaves of the published state ``digest`` (read from the blob store)."""
        shard = parse_checkpoint(self.host.read_blob(digest))
        return tensor_leaves(shard.weights), tensor_leaves(shard.momentum)

    def _thin(self, outer_round: int, state: StageState) -> StageState | _ThinState:
        """What is spilled of ``state``: without its weight and momentum leaves when the blob this node
        publishes of it holds them, which then stays as long as the spilled file (both go when the round's
        window closes: :meth:`forget_before`), without its payload pieces when the contributions' codec
        blobs cut to them (training.chunks.cut_payload: a low-rank piece carries a row of ``Q`` per element,
        the blob only the factors), and without its sum trees when the norm state it publishes beside them
        holds them (a version-3 stage: a hash and a 96-byte sum per node, about two nodes per 64 elements of
        each accepted contribution, 2 x the stage's bytes a round in the retention bench's `tiny`); each
        checked here; the whole state when none holds."""
        with self._lock:
            digest = self._published.get(outer_round, {}).get(state.stage)
            norms = self._published_norms.get(outer_round, {}).get(state.stage)
            blobs = self._payloads.get(outer_round, {}).get(state.stage)
        published = digest if digest is not None and self._holds_leaves(outer_round, digest, state) else None
        payloads = self._payload_blobs(state, blobs)
        norms = norms if norms is not None and state.sum_trees and self._holds_trees(norms, state) else None
        if published is None and payloads is None and norms is None:
            return state
        bare = dataclasses.replace(state, weight_leaves=[] if published else state.weight_leaves,
                                   momentum_leaves=[] if published else state.momentum_leaves,
                                   payload_leaves=[] if payloads is not None else state.payload_leaves,
                                   sum_trees=[] if norms is not None else state.sum_trees)
        return _ThinState(published, state.leaf(), bare, payloads, self._shapes(state.stage), norms)

    def _published_trees(self, digest: str, leaf: StageLeaf) -> list:
        """The sum trees of the published norm state ``digest`` (read from the blob store), checked against
        ``leaf``'s factors (ledger.normproof.parse_norm_state)."""
        data = self.host.read_blob(digest)
        return parse_norm_state(data, leaf.factors_hash, leaf.num_chunks)[1]

    def _holds_trees(self, digest: str, state: StageState) -> bool:
        """Whether the published norm state ``digest`` is stored and holds ``state``'s sum trees."""
        try:
            return self._published_trees(digest, state.leaf()) == list(state.sum_trees)
        except (*DLX_ERRORS, OSError, ValueError) as exc:
            logger.debug("stage %d: published norm state unreadable, its sum trees spilled: %s", state.stage,
                         exc)
            return False

    def _holds_leaves(self, outer_round: int, digest: str, state: StageState) -> bool:
        """Whether the published blob ``digest`` is stored and holds ``state``'s weights and momentum."""
        try:
            weights, momentum = self._published_leaves(digest)
        except (*DLX_ERRORS, OSError, ValueError) as exc:
            logger.debug("round %d stage %d: published state unreadable, spilled whole: %s", outer_round,
                         state.stage, exc)
            return False
        return list(state.weight_leaves) == weights and list(state.momentum_leaves) == momentum

    def _shapes(self, stage: int) -> dict | None:
        shapes = getattr(self.layout, "stage_shapes", None)
        return dict(shapes[stage]) if shapes is not None and stage < len(shapes) else None

    def _payload_blobs(self, state: StageState, blobs: Sequence[bytes] | None) -> list[bytes] | None:
        """The codec blobs of ``state``'s payload pieces in the factors' order, each cut back to its pieces
        exactly; None if one is not among ``blobs`` (the state's pieces are spilled as they are then)."""
        if state.payload_leaves and all(isinstance(p, CutPayload) for p in state.payload_leaves):
            return [pieces.blob for pieces in state.payload_leaves]  # cut from these blobs when read
        shapes = self._shapes(state.stage)
        if shapes is None or blobs is None:
            return None
        cut = {}
        for blob in blobs:
            try:
                pieces = cut_payload(blob, shapes)
            except CUT_ERRORS:
                continue
            cut[tree_root(pieces)] = (blob, pieces)
        out = []
        for root, pieces in zip(state.factors.payload_roots, state.payload_leaves, strict=True):
            if root not in cut or cut[root][1] != list(pieces):
                return None
            out.append(cut[root][0])
        return out

    def _rejoin(self, outer_round: int, thin: _ThinState) -> StageState | None:
        """The whole state of a thin spilled one (:meth:`_thin`): its leaves read back from the published blob
        and its pieces cut from the blobs, checked against the stage leaf and the payload roots; None (with a
        warning) if that blob is gone or is not it."""
        state = thin.state
        try:
            if thin.published is not None:
                weights, momentum = self._published_leaves(thin.published)
                state = dataclasses.replace(state, weight_leaves=weights, momentum_leaves=momentum)
            if thin.payloads is not None:
                pieces = [CutPayload(blob, thin.shapes) for blob in thin.payloads]
                state = dataclasses.replace(state, payload_leaves=pieces)
            if thin.norms is not None:
                state = dataclasses.replace(state, sum_trees=self._published_trees(thin.norms, thin.leaf))
        except (*DLX_ERRORS, *CUT_ERRORS) as exc:  # OSError: caller's
            logger.warning("round %d stage %d: spilled state not rebuilt (%s): not served", outer_round,
                           state.stage, exc)
            return None
        cut_wrong = thin.payloads is not None and tuple(
            tree_root(p) for p in state.payload_leaves) != tuple(state.factors.payload_roots)
        if state.leaf() != thin.leaf or cut_wrong:
            logger.warning("round %d stage %d: published state %s is not the spilled state's: not served",
                           outer_round, state.stage, str(thin.published)[:12])
            return None
        return state

    def forget_before(self, outer_round: int) -> None:
        """Drop (and stop serving) the states of rounds before ``outer_round - PUBLISHED_ROUNDS`` whose
        dispute window has closed (:class:`node.live.fraud.window.DisputeWindow`)."""
        with self._lock:
            candidates = sorted({*self._states, *self._spilled, *self._served})
        old = [r for r in candidates if r < outer_round - PUBLISHED_ROUNDS]
        with self._lock:
            for r in [r for r in self._left_out if r < outer_round - PUBLISHED_ROUNDS]:
                del self._left_out[r]  # a proof from them is built when the round is checked, not later
        done = [r for r in old if self.window is None or not (self.window.open(r) or self.keeps_starts
                                                               and self.window.open(r + 1))]
        with self._lock:
            spilled = {r: self._spilled.pop(r, set()) for r in done}
            for r in done:
                self._states.pop(r, None)
                self._published.pop(r, None)
                self._published_norms.pop(r, None)
                self._payloads.pop(r, None)
            blobs = [d for r in done for d in self._served.pop(r, [])]
        if self.on_ask is not None:
            self.on_ask.forget(done)
        for r in done:
            if self.window is not None:
                self.window.forget(r)
            for stage in spilled[r]:
                self._spill_path(r, stage).unlink(missing_ok=True)
        if self.spill_dir is not None:
            try:
                self._spill([r for r in old if r not in done])
            except OSError as exc:  # a full disk: the states stay in memory, as without a spill directory
                if is_disk_full(exc):
                    report_disk_full(exc,
                                     "chunked states kept in memory, not spilled (tried again next round)",
                                     kind="chunk spill")
                else:
                    logger.warning("chunked states not spilled to %s (kept in memory): %s", self.spill_dir,
                                   exc)
            with self._lock:
                for r in old:  # spilled (their pieces in their files) or still in memory, whole
                    self._payloads.pop(r, None)
        for digest in blobs:
            try:
                self.host.remove_blob(digest)
            except DLX_ERRORS as exc:
                logger.debug("published state %s not removed: %s", digest[:12], exc)

    def committed_state(self, outer_round: int, stage: int, leaf: StageLeaf,
                        providers: Sequence[str]) -> tuple[list[bytes], list[bytes]] | None:
        """``(weight leaves, momentum leaves)`` of the state published under ``leaf`` by one of ``providers``
        (the attesters of that leaf), checked against the leaf's roots; None if none served it.

        A state that does not parse, is not the run's stage, or whose chunk roots are not the leaf's is
        refused (logged), and the next provider asked.
        """
        key = state_key(leaf.encode())
        shapes = self.layout.stage_shapes[stage]
        numel = sum(max(1, _numel(shape)) for shape in shapes.values())
        limit = 8 * numel + STATE_SLACK_BYTES
        for peer in providers:
            try:
                data = fetch_published(self.host, key, peer, limit, min(60.0, self.cfg.round_timeout))
                shard = parse_checkpoint(data)
            except (*DLX_ERRORS, ValueError) as exc:  # ValueError: not a peer id
                logger.info("round %d stage %d: committed state not had from %s: %s", outer_round, stage,
                            peer[-8:], exc)
                continue
            problems = stage_problems(self.layout, stage, shard.weights, shard.momentum, None)
            if problems:
                logger.warning("round %d stage %d: the state %s served is not the stage's: %s", outer_round,
                               stage, peer[-8:], "; ".join(problems))
                continue
            weights, momentum = tensor_leaves(shard.weights), tensor_leaves(shard.momentum)
            if (len(weights), tree_root(weights), tree_root(momentum)) != (leaf.num_chunks, leaf.weights_root,
                                                                            leaf.momentum_root):
                logger.warning("round %d stage %d: the state %s served is not the committed leaf's",
                               outer_round, stage, peer[-8:])
                continue
            return weights, momentum
        return None


    def committed_norms(self, outer_round: int, stage: int, leaf: StageLeaf, providers: Sequence[str]):
        """``(factors, sum trees)`` served under ``leaf`` by one of ``providers`` (its attesters), checked
        against the leaf (ledger.normproof.parse_norm_state); None if none served it."""
        limit = (self.cfg.diloco.num_replicas + 1) * (4 + SUM_BYTES * leaf.num_chunks + 200) \
            + STATE_SLACK_BYTES
        for peer in providers:
            try:
                data = self.host.fetch_alias(norms_key(leaf.encode()), peer, limit,
                                             timeout=min(60.0, self.cfg.round_timeout))
                return parse_norm_state(data, leaf.factors_hash, leaf.num_chunks)
            except (*DLX_ERRORS, ValueError) as exc:  # ValueError: not a peer id
                logger.info("round %d stage %d: committed norms not had from %s: %s", outer_round, stage,
                            peer[-8:], exc)
        return None


@dataclasses.dataclass(frozen=True)
class _ThinState:
    """A spilled state without its weight and momentum leaves (those of the published blob ``published``, a
    stage shard, whose leaves' roots are ``leaf``'s) or its payload pieces (those cut from ``payloads``)."""

    published: str | None  # None: the state's own weight and momentum leaves
    leaf: StageLeaf
    state: StageState
    payloads: list[bytes] | None = None  # the accepted contributions' codec blobs; None: the state's pieces
    shapes: dict | None = None  # the stage's parameter shapes, to cut them
    norms: str | None = None  # the published norm state holding its sum trees; None: the state's own


def _numel(shape) -> int:
    count = 1
    for dim in shape:
        count *= int(dim)
    return count
