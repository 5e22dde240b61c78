"""``dlx-node demo --set KEY=VALUE``: run and node settings of every node of the demo (issue 64: the demo in
the reproducible mode), checked before anything starts."""

from __future__ import annotations

import pytest

from node.cli import build_parser, parse_command_line
from node.commands.demo import run_demo
from node.errors import ConfigError
from training.config_base import TrainingConfigError


def demo_args(tmp_path, *extra: str):
    return parse_command_line(build_parser(), ["demo", "--out", str(tmp_path / "out"), *extra])


def test_set_reaches_the_settings_and_a_bad_one_is_refused_by_name(tmp_path):
    args = demo_args(tmp_path, "--set", "training.reproducible=true", "--set", "training.seed=3")
    assert args.overrides == ["training.reproducible=true", "training.seed=3"]
    with pytest.raises(ConfigError, match="training.no_such_setting"):
        run_demo(demo_args(tmp_path, "--stages", "1", "--set", "training.no_such_setting=1"))
    with pytest.raises(TrainingConfigError, match="training.reproducible_kernels=4"):
        run_demo(demo_args(tmp_path, "--stages", "1", "--set", "training.reproducible=true",
                           "--set", "training.reproducible_kernels=4"))
    assert not (tmp_path / "out").exists()  # refused before anything starts


def test_the_reproducible_mode_needs_one_process_per_replica(tmp_path):
    with pytest.raises(ConfigError, match="--stages 1"):
        run_demo(demo_args(tmp_path, "--stages", "2", "--set", "training.reproducible=true"))
    # Without the mode the same shape is the demo's default.
    assert demo_args(tmp_path).stages == 2 and demo_args(tmp_path).overrides == []
