"""A real model's reproducible inner step compiled to a program of element-level ops (issue 78, docs/
FRAUD_PROOF.md "The model's step as a program"): training/step_compile.py, training/step_ops.py.

``llama-tiny`` (2 layers, grouped-query attention, RoPE, SwiGLU, RMSNorm, an untied head; AdamW with the clip)
is compiled from its first inner step at kernel version 3 and the program is run with ``run_op`` (and the
kinds not on chain yet) from the step's start on the step's batch: every tensor the compiler recorded, the
loss and the end state (weights and AdamW moments) are the trainer's own bits, and every output the step's
model-level trace (training/step_trace.py ``trace_steps``) commits is one of the program's tensors but the
RoPE tables' making (the program holds the tables) and a view the program never makes on its own.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

import pytest
import torch

from training.config import ModelConfig
from training.exact_probe import trainer_for
from training.step_compile import compile_step
from training.step_ops import (
    LAYOUT, NAMES, ON_CHAIN, TABLE_INPUT, Program, StepCompileError, counts, output_size, run_program,
)
from training.step_trace import CONST_INPUT, MATMUL, TREESUM, state_tensors, tensor_root, trace_steps

PRESET = "llama-tiny"


def _flat_root(leaves: list[bytes]) -> bytes:
    """A digest of the tensor's bits alone (each chunk leaf less its 24-byte header, which names the
    tensor's columns): a program tensor is flat, a traced one has the model's shape."""
    return hashlib.sha256(b"".join(leaf[24:] for leaf in leaves)).digest()


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).numpy().tobytes()


@pytest.fixture(scope="module")
def step():
    cfg, trainer = trainer_for(PRESET, "adamw", True, 2, 3)
    generator = torch.Generator().manual_seed(7)
    batch = torch.randint(0, cfg.vocab_size, (2, cfg.block_size + 1), generator=generator)
    compiled = compile_step(trainer, batch, keep_values=True)
    _, reference = trainer_for(PRESET, "adamw", True, 2, 3)
    _, traces = trace_steps(reference, [(batch[:, :-1], batch[:, 1:])], _flat_root)
    STEPPED.append(trainer)  # after its first step: test_the_next_steps_program_differs_in_constants
    return compiled, reference, traces[0], run_program(compiled.program, compiled.start, batch)


STEPPED: list = []


def test_the_program_gives_the_trainers_step_bit_for_bit(step):
    compiled, reference, trace, tensors = step
    program = compiled.program
    assert len(tensors) == program.state + len(program.ops) == len(compiled.values)
    differ = [i for i, t in enumerate(tensors) if _bits(t) != _bits(compiled.values[i])]
    assert differ == []  # every recorded tensor: forward, backward, clip, AdamW
    named = state_tensors(reference)
    assert program.names == [name for name, _ in named]
    assert [name for (name, want), q in zip(named, program.copies, strict=True)
            if _bits(tensors[q]) != _bits(want)] == []
    assert float(tensors[program.loss]) == trace.loss == compiled.loss
    lean = run_program(program, compiled.start, compiled.batch, keep_all=False)  # what the bench runs
    assert [_bits(lean[q]) for q in program.copies] == [_bits(tensors[q]) for q in program.copies]
    assert sum(t is None for t in lean) > len(program.ops) // 2 and lean[program.loss] is not None
    have = {tensor_root(t, _flat_root) for t in [*tensors, *program.tables]}
    missing = [(i, name) for i, (_phase, name, root) in enumerate(trace.ops) if root not in have]
    # the RoPE tables' making (ops 1-9, before the model reads a weight) and value's (B, kv heads, T, d)
    # view in each layer, which the program reads straight into the heads' repeat (GQA)
    assert [name for _, name in missing] == ["float", "div", "__rpow__", "__rdiv__", "float", "__getitem__",
                                             "__getitem__", "mul", "cat", "transpose", "transpose"]
    assert trace.ops[missing[0][0] - 1][1] == "embedding" and missing[8][0] == 9


def test_the_program_is_the_step_not_any_run(step):
    """A one-ulp change in the start, or one op read as another, changes the end: the evaluation checks."""
    compiled, _reference, _trace, tensors = step
    program = compiled.program
    start = [t.clone() for t in compiled.start]
    start[0].view(torch.int32)[5] += 1
    moved = run_program(program, start, compiled.batch)
    assert any(_bits(moved[q]) != _bits(tensors[q]) for q in program.copies)
    j = next(j for j, op in enumerate(program.ops) if op[0] == 3 and op[4] == op[5] == op[1] > 1)
    swapped = replace(program, ops=[(1, *op[1:]) if i == j else op for i, op in enumerate(program.ops)])
    again = run_program(swapped, compiled.start, compiled.batch)
    assert any(_bits(again[q]) != _bits(tensors[q]) for q in program.copies)


def test_the_program_is_the_step_on_another_batch(step):
    """Compiled on one batch, run on another from the same start: the trainer's step on that batch, so no
    value of the compiling batch is a constant of the program (the targets' pick, the clip's factor)."""
    compiled = step[0]
    cfg, other = trainer_for(PRESET, "adamw", True, 2, 3)
    generator = torch.Generator().manual_seed(8)
    batch = torch.randint(0, cfg.vocab_size, (2, cfg.block_size + 1), generator=generator)
    assert not torch.equal(batch, compiled.batch)
    loss = other.train_step(batch[:, :-1], batch[:, 1:])
    tensors = run_program(compiled.program, compiled.start, batch, keep_all=False)
    assert [_bits(tensors[q]) for q in compiled.program.copies] == [_bits(t) for _, t in state_tensors(other)]
    assert float(tensors[compiled.program.loss]) == loss


def test_the_program_counts(step):
    compiled = step[0]
    program = compiled.program
    table = counts(program, 100)
    kinds = {op[0] for op in program.ops}
    assert sum(table["ops_per_kind"].values()) == table["ops"] == len(program.ops)
    assert table["ops_not_on_chain"] == sum(1 for op in program.ops if op[0] not in ON_CHAIN) > 0
    assert {MATMUL, TREESUM, LAYOUT, 8, 9} <= kinds and all(NAMES.get(k) for k in kinds)
    assert (1 << (table["depth"] - 1)) < program.state + len(program.ops) <= (1 << table["depth"])
    for kind, rows, inner, cols, a_len, b_len, *_ in program.ops:  # StepProver's shape rules
        if kind == MATMUL:
            assert (a_len, b_len) == (rows * inner, inner * cols)
        elif kind == TREESUM:
            assert (a_len, b_len) == (rows * inner * cols, 0)
        elif kind in (1, 2, 3, 4):  # the second operand (and the first) broadcast as e % len
            assert (inner, cols) == (0, 1) and rows % a_len == 0 and rows % b_len == 0
    assert all(i < TABLE_INPUT + len(program.tables) for op in program.ops for i in op[6:])


def test_what_the_compiler_refuses_is_named():
    cfg, plain = trainer_for(PRESET, "adamw", False, 2)
    batch = torch.zeros(2, cfg.block_size + 1, dtype=torch.int64)
    with pytest.raises(StepCompileError, match="reproducible mode at kernel version 3"):
        compile_step(plain, batch)
    _, version2 = trainer_for(PRESET, "adamw", True, 2, 2)
    with pytest.raises(StepCompileError, match="kernel version 3"):
        compile_step(version2, batch)
    _, muon = trainer_for(PRESET, "muon", True, 2, 3)
    with pytest.raises(StepCompileError, match="ExactAdamW"):
        compile_step(muon, batch)
    _, good = trainer_for(PRESET, "adamw", True, 2, 3)
    with pytest.raises(StepCompileError, match="int64"):
        compile_step(good, batch.float())
    with pytest.raises(StepCompileError, match="2 state tensors for a program of 3"):
        run_program(Program(names=["a", "b", "c"]), [torch.zeros(1), torch.zeros(1)], None)


def test_each_ops_size_is_its_output(step):
    compiled, _reference, _trace, tensors = step
    program = compiled.program
    for j, (spec, extra) in enumerate(zip(program.ops, program.extras)):
        assert output_size(*spec[:4], extra) == tensors[program.state + j].numel(), (j, spec)


def test_run_op_computes_the_elementwise_functions_as_the_kernels():
    """Kinds 8 and 9 (helper fn78's numbering) in ``run_op``: the kernels' value and slope bits."""
    from training import exact_kernel
    from training.exact_ops import unary_values
    from training.step_trace import UNARY, UNARY_CODES, UNARY_SLOPE, run_op

    x = torch.linspace(0.05, 4.0, 97)  # positive: log, rsqrt and sqrt are defined
    for code, name in UNARY_CODES.items():
        if name == "sqrt":
            assert _bits(run_op(UNARY, 97, code, 1, x, x)) == _bits(exact_kernel.sqrt(x, 3))
            with pytest.raises(ValueError, match="no elementwise function 8 for op kind 9"):
                run_op(UNARY_SLOPE, 97, code, 1, x, x)
            continue
        with exact_kernel.using(3):
            value, slope = unary_values(name, x)
        assert _bits(run_op(UNARY, 97, code, 1, x, x)) == _bits(value), name
        assert _bits(run_op(UNARY_SLOPE, 97, code, 1, x, x)) == _bits(slope), name
    with pytest.raises(ValueError, match="no elementwise function 9"):
        run_op(UNARY, 97, 9, 1, x, x)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["mini", "llama-mini"])
def test_other_models_compile_to_their_step(preset):
    """GPT-2 (``mini``: LayerNorm, tanh-GELU, learned positions, biases, an untied head) and ``llama-mini``:
    compiled on one batch, run on another, the trainer's bits."""
    cfg, trainer = trainer_for(preset, "adamw", True, 2, 3)
    generator = torch.Generator().manual_seed(7)
    first, second = (torch.randint(0, cfg.vocab_size, (2, cfg.block_size + 1), generator=generator)
                     for _ in range(2))
    compiled = compile_step(trainer, first)
    _, other = trainer_for(preset, "adamw", True, 2, 3)
    loss = other.train_step(second[:, :-1], second[:, 1:])
    tensors = run_program(compiled.program, compiled.start, second, keep_all=False)
    assert [_bits(tensors[q]) for q in compiled.program.copies] == [_bits(t) for _, t in state_tensors(other)]
    assert float(tensors[compiled.program.loss]) == loss


def test_the_program_as_json_runs_the_same(step):
    compiled, _reference, _trace, tensors = step
    text = compiled.program.to_json()
    loaded = Program.from_json(text)
    assert loaded.to_json() == text and loaded.names == compiled.program.names
    again = run_program(loaded, compiled.start, compiled.batch, keep_all=False)
    assert [_bits(again[q]) for q in loaded.copies] == [_bits(tensors[q]) for q in compiled.program.copies]
    with pytest.raises(StepCompileError, match="step program JSON: KeyError"):
        Program.from_json('{"ops": []}')
    with pytest.raises(StepCompileError, match="8 fields"):
        Program.from_json(text.replace('"extras": [[', '"extras": [[], [', 1))


def test_the_next_steps_program_differs_in_constants_only(step):
    """Step 2's program is step 1's but for AdamW's constants of the step index: per parameter the divisor
    ``sqrt(1 - beta2^t)`` and the factor ``lr / (1 - beta1^t)`` (one program per step index, docs/
    FRAUD_PROOF.md "The model's step as a program" (c))."""
    first = step[0].program
    vocab = ModelConfig(preset=PRESET).vocab_size
    batch = torch.randint(0, vocab, tuple(step[0].batch.shape), generator=torch.Generator().manual_seed(9))
    second = compile_step(STEPPED[0], batch).program
    assert (second.extras, second.copies, second.names) == (first.extras, first.copies, first.names)
    differ = [(a, b) for a, b in zip(first.ops, second.ops, strict=True) if a != b]
    assert all(a[:6] == b[:6] and all(x == y or min(x, y) >= CONST_INPUT for x, y in zip(a[6:], b[6:]))
               for a, b in differ)
    grads = sum(1 for name in first.names if not name.endswith(("/exp_avg", "/exp_avg_sq")))
    assert sorted({a[0] for a, _ in differ}) == [3, 4] and len(differ) == 2 * grads
