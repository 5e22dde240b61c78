"""Issue 80 point 5, each through the real ``dlx-node`` command: an end of input (Ctrl-D) at a ``[y/N]``
prompt is a no, said in one line without a traceback, and nothing is sent; an RPC URL that answers plain
HTTP (a web server, a wrong port) is a usage error naming the URL, not a raw "501 Server Error"."""

from __future__ import annotations

import http.server
import os
import pty
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from ledger_fixtures import fresh_anvil_w3

from ledger.account import dev_account

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "node.cli"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.fixture
def plain_http():
    """A plain HTTP server on 127.0.0.1 (GET only: a POST gets 501), its URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_an_rpc_url_that_answers_plain_http_is_a_usage_error_naming_it(plain_http, tmp_path):
    proc = subprocess.run([*CLI, "deploy", "--rpc", plain_http, "--dev-account", "8", "--yes", "--out",
                           str(tmp_path / "deployment.json")], capture_output=True, text=True, timeout=120,
                          env=_env(), cwd=tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert f"rpc url {plain_http}: it answers, but not as an Ethereum JSON-RPC endpoint" in last
    assert "check the host and port" in last
    assert not (tmp_path / "deployment.json").exists()


def _run_on_a_terminal(command: list[str], cwd: Path, answer: bytes,
                       timeout: float = 240.0) -> tuple[int, str]:
    """Run ``command`` on a pseudo-terminal (stdin, stdout and stderr: Python writes an interactive prompt to
    stderr); send ``answer`` once it asks ``[y/N]``. Its exit code and everything it wrote."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(command, stdin=slave, stdout=slave, stderr=slave, env=_env(), cwd=cwd)
    os.close(slave)
    seen, answered, deadline = b"", False, time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(master, 4096)
                except OSError:  # the child exited and closed the terminal
                    break
                if not chunk:
                    break
                seen += chunk
            elif proc.poll() is not None:
                break
            if not answered and b"[y/N]" in seen:
                os.write(master, answer)
                answered = True
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    text = seen.decode(errors="replace")
    assert answered, text
    return code, text


def test_ctrl_d_at_the_prompt_is_a_no_without_a_traceback_and_sends_nothing(request, tmp_path):
    w3 = fresh_anvil_w3(request, timeout=10.0)
    account = dev_account(8, w3.eth.chain_id).address
    nonce = w3.eth.get_transaction_count(account)
    out = tmp_path / "deployment.json"
    code, err = _run_on_a_terminal([*CLI, "deploy", "--rpc", w3.provider.endpoint_uri, "--dev-account", "8",
                                    "--out", str(out)], tmp_path, b"\x04")  # Ctrl-D: the end of input
    assert "Traceback" not in err and "EOFError" not in err, err
    assert code == 2, err
    assert "the transactions were declined (nothing was sent)" in err.strip().splitlines()[-1]
    assert not out.exists() and w3.eth.get_transaction_count(account) == nonce
