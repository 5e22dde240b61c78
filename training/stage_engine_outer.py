"""Where a :class:`~training.stage_engine.StageEngine` keeps its outer state between uses (issue 75: RAM
per node): in RAM (the default of an engine), or in files (the node's ``storage.outer_state = "disk"``,
its default: node/config.py; set by :meth:`EngineOuterState.keep_outer_state_in`).

The outer state is the global weights, the outer momentum, the local snapshots of the delay correction
(the round start and the pending round ends: one shared copy in the node's order) and the error-feedback
residual: 12 to 16 bytes per parameter held through every round's inner steps although only the outer
step, the apply and the encode read them. On disk each is a :class:`~training.spilled.SpilledTensors`: a
file without a name under the directory (training/spilled.py), written once when the engine makes that
state, read a tensor at a time (one ``pread`` into a fresh buffer) by whatever reads it (the outer step,
the hash, the start state's writer, the checkpoint's), never written in place. A new state goes to a new
file and the old one's blocks go when its last reader lets it go, so a prepared aggregation or a held
round's state read on another thread sees the values it was computed from, and an error half way through
a write leaves the engine's state as it was (the new file is dropped; a full disk keeps that state in
RAM, with a warning). The residual of a run without error feedback is zeros: held as its shapes
(:class:`~training.spilled.ZeroTensors`), nothing allocated.

Crash safety is the engine's as before: nothing a restart reads is in these files (they have no name, so
a killed process leaves nothing behind and nothing half written that a restart could trust); a node
restarts from its checkpoint and start states as it always did. A file whose length is not what was written
to it is refused when read (:class:`~training.spilled.SpillFileError`), never used.

Bits: the same float32 values go in and come out (the host's byte order), and the arithmetic is the
same operations on the same values in the same order, so every hash, contribution and start state is the
one an engine in RAM makes (tests/test_outer_state_disk.py).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import torch

from training.host_tensors import Weights
from training.spilled import SpilledTensors, ZeroTensors, spill_float32, unheld

logger = logging.getLogger(__name__)


class EngineOuterState:
    """The :class:`~training.stage_engine.StageEngine` parts that place its outer state (a mixin)."""

    _outer_dir: Path | None = None
    _global_weights: Mapping[str, torch.Tensor]
    _momentum: Mapping[str, torch.Tensor]

    @property
    def outer_state_dir(self) -> Path | None:
        """The directory of the outer state's files; None: held in RAM."""
        return self._outer_dir

    def keep_outer_state_in(self, directory: Path | None) -> None:
        """Keep the outer state in files under ``directory`` (created when first written), from now on: what
        the engine holds now goes there at once, each later state when the engine makes it. Call it while no
        other thread uses the engine (the node: when it builds its engines). None: a state made from now on
        stays in RAM (one already in a file stays there until replaced)."""
        self._outer_dir = None if directory is None else Path(directory)
        logger.info("stage %d: outer state %s", self.stage_index,
                    "in RAM" if directory is None else f"in files without a name under {directory}")
        self.global_weights, self.momentum = self.global_weights, self.momentum
        self._park_snapshots()
        self._park_residual()

    @property
    def global_weights(self) -> Mapping[str, torch.Tensor]:
        """The stage's global weights (a file's, read a tensor at a time, when kept on disk)."""
        return self._global_weights

    @global_weights.setter
    def global_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        self._global_weights = self._parked(weights)

    @property
    def momentum(self) -> Mapping[str, torch.Tensor]:
        """The outer optimizer's state (Nesterov: the momentum; outer Adam: both moments, stacked)."""
        return self._momentum

    @momentum.setter
    def momentum(self, momentum: Mapping[str, torch.Tensor]) -> None:
        self._momentum = self._parked(momentum)

    def _parked(self, weights: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """``weights`` in a file under :attr:`outer_state_dir` (themselves where it is None, they already are
        not held, or the write fails: a full disk keeps them in RAM, with a warning)."""
        if self._outer_dir is None or unheld(weights):
            return weights
        try:
            return spill_float32(weights, self._outer_dir)
        except OSError as exc:
            logger.warning("stage %d: outer state kept in RAM: not written to %s (%s)",
                           self.stage_index, self._outer_dir, exc)
            return weights

    def _park_snapshots(self) -> None:
        """The round start and the pending round ends to files; a snapshot held twice (the round start is
        the pending round's end once that round is encoded) goes to one file, held by both."""
        if self._outer_dir is None:
            return
        done: dict[tuple[int, ...], Mapping[str, torch.Tensor]] = {}

        def park(snapshot: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
            if unheld(snapshot):
                return snapshot
            key = tuple(id(tensor) for tensor in snapshot.values())  # alive while this runs: ids are theirs
            if key not in done:
                done[key] = self._parked(snapshot)
            return done[key]

        self._round_start = park(self._round_start)
        self._round_end = {r: park(snapshot) for r, snapshot in self._round_end.items()}

    def _snapshots_in_ram(self, round_end: Mapping[str, torch.Tensor]
                          ) -> tuple[Weights, Weights, dict[int, Weights]]:
        """``(round_end, round start, pending round ends)`` as dicts of tensors for the delay correction,
        which re-bases a tensor held by two snapshots once: a file held by two is read once, its tensors
        shared by both dicts as they were before it was written."""
        read: dict[int, Weights] = {}

        def held(snapshot: Mapping[str, torch.Tensor]) -> Weights:
            if not isinstance(snapshot, SpilledTensors):
                return snapshot
            if id(snapshot) not in read:  # the files are alive (the engine holds them): ids are theirs
                read[id(snapshot)] = dict(snapshot.items())
            return read[id(snapshot)]

        return held(round_end), held(self._round_start), {r: held(s) for r, s in self._round_end.items()}

    def _park_residual(self) -> None:
        """The error-feedback residual to a file; zeros (a run without feedback, nothing carried) as their
        shapes."""
        if self._outer_dir is None:
            return
        compressor = self.compressor
        if not compressor.feeds_back and not compressor.carries:
            if not isinstance(compressor.residual, ZeroTensors):
                compressor.residual = ZeroTensors(compressor.shapes)
            return
        compressor.residual = self._parked(compressor.residual)
