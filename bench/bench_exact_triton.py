"""The reproducible mode on a GPU against the CPU, bit for bit (issue 64; training/exact_triton.py): the
operands and model calls tests/test_exact_triton.py checks, and the same checks as a script for a lent GPU
(bench/gpu_checks.sh runs it first; bench/results/exact_triton.json keeps an H200's run):

    python3 bench/bench_exact_triton.py --out $OUT/exact_triton.json

On a CUDA machine it records (1) version 2's kernels on the GPU (the Triton product, tree sums and
elementwise functions that training/exact_kernel.py sends CUDA tensors to) against the same calls on the CPU,
on random ragged operands and on every call of a forward and backward pass of ``tiny`` and ``llama-tiny``
(and of both at n_embd 48, batch 3: means over counts that are not powers of two); (2) that whole forward and
backward pass in the mode on the GPU against the CPU: the loss and each gradient, bit for bit or not (the
mode's other operations are torch's CUDA elementwise kernels); (3) two inner steps of each case in the mode
under kernel versions 2 and 3 on the GPU and on the CPU: the weights' digests, identical or not (issue 64's
"CPU and GPU reruns identical"); (4) how often torch's ``sqrt`` is not the correctly rounded root on the CPU
and on the GPU (version 2 takes torch's, version 3 the correctly rounded one), and whether two GPU runs
agree; (5) the cost: an inner step in the mode (version 3) against eager float32, and the Triton product
against torch's float32 matmul (TF32 off). The CPU side is the Numba passes where numba is installed, else
(:func:`cpu_formulas`, or ``--cpu-reference formulas``) the formulas with their bits (the product as torch
elementwise operations, ``exact_math.tree_sum``, ``exact_ops.UNARY``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training import exact_kernel  # noqa: E402 (training.exact_triton needs triton: imported where used)
from training.exact_math import tree_sum as v1_tree_sum  # noqa: E402
from training.exact_mode import ExactKernels  # noqa: E402
from training.exact_ops import UNARY  # noqa: E402
from training.exact_optim import exact_orthogonalize  # noqa: E402

#: Ragged against both tiles (TILE_INTERPRETED 64 x 128, TILE_DEVICE 32 x 64), batched, empty, K = 1.
SHAPES = [(1, 1, 1), (7, 45, 29), (2, 3, 17, 64, 33), (5, 1, 8), (0, 4, 3), (4, 0, 3), (3, 5, 0),
          (130, 20, 257), (2, 65, 70, 129)]
KINDS = ("ordered_matmul", "tree_sum", "unary32")


def operands(shape, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` (..., M, K) with columns over 12 orders of magnitude (another order or an FMA changes many
    outputs' last bits), ``b`` (..., K, N)."""
    *batch, m, k, n = shape
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(*batch, m, k, generator=generator) * torch.logspace(-6, 6, k)
    return a, torch.randn(*batch, k, n, generator=generator)


def sum_operand(shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Values over 16 orders of magnitude along the last dimension."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator, dtype=torch.float64)
            * torch.logspace(-8, 8, shape[-1], dtype=torch.float64)).to(dtype)


def unary_inputs(name: str) -> torch.Tensor:
    """50,000 values from 1e-3 to 500 in magnitude (positive for log and rsqrt), and edge cases (not 0 for
    log and rsqrt: version 2's Numba pass raises ZeroDivisionError on it)."""
    generator = torch.Generator().manual_seed(4)
    sign = torch.where(torch.rand(50_000, generator=generator) < 0.5, -1.0, 1.0)
    x = torch.logspace(-3, 2.7, 50_000) * sign
    edges = [1.0, -1.0, 0.5, 88.7, -103.0, 1e-30, 1e-40, 3.4e38, -3.4e38, float("inf"), -float("inf"),
             float("nan")]
    if name in ("log", "rsqrt"):
        return torch.cat([x.abs(), torch.tensor(edges)])
    return torch.cat([x, torch.tensor([0.0, -0.0, *edges])])


def bits_equal(a, b) -> bool:
    """The same bits (tensors or tuples of them, on any device), any NaN equal to any NaN."""
    if isinstance(a, tuple):
        return len(a) == len(b) and all(bits_equal(x, y) for x, y in zip(a, b))
    a, b = a.cpu(), b.cpu()
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan])


#: Model cases: a preset, or a preset with ``n_embd`` 48 and batch 3 (``preset@48``): counts that are not
#: powers of two (a mean's division by 48 and 96, which CUDA would make a multiply by a rounded reciprocal).
ODD = "@48"


def model_config(case: str):
    from training.config import ModelConfig

    preset, odd = case.removesuffix(ODD), case.endswith(ODD)
    return ModelConfig(preset=preset, **({"n_embd": 48} if odd else {})), 3 if odd else 2


def model_pass(case: str, device: str = "cpu", kernels: int = 2) -> tuple[torch.Tensor, dict]:
    """Loss and gradients of one forward and backward pass of ``case`` (batch 2, 32 tokens; ``preset@48``:
    batch 3) in the reproducible mode, kernel version ``kernels``, on ``device``."""
    from training.model import GPT

    config, batch = model_config(case)
    model = GPT(config, seed=0).to(device)
    generator = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 256, (batch, 32), generator=generator).to(device) for _ in range(2))
    with ExactKernels(kernels):
        _, loss = model(x, y)
    loss.backward()
    if case.startswith("llama"):  # Muon's Newton-Schulz on the first matrix's gradient
        grad = next(p.grad for p in model.parameters() if p.grad is not None and p.grad.dim() == 2)
        exact_orthogonalize(grad, (3.4445, -4.7750, 2.0315), 2, kernels=kernels)
    return loss.detach().cpu(), {name: p.grad.cpu() for name, p in model.named_parameters()}


def model_calls(case: str) -> list[tuple[str, tuple, object]]:
    """``(kind, args, result)`` of every call :func:`model_pass` makes on the CPU to version 2's compiled
    passes (training/exact_kernel.py's ``ordered_matmul``, ``tree_sum`` and ``unary32``; a tree sum that
    falls back to version 1's torch adds is left out), the tensors copied."""
    calls: list[tuple[str, tuple, object]] = []
    originals = {kind: getattr(exact_kernel, kind) for kind in KINDS}

    def recorder(kind):
        def record(*args):
            out = originals[kind](*args)
            if kind == "tree_sum":
                x, dim = args[:2]
                version = args[2] if len(args) > 2 and args[2] is not None else exact_kernel.CURRENT.get()
                if version != 2 or x.dtype not in (torch.float32, torch.float64) or x.size(dim) < 2:
                    return out
                args = (x, dim)
            calls.append((kind, tuple(a.detach().clone() if torch.is_tensor(a) else a for a in args), out))
            return out
        return record

    try:
        for kind in KINDS:
            setattr(exact_kernel, kind, recorder(kind))
        model_pass(case)
    finally:
        for kind, original in originals.items():
            setattr(exact_kernel, kind, original)
    return calls


# ----------------------------------------------------------------------------- the GPU run


def product_formula(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Version 2's product as torch elementwise operations (single IEEE operations on every CPU)."""
    out = torch.zeros(*a.shape[:-1], b.size(-1))
    for k in range(a.size(-1)):
        out = out + a[..., :, k:k + 1] * b[..., k:k + 1, :]
    return out


@contextlib.contextmanager
def cpu_formulas(active: bool):
    """Within (if ``active``: where numba is not installed): version 2's compiled passes on CPU tensors
    computed by the formulas with their bits (tests/test_reproducible_kernels.py), CUDA tensors unchanged."""
    originals = {kind: getattr(exact_kernel, kind) for kind in KINDS}

    def ordered_matmul(a, b):
        return originals["ordered_matmul"](a, b) if a.is_cuda else product_formula(a, b)

    def tree_sum(x, dim, version=None):
        version = exact_kernel.CURRENT.get() if version is None else version
        return originals["tree_sum"](x, dim, version) if x.is_cuda or version != 2 else v1_tree_sum(x, dim)

    def unary32(name, x):
        if x.is_cuda:
            return originals["unary32"](name, x)
        value, slope = UNARY[name](x.double())
        return value.float(), slope.float()

    try:
        if active:
            for kind, replacement in zip(KINDS, (ordered_matmul, tree_sum, unary32)):
                setattr(exact_kernel, kind, replacement)
        yield
    finally:
        for kind, original in originals.items():
            setattr(exact_kernel, kind, original)


def random_calls() -> list[tuple[str, tuple]]:
    calls = []
    for shape in SHAPES:
        a, b = operands(shape, sum(shape))
        calls += [("ordered_matmul", (a, b)), ("ordered_matmul", (b.transpose(-1, -2), a.transpose(-1, -2)))]
    for dtype in (torch.float32, torch.float64):
        calls += [("tree_sum", (sum_operand((3, 17, 4, 33), dtype, 5), dim)) for dim in range(4)]
    from training import exact_triton

    return calls + [("unary32", (name, unary_inputs(name))) for name in exact_triton.CODES]


def compare_on_gpu(calls) -> dict:
    result = {"calls": len(calls), "identical": 0, "mismatches": []}
    for kind, args, *_ in calls:
        got = getattr(exact_kernel, kind)(*(a.cuda() if torch.is_tensor(a) else a for a in args))
        if bits_equal(got, getattr(exact_kernel, kind)(*args)):
            result["identical"] += 1
        else:
            result["mismatches"].append([kind, [list(a.shape) if torch.is_tensor(a) else a for a in args]])
    return result


def whole_pass(case: str) -> dict:
    (cpu_loss, cpu_grads), (gpu_loss, gpu_grads) = model_pass(case, "cpu"), model_pass(case, "cuda")
    same = {name for name in cpu_grads if torch.equal(cpu_grads[name], gpu_grads[name])}
    return {"loss_identical": torch.equal(cpu_loss, gpu_loss), "loss": float(cpu_loss),
            "grads_identical": len(same), "grads": len(cpu_grads), "differing": sorted(set(cpu_grads) - same)}


def inner_steps(case: str, optimizer: str, device: str, kernels: int) -> str:
    """The weights' digest after two inner steps of ``case`` from its initial weights, the trainer in the
    reproducible mode (kernel version ``kernels``) on ``device`` (training/exact_probe.py's ``fresh_steps``,
    there)."""
    from training.config import TrainingConfig
    from training.exact_probe import digest
    from training.pipeline import LocalReplicaTrainer

    model_cfg, batch = model_config(case)
    trainer = LocalReplicaTrainer(model_cfg, TrainingConfig(batch_size=batch, optimizer=optimizer,
                                                            device=device, reproducible=True,
                                                            reproducible_kernels=kernels))
    generator = torch.Generator().manual_seed(7)
    for _ in range(2):
        x, y = (torch.randint(0, model_cfg.vocab_size, (batch, model_cfg.block_size), generator=generator)
                for _ in range(2))
        trainer.train_step(x, y)
    return digest(tensor.cpu() for tensor in trainer.state_dict().values())


def steps_on_both(case: str, optimizer: str, kernels: int) -> dict:
    cpu, cuda = inner_steps(case, optimizer, "cpu", kernels), inner_steps(case, optimizer, "cuda", kernels)
    return {"cpu": cpu, "cuda": cuda, "identical": cpu == cuda}


def sqrt_rounding() -> dict:
    """How often torch's float32/float64 ``sqrt`` on the CPU and on the GPU differs from numpy's (correctly
    rounded) root, on 1M random positive values over 40 orders of magnitude."""
    import numpy as np

    generator = torch.Generator().manual_seed(11)
    report = {}
    for dtype in (torch.float32, torch.float64):
        x = (torch.rand(1_000_000, generator=generator, dtype=torch.float64) * 40 - 20).exp().to(dtype)
        want = torch.from_numpy(np.sqrt(x.numpy()))
        report[str(dtype)] = {"cpu_differs": int((torch.sqrt(x) != want).sum()),
                              "cuda_differs": int((torch.sqrt(x.cuda()).cpu() != want).sum()),
                              "of": x.numel()}
    return report


def step_time(preset: str, optimizer: str, batch: int, steps: int = 3) -> dict:
    """Seconds per inner step on the GPU (the median of ``steps`` after one warm-up), eager float32 (TF32 off)
    against the reproducible mode, kernel version 3."""
    from training.config import ModelConfig, TrainingConfig
    from training.pipeline import LocalReplicaTrainer

    torch.backends.cuda.matmul.allow_tf32 = False
    model_cfg = ModelConfig(preset=preset)
    generator = torch.Generator().manual_seed(3)
    shape = (batch, model_cfg.block_size)
    batches = [tuple(torch.randint(0, model_cfg.vocab_size, shape, generator=generator) for _ in range(2))
               for _ in range(steps + 1)]
    out = {"preset": preset, "optimizer": optimizer, "batch": batch, "tokens_per_step": batch * shape[1]}
    for name, exact in (("eager_fp32_s", False), ("exact_v3_s", True)):
        trainer = LocalReplicaTrainer(model_cfg, TrainingConfig(
            batch_size=batch, optimizer=optimizer, device="cuda", reproducible=exact,
            **({"reproducible_kernels": 3} if exact else {})))
        times = []
        for x, y in batches:
            torch.cuda.synchronize()
            start = time.perf_counter()
            trainer.train_step(x, y)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        out[name] = sorted(times[1:])[len(times[1:]) // 2]
    out["slowdown"] = out["exact_v3_s"] / out["eager_fp32_s"]
    return out


def timing(shapes) -> list[dict]:
    from training import exact_triton

    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    for *batch, m, k, n in shapes:
        a, b = torch.randn(*batch, m, k, device="cuda"), torch.randn(*batch, k, n, device="cuda")
        entry = {"shape": [*batch, m, k, n]}
        for name, fn in (("triton_ordered", exact_triton.ordered_matmul), ("torch_fp32", torch.matmul)):
            fn(a, b)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(5):
                fn(a, b)
            torch.cuda.synchronize()
            entry[f"{name}_ms"] = (time.perf_counter() - start) / 5 * 1e3
        entry["slowdown"] = entry["triton_ordered_ms"] / entry["torch_fp32_ms"]
        rows.append(entry)
    return rows


def section(report: dict, name: str, fn) -> None:
    """``report[name] = fn()``, or the error it raised (the other sections still run)."""
    try:
        report[name] = fn()
    except Exception:  # noqa: BLE001 (a failed section is recorded, the rest still runs)
        report[name] = {"error": traceback.format_exc()[-3000:]}
    print(name, json.dumps(report[name])[:400], flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench/results/exact_triton.json")
    parser.add_argument("--cpu-reference", choices=("auto", "formulas"), default="auto",
                        help="the CPU side: version 2's Numba passes where numba imports (auto), or the "
                             "formulas with their bits (a second opinion independent of the machine's numba)")
    parser.add_argument("--anomaly", action="store_true",
                        help="autograd's anomaly mode (a failing backward names its forward line)")
    args = parser.parse_args()
    torch.autograd.set_detect_anomaly(args.anomaly)
    if not torch.cuda.is_available():
        sys.exit("bench_exact_triton: no CUDA GPU (torch.cuda.is_available() is false)")
    import triton

    try:
        import numba  # noqa: F401
        numba_here = args.cpu_reference == "auto"
    except ImportError:
        numba_here = False
    report = {"environment": {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "cuda": torch.version.cuda, "triton": triton.__version__,
                              "python": platform.python_version(),
                              "numba": getattr(sys.modules.get("numba"), "__version__", None),
                              "cpu_reference": "numba" if numba_here else "formulas"}}
    with cpu_formulas(not numba_here):
        section(report, "random_kernels", lambda: compare_on_gpu(random_calls()))
        for case in ("tiny", "llama-tiny", "tiny@48", "llama-tiny@48"):
            section(report, f"{case}_kernels", lambda c=case: compare_on_gpu(model_calls(c)))
            section(report, f"{case}_forward_backward", lambda c=case: whole_pass(c))
        # Version 2's square roots are torch's (not correctly rounded on the CPU), version 3's are.
        for kernels in (2, 3):
            for case, optimizer in (("tiny", "adamw"), ("llama-tiny", "muon"), ("tiny@48", "adamw"),
                                    ("llama-tiny@48", "muon")):
                section(report, f"{case}_{optimizer}_two_inner_steps_v{kernels}",
                        lambda c=case, o=optimizer, k=kernels: steps_on_both(c, o, k))
    section(report, "sqrt_rounding", sqrt_rounding)
    section(report, "gpu_rerun_v3", lambda: {
        case: inner_steps(case, opt, "cuda", 3) == inner_steps(case, opt, "cuda", 3)
        for case, opt in (("tiny", "adamw"), ("llama-tiny@48", "muon"))})
    for preset, optimizer in (("mini", "adamw"), ("llama-20m", "adamw"), ("llama-20m", "muon")):
        section(report, f"step_time_{preset}_{optimizer}", lambda p=preset, o=optimizer: step_time(p, o, 8))
    section(report, "timing", lambda: timing([(4096, 768, 768), (4096, 768, 3072), (96, 1024, 64, 1024)]))
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
