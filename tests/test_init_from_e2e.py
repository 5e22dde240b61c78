"""Issue 76 end to end: a run started from a Hugging Face model directory (no hub: transformers builds a small
random Qwen2 locally, with a BPE trained here as its tokenizer). 2 replicas x 2 stages of real nodes on anvil,
the data prepared with the source's own tokenizer; the run document names the imported weights and the
tokenizer by content hash, the genesis root on chain is that of the imported weights, ``audit`` (with reruns)
verifies every round, and ``pull`` writes a Qwen2ForCausalLM whose logits equal the project's. Through the
demo's seeder alone (a run link, no archive, no local copy of anything), ``audit`` fetches the initial
weights, replays round 0 from them and reruns every contribution from what the seeder serves, and ``pull``
fetches the tokenizer and writes the source's class.
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from node.commands.launcher import LocalRun
from node.commitments.values import genesis_root
from node.runconfig import node_config_from_run
from node.store.checkpoint import read_checkpoint
from node.commands.seeder import ArchiveSeeder
from node.tools.audit import audit_run
from node.tools.audit_inputs import INITIAL_WEIGHTS
from node.tools.evidence import PeerFetcher
from node.tools.pull import pull_checkpoint
from node.tools.report import OK
from training.config import ModelConfig
from training.data import generated_text
from training.hf_import import add_search_dir
from training.model import GPT
from training.prepare import prepare_dataset
from training.tokenizer import load_tokenizer, train_bpe

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]  # four node processes on a loaded machine
ROUNDS = 2


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen-src")
    text = root / "corpus.txt"
    text.write_text(generated_text(seed=31, n_bytes=100_000))
    (root / "tok.json").write_bytes(train_bpe(iter([text.read_text()]), 384))
    tokenizer = load_tokenizer(str(root / "tok.json"))
    config = transformers.Qwen2Config(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, tie_word_embeddings=True)
    torch.manual_seed(7)
    model = transformers.Qwen2ForCausalLM(config).eval()
    model.save_pretrained(root / "model")
    transformers.PreTrainedTokenizerFast(tokenizer_file=str(root / "tok.json"),
                                         eos_token="<|endoftext|>").save_pretrained(root / "model")
    # the run's data, prepared with the source's own tokenizer
    prepare_dataset([text], root / "ds", load_tokenizer(str(root / "model" / "tokenizer.json")),
                    shard_tokens=8192)
    return root, model


@pytest.fixture(scope="module")
def run(source, tmp_path_factory):
    root, _ = source
    local = LocalRun(tmp_path_factory.mktemp("init-run"), replicas=2, stages=2, split=True, attest_quorum=2,
                     init_from=str(root / "model"),
                     settings=["model.block_size=32", f"training.data_path={root / 'ds'}",
                               "diloco.inner_steps=4", "training.batch_size=4", f"rounds={ROUNDS}",
                               "checkpoint_every=1", "round_timeout=240", "join_timeout=240"])
    try:
        local.setup()
        local.start()
        ok = local.wait(1300, progress=True)
        logs = "\n".join(p.read_text(errors="replace")[-3000:] for s in local.nodes
                         for p in s.data_dir.glob("*.log"))
        assert ok, logs
        assert [c.commit.round for c in local.client().history(local.run_id).commits] \
            == list(range(ROUNDS)), logs
        yield local
    finally:
        local.stop()


def test_the_run_names_the_source_by_content_and_its_genesis_is_the_imported_weights(run, source):
    root, _ = source
    document = json.loads((run.workdir / "run.json").read_text())
    model = document["model"]
    weights = next((run.workdir / "initial").glob("*.safetensors"))
    assert model["init_weights"] == f"sha256:{hashlib.sha256(weights.read_bytes()).hexdigest()}"
    assert model["tokenizer"] == \
        f"sha256:{hashlib.sha256((root / 'model' / 'tokenizer.json').read_bytes()).hexdigest()}"
    assert model["attention_bias"] is True and \
        json.loads(model["hf_source"])["source"]["architecture"] == "Qwen2ForCausalLM"
    # every node kept (and served) the weights by their hash
    for slot in run.nodes:
        assert (slot.data_dir / "initial" / weights.name).is_file()
    add_search_dir(run.workdir / "initial")
    cfg = node_config_from_run(document)
    on_chain = run.client().run_values(run.run_id)["genesis_root"]
    assert genesis_root(cfg) == on_chain != bytes(32)


def test_an_audit_with_reruns_verifies_every_round_from_the_imported_start(run, source):
    from training import hf_import

    root, _ = source
    hf_import._SEARCH_DIRS.clear()  # the audit finds the initial weights in the archives by itself
    archives = [slot.data_dir for slot in run.nodes]
    report = audit_run(run.client(), run.run_id, archives=archives, data_path=root / "ds", reexecute=-1)
    assert report.ok, [c.line() for c in report.all_checks() if c.status != OK]
    reruns = [c for c in report.general if c.name.startswith("re-execution")]
    assert reruns and all(c.status == OK for c in reruns), [c.line() for c in reruns]


def test_pulled_back_into_the_source_class_its_logits_are_ours(run, source, tmp_path):
    client = run.client()
    latest = client.latest_checkpoint(run.run_id)
    out = tmp_path / "model"
    pull_checkpoint(client, run.run_id, out, archives=[slot.data_dir for slot in run.nodes], final_only=False)
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back).__name__ == "Qwen2ForCausalLM"
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    assert (out / "generation_config.json").is_file()
    slot = next(s for s in run.nodes if (s.data_dir / "checkpoints"
                                         / f"round-{latest.round:08d}.safetensors").is_file())
    checkpoint = read_checkpoint(slot.data_dir / "checkpoints" / f"round-{latest.round:08d}.safetensors",
                                 latest.content_hash)
    ours = GPT(ModelConfig(**checkpoint.model_config), seed=None).eval()
    ours.load_state_dict(checkpoint.weights)
    ids = torch.randint(0, ours.cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ours(ids)[0], atol=1e-5, rtol=0)
        _, src = source
        assert (src(ids).logits - ours(ids)[0]).abs().max() > 1e-4  # it trained: not the source's weights
    text = "the quick brown fox"
    assert transformers.AutoTokenizer.from_pretrained(out)(text)["input_ids"] == \
        list(load_tokenizer(ours.cfg.tokenizer, [slot.data_dir / "tokenizers"]).encode(text))


def test_through_the_seeder_alone_round_0_replays_from_the_fetched_weights_and_pull_writes_the_source_class(
        run, source, tmp_path):
    from training import hf_import

    root, _ = source
    hf_import._SEARCH_DIRS.clear()  # nothing local: the weights come through the link or not at all
    seeder = ArchiveSeeder.start([slot.data_dir for slot in run.nodes], run.run_id, datasets=[root / "ds"])
    try:
        fetcher = PeerFetcher.start([seeder.multiaddr])
        try:
            # issue 80 point 1: the reruns too read the seeder alone (start states, envelopes; round 0's
            # exclusions from the audit's own replay of it)
            report = audit_run(run.client(), run.run_id, fetcher=fetcher, reexecute=-1)
            pull_checkpoint(run.client(), run.run_id, tmp_path / "model", fetcher=fetcher, final_only=False)
        finally:
            fetcher.close()
    finally:
        seeder.close()
    assert report.ok, [c.line() for c in report.all_checks() if c.status != OK]
    item = next(c for c in report.general if c.name == INITIAL_WEIGHTS)
    assert item.status == OK and "fetched from the run's peers" in item.reason, item.line()
    first = report.rounds[0]
    assert first.round == 0
    assert any(c.name == "weights root (replay)" and c.status == OK for c in first.checks), first.line()
    reruns = [c for c in report.general if c.name.startswith("re-execution of round")]
    assert len(reruns) == 2 * ROUNDS and all(c.status == OK for c in reruns), [c.line() for c in reruns]
    assert report.reexecution["from"] == "peers" and report.reexecution["rerun"] == 2 * ROUNDS
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert type(back).__name__ == "Qwen2ForCausalLM"
    tokenizer = (tmp_path / "model" / "tokenizer.json").read_bytes()
    assert tokenizer == (root / "model" / "tokenizer.json").read_bytes()
