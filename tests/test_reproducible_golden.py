"""Kernel versions' bits are fixed: runs made with ``training.reproducible_kernels`` 1, 2 and 3 exist, so any
change to the kernels (training/exact_kernel*.py, training/exact_ops.py, the fused blocks of
training/exact_fused.py, the optimizers' compiled steps) must leave every output and every gradient as it
was. Per case: the logits and loss of one forward pass of a fresh model under ``ExactKernels(version)``,
every parameter's gradient after its backward pass, and a few inner steps of a fresh trainer (each step's
loss, its clipped gradients and the weights after it).

The forward and backward digests, and version 3's steps, depend on the shapes only: the same on every
instruction set and thread count (this test runs them on 1 and 2 threads, in this process). Versions 1 and
2 take torch's CPU square root in their optimizer steps, and its bits depend on the CPU's math-library path:
on a 2-core Intel Xeon with AVX-512 (torch 2.13.0, MKL 2024.2) torch's float32 ``sqrt`` goes through MKL's
vector math (``vsSqrt``), whose path MKL picks for the CPU (``MKL_CBWR`` pins it; ``ATEN_CPU_CAPABILITY``
changes nothing): its AVX-512 path, the default there, rounds 0.87% of the probe's float32 roots otherwise
than the correctly rounded root, its SSE/``COMPATIBLE`` path 23%, its AVX2 path none. The CPU the step
digests of b00ff5e were recorded on rounded 16.9 to 19% otherwise whatever ``MKL_CBWR`` said
(docs/REPRODUCIBLE.md). So versions 1 and 2's steps have one digest per square-root path: the path is named
by :func:`sqrt_path` (a digest of torch's roots of fixed values), the steps are checked in this process (the
CPU's own path) and in children under ``MKL_CBWR=COMPATIBLE`` and ``AVX2`` against the digests recorded for
that path, and a path not recorded is held to b00ff5e's digests (the path of the CPU they came from, which
named no signature). Every path recorded here came from a 2-core Intel Xeon with AVX-512 (``Intel(R) Xeon(R)
Processor``, avx512f/bw/cd/dq/vl/ifma/vbmi). The correctly rounded path gives version 3's digests (checked).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from training.config import ModelConfig
from training.exact_mode import ExactKernels
from training.exact_probe import trainer_for
from training.model import GPT

ROOT = Path(__file__).resolve().parents[1]

#: (preset, optimizer, batch, steps) -> (forward, backward) sha256 (16 hex) under version 2, recorded on
#: b00ff5e (the same on every CPU path).
GOLDEN = {
    ("tiny", "adamw", 2, 3): ("203dd52d46bb6d3e", "23b18f2c66d7a4f0"),
    ("mini", "adamw", 2, 3): ("d2a42bd9693cc27c", "458482937bcc9ed2"),
    ("llama-tiny", "muon", 2, 3): ("2753bb8a6e704c13", "72ed719c273a610e"),
}
#: Version 1's, recorded on b00ff5e too (version 2's speed work shares the gradient norm with it).
GOLDEN_V1 = {
    ("tiny", "adamw", 2, 2): ("70ebaa7bbfec315f", "976deb577d5e08b2"),
    ("llama-tiny", "muon", 2, 2): ("129e533a68d60891", "0f752b2bf9f3e59a"),
}
#: The square-root paths seen (:func:`sqrt_path`).
AVX512_PATH, COMPATIBLE_PATH, CORRECT_PATH = "6ace1792ad9c7ff7", "bf8f77c8f7dd5bad", "f317004d9dd9d070"
FIRST = "b00ff5e"
SQRT_PATHS = {
    AVX512_PATH: "MKL's AVX-512 path (the unpinned path of a 2-core Intel Xeon with AVX-512)",
    COMPATIBLE_PATH: "MKL's COMPATIBLE/SSE path (MKL_CBWR=COMPATIBLE on that Intel Xeon)",
    CORRECT_PATH: "correctly rounded (MKL's AVX2 path, MKL_CBWR=AVX2 on that Intel Xeon)",
}


def _paths(avx512: str, compatible: str, correct: str, first: str) -> dict[str, str]:
    return {AVX512_PATH: avx512, COMPATIBLE_PATH: compatible, CORRECT_PATH: correct, FIRST: first}


#: (version, case) -> the steps' digest per square-root path; FIRST: the path of the CPU that recorded the
#: first digests, on b00ff5e (any path not in SQRT_PATHS is held to it).
GOLDEN_STEPS = {
    (2, ("tiny", "adamw", 2, 3)): _paths("707dd560525cf113", "42e428b6442c08ad", "aa52a0f36b5cfce9",
                                        "b07c6f01f706d38e"),
    (2, ("mini", "adamw", 2, 3)): _paths("6d9492c648ade039", "0af9ec38dccdf389", "901bd32f4a7c0101",
                                        "f078d47b7659a719"),
    (2, ("llama-tiny", "muon", 2, 3)): _paths("82309fdb8a89f508", "c5c9fb3b10fd10ee", "c5a15a0ad75a6254",
                                             "d554d5e21820c60d"),
    (1, ("tiny", "adamw", 2, 2)): _paths("4ebef0686084c473", "1931f63c7d8e926a", "03c97672effed24d",
                                        "f84aafee638f1ce8"),
    (1, ("llama-tiny", "muon", 2, 2)): _paths("c44ab0884152b7f3", "d7753f9a555108ba", "656e0e4a06316bd6",
                                             "faed3fcf54bb16d7"),
}
#: The MKL paths the children pin (MKL_CBWR): COMPATIBLE on every x86 CPU, AVX2 where the CPU has it.
MKL_PATHS = ["COMPATIBLE", "AVX2"]
#: Version 3's: version 2's forward and backward, its own steps (the correctly rounded square root).
GOLDEN_V3 = {
    ("tiny", "adamw", 2, 3): ("203dd52d46bb6d3e", "23b18f2c66d7a4f0", "aa52a0f36b5cfce9"),
    ("mini", "adamw", 2, 3): ("d2a42bd9693cc27c", "458482937bcc9ed2", "901bd32f4a7c0101"),
    ("llama-tiny", "muon", 2, 3): ("2753bb8a6e704c13", "72ed719c273a610e", "c5a15a0ad75a6254"),
}
#: Version 2 at llama-20m (slow): forward and backward recorded on b00ff5e; its step per path as GOLDEN_STEPS.
SLOW_GOLDEN = {
    ("llama-20m", "adamw", 1, 1): ("7a3a6a2cf47ce566", "36ccaeff618a9d0f"),
}
SLOW_GOLDEN_STEPS = {
    (2, ("llama-20m", "adamw", 1, 1)): _paths("860b21b55664e93b", "a4baa54b84ca578d", "72056d977e6b1596",
                                             "ac496a3a03698276"),
}


def _digest(parts) -> str:
    out = hashlib.sha256()
    for part in parts:
        out.update(part if isinstance(part, bytes) else part.detach().contiguous().numpy().tobytes())
    return out.hexdigest()[:16]


def _batch(vocab: int, batch: int, block: int, generator: torch.Generator):
    return (torch.randint(0, vocab, (batch, block), generator=generator) for _ in range(2))


def forward_backward(preset: str, batch: int, version: int) -> tuple[str, str]:
    """The digests of one forward pass (logits and loss) and of its backward pass (every gradient) of a
    fresh model under kernel ``version``: no square root, so the same on every CPU path."""
    cfg = ModelConfig(preset=preset)
    model = GPT(cfg, seed=0)
    x, y = _batch(cfg.vocab_size, batch, cfg.block_size, torch.Generator().manual_seed(3))
    with ExactKernels(version):
        logits, loss = model(x, y)
    forward = _digest([logits, loss])
    loss.backward()
    return forward, _digest([p.grad for _, p in model.named_parameters()])


def inner_steps(preset: str, optimizer: str, batch: int, steps: int, version: int) -> str:
    """The digest of ``steps`` inner steps of a fresh trainer under kernel ``version``: each step's loss,
    its clipped gradients and the weights after it."""
    cfg = ModelConfig(preset=preset)
    _, trainer = trainer_for(preset, optimizer, True, batch, version)
    generator, parts = torch.Generator().manual_seed(7), []
    for _ in range(steps):
        value = trainer.train_step(*_batch(cfg.vocab_size, batch, cfg.block_size, generator))
        parts.append(struct.pack("<d", value))
        parts.extend(p.grad for module in trainer.stage_modules for p in module.parameters()
                     if p.grad is not None)
        parts.extend(trainer.state_dict().values())
    return _digest(parts)


def golden(preset: str, optimizer: str, batch: int, steps: int, version: int = 2) -> tuple[str, str, str]:
    """The three digests of the case (module docstring) under kernel ``version``, in this process."""
    return (*forward_backward(preset, batch, version), inner_steps(preset, optimizer, batch, steps, version))


def cpu_has_avx2() -> bool:
    try:
        return " avx2" in Path("/proc/cpuinfo").read_text()
    except OSError:  # no /proc: the AVX2 path is checked only where the CPU says it has it
        return False


def sqrt_path() -> str:
    """The name of this process's square-root path: a digest of torch's float32 and float64 roots of fixed
    values (the values where paths differ)."""
    x32 = torch.linspace(1e-7, 4.0, 8191, dtype=torch.float32) ** 2 + torch.linspace(0, 1e-6, 8191)
    x64 = x32.double() * 1.000001
    roots = torch.sqrt(x32).numpy().tobytes() + torch.sqrt(x64).numpy().tobytes()
    return hashlib.sha256(roots).hexdigest()[:16]


def expected_steps(table: dict, path: str) -> dict:
    """The recorded step digests of each case on square-root ``path`` (b00ff5e's for a path not recorded)."""
    return {key: want[path if path in SQRT_PATHS else FIRST] for key, want in table.items()}


def steps_on_path(cases) -> tuple[str, dict]:
    """This process's square-root path and :func:`inner_steps` of each ``(version, case)`` on 1 thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return sqrt_path(), {(version, tuple(case)): inner_steps(*case, version) for version, case in cases}
    finally:
        torch.set_num_threads(before)


def pinned_steps(cases, mkl_path: str) -> tuple[str, dict]:
    """:func:`steps_on_path` in a child whose MKL code path is pinned (``MKL_CBWR`` is read when MKL starts,
    so it cannot be set in this process)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MKL_CBWR", "OMP_NUM_THREADS")}
    env.update(MKL_CBWR=mkl_path, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, __file__, "steps", json.dumps(list(cases))], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=3000)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return out["path"], {(version, tuple(case)): digest for version, case, digest in out["steps"]}


def check_steps(table: dict, path: str, got: dict, where: str) -> None:
    want = expected_steps(table, path)
    assert got == want, (f"{where}: square-root path {path} "
                         f"({SQRT_PATHS.get(path, 'not recorded: held to b00ff5e, the first CPU')}); if this "
                         "is a CPU whose path was never recorded, record it (python "
                         "tests/test_reproducible_golden.py record) with its CPU model")


def _name(case) -> str:
    return "-".join(map(str, case))


def _check(case, want, threads, version):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = forward_backward(case[0], case[2], version) if len(want) == 2 else golden(*case, version)
        assert got == want, case
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("case", sorted(GOLDEN), ids=_name)
@pytest.mark.parametrize("threads", [1, 2])
def test_version_2_keeps_its_recorded_forward_and_backward_bits(case, threads):
    _check(case, GOLDEN[case], threads, version=2)


@pytest.mark.parametrize("case", sorted(GOLDEN_V1), ids=_name)
def test_version_1_keeps_its_recorded_forward_and_backward_bits(case):
    _check(case, GOLDEN_V1[case], 1, version=1)


def test_versions_1_and_2_keep_their_recorded_steps_on_this_cpus_path():
    check_steps(GOLDEN_STEPS, *steps_on_path(sorted(GOLDEN_STEPS)), "this process")


@pytest.mark.timeout(1800)  # one child per path: under a minute on an idle machine
@pytest.mark.parametrize("mkl_path", MKL_PATHS)
def test_versions_1_and_2_keep_their_recorded_steps_on_a_pinned_mkl_path(mkl_path):
    """Versions 1 and 2's inner steps under ``MKL_CBWR=COMPATIBLE`` and ``AVX2``: the digests recorded for the
    square-root path the child took."""
    if mkl_path == "AVX2" and not cpu_has_avx2():
        pytest.skip("this CPU has no AVX2: MKL's AVX2 path needs it")
    check_steps(GOLDEN_STEPS, *pinned_steps(sorted(GOLDEN_STEPS), mkl_path), f"MKL_CBWR={mkl_path}")


def test_the_correctly_rounded_paths_version_2_is_version_3():
    """The tables agree with the cause: on the path whose roots are correctly rounded, version 2's steps are
    version 3's; on every other recorded path they are not (a path recorded under the wrong name fails)."""
    for (version, case), want in GOLDEN_STEPS.items():
        if version == 2:
            assert want[CORRECT_PATH] == GOLDEN_V3[case][2], case
            assert all(want[path] != GOLDEN_V3[case][2] for path in want if path != CORRECT_PATH), case


def test_version_3s_root_is_correctly_rounded_on_this_cpus_own_mkl_path():
    """Version 3 never takes MKL's root: in this process (MKL's own path for this CPU) its float32 roots
    equal NumPy's, the correctly rounded ones, on 2^16 values."""
    import numpy as np

    from training import exact_kernel

    x = torch.rand(1 << 16, generator=torch.Generator().manual_seed(1)) * 10
    assert np.array_equal(exact_kernel.sqrt(x, 3).numpy().view(np.int32), np.sqrt(x.numpy()).view(np.int32))


@pytest.mark.parametrize("case", sorted(GOLDEN_V3), ids=_name)
@pytest.mark.parametrize("threads", [1, 2])
def test_version_3_keeps_its_recorded_bits(case, threads):
    _check(case, GOLDEN_V3[case], threads, version=3)


def test_version_3s_steps_are_those_the_h200_and_its_cpu_computed():
    """bench/bench_exact_triton.py on a lent H200 (bench/results/exact_triton.json): two inner steps under
    version 3 gave one digest on the GPU (Triton kernels, CUDA's elementwise operations) and on that
    machine's CPU (a Xeon with AVX-512, torch 2.11, numba 0.68.0); this CPU's torch build gives the same.
    Version 2's there differed between its CPU and GPU, and from this machine's."""
    from bench.bench_exact_triton import inner_steps as triton_inner_steps

    report = json.loads((ROOT / "bench/results/exact_triton.json").read_text())
    seen = {name: entry for name, entry in report.items() if name.endswith("_two_inner_steps_v3")}
    assert len(seen) == 4 and all(entry["identical"] for entry in seen.values())
    for name, entry in seen.items():
        case, optimizer = name.removesuffix("_two_inner_steps_v3").rsplit("_", 1)
        assert triton_inner_steps(case, optimizer, "cpu", 3) == entry["cuda"] == entry["cpu"], name
    assert not any(entry["identical"] for name, entry in report.items() if name.endswith("_v2"))


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("case", sorted(SLOW_GOLDEN), ids=_name)
def test_version_2_keeps_its_recorded_bits_at_llama_20m(case):
    _check(case, SLOW_GOLDEN[case], 2, version=2)
    check_steps(SLOW_GOLDEN_STEPS, *steps_on_path(sorted(SLOW_GOLDEN_STEPS)), "this process")
    for mkl_path in (p for p in MKL_PATHS if p != "AVX2" or cpu_has_avx2()):
        check_steps(SLOW_GOLDEN_STEPS, *pinned_steps(sorted(SLOW_GOLDEN_STEPS), mkl_path), mkl_path)


if __name__ == "__main__":
    # `steps '[[version, case], ...]'`: pinned_steps' child. `record [--slow]`: print the steps' digests on
    # this CPU's own path and on each pinned one, with the path's name, to record them.
    if sys.argv[1:2] == ["steps"]:
        path, steps = steps_on_path(json.loads(sys.argv[2]))
        print(json.dumps({"path": path, "steps": [[v, list(case), d] for (v, case), d in steps.items()]}))
    elif sys.argv[1:2] == ["record"]:
        table = SLOW_GOLDEN_STEPS if "--slow" in sys.argv else GOLDEN_STEPS
        for where, (path, steps) in [("own", steps_on_path(sorted(table))),
                                     *((p, pinned_steps(sorted(table), p)) for p in MKL_PATHS)]:
            for key, digest in steps.items():
                print(where, path, key, digest, flush=True)
