"""CLI surface: --help is fast and torch-free; errors are one line with an exit code."""

import subprocess
import sys


def run_cli(*args, timeout=60, **kw):
    return subprocess.run([sys.executable, "-m", "node.cli", *args], capture_output=True, text=True,
                          timeout=timeout, **kw)


def test_help_does_not_import_torch():
    code = ("import sys; from node.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('torch', 'libp2p', 'web3') if m in sys.modules]\n"
            "assert not heavy, heavy")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "dlx-node" in proc.stdout


def test_start_with_missing_config_is_a_config_error(tmp_path):
    proc = run_cli("start", "--config", str(tmp_path / "none.toml"), cwd=tmp_path)
    assert proc.returncode == 2
    assert "not found" in proc.stderr and "dlx-node init" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_start_with_bad_value_is_a_config_error(tmp_path):
    (tmp_path / "node.toml").write_text("[diloco]\ninner_steps = -1\n")
    proc = run_cli("start", "--config", str(tmp_path / "node.toml"))
    assert proc.returncode == 2
    assert "diloco.inner_steps=-1" in proc.stderr
