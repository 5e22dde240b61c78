"""Blob transfers between processes: a provider killed mid-transfer, and a 100 MB blob."""

import hashlib
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from p2p.config import P2PConfig
from p2p.errors import BlobUnavailable
from p2p.host import P2PHost
from p2p.identity import Identity

pytestmark = pytest.mark.timeout(120)


def start_provider(path, data_dir, rate_limit_bps=0.0):
    """``python -m p2p.serve`` in its own process; returns (process, info dict)."""
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "p2p.serve",
            str(path),
            "--data-dir",
            str(data_dir),
            "--rate-limit-bps",
            str(rate_limit_bps),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    line = process.stdout.readline()
    if not line:
        process.kill()
        raise RuntimeError("provider process failed to start")
    return process, json.loads(line)


def stop(process):
    if process.poll() is None:
        process.stdin.close()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture
def blob_file(tmp_path):
    path = tmp_path / "checkpoint.bin"
    path.write_bytes(os.urandom(24 << 20))
    return path


@pytest.mark.parametrize("direct_io", [False, True])
def test_download_finishes_from_another_provider_when_one_is_killed(tmp_path, blob_file, direct_io):
    # With direct_io the dead provider's range stops mid-block and the survivor resumes it
    # from an unaligned offset (p2p.staging writes those bytes through the page cache).
    rate = 6e6  # both providers capped so the transfer lasts a few seconds
    doomed, info = start_provider(blob_file, tmp_path / "doomed", rate_limit_bps=rate)
    try:
        survivor = P2PHost.start(
            P2PConfig(rate_limit_bps=rate), Identity.generate(), data_dir=tmp_path / "survivor"
        )
        fetcher = P2PHost.start(
            P2PConfig(blob_direct_io=direct_io), Identity.generate(), data_dir=tmp_path / "fetcher"
        )
        try:
            sha = survivor.provide_blob(blob_file, announce=False)
            assert sha == info["blobs"][str(blob_file)]
            fetcher.connect(info["listen_addrs"][0])
            fetcher.connect(survivor.listen_addrs[0])
            result = {}

            def fetch():
                try:
                    result["path"] = fetcher.fetch_blob(
                        sha, tmp_path / "out.bin", providers=[info["peer_id"], survivor.peer_id], timeout=90
                    )
                except Exception as exc:  # reported by the assertions below
                    result["error"] = exc

            thread = threading.Thread(target=fetch)
            thread.start()
            deadline = time.monotonic() + 30
            while fetcher.blob_peer_stats().get(info["peer_id"], {}).get("received", 0) < (3 << 20):
                assert time.monotonic() < deadline, "the doomed provider never started sending"
                time.sleep(0.05)
            doomed.kill()  # SIGKILL: no goodbye, the TCP connection just dies
            doomed.wait()
            thread.join(90)
            assert not thread.is_alive()
            assert "error" not in result, result.get("error")
            assert hashlib.sha256(result["path"].read_bytes()).hexdigest() == sha
            stats = fetcher.blob_peer_stats()
            from_doomed = stats[info["peer_id"]]["received"]
            from_survivor = stats[survivor.peer_id]["received"]
            assert 0 < from_doomed < blob_file.stat().st_size
            assert from_doomed + from_survivor == blob_file.stat().st_size  # resumed, nothing fetched twice
        finally:
            fetcher.close()
            survivor.close()
    finally:
        stop(doomed)


def test_sole_provider_killed_gives_blob_unavailable(tmp_path, blob_file):
    doomed, info = start_provider(blob_file, tmp_path / "doomed", rate_limit_bps=4e6)
    try:
        with P2PHost.start(P2PConfig(), Identity.generate(), data_dir=tmp_path / "fetcher") as fetcher:
            fetcher.connect(info["listen_addrs"][0])
            sha = info["blobs"][str(blob_file)]
            threading.Timer(1.0, doomed.kill).start()
            started = time.monotonic()
            with pytest.raises(BlobUnavailable):
                fetcher.fetch_blob(sha, tmp_path / "out.bin", providers=[info["peer_id"]], timeout=60)
            assert time.monotonic() - started < 20  # noticed promptly, not at the transfer timeout
            assert not fetcher.has_blob(sha) and not (tmp_path / "out.bin").exists()
            assert list((tmp_path / "fetcher" / "blobs" / ".staging").iterdir()) == []
    finally:
        stop(doomed)


def test_100_mb_blob_between_processes(tmp_path):
    path = tmp_path / "big.bin"
    with open(path, "wb") as handle:
        handle.writelines(os.urandom(1 << 20) for _ in range(100))
    provider, info = start_provider(path, tmp_path / "provider")
    try:
        with P2PHost.start(P2PConfig(), Identity.generate(), data_dir=tmp_path / "fetcher") as fetcher:
            fetcher.connect(info["listen_addrs"][0])
            sha = info["blobs"][str(path)]
            out = fetcher.fetch_blob(sha, tmp_path / "out.bin", providers=[info["peer_id"]], timeout=110)
            digest = hashlib.sha256()
            with open(out, "rb") as handle:
                while chunk := handle.read(1 << 22):
                    digest.update(chunk)
            assert digest.hexdigest() == sha and out.stat().st_size == 100 << 20
    finally:
        stop(provider)
