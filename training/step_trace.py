"""The trace of a reproducible inner step that the contribution proof bisects (issue 78, docs/FRAUD_PROOF.md
"The contribution proof").

A contribution in the reproducible mode (kernel version 3, docs/REPRODUCIBLE.md) is the result of H inner
steps whose bits depend on the documented order of operations only. A challenger and a contributor who
disagree about it bisect, first over the states after each inner step, then over the operations of the one
step where they split, then inside one operation. This module gives the node what those levels open:

* **State roots** (:func:`state_root`): the weights and the inner optimizer's state after a step, each
  tensor committed as its own tree of :mod:`training.chunks` tensor leaves (tensor index 0, 64 elements a
  leaf), and the state as the tree over those tensor roots in a fixed order (stages in order; per stage the
  weights by name, then each weight's optimizer state by name: ``exp_avg``, ``exp_avg_sq``, ...).
* **The operation order of one step** (:func:`trace_steps`): the trainer's own inner step
  (``LocalReplicaTrainer.train_step``, the one version of the arithmetic) run with a recorder: every torch
  function the forward pass calls under ``ExactKernels`` (in call order, the model's level, not the kernels'
  internals), every autograd node's gradients as the backward pass runs them (in the engine's order), and,
  after the optimizer, each parameter's new value and optimizer state. Each op's output is committed by its
  root. The recorder only reads: the traced steps give the bits of untraced ones (tests/test_step_proof.py).
* **Inside a product** (:func:`partial_sums`): the ``k + 1`` partial sums ``s_0 = +0``,
  ``s_{j+1} = fl(s_j + fl(a[r, j] b[j, c]))`` of one output element of ``ordered_matmul``, whose last is that
  element's bits; the contract (contracts/src/StepProver.sol) bisects them and recomputes one step.
* **Inside a tree sum** (:func:`tree_levels`): the levels of the pairwise tree of one row of
  ``training.exact_math.tree_sum`` (the elements, then each level's sums, an odd level's last node carried),
  whose top is that row's sum; the contract descends the tree from the disputed sum to one float32 add or
  one element.

Trees and hashes are the ledger's (``ledger.merkle``): this package knows no chain, so the caller passes
``tree_root`` (a function from leaves to the root, ``ledger.chunkproof.tree_root``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from training.chunks import tensor_leaves

TreeRoot = Callable[[list[bytes]], bytes]


def element_leaves(tensor: torch.Tensor) -> list[bytes]:
    """The chunk leaves of ``tensor`` alone (tensor index 0; element ``e`` of the contiguous order is in leaf
    ``e // 64``)."""
    return tensor_leaves({"t": tensor.detach().to(torch.float32).cpu().contiguous()})


def tensor_root(tensor: torch.Tensor, tree_root: TreeRoot) -> bytes:
    """The root of ``tensor``'s own chunk tree (an empty tensor: the root of one empty leaf)."""
    leaves = element_leaves(tensor)
    return tree_root(leaves if leaves else [b""])


def state_tensors(trainer) -> list[tuple[str, torch.Tensor]]:
    """The state an inner step reads and writes, in the committed order (module docstring)."""
    out: list[tuple[str, torch.Tensor]] = []
    for stage, (module, optimizer) in enumerate(zip(trainer.stage_modules, trainer.optimizers)):
        named = sorted(module.named_parameters(), key=lambda item: item[0].encode())
        for name, param in named:
            out.append((f"{stage}/{name}", param))
            for key, value in sorted(optimizer.state.get(param, {}).items()):
                if isinstance(value, torch.Tensor) and value.dtype == torch.float32 and value.dim() > 0:
                    out.append((f"{stage}/{name}/{key}", value))
    return out


def state_root(trainer, tree_root: TreeRoot) -> bytes:
    """The root over the roots of :func:`state_tensors` (each a 32-byte leaf)."""
    return tree_root([tensor_root(t, tree_root) for _, t in state_tensors(trainer)])


@dataclass
class StepTrace:
    """One inner step: its loss, the ops in order as ``(phase, name, output root)``, the state root
    after it."""

    loss: float
    ops: list[tuple[str, str, bytes]] = field(default_factory=list)
    state_root: bytes = b""


class _Recorder(TorchFunctionMode):
    """Records each float32 tensor a model-level torch function returns, and its autograd node's gradients."""

    def __init__(self, trace: StepTrace, tree_root: TreeRoot) -> None:
        super().__init__()
        self.trace, self.tree_root = trace, tree_root
        self._hooked: list = []  # the autograd nodes hooked (held, so that no id is reused)

    def _record(self, phase: str, name: str, value) -> None:
        tensors = value if isinstance(value, (tuple, list)) else (value,)
        for index, tensor in enumerate(tensors):
            if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32:
                label = name if len(tensors) == 1 else f"{name}[{index}]"
                self.trace.ops.append((phase, label, tensor_root(tensor, self.tree_root)))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", str(func))
        self._record("forward", name, out)
        node = getattr(out, "grad_fn", None) if isinstance(out, torch.Tensor) else None
        if node is not None and all(node is not seen for seen in self._hooked):
            self._hooked.append(node)
            node.register_hook(lambda grads, _outs, label=f"{type(node).__name__}<-{name}":
                               self._record("backward", label, grads))
        return out


class _TracingPlatform:
    """The trainer's platform with the recorder entered inside its ``autocast`` (above ``ExactKernels``)."""

    def __init__(self, platform, recorder: _Recorder) -> None:
        self._platform, self._recorder = platform, recorder

    def __getattr__(self, name):
        return getattr(self._platform, name)

    def autocast(self):
        import contextlib

        stack = contextlib.ExitStack()
        stack.enter_context(self._platform.autocast())
        stack.enter_context(self._recorder)
        return stack


def trace_steps(trainer, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], tree_root: TreeRoot,
                ) -> tuple[bytes, list[StepTrace]]:
    """Run ``trainer.train_step`` on each batch, recording each step (module docstring): the state root
    before the first step, and each step's :class:`StepTrace`. The trainer must be in the reproducible
    mode."""
    if not getattr(trainer.training_cfg, "reproducible", False):
        raise ValueError("trace_steps: the trace is defined for the reproducible mode only")
    start = state_root(trainer, tree_root)
    traces = []
    platform = trainer.platform
    try:
        for x, y in batches:
            trace = StepTrace(loss=0.0)
            trainer.platform = _TracingPlatform(platform, _Recorder(trace, tree_root))
            trace.loss = trainer.train_step(x, y)
            trainer.platform = platform
            for name, tensor in state_tensors(trainer):
                trace.ops.append(("optimizer", name, tensor_root(tensor, tree_root)))
            trace.state_root = state_root(trainer, tree_root)
            traces.append(trace)
    finally:
        trainer.platform = platform
    return start, traces


def float32_bits(value) -> int:
    """The IEEE binary32 encoding of a float32 scalar, as an unsigned integer."""
    return int(np.asarray(value, dtype=np.float32).reshape(()).view(np.uint32))


def partial_sums(a: torch.Tensor, b: torch.Tensor, row: int, col: int) -> list[int]:
    """The ``K + 1`` partial sums (bits) of element ``(row, col)`` of ``ordered_matmul(a, b)`` for ``a``
    (M, K) and ``b`` (K, N): one float32 multiply and one float32 add at a time, ``k`` increasing."""
    x = a.detach().cpu().numpy().astype(np.float32, copy=False)[row]
    y = b.detach().cpu().numpy().astype(np.float32, copy=False)[:, col]
    total = np.float32(0.0)
    sums = [float32_bits(total)]
    with np.errstate(all="ignore"):
        for left, right in zip(x, y):
            total = np.float32(total + np.float32(left * right))
            sums.append(float32_bits(total))
    return sums


def tree_levels(a: torch.Tensor, inner: int, elem: int, cols: int = 1) -> list[list[int]]:
    """The levels (bits) of the tree sum of output element ``elem = r * cols + c`` of ``a`` as ``(rows, inner,
    cols)`` summed over its middle dimension, ``a[r, :, c]`` (``cols`` 1: row ``elem``'s sum;
    :func:`training.exact_math.tree_sum`'s tree, :func:`tree_levels_of`)."""
    return tree_levels_of(a.detach().cpu().reshape(-1, inner, cols)[elem // cols, :, elem % cols].numpy())


def tree_levels_of(values: np.ndarray) -> list[list[int]]:
    """The levels (bits) of the tree sum of the float32 ``values``: level 0 the values; level ``l + 1`` of a
    level of ``c`` nodes has node ``i = fl(node_i + node_(i + c // 2))`` for ``i < c // 2`` and, for an odd
    ``c``, the last node carried; the last level is the one sum."""
    level = np.asarray(values, dtype=np.float32).reshape(-1).copy()
    levels = [[int(v) for v in level.view(np.uint32)]]
    with np.errstate(all="ignore"):
        while level.size > 1:
            half = level.size // 2
            summed = level[:half] + level[half:2 * half]
            level = np.concatenate((summed, level[2 * half:])) if level.size % 2 else summed
            levels.append([int(v) for v in level.view(np.uint32)])
    return levels


#: The operations StepProver recomputes (contracts/src/StepProver.sol): elementwise (the second operand
#: broadcast as ``e % len``), the ordered product, the embedding's lookup (``GATHER``: ``a`` the ids) and the
#: tree sum of each row of ``inner`` elements (``TREESUM``: ``b`` unread).
ADD, SUB, MUL, DIV, MATMUL, GATHER, TREESUM = 1, 2, 3, 4, 5, 6, 7


#: A program input index ``CONST_INPUT + bits``: the one-element tensor of float32 ``bits`` (StepProver's
#: constant operand, ``ledger.stepproof.CONST_INPUT``), such as the count a mean divides by.
CONST_INPUT = 2**32


def const_index(value: float) -> int:
    """The program input index of the constant ``value`` (rounded to float32)."""
    return CONST_INPUT + float32_bits(value)


def program_input(tensors: list[torch.Tensor], index: int) -> torch.Tensor:
    """Trace leaf ``index``'s tensor, or the constant an index :data:`CONST_INPUT` ``+ bits`` names."""
    if index >= CONST_INPUT:
        return torch.from_numpy(np.array([index - CONST_INPUT], dtype=np.uint32).view(np.float32))
    return tensors[index]


def op_point(kind: int, rows: int, inner: int, cols: int, a: torch.Tensor, b: torch.Tensor, elem: int,
             point) -> int:
    """What an honest defender posts at ``point`` of output element ``elem``'s game: a product's partial
    sum ``point`` (:func:`partial_sums`), a tree sum's node ``point = (level, index)``
    (:func:`tree_levels`)."""
    if kind == TREESUM:
        level, index = point
        return tree_levels(a, inner, elem, cols)[level][index]
    if kind != MATMUL:
        raise ValueError(f"op_point: op kind {kind} has no inner game")
    return partial_sums(a.reshape(rows, inner), b.reshape(inner, cols), elem // cols, elem % cols)[point]


#: The elementwise functions (helper fn78's numbering; until its StepProver change merges, run here only):
#: ``UNARY`` ``out[e] = f(a[e])``, ``UNARY_SLOPE`` ``out[e] = f'(a[e])``, ``f`` by its code in ``inner``.
UNARY, UNARY_SLOPE = 8, 9
UNARY_CODES = {1: "exp", 2: "log", 3: "tanh", 4: "sigmoid", 5: "silu", 6: "gelu_tanh", 7: "rsqrt", 8: "sqrt"}


def _unary(kind: int, code: int, x: torch.Tensor) -> torch.Tensor:
    """``UNARY`` / ``UNARY_SLOPE`` of function ``code`` at float32 ``x``: ``exact_ops.unary_values`` (kernel
    version 3's bits), the square root ``exact_kernel.sqrt`` (correctly rounded; its slope is not defined)."""
    from training import exact_kernel
    from training.exact_ops import unary_values

    name = UNARY_CODES.get(code)
    if name is None or (name == "sqrt" and kind == UNARY_SLOPE):
        raise ValueError(f"run_op: no elementwise function {code} for op kind {kind}")
    if name == "sqrt":
        return exact_kernel.sqrt(x, 3)
    with exact_kernel.using(3):
        value, slope = unary_values(name, x)
    return value if kind == UNARY else slope


def run_op(kind: int, rows: int, inner: int, cols: int, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """One program op as StepProver defines it, in float32: ``MATMUL`` is ``ordered_matmul`` of ``a`` as
    (rows, inner) and ``b`` as (inner, cols); an elementwise op has ``rows`` outputs, ``a[e % len(a)] op
    b[e % len(b)]``, one IEEE operation each; ``GATHER`` the rows ``a[i]`` (ids) of ``b`` as a table of
    ``cols`` columns, flattened (bits copied); ``TREESUM`` the tree sum (``exact_kernel.tree_sum``) of ``a``
    as ``(rows, inner, cols)`` over its middle dimension (``cols`` 1: each row's sum; ``rows`` 1: each
    column's)."""
    from training import exact_kernel

    if kind == TREESUM:
        return exact_kernel.tree_sum(a.detach().reshape(rows, inner, cols).float(), 1).reshape(-1)
    if kind == GATHER:
        return b.detach().reshape(-1, cols)[a.detach().reshape(-1).long()].reshape(-1).float()
    if kind in (UNARY, UNARY_SLOPE):
        return _unary(kind, inner, a.detach().reshape(-1).float())

    a, b = a.detach().reshape(-1).float(), b.detach().reshape(-1).float()
    if kind == MATMUL:
        return exact_kernel.ordered_matmul(a.view(rows, inner), b.view(inner, cols)).reshape(-1)
    index = torch.arange(rows)
    x, y = a[index % a.numel()], b[index % b.numel()]
    ops = {ADD: torch.add, SUB: torch.sub, MUL: torch.mul, DIV: torch.div}
    if kind not in ops:
        raise ValueError(f"run_op: unknown op kind {kind}")
    return ops[kind](x, y)
