"""Kernel version 2 on a GPU: the Triton kernels of training/exact_triton.py give version 2's bits.

On the CPU the kernels run under Triton's interpreter (each float32 operation one numpy IEEE operation), and
are compared bit for bit with version 2's Numba loops (training/exact_kernel_numba.py): random shapes with
ragged tiles, transposed operands, and every product of a forward and backward pass of the ``tiny`` and
``llama-tiny`` models and of Muon's Newton-Schulz. Kernels that fuse the multiply and the add, or sum ``k``
in another order, are seen to differ on the same operands (the comparison can fail). On a CUDA GPU (tests
marked ``gpu``, skipped without one) the compiled kernels are compared with the CPU's bits the same way;
bench/bench_exact_triton.py (the operands and the model calls) records the same comparison on a lent GPU
(bench/gpu_checks.sh). Compiled for an H100 without a GPU, the kernels' code is read: no FMA.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", exc_type=ImportError,
                             reason="triton cannot be imported (pyproject.toml's gpu extra installs it)")
import triton.language as tl  # noqa: E402

from bench.bench_exact_triton import SHAPES, bits_equal, model_calls, operands, sum_operand, unary_inputs  # noqa: E402
from training import exact_kernel, exact_triton  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                         reason="no CUDA GPU: torch.cuda.is_available() is false")


@pytest.mark.parametrize("shape", SHAPES)
def test_the_triton_product_is_version_2s_bit_for_bit(shape):
    a, b = operands(shape, sum(shape))
    out = exact_triton.ordered_matmul(a, b)
    assert out.dtype == torch.float32 and out.shape == (*shape[:-3], shape[-3], shape[-1])
    assert torch.equal(out, exact_kernel.ordered_matmul(a, b))
    # Transposed (strided) operands, as the backward passes give them.
    left, right = b.transpose(-1, -2), a.transpose(-1, -2)
    assert torch.equal(exact_triton.ordered_matmul(left, right), exact_kernel.ordered_matmul(left, right))


def _fused_tile(a, b, c, rows, cols, inner, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The product with each step one fused multiply-add (contiguous operands)."""
    i = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k in range(inner):
        a_k = tl.load(a + i * inner + k, mask=i < rows, other=0.0)
        b_k = tl.load(b + k * cols + j, mask=j < cols, other=0.0)
        acc = tl.fma(a_k[:, None], b_k[None, :], acc)
    tl.store(c + i[:, None] * cols + j[None, :], acc, mask=(i < rows)[:, None] & (j < cols)[None, :])


def _reversed_tile(a, b, c, rows, cols, inner, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The product summed over ``k`` decreasing."""
    i = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for step in range(inner):
        k = inner - 1 - step
        a_k = tl.load(a + i * inner + k, mask=i < rows, other=0.0)
        b_k = tl.load(b + k * cols + j, mask=j < cols, other=0.0)
        acc = acc + a_k[:, None] * b_k[None, :]
    tl.store(c + i[:, None] * cols + j[None, :], acc, mask=(i < rows)[:, None] & (j < cols)[None, :])


@pytest.mark.parametrize("variant", [_fused_tile, _reversed_tile])
def test_a_fused_or_reordered_kernel_is_seen_to_differ(variant):
    """What the comparison above rules out: an FMA per step, or another order, changes the bits."""
    a, b = operands((40, 96, 50), 3)
    out = torch.empty(40, 50)
    InterpretedFunction(variant)[(1, 1)](a, b, out, 40, 50, 96, BLOCK_M=64, BLOCK_N=64)
    expected = exact_kernel.ordered_matmul(a, b)
    assert torch.allclose(out, expected, rtol=1e-4, atol=1e-3 * float(expected.abs().max()))
    assert not torch.equal(out, expected)


def test_bad_operands_are_refused():
    a, b = operands((4, 6, 5), 1)
    with pytest.raises(TypeError, match="float32"):
        exact_triton.ordered_matmul(a.double(), b.double())
    with pytest.raises(ValueError, match="do not chain"):
        exact_triton.ordered_matmul(a, b.T)
    with pytest.raises(ValueError, match="do not chain"):
        exact_triton.ordered_matmul(a.expand(2, 4, 6), b)


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_the_models_products_sums_and_functions_forward_and_backward_are_version_2s(preset):
    calls = model_calls(preset)
    products = [args for kind, args, _ in calls if kind == "ordered_matmul"]
    assert len(products) >= 20 and len({(a.shape, b.shape) for a, b in products}) >= 6
    assert any(a.dim() == 4 for a, _ in products)  # attention's QK^T and PV
    kinds = [kind for kind, _, _ in calls]
    assert kinds.count("tree_sum") >= 4 and kinds.count("unary32") >= 2
    for kind, args, out in calls:
        got = getattr(exact_triton, kind)(*args)
        assert bits_equal(got, out), (kind, [getattr(a, "shape", a) for a in args])


@pytest.mark.parametrize("kernels", [2, 3])
@pytest.mark.parametrize("preset, optimizer", [("tiny", "adamw"), ("llama-tiny", "muon"),
                                               ("tiny@48", "adamw")])
def test_the_gpu_probes_cpu_side_without_numba_gives_version_2s_weights(preset, optimizer, kernels):
    """Where numba is not installed (a lent GPU machine), the probe computes the CPU's side by the formulas
    with version 2's (and 3's) bits: two inner steps give Numba's weights."""
    from bench.bench_exact_triton import cpu_formulas, inner_steps

    expected, numba_product = inner_steps(preset, optimizer, "cpu", kernels), exact_kernel.ordered_matmul
    with cpu_formulas(True):
        assert exact_kernel.ordered_matmul is not numba_product  # the formulas, not the Numba loops
        assert inner_steps(preset, optimizer, "cpu", kernels) == expected
    assert exact_kernel.ordered_matmul is numba_product


@pytest.mark.slow
@pytest.mark.parametrize("preset, optimizer", [("tiny", "adamw"), ("llama-tiny", "muon")])
def test_two_inner_steps_with_the_triton_kernels_give_version_2s_weights(monkeypatch, preset, optimizer):
    """The trainer's two inner steps (forward, backward, clipping, the optimizer) with every version 2
    kernel computed by the Triton kernels, as on a GPU (here interpreted): Numba's weights, bit for bit."""
    from bench.bench_exact_triton import inner_steps

    expected = inner_steps(preset, optimizer, "cpu", 2)
    numba_tree_sum = exact_kernel.tree_sum

    def tree_sum(x, dim, version=None):  # exact_kernel.tree_sum's choice of pass, its compiled one Triton's
        version = exact_kernel.CURRENT.get() if version is None else version
        if version >= 2 and x.dim() and x.dtype in (torch.float32, torch.float64) and x.size(dim) >= 2:
            return exact_triton.tree_sum(x, dim)
        return numba_tree_sum(x, dim, version)

    monkeypatch.setattr(exact_kernel, "ordered_matmul", exact_triton.ordered_matmul)
    monkeypatch.setattr(exact_kernel, "unary32", exact_triton.unary32)
    monkeypatch.setattr(exact_kernel, "tree_sum", tree_sum)
    assert inner_steps(preset, optimizer, "cpu", 2) == expected


# ----------------------------------------------------------------------------- tree sums and functions


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(2,), (3,), (7, 5), (3, 17, 4, 33), (2, 0, 3), (64, 129)])
def test_the_triton_tree_sum_is_version_2s_bit_for_bit(shape, dtype):
    """Every dimension of at least 2 elements; operands over 16 orders of magnitude."""
    x = sum_operand(shape, dtype, len(shape))
    for dim in [d for d in range(len(shape)) if shape[d] >= 2]:
        got, want = exact_triton.tree_sum(x, dim), exact_kernel.tree_sum(x, dim, 2)
        assert got.shape == want.shape and got.dtype == dtype and torch.equal(got, want), (dim,)


def test_another_summation_order_is_seen_to_differ():
    """What the comparison above rules out: the same numbers summed left to right give other bits."""
    generator = torch.Generator().manual_seed(9)
    x = torch.randn(64, 129, generator=generator) * torch.logspace(-8, 8, 129)
    sequential = x[:, :1].clone()
    for k in range(1, 129):
        sequential = sequential + x[:, k:k + 1]
    tree = exact_triton.tree_sum(x, 1)
    assert torch.allclose(tree, sequential, rtol=1e-5, atol=1e-6 * float(x.abs().max()))
    assert not torch.equal(tree, sequential)


@pytest.mark.parametrize("name", sorted(exact_triton.CODES))
def test_the_triton_elementwise_functions_are_version_2s_bit_for_bit(name):
    x = unary_inputs(name)
    value, slope = exact_triton.unary32(name, x[:50_000].reshape(100, -1)[:, :300])  # a strided 2-d view
    want_value, want_slope = exact_kernel.unary32(name, x[:50_000].reshape(100, -1)[:, :300])
    assert value.shape == (100, 300) and bits_equal(value, want_value) and bits_equal(slope, want_slope)
    value, slope = exact_triton.unary32(name, x)
    want_value, want_slope = exact_kernel.unary32(name, x)
    assert bits_equal(value, want_value) and bits_equal(slope, want_slope)


def test_bad_inputs_of_the_sums_and_functions_are_refused():
    with pytest.raises(ValueError, match="unknown function 'erf'"):
        exact_triton.unary32("erf", torch.ones(3))
    with pytest.raises(TypeError, match="float32"):
        exact_triton.unary32("exp", torch.ones(3, dtype=torch.float64))
    with pytest.raises(TypeError, match="float32 or float64"):
        exact_triton.tree_sum(torch.ones(3, dtype=torch.float16), 0)
    with pytest.raises(ValueError, match="at least 2"):
        exact_triton.tree_sum(torch.ones(3, 1), 1)


# ----------------------------------------------------------------------------- the compiled kernels


def compiled(fn, signature: dict, constants: dict, fusion: bool = False):
    """``fn`` compiled for an H100 (sm_90) as :func:`training.exact_triton._launch` compiles it (no GPU
    needed: Triton ships ptxas and cuobjdump)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(triton.jit(fn), {**signature, **{name: "constexpr" for name in constants}},
                       constexprs=constants)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={**exact_triton.EXACT_OPTIONS, "enable_fp_fusion": fusion})


PRODUCT_SIGNATURE = {"a": "*fp32", "b": "*fp32", "c": "*fp32", "rows": "i32", "cols": "i32", "inner": "i32",
                     "a_batch": "i64", "a_row": "i32", "a_inner": "i32", "b_batch": "i64", "b_inner": "i32",
                     "b_col": "i32"}


def sass(kernel) -> str:
    """The machine code of a compiled kernel (cuobjdump of its cubin)."""
    import pathlib
    import subprocess
    import tempfile

    tool = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        return subprocess.run([str(tool), "-sass", cubin.name], capture_output=True, text=True, check=True,
                              timeout=120).stdout


def test_the_compiled_product_has_no_fused_multiply_add():
    """sm_90's machine code of the product: separate FMUL and FADD; with ``enable_fp_fusion`` on (Triton's
    default) the same source compiles to FFMA (what the option prevents: the test can fail)."""
    tile = dict(zip(("BLOCK_M", "BLOCK_N"), exact_triton.TILE_DEVICE))
    exact = compiled(exact_triton._ordered_tile, PRODUCT_SIGNATURE, tile)
    code = sass(exact)
    assert "FFMA" not in code and "FMUL" in code and "FADD" in code
    assert "fma" not in exact.asm["ptx"] and "mul.rn.f32" in exact.asm["ptx"]
    assert "FFMA" in sass(compiled(exact_triton._ordered_tile, PRODUCT_SIGNATURE, tile, fusion=True))


def test_the_compiled_sums_and_functions_use_correctly_rounded_operations_only():
    """The PTX of the tree sums and of every elementwise function: IEEE round-to-nearest operations (``.rn``)
    only: no FMA, no approximate instruction, no flush-to-zero, no call (libdevice)."""
    import re

    kernels = [compiled(exact_triton._tree_sum_columns, {"x": f"*{dtype}", "count": "i32", "inner": "i32",
                                                          "columns": "i32"}, {"BLOCK": 128})
               for dtype in ("fp32", "fp64")]
    unary = {"x": "*fp32", "value": "*fp32", "slope": "*fp32", "size": "i32"}
    kernels += [compiled(exact_triton._unary, unary, {"CODE": code, "BLOCK": exact_triton.UNARY_BLOCK_DEVICE})
                for code in sorted(exact_triton.CODES.values())]
    for kernel in kernels:
        ptx = kernel.asm["ptx"]
        operation = r"\b(?:add|sub|mul|div|sqrt|fma|rcp|rsqrt|ex2|lg2)\.[a-z0-9.]*f(?:32|64)\b"
        floating = re.findall(operation, ptx)
        assert floating and all(".rn." in op and not op.startswith(("fma", "rcp", "rsqrt", "ex2", "lg2"))
                                for op in floating), sorted(set(floating))
        assert ".approx" not in ptx and ".ftz" not in ptx and "call" not in ptx


# ----------------------------------------------------------------------------- on a GPU


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES)
def test_on_a_gpu_the_product_is_the_cpus_bit_for_bit(shape):
    a, b = operands(shape, sum(shape))
    expected = exact_kernel.ordered_matmul(a, b)
    out = exact_kernel.ordered_matmul(a.cuda(), b.cuda())  # the CUDA branch: the compiled Triton kernel
    assert out.device.type == "cuda" and torch.equal(out.cpu(), expected)
    left, right = b.transpose(-1, -2), a.transpose(-1, -2)
    assert torch.equal(exact_triton.ordered_matmul(left.cuda(), right.cuda()).cpu(),
                       exact_kernel.ordered_matmul(left, right))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(exact_triton.CODES))
def test_on_a_gpu_the_sums_and_functions_are_the_cpus_bit_for_bit(name):
    x = unary_inputs(name)
    value, slope = exact_kernel.unary32(name, x.cuda())
    want_value, want_slope = exact_kernel.unary32(name, x)
    assert value.device.type == "cuda" and bits_equal(value.cpu(), want_value)
    assert bits_equal(slope.cpu(), want_slope)
    for dtype in (torch.float32, torch.float64):
        y = sum_operand((3, 17, 4, 33), dtype, len(name))
        for dim in range(4):
            want = exact_kernel.tree_sum(y, dim, 2)
            assert torch.equal(exact_kernel.tree_sum(y.cuda(), dim, 2).cpu(), want)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_on_a_gpu_the_models_kernels_are_the_cpus_bit_for_bit(preset):
    for kind, args, out in model_calls(preset):
        got = getattr(exact_triton, kind)(*(a.cuda() if torch.is_tensor(a) else a for a in args))
        assert bits_equal(got, out), (kind, [getattr(a, "shape", a) for a in args])
