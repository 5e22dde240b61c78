"""``dlx-node data fetch``: pinned public datasets from a real HTTP server on 127.0.0.1, honest and hostile.

The served bytes are the shared corpus's files beside the clone when they are there (or the directory
``$DLX_SHARED_DATA`` names), so the real pins are exercised; elsewhere the test makes its own file and pins it
through a catalog of its own (``fetch(..., catalog=...)``).
"""

from __future__ import annotations

import hashlib
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from node.cli import main
from node.datafetch import DATASETS, Dataset, PinnedFile, fetch, sha256_file
from node.errors import DataFetchError, DataMismatch

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("DLX_SHARED_DATA", REPO.parent / "shared" / "data"))


def _served_file(tmp_path: Path) -> tuple[bytes, dict[str, Dataset]]:
    """The tinyshakespeare bytes (real pins) where the shared copy exists, else made-up bytes pinned here."""
    real = SHARED / "tinyshakespeare" / "input.txt"
    if real.is_file():
        return real.read_bytes(), DATASETS
    body = b"".join(b"line %d of a made-up corpus\n" % i for i in range(20_000))
    pinned = PinnedFile("input.txt", "http://unused.invalid/input.txt", len(body),
                        hashlib.sha256(body).hexdigest())
    return body, {"tinyshakespeare": Dataset("tinyshakespeare", "test copy", (pinned,))}


class _Server:
    """A real http.server whose paths behave well or badly; it records the Range headers it saw."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.ranges: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _send(self, code: int, data: bytes, headers: dict[str, str] | None = None,
                      length: int | None = None) -> None:
                self.send_response(code)
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                if length is not None:
                    self.send_header("Content-Length", str(length))
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(data)
                self.wfile.flush()
                self.close_connection = True

            def do_GET(self) -> None:
                body = server.body
                path = self.path
                if path == "/good":
                    rng = self.headers.get("Range")
                    if rng:
                        server.ranges.append(rng)
                        start = int(rng.split("=")[1].rstrip("-"))
                        self._send(206, body[start:],
                                   {"Content-Range": f"bytes {start}-{len(body) - 1}/{len(body)}"},
                                   len(body) - start)
                    else:
                        self._send(200, body, length=len(body))
                elif path == "/norange":  # ignores Range: always the whole body
                    self._send(200, body, length=len(body))
                elif path == "/wrong":
                    self._send(200, bytes(b ^ 1 for b in body[:100]) + body[100:], length=len(body))
                elif path == "/truncated":  # announces the whole file, sends the first half, hangs up
                    self._send(200, body[: len(body) // 2], length=len(body))
                elif path == "/huge-announced":
                    self._send(200, b"x" * 10, length=len(body) * 100)
                elif path == "/huge-unannounced":  # no Content-Length: the body runs until the server closes
                    self.send_response(200)
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.protocol_version = "HTTP/1.0"
                    try:
                        for _ in range(len(body) // 65536 + 40):
                            self.wfile.write(b"y" * 65536)
                    except OSError:
                        pass  # the client hung up once over the cap
                    self.close_connection = True
                elif path == "/loop":
                    self._send(302, b"", {"Location": "/loop2"}, 0)
                elif path == "/loop2":
                    self._send(302, b"", {"Location": "/loop"}, 0)
                elif path == "/to-file":
                    self._send(302, b"", {"Location": "file:///etc/passwd"}, 0)
                elif path == "/moved":
                    self._send(301, b"", {"Location": "/good"}, 0)
                else:
                    self._send(404, b"not here", length=8)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture()
def served(tmp_path):
    body, catalog = _served_file(tmp_path)
    server = _Server(body)
    yield server, catalog
    server.close()


def test_real_pins_are_the_shared_files_bytes():
    """The pins in node/datafetch.py are the sha256 and sizes of the copies the benchmarks ran on."""
    if not SHARED.is_dir():
        pytest.skip(f"no shared data at {SHARED} (set DLX_SHARED_DATA) to check the pins against")
    for dataset in DATASETS.values():
        for pinned in dataset.files:
            path = SHARED / dataset.name / pinned.name
            assert path.stat().st_size == pinned.size, path
            assert sha256_file(path) == pinned.sha256, path


def test_fetch_downloads_checks_and_is_idempotent(served, tmp_path):
    server, catalog = served
    events = []
    paths = fetch("tinyshakespeare", cache_dir=tmp_path, url=server.base + "/good", catalog=catalog,
                  progress=lambda name, what: events.append(what))
    assert paths == [tmp_path / "tinyshakespeare" / "input.txt"]
    assert paths[0].read_bytes() == server.body
    assert not list((tmp_path / "tinyshakespeare").glob("*.part"))
    # Again: the cached file is kept, nothing downloaded (the URL would 404 if it were asked).
    again = fetch("tinyshakespeare", cache_dir=tmp_path, url=server.base + "/gone", catalog=catalog,
                  progress=lambda name, what: events.append(what))
    assert again == paths and events[-1] == "cached"


def test_redirect_to_the_file_is_followed(served, tmp_path):
    server, catalog = served
    [path] = fetch("tinyshakespeare", cache_dir=tmp_path, url=server.base + "/moved", catalog=catalog)
    assert path.read_bytes() == server.body


def test_truncated_download_resumes_with_a_range_request(served, tmp_path):
    server, catalog = served
    with pytest.raises(DataFetchError, match="truncated|connection lost") as info:
        fetch("tinyshakespeare", cache_dir=tmp_path, url=server.base + "/truncated", catalog=catalog)
    assert "run again to resume" in str(info.value)
    part = tmp_path / "tinyshakespeare" / "input.txt.part"
    assert part.stat().st_size == len(server.body) // 2
    assert not (tmp_path / "tinyshakespeare" / "input.txt").exists()
    [path] = fetch("tinyshakespeare", cache_dir=tmp_path, url=server.base + "/good", catalog=catalog)
    assert server.ranges == [f"bytes={len(server.body) // 2}-"]
    assert path.read_bytes() == server.body and not part.exists()


def test_a_server_that_ignores_range_still_gives_the_right_file(served, tmp_path):
    server, catalog = served
    part = tmp_path / "tinyshakespeare" / "input.txt.part"
    part.parent.mkdir(parents=True)
    part.write_bytes(b"garbage that is not the start of the file")
    [path] = fetch("tinyshakespeare", cache_dir=tmp_path, url=server.base + "/norange", catalog=catalog)
    assert path.read_bytes() == server.body


def test_wrong_bytes_are_refused_and_not_kept(served, tmp_path):
    server, catalog = served
    with pytest.raises(DataMismatch, match="sha256 .* the pinned one is"):
        fetch("tinyshakespeare", cache_dir=tmp_path, url=server.base + "/wrong", catalog=catalog)
    assert list((tmp_path / "tinyshakespeare").iterdir()) == []


@pytest.mark.parametrize("path, message", [
    ("/huge-announced", "announces .* bytes"),
    ("/huge-unannounced", "more than the pinned"),
    ("/loop", "too many redirects"),
    ("/to-file", "not an http\\(s\\) URL"),
    ("/nothing", "HTTP 404"),
])
def test_hostile_answers_get_specific_errors(served, tmp_path, path, message):
    server, catalog = served
    with pytest.raises(DataFetchError, match=message):
        fetch("tinyshakespeare", cache_dir=tmp_path, url=server.base + path, catalog=catalog)
    assert not (tmp_path / "tinyshakespeare" / "input.txt").exists()


def test_unreachable_and_unknown(tmp_path):
    with pytest.raises(DataFetchError, match="cannot connect"):
        fetch("tinyshakespeare", cache_dir=tmp_path, url="http://127.0.0.1:9/input.txt")
    with pytest.raises(DataFetchError, match="unknown dataset 'enwik9'"):
        fetch("enwik9", cache_dir=tmp_path)
    with pytest.raises(DataFetchError, match="not an http"):
        fetch("tinyshakespeare", cache_dir=tmp_path, url="ftp://example.org/input.txt")


def _local_wikitext(tmp_path: Path) -> tuple[Path, dict[str, Dataset] | None]:
    """A directory holding wikitext-2's files: the shared copy with the real pins where it exists, else
    made-up files pinned by a catalog of the test's own (so the copy path runs from a clone alone)."""
    if (SHARED / "wikitext-2").is_dir():
        return SHARED, None
    root = tmp_path / "made-up"
    (root / "wikitext-2").mkdir(parents=True)
    pins = []
    for name in ("valid.txt", "test.txt"):
        body = b"".join(b" = %s heading %d = \n" % (name.encode(), i) for i in range(2_000))
        (root / "wikitext-2" / name).write_bytes(body)
        pins.append(PinnedFile(name, "http://unused.invalid/" + name, len(body),
                               hashlib.sha256(body).hexdigest()))
    return root, {"wikitext-2": Dataset("wikitext-2", "test copy", tuple(pins))}


def test_from_a_local_copy(tmp_path):
    """--from: a dataset's files are copied from a local directory once their pins match; a wrong file is
    refused."""
    bad = tmp_path / "bad.txt"
    bad.write_text("not shakespeare")
    with pytest.raises(DataMismatch):
        fetch("tinyshakespeare", cache_dir=tmp_path / "cache", local=bad)
    with pytest.raises(DataFetchError, match="no valid.txt"):
        fetch("wikitext-2", cache_dir=tmp_path / "cache", local=tmp_path)
    root, catalog = _local_wikitext(tmp_path)
    paths = fetch("wikitext-2", cache_dir=tmp_path / "cache", local=root, catalog=catalog)
    assert [p.name for p in paths] == ["valid.txt", "test.txt"]
    assert all(p.read_bytes() == (root / "wikitext-2" / p.name).read_bytes() for p in paths)
    # A local file one byte off its pin is refused and not copied.
    wrong = tmp_path / "wrong" / "wikitext-2"
    wrong.mkdir(parents=True)
    for p in paths:
        (wrong / p.name).write_bytes(p.read_bytes()[:-1] + b"!")
    with pytest.raises(DataMismatch, match="sha256"):
        fetch("wikitext-2", cache_dir=tmp_path / "cache2", local=wrong.parent, catalog=catalog)
    assert not (tmp_path / "cache2" / "wikitext-2" / "valid.txt").exists()


def test_cli_prints_the_paths_and_exits_with_an_error_line(served, tmp_path, capsys, monkeypatch):
    server, catalog = served
    if catalog is not DATASETS:
        # No shared copy: the CLI checks the test's own pins
        # of the made-up file (the catalog is the boundary).
        monkeypatch.setitem(DATASETS, "tinyshakespeare", catalog["tinyshakespeare"])
    code = main(["data", "fetch", "tinyshakespeare", "--dir", str(tmp_path), "--url", server.base + "/good"])
    out, err = capsys.readouterr()
    assert code == 0 and out.strip() == str(tmp_path / "tinyshakespeare" / "input.txt")
    assert "downloaded from" in err
    code = main(["data", "fetch", "wikitext-2", "--dir", str(tmp_path), "--url", server.base + "/nothing/"])
    out, err = capsys.readouterr()
    assert code == 10 and "HTTP 404" in err and out == ""  # the dataset's server: exit 10
