"""deploy, create-run, leave, withdraw, run-info, and audit/pull's run link: bad input is refused with one
line and a non-zero exit code, before anything is sent; what is sent is what was listed. On the session's real
anvil."""

from __future__ import annotations

import json
import logging
from math import prod

import pytest
from eth_account import Account
from ledger_fixtures import FAST_RETRY, fresh_anvil_w3, mine

from ledger.account import create_keystore, dev_account
from ledger.client import LedgerClient
from ledger.runparams import game_steps_for, proof_window_bound
from node.cli import main
from node.commands.runfile import read_run_file
from node.commands.runpool import verify_pool
from node.commitments import UNNAMED, scheme_named
from node.config import config_from_dict
from node.errors import ConfigError
from training.chunks import CHUNK_ELEMENTS
from training.stages import split_stages, stage_param_shapes

RUN_FILE = """\
run_name = "cmd-test"
rounds = 3
checkpoint_every = 1

[model]
preset = "tiny"

[diloco]
inner_steps = 5
num_replicas = 2

[pipeline]
num_stages = 1

[run]
stake_eth = 0.5
quorum = 2
accusation_blocks = 8
dispute_blocks = 8
"""


@pytest.fixture(autouse=True)
def _fresh_log_handlers():
    """main() points the root logger at this test's captured stderr: forget it afterwards."""
    yield
    logging.getLogger().handlers[:] = []


@pytest.fixture
def w3(request):
    """A fresh (reset) anvil chain: its test deploys the contracts it uses."""
    return fresh_anvil_w3(request, timeout=10.0)


@pytest.fixture
def deployed(w3, tmp_path):
    """Fresh contracts and their deployment.json (as dlx-node deploy writes it)."""
    registry, ledger = LedgerClient.deploy(w3, dev_account(0, w3.eth.chain_id), retry=FAST_RETRY)
    path = tmp_path / "deployment.json"
    path.write_text(json.dumps({"chain_id": w3.eth.chain_id, "rpc_url": w3.provider.endpoint_uri,
                                "registry": registry, "ledger": ledger, "from_block": 0}))
    return path, registry, ledger


def run_file(tmp_path, text=RUN_FILE, name="run.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def run_count(w3, ledger: str, registry: str) -> int:
    return LedgerClient(w3, None, registry, ledger).run_count()


def create(tmp_path, deployment, *extra, data_dir="org", account=("--dev-account", "3")) -> int:
    return main(["create-run", str(run_file(tmp_path)), "--deployment", str(deployment), "--data-dir",
                 str(tmp_path / data_dir), "--listen-port", "24999", "--confirmations", "1", *account,
                 *extra])


# ---------------------------------------------------------------------- run file
@pytest.mark.parametrize("edit, says", [
    (lambda t: t.replace("quorum = 2", "quorum = 0"), "quorum=0: must be an integer >= 1"),
    (lambda t: t.replace("quorum = 2", "quorum = 5"), "can never be met"),
    (lambda t: t.replace("stake_eth = 0.5", "stake_eth = -1"), "stake_eth=-1"),
    (lambda t: t.replace("stake_eth = 0.5", 'stake_eth = "lots"'), "must be a number"),
    (lambda t: t + "unbonding_blocks = 10\n", "at least the longest proof window"),
    (lambda t: t + "quorum_bps = 20000\n", "quorum_bps=20000"),
    (lambda t: t + "stake = 1\n", "unknown \\[run\\] key"),
    (lambda t: t.split("[run]")[0], "needs a \\[run\\] table"),
    (lambda t: t.replace("rounds = 3", "rounds = 0"), "rounds"),
    (lambda t: t + "\n[ledger]\nrun_id = 3\n", "\\[ledger\\] is the organizer's"),
    (lambda t: t.replace("[model]", "[model\n"), "not valid TOML"),
])
def test_a_run_file_with_a_bad_value_is_refused_naming_it(tmp_path, edit, says):
    with pytest.raises(ConfigError, match=says):
        read_run_file(str(run_file(tmp_path, edit(RUN_FILE))))


def test_a_run_files_paths_are_taken_relative_to_it(tmp_path):
    (tmp_path / "book.txt").write_text("some training text " * 50)
    parsed = read_run_file(str(run_file(tmp_path, RUN_FILE.replace("[model]", '[training]\ndata_path = '
                                                                            '"book.txt"\n\n[model]'))))
    assert parsed.cfg.training.data_path == str((tmp_path / "book.txt").resolve())


# ---------------------------------------------------------------------- deploy
def test_deploy_refuses_a_wrong_chain_id_and_sends_nothing(w3, tmp_path, capsys):
    account = dev_account(8, w3.eth.chain_id).address
    nonce = w3.eth.get_transaction_count(account)
    out = tmp_path / "deployment.json"
    assert main(["deploy", "--rpc", w3.provider.endpoint_uri, "--chain-id", "11155111", "--dev-account", "8",
                 "--yes", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "serves chain id 31337, not 11155111" in err
    assert not out.exists() and w3.eth.get_transaction_count(account) == nonce


def test_deploy_writes_a_checked_deployment_and_never_overwrites_it(w3, tmp_path, capsys):
    out = tmp_path / "deployment.json"
    assert main(["deploy", "--rpc", w3.provider.endpoint_uri, "--dev-account", "8", "--yes", "--out",
                 str(out), "--confirmations", "1"]) == 0
    deployment = json.loads(out.read_text())
    client = LedgerClient(w3, None, deployment["registry"], deployment["ledger"])
    client.check_deployment()
    assert deployment["chain_id"] == w3.eth.chain_id and client.run_count() == 0
    verify_pool(w3, deployment["reward_pool"], deployment["ledger"])  # the runs' reward pools (issue 77)
    assert "matches the committed artifacts" in capsys.readouterr().out
    assert main(["deploy", "--rpc", w3.provider.endpoint_uri, "--dev-account", "8", "--yes", "--out",
                 str(out)]) == 2


def test_deploy_without_an_account_or_without_consent_sends_nothing(w3, tmp_path, capsys):
    out = tmp_path / "deployment.json"
    assert main(["deploy", "--rpc", w3.provider.endpoint_uri, "--out", str(out)]) == 2
    assert "no account" in capsys.readouterr().err
    account = dev_account(8, w3.eth.chain_id).address
    nonce = w3.eth.get_transaction_count(account)
    assert main(["deploy", "--rpc", w3.provider.endpoint_uri, "--dev-account", "8", "--out", str(out)]) == 2
    assert "pass --yes" in capsys.readouterr().err  # pytest's stdin is no terminal: nobody to ask
    assert not out.exists() and w3.eth.get_transaction_count(account) == nonce


# ---------------------------------------------------------------------- create-run
def test_create_run_refuses_an_address_without_the_contract(w3, tmp_path, deployed, capsys):
    path, _, _ = deployed
    deployment = json.loads(path.read_text())
    deployment["ledger"] = dev_account(9, w3.eth.chain_id).address  # an account, no code
    path.write_text(json.dumps(deployment))
    assert create(tmp_path, path, "--yes") == 2
    assert "no code" in capsys.readouterr().err
    assert not (tmp_path / "org" / "node.toml").exists()


def test_create_run_refuses_a_deployment_of_another_chain(w3, tmp_path, deployed, capsys):
    path, registry, ledger = deployed
    deployment = json.loads(path.read_text())
    deployment["chain_id"] = 10
    path.write_text(json.dumps(deployment))
    assert create(tmp_path, path, "--yes") == 2
    assert "not 10" in capsys.readouterr().err
    assert run_count(w3, ledger, registry) == 0


def test_create_run_with_too_little_balance_for_stake_and_gas_sends_nothing(w3, tmp_path, deployed, capsys):
    path, registry, ledger = deployed
    password = tmp_path / "password"
    password.write_text("correct horse battery staple\n")
    account = create_keystore(tmp_path / "keystore.json", "correct horse battery staple")
    funder = LedgerClient(w3, dev_account(0, w3.eth.chain_id), registry, ledger, retry=FAST_RETRY)
    funder.sender.send({"to": account.address, "value": 10**17}, "fund")  # 0.1 ETH: the stake is 0.5
    assert create(tmp_path, path, "--yes", account=("--keystore", str(tmp_path / "keystore.json"),
                                                    "--password-file", str(password))) == 2
    err = capsys.readouterr().err
    assert "holds 0.100000 ETH" in err and "nothing was sent" in err
    assert run_count(w3, ledger, registry) == 0 and w3.eth.get_transaction_count(account.address) == 0
    assert not (tmp_path / "org" / "node.toml").exists()


def test_create_run_with_values_the_contract_refuses_sends_nothing(w3, tmp_path, deployed, capsys):
    path, registry, ledger = deployed
    text = RUN_FILE.replace("accusation_blocks = 8", "accusation_blocks = 99999999999")
    (tmp_path / "run.toml").write_text(text)
    code = main(["create-run", str(tmp_path / "run.toml"), "--deployment", str(path), "--data-dir",
                 str(tmp_path / "org"), "--dev-account", "3", "--yes"])
    assert code == 11  # a ledger error: the contract's own refusal, decoded in the preflight
    assert "BadWindow" in capsys.readouterr().err
    assert run_count(w3, ledger, registry) == 0


def test_create_run_creates_joins_and_a_rerun_finishes_without_a_second_run(w3, tmp_path, deployed, capsys):
    path, registry, ledger = deployed
    assert create(tmp_path, path, "--yes") == 0
    out = capsys.readouterr().out
    link = (tmp_path / "org" / "run-link.txt").read_text().strip()
    assert link in out and "/tcp/24999/p2p/12D3KooW" in link and "checkpoint_every=1" in link
    client = LedgerClient(w3, None, registry, ledger)
    info = client.run_info(1)
    assert (info.min_stake, info.quorum, info.max_rounds) == (5 * 10**17, 2, 3)
    # (issue 62) the tiny model's one stage bisects in ceil(log2(chunks)) steps, four more; unbonding covers
    # the longest proof window of such a game
    model = config_from_dict({"model": {"preset": "tiny"}}).model  # RUN_FILE's
    shapes = stage_param_shapes(model, split_stages(model.n_layer, 1)[0]).values()
    assert info.max_game_steps == game_steps_for(sum(-(-prod(shape) // CHUNK_ELEMENTS) for shape in shapes))
    assert info.unbonding_blocks == proof_window_bound(8, 8, info.max_game_steps)
    organizer = dev_account(3, w3.eth.chain_id).address
    assert client.member(1, organizer).active and client.member(1, organizer).stake == 5 * 10**17
    document = json.loads((tmp_path / "org" / "run.json").read_bytes())
    assert document["diloco"]["inner_steps"] == 5
    # The run's commitments version on chain is its document's (what the prover holds its rounds to).
    assert info.commitments == scheme_named(document["diloco"].get("commitments", UNNAMED)).version
    # The same command again (as after a failure past createRun): it finds run 1 and creates no second.
    assert create(tmp_path, path, "--yes") == 0
    assert "created by" in capsys.readouterr().out and client.run_count() == 1
    # Another directory holds another node key, which this account is not registered with.
    assert create(tmp_path, path, "--yes", data_dir="org2") == 6  # ExitCode.ACCOUNT, as README says
    assert "registered with another node key" in capsys.readouterr().err
    # run-info reads it from the link.
    assert main(["run-info", link, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["members"][0]["account"] == organizer and summary["members"][0]["status"] == "active"
    assert summary["rounds_committed"] == 0 and summary["last_record"] is None
    assert summary["commitments"] == info.commitments
    # (issue 80 point 7) and, as audit and pull, from --rpc, --run and --deployment (it took only a link)
    assert main(["run-info", "--rpc", w3.provider.endpoint_uri, "--run", "1", "--deployment", str(path),
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == summary
    # (issue 80) the deployment names its chain's RPC: --rpc is needed only for another one, and the
    # command says where the URL it used came from
    assert main(["run-info", "--run", "1", "--deployment", str(path), "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == summary
    assert f"chain RPC {w3.provider.endpoint_uri}: the rpc_url of --deployment {path}" in err
    assert main(["run-info", link, "--run", "2"]) == 2
    assert "--run 2 and the link's run 1 differ" in capsys.readouterr().err
    assert main(["run-info", "--run", "1"]) == 2 and "pass the run link, or --run with --deployment" in (
        capsys.readouterr().err)


# ---------------------------------------------------------------------- leave / withdraw / run-info / links
def test_leave_then_withdraw_only_after_unbonding(w3, tmp_path, deployed, capsys):
    path, registry, ledger = deployed
    assert create(tmp_path, path, "--yes") == 0
    config = str(tmp_path / "org" / "node.toml")
    assert main(["withdraw", "--config", config, "--yes"]) == 2  # still active
    assert "leave first" in capsys.readouterr().err
    assert main(["leave", "--config", config, "--yes", "--confirmations", "1"]) == 0
    assert "can be withdrawn from block" in capsys.readouterr().out
    assert main(["leave", "--config", config, "--yes"]) == 2  # not active any more
    assert main(["withdraw", "--config", config, "--yes"]) == 14  # not yet
    assert "still unbonding" in capsys.readouterr().err
    mine(w3, LedgerClient(w3, None, registry, ledger).run_info(1).unbonding_blocks)  # the proof window's
    organizer = dev_account(3, w3.eth.chain_id).address
    before = w3.eth.get_balance(organizer)
    assert main(["withdraw", "--config", config, "--yes", "--confirmations", "1"]) == 0
    assert w3.eth.get_balance(organizer) > before  # 0.5 ETH back, less gas
    assert LedgerClient(w3, None, registry, ledger).member(1, organizer) is None


def test_run_info_and_audit_refuse_bad_links(w3, tmp_path, deployed, capsys):
    _, _, ledger = deployed
    url = w3.provider.endpoint_uri
    assert main(["run-info", "http://not-a-link"]) == 2
    assert main(["run-info", f"dlx://5/{ledger}/1?rpc={url}"]) == 2
    assert "not 5" in capsys.readouterr().err
    empty = Account.create().address
    assert main(["run-info", f"dlx://31337/{empty}/1?rpc={url}"]) == 2
    assert "no contract" in capsys.readouterr().err
    assert main(["run-info", f"dlx://31337/{ledger}/7?rpc={url}"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["audit"]) == 2
    assert "pass the run link" in capsys.readouterr().err
    assert main(["pull", f"dlx://31337/{ledger}/1?rpc={url}", str(tmp_path / "out"), "--run", "2"]) == 2
    assert "differ" in capsys.readouterr().err


def test_a_run_link_gives_audit_and_pull_their_chain_run_and_peers(w3, deployed):
    import argparse

    from node.commands.member import apply_link

    _, registry, ledger = deployed
    peer = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWLYbcG2UdN5Hj6A1rxfpfLXjxeNDK9iPoFb2NMH5bEyYW"
    args = argparse.Namespace(link=f"dlx://31337/{ledger}/3?rpc={w3.provider.endpoint_uri}&peer={peer}",
                              rpc="", run=None, ledger="", registry="", bootstrap=[])
    apply_link(args)
    assert (args.rpc, args.run, args.ledger, args.registry) == (w3.provider.endpoint_uri, 3, ledger, registry)
    assert args.bootstrap == [peer]


@pytest.mark.parametrize("kernels", [1, 2])
def test_create_run_refuses_kernel_versions_whose_roots_follow_the_cpu(w3, tmp_path, deployed, capsys,
                                                                        kernels):
    """Kernel versions 1 and 2 take the CPU math library's square root (docs/REPRODUCIBLE.md): a new run of
    either is refused, naming the setting, before anything is sent; --weak-run creates it with a warning."""
    path, registry, ledger = deployed
    run_file(tmp_path, RUN_FILE.replace("[model]", "[training]\nreproducible = true\nreproducible_kernels = "
                                        f"{kernels}\n\n[model]"))
    code = main(["create-run", str(tmp_path / "run.toml"), "--deployment", str(path), "--data-dir",
                 str(tmp_path / "org"), "--dev-account", "3", "--yes"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"training.reproducible_kernels={kernels}: its square roots are the CPU's math library's" in err
    assert run_count(w3, ledger, registry) == 0
    code = main(["create-run", str(tmp_path / "run.toml"), "--deployment", str(path), "--data-dir",
                 str(tmp_path / "org"), "--dev-account", "3", "--yes", "--weak-run", "--listen-port", "24999",
                 "--confirmations", "1"])
    assert code == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert f"warning: weak run (--weak-run): training.reproducible_kernels={kernels}" in out
    assert run_count(w3, ledger, registry) == 1


@pytest.mark.parametrize("scheme", ["hashed", "chunked"])
def test_create_run_refuses_commitment_versions_that_leave_wrong_rounds_unprovable(w3, tmp_path, deployed,
                                                                                    capsys, scheme):
    """Issue 79: versions 1 (no fraud proof) and 2 (no contribution binding, no norm commitment) are no longer
    made by default ("auto" gives version 3); a new run of either is refused, naming what it gives up, before
    anything is sent; --weak-run creates it with a warning (an honest node still joins it, logging it)."""
    path, registry, ledger = deployed
    run_file(tmp_path, RUN_FILE.replace("[diloco]\n", f"[diloco]\ncommitments = \"{scheme}\"\n"))
    code = main(["create-run", str(tmp_path / "run.toml"), "--deployment", str(path), "--data-dir",
                 str(tmp_path / "org"), "--dev-account", "3", "--yes"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"diloco.commitments={scheme} (version " in err
    assert ("no fraud proof opens its roots" if scheme == "hashed" else "cannot be proven wrong") in err
    assert run_count(w3, ledger, registry) == 0
    code = main(["create-run", str(tmp_path / "run.toml"), "--deployment", str(path), "--data-dir",
                 str(tmp_path / "org"), "--dev-account", "3", "--yes", "--weak-run", "--listen-port", "24998",
                 "--confirmations", "1"])
    assert code == 0, capsys.readouterr().err
    assert f"warning: weak run (--weak-run): diloco.commitments={scheme}" in capsys.readouterr().out
    assert run_count(w3, ledger, registry) == 1


def test_mine_advances_a_dev_chain_and_the_hint_names_it_not_cast(w3, capsys):
    """(issue 80 point 7) the no-estimate hint named `cast`, which setup installs nowhere: it names the
    project's own `dlx-node mine`, and that mines on the real anvil; a non-positive count is refused."""
    from node.commands.chainops import ON_DEMAND

    assert "cast" not in ON_DEMAND and "dlx-node mine N --rpc URL" in ON_DEMAND
    before = w3.eth.block_number
    assert main(["mine", "3", "--rpc", w3.provider.endpoint_uri]) == 0
    assert w3.eth.block_number == before + 3
    assert f"the head is block {before + 3}" in capsys.readouterr().out
    assert main(["mine", "0", "--rpc", w3.provider.endpoint_uri]) == 2
    assert "at least 1" in capsys.readouterr().err
