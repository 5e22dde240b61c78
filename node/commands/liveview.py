"""The demo's live view of its nodes: one row per node, from each node's ``status.json``.

On a terminal the table is drawn with ``rich`` (:class:`rich.live.Live`), which redraws only
the lines it owns, so what was printed above it (the chain line) stays; anything else printed
while it runs goes above the table. When stdout is not a terminal (a log file, a pipe, CI) it
prints plain text rows every ``plain_every`` seconds instead, no escape codes.

A node that is still joining has no round yet (its status says -1): the table says ``-`` rather
than ``-1``, and the state column says ``joining``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from typing import Any

COLUMNS = ("node", "state", "round", "step", "loss", "held-out", "sent", "peers", "commit")
_RIGHT = {"round", "step", "loss", "held-out", "sent", "peers", "commit"}


def _count(value: Any) -> str:
    """A round, step or commit index for humans: '-' while there is none (negative or missing)."""
    return str(value) if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else "-"


def _loss(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, (int, float)) and value == value else "-"


def node_row(name: str, status: dict, exit_code: int | None) -> tuple[str, ...]:
    """One row of the table: ``status`` is the node's status.json (possibly empty or partial, a node
    writes it only once it runs), ``exit_code`` None while its process runs."""
    if exit_code is not None:
        state = f"exit {exit_code}"
    else:
        state = str(status.get("state") or "starting")
    inner = status.get("inner_steps")
    step = f"{_count(status.get('step'))}/{_count(inner)}" if _count(status.get("round")) != "-" else "-"
    sent = status.get("bytes_sent")
    return (name, state, _count(status.get("round")), step, _loss(status.get("loss")),
            _loss(status.get("eval_loss")),
            f"{sent / 1e6:.2f}MB" if isinstance(sent, (int, float)) else "-",
            _count(status.get("peers")), _count(status.get("last_commit")))


def plain_table(rows: Iterable[tuple[str, ...]], elapsed: float) -> str:
    """The rows as fixed-width text (for logs and pipes)."""
    rows = [COLUMNS, *rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["  " + " ".join(cell.rjust(w) if COLUMNS[i] in _RIGHT else cell.ljust(w)
                             for i, (cell, w) in enumerate(zip(row, widths))) for row in rows]
    return f"t+{elapsed:.0f}s\n" + "\n".join(lines)


class LiveView:
    """The live table of a :class:`node.commands.launcher.LocalRun`; ``tick(run)`` from its wait loop."""

    def __init__(self, stream=None, refresh_every: float = 1.0, plain_every: float = 10.0) -> None:
        self.stream = stream if stream is not None else sys.stdout
        self.interactive = self.stream.isatty()
        self.every = refresh_every if self.interactive else plain_every
        self.started = time.monotonic()
        self._last = 0.0
        self._live = None

    def rows(self, run) -> list[tuple[str, ...]]:
        out = []
        for slot in run.nodes:
            process = slot.process
            if process is None:
                out.append(node_row(slot.name, {"state": "not started"}, None))
            else:
                out.append(node_row(slot.name, slot.status(), process.poll()))
        return out

    def _rich_table(self, rows: list[tuple[str, ...]]):
        from rich.table import Table

        table = Table(title=f"t+{time.monotonic() - self.started:.0f}s", title_justify="left", box=None,
                      pad_edge=False)
        for column in COLUMNS:
            table.add_column(column, justify="right" if column in _RIGHT else "left", no_wrap=True)
        for row in rows:
            table.add_row(*row)
        return table

    def tick(self, run, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < self.every:
            return
        self._last = now
        rows = self.rows(run)
        if not self.interactive:
            self.stream.write(plain_table(rows, now - self.started) + "\n")
            self.stream.flush()
            return
        if self._live is None:
            from rich.console import Console
            from rich.live import Live

            self._live = Live(console=Console(file=self.stream), auto_refresh=False, transient=False)
            self._live.start()
        self._live.update(self._rich_table(rows), refresh=True)

    def close(self) -> None:
        """Leave the last table on screen; what is printed next goes below it."""
        if self._live is not None:
            self._live.stop()
            self._live = None
