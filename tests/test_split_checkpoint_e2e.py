"""A run whose nodes keep their checkpoints split, end to end (issue 75), its records header-hashed
(``diloco.checkpoint_hash = "header"``: the record names the hash of the checkpoint's header, so each
committer signs with its own stage only, and every node keeps its checkpoints split).

Real node processes, real anvil, real gloo pipelines: 2 replicas x 2 stages, one node per stage, a checkpoint
every round, every node keeping a checkpoint round's header and its own stage shards only
(node/store/checkpoint_split.py). One stage node is killed with SIGKILL and started again: with no whole file
on its disk it enters from its kept split (node/live/round/entry.py, ``_split_stages``), its pipeline
re-forms and the run goes on committing. Then ``dlx-node pull``, told of one live node only (which holds one
stage), assembles the checkpoint from the header and the shards the live nodes serve under the record's keys
(the other stage's holders found on the DHT), checks it against the chain's hash and writes a model that
loads in transformers and gives our own model's logits. Then the whole run is stopped and replica 0's two
nodes started alone: with no other holder of its stage alive, each enters from its own kept split (header
and stage shard from its own directory); the others come back and the run commits on. No node ever kept a
whole checkpoint.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import pytest
from node_fixtures import TINY, node_log, run_logs, stopped_cleanly, wait_for

KEPT_SPLIT = "from its header and stage shards (kept split), checked against the record"


def _stage(slot) -> int:
    placed = re.findall(r"placed: cluster \S+ replica \d+ stages \[(\d+)\]", node_log(slot))
    assert placed, node_log(slot)[-3000:]
    return int(placed[-1])


def _no_whole_checkpoint(run, published) -> None:
    """No node keeps a whole checkpoint file, by its round's name or under its content hash."""
    for slot in run.nodes:
        whole = sorted(p.name for p in (slot.data_dir / "checkpoints").glob("round-*.safetensors"))
        assert not whole, (slot.name, whole)
        blobs = slot.data_dir / "blobs"
        held = [c.round for c in published if (blobs / c.content_hash.hex()).exists()]
        assert not held, (slot.name, held)


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_a_node_restarts_from_its_kept_split_and_pull_assembles_from_live_nodes(make_run, tmp_path):
    run = make_run(replicas=2, stages=2, split=True,
                   settings=[*TINY, "diloco.checkpoint_hash=header", "rounds=0", "join_timeout=60"])
    run.start()
    client = run.client()

    def last() -> int:
        committed = client.last_round(run.run_id)
        return -1 if committed is None else committed

    wait_for(lambda: last() >= 1 and client.latest_checkpoint(run.run_id) is not None, 400,
             "round 1 committed with a checkpoint", run, none_exits=True)
    survivor, victim = [s for s in run.nodes if s.cluster == "cluster-0"]
    run.kill(victim, signal.SIGKILL)
    kept = sorted((victim.data_dir / "checkpoints").glob("round-*.split.json"))
    assert kept, sorted(p.name for p in (victim.data_dir / "checkpoints").iterdir())
    assert not list((victim.data_dir / "checkpoints").glob("round-*.safetensors"))
    wait_for(lambda: "waiting for the partner to come back" in node_log(survivor), 240,
             "the survivor noticed the broken pipeline", run)
    run.start_node(victim)
    wait_for(lambda: KEPT_SPLIT in node_log(victim), 300, "the restarted node entered from a kept split", run)
    wait_for(lambda: "re-formed; entering at round" in node_log(survivor), 300, "the pipeline re-formed", run)
    reentry = int(node_log(survivor).split("re-formed; entering at round ")[1].split()[0])
    wait_for(lambda: last() >= reentry + 1, 400, "the round after the re-entry committed", run)
    assert f"entering at round {reentry}" in node_log(victim)
    # What it entered from: a checkpoint of the record's, its stage read from a header and a stage shard.
    entered = int(re.search(r"round (\d+)'s checkpoint: stages \[\d+\] " + re.escape(KEPT_SPLIT),
                            node_log(victim)).group(1))
    assert f"restored stages [{_stage(victim)}] from the chain-verified checkpoint of round {entered}" \
        in node_log(victim)

    # Pull from the live nodes, told of one node of the other replica only: one stage's holder.
    latest = client.latest_checkpoint(run.run_id)
    named = next(s for s in run.nodes if s.cluster != "cluster-0")
    out = tmp_path / "model"
    pulled = subprocess.run(
        [sys.executable, "-m", "node.cli", "pull", "--rpc", run.url, "--run", str(run.run_id), "--deployment",
         str(run.workdir / "deployment.json"), "--bootstrap", named.multiaddr, "--round", str(latest.round),
         "--pending", str(out)],
        capture_output=True, text=True, timeout=400)
    assert pulled.returncode == 0, pulled.stdout + pulled.stderr + run_logs(run)
    assert f"checkpointHash {latest.content_hash.hex()} (its header's), file sha256" in pulled.stdout \
        and "from peers" in pulled.stdout, pulled.stdout
    # its record names no whole file: never asked for, its header and shards assembled
    assert "not downloaded whole" not in pulled.stderr, pulled.stderr[-3000:]
    assert "not assembled" not in pulled.stderr, pulled.stderr[-3000:]
    assert len(run.running()) == len(run.nodes), run_logs(run)  # pulled from live nodes

    # The whole run stopped; replica 0's pair started alone: no live node but itself holds its stage, so
    # each enters from its own kept split (its header and stage shard, no whole file); then the rest.
    run.stop_nodes()
    assert all(s.process.returncode == 0 for s in run.nodes), run_logs(run)
    stopped_at = last()
    pair = [survivor, victim]
    kept = {s.name: {int(p.name[6:14]) for p in (s.data_dir / "checkpoints").glob("round-*.split.json")}
            for s in pair}
    for slot in pair:
        run.start_node(slot)

    def this_life(slot) -> str:
        return slot.log_path.read_text(errors="replace")

    restored = "from the chain-verified checkpoint of round"  # logged a moment after KEPT_SPLIT
    wait_for(lambda: all(KEPT_SPLIT in this_life(s) and restored in this_life(s) for s in pair), 300,
             "replica 0's nodes entered from their own kept splits", run)
    for slot in pair:
        entered = int(re.search(r"round (\d+)'s checkpoint: stages \[\d+\] " + re.escape(KEPT_SPLIT),
                                this_life(slot)).group(1))
        assert entered in kept[slot.name], (slot.name, entered, sorted(kept[slot.name]))
        assert f"from the chain-verified checkpoint of round {entered}" in this_life(slot)
    for slot in run.nodes:
        if slot not in pair:
            run.start_node(slot)
    wait_for(lambda: last() >= stopped_at + 2, 400, "two rounds committed after the restart", run)
    history, rounds = stopped_cleanly(run, client)  # every node exited 0, rounds in order, none missing
    assert rounds[-1] >= reentry + 1
    assert history.checkpoints, rounds
    _no_whole_checkpoint(run, history.checkpoints)
    for slot in run.nodes:  # every node kept the split of the latest checkpoint round it built
        assert list((slot.data_dir / "checkpoints").glob("round-*.head")), slot.name

    import torch
    from transformers import AutoModelForCausalLM

    from node.config import load_config
    from node.runconfig import config_hash, run_document
    from node.store.checkpoint import RunLayout, checkpoint_problems, read_checkpoint
    from node.store.checkpoint_hash import file_record_hash
    from node.tools.evidence import find_checkpoint_files
    from training.config import ModelConfig
    from training.model import GPT

    # The file the record names, assembled from the node directories' kept headers and shards.
    files = find_checkpoint_files([s.data_dir for s in run.nodes], latest.round, latest.content_hash.hex())
    assert files, [sorted(p.name for p in (s.data_dir / "checkpoints").iterdir()) for s in run.nodes]
    assert file_record_hash(files[0], True) == latest.content_hash  # the record names its header's hash
    checkpoint = read_checkpoint(files[0])  # and its header the leaves of every stage's tensors:
    document = run_document(load_config(run.nodes[0].config_path))
    layout = RunLayout.of_document(run.run_id, config_hash(document), document)
    commit = next(c.commit for c in history.commits if c.commit.round == latest.round)
    assert layout.header_hashed
    assert checkpoint_problems(checkpoint, layout, latest.round, commit.weights_root) == []
    ours = GPT(ModelConfig(**checkpoint.model_config), seed=None)
    ours.load_state_dict(checkpoint.weights)
    ours.eval()
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([list(b"To be, or not")])
    with torch.no_grad():
        theirs = model(ids).logits
        mine, _ = ours(ids)
    torch.testing.assert_close(theirs, mine, atol=1e-4, rtol=0)
