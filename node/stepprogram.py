"""A run's step program as a node holds it (issue 78; docs/FRAUD_PROOF.md "The run's program", "The node
defends its contributions").

The chain fixes a run's program by a hash (``StepProver.programOf``: its root, state leaves, ops and depth)
and its state's origins by a root (``originOf``); a node that defends a contribution needs the program
itself, to run it from the committed start and answer a game's moves. The run's creator publishes it as a
JSON file (:meth:`StepProgram.load`)::

    {"ops": [[kind, rows, inner, cols, a_len, b_len, a_index, b_index], ...],
     "copies": [trace leaf of state tensor q after the step, ...],
     "depth": trace tree depth,
     "origins": [[stage tensor (4294967295: starts at zero), numel, first chunk, stage chunks], ...]}

(the fields of ``ledger.stepproof.spec_leaf``, ``copy_leaf`` and ``origin_leaf``; an input index
``2**32 + bits`` is the float32 constant ``bits``, ``training.step_trace.CONST_INPUT``), and the node checks
it against the chain before it claims anything (:meth:`StepProgram.check_on`). :meth:`StepProgram.defense`
runs it for a claim's steps from the committed start's weight chunk leaves, in the documented op order
(``training.step_trace.run_op``), and gives the defender's side of every game.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ledger.chunkproof import tree_root
from ledger.stepdefense import DefenseSide
from ledger.stepproof import DATA_INPUT, ZERO_START, StepTrace, origin_leaf, program_hash
from node.errors import ConfigError
from node.live.fraud.endcheck import end_breaks, piece_bits
from training.chunks import CHUNK_ELEMENTS, leaf_values
from training.step_trace import (
    CONST_INPUT,
    GATHER,
    MATMUL,
    TREESUM,
    element_leaves,
    op_point,
    program_input,
    run_op,
)

#: The op kinds StepProver recomputes (training.step_trace: ADD .. MATMUL, GATHER, TREESUM).
KINDS = (*range(1, MATMUL + 1), GATHER, TREESUM)


@dataclass(frozen=True)
class StepProgram:
    """A run's step program (module docstring): its ops, the state's copies, the trace depth, the origins."""

    ops: tuple[tuple[int, ...], ...]
    copies: tuple[int, ...]
    depth: int
    origins: tuple[tuple[int, int, int, int], ...]

    def __post_init__(self) -> None:
        state, ops = len(self.copies), len(self.ops)
        if not ops or not state or len(self.origins) != state:
            raise ConfigError(f"step program: {ops} ops, {state} state tensors and {len(self.origins)} "
                              "origins: needs at least one op and one origin per state tensor")
        if not 0 <= self.depth <= 32 or (1 << self.depth) < state + ops:
            raise ConfigError(f"step program: depth {self.depth} holds no {state + ops} trace leaves")
        for j, spec in enumerate(self.ops):
            if len(spec) != 8 or spec[0] not in KINDS or not all(0 <= v < 2**32 for v in spec[:6]) \
                    or not all(0 <= v < 2 * CONST_INPUT for v in spec[6:]):
                raise ConfigError(f"step program: op {j} {list(spec)} is not [kind 1-7, rows, inner, "
                                  "cols, a_len, b_len, a_index, b_index]")
            # the rest: constants and the step's batch (DATA_INPUT)
            leaves = [index for index in spec[6:] if index < CONST_INPUT and index != DATA_INPUT]
            if leaves and max(leaves) >= state + j:
                raise ConfigError(f"step program: op {j} reads trace leaf {max(leaves)}, not one before it")
        if any(not 0 <= c < state + ops for c in self.copies):
            raise ConfigError(f"step program: copies {list(self.copies)} past the {state + ops} trace leaves")
        if any(len(o) != 4 or o[1] < 1 for o in self.origins):
            raise ConfigError("step program: each origin is [tensor, numel >= 1, first chunk, stage chunks]")

    @classmethod
    def load(cls, path: str | Path) -> StepProgram:
        """The program in JSON file ``path``; ConfigError naming what is wrong."""
        try:
            value = json.loads(Path(path).read_text())
            return cls(tuple(tuple(int(v) for v in spec) for spec in value["ops"]),
                       tuple(int(c) for c in value["copies"]), int(value["depth"]),
                       tuple(tuple(int(v) for v in o) for o in value["origins"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"step program {path}: {type(exc).__name__}: {exc}"[:300]) from None

    def to_json(self) -> str:
        return json.dumps({"ops": [list(s) for s in self.ops], "copies": list(self.copies),
                           "depth": self.depth, "origins": [list(o) for o in self.origins]})

    def origin_leaves(self) -> list[bytes]:
        return [origin_leaf(*o) for o in self.origins]

    def head(self) -> tuple:
        """A ``RunClaim``'s program fields: (programRoot, stateLeaves, ops, depth)."""
        return tree_root(self.trace([]).program()), len(self.copies), len(self.ops), self.depth

    def trace(self, leaves: list[list[bytes]]) -> StepTrace:
        return StepTrace(leaves, [tuple(s) for s in self.ops], list(self.copies), self.depth)

    def check_on(self, chain_program: bytes, chain_origins: bytes) -> None:
        """ConfigError unless this is the program and origins the chain fixed for the run (``programOf``,
        ``originOf``)."""
        if program_hash(self.head()) != chain_program:
            raise ConfigError(f"the step program file is not the run's: its hash "
                              f"{program_hash(self.head()).hex()}, the chain's 0x{chain_program.hex()} "
                              "(zero: the run has none)")
        if tree_root(self.origin_leaves()) != chain_origins:
            raise ConfigError("the step program file's origins are not the run's (StepProver.originOf)")

    def start_state(self, committed: list[bytes]) -> list[torch.Tensor]:
        """The first state of a claim: each state tensor's elements read from the committed start's weight
        chunk leaves where its origin lies (zeros for a tensor that starts at zero); ConfigError where the
        leaves do not hold it."""
        state = []
        for q, (tensor, numel, first, _chunks) in enumerate(self.origins):
            if tensor == ZERO_START:
                state.append(torch.zeros(numel, dtype=torch.float32))
                continue
            bits: list[int] = []
            for i in range(math.ceil(numel / CHUNK_ELEMENTS)):
                if first + i >= len(committed):
                    raise ConfigError(f"state tensor {q}: chunk {first + i} past the start's "
                                      f"{len(committed)}")
                (leaf_tensor, offset, _cols, _count), values = leaf_values(committed[first + i])
                if leaf_tensor != tensor or offset != i * CHUNK_ELEMENTS:
                    raise ConfigError(f"state tensor {q}: chunk {first + i} is tensor {leaf_tensor} at "
                                      f"{offset}, not tensor {tensor} at {i * CHUNK_ELEMENTS}")
                bits += values
            state.append(torch.from_numpy(np.array(bits[:numel], dtype=np.uint32).view(np.float32)))
        return state

    @property
    def reads_data(self) -> bool:
        """Whether an op reads the step's batch (``DATA_INPUT``)."""
        return any(DATA_INPUT in spec[6:] for spec in self.ops)

    def run(self, state: list[torch.Tensor], steps: int,
            batches: list[torch.Tensor] | None = None) -> list[list[torch.Tensor]]:
        """Each step's trace tensors (the state, then each op's output) for ``steps`` steps from ``state``
        (``batches``: each step's batch, what a ``DATA_INPUT`` operand reads)."""
        out = []
        for step in range(steps):
            tensors = [t.reshape(-1) for t in state]
            batch = batches[step] if batches is not None else None
            for kind, rows, inner, cols, _a_len, _b_len, a_index, b_index in self.ops:
                tensors.append(run_op(kind, rows, inner, cols, _operand(tensors, a_index, batch),
                                      _operand(tensors, b_index, batch)))
            out.append(tensors)
            state = [tensors[c] for c in self.copies]
        return out

    def defense(self, committed: list[bytes], steps: int, payload=None,
                batches: list[torch.Tensor] | None = None) -> DefenseSide:
        """The honest defender's side of a claim of ``steps`` steps from the committed start ``committed``;
        with ``payload`` (the contribution's payload pieces, for a run with the plain end rule) its answers to
        end disputes too, after checking every one (node/live/fraud/endcheck.py): ConfigError naming the first
        elements whose piece does not code ``fl(S - E)`` (a claim would lose its bond on them). ``batches``:
        each step's batch (``training.data_binding.claim_batches``), which the traces carry with its path in
        the claim's batch tree (``ledger.stepdata.batch_root``); ConfigError where the program reads the
        batch and none is given."""
        if self.reads_data and (batches is None or len(batches) < steps):
            raise ConfigError("the step program reads each step's batch (DATA_INPUT) and this claim has no "
                              f"batch for each of its {steps} steps")
        start = self.start_state(committed)
        runs = self.run(start, steps, batches)

        def sums(step: int, op: int, elem: int, point) -> int:
            kind, rows, inner, cols, _a_len, _b_len, a_index, b_index = self.ops[op]
            tensors, batch = runs[step], batches[step] if batches is not None else None
            return op_point(kind, rows, inner, cols, _operand(tensors, a_index, batch),
                            _operand(tensors, b_index, batch), elem, point)

        side = DefenseSide(self._traces(runs, batches), self.origin_leaves(), list(committed), sums)
        if payload is not None:
            end = [runs[-1][c] for c in self.copies] if runs else start
            bits = piece_bits(payload, side.origins)
            broken = end_breaks(start, end, payload, side.origins, bits, limit=2)
            if broken:
                shown = "; ".join(f"state tensor {q} element {e}: {why}" for q, e, why in broken)
                raise ConfigError(f"the payload does not code the program's end fl(S - E) ({shown}): a claim "
                                  "would lose its bond to an end dispute there (the program is not the "
                                  "model's step, or the payload is not this node's training's)")
            side.payload, side.bits = list(payload), bits
        return side

    def _traces(self, runs: list[list[torch.Tensor]], batches: list[torch.Tensor] | None) -> list[StepTrace]:
        """Each step's trace of its tensors, with its batch's leaves and path where ``batches``."""
        if batches is None:
            return [self.trace([element_leaves(t) for t in tensors]) for tensors in runs]
        from ledger.stepdata import batch_path
        from training.data_binding import batch_leaves

        leaves = [batch_leaves(b) for b in batches[:len(runs)]]
        ops = [tuple(s) for s in self.ops]
        return [StepTrace([element_leaves(t) for t in tensors], ops, list(self.copies), self.depth,
                          batch=leaves[i], batch_path=batch_path(leaves, i))
                for i, tensors in enumerate(runs)]


def _operand(tensors: list[torch.Tensor], index: int, batch: torch.Tensor | None) -> torch.Tensor:
    """An op's operand: the step's batch for :data:`DATA_INPUT`, else ``program_input``'s."""
    if index == DATA_INPUT:
        if batch is None:
            raise ConfigError("the step program reads the step's batch and none was given")
        return batch.reshape(-1)
    return program_input(tensors, index)
