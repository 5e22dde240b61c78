"""New runs' error feedback (issue 66, fifth pass: docs/DILOCOX.md section 14): ``dlx-node init``'s node.toml
and ``dlx-node demo`` switch it off; a run document made before keeps its meaning (on) and its config hash,
and the codec's own default (``CompressionConfig()``, a configuration that names none) stays on."""

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
from training.config_compression import LEGACY_ERROR_FEEDBACK, NEW_RUN_ERROR_FEEDBACK, CompressionConfig
from training.data import generated_corpus
from training.reexec_sim import PerturbedReplica, SimConfig, SimReplica

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "node" / "templates" / "node.toml"


def test_the_template_switches_error_feedback_off_and_its_run_document_names_it():
    assert NEW_RUN_ERROR_FEEDBACK is False and LEGACY_ERROR_FEEDBACK is True
    assert tomllib.loads(TEMPLATE.read_text())["compression"]["error_feedback"] is False
    cfg = load_config(TEMPLATE)
    assert cfg.compression.error_feedback is False
    document = run_document(cfg)
    assert document["compression"]["error_feedback"] is False
    parsed = parse_run_document(canonical_json(document), config_hash(document))  # a joiner's read
    assert node_config_from_run(parsed).compression.error_feedback is False
    # The codec's default, and a configuration that names none (the launcher's, the benchmarks'), stay on.
    assert CompressionConfig().error_feedback is True and load_config(None).compression.error_feedback is True


def test_the_demo_switches_it_off_and_set_overrides_it(tmp_path):
    def feedback(*extra: str) -> bool:
        args = parse_command_line(build_parser(), ["demo", "--out", str(tmp_path / "out"), *extra])
        settings, _ = _demo_settings(args)
        return load_config(None, settings).compression.error_feedback

    assert feedback() is False
    assert feedback("--set", "compression.error_feedback=true") is True


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
    # The same run made with the new default is another run, with another hash.
    new = run_document(load_config(None, [*settings, "diloco.commitments=hashed",
                                          "compression.error_feedback=false"]))
    assert new["compression"]["error_feedback"] is False and config_hash(new) != config_hash(older)
    assert node_config_from_run(new).compression.error_feedback is False


def test_a_contribution_without_error_feedback_reruns_bit_exactly_and_a_cheat_does_not():
    """A new run's setting (AdamW, the default inner optimizer, feedback off) under the configuration rebuilt
    from its run document: the spot check's rerun gives the same bits (no residual to replay), a 1% cheat
    does not."""
    overrides = ["model.preset=tiny", "training.seed=3", "training.batch_size=4", "training.warmup_steps=2",
                 "diloco.inner_steps=3", "diloco.num_replicas=2", "compression.min_compress_numel=512",
                 "compression.error_feedback=false"]
    cfg = node_config_from_run(run_document(load_config(None, overrides)))
    assert cfg.compression.error_feedback is False
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
