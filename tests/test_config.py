"""Configuration loading: every shipped file loads; bad values name the field."""

from pathlib import Path

import pytest

from node.config import config_from_dict, dump_toml, load_config
from node.errors import CONFIG_ERRORS

ROOT = Path(__file__).resolve().parents[1]


#: Where the project keeps the node configs it ships. Only these are collected: a user's own
#: files (``dlx-node demo`` writes node configs under ``./dlx-demo``) must not change the suite.
SHIPPED_CONFIG_DIRS = ("node/templates",)


def shipped_configs() -> list[Path]:
    return sorted(p for d in SHIPPED_CONFIG_DIRS for p in (ROOT / d).glob("*.toml"))


def test_project_ships_config_files():
    assert shipped_configs(), "the project must ship at least one node config"


@pytest.mark.parametrize("path", shipped_configs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert cfg.model.n_layer >= cfg.pipeline.num_stages


def test_defaults_and_presets_fill_sizes():
    cfg = load_config(None)
    assert cfg.model.preset == "tiny" and cfg.model.n_embd > 0 and cfg.model.n_embd % cfg.model.n_head == 0


def test_the_template_runs_the_benchmarks_setting_and_auto_values_round_trip(tmp_path):
    cfg = load_config(ROOT / "node/templates/node.toml")
    assert cfg.diloco.inner_steps == 50 and cfg.diloco.overlap_steps == "auto" and cfg.diloco.overlap == 5
    assert cfg.compression.bandwidth_budget == "auto" and cfg.compression.target_reduction == 1000.0
    assert cfg.diloco.commitments == "normed"  # secure by default: its clip scales provable on chain
    set_ = load_config(None, ["diloco.overlap_steps=3", "compression.bandwidth_budget=12000"])
    assert set_.diloco.overlap_steps == 3 and set_.compression.bandwidth_budget == 12_000
    path = tmp_path / "node.toml"
    path.write_text(dump_toml(cfg.to_dict()))  # what the local launcher writes
    again = load_config(path)
    assert again.diloco.overlap_steps == "auto" and again.compression.bandwidth_budget == "auto"
    for bad in ("diloco.overlap_steps=lots", "diloco.overlap_steps=50", "compression.bandwidth_budget=-5"):
        with pytest.raises(CONFIG_ERRORS, match=bad.split("=")[0]):
            load_config(None, [bad])


def test_overrides_are_typed(tmp_path):
    cfg = load_config(None, ["diloco.inner_steps=7", "compression.enabled=false", "rounds=3",
                             "compression.bit_choices=8,4", "p2p.rate_limit_bps=1.25e8"])
    assert cfg.diloco.inner_steps == 7 and cfg.compression.enabled is False and cfg.rounds == 3
    assert cfg.compression.bit_choices == [4, 8] and cfg.p2p.rate_limit_bps == 1.25e8


@pytest.mark.parametrize(
    "override, field",
    [
        ("diloco.inner_steps=0", "diloco.inner_steps=0"),
        ("diloco.inner_steps=abc", "diloco.inner_steps='abc'"),
        ("model.preset=huge", "model.preset='huge'"),
        ("pipeline.num_stages=9", "pipeline.num_stages=9"),
        ("quorum=5", "quorum=5"),
        ("cluster_size=3", "cluster_size=3"),
        ("ledger.backend=ganache", "ledger.backend='ganache'"),
        ("p2p.bootstrap=/ip4/1.2.3.4/tcp/1", "p2p.bootstrap entry"),
        ("diloco.nope=1", "diloco.nope: unknown setting"),
        ("nonsense", "expected KEY=VALUE"),
        ("diloco.delay_correction=sideways", "diloco.delay_correction='sideways'"),
    ],
)
def test_bad_values_name_the_field(override, field):
    with pytest.raises(CONFIG_ERRORS) as info:
        load_config(None, [override])
    assert field in str(info.value)


def test_bad_files_give_specific_errors(tmp_path):
    with pytest.raises(CONFIG_ERRORS, match="not found"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[diloco\ninner_steps = 3\n")
    with pytest.raises(CONFIG_ERRORS, match="not valid TOML"):
        load_config(bad)
    wrong_type = tmp_path / "wrong.toml"
    wrong_type.write_text("diloco = 3\n")
    with pytest.raises(CONFIG_ERRORS, match=r"\[diloco\] must be a table"):
        load_config(wrong_type)


def test_round_trip_through_toml(tmp_path):
    cfg = load_config(None, ["diloco.inner_steps=5", "run_name=x"])
    path = tmp_path / "node.toml"
    path.write_text(dump_toml(cfg.to_dict()))
    again = load_config(path)
    assert again == cfg
    assert config_from_dict(cfg.to_dict()) == cfg
