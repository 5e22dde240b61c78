"""A full disk (ENOSPC) against the node's writers, on a real tmpfs of a few MiB (tests/tinyfs.py).

Each writer must leave the old file (or none) where a reader looks, never half a new one, raise or
log an error that names the file, and succeed once space is freed (issue 45).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import threading
import time
from types import SimpleNamespace

import pytest

from node.exitcodes import exit_code_for
from tinyfs import fill, tiny_filesystem
from waiting import wait_until

from node.cli import _FileHandler
from node.errors import DiskFull
from node.fsutil import (
    DEFERRED,
    DeferredWrites,
    append_line,
    atomic_write_bytes,
    is_disk_full,
    keep_evidence,
    retry_on_full_disk,
    write_when_space,
)
from node.live.record.committer import Committer
from node.live.state.status import StateFile
from node.store.archive import Archive, ArchivedContribution
from p2p.blobstore import BlobStore


@pytest.fixture
def full_disk(tmp_path):
    """A tmpfs of 1 MiB, and the filler that takes all of its space (delete it to free the space)."""
    with tiny_filesystem(tmp_path / "disk", "1m") as disk:
        yield disk


def _leftovers(directory) -> list[str]:
    return sorted(p.name for p in directory.rglob("*") if p.name.endswith(".tmp") or ".staging" in p.parts
                  and p.is_file())


def test_atomic_write_on_a_full_disk_keeps_the_old_file_and_names_the_path(full_disk):
    path = full_disk / "state.json"
    atomic_write_bytes(path, b'{"old": 1}\n')
    filler = fill(full_disk)
    with pytest.raises(OSError) as raised:
        atomic_write_bytes(path, b"x" * 200_000)
    assert raised.value.errno == errno.ENOSPC and is_disk_full(raised.value)
    assert raised.value.filename == str(path)  # the file meant, not the temporary name
    assert path.read_bytes() == b'{"old": 1}\n'
    assert _leftovers(full_disk) == []
    filler.unlink()
    atomic_write_bytes(path, b"x" * 200_000)
    assert path.read_bytes() == b"x" * 200_000


def test_append_line_leaves_no_half_record(full_disk):
    log = full_disk / "timing.jsonl"
    append_line(log, b'{"round": 0}\n')
    fill(full_disk)
    # Longer than what is left of the log's last page: part of it would fit.
    with pytest.raises(OSError) as raised:
        append_line(log, json.dumps({"round": 1, "pad": "y" * 9000}).encode() + b"\n")
    assert is_disk_full(raised.value) and raised.value.filename == str(log)
    assert log.read_bytes() == b'{"round": 0}\n'


def test_retry_pauses_until_space_is_freed_and_says_so_once(full_disk, caplog):
    path = full_disk / "round.json"
    filler = fill(full_disk)
    tries = []

    def write():
        tries.append(1)
        if len(tries) == 4:  # the operator frees space after the third failed try
            filler.unlink()
        atomic_write_bytes(path, b"sealed\n")
        return "done"

    with caplog.at_level(logging.WARNING):
        assert retry_on_full_disk(write, what="round 3's archive seal", stop=threading.Event(),
                                  min_s=0.01) == "done"
    assert len(tries) == 4 and path.read_bytes() == b"sealed\n"
    lines = [r.getMessage() for r in caplog.records]
    full = [line for line in lines if "is full" in line]
    assert len(full) == 1, lines  # rate-limited: one line for three failed tries
    assert f"disk of {path} is full" in full[0] and "round 3's archive seal paused" in full[0]
    assert any("has space again: round 3's archive seal done" in line for line in lines), lines
    assert not any(r.exc_info for r in caplog.records)  # no traceback


def test_retry_gives_up_with_disk_full_when_the_node_stops(full_disk):
    path = full_disk / "round.json"
    atomic_write_bytes(path, b"old\n")
    fill(full_disk)
    stop = threading.Event()
    tries = []

    def write():
        tries.append(1)
        stop.set()  # the node is asked to stop while it waits for space
        atomic_write_bytes(path, b"new" * 100_000)

    with pytest.raises(DiskFull, match=f"disk of {path} is full.*not done before the node stopped"):
        retry_on_full_disk(write, what="round 3's archive seal", stop=stop, min_s=0.01)
    assert len(tries) == 1 and path.read_bytes() == b"old\n"


def test_other_errors_are_not_retried(tmp_path):
    def write():
        raise PermissionError(errno.EACCES, "denied", str(tmp_path))

    with pytest.raises(PermissionError):
        retry_on_full_disk(write, what="x", stop=threading.Event())


def test_archive_seal_on_a_full_disk_leaves_the_round_unsealed_then_seals_it(full_disk):
    archive = Archive(full_disk / "archive", run_id=1)
    digest = archive.put(3, b"envelope" * 100)
    filler = fill(full_disk)
    contributions = [ArchivedContribution(0, 0, "peer", digest)]
    with pytest.raises(OSError) as raised:
        archive.seal_round(3, contributions * 2000)  # a manifest larger than what is left
    assert is_disk_full(raised.value)
    assert archive.sealed(3) is None  # not sealed: a restart re-applies it, an audit does not read half of it
    assert archive.get(3, digest) == b"envelope" * 100
    filler.unlink()
    archive.seal_round(3, contributions)
    assert archive.sealed(3) == contributions


def test_state_file_on_a_full_disk_stays_loadable(full_disk):
    state = StateFile(full_disk / "state.json", run_id=1)
    state.update(last_finished=4)
    filler = fill(full_disk)
    with pytest.raises(OSError):
        state.update(last_finished=5, padding="z" * 200_000)
    assert StateFile(full_disk / "state.json", run_id=1).get("last_finished") == 4  # the old file, whole
    filler.unlink()
    state.update(last_finished=5)
    assert StateFile(full_disk / "state.json", run_id=1).get("last_finished") == 5


def test_blob_store_leaves_no_partial_staging_file(full_disk):
    store = BlobStore(full_disk / "blobs", max_blob_bytes=1 << 22)
    fill(full_disk)
    with pytest.raises(OSError) as raised:
        store.put_bytes(b"b" * 300_000)
    assert is_disk_full(raised.value)
    assert list((full_disk / "blobs" / ".staging").iterdir()) == []
    assert [p.name for p in (full_disk / "blobs").iterdir()] == [".staging"]


def test_log_handler_drops_records_on_a_full_disk_without_tracebacks(full_disk, capsys):
    handler = _FileHandler(full_disk / "node.log")
    logger = logging.getLogger("test_disk_full.handler")
    logger.propagate = False
    logger.addHandler(handler)
    try:
        logger.warning("before")
        filler = fill(full_disk)
        for i in range(50):
            logger.warning("while full %d %s", i, "p" * 5000)
        assert capsys.readouterr().err == ""  # no "--- Logging error ---" per record
        filler.unlink()
        logger.warning("after")
    finally:
        logger.removeHandler(handler)
        handler.close()
    text = (full_disk / "node.log").read_text()
    assert "before" in text and text.rstrip().endswith("after")
    assert "log records dropped: the log's disk was full" in text


def test_a_fetch_onto_a_full_disk_blames_no_provider_and_succeeds_once_space_is_freed(tmp_path, full_disk):
    from p2p.config import P2PConfig
    from p2p.errors import BlobStoreFull
    from p2p.host import P2PHost
    from p2p.identity import Identity

    config = {"gossip_resync_interval": 0}
    provider = P2PHost.start(P2PConfig(**config), Identity.generate(), data_dir=tmp_path / "provider")
    fetcher = P2PHost.start(P2PConfig(bootstrap=provider.listen_addrs, **config), Identity.generate(),
                            data_dir=full_disk / "fetcher")
    try:
        data = bytes(range(256)) * 2048  # 512 KiB: more than the full disk takes
        digest = provider.provide_blob(data, announce=False)
        filler = fill(full_disk)
        with pytest.raises(BlobStoreFull, match=f"disk of {full_disk / 'fetcher'}.* is full") as refused:
            fetcher.fetch_blob(digest, tmp_path / "out.bin", providers=[provider.peer_id], timeout=60)
        # the file that found no room, on the full disk; a full disk is state, 4 (it was network, 10)
        assert f"disk of {fetcher.store.staging}" in str(refused.value), refused.value
        assert exit_code_for(refused.value) == 4
        assert not fetcher.store.has(digest)
        assert [p for p in fetcher.store.staging.iterdir()] == []  # nothing half-fetched eats the space
        filler.unlink()
        out = fetcher.fetch_blob(digest, tmp_path / "out.bin", providers=[provider.peer_id], timeout=60)
        assert out.read_bytes() == data
    finally:
        fetcher.close()
        provider.close()


class _ArchivingCommitter(Committer):
    """A committer whose chain step of a round writes that round's file on the test's tmpfs (the real
    step writes the checkpoint and state.json): a full disk fails it as it failed the soak's."""

    def __init__(self, node, directory) -> None:
        self.directory = directory
        self.tries: list[int] = []
        super().__init__(node)

    def handle(self, outer_round: int) -> None:
        self.tries.append(outer_round)
        atomic_write_bytes(self.directory / f"round-{outer_round}.json", b"r" * 300_000)


def test_the_committer_retries_a_round_its_full_disk_failed_and_skips_none(full_disk):
    context = SimpleNamespace(stop_event=threading.Event())
    committer = _ArchivingCommitter(context, full_disk)
    try:
        committer.submit(0)
        assert committer.drain(60) and committer.handled_through == 0
        filler = fill(full_disk)
        committer.submit(1)
        committer.submit(2)
        deadline = time.monotonic() + 60
        while committer.tries.count(1) < 3:  # failed, paused, and tried again, still full
            assert time.monotonic() < deadline, committer.tries
            time.sleep(0.05)
        # not handled, nothing after it ran
        assert committer.handled_through == 0 and 2 not in committer.tries
        filler.unlink()  # the operator frees space
        assert committer.drain(60)
        assert committer.handled_through == 2
        assert [r for i, r in enumerate(committer.tries) if r not in committer.tries[:i]] == [0, 1, 2]
        assert all((full_disk / f"round-{r}.json").stat().st_size == 300_000 for r in range(3))
    finally:
        context.stop_event.set()
        committer.close()


def test_evidence_on_a_full_disk_is_kept_in_memory_and_written_once_space_is_freed(full_disk, caplog):
    path = full_disk / "evidence" / "round-00000001-stage0-ab.envelope"
    data = b"signed evidence" * 20_000
    filler = fill(full_disk)
    with caplog.at_level(logging.WARNING):
        keep_evidence(path, data)  # returns at once: the accusation goes on, served from memory
        assert not path.exists() and DEFERRED.pending() == 1
        filler.unlink()
        wait_until(lambda: DEFERRED.pending() == 0, 120, "the deferred evidence write")
    assert path.read_bytes() == data and _leftovers(full_disk) == []
    lines = [r.getMessage() for r in caplog.records]
    assert any(f"disk of {path} is full" in line and "kept in memory" in line for line in lines), lines
    assert any("written" in line and path.name in line for line in lines), lines
    assert not any(r.exc_info for r in caplog.records)


def test_writes_waiting_for_space_are_capped_the_oldest_dropped(full_disk, caplog):
    writes = DeferredWrites(max_bytes=300_000)
    filler = fill(full_disk)
    paths = [full_disk / f"part-{i}" for i in range(3)]
    with caplog.at_level(logging.WARNING):
        for path in paths:
            writes.add(path.name, lambda path=path: atomic_write_bytes(path, b"z" * 200_000), 200_000)
        assert writes.dropped == 2 and writes.pending() == 1  # 400 kB > 300 kB: the two oldest go
        filler.unlink()
        wait_until(lambda: writes.pending() == 0, 120, "the deferred write")
    assert [p.exists() for p in paths] == [False, False, True]
    assert sum("part-0 dropped" in r.getMessage() for r in caplog.records) == 1


def test_a_dropped_write_is_never_made_even_with_an_attempt_under_way(full_disk, caplog):
    """The retry thread is inside part-0's attempt (held at its start) when two more writes arrive past the
    cap, and space is freed before the attempt goes on: whichever writes end up dropped, none of them is
    written afterwards (the suite under load once saw part-0 written after "part-0 dropped" was said)."""
    writes = DeferredWrites(max_bytes=300_000)
    filler = fill(full_disk)
    paths = [full_disk / f"part-{i}" for i in range(3)]
    attempting, go_on = threading.Event(), threading.Event()

    def first() -> None:
        attempting.set()
        go_on.wait(60)
        atomic_write_bytes(paths[0], b"z" * 200_000)

    def later() -> None:
        for path in paths[1:]:
            writes.add(path.name, lambda path=path: atomic_write_bytes(path, b"z" * 200_000), 200_000)

    with caplog.at_level(logging.WARNING):
        writes.add(paths[0].name, first, 200_000)
        assert attempting.wait(60)  # the retry thread's attempt, held at its start
        adder = threading.Thread(target=later)
        adder.start()
        adder.join(0.5)  # done at once where add() does not wait for the attempt under way
        filler.unlink()
        go_on.set()
        adder.join(60)
        assert not adder.is_alive()
        wait_until(lambda: writes.pending() == 0, 120, "the deferred writes")
    dropped = {p.name for p in paths if any(f"{p.name} dropped" in r.getMessage() for r in caplog.records)}
    assert writes.dropped == len(dropped)  # none where the retry wrote each before the next arrived
    assert {p.name for p in paths if p.exists()} == {p.name for p in paths} - dropped
    assert paths[2].exists()


def test_other_errors_of_a_deferred_write_are_raised_at_once(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(OSError) as raised:
        write_when_space(lambda: atomic_write_bytes(tmp_path / "file" / "inside", b"1"), what="x", size=1)
    assert not is_disk_full(raised.value) and DEFERRED.pending() == 0


@pytest.mark.parametrize("what", ["start state", "streamed start state", "own contribution"])
def test_what_a_node_serves_onto_a_full_disk_waits_for_space_then_is_served(tmp_path, full_disk, caplog,
                                                                            what):
    """A start state (the spot checks') or the node's own contribution stored onto a full disk pauses until
    space is freed, then is served; it never raises out of the lane or the pool (issue 45: a start state's
    ENOSPC ended a node of the disk-full run)."""
    from node.live.checks.heldstates import HeldStates
    from node.live.exchange.protocol import ContributionPool
    from node.live.state.roundbook import RoundBook
    from p2p.config import P2PConfig
    from p2p.host import P2PHost
    from p2p.identity import Identity

    from node.live.exchange.pool import ContributionPool
    from node.live.checks.heldstates import HeldStates
    from node.live.state.roundbook import RoundBook

    config = {"gossip_resync_interval": 0}
    host = P2PHost.start(P2PConfig(**config), Identity.generate(), data_dir=full_disk / "node")
    fetcher = P2PHost.start(P2PConfig(bootstrap=host.listen_addrs, **config), Identity.generate(),
                            data_dir=tmp_path / "fetcher")
    stop = threading.Event()
    data = bytes(range(256)) * 2048  # 512 KiB: more than the full disk takes
    digest = hashlib.sha256(data).hexdigest()
    pool = ContributionPool(host, RoundBook(), 1, tmp_path / "incoming", 1 << 20, 5.0, 2, stop=stop)
    held = HeldStates(host, tmp_path / "work", tmp_path / "evidence", 1, stop)
    # streamed: its tensors' data straight into the store's pieces (issue 75), given again on the retry
    parts = {0: data} if what == "start state" else {
        0: lambda: iter([(data[:100], False), (data[100:], True)])}
    serve = (lambda: held.serve(3, parts, keep_rounds=0)) if what != "own contribution" else (
        lambda: pool.serve_own(3, data))
    what = what.replace("streamed ", "")
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["value"] = serve()
        except BaseException as exc:  # what the lane would have raised into the node's main thread
            outcome["raised"] = exc

    try:
        filler = fill(full_disk)
        thread = threading.Thread(target=run, daemon=True)
        with caplog.at_level(logging.WARNING):
            thread.start()
            wait_until(lambda: any("paused" in r.getMessage() for r in caplog.records)
                       or not thread.is_alive(),
                       60, f"the {what} paused for space")
            assert thread.is_alive() and "raised" not in outcome, outcome
            assert not host.store.has(digest) and host.store.packed(digest) is None
            filler.unlink()  # the operator frees space
            thread.join(60)
        assert not thread.is_alive() and "raised" not in outcome, outcome
        expected = {0: bytes.fromhex(digest)} if what == "start state" else bytes.fromhex(digest)
        assert outcome["value"] == expected
        lines = [r.getMessage() for r in caplog.records]
        assert any(f"round 3's {what}" in line and "paused" in line and "is full" in line
                   for line in lines), lines
        assert any("has space again" in line and f"round 3's {what}" in line for line in lines), lines
        out = fetcher.fetch_blob(digest, tmp_path / "out.bin", providers=[host.peer_id], timeout=60)
        assert out.read_bytes() == data  # served
    finally:
        stop.set()
        pool.close()
        fetcher.close()
        host.close()


def test_a_checkpoint_on_a_full_disk_is_enospc_naming_it_and_leaves_nothing(full_disk):
    """write_checkpoint streams the file through safetensors (never the whole checkpoint in memory, issue 75):
    a full disk must still be the ENOSPC the node's retry waits on, naming the checkpoint, with the old file
    kept and no temporary left; once space is freed the same call writes the bytes to_bytes() gives."""
    import hashlib

    import torch

    from node.store.checkpoint import Checkpoint, write_checkpoint

    checkpoint = Checkpoint(run_id=1, round=2, model_config={"preset": "tiny"}, config_hash=b"\1" * 32,
                            stage_hashes={0: b"\2" * 32}, weights={"w": torch.ones(300, 300)},
                            momentum={"w": torch.zeros(300, 300)})
    path = full_disk / "round-00000002.safetensors"
    path.write_bytes(b"old")
    filler = fill(full_disk)
    with pytest.raises(OSError) as raised:
        write_checkpoint(path, checkpoint)
    assert raised.value.errno == errno.ENOSPC and is_disk_full(raised.value), raised.value
    assert raised.value.filename == str(path)
    assert path.read_bytes() == b"old" and _leftovers(full_disk) == []
    filler.unlink()
    digest = write_checkpoint(path, checkpoint)
    assert path.read_bytes() == checkpoint.to_bytes() and digest == hashlib.sha256(path.read_bytes()).digest()

