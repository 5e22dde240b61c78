"""One default encoder (issue 29 item 2): the launcher and the tests, the benchmark; new runs (init's
node.toml and the demo) take issue 66's codec, ``NEW_RUN_COMPRESSION`` (tests/test_new_run_codec.py).

Every other entry point that makes a run takes ``training.config.DEFAULT_ENCODER``;
a run document that names no encoder (a run made before the setting existed)
keeps ``LEGACY_ENCODER``, and one that names an encoder keeps it.

The benchmark's default corpus is the one ``dlx-node data fetch`` keeps: these tests fetch it from a server
of their own into an empty cache, so they pass in a user's clone with no corpus beside it (issue 65 point 18).
"""

import hashlib
import importlib.util
import os
import sys
import threading
import tomllib
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import node.datafetch

from node.config import load_config
from node.runconfig import canonical_json, config_hash, node_config_from_run, parse_run_document, run_document
from training.codec.registry import ENCODERS
from training.config import DEFAULT_ENCODER, LEGACY_ENCODER, EncoderVersion
from training.config_compression import NEW_RUN_COMPRESSION, CompressionConfig

ROOT = Path(__file__).resolve().parents[1]
#: The shared corpus beside a developer's clone, used for the real pins only where it is there (a user's clone
#: has none: DLX_SHARED_DATA=/nonexistent runs these tests as there).
SHARED = Path(os.environ.get("DLX_SHARED_DATA", ROOT.parent / "shared" / "data"))


def test_the_default_is_a_registered_encoder_and_the_dataclass_default():
    assert DEFAULT_ENCODER in ENCODERS and LEGACY_ENCODER in ENCODERS
    assert CompressionConfig().encoder == DEFAULT_ENCODER == "v4"


def test_init_writes_the_new_run_encoder():
    # New runs (init's node.toml, the demo) take issue 66's codec (tests/test_new_run_codec.py); a
    # configuration that names no encoder takes the codec's default.
    template = tomllib.loads((ROOT / "node/templates/node.toml").read_text())
    assert template["compression"]["encoder"] == NEW_RUN_COMPRESSION["encoder"] != DEFAULT_ENCODER
    encoder = load_config(ROOT / "node/templates/node.toml").compression.encoder
    assert encoder == NEW_RUN_COMPRESSION["encoder"]


def test_launcher_runs_take_the_default_and_their_run_document_validates():
    # The launcher (so every end-to-end test) builds the run from load_config(None, settings) with settings
    # that name no encoder (the demo adds NEW_RUN_COMPRESSION's; tests/test_demo.py checks its run document).
    settings = ["model.preset=tiny", "rounds=2", "diloco.inner_steps=4", "checkpoint_every=1",
                "round_timeout=120", "pipeline.num_stages=2", "diloco.num_replicas=2", "torch_threads=1"]
    cfg = load_config(None, settings)
    assert cfg.compression.encoder == DEFAULT_ENCODER
    document = run_document(cfg)
    assert document["compression"]["encoder"] == DEFAULT_ENCODER
    data = canonical_json(document)
    parsed = parse_run_document(data, config_hash(document))  # what a joiner and the audit check
    assert run_document(node_config_from_run(parsed)) == document


def test_a_run_document_keeps_the_encoder_it_names_and_one_naming_none_is_v1():
    document = run_document(load_config(None, ["model.preset=tiny"]))
    for version in EncoderVersion:
        named = {**document, "compression": {**document["compression"], "encoder": version.value}}
        assert node_config_from_run(named).compression.encoder == version
    legacy = {**document, "compression": {k: v for k, v in document["compression"].items() if k != "encoder"}}
    assert node_config_from_run(legacy).compression.encoder == LEGACY_ENCODER == "v1"


@pytest.fixture
def corpus_server(tmp_path, monkeypatch):
    """What the benchmark's default corpus needs in a user's clone: an empty data cache (``$DLX_DATA_DIR``)
    and tinyshakespeare's server, a real http.server on 127.0.0.1. It serves the real bytes under the real pin
    where the shared corpus lies beside the clone; else made-up bytes under a pin of their own (the
    catalog's entry replaced), so no test needs the corpus. Yields (the server's request paths, the pin)."""
    real = SHARED / "tinyshakespeare" / "input.txt"
    body = real.read_bytes() if real.is_file() else b"".join(b"line %d of a made-up corpus\n" % i
                                                               for i in range(20_000))
    served = tmp_path / "served"
    served.mkdir()
    (served / "input.txt").write_bytes(body)
    requests: list[str] = []

    class Handler(SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(served), **kwargs)

        def log_message(self, *args) -> None:  # quiet
            requests.append(self.path)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    pinned = node.datafetch.DATASETS["tinyshakespeare"].files[0]
    if not real.is_file():
        pinned = node.datafetch.PinnedFile("input.txt", "", len(body), hashlib.sha256(body).hexdigest())
    pinned = node.datafetch.PinnedFile(pinned.name, f"http://127.0.0.1:{server.server_address[1]}/input.txt",
                                       pinned.size, pinned.sha256)
    monkeypatch.setitem(node.datafetch.DATASETS, "tinyshakespeare",
                        node.datafetch.Dataset("tinyshakespeare", "served here", (pinned,)))
    monkeypatch.setenv("DLX_DATA_DIR", str(tmp_path / "cache"))
    try:
        yield requests, pinned
    finally:
        server.shutdown()
        server.server_close()


def _bench_diloco():
    spec = importlib.util.spec_from_file_location("bench_diloco_under_test", ROOT / "bench/bench_diloco.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_benchmark_defaults_to_the_node_encoder(monkeypatch, corpus_server):
    monkeypatch.setattr(sys, "argv", ["bench_diloco.py"])
    assert _bench_diloco().parse_args().encoder == DEFAULT_ENCODER


def test_the_benchmark_defaults_to_the_fetched_corpus_fetched_once(monkeypatch, corpus_server, tmp_path):
    requests, pinned = corpus_server
    monkeypatch.setattr(sys, "argv", ["bench_diloco.py"])
    module = _bench_diloco()
    data = Path(module.parse_args().data)
    assert data == tmp_path / "cache" / "tinyshakespeare" / "input.txt"
    assert hashlib.sha256(data.read_bytes()).hexdigest() == pinned.sha256
    assert len(requests) == 1  # fetched once, checked against its pin
    assert Path(module.parse_args().data) == data and len(requests) == 1  # then the cache, not the server
    monkeypatch.setattr(sys, "argv", ["bench_diloco.py", "--data", "other.txt"])
    assert module.parse_args().data == "other.txt" and len(requests) == 1


def test_the_benchmark_without_its_corpus_says_how_to_get_it(monkeypatch, corpus_server):
    requests, pinned = corpus_server
    dead = node.datafetch.PinnedFile(pinned.name, "http://127.0.0.1:9/input.txt", pinned.size, pinned.sha256)
    monkeypatch.setitem(node.datafetch.DATASETS, "tinyshakespeare",
                        node.datafetch.Dataset("tinyshakespeare", "offline", (dead,)))
    monkeypatch.setattr(sys, "argv", ["bench_diloco.py"])
    with pytest.raises(SystemExit, match="run 'dlx-node data fetch tinyshakespeare' .*--from FILE"):
        _bench_diloco().parse_args()
    assert requests == []


@pytest.mark.parametrize("version", [v.value for v in EncoderVersion])
def test_every_version_can_still_be_named(version):
    assert load_config(None, [f"compression.encoder={version}"]).compression.encoder == version
