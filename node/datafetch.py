"""Public datasets by name: download once, check the pinned sha256, keep in a cache (``dlx-node data fetch``).

Every file of a dataset is pinned by its size and sha256, so a mirror (``--url``), a local copy (``--from``)
or the canonical URL must all give the same bytes. A download goes to ``<file>.part`` and is renamed only
once its hash matches, so the cache never holds a wrong or partial file under the real name; an interrupted
download resumes from the ``.part`` with an HTTP ``Range`` request, and a file already in the cache with the
right hash is not downloaded again. The server's answer is treated as hostile: a body longer than the pinned
size is cut off and refused, redirects are followed at most :data:`MAX_REDIRECTS` times and only to http(s),
and every failure names the file, the URL and what was wrong.
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import os
import shutil
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from node.errors import DataFetchError, DataFetchUsage, DataMismatch, DataUnreachable

logger = logging.getLogger(__name__)

MAX_REDIRECTS = 5
READ_TIMEOUT_S = 30.0
CHUNK = 1 << 16
#: What an unreachable server's error adds: the two ways to fetch without it.
OFFLINE_HINT = (" (offline? fetch the file elsewhere and pass --from FILE|DIR, or another mirror with --url "
                "URL)")


@dataclass(frozen=True)
class PinnedFile:
    """One file of a dataset: its name in the cache, its canonical URL, its size in bytes and sha256."""

    name: str
    url: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Dataset:
    name: str
    description: str
    files: tuple[PinnedFile, ...]


_PYTORCH_EXAMPLES = ("https://raw.githubusercontent.com/pytorch/examples/"
                     "77f55b912142e11fcfdf5b530231fb9c52f181e8/word_language_model/data/wikitext-2/")

#: The datasets ``dlx-node data fetch`` knows. The pins are the sha256 of the files at these URLs (checked
#: against the repositories' git blobs and against the copies the benchmarks were run on).
DATASETS: dict[str, Dataset] = {
    "tinyshakespeare": Dataset(
        "tinyshakespeare", "Karpathy's tiny Shakespeare (char-rnn), 1.1 MB of plain text",
        (PinnedFile("input.txt",
                    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
                    1115394, "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"),)),
    "wikitext-2": Dataset(
        "wikitext-2", "WikiText-2 validation and test splits (the word-level text of pytorch/examples)",
        (PinnedFile("valid.txt", _PYTORCH_EXAMPLES + "valid.txt",
                    1121681, "f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8"),
         PinnedFile("test.txt", _PYTORCH_EXAMPLES + "test.txt",
                    1256449, "d790b833ef8cf03a90db7bf1271b7520b83c45ce07ba3c1a9699df81e239eca0"))),
}


def default_cache_dir() -> Path:
    """``$DLX_DATA_DIR``, else ``$XDG_CACHE_HOME/dlx-node/data``, else ``~/.cache/dlx-node/data``."""
    if os.environ.get("DLX_DATA_DIR"):
        return Path(os.environ["DLX_DATA_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "dlx-node" / "data"


def lookup(name: str, catalog: dict[str, Dataset] | None = None) -> Dataset:
    catalog = DATASETS if catalog is None else catalog
    if name not in catalog:
        raise DataFetchUsage(f"unknown dataset {name!r}: known are {', '.join(sorted(catalog))}")
    return catalog[name]


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def cached_path(name: str, file_name: str | None = None, cache_dir: Path | None = None,
                shared_root: Path | None = None) -> Path | None:
    """Where a dataset file already lies with the pinned bytes: the cache, else ``shared_root/<name>/``."""
    dataset = lookup(name)
    pinned = dataset.files[0] if file_name is None else next(f for f in dataset.files if f.name == file_name)
    candidates = [(cache_dir or default_cache_dir()) / name / pinned.name]
    if shared_root is not None:
        candidates.append(shared_root / name / pinned.name)
    for path in candidates:
        if path.is_file() and path.stat().st_size == pinned.size and sha256_file(path) == pinned.sha256:
            return path
    return None


class _LimitedRedirects(urllib.request.HTTPRedirectHandler):
    """Follow at most MAX_REDIRECTS redirects, and only to http(s) URLs."""

    max_redirections = MAX_REDIRECTS
    max_repeats = 1

    def http_error_302(self, req, fp, code, msg, headers):  # noqa: D401 (urllib's signature)
        location = headers.get("Location") or headers.get("URI") or ""
        newurl = urllib.parse.urljoin(req.full_url, location)
        if urllib.parse.urlsplit(newurl).scheme not in ("http", "https"):
            raise DataFetchError(f"{req.full_url}: redirected to {newurl!r}, not an http(s) URL")
        return super().http_error_302(req, fp, code, msg, headers)

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302


def _opener() -> urllib.request.OpenerDirector:
    return urllib.request.build_opener(_LimitedRedirects())


def _download(url: str, pinned: PinnedFile, part: Path) -> None:
    """Append the rest of ``pinned`` from ``url`` to ``part`` (resuming), never past the pinned size."""
    have = part.stat().st_size if part.exists() else 0
    if have >= pinned.size:
        part.unlink()  # whole but wrong (its hash was checked), or longer than the pin: start over
        have = 0
    request = urllib.request.Request(url, headers={"User-Agent": "dlx-node data fetch"})
    if have:
        request.add_header("Range", f"bytes={have}-")
    try:
        response = _opener().open(request, timeout=READ_TIMEOUT_S)
    except urllib.error.HTTPError as exc:
        if exc.code in (301, 302, 303, 307, 308):
            raise DataFetchError(
                f"{url}: too many redirects (a loop?), followed at most {MAX_REDIRECTS}") from None
        if exc.code == 416 and have:
            part.unlink()  # our partial file does not fit the server's: start over next time
            raise DataFetchError(
                f"{url}: the server refused to resume at byte {have:,} (HTTP 416); the partial "
                "file was removed, run again") from None
        raise DataFetchError(f"{url}: HTTP {exc.code} {exc.reason}") from None
    except urllib.error.URLError as exc:
        raise DataUnreachable(f"{url}: cannot connect: {exc.reason}" + OFFLINE_HINT) from None
    except OSError as exc:  # timeouts, resets
        raise DataUnreachable(f"{url}: {exc}" + OFFLINE_HINT) from None
    except ValueError as exc:  # bad URLs, broken status lines
        raise DataFetchError(f"{url}: {exc}") from None
    with response:
        status = getattr(response, "status", 200)
        mode = "ab"
        if have and status == 206:
            content_range = response.headers.get("Content-Range", "")
            if not content_range.startswith(f"bytes {have}-"):
                raise DataFetchError(
                    f"{url}: asked to resume at byte {have:,}, the server sent {content_range!r}")
        elif status == 200:
            mode, have = "wb", 0  # the server ignored the Range: take the whole body
        else:
            raise DataFetchError(f"{url}: unexpected HTTP {status}")
        declared = response.headers.get("Content-Length")
        if declared is not None and declared.isdigit() and have + int(declared) > pinned.size:
            raise DataFetchError(f"{url}: the server announces {have + int(declared):,} bytes, the pinned "
                                 f"{pinned.name} has {pinned.size:,}: refused (wrong file or mirror)")
        written = have
        with open(part, mode) as out:
            while True:
                try:
                    chunk = response.read(min(CHUNK, pinned.size + 1 - written))
                except (OSError, http.client.HTTPException) as exc:  # resets, timeouts, IncompleteRead
                    raise DataUnreachable(f"{url}: connection lost after {written:,} of {pinned.size:,} "
                                          f"bytes ({exc.__class__.__name__}); run again to resume") from None
                if not chunk:
                    break
                written += len(chunk)
                if written > pinned.size:
                    out.close()
                    part.unlink()
                    raise DataFetchError(f"{url}: sent more than the pinned {pinned.size:,} bytes of "
                                         f"{pinned.name}: refused (wrong file or mirror)")
                out.write(chunk)
    if written < pinned.size:
        raise DataFetchError(
            f"{url}: truncated: got {written:,} of {pinned.size:,} bytes of {pinned.name}; run "
            "again to resume")


def _accept(part: Path, pinned: PinnedFile, dest: Path, source: str) -> None:
    """Rename ``part`` to ``dest`` if its bytes are the pinned ones; else remove it and refuse."""
    size = part.stat().st_size
    digest = sha256_file(part)
    if size != pinned.size or digest != pinned.sha256:
        part.unlink()
        raise DataMismatch(f"{source}: {pinned.name} has sha256 {digest} ({size:,} bytes), the pinned one is "
                           f"{pinned.sha256} ({pinned.size:,} bytes): refused, nothing was kept")
    os.replace(part, dest)


def _local_source(source: Path, dataset: Dataset, pinned: PinnedFile) -> Path:
    """The file to copy from ``--from``: the file itself (one-file datasets), or ``DIR/<file>`` or
    ``DIR/<dataset>/<file>``."""
    if source.is_file():
        if len(dataset.files) > 1:
            raise DataFetchError(f"--from {source}: {dataset.name} has {len(dataset.files)} files; give the "
                                 "directory that holds them")
        return source
    for candidate in (source / pinned.name, source / dataset.name / pinned.name):
        if candidate.is_file():
            return candidate
    raise DataFetchError(f"--from {source}: no {pinned.name} there (nor in {source / dataset.name})")


def fetch(name: str, cache_dir: Path | None = None, url: str = "", local: Path | None = None,
          catalog: dict[str, Dataset] | None = None,
          progress: Callable[[str, str], None] | None = None) -> list[Path]:
    """Bring every file of dataset ``name`` into ``cache_dir/<name>/`` and return their paths.

    ``url`` replaces the canonical URL (a one-file dataset: the file's URL; several files: a base URL the
    file names are appended to); ``local`` copies from a file or directory instead of downloading. Files
    already cached with the pinned hash are kept as they are. Raises :class:`DataMismatch` for bytes that
    are not the pinned ones and :class:`DataFetchError` for everything else (HTTP errors, loops, truncation).
    """
    dataset = lookup(name, catalog)
    target = (cache_dir or default_cache_dir()) / dataset.name
    target.mkdir(parents=True, exist_ok=True)
    report = progress or (lambda _name, _what: None)
    paths = []
    for pinned in dataset.files:
        dest = target / pinned.name
        paths.append(dest)
        if dest.is_file() and dest.stat().st_size == pinned.size and sha256_file(dest) == pinned.sha256:
            report(pinned.name, "cached")
            continue
        part = target / (pinned.name + ".part")
        if local is not None:
            source = _local_source(local, dataset, pinned)
            shutil.copyfile(source, part)
            _accept(part, pinned, dest, str(source))
            report(pinned.name, f"copied from {source}")
            continue
        file_url = pinned.url
        if url:
            file_url = url if len(dataset.files) == 1 else url.rstrip("/") + "/" + pinned.name
        if urllib.parse.urlsplit(file_url).scheme not in ("http", "https"):
            raise DataFetchUsage(f"{file_url!r}: not an http(s) URL (use --from for a local file)")
        _download(file_url, pinned, part)
        _accept(part, pinned, dest, file_url)
        report(pinned.name, f"downloaded from {file_url}")
    return paths


def resolve_text(name: str, file_name: str | None = None, extra_roots: Iterable[Path] = ()) -> Path:
    """A dataset file with the pinned bytes, for benchmarks: the cache first, then ``<root>/<name>/<file>``
    under each of ``extra_roots`` (laid out like the cache); else an error naming the fetch command."""
    dataset = lookup(name)
    pinned = dataset.files[0] if file_name is None else next(f for f in dataset.files if f.name == file_name)
    found = cached_path(name, pinned.name)
    for root in extra_roots:
        found = found or cached_path(name, pinned.name, shared_root=Path(root))
    if found is not None:
        return found
    raise DataFetchError(f"{name}/{pinned.name} is not in the cache ({default_cache_dir()}): run "
                         f"'dlx-node data fetch {name}' first (or give the file with --data)")
