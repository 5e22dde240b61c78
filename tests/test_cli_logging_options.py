"""Issue 80 point 7: the logging options work after the command's name too (``dlx-node run-info LINK
--log-file F`` as ``dlx-node --log-file F run-info LINK``, where it was "unrecognized arguments"), through the
real command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BAD_LINK = "dlx://bad"


@pytest.mark.parametrize("where", ["before", "after"])
def test_log_file_before_or_after_the_command_gets_the_commands_error(tmp_path, where):
    log = tmp_path / "node.log"
    options = ["--log-file", str(log), "--log-level", "info"]
    argv = [*options, "run-info", BAD_LINK] if where == "before" else ["run-info", BAD_LINK, *options]
    proc = subprocess.run([sys.executable, "-m", "node.cli", *argv], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                          check=False)
    assert proc.returncode == 2, proc.stderr
    assert "unrecognized arguments" not in proc.stderr
    assert f"run link {BAD_LINK!r}" in proc.stderr.strip().splitlines()[-1]  # the command's own refusal
    assert log.exists()  # the file handler was set up from the option


def test_a_nested_commands_logging_options_do_not_clash_with_its_own(tmp_path):
    from node.cli import parse_command_line
    from node.commands.parsers import build_parser

    args = parse_command_line(build_parser(), ["data", "fetch", "tinyshakespeare", "--log-level", "debug",
                                               "--log-json"])
    assert (args.log_level, args.log_json, args.log_file) == ("debug", True, None)
    args = parse_command_line(build_parser(), ["--log-level", "warning", "status"])
    assert (args.log_level, args.log_json, args.log_file) == ("warning", False, None)
