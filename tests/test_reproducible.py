"""``training.reproducible``: the inner steps give the same bits on every CPU instruction set, thread count
and math-library path, so any verifier judges any claim bit for bit (issue 64; docs/REPRODUCIBLE.md).

A short reproducible run (tiny, 3 replicas, 2 rounds) is trained here, in this process, by an honest claimant
and two cheats who each tamper with one inner step of round 0: one makes that step's update 1% larger, the
other moves one weight by one ulp. tests/repro_probe.py then runs in children under other
``ATEN_CPU_CAPABILITY`` values, thread counts and ``MKL_CBWR``, trains two fresh inner steps of GPT-2 (AdamW)
and Llama (Muon) and reruns every claim. Demanded: the fresh steps are the same bits in every child, the
honest claims rerun to ``exact`` under the reproducible rule and chain into the next round everywhere, and
each cheat is convicted everywhere (its rerun a mismatch, or its next start state not where the rerun
leads). The normal mode, for contrast, is not the same bits under every capability (slow grid).
"""

from __future__ import annotations

import contextlib
import json
import math
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from training.exact_codec import ExactCodec
from training.exact_linalg import gram_svd, householder_qr, jacobi_eigh
from training.exact_math import exact_matmul, exp64, log64, sin_cos64, tanh64, tree_sum
from training.exact_mode import ExactKernels
from training.exact_probe import ENCODERS, FRESH, NATIVE, child_env, codec_bytes, fresh_steps
from training.exact_ops import ExactKernelError
from training.fingerprint import EXACT, MISMATCH, RULE_REPRODUCIBLE, compare_rerun, fingerprint
from training.reexec import STATE_MISMATCH
from training.reexec_sim import SimReplica

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.repro_cheats import OneStepCheat  # noqa: E402  (the same cheats as the full demo's audit bench)

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "tests" / "repro_probe.py"
OVERRIDES = ["model.preset=tiny", "pipeline.num_stages=2", "diloco.num_replicas=3", "diloco.inner_steps=2",
             "training.batch_size=4", "training.warmup_steps=2", "compression.min_compress_numel=512",
             "training.reproducible=true", "training.reproducible_kernels=1"]
HONEST, PERCENT_CHEAT, ULP_CHEAT = 0, 1, 2


# ----------------------------------------------------------------------------- the arithmetic


def test_elementary_functions_match_float64_references():
    x = torch.linspace(-80, 80, 20001, dtype=torch.float64)
    assert torch.allclose(exp64(x), torch.exp(x), rtol=4e-15, atol=0)
    positive = torch.logspace(-30, 30, 20001, dtype=torch.float64)
    assert torch.allclose(log64(positive), torch.log(positive), rtol=4e-15, atol=1e-15)
    assert log64(torch.zeros(1, dtype=torch.float64)).item() == -math.inf
    angles = torch.linspace(-2048, 2048, 40001, dtype=torch.float64)
    sin, cos = sin_cos64(angles)
    assert torch.allclose(sin, torch.sin(angles), rtol=0, atol=2e-14)
    assert torch.allclose(cos, torch.cos(angles), rtol=0, atol=2e-14)
    assert torch.allclose(tanh64(x / 8), torch.tanh(x / 8), rtol=0, atol=4e-16)


def test_exact_matmul_does_not_depend_on_the_summation_order():
    generator = torch.Generator().manual_seed(0)
    for inner in (1, 13, 700, 3000):
        a = torch.randn(5, 7, inner, generator=generator) * torch.logspace(-3, 3, inner)
        b = torch.randn(5, inner, 3, generator=generator)
        product = exact_matmul(a, b)
        reference = (a.double() @ b.double()).float()
        assert torch.allclose(product, reference, rtol=1e-6, atol=1e-6 * float(reference.abs().max()))
        # The slices' products are exact: any order of the inner index gives the same bits.
        order = torch.randperm(inner, generator=generator)
        assert torch.equal(exact_matmul(a[..., order], b[..., order, :]), product)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            assert torch.equal(exact_matmul(a, b), product)
        finally:
            torch.set_num_threads(threads)


def test_tree_sum_is_a_tree_of_fixed_shape():
    generator = torch.Generator().manual_seed(0)
    for count in (1, 2, 7, 64, 65):
        x = torch.randn(3, count, generator=generator)
        assert torch.allclose(tree_sum(x, 1), x.sum(1, keepdim=True), atol=1e-5)
    # [1, u, u, u] with u half an ulp of 1: in sequence every u is lost (a tie, to even): 1; the tree adds
    # the halves, [1 + u, u + u] = [1, 2u], then 1 + 2u.
    u = 2.0 ** -24
    assert tree_sum(torch.tensor([[1.0, u, u, u]]), 1).item() == 1.0 + 2 * u
    # An odd count's last element is carried: [1, u, u] -> [1 + u, u] = [1, u] -> 1.
    assert tree_sum(torch.tensor([[1.0, u, u]]), 1).item() == 1.0


def test_an_operation_without_a_fixed_order_kernel_is_refused():
    x = torch.randn(4, 4)
    with ExactKernels(), pytest.raises(ExactKernelError, match="cumsum"):
        torch.cumsum(x, 0)
    with ExactKernels(), pytest.raises(ExactKernelError, match="alpha"):
        torch.add(x, x, alpha=2.0)
    with ExactKernels(), pytest.raises(ExactKernelError, match="tanh approximation"):
        torch.nn.functional.gelu(x)


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_the_mode_computes_the_same_model(preset):
    """The fixed-order forward and backward passes are the model's: loss and gradients as torch's to
    float32 rounding."""
    from training.config import ModelConfig
    from training.model import GPT

    model = GPT(ModelConfig(preset=preset), seed=0)
    generator = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 256, (2, 32), generator=generator) for _ in range(2))
    _, reference = model(x, y)
    reference.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    with ExactKernels():
        _, loss = model(x, y)
    loss.backward()
    assert abs(loss.item() - reference.item()) < 1e-5
    for name, param in model.named_parameters():
        scale = float(expected[name].abs().max()) + 1e-12
        assert float((param.grad - expected[name]).abs().max()) / scale < 1e-4, name


# ----------------------------------------------------------------------------- settings and the verdict


def test_the_setting_is_in_the_run_document_only_when_on():
    from node.config import load_config
    from node.runconfig import run_document

    plain = [o for o in OVERRIDES if not o.startswith("training.reproducible")]
    assert "reproducible" not in run_document(load_config(None, plain))["training"]
    assert run_document(load_config(None, OVERRIDES))["training"]["reproducible"] is True
    from training.config import TrainingConfig

    with pytest.raises(ValueError, match="fp32"):
        TrainingConfig(reproducible=True, precision="bf16")


def test_a_reproducible_rerun_is_judged_bit_for_bit_on_any_cpu():
    here = fingerprint(torch.device("cpu"), "fp32")
    for field, value in (("capability", "DEFAULT"), ("device_name", "another CPU"),
                         ("blas", "MKL_CBWR=COMPATIBLE")):
        other = type(here)(**{**here.document(), field: value})
        exact = compare_rerun(other, here, 0.0, claimed_threads=1, rerun_threads=2, reproducible=True)
        assert (exact.verdict, exact.rule) == (EXACT, RULE_REPRODUCIBLE), field
        off = compare_rerun(other, here, 1e-9, claimed_threads=2, rerun_threads=1, reproducible=True)
        assert (off.verdict, off.rule) == (MISMATCH, RULE_REPRODUCIBLE), field
        # Without the mode the same distance elsewhere passes as within tolerance.
        assert compare_rerun(other, here, 1e-9, claimed_threads=2, rerun_threads=2).verdict != MISMATCH
    # Another torch version, or a GPU: not covered (untested), the tolerance rules apply.
    for field, value in (("torch", "0.0.1"), ("device_type", "cuda")):
        elsewhere = type(here)(**{**here.document(), field: value})
        judged = compare_rerun(elsewhere, here, 1e-9, claimed_threads=2, rerun_threads=2, reproducible=True)
        assert judged.rule != RULE_REPRODUCIBLE and judged.verdict != MISMATCH


# ----------------------------------------------------------------------------- the codec


def test_the_fixed_order_factorizations_are_accurate():
    generator = torch.Generator().manual_seed(0)
    tall = torch.randn(200, 24, generator=generator)
    tall[:, 5] = 0.0  # a zero column: its reflection is skipped
    q, r = householder_qr(tall)
    assert float((q @ r - tall).abs().max()) < 1e-5
    assert float((q.t() @ q - torch.eye(24)).abs().max()) < 1e-5
    assert torch.equal(r, torch.triu(r))
    for size, rank in ((9, 9), (33, 33), (40, 12)):  # odd and even sizes, and a rank-deficient matrix
        side = torch.randn(size, rank, generator=generator)
        symmetric = side @ side.t()
        values, vectors = jacobi_eigh(symmetric)
        reference = torch.linalg.eigvalsh(symmetric.double()).float()
        scale = float(reference.abs().max())
        assert float((values - reference).abs().max()) < 1e-5 * scale, size
        assert float((vectors @ torch.diag(values) @ vectors.t() - symmetric).abs().max()) < 1e-5 * scale
        assert float((vectors.t() @ vectors - torch.eye(size)).abs().max()) < 1e-5
    for shape in ((30, 70), (70, 30)):
        matrix = torch.randn(*shape, generator=generator)
        u, sigma, vh = gram_svd(matrix)
        assert torch.allclose(sigma, torch.linalg.svdvals(matrix), rtol=1e-5, atol=1e-5)
        assert float((u @ torch.diag(sigma) @ vh - matrix).abs().max()) < 1e-4


def test_the_exact_codec_refuses_what_it_does_not_cover():
    x = torch.randn(4, 4)
    with ExactCodec(), pytest.raises(ExactKernelError, match="alpha"):
        torch.add(x, x, alpha=2.0)
    with ExactCodec(), pytest.raises(ExactKernelError, match="exp"):
        torch.exp(x)
    with ExactCodec(), pytest.raises(ExactKernelError, match="order 1"):
        torch.linalg.vector_norm(x, ord=1)
    # The decoder's product of integers is BLAS's own (exact in any order); a general one is split.
    ints = torch.randint(-1000, 1000, (8, 64)).double()
    with ExactCodec():
        assert torch.equal(ints @ ints.t(), torch.mm(ints, ints.t()))


def test_a_reproducible_codec_encodes_as_the_normal_one_does():
    """The fixed-order codec is the same codec: its contributions are as close to the input."""
    from training.codec.registry import encoder_for
    from training.codec_wire import decode_contribution
    from training.config_compression import CompressionConfig
    from training.exact_probe import codec_inputs

    tensors = codec_inputs()
    for encoder in ENCODERS:
        coder = encoder_for(CompressionConfig(encoder=encoder))
        errors = []
        for exact in (False, True):
            with ExactCodec() if exact else contextlib.nullcontext():
                blob, _, _, _ = coder.encode_round(tensors, 12000, None, stage_index=0, outer_round=0)
            decoded = decode_contribution(blob, {name: tuple(t.shape) for name, t in tensors.items()})
            errors.append(max(float(torch.linalg.vector_norm(decoded[name] - t) / torch.linalg.vector_norm(t))
                              for name, t in tensors.items()))
        assert errors[1] <= errors[0] * 1.05 + 1e-6, (encoder, errors)


# ----------------------------------------------------------------------------- across platforms


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory) -> Path:
    """The reproducible run (kernel version 1), trained in this process (its own kernels, 1 thread)."""
    return record_run(tmp_path_factory, OVERRIDES)


@pytest.fixture(scope="module")
def recorded_run_v2(tmp_path_factory) -> Path:
    """The same run with ``training.reproducible_kernels = 2``."""
    return record_run(tmp_path_factory, [*OVERRIDES, "training.reproducible_kernels=2"])


def record_run(tmp_path_factory, overrides: list[str]) -> Path:
    from node.config import load_config
    from training.data import corpus_from_config
    from training.reexec_sim import SimConfig, run_with_states

    cfg = load_config(None, overrides)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sim = SimConfig(corpus_from_config(cfg.training, cfg.model), cfg.model, cfg.training, cfg.diloco,
                        cfg.compression, cfg.pipeline.num_stages, rounds=2)
        replicas = [SimReplica(HONEST, sim), OneStepCheat(PERCENT_CHEAT, sim, "percent", 0),
                    OneStepCheat(ULP_CHEAT, sim, "ulp", 0)]
        records = run_with_states(replicas, sim)
    finally:
        torch.set_num_threads(threads)
    run = {"overrides": overrides,
           "records": [{"round": r.outer_round, "contributions": r.contributions,
                        "states": {replica: [part.to_bytes() for part in state.stages]
                                   for replica, state in r.states.items()},
                        "claims": r.claims} for r in records]}
    path = tmp_path_factory.mktemp("repro") / "run.pkl"
    path.write_bytes(pickle.dumps(run))
    return path


#: What :func:`probe` printed, by its arguments: a child the module's tests would run twice runs once.
_PROBED: dict[tuple, dict] = {}


def probe(run: Path | str, capability: str, threads: int, cbwr: str | None = None,
          fresh: bool = True, v3_only: bool = False) -> dict:
    """tests/repro_probe.py in a child under ``capability`` (or the machine's own), ``threads`` and
    ``MKL_CBWR`` (``fresh=False``: the reruns alone, not the fresh steps and codec payloads; ``v3_only``:
    of the fresh steps and payloads, kernel version 3's alone)."""
    key = (str(run), capability, threads, cbwr, fresh, v3_only)
    if key not in _PROBED:
        _PROBED[key] = _probe(run, capability, threads, cbwr, fresh, v3_only)
    return _PROBED[key]


def _probe(run: Path | str, capability: str, threads: int, cbwr: str | None, fresh: bool,
           v3_only: bool = False) -> dict:
    done = subprocess.run([sys.executable, str(PROBE), str(run), str(threads),
                           *(() if fresh else ("--reruns-only",)), *(("--v3-only",) if v3_only else ())],
                          env=child_env(ROOT, capability, threads, cbwr), capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["threads"] == threads
    if capability != NATIVE:
        assert out["capability"] == capability.upper()
    return out


def check_grid(run: Path, grid: list[tuple[str, int, str | None]], fresh: bool = True) -> list[dict]:
    """Every child of ``grid`` reruns ``run``'s claims to the demanded verdicts; with ``fresh``, their fresh
    steps and codec payloads agree too."""
    results = [probe(run, *key, fresh=fresh) for key in grid]
    first = results[0]
    for key, out in zip(grid, results):
        if fresh:
            assert out["fresh_v3"] == first["fresh_v3"], (key, out["fresh_v3"], first["fresh_v3"])
            # Versions 1 and 2's steps take MKL's root (tests/test_reproducible_golden.py): one MKL path, one
            # result.
            same_path = next(o for k, o in zip(grid, results) if k[2] == key[2])
            for version in ("fresh", "fresh_v2"):
                assert out[version] == same_path[version], (key, version, out[version], same_path[version])
            assert out["codec"] == first["codec"], (key, out["codec"], first["codec"])
        assert len(out["checks"]) == 6, key
        checks = {(c["round"], c["replica"]): c for c in out["checks"]}
        for outer_round in (0, 1):
            honest = checks[(outer_round, HONEST)]
            assert (honest["verdict"], honest["rule"]) == (EXACT, RULE_REPRODUCIBLE), (key, honest)
            assert honest["how"] == "exact", (key, honest)  # no child: nothing to emulate
        assert checks[(0, HONEST)]["chain"] == EXACT, key
        assert checks[(0, PERCENT_CHEAT)]["verdict"] == MISMATCH, (key, checks[(0, PERCENT_CHEAT)])
        ulp = checks[(0, ULP_CHEAT)]
        # Convicted by its contribution or, where the codec's rounding hides one ulp, by its next state.
        assert ulp["verdict"] == MISMATCH or ulp["chain"] == STATE_MISMATCH, (key, ulp)
    return results


@pytest.mark.timeout(900)  # two children: ~20 s on an idle machine, 2 minutes at a load of 15 on 2 cores
def test_inner_steps_are_the_same_bits_under_other_kernels_threads_and_mkl_path(request):
    """Two inner steps of GPT-2 (AdamW) and Llama (Muon), and the codec's payloads on fixed inputs, in
    children: the same bits as in this process."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        here = {f"{p}/{o}": fresh_steps(p, o) for p, o in FRESH}
        here_v2 = {f"{p}/{o}": fresh_steps(p, o, kernels=2) for p, o in FRESH}
        here_v3 = {f"{p}/{o}": fresh_steps(p, o, kernels=3) for p, o in FRESH}
        codec = {encoder: codec_bytes(encoder) for encoder in ENCODERS}
        codec_v2 = {encoder: codec_bytes(encoder, kernels=2) for encoder in ENCODERS}
    finally:
        torch.set_num_threads(threads)
    assert len({str(here), str(here_v2), str(here_v3)}) == 3  # the versions' arithmetic differs
    # Version 3's steps and codec: the same bits everywhere. Versions 1 and 2 take torch's square root, in
    # their steps and their codec, whose bits are the math library's path's (test_reproducible_golden.py):
    # the same under another ATen capability and thread count on this CPU's own path (their steps'
    # recorded digests on pinned paths: the golden test). So the child on the pinned path computes version
    # 3's alone (versions 1 and 2 there: Numba's loops built for that target, about 25 CPU seconds on a
    # clean clone, for bits nothing here compares).
    for key in (("default", 2, None), ("avx2", 1, "COMPATIBLE")):
        # The first child is the one test_reruns_are_bit_exact_under_other_kernels_and_threads[recorded_run]
        # runs (the same environment): run once for both.
        out = (probe(request.getfixturevalue("recorded_run"), *key) if key[2] is None
               else probe("-", *key, v3_only=True))
        assert (out["fresh_v3"], out["codec"]) == (here_v3, codec), key
        if key[2] is None:
            assert (out["fresh"], out["fresh_v2"], out["codec_v2"]) == (here, here_v2, codec_v2), key


@pytest.mark.timeout(900)
@pytest.mark.parametrize("run", ["recorded_run", "recorded_run_v2"])
def test_reruns_are_bit_exact_under_other_kernels_and_threads(run, request):
    """Version 1's run, and version 2's (whose compiled loops the child builds for the baseline x86-64:
    ``NUMBA_CPU_NAME=generic``, SSE2 without FMA, where this process built them for AVX-512). One child
    for both: its fresh steps and codec are test_inner_steps_are_the_same_bits_...'s business (version 1's
    child serves it too), so version 2's child reruns the claims alone."""
    check_grid(request.getfixturevalue(run), [("default", 2, None)], fresh=run == "recorded_run")


@pytest.mark.slow
@pytest.mark.timeout(3600)  # 12 children, the CBWR ones with a grandchild: minutes on a loaded machine
@pytest.mark.parametrize("run", ["recorded_run", "recorded_run_v2"])
def test_reruns_are_bit_exact_under_every_capability_thread_count_and_mkl_path(run, request):
    grid = [(capability, threads, cbwr) for capability in (NATIVE, "default", "avx2") for threads in (1, 2)
            for cbwr in (None, "COMPATIBLE")]
    results = check_grid(request.getfixturevalue(run), grid)
    # The contrast: torch's own kernels, and the codec's LAPACK and BLAS, give other bits elsewhere.
    assert len({out["normal"] for out in results}) > 1
    assert len({out["codec_normal"] for out in results}) > 1
