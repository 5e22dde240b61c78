"""The properties that move money, for all inputs: halmos over contracts/forge/test/MoneySymbolic.t.sol.

halmos (pinned in scripts/analysis-requirements.txt, installed in .venv-analysis by scripts/setup.sh) builds
with forge through contracts/forge/solc and runs each ``check_`` function with symbolic arguments: a
withdrawal returns exactly the stake for any stake and any block from the unbonding's end; none succeeds
before it; a prover's call over an uncommitted round moves nothing. docs/TRUST.md says what is out of its
reach and why.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.test_static_analysis import NODE_BIN, REPO, analysis_tool


@pytest.mark.slow
def test_halmos_proves_the_money_properties_for_all_inputs():
    halmos = analysis_tool("halmos")
    if halmos is None or not (NODE_BIN / "forge").exists():
        pytest.fail("halmos or forge missing (a test dependency): run scripts/setup.sh")
    env = {**os.environ, "PATH": f"{NODE_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run([halmos, "--contract", "MoneySymbolicTest", "--function", "check_"],
                          cwd=REPO / "contracts" / "forge", env=env, capture_output=True, text=True,
                          timeout=1800, check=False)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert out.count("[PASS]") == 3 and "[FAIL]" not in out and "[TIMEOUT]" not in out, out[-4000:]
