"""``dlx-node join``: the run link, and a fresh node joining a running local run with that one command."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from node_fixtures import TINY, run_logs

from ledger.account import dev_account
from node.commands.join import infer_checkpoint_every
from node.commands.link import RunLink, parse_run_link, run_link
from node.config import load_config
from node.errors import ConfigError
from node.runconfig import config_hash, run_document

LEDGER = "0x" + "ab" * 20
PEER = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWJWoaqZhDaoEFshF7Rh1bpY9ohihFhzcW6d69Lr2NASuq"


def test_a_run_link_round_trips_and_keeps_urls_readable():
    text = run_link(31337, LEDGER, 7, "https://rpc.example/v1?key=a&b=c",
                    [PEER, PEER.replace("4001", "4002")], checkpoint_every=2)
    assert text.startswith(f"dlx://31337/{LEDGER}/7?rpc=https://rpc.example/v1%3Fkey%3Da%26b%3Dc&peer=/ip4/")
    link = parse_run_link(text)
    assert link == RunLink(31337, LEDGER, 7, "https://rpc.example/v1?key=a&b=c",
                           (PEER, PEER.replace("4001", "4002")), {"checkpoint_every": 2})
    assert str(link) == text


@pytest.mark.parametrize("text, says", [
    ("http://31337/x/1", "must start with dlx://"),
    (f"dlx://main/{LEDGER}/1?rpc=http://a", "not a chain id"),
    (f"dlx://1/{LEDGER}?rpc=http://a", "expected dlx://<chain_id>/<ledger address>/<run id>"),
    ("dlx://1/0x1234/1?rpc=http://a", "20-byte hex address"),
    (f"dlx://1/0x{'zz' * 20}/1?rpc=http://a", "not hexadecimal"),
    (f"dlx://1/{LEDGER}/-1?rpc=http://a", "run id '-1' is not an integer"),
    (f"dlx://1/{LEDGER}/1", "exactly one rpc="),
    (f"dlx://1/{LEDGER}/1?rpc=http://a&rpc=http://b", "exactly one rpc="),
    (f"dlx://1/{LEDGER}/1?rpc=http://a&stake=100", "unknown parameter(s) ['stake']"),
    (f"dlx://1/{LEDGER}/1?rpc=http://a&peer=12D3KooW", "must be a multiaddr ending in /p2p/"),
    (f"dlx://1/{LEDGER}/1?rpc=http://a&checkpoint_every=0", "checkpoint_every must appear at most once"),
    (f"dlx://1/{LEDGER}/1?rpc=http://a&checkpoint_every=2&checkpoint_every=3", "at most once"),
])
def test_a_malformed_run_link_is_refused_saying_what_is_wrong(text, says):
    with pytest.raises(ConfigError) as err:
        parse_run_link(text)
    assert says in str(err.value)


def test_checkpoint_every_is_inferred_from_the_checkpointed_rounds():
    assert infer_checkpoint_every([]) is None
    assert infer_checkpoint_every([0, 1, 2]) == 1
    assert infer_checkpoint_every([1, 3, 5]) == 2
    assert infer_checkpoint_every([2]) == 3


def test_join_without_peers_or_chain_facts_says_what_to_pass(tmp_path):
    from node.cli import main

    assert main(["join", "--data-dir", str(tmp_path / "j"), "--rpc", "http://127.0.0.1:1", "--dev-account",
                 "1"]) == 2
    assert main(["join", f"dlx://1/{LEDGER}/1?rpc=http://127.0.0.1:1", "--data-dir", str(tmp_path / "j"),
                 "--dev-account", "1"]) == 2  # no peer
    assert not (tmp_path / "j" / "node.toml").exists()


def _wait_for(predicate, timeout: float, what: str, run, joiner=None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        assert joiner is None or joiner.poll() is None, f"dlx-node join exited with {joiner.returncode}\n" \
            + run_logs(run)
        assert run.running(), "the founder exited\n" + run_logs(run)
        time.sleep(1.0)
    raise AssertionError(f"{what} within {timeout}s\n" + run_logs(run))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("keeping", ["whole", "stages", "header"])
def test_a_fresh_node_joins_a_running_run_with_one_command(make_run, tmp_path, keeping):
    # An open-ended run of two replicas of which one is started: the founder trains alone until
    # the joiner, started from an empty directory with nothing but the run link, takes the other seat.
    # keeping: how the founder keeps its checkpoints (storage.checkpoints; "stages": its header and shards;
    # "header": a header-hashed run, diloco.checkpoint_hash = "header", whose nodes keep them split)
    setting = ["diloco.checkpoint_hash=header"] if keeping == "header" else [f"storage.checkpoints={keeping}"]
    run = make_run(replicas=2, stages=1, split=False, stake_wei=10**18,
                   settings=TINY + ["rounds=0", "join_timeout=5", "checkpoint_every=2", *setting])
    founder = run.nodes[0]
    run.start_node(founder)
    client = run.client()
    _wait_for(lambda: client.latest_checkpoint(run.run_id) is not None, 180, "no checkpoint committed", run)
    joiner_dir = tmp_path / "joiner"
    log = tmp_path / "join.log"
    account = dev_account(5, run.chain_id).address
    joiner = subprocess.Popen(
        [sys.executable, "-m", "node.cli", "--log-file", str(log), "join", run.link(), "--data-dir",
         str(joiner_dir), "--dev-account", "5", "--yes", "--no-progress",
         # The founder's thread count: one-stage screening evaluates losses with matmuls whose float sums
         # depend on it, and a decision at the threshold can then differ between members (reported).
         "--set", "torch_threads=1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        def joiner_counted() -> bool:
            # The joiner's contribution is in a committed round, and it signed or submitted a commit
            # (with k = 1 its turn in the rotation submits a record; the signatures may be the founder's).
            history = client.history(run.run_id, with_registrations=False)
            contributed = any(c.commit.num_contributors == 2 for c in history.commits)
            return contributed and any(account in (c.submitter, *c.attesters) for c in history.commits)

        _wait_for(joiner_counted, 400, "no commit with the joiner's contribution, signed or sent by it", run,
                  joiner)
    finally:
        if joiner.poll() is None:
            joiner.send_signal(signal.SIGTERM)
        output = joiner.communicate(timeout=60)[0].decode(errors="replace")
    run.stop_nodes()
    assert joiner.returncode == 0, output + "\n" + log.read_text(errors="replace")
    assert "fetched from the run's peers and checked against the chain" in output
    # What join wrote is a node.toml of exactly the run's settings, of its own cluster.
    cfg = load_config(joiner_dir / "node.toml")
    assert config_hash(run_document(cfg)) == client.run_info(run.run_id).config_hash
    assert (cfg.checkpoint_every, cfg.cluster_size, cfg.ledger.run_id) == (2, 1, run.run_id)
    assert cfg.cluster != founder.cluster
    seat = client.member(run.run_id, account)
    assert seat is not None and seat.stake == 10**18
    history = client.history(run.run_id)
    rounds = [c.commit.round for c in history.commits]
    assert rounds == list(range(len(rounds)))
    assert not history.disputes
    assert "from the chain-verified checkpoint of round" in log.read_text(errors="replace")
    # a chunked run (new runs' scheme): the joiner read its stage of the file by range, checked against the
    # record's stage leaves, and wrote none of the whole model's file (issue 75); from a founder that kept it
    # split, from its header and the founder's stage shard
    assert ("fetched by range from" if keeping == "whole" else "stage shards (kept split), checked against "
            "the record") in log.read_text(errors="replace")
    if keeping != "whole":
        kept = {p.name.split(".", 1)[1] for p in (founder.data_dir / "checkpoints").glob("round-*")}
        assert kept == {"head", "split.json"}, kept  # no whole file on the founder
    if keeping == "header":
        _header_hashed_records_pull_and_audit(client, run, founder, joiner_dir, tmp_path)


def _header_hashed_records_pull_and_audit(client, run, founder, joiner_dir, tmp_path) -> None:
    """A header-hashed run's records: each names the hash of its checkpoint's header (docs/PROTOCOL.md), kept
    by the founder; pull and audit assemble the file from the node directories and check it."""
    from node.store.checkpoint_hash import header_hash
    from node.tools.audit import audit_run
    from node.tools.pull import pull_checkpoint
    from node.tools.report import OK

    assert run_document(load_config(joiner_dir / "node.toml"))["diloco"]["checkpoint_hash"] == "header"
    history = client.history(run.run_id, with_registrations=False)
    named = {c.commit.round: c.commit.checkpoint_hash for c in history.commits if c.commit.has_checkpoint}
    heads = {int(p.name[6:14]): p for p in (founder.data_dir / "checkpoints").glob("round-*.head")
             if int(p.name[6:14]) in named}  # (a round built at the stop may not be committed)
    assert heads and all(named[r] == header_hash(p.read_bytes()) for r, p in heads.items()), (heads, named)
    latest = max(heads)
    result = pull_checkpoint(client, run.run_id, tmp_path / "pulled", round_index=latest,
                             archives=[founder.data_dir], final_only=False)
    assert result.content_hash == named[latest].hex() and result.file_sha256 not in ("", result.content_hash)
    report = audit_run(client, run.run_id, archives=[founder.data_dir, joiner_dir], replay=False)
    checked = [c for c in report.checkpoints if c.round == latest]
    assert checked and checked[0].status == OK and "header hash" in checked[0].reason, report.checkpoints
