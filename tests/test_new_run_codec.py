"""New runs' codec (issue 66's fifth and sixth passes: docs/DILOCOX.md section 14): ``dlx-node init``'s
node.toml and ``dlx-node demo`` set encoder "v2", clipped low-bit scales ("mse") and no error feedback; a
run document made before keeps its meaning (the encoder it names, "max" scales, feedback on) and its config
hash, and the codec's own defaults (``CompressionConfig()``, a configuration that names none) stay."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from test_muon import BEFORE_MUON_DEFAULT, HONEST, PERTURBED, ROUNDS, _records

from node.cli import build_parser, parse_command_line
from node.commands.demo import _demo_settings
from node.config import load_config
from node.runconfig import canonical_json, config_hash, node_config_from_run, parse_run_document, run_document
from tests.rerun_fixtures import assert_honest_exact_and_cheat_caught, rerun_checker
from training.config_compression import (
    LEGACY_ERROR_FEEDBACK,
    NEW_RUN_COMPRESSION,
    CompressionConfig,
    new_run_compression_settings,
)
from training.data import generated_corpus
from training.reexec_sim import PerturbedReplica, SimConfig, SimReplica

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "node" / "templates" / "node.toml"


def test_the_template_sets_the_new_run_codec_and_its_run_document_names_it():
    assert NEW_RUN_COMPRESSION == {"encoder": "v2", "quant_scale": "mse", "error_feedback": False}
    assert NEW_RUN_COMPRESSION["error_feedback"] is False and LEGACY_ERROR_FEEDBACK is True
    table = tomllib.loads(TEMPLATE.read_text())["compression"]
    assert {key: table[key] for key in NEW_RUN_COMPRESSION} == NEW_RUN_COMPRESSION
    cfg = load_config(TEMPLATE)
    assert {key: getattr(cfg.compression, key) for key in NEW_RUN_COMPRESSION} == NEW_RUN_COMPRESSION
    document = run_document(cfg)
    assert {key: document["compression"][key] for key in NEW_RUN_COMPRESSION} == NEW_RUN_COMPRESSION
    parsed = parse_run_document(canonical_json(document), config_hash(document))  # a joiner's read
    joined = node_config_from_run(parsed).compression
    assert {key: getattr(joined, key) for key in NEW_RUN_COMPRESSION} == NEW_RUN_COMPRESSION
    # The codec's defaults, and a configuration that names none (the launcher's, the benchmarks'), stay.
    for codec in (CompressionConfig(), load_config(None).compression):
        assert (codec.encoder, codec.quant_scale, codec.error_feedback) == ("v4", "max", True)


def test_the_demo_sets_the_new_run_codec_and_set_overrides_it(tmp_path):
    def codec(*extra: str) -> tuple:
        args = parse_command_line(build_parser(), ["demo", "--out", str(tmp_path / "out"), *extra])
        settings, _ = _demo_settings(args)
        compression = load_config(None, settings).compression
        return compression.encoder, compression.quant_scale, compression.error_feedback

    assert codec() == ("v2", "mse", False)
    assert codec("--set", "compression.error_feedback=true") == ("v2", "mse", True)
    assert codec("--set", "compression.encoder=v4", "--set", "compression.quant_scale=max") == (
        "v4", "max", False)
    assert new_run_compression_settings() == ["compression.encoder=v2", "compression.quant_scale=mse",
                                              "compression.error_feedback=false"]


@pytest.mark.parametrize("settings", list(BEFORE_MUON_DEFAULT))
def test_an_older_run_document_keeps_its_hash_and_its_meaning(settings):
    # A run made before the change: its settings named no error feedback, so it ran with it on.
    older = run_document(load_config(None, [*settings, "diloco.commitments=hashed"]))
    assert older["compression"]["error_feedback"] is True
    assert config_hash(older).hex() == BEFORE_MUON_DEFAULT[settings]
    again = node_config_from_run(parse_run_document(canonical_json(older), config_hash(older)))
    assert again.compression.error_feedback is True and config_hash(run_document(again)) == config_hash(older)
    # A document without the field (none was written so: the table always names it) reads as on.
    bare = {**older, "compression": {k: v for k, v in older["compression"].items() if k != "error_feedback"}}
    assert node_config_from_run(bare).compression.error_feedback is True
    assert again.compression.quant_scale == "max" and "quant_scale" not in older["compression"]
    # The same run made with the new defaults is another run, with another hash.
    new = run_document(load_config(None, [*settings, "diloco.commitments=hashed",
                                          *new_run_compression_settings()]))
    assert new["compression"]["error_feedback"] is False and config_hash(new) != config_hash(older)
    assert (new["compression"]["encoder"], new["compression"]["quant_scale"]) == ("v2", "mse")
    again = node_config_from_run(new).compression
    assert (again.encoder, again.quant_scale, again.error_feedback) == ("v2", "mse", False)


def test_a_contribution_of_the_new_run_codec_reruns_bit_exactly_and_a_cheat_does_not():
    """A new run's codec (AdamW, the default inner optimizer; encoder v2, clipped scales, feedback off) under
    the configuration rebuilt from its run document: the spot check's rerun gives the same bits (no residual
    to replay), a 1% cheat does not."""
    overrides = ["model.preset=tiny", "training.seed=3", "training.batch_size=4", "training.warmup_steps=2",
                 "diloco.inner_steps=3", "diloco.num_replicas=2", "compression.min_compress_numel=512",
                 *new_run_compression_settings()]
    cfg = node_config_from_run(run_document(load_config(None, overrides)))
    assert (cfg.compression.encoder, cfg.compression.quant_scale, cfg.compression.error_feedback) == (
        "v2", "mse", False)
    sim = SimConfig(corpus=generated_corpus(seed=0, n_bytes=30_000), model=cfg.model, training=cfg.training,
                    diloco=cfg.diloco, compression=cfg.compression, num_stages=2, rounds=ROUNDS)
    records = _records(sim, SimReplica, PerturbedReplica)
    check = rerun_checker(sim, records, {})
    assert_honest_exact_and_cheat_caught(check, records, HONEST, PERTURBED, ROUNDS)


@pytest.mark.parametrize("bad", ["yes", 2, None, [True]])
def test_a_run_document_with_a_hostile_error_feedback_is_refused_by_name(bad):
    """A run document from the chain or a file naming error_feedback as anything but a boolean is refused
    with the setting's name, not read as on or off."""
    from node.errors import ConfigError

    document = run_document(load_config(None, ["model.preset=tiny"]))
    document["compression"] = {**document["compression"], "error_feedback": bad}
    with pytest.raises(ConfigError, match="compression.error_feedback"):
        node_config_from_run(document)


@pytest.mark.parametrize("key, bad", [("quant_scale", "MSE"), ("quant_scale", 1), ("quant_scale", None),
                                      ("encoder", "v9"), ("encoder", 2)])
def test_a_run_document_with_a_hostile_codec_setting_is_refused_by_name(key, bad):
    """Refused with the setting's name (a ConfigError for a value of the wrong type, the codec's
    TrainingConfigError for an unknown one: both ValueErrors, which a joiner's read reports)."""
    document = run_document(load_config(None, ["model.preset=tiny", *new_run_compression_settings()]))
    document["compression"] = {**document["compression"], key: bad}
    with pytest.raises(ValueError, match=f"compression.{key}"):
        node_config_from_run(document)
