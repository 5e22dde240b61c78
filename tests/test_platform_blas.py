"""The math libraries' code path is part of the platform (issue 42, "find every other place that differs").

torch's CPU matrix products go to MKL, which picks its code path once per process from the CPU or from the
environment (``MKL_CBWR``, ``MKL_ENABLE_INSTRUCTIONS``; oneDNN's ``ONEDNN_MAX_CPU_ISA``, ...). On the AMD
EPYC of these sessions ``MKL_CBWR=COMPATIBLE`` gives other sgemm bits than MKL's own dispatch. Before the
fingerprint recorded it, an honest member started with such a setting and a verifier of the same CPU model
without it had equal fingerprints, so the rerun was held to bit-exactness it could not give: the honest
member was a "mismatch". Now the setting is in the fingerprint (left out when none is set, so nothing
recorded before changes), and a verifier of the same CPU model reruns the claim in a child with the
claimant's setting, bit-exact demanded.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from training.declaration import platform_declaration, platform_hash
from training.errors import PlatformError
from training.fingerprint import (
    BLAS_DISPATCH_ENV, EXACT, RULE_CROSS_PLATFORM, blas_dispatch, fingerprint,
    parse_fingerprint,
)
from training.claimant_kernels import emulated_environment, kernels_to_emulate

ROOT = Path(__file__).resolve().parents[1]
CLAIMANT = ROOT / "tests" / "blas_claimant.py"


def here(**changes):
    return dataclasses.replace(fingerprint(torch.device("cpu"), "fp32"), **({"blas": ""} | changes))


def test_no_setting_leaves_every_recorded_byte_as_it_was():
    plain = here()
    assert "blas" not in plain.document()
    assert parse_fingerprint(plain.document()) == plain
    # a fingerprint document of before the field (the same keys) still parses, and declares the same way
    with_setting = dataclasses.replace(plain, blas="MKL_CBWR=COMPATIBLE")
    assert with_setting.document()["blas"] == "MKL_CBWR=COMPATIBLE"
    assert parse_fingerprint(with_setting.document()) == with_setting
    assert platform_hash(with_setting) != platform_hash(plain)
    assert platform_declaration(with_setting)[:31] != platform_declaration(plain)[:31]


def test_the_setting_is_read_from_the_environment_in_one_canonical_form():
    assert blas_dispatch({}) == ""
    assert blas_dispatch({"MKL_CBWR": " COMPATIBLE ", "PATH": "/bin"}) == "MKL_CBWR=COMPATIBLE"
    assert blas_dispatch({"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_CBWR": "AVX2,STRICT"}) == \
        "MKL_CBWR=AVX2,STRICT;ONEDNN_MAX_CPU_ISA=AVX2"
    assert blas_dispatch({"MKL_CBWR": "BRANCH=AVX2"}) == "MKL_CBWR=BRANCH=AVX2"
    with pytest.raises(PlatformError, match="MKL_CBWR"):
        blas_dispatch({"MKL_CBWR": "AVX2 STRICT"})
    with pytest.raises(PlatformError, match="exceed"):
        blas_dispatch({name: "X" * 40 for name in BLAS_DISPATCH_ENV})


@pytest.mark.parametrize("blas, why", [
    ("", "leaving blas out"),
    ("PATH=/bin", "not NAME=value"),
    ("MKL_CBWR", "not NAME=value"),
    ("MKL_CBWR=", "not NAME=value"),
    ("MKL_CBWR=A B", "not NAME=value"),
    ("MKL_CBWR=A;MKL_CBWR=B", "not NAME=value"),
    ("ONEDNN_MAX_CPU_ISA=AVX2;MKL_CBWR=AVX2", "canonical"),
    (7, "string"),
])
def test_a_recorded_setting_no_node_writes_is_refused(blas, why):
    document = here().document() | {"blas": blas}
    with pytest.raises(PlatformError, match=why):
        parse_fingerprint(document)


def test_a_verifier_of_the_same_cpu_model_reruns_under_the_claimants_setting():
    claim = here(blas="MKL_CBWR=COMPATIBLE")
    settings = kernels_to_emulate(claim, here())
    assert settings == dict.fromkeys(BLAS_DISPATCH_ENV) | {"MKL_CBWR": "COMPATIBLE"}
    env = emulated_environment(settings, {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "HOME": "/root"})
    assert env == {"MKL_CBWR": "COMPATIBLE", "HOME": "/root"}
    # a verifier with a setting reruns a claim made without one with none
    assert kernels_to_emulate(here(), claim) == dict.fromkeys(BLAS_DISPATCH_ENV)
    # another instruction set as well: both
    lower = dataclasses.replace(claim, capability="DEFAULT")
    assert kernels_to_emulate(lower, here(capability="AVX2"))["ATEN_CPU_CAPABILITY"] == "default"
    # nothing to do, or nothing that can be done here
    assert kernels_to_emulate(claim, claim) is None
    assert kernels_to_emulate(claim, here(device_name="Other CPU")) is None
    assert kernels_to_emulate(claim, here(torch="0.0.0")) is None
    assert kernels_to_emulate(dataclasses.replace(claim, device_type="cuda"), here()) is None


@pytest.fixture(scope="module")
def claimant_round(tmp_path_factory) -> dict:
    """One round trained by a claimant process under ``MKL_CBWR=COMPATIBLE`` (the verifier here has none)."""
    out = tmp_path_factory.mktemp("blas") / "round.pkl"
    env = {k: v for k, v in os.environ.items() if k not in BLAS_DISPATCH_ENV}
    env.update(MKL_CBWR="COMPATIBLE", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(CLAIMANT), str(out)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return pickle.loads(out.read_bytes())


def test_an_honest_claim_under_another_math_library_path_is_rerun_exactly(claimant_round, monkeypatch):
    from node.config import load_config
    from node.tools.audit_reexec import rerun_by_rule
    from training.data import corpus_from_config
    from training.reexec import verify_contribution
    from training.replica_state import parse_stage_state

    sys.path.insert(0, str(ROOT / "tests"))
    from blas_claimant import OVERRIDES, THREADS

    for name in BLAS_DISPATCH_ENV:
        monkeypatch.delenv(name, raising=False)
    cfg = load_config(None, OVERRIDES)
    corpus = corpus_from_config(cfg.training, cfg.model)
    configs = (cfg.model, cfg.training, cfg.diloco, cfg.compression)
    for replica, parts in sorted(claimant_round["states"].items()):
        assert parse_stage_state(parts[0]).meta.platform.blas == "MKL_CBWR=COMPATIBLE"
        kwargs = dict(outer_round=claimant_round["round"], replica=replica, run_rounds=1, threads=THREADS)
        claims = claimant_round["claims"][replica]
        # here, under MKL's own dispatch: another platform, so never the bit-exact rule (that was the fault)
        direct = verify_contribution(parts, claims, corpus, *configs, **kwargs)
        assert direct.rule == RULE_CROSS_PLATFORM, direct.reason
        print(f"replica {replica}: rerun under MKL's own dispatch: {direct.verdict}, {direct.reason}")
        # MKL's path changed the bits: why the setting is in the platform
        if torch.backends.mkl.is_available():
            assert max(direct.distances.values()) > 0.0, direct.distances
        # under the platform rule: a child with the claimant's setting, bit-exact demanded and given
        judged = rerun_by_rule(parts, claims, corpus, *configs, **kwargs)
        assert judged.how == "emulated" and judged.verdict == EXACT, (judged.verdict, judged.reason)
