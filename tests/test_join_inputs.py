"""What a joiner's node.toml names as data and tokenizer: local files checked against the run document, or the
tokenizer fetched from a peer by its hash; the node.toml then hashes to the run's configHash."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest

from node.commands.join import run_inputs
from node.config import config_from_dict, load_config
from node.errors import ConfigError
from node.runconfig import config_hash, node_config_from_run, run_document
from training.data import generated_text
from training.prepare import prepare_dataset, train_tokenizer


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A Llama run on a prepared dataset with a trained BPE: its directory and run document."""
    root = tmp_path_factory.mktemp("run")
    text = root / "book.txt"
    text.write_text(generated_text(seed=6, n_bytes=30_000))
    tokenizer = train_tokenizer([text], 320)
    prepare_dataset([text], root / "ds", tokenizer)
    cfg = load_config(None, ["model.preset=llama-tiny", f"model.vocab_size={tokenizer.vocab_size}",
                             f"model.tokenizer={root / 'ds' / 'tokenizer.json'}",
                             f"training.data_path={root / 'ds'}"])
    return root, tokenizer, run_document(cfg)


def _joined_config(document, data_path, tokenizer_path, data_dir):
    table = node_config_from_run(document, data_dir=str(data_dir)).to_dict()
    table["training"]["data_path"] = data_path
    table["model"]["tokenizer"] = tokenizer_path
    return config_from_dict(table)


def test_a_joiner_with_the_dataset_gets_the_runs_config_hash(run, tmp_path):
    root, tokenizer, document = run
    assert document["training"]["data_sha256"].startswith("manifest:")
    data_path, tokenizer_path = run_inputs(document, str(root / "ds"), "", tmp_path)
    assert tokenizer_path == str((tmp_path / "tokenizers" / f"{tokenizer.sha256}.json").resolve())
    assert hashlib.sha256(Path(tokenizer_path).read_bytes()).hexdigest() == tokenizer.sha256
    cfg = _joined_config(document, data_path, tokenizer_path, tmp_path)
    assert config_hash(run_document(cfg)) == config_hash(document)


def test_a_joiner_without_the_right_files_is_told_what_to_pass(run, tmp_path):
    root, tokenizer, document = run
    with pytest.raises(ConfigError, match="prepared dataset.*pass --data"):
        run_inputs(document, "", "", tmp_path)
    with pytest.raises(ConfigError, match="not one"):
        run_inputs(document, str(root / "book.txt"), "", tmp_path)
    other = tmp_path / "other"
    prepare_dataset([root / "book.txt"], other, tokenizer, eval_fraction=0.2)  # same ids, another split
    with pytest.raises(ConfigError, match="dataset root"):
        run_inputs(document, str(other), "", tmp_path)
    wrong = tmp_path / "wrong.json"
    wrong.write_bytes(tokenizer.data + b"\n")
    with pytest.raises(ConfigError, match="--tokenizer .*not the run's tokenizer"):
        run_inputs(document, str(root / "ds"), str(wrong), tmp_path)
    text_run = dict(document, training={**document["training"], "data_sha256": "generated"})
    with pytest.raises(ConfigError, match="pass --tokenizer FILE"):
        run_inputs(text_run, "", "", tmp_path)


def test_the_tokenizer_comes_from_a_peer_that_serves_it(run, tmp_path):
    from p2p.config import P2PConfig
    from p2p.host import P2PHost
    from p2p.identity import Identity

    _, tokenizer, document = run
    generated = dict(document, training={**document["training"], "data_sha256": "generated"})
    with P2PHost.start(P2PConfig(), Identity.generate(), data_dir=tmp_path / "peer") as peer:
        peer.provide_blob(tokenizer.data, announce=False)
        data_path, tokenizer_path = run_inputs(generated, "", "", tmp_path / "joiner",
                                               tuple(peer.listen_addrs[:1]))
    assert data_path == "" and Path(tokenizer_path).read_bytes() == tokenizer.data


def test_the_run_document_is_fetched_from_a_peer_that_comes_up_while_join_dials(tmp_path, caplog):
    """Issue 80: a join right after the organizer's start found no node listening and failed at once (exit
    10). It dials again for up to its peer wait, saying so, and gets the document once the peer is up (a real
    libp2p host that starts listening 3 s later on the port the link names)."""
    import socket
    import threading

    from node.commands.rundocs import fetch_run_document
    from p2p.config import P2PConfig
    from p2p.host import P2PHost
    from p2p.identity import Identity

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    identity, document = Identity.generate(), b'{"format": "a run document"}'
    hosts = []

    def come_up_late():
        time.sleep(3)
        host = P2PHost.start(P2PConfig(listen_port=port), identity, data_dir=tmp_path / "peer")
        host.provide_blob(document, announce=False)
        hosts.append(host)

    late = threading.Thread(target=come_up_late)
    late.start()
    try:
        with caplog.at_level("WARNING"):
            got = fetch_run_document((f"/ip4/127.0.0.1/tcp/{port}/p2p/{identity.peer_id}",),
                                     hashlib.sha256(document).digest(), tmp_path / "joiner", peer_wait=120)
        assert got == document
        assert "no peer of the run is reachable" in caplog.text
        assert "dialling again for up to 120s" in caplog.text
    finally:
        late.join()
        for host in hosts:
            host.close()
