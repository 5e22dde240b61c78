"""``training.reproducible_kernels``: the reproducible mode's kernel versions (training/exact_kernel.py).

Version 2's compiled loops (Numba): the float32 product sums each output over ``k`` in increasing order,
one float32 multiply and one add at a time (compared bit for bit with that sum written as torch elementwise
operations, which are single IEEE operations on every CPU), without fused multiply-adds although the host
has them; the elementwise functions are version 1's float64 formulas operation for operation (the same
bits). The setting: version 1 for a run document without it (its document and hash unchanged), version 2
recorded. Across ATen capabilities, Numba targets, threads and ``MKL_CBWR``: tests/test_reproducible.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from training import exact_kernel
from training.exact_kernel import KernelVersionError, ordered_matmul, unary32
from training.exact_math import tree_sum
from training.exact_mode import ExactKernelError, ExactKernels
from training.exact_ops import UNARY
from training.exact_optim import exact_orthogonalize


def loop_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``sum_k a[..., :, k] b[..., k, :]``, ``k`` increasing from 0, as torch elementwise operations."""
    out = torch.zeros(*a.shape[:-1], b.size(-1))
    for k in range(a.size(-1)):
        out = out + a[..., :, k:k + 1] * b[..., k:k + 1, :]
    return out


@pytest.mark.parametrize("shape", [(1, 1, 1), (7, 45, 29), (2, 3, 17, 64, 33), (5, 1, 8), (0, 4, 3),
                                   (4, 0, 3)])
def test_ordered_matmul_sums_each_output_in_increasing_order(shape):
    *batch, m, k, n = shape
    generator = torch.Generator().manual_seed(sum(shape))
    # Entries over 12 orders of magnitude: a different order or an FMA changes many outputs' last bits.
    a = torch.randn(*batch, m, k, generator=generator) * torch.logspace(-6, 6, k)
    b = torch.randn(*batch, k, n, generator=generator)
    out = ordered_matmul(a, b)
    assert out.dtype == torch.float32 and out.shape == (*batch, m, n)
    assert torch.equal(out, loop_reference(a, b))
    # Transposed (non-contiguous) operands, as the backward passes give them.
    assert torch.equal(ordered_matmul(b.transpose(-1, -2), a.transpose(-1, -2)),
                       loop_reference(b.transpose(-1, -2), a.transpose(-1, -2)))


@pytest.mark.parametrize("batch", [(), (3,), (5,)])
def test_ordered_matmul_splits_work_over_threads_without_changing_a_bit(batch):
    """One matrix split in rows, fewer matrices than threads split in rows each, more split by matrix."""
    generator = torch.Generator().manual_seed(len(batch))
    a = torch.randn(*batch, 260, 128, generator=generator)
    b = torch.randn(*batch, 128, 130, generator=generator)
    threads = torch.get_num_threads()
    try:
        outs = []
        for count in (1, 2, 4):
            torch.set_num_threads(count)
            outs.append(ordered_matmul(a, b))
    finally:
        torch.set_num_threads(threads)
    assert math.prod(batch) * 260 * 128 * 130 >= exact_kernel.SPLIT_WORK  # big enough to be split
    assert all(torch.equal(out, outs[0]) for out in outs[1:])
    assert torch.equal(outs[0][(0,) * len(batch)][:3], loop_reference(a[(0,) * len(batch)][:3],
                                                                       b[(0,) * len(batch)]))


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (1, 8, 5, 16), (2, 9, 45, 33), (3, 17, 64, 70),
                                   (1, 130, 7, 1), (2, 4, 0, 5)])
def test_the_register_tiles_compute_the_plain_loops_bits(shape):
    """Version 2's product blocked in registers (training/exact_kernel_tile.py: whole tiles, partial tiles,
    strided operands) gives the plain loop's bits (the loop tests/above compare with the written-out sum)."""
    import numpy as np

    from training import exact_kernel_numba, exact_kernel_tile

    count, m, k, n = shape
    generator = np.random.default_rng(sum(shape))
    a = (generator.standard_normal((count, m, k)) * np.logspace(-6, 6, k)).astype(np.float32)
    b = generator.standard_normal((count, n, k)).astype(np.float32).transpose(0, 2, 1)  # strided
    want, got = np.empty((count, m, n), np.float32), np.full((count, m, n), np.nan, np.float32)
    exact_kernel_numba.ordered(a, np.ascontiguousarray(b), want)
    exact_kernel_tile.ordered(a, b, got)
    assert want.tobytes() == got.tobytes()


def test_ordered_matmul_is_as_accurate_as_a_sequential_float32_sum():
    generator = torch.Generator().manual_seed(5)
    a, b = torch.randn(64, 512, generator=generator), torch.randn(512, 96, generator=generator)
    exact = a.double() @ b.double()
    bound = 512 * 2.0 ** -24 * (a.double().abs() @ b.double().abs())
    assert bool(((ordered_matmul(a, b).double() - exact).abs() <= bound).all())
    with pytest.raises(TypeError, match="float32"):
        ordered_matmul(a.double(), b.double())
    with pytest.raises(ValueError, match="do not chain"):
        ordered_matmul(a, b.T)


def test_the_compiled_loops_contract_no_multiply_and_add():
    """Where the CPU has FMA (this one: AVX2 and AVX-512) the compiled loops, vectorised, use none."""
    import numba
    import numpy as np

    from training import exact_kernel_numba

    from training import exact_kernel_tile

    ones = np.ones((1, 3, 3), dtype=np.float32)
    row = ones[0, 0]
    for kernel, args in ((exact_kernel_numba.ordered, (ones, ones, ones)),
                         (exact_kernel_tile.ordered, (ones, ones, ones.copy())),
                         (exact_kernel_tile.newton_schulz, (ones.copy(), 3.4, -4.7, 2.0, 2)),
                         (exact_kernel_numba.unary, (5, row, ones[0, 1], ones[0, 2])),
                         (exact_kernel_numba.adamw_moments,
                          (row.copy(), row, row.copy(), row.copy(), 0.9, 0.9, 0.1, 0.95, 0.05)),
                         (exact_kernel_numba.adamw_apply, (row.copy(), row, row, 0.3, 1e-8, 0.01))):
        options = {key: value for key, value in kernel.targetoptions.items()
                   if key not in ("cache", "nopython")}
        fresh = numba.njit(**options)(kernel.py_func)  # the cached build cannot be inspected
        fresh(*args)
        assembly = "".join(fresh.inspect_asm().values())
        assert "mulp" in assembly or "mulss" in assembly or "mulsd" in assembly
        assert "vfmadd" not in assembly and "vfmsub" not in assembly and "vfnmadd" not in assembly


@pytest.mark.parametrize("name", sorted(UNARY))
def test_the_compiled_functions_are_version_1s_formulas_bit_for_bit(name):
    generator = torch.Generator().manual_seed(len(name))
    x = torch.cat([torch.randn(20000, generator=generator) * scale for scale in (1e-3, 1, 8, 60, 500)]
                  + [torch.tensor([0.0, -0.0, 1e-38, -1e-38, 1e-45, 88.7, -87.3, -103.9, 3e38, -3e38])])
    if name in ("log", "rsqrt"):
        x = x.abs() + 1e-30
    value, slope = UNARY[name](x.to(torch.float64))
    compiled_value, compiled_slope = unary32(name, x)
    for got, want in ((compiled_value, value.to(torch.float32)), (compiled_slope, slope.to(torch.float32))):
        assert torch.equal(got.isnan(), want.isnan()), name
        assert torch.equal(got[~got.isnan()], want[~want.isnan()]), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_compiled_tree_sum_adds_version_1s_pairs(dtype):
    generator = torch.Generator().manual_seed(4)
    for shape in [(7,), (1,), (2, 3), (5, 33, 17), (4, 1, 9), (3, 1000), (2, 3, 4, 5), (0, 3)]:
        # 16 orders of magnitude: another pairing changes the sums' bits.
        x = (torch.randn(shape, generator=generator) * torch.logspace(-8, 8, shape[-1])).to(dtype)
        for dim in range(-len(shape), len(shape)):
            want = tree_sum(x, dim)
            got = exact_kernel.tree_sum(x, dim, 2)
            assert got.shape == want.shape and got.dtype == dtype and torch.equal(got, want), (shape, dim)


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_version_2_computes_the_same_model(preset):
    """Loss and gradients as torch's to float32 rounding; and not version 1's bits (the version is used)."""
    from training.config import ModelConfig
    from training.model import GPT

    model = GPT(ModelConfig(preset=preset), seed=0)
    generator = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 256, (2, 32), generator=generator) for _ in range(2))
    _, reference = model(x, y)
    reference.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    grads = {}
    for version in (1, 2):
        model.zero_grad()
        with ExactKernels(version):
            _, loss = model(x, y)
        loss.backward()  # outside the mode: each product's backward keeps its forward's version
        assert abs(loss.item() - reference.item()) < 1e-5
        for name, param in model.named_parameters():
            scale = float(expected[name].abs().max()) + 1e-12
            assert float((param.grad - expected[name]).abs().max()) / scale < 1e-4, (version, name)
        grads[version] = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert not torch.equal(grads[1], grads[2])
    assert exact_kernel.CURRENT.get() == exact_kernel.LEGACY  # the mode's exit restores it


def test_muons_newton_schulz_uses_the_runs_version():
    generator = torch.Generator().manual_seed(2)
    update = torch.randn(24, 40, generator=generator)
    coefficients = (3.4445, -4.7750, 2.0315)
    expected = exact_orthogonalize(update, coefficients, 3, kernels=2)
    with exact_kernel.using(2):
        assert torch.equal(exact_orthogonalize(update, coefficients, 3, kernels=2), expected)
    assert not torch.equal(exact_orthogonalize(update, coefficients, 3, kernels=1), expected)
    # An orthogonalization: singular values near 1, as version 1's.
    singular = torch.linalg.svdvals(expected.double())
    assert float(singular.max()) < 1.3 and float(singular.min()) > 0.5


def test_the_setting_is_a_run_setting_recorded_when_not_1():
    from node.config import load_config
    from node.runconfig import run_document
    from training.config import TrainingConfig
    from training.config_training import DEFAULT_KERNELS, LEGACY_KERNELS

    assert (DEFAULT_KERNELS, LEGACY_KERNELS) == (exact_kernel.LATEST, exact_kernel.LEGACY) == (3, 1)
    on = ["model.preset=tiny", "training.reproducible=true"]
    legacy = run_document(load_config(None, [*on, "training.reproducible_kernels=1"]))["training"]
    assert legacy["reproducible"] is True and "reproducible_kernels" not in legacy
    # A new reproducible run that names no version gets version 3, written into its document; a run that
    # names 2 records 2.
    assert load_config(None, on).training.reproducible_kernels == 3
    assert run_document(load_config(None, on))["training"] == {**legacy, "reproducible_kernels": 3}
    recorded = run_document(load_config(None, [*on, "training.reproducible_kernels=2"]))["training"]
    assert recorded == {**legacy, "reproducible_kernels": 2}
    # Without the mode: version 1, and neither setting in the document.
    assert TrainingConfig().reproducible_kernels == 1
    assert "reproducible_kernels" not in TrainingConfig().document()
    assert TrainingConfig(reproducible=True).reproducible_kernels == 3
    for bad in (-1, 4, True, 2.0, "2"):
        with pytest.raises(ValueError, match="reproducible_kernels"):
            TrainingConfig(reproducible=True, reproducible_kernels=bad)
    with pytest.raises(ValueError, match="setting of training.reproducible"):
        TrainingConfig(reproducible_kernels=2)
    with pytest.raises(KernelVersionError):
        ExactKernels(4)


def _two_steps(cfg) -> str:
    """The weights' digest after ``training.exact_probe.fresh_steps``'s two inner steps, the trainer built
    from ``cfg`` (a NodeConfig) as a node builds it."""
    from training.exact_probe import digest
    from training.pipeline import LocalReplicaTrainer

    trainer = LocalReplicaTrainer(cfg.model, cfg.training)
    generator = torch.Generator().manual_seed(7)
    for _ in range(2):
        x, y = (torch.randint(0, cfg.model.vocab_size, (cfg.training.batch_size, cfg.model.block_size),
                              generator=generator) for _ in range(2))
        trainer.train_step(x, y)
    return digest(trainer.state_dict().values())


def test_an_old_document_without_the_version_still_hashes_and_trains_as_version_1():
    """A run document made before versions existed says ``reproducible = true`` and no version: it is read
    as version 1 (its config hash unchanged, its inner steps version 1's bits), although a new configuration
    that names no version gets version 3, and one that names 2 keeps version 2."""
    from node.config import load_config
    from node.runconfig import config_hash, node_config_from_run, run_document
    from training.exact_probe import fresh_steps

    on = ["model.preset=tiny", "training.reproducible=true", "training.batch_size=2"]
    old = run_document(load_config(None, [*on, "training.reproducible_kernels=1"]))
    assert "reproducible_kernels" not in old["training"]
    read = node_config_from_run(old)
    assert read.training.reproducible and read.training.reproducible_kernels == 1
    assert config_hash(run_document(read)) == config_hash(old)
    new = run_document(load_config(None, on))
    assert new["training"]["reproducible_kernels"] == 3 and config_hash(new) != config_hash(old)
    assert node_config_from_run(new).training.reproducible_kernels == 3
    assert config_hash(run_document(node_config_from_run(new))) == config_hash(new)
    # A run without the mode: its document and its hash are what they were, read back as version 1.
    plain = run_document(load_config(None, ["model.preset=tiny"]))
    assert "reproducible_kernels" not in plain["training"] and "reproducible" not in plain["training"]
    assert node_config_from_run(plain).training.reproducible_kernels == 1
    # Trains as version 1: the bits of fresh_steps' version 1, not version 2's or 3's.
    version1, version3 = fresh_steps("tiny", "adamw", kernels=1), fresh_steps("tiny", "adamw", kernels=3)
    assert version1 != version3
    assert _two_steps(read) == version1
    assert _two_steps(node_config_from_run(new)) == version3
    # A document of version 2 (made before version 3) keeps its hash and trains with version 2's bits.
    named2 = run_document(load_config(None, [*on, "training.reproducible_kernels=2"]))
    read2 = node_config_from_run(named2)
    assert read2.training.reproducible_kernels == 2
    assert config_hash(run_document(read2)) == config_hash(named2)
    assert _two_steps(read2) == fresh_steps("tiny", "adamw", kernels=2)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("block", ["linear", "addmm", "layer_norm", "attention", "cross_entropy"])
def test_each_fused_block_computes_its_composites_bits(block, version):
    """training/exact_fused.py's one-node blocks against training/exact_ops.py's composites, forward and
    every gradient, inside a residual (the input also reaches the loss directly, so its gradient sums
    several contributions, whose order the fused node must keep)."""
    from training import exact_fused
    from training import exact_ops as ops

    generator = torch.Generator().manual_seed(len(block) + version)

    def make(*shape, spread=4):
        scale = torch.logspace(-spread, spread, shape[-1]) if shape[-1] > 1 else torch.ones(1)
        return (torch.randn(*shape, generator=generator) * scale).requires_grad_()

    if block == "linear":
        inputs = [make(2, 5, 24), make(16, 24), make(16)]
        calls = (lambda x, w, b: ops.linear(x, w, b), lambda x, w, b: exact_fused.linear(x, w, b))
    elif block == "addmm":
        inputs = [make(16), make(10, 24), make(24, 16)]
        calls = (ops.addmm, exact_fused.addmm)
    elif block == "layer_norm":
        inputs = [make(2, 5, 24, spread=2), make(24), make(24)]
        calls = (lambda x, w, b: ops.layer_norm(x, (24,), w, b),
                 lambda x, w, b: exact_fused.layer_norm(x, (24,), w, b))
    elif block == "attention":
        inputs = [make(2, 3, 9, 8, spread=1), make(2, 3, 9, 8, spread=1), make(2, 3, 9, 8)]
        calls = (lambda q, k, v: ops.attention(q, k, v, is_causal=True),
                 lambda q, k, v: exact_fused.attention(q, k, v, is_causal=True))
    else:
        targets = torch.randint(0, 12, (20,), generator=generator)
        inputs = [make(20, 12, spread=1)]
        calls = (lambda z: ops.cross_entropy(z, targets), lambda z: exact_fused.cross_entropy(z, targets))
    weights = torch.randn(64, generator=generator)
    results = []
    for call in calls:
        for tensor in inputs:
            tensor.grad = None
        with exact_kernel.using(version):
            out = call(*inputs)
            # The first input reaches the loss twice more: its gradient adds three contributions.
            loss = (out.reshape(-1)[:64] * weights[:out.numel()]).sum() + inputs[0].sum() * 0.5
        loss.backward()
        results.append([out.detach().clone(), *(t.grad.clone() for t in inputs)])
    for composite, fused in zip(*results):
        assert composite.shape == fused.shape and torch.equal(composite, fused), block


# ----------------------------------------------------------------------------- version 3's square root


def test_version_3s_square_root_is_correctly_rounded_and_version_2s_is_torchs():
    """Version 3's root against an independent reference (the float64 root rounded to float32: a double
    rounding that is innocuous for the square root, 53 >= 2 x 24 + 2 bits), on 1M values over 40 orders of
    magnitude, subnormals, 0, -0, inf, NaN and negatives; version 2's is torch's (whatever its rounding)."""
    import numpy as np

    generator = torch.Generator().manual_seed(5)
    x = (torch.rand(1_000_000, generator=generator, dtype=torch.float64) * 92 - 46).exp().float()
    x = torch.cat([x, torch.tensor([0.0, -0.0, 1e-45, 1e-40, float("inf"), float("nan"), -1.0, 3.4e38])])
    with np.errstate(invalid="ignore"):  # a negative's root: NaN
        want = torch.from_numpy(np.sqrt(x.double().numpy()).astype(np.float32))
    got = exact_kernel.sqrt(x, 3)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[~got.isnan()], want[~want.isnan()])
    assert torch.equal(exact_kernel.sqrt(x, 2).nan_to_num(-7.0), torch.sqrt(x).nan_to_num(-7.0))
    scalar = torch.tensor(2.0)
    root = exact_kernel.sqrt(scalar, 3)
    assert root.shape == () and float(root) == float(np.sqrt(np.float32(2.0)))
    wide = x.double()[:1000]
    assert torch.equal(exact_kernel.sqrt(wide, 3), torch.from_numpy(np.sqrt(wide.numpy())))
    with pytest.raises(TypeError, match="float32 or float64"):
        exact_kernel.sqrt(torch.ones(3, dtype=torch.float16), 3)


def test_the_modes_sqrt_is_the_versions_and_refuses_a_gradient_under_version_3():
    x = torch.rand(257) * 100
    graded = x.clone().requires_grad_()
    with ExactKernels(3):
        rounded = torch.sqrt(x)
        with pytest.raises(ExactKernelError, match="sqrt of a tensor that needs a gradient"):
            torch.sqrt(graded)
    with ExactKernels(2):
        torchs = torch.sqrt(x)
        with_grad = torch.sqrt(graded)  # version 2: torch's, with its derivative
    assert torch.equal(rounded, exact_kernel.sqrt(x, 3)) and torch.equal(torchs, torch.sqrt(x))
    assert with_grad.requires_grad


def test_a_number_divides_a_gpu_tensor_as_a_tensor_and_a_cpu_tensor_as_itself():
    """CUDA's division by a number multiplies by its rounded reciprocal (a third of float32 quotients by 3
    differ from the division's): off the CPU the number goes as a 0-dim tensor of the dividend's dtype and
    device ('meta' here, which has no values); on the CPU torch divides by it correctly rounded (the same
    quotients as NumPy's float32 division)."""
    import numpy as np

    x = torch.randn(100_000, generator=torch.Generator().manual_seed(2))
    assert exact_kernel.as_divisor(x, 3) == 3
    assert torch.equal(x / exact_kernel.as_divisor(x, 3), torch.from_numpy(x.numpy() / np.float32(3)))
    assert not torch.equal(x / 3, x * (1 / 3))  # what a reciprocal would change
    meta = torch.empty(4, 5, dtype=torch.float64, device="meta")
    divisor = exact_kernel.as_divisor(meta, 48)
    assert isinstance(divisor, torch.Tensor) and divisor.shape == () and divisor.dtype == torch.float64
    assert divisor.device.type == "meta"
