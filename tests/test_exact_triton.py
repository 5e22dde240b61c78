"""Kernel version 2 on a GPU: the Triton kernels of training/exact_triton.py give version 2's bits.

On the CPU the kernels run under Triton's interpreter (each float32 operation one numpy IEEE operation), and
are compared bit for bit with version 2's Numba loops (training/exact_kernel_numba.py): random shapes with
ragged tiles, transposed operands, and every product of a forward and backward pass of the ``tiny`` and
``llama-tiny`` models and of Muon's Newton-Schulz. Kernels that fuse the multiply and the add, or sum ``k``
in another order, are seen to differ on the same operands (the comparison can fail). On a CUDA GPU (tests
marked ``gpu``, skipped without one) the compiled kernels are compared with the CPU's bits the same way;
bench/exact_triton_gpu.py records the same comparison on a lent GPU (bench/gpu_checks.sh).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed (pyproject.toml's gpu extra)")
tl = pytest.importorskip("triton.language")

from training import exact_kernel, exact_triton  # noqa: E402
from training.exact_mode import ExactKernels  # noqa: E402
from training.exact_optim import exact_orthogonalize  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                         reason="no CUDA GPU: torch.cuda.is_available() is false")

#: Ragged against both tiles (TILE_INTERPRETED 64 x 128, TILE_DEVICE 32 x 64), batched, empty, K = 1.
SHAPES = [(1, 1, 1), (7, 45, 29), (2, 3, 17, 64, 33), (5, 1, 8), (0, 4, 3), (4, 0, 3), (3, 5, 0),
          (130, 20, 257), (2, 65, 70, 129)]


def operands(shape, seed: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` (..., M, K) with columns over 12 orders of magnitude (another order or an FMA changes many
    outputs' last bits), ``b`` (..., K, N)."""
    *batch, m, k, n = shape
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(*batch, m, k, generator=generator) * torch.logspace(-6, 6, k)
    b = torch.randn(*batch, k, n, generator=generator)
    return a.to(device), b.to(device)


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


class Recorder:
    """Every call of ``name`` (a function of training/exact_kernel.py) while it is installed: ``(args,
    result)``, the tensors copied; a tree sum's version (its third argument) resolved as the call did."""

    def __init__(self, monkeypatch, name: str) -> None:
        self.calls: list[tuple[tuple, object]] = []
        self.original = getattr(exact_kernel, name)
        monkeypatch.setattr(exact_kernel, name, self)

    def __call__(self, *args):
        if self.original.__name__ == "tree_sum" and (len(args) < 3 or args[2] is None):
            args = (*args[:2], exact_kernel.CURRENT.get())
        out = self.original(*args)
        copies = tuple(a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args)
        self.calls.append((copies, out))
        return out


def model_calls(monkeypatch, preset: str) -> dict[str, list[tuple[tuple, object]]]:
    """Version 2's products, tree sums and elementwise passes in one forward and backward pass of
    ``preset`` (batch 2, 32 tokens), and for ``llama-tiny`` Muon's Newton-Schulz on its first gradient."""
    from training.config import ModelConfig
    from training.model import GPT

    recorders = {name: Recorder(monkeypatch, name) for name in ("ordered_matmul", "tree_sum", "unary32")}
    model = GPT(ModelConfig(preset=preset), seed=0)
    generator = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 256, (2, 32), generator=generator) for _ in range(2))
    with ExactKernels(2):
        _, loss = model(x, y)
    loss.backward()
    if preset == "llama-tiny":
        grad = next(p.grad for p in model.parameters() if p.grad is not None and p.grad.dim() == 2)
        exact_orthogonalize(grad, (3.4445, -4.7750, 2.0315), 2, kernels=2)
    tree_sums = [(args, out) for args, out in recorders["tree_sum"].calls
                 if args[2] == 2 and args[0].dtype in (torch.float32, torch.float64)
                 and args[0].size(args[1]) >= 2]  # the compiled pass (else version 1's torch adds)
    return {"ordered_matmul": recorders["ordered_matmul"].calls, "tree_sum": tree_sums,
            "unary32": recorders["unary32"].calls}


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_the_models_products_sums_and_functions_forward_and_backward_are_version_2s(monkeypatch, preset):
    calls = model_calls(monkeypatch, preset)
    products = calls["ordered_matmul"]
    assert len(products) >= 20 and len({(a.shape, b.shape) for (a, b), _ in products}) >= 6
    assert any(a.dim() == 4 for (a, _), _ in products)  # attention's QK^T and PV
    for (a, b), out in products:
        assert torch.equal(exact_triton.ordered_matmul(a, b), out), (tuple(a.shape), tuple(b.shape))
    assert len(calls["tree_sum"]) >= 4 and len(calls["unary32"]) >= 2
    for (x, dim, _), out in calls["tree_sum"]:
        assert torch.equal(exact_triton.tree_sum(x, dim), out), (tuple(x.shape), dim)
    for (name, x), (value, slope) in calls["unary32"]:
        got = exact_triton.unary32(name, x)
        assert torch.equal(got[0], value) and torch.equal(got[1], slope), name


# ----------------------------------------------------------------------------- tree sums and functions


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(2,), (3,), (7, 5), (3, 17, 4, 33), (2, 0, 3), (64, 129)])
def test_the_triton_tree_sum_is_version_2s_bit_for_bit(shape, dtype):
    """Every dimension of at least 2 elements; operands over 16 orders of magnitude."""
    generator = torch.Generator().manual_seed(len(shape))
    x = (torch.randn(shape, generator=generator, dtype=torch.float64)
         * torch.logspace(-8, 8, shape[-1], dtype=torch.float64)).to(dtype)
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


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same float32 bits, any NaN equal to any NaN."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


def unary_inputs(name: str) -> torch.Tensor:
    """50,000 values from 1e-3 to 500 in magnitude (positive for log and rsqrt), and edge cases (not 0 for
    log and rsqrt: version 2's Numba pass raises ZeroDivisionError on it)."""
    generator = torch.Generator().manual_seed(4)
    sign = torch.where(torch.rand(50_000, generator=generator) < 0.5, -1.0, 1.0)
    x = torch.logspace(-3, 2.7, 50_000) * sign
    edges = [1.0, -1.0, 0.5, 88.7, -103.0, 1e-30, 1e-40, 3.4e38, -3.4e38, float("inf"), -float("inf"),
             float("nan")]
    if name in ("log", "rsqrt"):
        return torch.cat([x.abs(), torch.tensor([e for e in edges if e != 0])])
    return torch.cat([x, torch.tensor([0.0, -0.0, *edges])])


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
    generator = torch.Generator().manual_seed(len(name))
    for dtype in (torch.float32, torch.float64):
        y = (torch.randn(3, 17, 4, 33, generator=generator, dtype=torch.float64)
             * torch.logspace(-8, 8, 33, dtype=torch.float64)).to(dtype)
        for dim in range(4):
            want = exact_kernel.tree_sum(y, dim, 2)
            assert torch.equal(exact_kernel.tree_sum(y.cuda(), dim, 2).cpu(), want)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_on_a_gpu_the_models_kernels_are_the_cpus_bit_for_bit(monkeypatch, preset):
    calls = model_calls(monkeypatch, preset)
    for (a, b), out in calls["ordered_matmul"]:
        assert torch.equal(exact_triton.ordered_matmul(a.cuda(), b.cuda()).cpu(), out)
    for (x, dim, _), out in calls["tree_sum"]:
        assert torch.equal(exact_triton.tree_sum(x.cuda(), dim).cpu(), out)
    for (name, x), (value, slope) in calls["unary32"]:
        got = exact_triton.unary32(name, x.cuda())
        assert torch.equal(got[0].cpu(), value) and torch.equal(got[1].cpu(), slope), name
