"""Every bit-exact path gives the same bits under every CPU instruction set torch can pick, and any thread
count (issue 42, "Verification anywhere").

A short run (tiny, 2 replicas x 2 stages, 2 rounds) is trained here, once, by claimants on 1 thread. Then
tests/isa_probe.py runs in subprocesses under ``ATEN_CPU_CAPABILITY=default`` (no AVX: what an ARM or an old
x86 auditor's kernels compute like), ``avx2`` and this machine's own choice, on 1 and 2 threads, and each
prints the portable initial weights, the codec's sketch, the data order, the decode of every contribution,
the audit replay's weights root of every round, an encode, the wire vectors' rebuild, and every
re-execution's verdict. Everything but the re-execution must be the same bits everywhere, and equal to what
the members themselves computed. Re-execution reruns the inner steps, which are not bit-exact across
instruction sets (torch's vectorised GELU, softmax, LayerNorm and AdamW kernels round differently;
docs/DILOCOX.md): under the claimant's own kernels the verdict must be ``exact``, elsewhere it must accept
the honest claimant (no ``mismatch``); the state chain is checked from the bit-exact reruns only.

The default suite runs this machine's own kernels on 1 thread and ``default`` on 2; the full grid is ``slow``.
With ``DLX_ARM_PYTHON`` naming an aarch64 Python with torch (scripts/setup-arm-emulation.sh: qemu-user on
x86), a ``slow`` test runs the probe there too, under torch's aarch64 ``default`` (NEON) and native (SVE256)
kernels: the same bits demanded (the wire vectors are not rebuilt there: libp2p is not installed), every rerun
of the x86 claims on other kernels, so none exact and none a mismatch.
"""

from __future__ import annotations

import json
import os
import pickle
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from training.fingerprint import EXACT, MISMATCH

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "tests" / "isa_probe.py"
OVERRIDES = ["model.preset=tiny", "pipeline.num_stages=2", "diloco.num_replicas=2", "diloco.inner_steps=2",
             "training.batch_size=4", "training.warmup_steps=2", "compression.min_compress_numel=512"]
CLAIMANT_THREADS = 1
NATIVE = "native"
#: What must be the same bits under every capability and thread count.
PORTABLE = ("init", "sketch", "data", "decode", "encode_1_thread", "roots", "weights", "wire_vectors")
#: An aarch64 python with torch, this checkout's training/
#: importable (scripts/setup-arm-emulation.sh), or unset.
ARM_PYTHON = os.environ.get("DLX_ARM_PYTHON", "")


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory) -> tuple[Path, list[str]]:
    """The short run, trained in this process by honest claimants on 1 thread; its file and the members'
    roots."""
    from node.config import load_config
    from training.data import corpus_from_config
    from training.reexec_sim import SimConfig, SimReplica, run_with_states

    cfg = load_config(None, OVERRIDES)
    assert cfg.model.init == "philox" and cfg.compression.sketch == "philox"
    threads = torch.get_num_threads()
    torch.set_num_threads(CLAIMANT_THREADS)
    try:
        sim = SimConfig(corpus_from_config(cfg.training, cfg.model), cfg.model, cfg.training, cfg.diloco,
                        cfg.compression, cfg.pipeline.num_stages, rounds=2)
        replicas = [SimReplica(r, sim) for r in range(cfg.diloco.num_replicas)]
        records = run_with_states(replicas, sim)
    finally:
        torch.set_num_threads(threads)
    run = {
        "overrides": OVERRIDES, "claimant_threads": CLAIMANT_THREADS,
        "records": [{"round": r.outer_round, "contributions": r.contributions,
                     "states": {replica: [part.to_bytes() for part in state.stages]
                                    for replica, state in r.states.items()},
                     "claims": r.claims} for r in records],
    }
    path = tmp_path_factory.mktemp("isa") / "run.pkl"
    path.write_bytes(pickle.dumps(run))
    # The members' own root after the last round (every replica holds the same global weights).
    from training.hashing import weights_root

    member_root = weights_root([engine.weights_hash() for engine in replicas[0].engines]).hex()
    return path, member_root


def probe(run: Path, capability: str, threads: int, python: str = sys.executable) -> dict:
    """tests/isa_probe.py in a child of ``python`` (an aarch64 one: without the wire vectors, and its output's
    capability named ``aarch64:CAPABILITY``, since torch calls x86's and ARM's baseline both ``DEFAULT``)."""
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS")}
    env["PYTHONPATH"] = str(ROOT)
    env["OMP_NUM_THREADS"] = str(threads)
    if capability != NATIVE:
        env["ATEN_CPU_CAPABILITY"] = capability
    arm = python != sys.executable
    done = subprocess.run([python, str(PROBE), str(run), str(threads)] + (["--no-wire-vectors"] if arm
                                                                          else []),
                          env=env, capture_output=True, text=True, timeout=1800 if arm else 600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["threads"] == threads
    if capability != NATIVE:
        assert out["capability"] == capability.upper()
    if arm:
        out["capability"] = f"aarch64:{out['capability']}"
    return out


def check_grid(run: Path, member_root: str, grid: list[tuple[str, int]],
               arm: list[tuple[str, int]] = ()) -> None:
    """``grid``: (capability, threads) of this machine's probes, the first one x86's; ``arm``: the same under
    ``ARM_PYTHON``."""
    native_capability = torch.backends.cpu.get_cpu_capability()
    results = {(capability, threads): probe(run, capability, threads) for capability, threads in grid}
    results.update({(f"aarch64 {capability}", threads): probe(run, capability, threads, ARM_PYTHON)
                    for capability, threads in arm})
    first = next(iter(results.values()))
    assert first["wire_vectors"] is True
    assert first["weights"] == member_root  # the audit's replay reaches the members' own weights
    for key, out in results.items():
        out["encode_1_thread"] = out["encode"] if key[1] == 1 else None
        for name in PORTABLE:
            # not rebuilt on ARM
            if name == "encode_1_thread" or (name == "wire_vectors" and out[name] is None):
                continue
            assert out[name] == first[name], f"{name} differs under {key}: {out[name]} != {first[name]}"
        print(key, out["capability"], out["verdicts"], out["distances"], out["chains"])
        assert MISMATCH not in out["verdicts"], (key, out["verdicts"], out["distances"])
        if out["capability"] == native_capability:  # the claimants' own kernels: bit-exact demanded and given
            assert set(out["verdicts"]) == {EXACT}, (key, out["verdicts"], out["distances"])
            # and the rerun's next start state chains into the claimant's next round
            assert out["chains"] and all(chain == EXACT for chain in out["chains"]), (key, out["chains"])
    encodes = {out["encode"] for key, out in results.items() if key[1] == 1}
    assert len(encodes) <= 1  # the encoder on one thread: the same bytes under every capability


def test_bit_exact_paths_agree_under_default_and_native_kernels(recorded_run):
    run, member_root = recorded_run
    check_grid(run, member_root, [(NATIVE, 1), ("default", 2)])


@pytest.mark.slow
def test_bit_exact_paths_agree_under_every_capability_and_thread_count(recorded_run):
    run, member_root = recorded_run
    check_grid(run, member_root, [(capability, threads) for capability in (NATIVE, "default", "avx2")
                                  for threads in (1, 2)])


@pytest.mark.slow
@pytest.mark.timeout(3600)  # two probes under qemu-user emulation: 1 to 2 minutes each at a light load
@pytest.mark.skipif(not ARM_PYTHON,
                    reason="no aarch64 python: set DLX_ARM_PYTHON (scripts/setup-arm-emulation.sh)")
def test_bit_exact_paths_agree_on_aarch64(recorded_run):
    """The x86 claimants' run probed by an aarch64 torch under its NEON (``default``) and its own (SVE256
    under the setup's emulated CPU) kernels: the replay, decode, init, sketch, data order and encode are x86's
    bits; the reruns of the inner steps are on other kernels, so the exact-verdict check above does not apply
    to them."""
    assert platform.machine() != "aarch64", "on an ARM machine this file's other tests are the ARM ones"
    run, member_root = recorded_run
    check_grid(run, member_root, [(NATIVE, 1)], arm=[("default", 1), (NATIVE, 1)])
