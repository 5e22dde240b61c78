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
    """Every ``(a, b, a @ b)`` that version 2's product computes while it is installed."""

    def __init__(self, monkeypatch) -> None:
        self.calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.original = exact_kernel.ordered_matmul
        monkeypatch.setattr(exact_kernel, "ordered_matmul", self)

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = self.original(a, b)
        self.calls.append((a.detach().clone(), b.detach().clone(), out))
        return out


def model_products(monkeypatch, preset: str) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The products of one forward and backward pass of ``preset`` (batch 2, 32 tokens) under version 2,
    and for ``llama-tiny`` of Muon's Newton-Schulz on its first gradient."""
    from training.config import ModelConfig
    from training.model import GPT

    recorder = Recorder(monkeypatch)
    model = GPT(ModelConfig(preset=preset), seed=0)
    generator = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 256, (2, 32), generator=generator) for _ in range(2))
    with ExactKernels(2):
        _, loss = model(x, y)
    loss.backward()
    if preset == "llama-tiny":
        grad = next(p.grad for p in model.parameters() if p.grad is not None and p.grad.dim() == 2)
        exact_orthogonalize(grad, (3.4445, -4.7750, 2.0315), 2, kernels=2)
    return recorder.calls


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_the_models_products_forward_and_backward_are_version_2s(monkeypatch, preset):
    calls = model_products(monkeypatch, preset)
    shapes = {(tuple(a.shape), tuple(b.shape)) for a, b, _ in calls}
    assert len(calls) >= 20 and len(shapes) >= 6  # projections, attention's batched products, backward
    assert any(a.dim() == 4 for a, _, _ in calls)  # attention's QK^T and PV
    for a, b, out in calls:
        assert torch.equal(exact_triton.ordered_matmul(a, b), out), (tuple(a.shape), tuple(b.shape))


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
@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_on_a_gpu_the_models_products_are_the_cpus_bit_for_bit(monkeypatch, preset):
    for a, b, out in model_products(monkeypatch, preset):
        assert torch.equal(exact_triton.ordered_matmul(a.cuda(), b.cuda()).cpu(), out)
