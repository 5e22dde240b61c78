"""One default encoder everywhere (issue 29 item 2): init, demo, the launcher and the tests, the benchmark.

Every entry point that makes a run takes ``training.config.DEFAULT_ENCODER``;
a run document that names no encoder (a run made before the setting existed)
keeps ``LEGACY_ENCODER``, and one that names an encoder keeps it.
"""

import importlib.util
import sys
import tomllib
from pathlib import Path

import pytest

from node.config import load_config
from node.runconfig import canonical_json, config_hash, node_config_from_run, parse_run_document, run_document
from training.codec.registry import ENCODERS
from training.config import DEFAULT_ENCODER, LEGACY_ENCODER, EncoderVersion
from training.config_compression import CompressionConfig

ROOT = Path(__file__).resolve().parents[1]


def test_the_default_is_a_registered_encoder_and_the_dataclass_default():
    assert DEFAULT_ENCODER in ENCODERS and LEGACY_ENCODER in ENCODERS
    assert CompressionConfig().encoder == DEFAULT_ENCODER == "v4"


def test_init_writes_the_default():
    template = tomllib.loads((ROOT / "node/templates/node.toml").read_text())
    assert template["compression"]["encoder"] == DEFAULT_ENCODER
    assert load_config(ROOT / "node/templates/node.toml").compression.encoder == DEFAULT_ENCODER


def test_demo_and_launcher_runs_take_the_default_and_their_run_document_validates():
    # dlx-node demo and the launcher (so every end-to-end test) build the run from load_config(None, settings)
    # with settings that name no encoder (tests/test_demo.py checks the real demo's run document).
    settings = ["model.preset=tiny", "rounds=2", "diloco.inner_steps=4", "checkpoint_every=1",
                "round_timeout=120", "pipeline.num_stages=2", "diloco.num_replicas=2", "torch_threads=1"]
    cfg = load_config(None, settings)
    assert cfg.compression.encoder == DEFAULT_ENCODER
    document = run_document(cfg)
    assert document["compression"]["encoder"] == DEFAULT_ENCODER
    data = canonical_json(document)
    parsed = parse_run_document(data, config_hash(document))  # what a joiner and the audit check
    assert run_document(node_config_from_run(parsed)) == document


def test_a_run_document_keeps_the_encoder_it_names_and_one_naming_none_is_v1():
    document = run_document(load_config(None, ["model.preset=tiny"]))
    for version in EncoderVersion:
        named = {**document, "compression": {**document["compression"], "encoder": version.value}}
        assert node_config_from_run(named).compression.encoder == version
    legacy = {**document, "compression": {k: v for k, v in document["compression"].items() if k != "encoder"}}
    assert node_config_from_run(legacy).compression.encoder == LEGACY_ENCODER == "v1"


def test_the_benchmark_defaults_to_the_node_encoder(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_diloco_under_test", ROOT / "bench/bench_diloco.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", ["bench_diloco.py"])
    assert module.parse_args().encoder == DEFAULT_ENCODER


@pytest.mark.parametrize("version", [v.value for v in EncoderVersion])
def test_every_version_can_still_be_named(version):
    assert load_config(None, [f"compression.encoder={version}"]).compression.encoder == version
