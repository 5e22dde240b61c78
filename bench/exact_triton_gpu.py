"""Kernel version 2 on a GPU against the CPU, bit for bit (issue 64; training/exact_triton.py).

On a CUDA machine: (1) version 2's kernels on the GPU (the Triton product, tree sums and elementwise
functions that training/exact_kernel.py sends CUDA tensors to) against the same calls on the CPU, on random
ragged operands and on every call of a forward and backward pass of ``tiny`` and ``llama-tiny``; (2) the whole
forward and backward pass of those models in the reproducible mode (version 2) on the GPU against the CPU:
the loss and every gradient, bit for bit or not (the mode's other operations are torch's CUDA elementwise
kernels); (3) the Triton product's time against torch's float32 matmul (TF32 off) on a few shapes.

The CPU side is version 2's Numba loops where numba is installed, else the formulas tests/ prove to give
their bits (the product as torch elementwise operations, ``exact_math.tree_sum``, ``exact_ops.UNARY``).
Usage (bench/gpu_checks.sh runs it): ``python3 bench/exact_triton_gpu.py --out $OUT/exact_triton.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training import exact_kernel, exact_triton  # noqa: E402
from training.exact_math import tree_sum as v1_tree_sum  # noqa: E402
from training.exact_mode import ExactKernels  # noqa: E402
from training.exact_ops import UNARY  # noqa: E402


def numba_available() -> bool:
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


def cpu_call(kind: str, args: tuple, numba: bool):
    """Version 2's ``kind`` on the CPU (Numba), or the formulas with its bits."""
    if numba:
        return getattr(exact_kernel, kind)(*args)
    if kind == "ordered_matmul":
        a, b = args
        out = torch.zeros(*a.shape[:-1], b.size(-1))
        for k in range(a.size(-1)):
            out = out + a[..., :, k:k + 1] * b[..., k:k + 1, :]
        return out
    if kind == "tree_sum":
        return v1_tree_sum(args[0], args[1])
    value, slope = UNARY[args[0]](args[1].double())
    return value.float(), slope.float()


def same_bits(a, b) -> bool:
    if isinstance(a, tuple):
        return all(same_bits(x, y) for x, y in zip(a, b))
    a, b = a.cpu(), b.cpu()
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan])


def random_calls() -> list[tuple[str, tuple]]:
    generator = torch.Generator().manual_seed(0)
    calls = []
    shapes = [(7, 45, 29), (2, 3, 17, 64, 33), (130, 20, 257), (2, 65, 70, 129), (256, 512, 96)]
    for *batch, m, k, n in shapes:
        a = torch.randn(*batch, m, k, generator=generator) * torch.logspace(-6, 6, k)
        calls.append(("ordered_matmul", (a, torch.randn(*batch, k, n, generator=generator))))
        calls.append(("ordered_matmul", (a.transpose(-1, -2).contiguous().transpose(-1, -2),
                                         torch.randn(*batch, k, n, generator=generator))))
    for dtype in (torch.float32, torch.float64):
        x = (torch.randn(3, 17, 4, 33, generator=generator, dtype=torch.float64)
             * torch.logspace(-8, 8, 33, dtype=torch.float64)).to(dtype)
        calls += [("tree_sum", (x, dim)) for dim in range(4)]
    sign = torch.where(torch.rand(100_000, generator=generator) < 0.5, -1.0, 1.0)
    x = torch.logspace(-3, 2.7, 100_000) * sign
    calls += [("unary32", (name, x.abs() if name in ("log", "rsqrt") else x)) for name in exact_triton.CODES]
    return calls


def model_calls(preset: str) -> list[tuple[str, tuple]]:
    """Every version 2 kernel call of one forward and backward pass of ``preset`` on the CPU."""
    calls = []
    originals = {kind: getattr(exact_kernel, kind) for kind in ("ordered_matmul", "tree_sum", "unary32")}

    def recorder(kind):
        def record(*args):
            if kind == "tree_sum" and (len(args) < 3 or args[2] is None):
                args = (*args[:2], exact_kernel.CURRENT.get())
            if kind != "tree_sum" or (args[2] == 2 and args[0].size(args[1]) >= 2):
                calls.append((kind, tuple(a.detach().clone() if torch.is_tensor(a) else a for a in args[:2])))
            return originals[kind](*args)
        return record

    try:
        for kind in originals:
            setattr(exact_kernel, kind, recorder(kind))
        model_pass(preset, "cpu")
    finally:
        for kind, original in originals.items():
            setattr(exact_kernel, kind, original)
    return calls


def model_pass(preset: str, device: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from training.config import ModelConfig
    from training.model import GPT

    model = GPT(ModelConfig(preset=preset), seed=0).to(device)
    generator = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 256, (2, 32), generator=generator).to(device) for _ in range(2))
    with ExactKernels(2):
        _, loss = model(x, y)
    loss.backward()
    return loss.detach().cpu(), {name: p.grad.cpu() for name, p in model.named_parameters()}


def compare_kernels(calls: list[tuple[str, tuple]], numba: bool) -> dict:
    result = {"calls": len(calls), "identical": 0, "mismatches": []}
    for kind, args in calls:
        want = cpu_call(kind, args, numba)
        got = getattr(exact_kernel, kind)(*(a.cuda() if torch.is_tensor(a) else a for a in args))
        if same_bits(got, want):
            result["identical"] += 1
        else:
            result["mismatches"].append([kind, [list(a.shape) if torch.is_tensor(a) else a for a in args]])
    return result


def timing(shapes) -> list[dict]:
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
        report[name] = {"error": traceback.format_exc(limit=4)}
    print(name, json.dumps(report[name])[:400], flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("exact_triton_gpu: no CUDA GPU (torch.cuda.is_available() is false)")
    import triton

    numba = numba_available()
    report = {"environment": {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "cuda": torch.version.cuda, "triton": triton.__version__,
                              "python": platform.python_version(), "cpu_reference": "numba" if numba else
                              "formulas (numba not installed)"}}
    section(report, "random_kernels", lambda: compare_kernels(random_calls(), numba))
    for preset in ("tiny", "llama-tiny"):
        section(report, f"{preset}_kernels", lambda p=preset: compare_kernels(model_calls(p), numba))

        def whole(p=preset):
            (cpu_loss, cpu_grads), (gpu_loss, gpu_grads) = model_pass(p, "cpu"), model_pass(p, "cuda")
            same = sorted(name for name in cpu_grads if torch.equal(cpu_grads[name], gpu_grads[name]))
            return {"loss_identical": torch.equal(cpu_loss, gpu_loss), "loss": float(cpu_loss),
                    "grads_identical": len(same), "grads": len(cpu_grads),
                    "differing": sorted(set(cpu_grads) - set(same))}
        section(report, f"{preset}_forward_backward", whole)
    section(report, "timing", lambda: timing([(4096, 768, 768), (4096, 768, 3072), (96, 1024, 64, 1024)]))
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
