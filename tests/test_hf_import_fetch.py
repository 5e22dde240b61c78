"""An imported run's initial weights and tokenizer through a run link (node/tools/audit_inputs.py), over real
libp2p hosts: the demo's seeder (:class:`ArchiveSeeder`) serves both from a node's data directory; an audit
given only the seeder's address fetches them, checked against the run document's hashes, and its replay of
round 0 starts from exactly the imported weights (their genesis root); a peer serving corrupt bytes under
the right hash, or an archive holding a wrong copy, is refused with one line and never replayed."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch
from test_hf_import import _source

from ledger.chunkproof import chunked_weights_root
from node.commands.runfile import import_model
from node.commands.seeder import ArchiveSeeder
from node.commitments.values import genesis_root
from node.config import config_from_dict
from node.runconfig import run_document
from node.tools.audit_inputs import INITIAL_WEIGHTS, initial_weights_check, tokenizer_dirs
from node.tools.audit_replay import Replayer
from node.tools.evidence import PeerFetcher
from node.tools.report import OK, UNVERIFIABLE
from p2p.config import P2PConfig
from p2p.host import P2PHost
from p2p.identity import Identity
from training import hf_import
from training.data import generated_text
from training.tokenizer import load_tokenizer, train_bpe

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(180)
RUN_ID = 3


@pytest.fixture(autouse=True)
def _no_search_dirs():
    """Each test finds the weights only where the audit puts them (the search list is process-wide)."""
    saved = list(hf_import._SEARCH_DIRS)
    hf_import._SEARCH_DIRS.clear()
    yield
    hf_import._SEARCH_DIRS[:] = saved


@pytest.fixture(scope="module")
def organizer(tmp_path_factory):
    """A node's data directory after ``create-run --init-from`` of a small Llama (its initial weights and
    tokenizer kept by hash), and the run document naming them."""
    root = tmp_path_factory.mktemp("org")
    (root / "tok.json").write_bytes(train_bpe(iter([generated_text(seed=3, n_bytes=20_000)]), 300))
    _source("llama", root / "src", root / "tok.json")
    node_dir = root / "node"
    model = import_model(str(root / "src"), {"block_size": 32}, node_dir, "run.toml")
    cfg = config_from_dict({"model": model, "pipeline": {"num_stages": 2}, "diloco": {"inner_steps": 2}})
    document = run_document(cfg)
    return node_dir, document, cfg


def _digest(document: dict, key: str) -> str:
    return document["model"][key].removeprefix("sha256:")


def test_a_seeder_serves_the_initial_weights_and_an_audit_replays_round_0_from_them(organizer):
    node_dir, document, cfg = organizer
    weights, tokenizer = _digest(document, "init_weights"), _digest(document, "tokenizer")
    replayer = Replayer(document)
    replayer.start_from_initial()  # nothing local: round 0 is not replayed, and the report says why
    assert replayer.weights is None and "initial weights are not here" in replayer.base_problem
    seeder = ArchiveSeeder.start([node_dir], RUN_ID)
    try:
        assert {weights, tokenizer} <= set(seeder.served)
        fetcher = PeerFetcher.start([seeder.multiaddr])
        try:
            check = initial_weights_check(document, [], fetcher)
            dirs = tokenizer_dirs(document, [], fetcher)
        finally:
            fetched = (Path(fetcher.workdir) / "initial" / f"{weights}.safetensors").read_bytes()
            fetched_tokenizer = load_tokenizer(document["model"]["tokenizer"], dirs)
            replayer.start_from_initial()
            fetcher.close()
    finally:
        seeder.close()
    assert check.name == INITIAL_WEIGHTS and check.status == OK
    assert "fetched from the run's peers" in check.reason
    assert hashlib.sha256(fetched).hexdigest() == weights
    assert fetched_tokenizer.sha256 == tokenizer and fetched_tokenizer.vocab_size == 300
    # the replay's start is the imported model: its genesis root is the run's
    assert replayer.weights is not None and replayer.base == "initial weights"
    imported = hf_import.load_init_weights(type(cfg.model)(**cfg.model.__dict__), [node_dir / "initial"])
    for stage in replayer.weights:
        for name, tensor in stage.items():
            assert torch.equal(tensor, imported[name]), name
    assert replayer.states is not None  # a chunked run: the fraud proof's round-0 rule opens these states
    assert chunked_weights_root([state.leaf() for state in replayer.states]) == genesis_root(cfg)


def test_a_corrupt_copy_from_a_peer_or_an_archive_is_refused_in_one_line(organizer, tmp_path):
    node_dir, document, _ = organizer
    digest = _digest(document, "init_weights")
    good = node_dir / "initial" / f"{digest}.safetensors"
    corrupt = tmp_path / "archive" / "initial" / good.name
    corrupt.parent.mkdir(parents=True)
    data = bytearray(good.read_bytes())
    data[-5] ^= 0x40
    corrupt.write_bytes(bytes(data))
    # a hostile peer serves the corrupt bytes under the run's hash
    with P2PHost.start(P2PConfig(), Identity.generate(), data_dir=tmp_path / "liar") as liar:
        liar.provide_file(corrupt, digest)
        fetcher = PeerFetcher.start([liar.listen_addrs[0]])
        try:
            check = initial_weights_check(document, [tmp_path / "archive"], fetcher)
            kept = list((Path(fetcher.workdir) / "initial").glob("*"))
        finally:
            fetcher.close()
    assert check.status == UNVERIFIABLE and "\n" not in check.reason, check.reason
    assert f"{corrupt} does not hash to it" in check.reason and "could not be fetched" in check.reason
    assert "round 0 cannot be replayed" in check.reason and kept == []
    replayer = Replayer(document)
    replayer.start_from_initial()
    assert replayer.weights is None
    # the archive's good copy is taken when there is one; the wrong one beside it is passed over
    (tmp_path / "good").mkdir()
    shutil.copyfile(good, tmp_path / "good" / good.name)
    check = initial_weights_check(document, [tmp_path / "archive", tmp_path / "good"], None)
    assert check.status == OK and str(tmp_path / "good") in check.reason
    replayer.start_from_initial()
    assert replayer.weights is not None


def test_a_run_that_draws_its_own_weights_has_no_such_item(organizer):
    _, document, _ = organizer
    plain = {**document, "model": {k: v for k, v in document["model"].items() if k != "init_weights"}}
    assert initial_weights_check(plain, [], None) is None
    assert tokenizer_dirs(plain, [Path("/nonexistent")], None) == [Path("/nonexistent/tokenizers"),
                                                                    Path("/nonexistent")]
