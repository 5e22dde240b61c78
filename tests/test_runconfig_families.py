"""The run document with model families and tokenizers: GPT-2 runs keep their hashes, Llama runs pin
theirs."""

import hashlib

import pytest

from node.config import load_config
from node.errors import ConfigError
from node.runconfig import config_hash, node_config_from_run, run_document
from training.errors import TrainingConfigError

#: configHash of byte-level GPT-2 run documents, computed before model families existed (commit 57e253c).
#: Those runs' documents name their encoder (v1 was the default then; v4 is now), so the encoder is pinned
#: here; they drew their weights and sketch from torch's generator (the portable "philox" is the default since
#: issue 42), which is pinned too (OLD_RANDOM), as are their version-1 records (chunked commitments were the
#: default from issue 43, normed ones are now: a hashed run's document does not name them); and they trained
#: with AdamW (Muon is the default since issue 46), pinned too: an
#: AdamW run's document leaves the optimizer out, as theirs did.
OLD_RANDOM = ["model.init=torch", "compression.sketch=torch", "diloco.commitments=hashed",
              "training.optimizer=adamw"]
GPT2_HASHES = [
    (["compression.encoder=v1"], "4793715b0970f4f70ae421d7de4571ac5b90a35c9f0fa45f00d3692ee4c3bcee"),
    (["model.preset=mini", "diloco.inner_steps=20", "compression.encoder=v4"],
     "5865b681797d905a0c3d5100379b89dd73000c85c07398ef35e374d1f6342815"),
    (["model.preset=small", "diloco.exchange=sliced", "training.seed=7", "compression.encoder=v1"],
     "d32749f2106714507fccf3aaef8bd62b0bf9844853f95c41b9f18581b45564d8"),
]
FIXED_TEXT = b"To be, or not to be, that is the question.\n" * 50
# preset mini on FIXED_TEXT
FIXED_TEXT_HASH = "adb3d38a104f7451a8449df88257cd636f3645d2282c7143abe1f7b80dd60723"


@pytest.mark.parametrize("overrides, expected", GPT2_HASHES)
def test_gpt2_run_hashes_are_unchanged(overrides, expected):
    document = run_document(load_config(None, overrides + OLD_RANDOM))
    assert "family" not in document["model"] and "tokenizer" not in document["model"]
    assert "init" not in document["model"] and "sketch" not in document["compression"]
    assert "commitments" not in document["diloco"]
    assert config_hash(document).hex() == expected
    # the same document read back (as a joiner or an auditor does) keeps torch's generator, and its hash
    again = node_config_from_run(document)
    assert again.model.init == "torch" and again.compression.sketch == "torch" \
        and again.training.optimizer == "adamw"
    assert again.diloco.commitments == "hashed" and not again.commitment_scheme.chunked
    assert config_hash(run_document(again)).hex() == expected


#: configHash of run documents made while "auto" resolved to "chunked" (commit d4cc534, before version 3
#: became the default): such a document names "chunked", so it keeps its hash and its records stay version 2.
CHUNKED_HASHES = {
    (): "47d4b943924714c6f656f8d499c1ddb6e4ac98c893a88506364c34344ae6ed6c",
    ("model.preset=mini",): "c2d57a7e05193142bbcf4a0abc74930958009420dca6086374d8b7242b219dc0",
}


def test_a_new_run_commits_normed_roots_where_a_proof_can_open_them():
    """Secure by default: a new full-exchange run names normed (version-3) commitments, its clip scales
    provable, and keeps them when read back, the norm rule on or off; a sliced run (no proof opens its
    partials) or one with two outer lrs resolves to hashed, and asking chunked or normed of it is refused with
    the way out."""
    document = run_document(load_config(None, []))
    assert document["diloco"]["commitments"] == "normed" and document["diloco"]["norm_clip"] == 2.0
    again = node_config_from_run(document)
    assert again.diloco.commitments == "normed" and again.commitment_scheme.chunked
    assert config_hash(run_document(again)) == config_hash(document)
    # With the norm rule off too: version 2 would leave every clip scale free, version 3 holds each to 1.0.
    assert load_config(None, ["diloco.norm_clip=0"]).diloco.commitments == "normed"
    sliced = run_document(load_config(None, ["diloco.exchange=sliced"]))
    assert "commitments" not in sliced["diloco"] \
        and not node_config_from_run(sliced).commitment_scheme.chunked
    scaled = load_config(None, ["diloco.outer_lr_other_scale=0.5"])
    assert scaled.diloco.commitments == "hashed"
    for overrides in (["diloco.exchange=sliced"], ["diloco.outer_lr_other_scale=0.5"]):
        for version in ("chunked", "normed"):
            with pytest.raises((ConfigError, TrainingConfigError), match="diloco.commitments = .hashed."):
                load_config(None, overrides + [f"diloco.commitments={version}"])
    with pytest.raises((ConfigError, TrainingConfigError), match="must be one of hashed, chunked, normed"):
        load_config(None, ["diloco.commitments=merkle"])


@pytest.mark.parametrize("settings", list(CHUNKED_HASHES))
def test_a_chunked_runs_document_keeps_its_hash_and_its_version(settings):
    """A run made while "auto" resolved to "chunked" names it: read back (as a joiner or the auditor does) it
    is still version 2, its hash what it was; the same settings now give a normed run, another hash."""
    document = run_document(load_config(None, [*settings, "diloco.commitments=chunked"]))
    assert document["diloco"]["commitments"] == "chunked"
    assert config_hash(document).hex() == CHUNKED_HASHES[settings]
    again = node_config_from_run(document)
    assert again.diloco.commitments == "chunked" and again.commitment_scheme.chunked
    assert config_hash(run_document(again)).hex() == CHUNKED_HASHES[settings]
    assert config_hash(run_document(load_config(None, list(settings)))).hex() != CHUNKED_HASHES[settings]


def test_a_new_run_names_the_portable_generator_and_round_trips():
    cfg = load_config(None, ["model.preset=mini"])
    document = run_document(cfg)
    assert document["model"]["init"] == "philox" and document["compression"]["sketch"] == "philox"
    again = node_config_from_run(document)
    assert again.model.init == "philox" and again.compression.sketch == "philox"
    assert config_hash(run_document(again)) == config_hash(document)
    assert config_hash(document) \
        != config_hash(run_document(load_config(None, ["model.preset=mini"] + OLD_RANDOM)))


def test_gpt2_run_on_a_text_file_keeps_its_hash(tmp_path):
    text = tmp_path / "fixed.txt"
    text.write_bytes(FIXED_TEXT)
    cfg = load_config(None, [f"training.data_path={text}", "model.preset=mini", "compression.encoder=v1"]
                      + OLD_RANDOM)
    assert config_hash(run_document(cfg)).hex() == FIXED_TEXT_HASH
    # naming the defaults explicitly changes nothing
    explicit = load_config(None, [f"training.data_path={text}", "model.preset=mini", "model.family=gpt2",
                                  "model.tokenizer=bytes", "compression.encoder=v1"] + OLD_RANDOM)
    assert config_hash(run_document(explicit)).hex() == FIXED_TEXT_HASH


def test_llama_document_pins_the_family_and_round_trips():
    cfg = load_config(None, ["model.preset=llama-tiny", "model.rope_theta=50000"])
    document = run_document(cfg)
    model = document["model"]
    assert model["family"] == "llama" and model["n_kv_head"] == 2 and model["rope_theta"] == 50000.0
    assert model["intermediate_size"] == 64 and model["tokenizer"] == "bytes"
    again = node_config_from_run(document)
    assert again.model == cfg.model
    assert config_hash(run_document(again)) == config_hash(document)
    other = run_document(load_config(None, ["model.preset=llama-tiny", "model.n_kv_head=4"]))
    assert config_hash(other) != config_hash(document)


def test_tokenizer_is_named_by_content_not_path(tmp_path):
    data = b'{"not": "checked here"}'
    for name in ("a.json", "b.json"):
        (tmp_path / name).write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    docs = [run_document(load_config(None, ["model.preset=llama-tiny", f"model.tokenizer={tmp_path / name}"]))
            for name in ("a.json", "b.json")]
    assert docs[0]["model"]["tokenizer"] == f"sha256:{digest}"
    assert config_hash(docs[0]) == config_hash(docs[1])
    by_reference = run_document(load_config(None,
                                            ["model.preset=llama-tiny", f"model.tokenizer=sha256:{digest}"]))
    assert config_hash(by_reference) == config_hash(docs[0])
    # a GPT-2 run with a BPE tokenizer names it too
    gpt2 = run_document(load_config(None, [f"model.tokenizer={tmp_path / 'a.json'}"]))
    assert gpt2["model"]["tokenizer"] == f"sha256:{digest}" and "family" not in gpt2["model"]
    with pytest.raises(ConfigError, match="model.tokenizer='/nonexistent.json': cannot read it"):
        run_document(load_config(None, ["model.tokenizer=/nonexistent.json"]))
    with pytest.raises(TrainingConfigError, match="64 lowercase hex digits"):
        load_config(None, ["model.tokenizer=sha256:abc"])


def test_a_relative_tokenizer_path_is_read_from_the_data_dir(tmp_path):
    node_dir = tmp_path / "node"
    node_dir.mkdir()
    (node_dir / "tok.json").write_bytes(b"{}")
    cfg = load_config(None, [f"data_dir={node_dir}", "model.preset=llama-tiny", "model.tokenizer=tok.json"])
    assert cfg.model.tokenizer == str(node_dir / "tok.json")
    assert run_document(cfg)["model"]["tokenizer"] == "sha256:" + hashlib.sha256(b"{}").hexdigest()


def test_auto_exchange_resolves_by_replica_count_and_hashes_as_the_exchange_it_names():
    """diloco.exchange = "auto" (the node template's) is "full" below 8 replicas and "sliced" from 8; the run
    document names what it resolved to, so its hash is that of the explicit choice, and documents that name
    their exchange (or, for "full", name none) hash as before."""
    for replicas, chosen in ((2, "full"), (7, "full"), (8, "sliced"), (64, "sliced")):
        auto = load_config(None, ["diloco.exchange=auto", f"diloco.num_replicas={replicas}"])
        explicit = load_config(None, [f"diloco.exchange={chosen}", f"diloco.num_replicas={replicas}"])
        assert auto.diloco.exchange == chosen
        assert config_hash(run_document(auto)) == config_hash(run_document(explicit))
        assert run_document(auto)["diloco"].get("exchange") == (None if chosen == "full" else "sliced")
        assert node_config_from_run(run_document(auto)).diloco.exchange == chosen
    # A full run's document never names "auto" or "full": joiners of a run without the field run "full".
    assert load_config(None, ["diloco.num_replicas=16"]).diloco.exchange == "full"
    with pytest.raises((ConfigError, TrainingConfigError), match="auto"):
        load_config(None, ["diloco.exchange=butterfly"])
