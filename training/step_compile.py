"""A real model's reproducible inner step as a program of element-level ops (issue 78, docs/FRAUD_PROOF.md
"The model's step as a program").

:func:`compile_step` runs the trainer's own inner step (``LocalReplicaTrainer.train_step``, kernel version 3)
once under a recorder below autograd (a ``TorchDispatchMode``: every ATen operation of the forward pass, of
the backward pass as the engine runs it and of the optimizer) with the reproducible mode's kernels wrapped
(the ordered product, the tree sum, the elementwise functions, the square root, the embedding's backward:
:mod:`training.exact_kernel`, whose compiled loops autograd does not see), and maps each to program ops:

* ``add``, ``sub``, ``mul``, ``div``, ``neg`` (and their in-place forms) to StepProver's elementwise kinds, an
  operand broadcast along leading dimensions read as ``e % len`` (the contract's rule), any other broadcast
  or non-contiguous view first made contiguous by a ``LAYOUT`` op;
* the kernels to ``MATMUL`` (a batch of products: ``BMM``), ``TREESUM``, ``UNARY``/``UNARY_SLOPE``,
  ``INDEX_ADD``; the embedding's lookup to ``GATHER`` of the step's batch (``DATA_INPUT``: the inputs and
  the targets are the batch's two overlapping windows, ``LAYOUT`` ops of it);
* the rest a real step needs to the kinds of :mod:`training.step_ops` (not on chain yet);
* the gradient clip (training/pipeline.py ``inner_step``: the float64 norm, the factor, each gradient times
  it) to ``SQNORM``, ``CLIP`` and one ``MUL`` per gradient, always (a factor of 1 multiplies to the same
  bits, so the program does not branch on the data).

Tensors are followed by their storage: a state tensor, an op's output, the batch; a tensor that no input of
the step reaches is a constant (a scalar ``CONST_INPUT + bits``, else a table). An operation this module does
not map is an error only where the step uses its result (its message names it). The optimizer runs its torch
path (``ExactAdamW``'s operations, the compiled pass's bits), and its moments start at zero (a fresh inner
state). Verified by :func:`training.step_ops.run_program` from the step's start: every recorded tensor and
the end state bit for bit (tests/test_step_compile.py).

What the program is of: **one** inner step, the index ``t`` fixed: AdamW's bias corrections ``1 - beta^t``
and the learning rate of step ``t`` are constants in it (a program for all H steps needs the step counter as
state; docs/FRAUD_PROOF.md). One stage in one process (``LocalReplicaTrainer`` with one stage). While it runs,
the kernels, ``training.pipeline.inner_step`` and AdamW's compiled pass are replaced process-wide: no other
thread of the process may train meanwhile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from training import exact_kernel
from training import pipeline as pipeline_module
from training.step_capture import MUL, SQRT, FUNCTIONS, Capture, Recorder, whole
from training.step_ops import (
    BMM, CLIP, DATA_INPUT, INDEX_ADD, SELECT, SQNORM, Program, StepCompileError, pack64,
)
from training.step_trace import CONST_INPUT, MATMUL, TREESUM, UNARY, UNARY_SLOPE, float32_bits, state_tensors


# ---------------------------------------------------------------------- the kernels, wrapped


def _kernel_wrappers(cap: Capture) -> dict:
    orig = {name: getattr(exact_kernel, name) for name in
            ("ordered_matmul", "tree_sum", "unary32", "sqrt", "embedding_backward")}

    def ordered_matmul(a, b):
        with cap.silent():
            out = orig["ordered_matmul"](a, b)
        if cap.tracked(a) or cap.tracked(b):
            left, right = cap.resolve(a), cap.resolve(b)
            count, (m, k), n = math.prod(a.shape[:-2]), a.shape[-2:], b.size(-1)
            if a.dim() == 2:
                cap.register(out, cap.emit(MATMUL, m, k, n, left, right, out))
            else:
                cap.register(out, cap.emit(BMM, m, k, n, left, right, out, (count,)))
        return out

    def tree_sum(x, dim, version=None):
        with cap.silent():
            out = orig["tree_sum"](x, dim, version)
        if cap.tracked(x):
            dim %= max(x.dim(), 1)
            source = cap.resolve(x)
            rows, inner = math.prod(x.shape[:dim]), x.size(dim)
            pid = source if inner == 1 else cap.emit(TREESUM, rows, inner, x.numel() // (rows * inner),
                                                     source, source, out, b_len=0)
            cap.register(out, pid)
        return out

    def unary32(name, x):
        with cap.silent():
            value, slope = orig["unary32"](name, x)
        if cap.tracked(x):
            source = cap.resolve(x)
            code = FUNCTIONS[name]
            cap.register(value, cap.emit(UNARY, x.numel(), code, 1, source, source, value, b_len=0))
            cap.register(slope, cap.emit(UNARY_SLOPE, x.numel(), code, 1, source, source, slope, b_len=0))
        return value, slope

    def sqrt(x, version=None):
        with cap.silent():
            out = orig["sqrt"](x, version)
        if cap.tracked(x):
            source = cap.resolve(x)
            cap.register(out, cap.emit(UNARY, x.numel(), SQRT, 1, source, source, out, b_len=0))
        return out

    def embedding_backward(ids, rows, out):
        with cap.silent():
            done = orig["embedding_backward"](ids, rows, out)
        if done and (cap.tracked(ids) or cap.tracked(rows)):
            source, grads = cap.resolve(ids), cap.resolve(rows)
            cap.register(out, cap.emit(INDEX_ADD, out.size(0), 0, out.size(1), source, grads, out))
        return done

    return {"ordered_matmul": ordered_matmul, "tree_sum": tree_sum, "unary32": unary32, "sqrt": sqrt,
            "embedding_backward": embedding_backward}, orig


def _clip_and_step(cap: Capture):
    """training/pipeline.py ``inner_step`` with the clip recorded (module docstring)."""

    def inner_step(modules, optimizers, grad_clip, backward, reduce_sq_norm=None, sq_norm=None):
        if len(modules) != 1 or reduce_sq_norm is not None:
            raise StepCompileError("compile_step: one stage in one process (a LocalReplicaTrainer of one "
                                   "stage)")
        module, optimizer = modules[0], optimizers[0]
        module.train()
        optimizer.zero_grad(set_to_none=True)
        loss = backward()
        if grad_clip > 0:
            _record_clip(cap, [p for p in module.parameters() if p.grad is not None], float(grad_clip))
        optimizer.step()
        return loss

    return inner_step


def _record_clip(cap: Capture, params: list, grad_clip: float) -> None:
    if float(np.float32(grad_clip)) != grad_clip:
        raise StepCompileError(f"training.grad_clip={grad_clip} is not a float32: the program's CLIP holds "
                               "its float32 bits")
    total, acc = 0.0, CONST_INPUT + float32_bits(0.0)
    for param in params:
        with cap.silent():
            total = total + exact_kernel.square_sum(param.grad)
        acc = cap.emit(SQNORM, 1, 0, 1, cap.resolve(param.grad), acc, pack64(total))
    coefficient = pipeline_module.clip_coefficient(torch.tensor(total, dtype=torch.float64), grad_clip)
    factor = cap.emit(CLIP, 1, float32_bits(grad_clip), 1, acc, acc,
                      torch.tensor([coefficient], dtype=torch.float32), b_len=0)
    for param in params:
        source = cap.resolve(param.grad)
        if coefficient < 1.0:
            with cap.silent():
                param.grad.mul_(coefficient)
        cap.register(param.grad, cap.emit(MUL, param.grad.numel(), 0, 1, source, factor, param.grad))


@dataclass
class CompiledStep:
    """:func:`compile_step`'s result: the program, the state at the step's start (flat), the batch, and
    (``keep_values``) each program tensor's recorded value."""

    program: Program
    start: list[torch.Tensor]
    batch: torch.Tensor
    values: dict[int, torch.Tensor] | None = field(default=None, repr=False)
    loss: float = 0.0


def fresh_state(trainer) -> None:
    """Give each parameter its zero AdamW moments now (what ``ExactAdamW``'s first step would), so that the
    state tensors are the same list at the step's start and end; StepCompileError for another optimizer."""
    from training.exact_optim import ExactAdamW

    for optimizer in trainer.optimizers:
        if not isinstance(optimizer, ExactAdamW):
            raise StepCompileError(f"compile_step: the inner optimizer is {type(optimizer).__name__}; the "
                                   "compiler maps ExactAdamW (training.optimizer = 'adamw', reproducible)")
        for group in optimizer.param_groups:
            for param in group["params"]:
                state = optimizer.state[param]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def compile_step(trainer, batch: torch.Tensor, keep_values: bool = False) -> CompiledStep:
    """The program of ``trainer``'s next inner step on ``batch`` (``(rows, block_size + 1)`` token ids: the
    inputs are ``batch[:, :-1]``, the targets ``batch[:, 1:]``), found by running that step (the trainer
    takes it). The trainer: one stage, the reproducible mode at kernel version 3, ExactAdamW."""
    from training import exact_optim

    cfg = trainer.training_cfg
    if not getattr(cfg, "reproducible", False) or getattr(cfg, "reproducible_kernels", 1) != 3:
        raise StepCompileError("compile_step: the step program is defined for the reproducible mode at "
                               "kernel version 3 (training.reproducible, reproducible_kernels = 3)")
    if batch.dim() != 2 or batch.dtype != torch.int64 or not whole(batch):
        raise StepCompileError(f"compile_step: the batch is a contiguous (rows, block + 1) int64 tensor, got "
                               f"{tuple(batch.shape)} {batch.dtype}")
    fresh_state(trainer)
    cap = Capture(keep_values)
    named = state_tensors(trainer)
    cap.program.names = [name for name, _ in named]
    start = [t.detach().clone().reshape(-1) for _, t in named]
    for q, (name, tensor) in enumerate(named):
        if not whole(tensor):
            raise StepCompileError(f"compile_step: state tensor {name} is not a whole contiguous tensor")
        cap.register(tensor, q)
        cap.lengths[q] = tensor.numel()
        if cap.values is not None:
            cap.values[q] = start[q]
    cap.register(batch, DATA_INPUT)
    cap.lengths[DATA_INPUT] = batch.numel()
    wrappers, originals = _kernel_wrappers(cap)
    loss_of = trainer.loss
    losses: list[torch.Tensor] = []

    def loss(x, y):
        out = loss_of(x, y)
        losses.append(out)
        return out

    saved = (pipeline_module.inner_step, exact_optim._compiled_step)
    try:
        for name, fn in wrappers.items():
            setattr(exact_kernel, name, fn)
        pipeline_module.inner_step = _clip_and_step(cap)
        exact_optim._compiled_step = lambda *args: False  # the torch path: the same bits, visible
        trainer.loss = loss
        with Recorder(cap):
            value = trainer.train_step(batch[:, :-1], batch[:, 1:])
    finally:
        for name, fn in originals.items():
            setattr(exact_kernel, name, fn)
        pipeline_module.inner_step, exact_optim._compiled_step = saved
        trainer.__dict__.pop("loss", None)
    cap.program.copies = [cap.resolve(tensor) for _, tensor in named]
    cap.program.loss = cap.resolve(losses[-1]) if losses else -1
    program, values = prune(cap.program, cap.values)
    return CompiledStep(program, start, batch, values, value)


def _pid_inputs(program: Program, j: int) -> list[int]:
    (_k, _r, _i, _c, _al, _bl, a, b), extra = program.ops[j], program.extras[j]
    found = [a, b] + ([extra[0]] if program.ops[j][0] == SELECT else [])
    return [i for i in found if i < CONST_INPUT and i != DATA_INPUT]


def prune(program: Program, values: dict | None) -> tuple[Program, dict | None]:
    """``program`` without the ops whose outputs neither the end state nor the loss reads (the slopes of
    functions that are not differentiated, ...), renumbered."""
    state, ops = program.state, len(program.ops)
    needed = set(program.copies) | ({program.loss} if program.loss >= 0 else set())
    for j in range(ops - 1, -1, -1):
        if state + j in needed:
            needed.update(_pid_inputs(program, j))
    renumber = {q: q for q in range(state)}
    for j in range(ops):
        if state + j in needed:
            renumber[state + j] = len(renumber)

    def new(index: int) -> int:
        return renumber[index] if index < CONST_INPUT and index != DATA_INPUT else index

    out = Program(names=program.names, tables=program.tables)
    kept: dict | None = {} if values is not None else None
    for j in range(ops):
        if state + j not in needed:
            continue
        kind, rows, inner, cols, a_len, b_len, a, b = program.ops[j]
        extra = program.extras[j]
        if kind == SELECT:
            extra = (new(extra[0]),) + tuple(extra[1:])
        out.ops.append((kind, rows, inner, cols, a_len, b_len, new(a), new(b)))
        out.extras.append(extra)
        if kept is not None:
            kept[renumber[state + j]] = values[state + j]
    if kept is not None:
        kept.update({q: values[q] for q in range(state)})
    out.copies = [new(c) for c in program.copies]
    out.loss = new(program.loss) if program.loss >= 0 else -1
    return out, kept
