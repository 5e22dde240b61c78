"""``dlx-node pull`` against a real short run (tests/short_run_fixtures.py), shared by every test here.

The download is checked against the chain's checkpoint hash: from local archives or from peers, a
tampered file is refused and nothing is left behind. ``dlx-node audit``: tests/test_audit_e2e.py.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from short_run_fixtures import cli_args, client, node_archives, run  # noqa: F401 (client, run: fixtures)

from node.cli import exit_code_for
from node.errors import NodeError, PullUnavailable, RunDocumentMissing
from node.tools.evidence import PeerFetcher
from node.tools.pull import NoCheckpoint, PullRefused, pull_checkpoint
from node.tools.pull_cli import run_pull
from short_run_fixtures import cli_args, client, node_archives, run  # noqa: F401 (client, run: fixtures)


def _serve(tmp_path: Path, name: str, files: list[Path]):
    """A real libp2p host in its own process (``python -m p2p.serve``) providing ``files`` as blobs."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "p2p.serve", "--data-dir", str(tmp_path / name), *map(str, files)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    info = json.loads(proc.stdout.readline())
    return proc, info


def _stop(proc) -> None:
    proc.stdin.close()
    proc.wait(timeout=30)


# ---------------------------------------------------------------------- pull
@pytest.mark.timeout(240, func_only=True)
def test_pull_from_peers_gives_a_transformers_model_with_our_logits(run, client, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from node.store.checkpoint import read_checkpoint
    from training.config import ModelConfig
    from training.model import GPT

    latest = client.latest_checkpoint(run.run_id)
    files = [s.data_dir / "checkpoints" / f"round-{latest.round:08d}.safetensors" for s in run.nodes]
    # Two providers of the checkpoint and one bootstrap peer without it: the download still succeeds. The
    # run document (by the chain's configHash) comes from the third.
    document = run.nodes[0].data_dir / "archive" / f"run-{run.run_id}" / "run.json"
    servers = [
        _serve(tmp_path, "p0", files[:1]),
        _serve(tmp_path, "p1", files[1:]),
        _serve(tmp_path, "p2", [document]),
    ]
    fetcher = None
    try:
        fetcher = PeerFetcher.start([info["listen_addrs"][0] for _proc, info in servers])
        out = tmp_path / "model"
        result = pull_checkpoint(client, run.run_id, out, fetcher=fetcher, final_only=False)
    finally:
        if fetcher is not None:
            fetcher.close()
        for proc, _info in servers:
            _stop(proc)
    assert (result.round, result.content_hash, result.source) == (
        latest.round,
        latest.content_hash.hex(),
        "peers",
    )
    assert json.loads((out / "dlx_provenance.json").read_text())["content_hash"] == latest.content_hash.hex()

    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = tokenizer("To be, or not", return_tensors="pt")
    assert ids["input_ids"].tolist() == [list(b"To be, or not")]  # byte-level: token id = byte
    checkpoint = read_checkpoint(files[0], latest.content_hash)
    ours = GPT(ModelConfig(**checkpoint.model_config), seed=None)
    ours.load_state_dict(checkpoint.weights)
    ours.eval()
    with torch.no_grad():
        theirs = model(ids["input_ids"]).logits
        mine, _ = ours(ids["input_ids"])
    torch.testing.assert_close(theirs, mine, atol=1e-4, rtol=0)  # same weights, float32: ~1e-6 apart
    generated = model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert generated.shape[1] == ids["input_ids"].shape[1] + 12
    assert tokenizer.decode(generated[0]).startswith("To be, or not")
    assert generated[0].tolist() == ours.generate(ids["input_ids"], 12)[0].tolist()
    # Past the context: plain transformers runs on the export's grown position table (issue 80: was an
    # IndexError); loaded with trust_remote_code the directory's custom_generate slides the window as nanoGPT
    # does.
    block = model.config.dlx_context
    assert model.generate(**ids, max_new_tokens=block, do_sample=False).shape[1] == \
        ids["input_ids"].shape[1] + block
    sliding = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    longer = sliding.generate(**ids, max_new_tokens=block, do_sample=False)
    assert longer.shape[1] == ids["input_ids"].shape[1] + block
    assert longer[0, :generated.shape[1]].tolist() == generated[0].tolist()


@pytest.mark.timeout(180, func_only=True)
def test_pull_refuses_a_tampered_checkpoint(run, client, tmp_path, capsys):
    latest = client.latest_checkpoint(run.run_id)
    good = run.nodes[0].data_dir / "checkpoints" / f"round-{latest.round:08d}.safetensors"
    tampered_dir = tmp_path / "tampered"
    tampered_dir.mkdir()
    data = bytearray(good.read_bytes())
    data[-100] ^= 0x01  # a weight's low bit: still a valid safetensors file
    (tampered_dir / good.name).write_bytes(bytes(data))
    document = run.nodes[0].data_dir / "archive" / f"run-{run.run_id}" / "run.json"
    # the run document is there: only bytes differ
    (tampered_dir / "run.json").write_bytes(document.read_bytes())
    actual = hashlib.sha256(data).hexdigest()

    out = tmp_path / "out"
    with pytest.raises(PullRefused) as refused:
        pull_checkpoint(client, run.run_id, out, archives=[tampered_dir], final_only=False)
    assert exit_code_for(refused.value) == 9
    assert latest.content_hash.hex() in str(refused.value) and actual in str(refused.value)
    assert not out.exists()

    # A peer serving other bytes under the checkpoint's hash: the download is refused and deleted.
    proc, info = _serve(tmp_path, "liar", [good, document])
    fetcher = None
    try:
        blob = tmp_path / "liar" / "blobs" / latest.content_hash.hex()
        blob.write_bytes(bytes(data))  # same size, one bit flipped, served as the real thing
        fetcher = PeerFetcher.start(info["listen_addrs"][:1])
        with pytest.raises(PullRefused) as refused:
            pull_checkpoint(client, run.run_id, out, fetcher=fetcher, final_only=False)
    finally:
        if fetcher is not None:
            fetcher.close()
        _stop(proc)
    assert latest.content_hash.hex() in str(refused.value) and actual in str(refused.value)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]

    # The CLI with an intact archive: exit 0 and the two lines an agent developer pastes.
    args = cli_args(
        run,
        archive=[str(tampered_dir), str(run.nodes[1].data_dir)],
        round=-1,
        out_dir=str(out),
        pending=True,  # the run just ended: its rounds are inside their dispute window
    )
    assert run_pull(args) == 0
    printed = capsys.readouterr().out.splitlines()
    assert any(line.startswith(f"round {latest.round} is NOT final (--pending)") for line in printed)
    assert any("AutoModelForCausalLM.from_pretrained" in line for line in printed)
    assert any(line.startswith(f"round {latest.round} (block ") and "attested by" in line for line in printed)
    assert any("member since block" in line for line in printed)
    assert any("model.generate" in line for line in printed)
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()


@pytest.mark.timeout(60, func_only=True)
def test_pull_names_what_is_missing_and_never_overwrites(run, client, tmp_path):
    with pytest.raises(
        NoCheckpoint,
        match=r"no checkpoint published for round 99 \(it is not committed\); published rounds: \[0, 1, 2\]",
    ):
        pull_checkpoint(client, run.run_id, tmp_path / "out", round_index=99, archives=node_archives(run),
                        final_only=False)
    with pytest.raises(RunDocumentMissing, match="run document .* is not available"):
        pull_checkpoint(client, run.run_id, tmp_path / "out", archives=[tmp_path], final_only=False)
    document = run.nodes[0].data_dir / "archive" / f"run-{run.run_id}" / "run.json"
    (tmp_path / "run.json").write_bytes(document.read_bytes())
    with pytest.raises(PullUnavailable, match="no --archive directory holds it"):  # exit 9, as any refusal
        pull_checkpoint(client, run.run_id, tmp_path / "out", archives=[tmp_path], final_only=False)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    with pytest.raises(NodeError, match="not empty"):
        pull_checkpoint(client, run.run_id, busy, archives=node_archives(run), final_only=False)
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]
    # An older round on request.
    result = pull_checkpoint(client, run.run_id, tmp_path / "round0", round_index=0,
                             archives=node_archives(run), final_only=False)
    assert result.round == 0 and (tmp_path / "round0" / "config.json").exists()
