"""An organizer's second run (issue 80 point 3), on the session's real anvil.

A run file makes one run: ``create-run`` of it again after every round is committed says the run is over and
how to make the next one (exit 6, nothing sent), not "finishing it". An account registers one node key, so
the next run's node directory takes it with ``--identity OLD/identity.key``; without it the refusal says so.
The real ``dlx-node create-run`` (a process of its own) makes the second run; the organizer is its member. A
contributor's account registered with the key of another node directory joins with ``--identity`` too.
Also (point 7): ``run-info`` takes ``--run``/``--deployment`` as a real command, and the hint of a chain that
mines on demand names a command the machine has (``dlx-node mine``, not ``cast``): run as printed, it mines.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ledger_fixtures import FAST_RETRY, fresh_anvil_w3

from ledger.account import dev_account
from ledger.binding import binding_message
from ledger.client import LedgerClient
from ledger.records import RoundRecord
from node.cli import main
from p2p.identity import Identity

REPO = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "node.cli"]

RUN_FILE = """\
run_name = "{name}"
rounds = 1
checkpoint_every = 1

[model]
preset = "tiny"

[diloco]
inner_steps = 5
num_replicas = 1

[pipeline]
num_stages = 1

[run]
stake_eth = 0.5
quorum = 1
accusation_blocks = 8
dispute_blocks = 8
"""


@pytest.fixture
def chain(request, tmp_path):
    """A reset anvil with fresh contracts and their deployment.json."""
    w3 = fresh_anvil_w3(request, timeout=10.0)
    registry, ledger = LedgerClient.deploy(w3, dev_account(0, w3.eth.chain_id), retry=FAST_RETRY)
    path = tmp_path / "deployment.json"
    path.write_text(json.dumps({"chain_id": w3.eth.chain_id, "rpc_url": w3.provider.endpoint_uri,
                                "registry": registry, "ledger": ledger, "from_block": 0}))
    return w3, path, registry, ledger


def _create_run_command(tmp_path, deployment, name: str, data_dir: str, *extra: str) -> list[str]:
    run_file = tmp_path / f"{name}.toml"
    run_file.write_text(RUN_FILE.format(name=name))
    return ["create-run", str(run_file), "--deployment", str(deployment), "--data-dir",
            str(tmp_path / data_dir), "--listen-port", "24998", "--confirmations", "1", "--dev-account", "3",
            "--weak-run", "--yes", *extra]


def _dlx_node(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def _commit_every_round(w3, registry: str, ledger: str, run_id: int) -> None:
    """The organizer (the run's one member, quorum 1) commits its one round."""
    organizer = LedgerClient(w3, dev_account(3, w3.eth.chain_id), registry, ledger)
    record = RoundRecord(run_id=run_id, round=0, prev_head=organizer.head_of(run_id),
                         weights_root=b"\x01" * 32, contributions_root=b"\x02" * 32,
                         train_loss_micro=3_500_000, eval_loss_micro=3_600_000, tokens=4096,
                         num_contributors=1, checkpoint_hash=b"\x03" * 32)
    organizer.commit_round(record, [organizer.sign_record(record)])
    assert organizer.commit_count(run_id) == 1


def test_an_organizers_second_run_after_the_first_ended(chain, tmp_path, capsys):
    w3, deployment, registry, ledger = chain
    client = LedgerClient(w3, None, registry, ledger)
    assert main(_create_run_command(tmp_path, deployment, "first", "org")) == 0
    capsys.readouterr()
    _commit_every_round(w3, registry, ledger, 1)
    # The same command after the run ended: it is over (6), nothing sent, and the way to the next run.
    again = _dlx_node(_create_run_command(tmp_path, deployment, "first", "org"))
    assert again.returncode == 6, again.stdout + again.stderr
    last = again.stderr.strip().splitlines()[-1]
    assert "run 1" in last and "is over" in last and "run_name" in last, last
    assert f"--identity {tmp_path / 'org' / 'identity.key'}" in last and "finishing" not in again.stdout, last
    assert client.run_count() == 1
    # A new run file in a new directory: a new key there is not the account's (6); the refusal names
    # --identity.
    assert main(_create_run_command(tmp_path, deployment, "second", "org2")) == 6
    assert "--identity OLD_DIR/identity.key" in capsys.readouterr().err
    assert client.run_count() == 1
    # With the account's key: the second run, its organizer a member of it, its node directory ready.
    second = _dlx_node(_create_run_command(tmp_path, deployment, "second", "org3", "--identity",
                                           str(tmp_path / "org" / "identity.key")))
    assert second.returncode == 0, second.stdout + second.stderr
    assert "created run 2" in second.stdout, second.stdout
    assert client.run_count() == 2
    organizer = dev_account(3, w3.eth.chain_id).address
    assert client.member(2, organizer).active
    key = Identity.load(tmp_path / "org" / "identity.key")
    assert Identity.load(tmp_path / "org3" / "identity.key").peer_id == key.peer_id
    assert (tmp_path / "org3" / "identity.key").stat().st_mode & 0o077 == 0
    assert key.peer_id in (tmp_path / "org3" / "run-link.txt").read_text()
    assert "run_id = 2" in (tmp_path / "org3" / "node.toml").read_text()
    # A directory holding another key is not overwritten by --identity.
    other = _create_run_command(tmp_path, deployment, "third", "org2", "--identity",
                                str(tmp_path / "org" / "identity.key"))
    assert main(other) == 2
    assert "already holds another node key" in capsys.readouterr().err and client.run_count() == 2


def test_a_contributors_next_run_takes_its_node_key_with_identity(chain, tmp_path, capsys):
    """An account that holds a seat elsewhere (its key in ``old/identity.key``) joins another run from a new
    directory: refused naming --identity (6, nothing sent); with it the key is taken and the join goes on to
    fetch the run document (from the link's peer, not running here: exit 10, the network)."""
    w3, deployment, registry, ledger = chain
    assert main(_create_run_command(tmp_path, deployment, "open", "org")) == 0
    link = (tmp_path / "org" / "run-link.txt").read_text().strip()
    capsys.readouterr()
    key = Identity.generate()
    key.save(tmp_path / "old" / "identity.key")
    account = dev_account(5, w3.eth.chain_id)
    member = LedgerClient(w3, account, registry, ledger)
    binding = key.sign(binding_message(w3.eth.chain_id, registry, account.address))
    member.register(key.public_key_bytes, binding)
    join = ["join", link, "--data-dir", str(tmp_path / "new"), "--dev-account", "5", "--yes", "--no-start",
            "--no-progress"]
    assert main(join) == 6
    assert "--identity OLD_DIR/identity.key" in capsys.readouterr().err
    assert LedgerClient(w3, None, registry, ledger).member(1, account.address) is None
    # --peer-wait 2: the link's peer is not running; join's wait for it (120 s by default, tested in
    # tests/test_exit_codes.py) is not what this test is about, the key taken is.
    proc = _dlx_node([*join, "--data-dir", str(tmp_path / "new2"), "--peer-wait", "2", "--identity",
                      str(tmp_path / "old" / "identity.key")])
    assert proc.returncode == 10, proc.stdout + proc.stderr
    assert "no peer of the run is reachable" in proc.stderr.strip().splitlines()[-1], proc.stderr
    assert Identity.load(tmp_path / "new2" / "identity.key").peer_id == key.peer_id


def test_run_info_by_run_and_deployment_and_a_mining_hint_that_runs(chain, tmp_path, capsys):
    w3, deployment, registry, ledger = chain
    assert main(_create_run_command(tmp_path, deployment, "info", "org")) == 0
    capsys.readouterr()
    url = w3.provider.endpoint_uri
    proc = _dlx_node(["run-info", "--rpc", url, "--run", "1", "--deployment", str(deployment), "--json"])
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["members"][0]["account"] == dev_account(3, w3.eth.chain_id).address
    assert _dlx_node(["run-info", "--rpc", url, "--deployment", str(deployment)]).returncode == 2  # no --run
    config = str(tmp_path / "org" / "node.toml")
    assert main(["leave", "--config", config, "--yes", "--confirmations", "1"]) == 0
    capsys.readouterr()
    proc = _dlx_node(["withdraw", "--config", config, "--yes"])
    assert proc.returncode == 14, proc.stdout + proc.stderr  # not yet: unbonding
    hint = proc.stderr.strip().splitlines()[-1]
    assert "no time estimate" in hint and "cast" not in hint and "`dlx-node mine N --rpc URL`" in hint, hint
    head = w3.eth.block_number
    mined = _dlx_node(["mine", "100", "--rpc", url])  # as the hint says
    assert mined.returncode == 0, mined.stdout + mined.stderr
    assert w3.eth.block_number == head + 100
