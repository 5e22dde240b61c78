"""The step program's operations that StepProver does not recompute yet (issue 78, docs/FRAUD_PROOF.md "The
model's step as a program"), and the evaluator of a compiled program.

:mod:`training.step_compile` maps a real model's reproducible inner step to a program of element-level ops.
Most of it is StepProver's kinds (training/step_trace.py: ``ADD`` .. ``TREESUM``, and the elementwise
functions ``UNARY`` 8 and ``UNARY_SLOPE`` 9). What a real step needs beyond them is here, each a kind
>= 16, **not on chain yet** (no contract computes them; a game that splits on one cannot be decided):

* ``LAYOUT`` 16: ``out = a.as_strided(sizes, strides, offset)`` made contiguous (``extra = (offset, ndim,
  *sizes, *strides)``): transposes, permutes, reshapes of non-contiguous views, slices, and a row vector
  broadcast over rows (a stride 0); every element a copy of one input element (bits copied);
* ``BMM`` 17: ``extra[0]`` ordered products side by side (``MATMUL``'s k-order, a batch index more);
* ``SELECT`` 18: ``out[e] = m[e % |m|] != 0 ? a[e % |a|] : b[e % |b|]``, ``m`` the program input
  ``extra[0]`` (the causal mask, a constant table);
* ``MAX`` 19: the maximum over the middle of ``(rows, inner, cols)`` (softmax's and cross-entropy's shift);
* ``ONEHOT`` 20: ``(rows, cols)`` zeros of dtype ``extra[0]`` with ``b`` at ``(r, a[r])`` (cross-entropy's
  target pick);
* ``CAST`` 21: ``a`` converted to dtype ``extra[0]`` (:data:`DTYPES`);
* ``SCATTER`` 22: zeros of ``extra[0]`` elements with ``a`` written at ``as_strided(sizes, strides,
  offset)`` (``extra[1:]`` as LAYOUT's; a slice's backward);
* ``INDEX_ADD`` 23: the embedding's backward, ``out = zeros(rows, cols)``, ``out[a[i]] += b[i]``, positions
  in increasing order (``exact_kernel.embedding_backward``'s adds);
* ``CAT`` 24: ``a`` as ``(rows, inner)`` and ``b`` as ``(rows, cols)`` side by side;
* ``SQNORM`` 25: the gradient norm's float64 accumulator: ``b + square_sum(a)`` (``b`` the previous
  accumulator or the constant 0), a float64 held as two float32 words (:func:`pack64`);
* ``CLIP`` 26: the clip factor ``fl32(min(1, clip / (sqrt(total) + 1e-6)))`` of the accumulator ``a``,
  ``clip`` the float32 bits ``inner`` (training/pipeline.py ``clip_coefficient``).

A program input index ``TABLE_INPUT + i`` names the program's constant table ``i`` (RoPE's cos and sin, the
causal mask, a constant gradient), as ``CONST_INPUT + bits`` names a constant scalar.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from training.step_trace import GATHER, MATMUL, TREESUM, program_input, run_op

LAYOUT, BMM, SELECT, MAX, ONEHOT, CAST, SCATTER, INDEX_ADD, CAT, SQNORM, CLIP = range(16, 27)
UNARY, UNARY_SLOPE = 8, 9
#: The kinds StepProver recomputes (with fn78's elementwise functions, 8 and 9).
ON_CHAIN = frozenset({1, 2, 3, 4, MATMUL, GATHER, TREESUM, UNARY, UNARY_SLOPE})
NAMES = {1: "ADD", 2: "SUB", 3: "MUL", 4: "DIV", MATMUL: "MATMUL", GATHER: "GATHER", TREESUM: "TREESUM",
         UNARY: "UNARY", UNARY_SLOPE: "UNARY_SLOPE", LAYOUT: "LAYOUT", BMM: "BMM", SELECT: "SELECT",
         MAX: "MAX", ONEHOT: "ONEHOT", CAST: "CAST", SCATTER: "SCATTER", INDEX_ADD: "INDEX_ADD", CAT: "CAT",
         SQNORM: "SQNORM", CLIP: "CLIP"}
#: A program input index past the constants' (``CONST_INPUT + 2**32``): the constant table
#: ``index - TABLE_INPUT``.
TABLE_INPUT = 2**33
#: The data input (StepProver.DATA_INPUT, ``ledger.stepproof.DATA_INPUT``): the step's batch.
DATA_INPUT = 2**32 - 1
DTYPES = {0: torch.float32, 1: torch.int64, 2: torch.float64, 3: torch.bool, 4: torch.int32}
DTYPE_CODES = {dtype: code for code, dtype in DTYPES.items()}
CLIP_EPS = 1e-6


class StepCompileError(ValueError):
    """A step the compiler cannot map, or a program it cannot run (names the operation and why)."""


def pack64(value: float) -> torch.Tensor:
    """A float64 as the two float32 words of its bits (the ``SQNORM`` accumulator's element)."""
    return torch.from_numpy(np.array([value], dtype=np.float64).view(np.float32).copy())


def unpack64(words: torch.Tensor) -> float:
    return float(words.detach().contiguous().numpy().view(np.float64)[0])


def _strided(extra) -> tuple[int, list[int], list[int]]:
    offset, ndim = extra[0], extra[1]
    return offset, list(extra[2:2 + ndim]), list(extra[2 + ndim:2 + 2 * ndim])


def run_extra(kind: int, rows: int, inner: int, cols: int, a: torch.Tensor, b: torch.Tensor, extra,
              tensors=None) -> torch.Tensor:
    """One op of a kind >= 16 (module docstring), flat output; ``tensors``: the step's trace tensors so far
    (``SELECT``'s mask)."""
    a = a.detach().reshape(-1)
    b = b.detach().reshape(-1)
    if kind == LAYOUT:
        offset, sizes, strides = _strided(extra)
        return a.as_strided(sizes, strides, offset).contiguous().reshape(-1)
    if kind == BMM:
        from training import exact_kernel
        count = extra[0]
        return exact_kernel.ordered_matmul(a.float().view(count, rows, inner),
                                           b.float().view(count, inner, cols)).reshape(-1)
    if kind == SELECT:
        mask = table_or_leaf(tensors, extra[0]).reshape(-1)
        index = torch.arange(rows)
        return torch.where(mask[index % mask.numel()] != 0, a[index % a.numel()], b[index % b.numel()])
    if kind == MAX:
        return a.view(rows, inner, cols).amax(1).reshape(-1)
    if kind == ONEHOT:
        out = torch.zeros(rows, cols, dtype=DTYPES[extra[0]])
        out.scatter_(1, a.long().view(rows, 1), b.to(out.dtype).view(1, 1).expand(rows, 1))
        return out.reshape(-1)
    if kind == CAST:
        return a.to(DTYPES[extra[0]])
    if kind == SCATTER:
        offset, sizes, strides = _strided(extra[1:])
        out = torch.zeros(extra[0], dtype=a.dtype)
        out.as_strided(sizes, strides, offset).copy_(a.view(sizes))
        return out
    if kind == INDEX_ADD:
        return _index_add(a, b, rows, cols)
    if kind == CAT:
        return torch.cat((a.view(rows, inner), b.view(rows, cols)), 1).reshape(-1)
    if kind == SQNORM:
        from training.exact_kernel import square_sum
        return pack64(unpack64(b) + square_sum(a.float()) if b.numel() == 2 else square_sum(a.float()))
    if kind == CLIP:
        clip = float(np.array([inner], dtype=np.uint32).view(np.float32)[0])
        norm = math.sqrt(unpack64(a))
        return torch.tensor([min(1.0, clip / (norm + CLIP_EPS))], dtype=torch.float32)
    raise StepCompileError(f"run_extra: unknown op kind {kind}")


def _index_add(ids: torch.Tensor, rows_in: torch.Tensor, table_rows: int, cols: int) -> torch.Tensor:
    from training import exact_kernel
    out = torch.zeros(table_rows, cols, dtype=torch.float32)
    flat, grads = ids.long().contiguous(), rows_in.float().contiguous().view(-1, cols)
    if not exact_kernel.embedding_backward(flat, grads, out):
        for i in range(flat.numel()):  # the same adds, one position at a time
            out[flat[i]] = out[flat[i]] + grads[i]
    return out.reshape(-1)


def table_or_leaf(tensors, index: int) -> torch.Tensor:
    if index >= TABLE_INPUT:
        return tensors.tables[index - TABLE_INPUT]
    return program_input(tensors, index)


@dataclass
class Program:
    """A compiled step: ``ops`` (8 fields, StepProver's ``spec_leaf`` layout), ``extras`` (each op's extra
    parameters, empty for StepProver's kinds), ``copies`` (the trace leaf of each state tensor after the
    step), the constant ``tables``, the state tensors' ``names`` and the ``loss`` leaf."""

    ops: list[tuple[int, ...]] = field(default_factory=list)
    extras: list[tuple[int, ...]] = field(default_factory=list)
    copies: list[int] = field(default_factory=list)
    tables: list[torch.Tensor] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    loss: int = -1

    @property
    def state(self) -> int:
        return len(self.names)

    def to_json(self) -> str:
        """The program as JSON: ``ops`` (8 fields each), ``extras``, ``copies``, ``names``, ``loss`` and each
        table as its dtype code and its values' bits (a table of floats: their 32-bit patterns)."""
        return json.dumps({"ops": [list(op) for op in self.ops], "extras": [list(e) for e in self.extras],
                           "copies": self.copies, "names": self.names, "loss": self.loss,
                           "tables": [[DTYPE_CODES[t.dtype], _table_words(t)] for t in self.tables]})

    @classmethod
    def from_json(cls, text: str) -> Program:
        """The program :meth:`to_json` wrote; StepCompileError naming what is wrong."""
        try:
            value = json.loads(text)
            program = cls([tuple(int(v) for v in op) for op in value["ops"]],
                          [tuple(int(v) for v in e) for e in value["extras"]],
                          [int(c) for c in value["copies"]], [_table_of(int(code), words)
                                                              for code, words in value["tables"]],
                          [str(n) for n in value["names"]], int(value["loss"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise StepCompileError(f"step program JSON: {type(exc).__name__}: {exc}"[:300]) from None
        if len(program.ops) != len(program.extras) or any(len(op) != 8 for op in program.ops):
            raise StepCompileError("step program JSON: each op has 8 fields and an extras entry")
        return program

    @property
    def depth(self) -> int:
        return max(1, math.ceil(math.log2(self.state + len(self.ops))))


def _table_words(t: torch.Tensor) -> list[int]:
    if t.dtype == torch.float32:
        return t.view(torch.int32).numpy().astype(np.uint32).tolist()
    return t.to(torch.int64).tolist()


def _table_of(code: int, words: list[int]) -> torch.Tensor:
    if DTYPES[code] == torch.float32:
        return torch.from_numpy(np.array(words, dtype=np.uint32).view(np.float32))
    return torch.tensor(words, dtype=torch.int64).to(DTYPES[code])


class _Tensors(list):
    """The trace tensors of one step, with the program's tables (for :func:`table_or_leaf`)."""

    def __init__(self, values, tables, batch) -> None:
        super().__init__(values)
        self.tables, self.batch = tables, batch


def fetch(tensors: _Tensors, index: int) -> torch.Tensor:
    if index == DATA_INPUT:
        if tensors.batch is None:
            raise StepCompileError("the program reads the step's batch and none was given")
        return tensors.batch
    return table_or_leaf(tensors, index)


def run_program(program: Program, state: list[torch.Tensor], batch: torch.Tensor | None,
                keep_all: bool = True) -> list[torch.Tensor | None]:
    """The trace tensors of one step of ``program`` from ``state`` on ``batch`` (the state, then each op's
    output, flat): StepProver's kinds by ``training.step_trace.run_op``, the rest by :func:`run_extra`.
    ``keep_all`` False: each tensor dropped (None) after its last reader, but the end state's and the loss."""
    if len(state) != program.state:
        raise StepCompileError(f"run_program: {len(state)} state tensors for a program of {program.state}")
    tensors = _Tensors([t.detach().reshape(-1) for t in state], program.tables, batch)
    last = {} if keep_all else _last_reads(program)
    for j, (spec, extra) in enumerate(zip(program.ops, program.extras)):
        kind, rows, inner, cols, _al, _bl, ai, bi = spec
        a, b = fetch(tensors, ai), fetch(tensors, bi)
        if kind >= 16:
            tensors.append(run_extra(kind, rows, inner, cols, a, b, extra, tensors))
        else:
            tensors.append(run_op(kind, rows, inner, cols, a, b))
        for index in last.get(j, ()):
            tensors[index] = None
    return list(tensors)


def _last_reads(program: Program) -> dict[int, list[int]]:
    """Op ``j`` -> the trace leaves no op after it reads (the end state's and the loss never)."""
    kept = set(program.copies) | {program.loss}
    last: dict[int, int] = {}
    for j, ((kind, *_shape, ai, bi), extra) in enumerate(zip(program.ops, program.extras)):
        for index in (ai, bi, *(extra[:1] if kind == SELECT else ())):
            if index < DATA_INPUT:
                last[index] = j
    out: dict[int, list[int]] = {}
    for index, j in last.items():
        if index not in kept:
            out.setdefault(j, []).append(index)
    return out


def output_size(kind: int, rows: int, inner: int, cols: int, extra) -> int:
    """The number of output elements (32-bit words) of an op."""
    if kind in (MATMUL, TREESUM, MAX, ONEHOT, GATHER, INDEX_ADD):
        return rows * cols
    if kind == BMM:
        return extra[0] * rows * cols
    if kind == CAT:
        return rows * (inner + cols)
    if kind == SQNORM:  # one float64: two words
        return 2
    return rows


def counts(program: Program, steps: int) -> dict:
    """The program's size (ops per kind, output elements, trace depth, ops not on chain yet, the longest
    inner game) and the bisection's halvings for ``steps`` inner steps: ``ceil(log2 H) + ceil(log2 ops) +
    ceil(log2 k)`` (the moves: two a halving, plus the game's constant)."""
    kinds: Counter = Counter()
    elements: Counter = Counter()
    k_chain = k_all = 1
    for (kind, rows, inner, cols, *_rest), extra in zip(program.ops, program.extras):
        name = NAMES.get(kind, str(kind))
        kinds[name] += 1
        elements[name] += output_size(kind, rows, inner, cols, extra)
        if kind in (MATMUL, TREESUM):
            k_chain = max(k_chain, inner)
        if kind in (MATMUL, TREESUM, BMM, MAX):
            k_all = max(k_all, inner)
    for (kind, _r, _i, _c, a_len, *_rest) in program.ops:
        if kind in (SQNORM, INDEX_ADD):
            k_all = max(k_all, a_len)
    off = sum(n for kind, n in kinds.items() if kind not in {NAMES[k] for k in ON_CHAIN})
    ops = len(program.ops)
    levels = math.ceil(math.log2(max(steps, 1))) + math.ceil(math.log2(ops))
    halvings = {name: levels + math.ceil(math.log2(k))
                for name, k in (("on_chain_k", k_chain), ("any_k", k_all))}
    return {"state_tensors": program.state, "ops": ops, "ops_per_kind": dict(sorted(kinds.items())),
            "elements_per_kind": dict(sorted(elements.items())), "elements": sum(elements.values()),
            "depth": program.depth, "ops_not_on_chain": off, "tables": len(program.tables),
            "table_elements": sum(t.numel() for t in program.tables), "k_on_chain": k_chain, "k_any": k_all,
            "steps": steps, "halvings": halvings}
