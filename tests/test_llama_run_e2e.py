"""What issue 31 must show, end to end: a Llama run of real nodes on a prepared dataset with a trained BPE
tokenizer, committing on anvil; audited with the dataset (screening and reruns read their batches from it as
the nodes did; a wrong dataset is refused naming the mismatch); pulled into ``transformers`` with its
tokenizer, whose logits match the project's forward within 1e-5 and which generates text.

One module-scoped run: anvil, 2 ``dlx-node start`` processes (2 replicas x 1 stage: every round is screened),
``llama-tiny`` at a 384-token byte-level BPE trained on the project's generated text, 2 outer rounds of H=4, a
checkpoint every round, every record signed by both nodes. Slow (a few minutes on a loaded 2-core machine).
"""

from __future__ import annotations

import json

import pytest
import torch

from node.commands.launcher import LocalRun
from node.store.checkpoint import read_checkpoint
from node.tools.audit import audit_run
from node.tools.pull import pull_checkpoint
from node.tools.report import FAIL, OK
from training.config import ModelConfig
from training.data import generated_text
from training.model import GPT
from training.prepare import prepare_dataset, train_tokenizer
from training.sharded_corpus import read_manifest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # a run of real nodes on a loaded machine
ROUNDS = 2


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama-data")
    text = root / "corpus.txt"
    text.write_text(generated_text(seed=21, n_bytes=120_000))
    tokenizer = train_tokenizer([text], 384)
    prepare_dataset([text], root / "ds", tokenizer, shard_tokens=8192)
    # The same ids with another held-out split: another dataset (another root) of the same text.
    prepare_dataset([text], root / "other", tokenizer, eval_fraction=0.2, shard_tokens=8192)
    return root, tokenizer


@pytest.fixture(scope="module")
def run(dataset, tmp_path_factory):
    root, tokenizer = dataset
    local = LocalRun(
        tmp_path_factory.mktemp("llama-run"), replicas=2, stages=1, split=False, attest_quorum=2,
        settings=["model.preset=llama-tiny", f"model.vocab_size={tokenizer.vocab_size}",
                  f"model.tokenizer={root / 'ds' / 'tokenizer.json'}", f"training.data_path={root / 'ds'}",
                  "diloco.inner_steps=4", "training.batch_size=4", f"rounds={ROUNDS}", "checkpoint_every=1",
                  "round_timeout=120", "join_timeout=120"],
    )
    try:
        local.setup()
        local.start()
        ok = local.wait(900, progress=True)
        logs = "\n".join(p.read_text(errors="replace")[-3000:] for s in local.nodes
                         for p in s.data_dir.glob("*.log"))
        assert ok, logs
        assert [c.commit.round for c in local.client().history(local.run_id).commits] \
            == list(range(ROUNDS)), logs
        yield local
    finally:
        local.stop()


def test_the_run_committed_to_its_dataset_and_an_audit_with_it_passes(run, dataset):
    root, _ = dataset
    client = run.client()
    archives = [slot.data_dir for slot in run.nodes]
    document = json.loads((archives[0] / "archive" / f"run-{run.run_id}" / "run.json").read_text())
    assert document["model"]["family"] == "llama"
    assert document["training"]["data_sha256"] == f"manifest:{read_manifest(root / 'ds')[1].root}"
    report = audit_run(client, run.run_id, archives=archives, data_path=root / "ds", reexecute=-1)
    assert report.ok, [c.line() for c in report.all_checks() if c.status != OK]
    reruns = [c for c in report.general if c.name.startswith("re-execution")]
    assert reruns and all(c.status == OK for c in reruns), [c.line() for c in reruns]
    # Screened rounds were re-derived on the dataset's held-out batches, as the nodes screened them.
    assert all(r.status == OK for r in report.rounds)

    wrong = audit_run(client, run.run_id, archives=archives, data_path=root / "other", reexecute=1)
    assert not wrong.ok and not [c for c in wrong.all_checks() if c.status == FAIL]  # not verified, not a lie
    refused = [c.line() for c in wrong.all_checks() if "dataset root" in c.line()]
    assert refused, [c.line() for c in wrong.all_checks() if c.status != OK]
    assert read_manifest(root / "other")[1].root in refused[0]


def test_pulled_into_transformers_with_its_tokenizer_it_matches_our_forward_and_generates(run, dataset,
                                                                                          tmp_path):
    transformers = pytest.importorskip("transformers")
    _, tokenizer = dataset
    client = run.client()
    latest = client.latest_checkpoint(run.run_id)
    out = tmp_path / "model"
    result = pull_checkpoint(client, run.run_id, out, archives=[slot.data_dir for slot in run.nodes],
                             final_only=False)
    assert result.round == latest.round == ROUNDS - 1
    tok = transformers.AutoTokenizer.from_pretrained(out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    text = "The quick brown fox"
    assert tok(text)["input_ids"] == tokenizer.encode(text) and tok.decode(tok(text)["input_ids"]) == text
    checkpoint = read_checkpoint(run.nodes[0].data_dir / "checkpoints"
                                 / f"round-{latest.round:08d}.safetensors",
                                 latest.content_hash)
    ours = GPT(ModelConfig(**checkpoint.model_config), seed=None)
    ours.load_state_dict(checkpoint.weights)
    ours.eval()
    batch = torch.randint(0, tokenizer.vocab_size, (2, ours.cfg.block_size),
                          generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(hf(batch).logits, ours(batch)[0], atol=1e-5, rtol=0)
        prompt = tok(text, return_tensors="pt")
        generated = hf.generate(**prompt, max_new_tokens=16, do_sample=False)
    assert generated.shape[1] == prompt["input_ids"].shape[1] + 16
    assert tok.decode(generated[0]).startswith(text)
    assert torch.equal(generated, ours.generate(prompt["input_ids"], 16)[:, : generated.shape[1]])
