"""Progress of long transfers: one updating line with size and rate on a terminal, one log line at the start
and one at the end otherwise (the TTY flag is forced; no timing is asserted)."""

from __future__ import annotations

import io
import logging
import os

from node.progress import TransferProgress, host_progress, human_bytes
from p2p.config import P2PConfig
from p2p.host import P2PHost
from p2p.identity import Identity


def _records(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "node.progress"]


def test_on_a_terminal_one_line_is_rewritten_with_size_share_and_rate(caplog):
    caplog.set_level(logging.INFO, logger="node.progress")
    out = io.StringIO()
    with TransferProgress("shards", total=4 << 20, stream=out, tty=True, interval=0) as progress:
        progress.update(1 << 20)
        progress.advance(1 << 20)
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith(" - done\n")  # one line, rewritten in place
    assert "\r" in text and "shards: 1.0 MiB of 4.0 MiB (25%)" in text and "2.0 MiB of 4.0 MiB (50%)" in text
    assert "/s" in text.splitlines()[-1]
    assert _records(caplog) == []  # nothing in the logs


def test_in_logs_it_is_quiet_one_line_at_the_start_and_one_at_the_end(caplog):
    caplog.set_level(logging.INFO, logger="node.progress")
    out = io.StringIO()
    with TransferProgress("checkpoint of round 3", total=3000, stream=out, tty=False, interval=0) as progress:
        for _ in range(30):
            progress.advance(100)
    assert out.getvalue() == ""
    lines = _records(caplog)
    assert len(lines) == 2
    assert lines[0] == "checkpoint of round 3: started (2.9 KiB)"
    assert lines[1].startswith("checkpoint of round 3: done: 2.9 KiB in ") and "/s)" in lines[1]
    assert human_bytes(1536) == "1.5 KiB" and human_bytes(3 << 30) == "3.0 GiB"


def test_a_real_blob_transfer_counts_its_bytes(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="node.progress")
    config = P2PConfig(listen_host="127.0.0.1", listen_port=0, gossip_resync_interval=0)
    blob = os.urandom(3 << 20)
    with P2PHost.start(config, Identity.generate(), data_dir=tmp_path / "a") as server, \
            P2PHost.start(config, Identity.generate(), data_dir=tmp_path / "b") as client:
        digest = server.provide_blob(blob, announce=False)
        client.connect(server.listen_addrs[0], timeout=10)
        out = io.StringIO()
        with host_progress(client, "blob", total=len(blob), stream=out, tty=True) as progress:
            client.fetch_blob(digest, tmp_path / "got", providers=[server.peer_id], timeout=120)
        assert progress.done == len(blob)
        assert out.getvalue().rstrip("\n").split("\r\x1b[2K")[-1].startswith(
            "blob: 3.0 MiB of 3.0 MiB (100%), ")
        failed = io.StringIO()
        try:
            with host_progress(client, "missing", stream=failed, tty=False):
                client.fetch_blob("ab" * 32, tmp_path / "none", providers=[server.peer_id], timeout=30)
        except Exception:
            pass
    assert failed.getvalue() == ""
    assert [m.split(":")[1].strip() for m in _records(caplog)] == ["started", "stopped"]
