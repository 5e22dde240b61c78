"""``dlx-node data prepare``: tokenizer training, sharding and the manifest (training/prepare.py) with a
progress bar.

On a terminal a ``rich`` progress bar shows bytes read, rate and time left; elsewhere (logs, pipes) the
command prints only its summary. The summary ends with the ``node.toml`` lines that train on the dataset.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from node.errors import ConfigError

logger = logging.getLogger(__name__)


class _Progress:
    """A rich progress bar over input bytes when stderr is a terminal; nothing otherwise."""

    def __init__(self, description: str, enabled: bool) -> None:
        self._bar = None
        if enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self._bar = Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                                 TransferSpeedColumn(), TimeRemainingColumn(), console=Console(stderr=True),
                                 transient=True)
            self._task = self._bar.add_task(description, total=None)
            self._bar.start()

    def __call__(self, done: int, total: int) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=done, total=total)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def run_prepare(args: argparse.Namespace) -> int:
    """Train a tokenizer if asked, write the shards and manifest, print the settings that use them."""
    from training.prepare import prepare_dataset, train_tokenizer
    from training.shards import DEFAULT_SHARD_TOKENS
    from training.tokenizer import load_tokenizer

    inputs = [*args.inputs, *(args.eval_input or [])]
    if any(not str(p).strip() for p in inputs):  # `prepare "$(dlx-node data fetch ...)"` after a failed fetch
        raise ConfigError("an input path is empty: did the command that should print it (dlx-node data fetch)"
                          " fail? Run it alone first")
    missing = [str(p) for p in inputs if not Path(p).expanduser().exists()]
    if missing:  # a usage error (exit 2), named before anything is read or written
        raise ConfigError(f"no such input file(s): {', '.join(missing)}")
    not_files = [str(p) for p in inputs if not Path(p).expanduser().is_file()]
    if not_files:
        raise ConfigError(f"input(s) not a file: {', '.join(not_files)} (give the text or JSON Lines files)")
    out = Path(args.out).expanduser()
    interactive = sys.stderr.isatty() and not args.no_progress
    started = time.monotonic()
    model_dir = None
    if args.train_tokenizer:
        if args.tokenizer != "bytes":
            raise ConfigError("--train-tokenizer and --tokenizer exclude each other: give one")
        if not args.vocab_size:
            raise ConfigError("--train-tokenizer needs --vocab-size N (e.g. 8192)")
        if interactive:
            print(f"training a byte-level BPE of {args.vocab_size} tokens on {len(args.inputs)} input(s)...",
                  file=sys.stderr)
        tokenizer = train_tokenizer(args.inputs, args.vocab_size, args.text_field)
    else:
        spec = args.tokenizer
        model_dir = Path(spec).expanduser() if spec != "bytes" and Path(spec).expanduser().is_dir() else None
        if model_dir is not None:  # a model directory: its own tokenizer, which must fit its vocabulary
            spec = str(model_dir / "tokenizer.json")
        tokenizer = load_tokenizer(spec)
        if model_dir is not None:
            from training.hf_import import HFImportError, check_source_vocab

            try:
                check_source_vocab(model_dir, tokenizer)
            except HFImportError as exc:
                raise ConfigError(str(exc)) from None
    progress = _Progress(f"preparing {out.name}", interactive)
    try:
        manifest = prepare_dataset(
            args.inputs, out, tokenizer, eval_inputs=args.eval_input, eval_fraction=args.eval_fraction,
            text_field=args.text_field, shard_tokens=args.shard_tokens or DEFAULT_SHARD_TOKENS,
            progress=progress,
        )
    finally:
        progress.close()
    held_out = manifest.num_tokens - manifest.eval_start
    print(f"prepared {out} in {time.monotonic() - started:.1f}s: {len(manifest.shards)} shard(s) of "
          f"{manifest.dtype} ids, {manifest.num_tokens:,} tokens ({held_out:,} held out), vocabulary "
          f"{manifest.vocab_size:,}")
    print(f"dataset root {manifest.root} (the run document names it as manifest:<root>)")
    _print_settings(out, manifest, model_dir)
    return 0


def _print_settings(out: Path, manifest, model_dir: Path | None) -> None:
    """The settings that train on the dataset: a model directory's run takes its [model] from the model."""
    if model_dir is not None:  # README "Start from a model"
        print(f"start a run from {model_dir} on it (create-run or demo --init-from {model_dir}: [model] "
              "comes from the model) with these run file settings:")
    else:
        print("train on it with these node.toml settings:")
        print("[model]")
        if manifest.tokenizer != "bytes":
            print(f'tokenizer = "{(out / "tokenizer.json").resolve()}"')
        print(f"vocab_size = {manifest.vocab_size}")
    print("[training]")
    print(f'data_path = "{out.resolve()}"')


def run_fetch(args: argparse.Namespace) -> int:
    """Bring a public dataset into the cache (node/datafetch.py); print its files' paths on stdout."""
    from node.datafetch import default_cache_dir, fetch

    if args.url and args.from_path:
        raise ConfigError("--url and --from exclude each other: give one")
    cache_dir = Path(args.dir).expanduser() if args.dir else default_cache_dir()

    def progress(file_name: str, what: str) -> None:
        print(f"{args.name}/{file_name}: {what}", file=sys.stderr)

    paths = fetch(args.name, cache_dir=cache_dir, url=args.url,
                  local=Path(args.from_path).expanduser() if args.from_path else None, progress=progress)
    for path in paths:
        print(path)
    return 0


def run_data(args: argparse.Namespace) -> int:
    """``dlx-node data ACTION``: dispatch by action."""
    return {"prepare": run_prepare, "fetch": run_fetch}[args.data_command](args)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """``dlx-node data prepare|fetch ...`` (registered by node.cli)."""
    from node.datafetch import DATASETS

    data = sub.add_parser("data",
                          help="fetch a public dataset; prepare a dataset: tokenizer, shards, manifest")
    actions = data.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    f = actions.add_parser("fetch",
                           help="download a public dataset into the cache, checked against its pinned "
                                         "sha256; prints the paths of its files")
    f.add_argument("name", choices=sorted(DATASETS), help="the dataset")
    f.add_argument("--dir", default="",
                   help="cache directory (default $DLX_DATA_DIR, else ~/.cache/dlx-node/data)")
    f.add_argument("--url", default="",
                   help="download from this mirror instead (the file's URL; for a dataset of "
                                             "several files, the base URL their names are appended to)")
    f.add_argument("--from", dest="from_path", default="", metavar="FILE|DIR",
                   help="copy from a local file or directory instead of downloading (checked the same way)")
    p = actions.add_parser("prepare",
                           help="tokenize text / JSON lines / Parquet files into shards and a manifest")
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="text files (one document each), .jsonl files (a field per line), .parquet files "
                        "(a column; needs pyarrow)")
    p.add_argument("--out", required=True, help="the dataset directory to create (new or empty)")
    p.add_argument("--tokenizer", default="bytes",
                   help="'bytes' (token id = byte value), a Hugging Face tokenizer.json, or a model "
                        "directory holding one (a run started with --init-from DIR; default: bytes)")
    p.add_argument("--train-tokenizer", action="store_true",
                   help="train a byte-level BPE on the inputs first (with --vocab-size)")
    p.add_argument("--vocab-size", type=int, default=0, help="vocabulary of the trained tokenizer, e.g. 8192")
    p.add_argument("--text-field", default="text",
                   help="field of a JSON line / Parquet column holding the text")
    p.add_argument("--eval-input", action="append", default=[], metavar="FILE",
                   help="hold out this file's documents (repeatable); default: the tail of the inputs")
    p.add_argument("--eval-fraction", type=float, default=0.1,
                   help="share of the tokens held out at the end when no --eval-input is given (default 0.1)")
    p.add_argument("--shard-tokens", type=int, default=0,
                   help="token ids per shard (default 16,777,216: 32 MiB of uint16 ids)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar even on a terminal")
