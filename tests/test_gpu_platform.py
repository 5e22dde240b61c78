"""Issue 32, the pure parts: device and precision settings, the run document without them, the
platform fingerprint and its place in the start state, and the rule a rerun is judged by.
All of it runs on the CPU; what needs CUDA is in tests/test_gpu_training.py, marked ``gpu``.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import pytest
import torch

from node.config import load_config
from node.runconfig import config_hash, run_document
from training.config import MUON_ONLY, NODE_ONLY_TRAINING, TrainingConfig
from training.errors import PlatformError, ReplicaStateError, TrainingConfigError
from training.fingerprint import (
    CROSS_PLATFORM_TOLERANCE,
    EXACT,
    MISMATCH,
    RULE_CROSS_PLATFORM,
    RULE_SAME_PLATFORM,
    RULE_UNRECORDED,
    TOLERANCE_PASS_BOUND,
    UNDECIDED,
    WITHIN_TOLERANCE,
    compare_rerun,
    fingerprint,
    parse_fingerprint,
)
from training.pipeline_group import pipeline_backend
from training.platform import resolve_device
from training.replica_state import (
    STATE_MAGIC,
    RoundMeta,
    StageStartState,
    parse_stage_state,
)

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(),
                                   reason="checks the refusal on a machine without CUDA")

# ----------------------------------------------------------------------------- settings


@pytest.mark.parametrize("spec, normal", [("auto", "auto"), ("CPU", "cpu"), ("cuda", "cuda"),
                                          (" cuda:1 ", "cuda:1"), ("cuda:07", "cuda:7")])
def test_device_setting_is_normalised(spec, normal):
    assert TrainingConfig(device=spec).device == normal


@pytest.mark.parametrize("field, value, message", [
    ("device", "gpu", 'training.device=\'gpu\': must be "auto", "cpu", "cuda" or "cuda:N"'),
    ("device", "cuda:", "training.device='cuda:'"),
    ("device", "cuda:-1", "training.device='cuda:-1'"),
    ("device", 3, "training.device=3: must be a string"),
    ("precision", "fp16", "training.precision='fp16': must be one of ['fp32', 'bf16']"),
    ("precision", "BF16", "training.precision='BF16'"),
])
def test_bad_device_or_precision_is_refused_by_name(field, value, message):
    with pytest.raises(TrainingConfigError) as caught:
        TrainingConfig(**{field: value})
    assert message in str(caught.value)


def test_node_toml_reads_device_and_precision(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text('[training]\ndevice = "cpu"\nprecision = "bf16"\n')
    cfg = load_config(path)
    assert (cfg.training.device, cfg.training.precision) == ("cpu", "bf16")
    with pytest.raises(TrainingConfigError, match="training.precision='half'"):
        load_config(path, ["training.precision=half"])


def test_device_and_precision_are_not_in_the_run_document():
    default = load_config(None, [])
    other = load_config(None, ["training.device=cuda:3", "training.precision=bf16"])
    assert config_hash(run_document(default)) == config_hash(run_document(other))
    assert not set(NODE_ONLY_TRAINING) & set(run_document(other)["training"])
    # Everything else of [training] is still there (the hash of every existing run is unchanged) ...
    # (An AdamW run's table omits the inner optimizer's settings: it is what it was before they existed; a run
    # without training.reproducible omits that setting too, and one of kernel version 1 the version; a run
    # drawn by replica index omits training.data_windows, and one that carries its inner state inner_state.)
    names = {f.name for f in dataclasses.fields(TrainingConfig)} - {"data_path", "reproducible_kernels",
                                                                    "data_windows", "inner_state",
                                                                    *NODE_ONLY_TRAINING}
    adamw = load_config(None, ["training.optimizer=adamw"])
    assert set(run_document(adamw)["training"]) == names - {"optimizer", "reproducible", *MUON_ONLY} | {
        "data_sha256"}
    # AdamW, the default
    assert set(run_document(default)["training"]) == set(run_document(adamw)["training"])
    muon = load_config(None, ["training.optimizer=muon"])
    assert set(run_document(muon)["training"]) == names - {"reproducible"} | {"data_sha256"}
    reproducible = load_config(None, ["training.reproducible=true"])
    assert set(run_document(reproducible)["training"]) == names - {"optimizer", *MUON_ONLY} | {
        "data_sha256", "reproducible_kernels"}  # a new reproducible run: kernel version 2, recorded
    # ... and still pins the run: a run setting changes it.
    assert config_hash(run_document(load_config(None, ["training.seed=1"]))) \
        != config_hash(run_document(default))


# ----------------------------------------------------------------------------- device


def test_auto_is_the_cpu_without_cuda():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu") == torch.device("cpu")


@needs_no_cuda
@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "cuda:5"])
def test_cuda_without_cuda_is_a_clear_error(spec):
    with pytest.raises(PlatformError, match=rf"training.device='{spec}': .*use \"cpu\" or \"auto\""):
        resolve_device(spec)


@needs_no_cuda
def test_pipeline_backend_is_gloo_without_cuda():
    assert pipeline_backend() == "gloo"


# ----------------------------------------------------------------------------- fingerprint


def test_cpu_fingerprint_names_the_cpu_and_the_libraries():
    fp = fingerprint(torch.device("cpu"), "bf16")
    assert fp.device_type == "cpu" and fp.precision == "bf16" and fp.torch == torch.__version__
    assert fp.capability == torch.backends.cpu.get_cpu_capability() and fp.device_name
    assert (fp.cuda, fp.cudnn, fp.tf32) == ("", "", False)
    assert fp.deterministic == torch.are_deterministic_algorithms_enabled()
    assert parse_fingerprint(json.loads(json.dumps(fp.document()))) == fp


@pytest.mark.parametrize("change", [
    lambda d: d.update(extra="x"),
    lambda d: d.pop("cudnn"),
    lambda d: d.update(deterministic="yes"),
    lambda d: d.update(torch=7),
    lambda d: d.update(device_name="x" * 201),
    lambda d: d.update(device_type="tpu"),
    lambda d: d.update(precision="fp16"),
])
def test_malformed_fingerprint_is_refused(change):
    document = fingerprint(torch.device("cpu"), "fp32").document()
    change(document)
    with pytest.raises(PlatformError):
        parse_fingerprint(document)
    with pytest.raises(PlatformError):
        parse_fingerprint([document])


# ----------------------------------------------------------------------------- start state bytes


def _part(platform=None) -> StageStartState:
    meta = RoundMeta(outer_round=2, replica=1, num_stages=1, inner_steps=3, lr_total_steps=9, threads=1,
                     micro_batches=0, platform=platform)
    return StageStartState(meta, 0, (2, 1, -1),
                           {"param/w": torch.arange(6, dtype=torch.float32).reshape(2, 3)})


def test_state_without_fingerprint_keeps_the_bytes_of_before():
    """A start state that records no platform is byte for byte the version-1 layout (hashes of old runs
    hold)."""
    data = _part().to_bytes()
    assert data.startswith(STATE_MAGIC)
    (length,) = struct.unpack("<I", data[len(STATE_MAGIC):len(STATE_MAGIC) + 4])
    header = data[len(STATE_MAGIC) + 4:len(STATE_MAGIC) + 4 + length]
    assert header == (b'{"engine":[2,1,-1],"meta":{"inner_steps":3,"lr_total_steps":9,"micro_batches":0,'
                      b'"num_stages":1,"outer_round":2,"replica":1,"threads":1},"stage":0,"v":1}')
    assert parse_stage_state(data).meta.platform is None


def test_state_with_fingerprint_is_version_2_and_round_trips():
    fp = fingerprint(torch.device("cpu"), "bf16")
    part = _part(fp)
    parsed = parse_stage_state(part.to_bytes())
    assert parsed.meta.platform == fp and parsed.state_hash() == part.state_hash()
    assert b'"v":2' in part.to_bytes()[:400]
    # The fingerprint is bound: another platform (here: the precision) is another state hash.
    assert _part(dataclasses.replace(fp, precision="fp32")).state_hash() != part.state_hash()
    assert _part().state_hash() != part.state_hash()


def _with_header(data: bytes, edit) -> bytes:
    start = len(STATE_MAGIC)
    (length,) = struct.unpack("<I", data[start:start + 4])
    header = json.loads(data[start + 4:start + 4 + length])
    edit(header)
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return data[:start] + struct.pack("<I", len(raw)) + raw + data[start + 4 + length:]


@pytest.mark.parametrize("edit", [
    lambda h: h.update(v=1),  # a platform under the version-1 header
    lambda h: h.pop("platform"),  # version 2 without one
    lambda h: h["platform"].update(precision="fp8"),
    lambda h: h["meta"].update(platform={}),
    lambda h: h.update(v=3),
])
def test_state_header_with_a_misplaced_or_bad_fingerprint_is_refused(edit):
    data = _part(fingerprint(torch.device("cpu"), "fp32")).to_bytes()
    with pytest.raises(ReplicaStateError):
        parse_stage_state(_with_header(data, edit))


# ----------------------------------------------------------------------------- the rule


CPU32 = fingerprint(torch.device("cpu"), "fp32")
CPU16 = dataclasses.replace(CPU32, precision="bf16")
H100 = dataclasses.replace(CPU16, device_type="cuda", device_name="NVIDIA H100 80GB HBM3", capability="sm_90",
                           cuda="12.8", cudnn="91002", deterministic=True, cudnn_deterministic=True)


def test_same_platform_demands_bit_exact():
    exact = compare_rerun(CPU32, CPU32, 0.0, claimed_threads=2, rerun_threads=2)
    assert (exact.verdict, exact.rule, exact.tolerance) == (EXACT, RULE_SAME_PLATFORM, 0.0)
    tiny = compare_rerun(CPU32, CPU32, 1e-9, claimed_threads=2, rerun_threads=2)
    assert (tiny.verdict, tiny.rule) == (MISMATCH, RULE_SAME_PLATFORM)
    assert "bit-exact rerun demanded" in tiny.reason


def test_another_platform_or_thread_count_gets_the_three_zones_of_the_precision():
    """Passed up to the pass bound, a mismatch beyond the cross-platform tolerance, undecided between."""
    threads = compare_rerun(CPU32, CPU32, 5e-5, claimed_threads=1, rerun_threads=2)
    assert (threads.verdict, threads.rule, threads.tolerance, threads.pass_bound) == (
        WITHIN_TOLERANCE, RULE_CROSS_PLATFORM, CROSS_PLATFORM_TOLERANCE["fp32"], TOLERANCE_PASS_BOUND["fp32"])
    between = compare_rerun(CPU32, CPU32, 1e-3, claimed_threads=1, rerun_threads=2)
    assert between.verdict == UNDECIDED and "needs a verifier of the claimant's platform" in between.reason
    far32 = compare_rerun(CPU32, CPU32, 2 * CROSS_PLATFORM_TOLERANCE["fp32"], claimed_threads=1,
                          rerun_threads=2)
    assert far32.verdict == MISMATCH and "mismatch beyond" in far32.reason
    # bf16: passed or undecided, never a mismatch on another platform, however far (the honest H200 <-> CPU
    # distance reaches 0.159: bench/results/gpu_calibration.json).
    gpu = compare_rerun(H100, CPU16, TOLERANCE_PASS_BOUND["bf16"], claimed_threads=1, rerun_threads=1)
    assert (gpu.verdict, gpu.rule) == (WITHIN_TOLERANCE, RULE_CROSS_PLATFORM)
    assert "H100" in gpu.reason and "never a mismatch across platforms" in gpu.reason
    for distance in (1e-3, 0.159, 1.0):
        far = compare_rerun(H100, CPU16, distance, claimed_threads=1, rerun_threads=1)
        assert far.verdict == UNDECIDED and "needs a verifier of the claimant's platform" in far.reason
    # On the claimant's own platform a bf16 rerun must still give the same bits.
    assert compare_rerun(H100, H100, 1e-9, claimed_threads=1, rerun_threads=1).verdict == MISMATCH
    assert compare_rerun(H100, CPU16, 0.0, claimed_threads=1, rerun_threads=1).verdict == EXACT
    # A library version or a flag is enough to make it another platform.
    flagged = dataclasses.replace(CPU32, deterministic=not CPU32.deterministic)
    assert compare_rerun(flagged, CPU32, 1e-3, claimed_threads=1, rerun_threads=1).rule == RULE_CROSS_PLATFORM
    override = compare_rerun(H100, CPU16, 1e-3, claimed_threads=1, rerun_threads=1, tolerance=1e-4)
    assert (override.verdict, override.tolerance) == (MISMATCH, 1e-4)


def test_state_without_fingerprint_gets_the_float32_zones():
    legacy = compare_rerun(None, CPU32, 5e-5, claimed_threads=1, rerun_threads=1)
    assert (legacy.verdict, legacy.rule, legacy.tolerance) == (
        WITHIN_TOLERANCE, RULE_UNRECORDED, CROSS_PLATFORM_TOLERANCE["fp32"])
    assert compare_rerun(None, CPU32, 5e-3, claimed_threads=1, rerun_threads=1).verdict == UNDECIDED


def test_the_zones_fit_the_calibration():
    """From bench/results/gpu_calibration.json (claimants on a CPU and a GPU, reruns on the other device and
    thread count): the pass bound lies below every 1% cheat, so claiming another platform never passes one;
    no honest rerun on another platform is a mismatch, so nobody honest is accused; and the float32 mismatch
    bound lies below the 1%-perturbation cheat of bench/results/reexec.json (4.9e-2 and more)."""
    assert set(CROSS_PLATFORM_TOLERANCE) == {"fp32", "bf16"} == set(TOLERANCE_PASS_BOUND)
    assert 0 < CROSS_PLATFORM_TOLERANCE["fp32"] < 4.9e-2
    calibration = json.loads(
        (Path(__file__).parent.parent / "bench/results/gpu_calibration.json").read_text())
    assert {"cpu", "cuda"} <= set(calibration["summary"]["bf16"]["measured_devices"])
    for precision, bound in TOLERANCE_PASS_BOUND.items():
        assert 0 < bound < calibration["summary"][precision]["cheat_min"]
        honest = [r["distance"] for r in calibration["rows"]
                  if r["precision"] == precision and r["role"] == "honest"
                  and r["rerun"] in ("threads", "device")]
        assert honest and max(honest) <= CROSS_PLATFORM_TOLERANCE[precision]


# ----------------------------------------------------------------------------- the node's path


def test_preparing_the_cpu_changes_no_process_flag():
    """float32 CPU runs keep their bits: on the CPU the platform set-up touches no torch setting."""
    from training.platform import prepare_platform

    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
              torch.backends.cuda.matmul.allow_tf32, torch.get_num_threads())
    platform = prepare_platform("cpu", "fp32")
    assert platform.device == torch.device("cpu") and platform.precision == "fp32"
    assert (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
            torch.backends.cuda.matmul.allow_tf32, torch.get_num_threads()) == before


def test_round_meta_records_the_platform_the_trainer_was_built_for():
    """What a live node records (node.live.worker.replica calls round_meta without a platform)."""
    from training.config import DilocoConfig, ModelConfig
    from training.pipeline import LocalReplicaTrainer
    from training.reexec import round_meta

    model = ModelConfig(preset="llama-tiny")
    for precision in ("bf16", "fp32"):
        LocalReplicaTrainer(model, TrainingConfig(device="cpu", precision=precision), 1)
        meta = round_meta(0, 0, model, DilocoConfig(inner_steps=2), run_rounds=1, num_stages=1)
        assert meta.platform == fingerprint(torch.device("cpu"), precision)
