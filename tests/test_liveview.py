"""The demo's live view: rows for humans (no -1 while a node joins), rich on a terminal, plain text
elsewhere."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap

from node.commands.liveview import LiveView, node_row, plain_table


def test_a_joining_node_shows_dashes_not_minus_one():
    row = node_row("r0n0", {"state": "joining", "round": -1, "step": 0, "inner_steps": 20,
                            "loss": float("nan"), "eval_loss": None, "bytes_sent": 0, "peers": 1,
                            "last_commit": -1}, None)
    assert row == ("r0n0", "joining", "-", "-", "-", "-", "0.00MB", "1", "-")
    assert "-1" not in " ".join(row)


def test_a_training_node_and_an_exited_one():
    status = {"state": "training", "round": 3, "step": 7, "inner_steps": 20, "loss": 2.34567,
              "eval_loss": 2.5, "bytes_sent": 1_234_567, "peers": 3, "last_commit": 2}
    assert node_row("r1", status, None) == ("r1", "training", "3", "7/20", "2.346", "2.500", "1.23MB", "3",
                                            "2")
    assert node_row("r1", status, 0)[1] == "exit 0"
    assert node_row("r2", {}, None) == ("r2", "starting", "-", "-", "-", "-", "-", "-", "-")


def test_plain_output_has_no_escape_codes():
    class Slot:
        def __init__(self, name, status):
            self.name, self._status = name, status
            self.process = subprocess.Popen([sys.executable, "-c", "pass"])
            self.process.wait()

        def status(self):
            return self._status

    class Run:
        nodes = [Slot("r0", {"state": "stopped", "round": 1, "last_commit": 1}), Slot("r1", {})]

    out = io.StringIO()
    view = LiveView(stream=out)
    view.tick(Run())
    view.tick(Run())  # within plain_every: nothing
    text = out.getvalue()
    assert "\x1b" not in text
    assert text.count("\n") == 4 and "exit 0" in text
    assert plain_table([], 0).startswith("t+0s")


def test_on_a_terminal_the_table_redraws_in_place_and_keeps_the_lines_above(tmp_path):
    # A real pseudo-terminal: rich must move the cursor up over its own table only, never clear the
    # screen (the demo's chain line is printed above the table).
    script = tmp_path / "view.py"
    script.write_text(textwrap.dedent("""
        import sys, types
        from node.commands.liveview import LiveView
        print("chain: the line above the table", flush=True)
        slot = types.SimpleNamespace(name="r0", process=None, status=dict)
        run = types.SimpleNamespace(nodes=[slot])
        view = LiveView(refresh_every=0.0)
        for _ in range(3):
            view.tick(run, force=True)
        view.close()
        print("after", flush=True)
    """))
    pid, fd = os.forkpty()
    if pid == 0:  # the child: the script on the pty
        os.execve(sys.executable, [sys.executable, str(script)],
                  dict(os.environ, TERM="xterm-256color", COLUMNS="100", LINES="30"))
    chunks = []
    while True:
        try:
            data = os.read(fd, 4096)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    _, status = os.waitpid(pid, 0)
    text = b"".join(chunks).decode(errors="replace")
    assert os.waitstatus_to_exitcode(status) == 0, text
    assert "chain: the line above the table" in text and "not started" in text and "after" in text
    assert "\x1b[2J" not in text and "\x1b[H\x1b[J" not in text  # no clear screen
    assert "\x1b[1A" in text or "\x1b[A" in text  # redrawn in place (cursor up over its own lines)
