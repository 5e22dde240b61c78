"""A chunked run's published stage states written only when a peer asks for one (issue 75).

A node publishes its state of each held stage after every round (node/live/fraud/chunkstate.py: the stage's
weights and momentum as a stage shard, served under ``sha256(stage leaf)``) for the whole proof window. Kept
as files, those were most of a node's disk once its start states were rebuilt rather than kept (``P``
rounds of 2 x the stage's bytes: 58 x the stage's weights on the retention bench's local chain). Yet every
byte of such a shard is in the round's :class:`ledger.chunkproof.StageState`, which the node holds anyway
(for its attestation, the fraud proofs and the availability answers): its weight and momentum leaves are the
stage's float32 bit patterns chunk by chunk (training/chunks.py). So with ``storage.start_states =
"rebuild"`` (the default) the node

- binds, when it publishes round ``r``'s state, only the shard's sha256 (:func:`node.store.checkpoint.
  checkpoint_digest`: its bytes streamed into the hash, nothing written), and serves the alias by a blob
  rebuilder (:meth:`p2p.blobstore.BlobStore.set_rebuilder`);
- when a peer asks (a prover fetching the committed state: ``ChunkedStates.committed_state``), writes the
  shard from the held state's leaves (:func:`tensors_of_leaves`), checks that it hashes to the bound sha256
  (else nothing is served: the asker is told it is not here, as for any state not held), and serves it as a
  packed blob from then on, for as long as the round's window keeps it;
- writes it the same way when the round's state leaves memory for the spill directory (four rounds behind
  the committer): the spilled state then names that blob for its leaves, as before.

So the rounds in memory, the ones a prover asks about (it checks a round as soon as it reads it from the
chain), cost no disk until asked; an older round costs what it did. What a rebuild costs: one stage shard
written and hashed (no replay, no child process: the leaves are the state), one at a time on the node;
a request for a state being written for another asker waits for it (at most :data:`REBUILD_WAIT_S`, then is
refused and asks again), and a second request for a written one is served from the store. A key this node
never published, or a round whose window has closed (its key forgotten), is refused at once (not found).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from node.errors import DLX_ERRORS, NodeError
from node.live.checks.heldstates import REFETCH_AFTER_S, SLOW_REFUSAL_S
from node.store.checkpoint import Checkpoint, checkpoint_digest, write_checkpoint
from node.store.safetensors_stream import data_ranges
from p2p.errors import P2PError
from training.chunks import stage_layout

logger = logging.getLogger(__name__)

#: Seconds a request for a published state waits for another's write before it is refused (the asker asks
#: again) rather than hold a thread of the host's.
REBUILD_WAIT_S = 10.0
#: Seconds a state whose write failed is not tried again (each ask of it would try).
RETRY_AFTER_S = 60.0


class StateNotWritten(NodeError):
    """A published state could not be written when asked (its state is no longer held, or its bytes are not
    the ones bound when it was published)."""


def fetch_published(host, key: str, provider: str, max_bytes: int, timeout: float) -> bytes:
    """``host.fetch_alias(key, provider, max_bytes)`` of a published state, asked again every few seconds
    until ``timeout`` once an ask failed slowly: the provider writes a state it has not written yet before
    it answers (:class:`StatesOnAsk`), and at a large stage that may outlast the blob protocol's stall
    timeout (15 s), whose failure then is no refusal. A quick failure (not served) is final at once."""
    deadline, slow = time.monotonic() + timeout, False
    while True:
        asked = time.monotonic()
        try:
            return host.fetch_alias(key, provider, max_bytes, timeout=max(1.0, deadline - asked))
        except P2PError:
            now = time.monotonic()
            slow = slow or now - asked >= SLOW_REFUSAL_S
            if not slow or deadline - now < 2 * REFETCH_AFTER_S:
                raise
            time.sleep(REFETCH_AFTER_S)


def tensors_of_leaves(leaves: Sequence[bytes],
                      shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """The float32 tensors whose chunk leaves (training.chunks.tensor_leaves) are ``leaves``, of ``shapes``
    (the inverse of that layout: each leaf's last ``4 x count`` bytes are its elements' big-endian bits)."""
    places = stage_layout(shapes)
    if len(places) != len(leaves):
        raise StateNotWritten(f"{len(leaves)} leaves for a layout of {len(places)} chunks")
    parts: dict[str, list[bytes]] = {}
    for place, leaf in zip(places, leaves):
        parts.setdefault(place.name, []).append(leaf[len(leaf) - 4 * place.count:])
    out = {}
    for name, chunks in parts.items():
        bits = np.frombuffer(b"".join(chunks), dtype=">u4").astype("<u4")
        out[name] = torch.from_numpy(bits.view(np.float32)).reshape(tuple(shapes[name]))
    return out


@dataclass(frozen=True)
class Deferred:
    """A published state not written yet: round, stage and the sha256 (hex) its shard must hash to."""

    outer_round: int
    stage: int
    digest: str


def states_on_ask(cfg, host, work_dir: Path, layout, config_hash: bytes, state_of, served):
    """The :class:`StatesOnAsk` of a node of configuration ``cfg`` whose chunked states spill to
    ``work_dir``, set as ``host``'s blob rebuilder: with ``storage.start_states = "rebuild"`` and a host
    that serves rebuilt blobs; else None (every published state is written when published)."""
    storage = getattr(cfg, "storage", None)
    if getattr(storage, "start_states", "keep") != "rebuild" or not hasattr(host, "set_blob_rebuilder"):
        return None
    on_ask = StatesOnAsk(host, work_dir, layout, config_hash, state_of, served)
    host.set_blob_rebuilder(on_ask)
    return on_ask


class StatesOnAsk:
    """The published states of one node written when asked (module docstring): the blob rebuilder of the
    aliases it has not written (``knows``, ``rebuild``), and the write a spill makes first (:meth:`write`).

    ``state_of(round, stage)``: the node's held :class:`ledger.chunkproof.StageState` (None: not held any
    more); ``served(round, stage, key, digest)``: called once its blob is stored and aliased under ``key``."""

    def __init__(self, host, work_dir: Path, layout, config_hash: bytes,
                 state_of: Callable[[int, int], object],
                 served: Callable[[int, int, str, str], None]) -> None:
        self.host = host
        self.work_dir = work_dir
        self.layout = layout  # RunLayout: the shard's run id and model configuration
        self.config_hash = config_hash
        self.state_of = state_of
        self.served = served
        self._pending: dict[str, Deferred] = {}  # alias key -> the state not written yet
        # alias key -> round of a state written since: an asker that saw it pending is served the blob
        self._done: dict[str, int] = {}
        self._lock = threading.Lock()  # one write at a time
        self.wait_s = REBUILD_WAIT_S  # how long an asker waits for another's write before it is refused
        # _pending and _done are replaced whole under this (read without it: knows, on the event loop)
        self._index_lock = threading.Lock()
        self._failed: dict[str, float] = {}  # key -> when a failed write may be tried again
        # stage -> (weights' shapes, momentum's shapes) of its shards, to write them from the leaves
        self._shapes: dict[int, tuple[dict, dict]] = {}
        self.disabled = False  # a stage's shard did not come back from its leaves: none is deferred
        self.written = 0  # shards written when asked or spilled
        self.failures = 0

    def publish(self, key: str, shard: Checkpoint, stage: int) -> bool:
        """Bind ``shard``'s hash and serve it under ``key`` when asked; False where it is not deferred (the
        caller writes it now). A stage's first shard is written back from the held state's leaves at once
        and its hash compared: a layout that does not give back the same bytes is never deferred."""
        if self.disabled:
            return False
        first = stage not in self._shapes
        self._shapes[stage] = ({n: tuple(t.shape) for n, t in shard.weights.items()},
                               {n: tuple(t.shape) for n, t in shard.momentum.items()})
        try:
            digest = checkpoint_digest(shard)
            again = checkpoint_digest(self.shard_of(shard.round, stage)) if first else digest
        except (*DLX_ERRORS, ValueError, AttributeError) as exc:  # AttributeError: no state held (None)
            logger.warning("round %d stage %d: published state written now (%s)", shard.round, stage, exc)
            return False
        if again != digest:
            logger.warning("stage %d: a published state written back from its leaves is not its bytes: "
                           "every one is written when published", stage)
            self.disabled = True
            return False
        self.defer(key, shard.round, stage, digest.hex())
        return True

    def shard_of(self, outer_round: int, stage: int) -> Checkpoint | None:
        """The stage shard of the node's held state of the round, from its leaves; None if not held."""
        state = self.state_of(outer_round, stage)
        if state is None or stage not in self._shapes:
            return None
        weights, momentum = self._shapes[stage]
        return Checkpoint(self.layout.run_id, outer_round, dict(self.layout.model_config), self.config_hash,
                          {}, tensors_of_leaves(state.weight_leaves, weights),
                          tensors_of_leaves(state.momentum_leaves, momentum))

    def defer(self, key: str, outer_round: int, stage: int, digest: str) -> None:
        """Serve round ``outer_round``'s state of ``stage`` under ``key`` when asked; its shard hashes to
        ``digest``."""
        with self._index_lock:
            self._pending = {**self._pending, key: Deferred(outer_round, stage, digest)}

    def knows(self, key: str) -> bool:
        """Whether ``key`` is a published state not written yet, or written since (an asker of the blob server
        found it not stored a moment before): on the host's event loop, no lock."""
        return key in self._pending or key in self._done

    def rebuild(self, key: str) -> bool:
        """Write and serve the state under ``key`` (a peer asked); False if it cannot be (logged)."""
        if not self._lock.acquire(timeout=self.wait_s):
            return False
        try:
            return self._write_locked(key, "a peer asked")
        finally:
            self._lock.release()

    def write(self, outer_round: int) -> None:
        """Write every state of ``outer_round`` not written yet (before its round is spilled)."""
        keys = [key for key, entry in self._pending.items() if entry.outer_round == outer_round]
        with self._lock:
            for key in keys:
                self._write_locked(key, "its round is spilled")

    def forget(self, rounds: Sequence[int]) -> None:
        """Stop serving the unwritten states of ``rounds`` (their windows closed)."""
        gone = set(rounds)
        with self._index_lock:
            self._pending = {k: e for k, e in self._pending.items() if e.outer_round not in gone}
            self._done = {k: r for k, r in self._done.items() if r not in gone}

    def pending_rounds(self) -> list[int]:
        return sorted({entry.outer_round for entry in self._pending.values()})

    def _write_locked(self, key: str, why: str) -> bool:
        entry = self._pending.get(key)
        if entry is None:  # written meanwhile (another asker's), or forgotten
            return self.host.store.served_packed(key) is not None
        if time.monotonic() < self._failed.get(key, 0.0):
            return False
        try:
            digest = self._write(entry)
            self.host.provide_alias(key, digest)
        except (*DLX_ERRORS, OSError, ValueError) as exc:
            self.failures += 1
            self._failed = {k: t for k, t in self._failed.items() if t > time.monotonic()}
            self._failed[key] = time.monotonic() + RETRY_AFTER_S
            logger.warning("round %d stage %d: published state %s not written: %s", entry.outer_round,
                           entry.stage, key[:12], exc)
            return False
        self.served(entry.outer_round, entry.stage, key, digest)
        with self._index_lock:
            self._done = {**self._done, key: entry.outer_round}
            self._pending = {k: e for k, e in self._pending.items() if k != key}
        self.written += 1
        logger.info("round %d stage %d: published state %s written (%s)", entry.outer_round, entry.stage,
                    key[:12], why)
        return True

    def _write(self, entry: Deferred) -> str:
        """Write ``entry``'s shard from its held state, check its hash, store it packed; its sha256 hex."""
        shard = self.shard_of(entry.outer_round, entry.stage)
        if shard is None:
            raise StateNotWritten("its state is no longer held")
        path = self.work_dir / f"round-{entry.outer_round:08d}-stage-{entry.stage}.asked"
        try:
            digest = write_checkpoint(path, shard).hex()
            if digest != entry.digest:
                raise StateNotWritten(f"its bytes hash to {digest[:16]}, not the bound {entry.digest[:16]}")
            return self.host.provide_packed(path, data_ranges(path))
        finally:
            path.unlink(missing_ok=True)
