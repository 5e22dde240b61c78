"""The prover's reward against its gas (node/provergas.py; docs/FRAUD_PROOF.md "The reward against the gas").

The contract creates a run whose ``quorum x minStake / 2`` would not pay a prover's worst-case gas; the
node refuses it before createRun (create-run and the demo; ``--allow-unpaid-proofs`` creates it with a
warning) and warns a contributor about to take a seat in one. The constants are held to the bench's
measured rows and the commitment's gas is measured here, on py-evm and on a real anvil; the refusal runs the
real ``dlx-node create-run`` against an anvil started with a high base fee.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from ledger_fixtures import FAST_RETRY, deploy

import contracts
from ledger.account import dev_account
from ledger.anvil import AnvilProcess
from ledger.chain import connect_pyevm, connect_rpc
from ledger.client import LedgerClient
from ledger.runparams import DEFAULT_MAX_CONTRIBUTIONS, DEFAULT_MAX_RANK, PROOF_MAX_GAS, RunParams
from node.cli import main
from node.config import dump_toml, load_config
from node.errors import ConfigError
from node.provergas import (
    CHALLENGE_GAS,
    COMMIT_GAS,
    EXPIRE_GAS,
    PRICE_SPIKE_FACTOR,
    ProverCost,
    check_reward,
    gas_price,
    joining_warning,
    prover_cost,
    prover_gas,
)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
#: The high-price chain's base fee: 50 gwei, so that 0.5 ETH a member (the command tests' stake) pays no
#: prover at ten times the price.
BASE_FEE = 50 * 10**9


def _measured(name: str, suffix: str) -> list[int]:
    rows = json.loads((RESULTS / name).read_text())["availability_rows"]
    return [value for row in rows for key, value in row.items() if key.endswith(suffix)]


# ---------------------------------------------------------------------- the constants
def test_the_constants_hold_every_measured_row():
    challenges, expiries = _measured("fraud_proof.json", "_challenge_gas"), _measured("fraud_proof.json",
                                                                                     "expire_gas")
    assert len(challenges) >= 50 and expiries
    assert max(challenges) <= CHALLENGE_GAS < max(challenges) + 1_000, max(challenges)
    assert set(expiries) == {EXPIRE_GAS}
    bounds = json.loads((RESULTS / "fraud_proof_bounds.json").read_text())
    assert bounds["max_gas"] == PROOF_MAX_GAS and bounds["bound_holds"]
    # The default run's proof bound, as that file gives it (LedgerCore.proofCost at rank 64, 6 pieces).
    assert prover_gas(DEFAULT_MAX_CONTRIBUTIONS, DEFAULT_MAX_RANK) == 9_848_800
    assert max(row["gas"] for row in bounds["rows"] if "gas" in row) <= 9_848_800


def test_the_documented_worst_case_at_24_steps():
    """docs/FRAUD_PROOF.md and TRUST.md: about 17.7M gas at S = 24 and the 10M bound, 0.53 ETH at 30 gwei."""
    cost = ProverCost(steps=24, proof_gas=PROOF_MAX_GAS, price=3 * 10**9, quorum=2, stake=10**18,
                      bond=10**17)
    assert cost.gas == 24 * CHALLENGE_GAS + EXPIRE_GAS + COMMIT_GAS + PROOF_MAX_GAS == 17_676_358
    assert cost.spike_price == 30 * 10**9 and PRICE_SPIKE_FACTOR == 10
    assert round(cost.cost / 1e18, 2) == 0.53 and cost.escrow == 24 * 10**17 and cost.covered


def test_a_proof_commitment_costs_what_the_check_counts(chain_w3):
    deployment = deploy(chain_w3)
    prover = deployment.client(1)
    contract = chain_w3.eth.contract(address=prover.prover_address,
                                     abi=contracts.artifact("AggregationProver")["abi"])
    # No zero byte (a keccak hash seldom has one; a zero byte of calldata costs 4 gas, not 16): the most.
    receipt = prover.sender.transact(contract, "commitProof", (bytes(range(1, 33)),))
    assert receipt["gasUsed"] == COMMIT_GAS


# ---------------------------------------------------------------------- py-evm
def _params(stake: int, quorum: int = 2, **kwargs) -> RunParams:
    return RunParams(bytes(range(1, 33)), 1, 5, min_stake=stake, quorum=quorum, max_rounds=3, **kwargs)


def test_a_small_stake_run_is_refused_though_the_contract_takes_it():
    w3 = connect_pyevm()
    deployment = deploy(w3)
    price = gas_price(w3)
    small = _params(10**16)  # 0.01 ETH a member: 0.01 ETH to a prover of a 17.5M-gas case
    with pytest.raises(ConfigError) as refused:
        check_reward(small, w3, allow=False, where="test")
    cost = prover_cost(small, price)
    said = str(refused.value)
    assert not cost.covered and cost.gas == 24 * CHALLENGE_GAS + EXPIRE_GAS + COMMIT_GAS + 9_848_800
    assert f"{cost.gas:,} gas" in said and f"{price / 1e9:g} gwei today" in said, said
    assert "2 x 0.01 ETH / 2 = 0.01 ETH" in said and "--allow-unpaid-proofs" in said, said
    needed = re.search(r"stake needed at k=2 is ([0-9.]+) ETH", said)
    assert needed and round(float(needed.group(1)) * 10**18) == cost.stake_needed, said
    warned = check_reward(small, w3, allow=True, where="test")
    assert warned[0].startswith("a prover escrows 24 challenge bonds x 0.001 ETH")
    assert warned[1].startswith("warning: unpaid proofs"), warned
    enough = _params(cost.stake_needed)
    assert check_reward(enough, w3, allow=False, where="test") == [prover_cost(enough, price).liquidity()]
    with pytest.raises(ConfigError, match="does not cover"):  # a micro-ETH less is short
        check_reward(_params(cost.stake_needed - 10**12), w3, allow=False, where="test")
    # A larger quorum pays more for the same stake (k attesters slashed at least).
    assert prover_cost(_params(cost.stake_needed // 2 + 10**12, quorum=4), price).covered
    with pytest.raises(ConfigError, match="= 0 ETH, but"):  # a stake of 0 (--weak-run) pays no prover either
        check_reward(_params(0), w3, allow=False, where="test")
    # A hashed run has no fraud proof: nothing to pay a prover for.
    assert check_reward(_params(0, commitments=1), w3, allow=False, where="test") == []
    assert gas_price(w3) == price  # nothing mined meanwhile: every check above saw one price
    # The contract does not check it: the run the node refused is created when sent.
    assert deployment.client(2).create_run_with(small, "x") == 1


# ---------------------------------------------------------------------- anvil at a high gas price
RUN_FILE = """\
run_name = "{name}"
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
stake_eth = {stake}
quorum = 2
accusation_blocks = 8
dispute_blocks = 8
"""


@pytest.fixture(scope="module")
def dear_chain():
    """An anvil whose base fee starts at :data:`BASE_FEE` (``--base-fee``), with fresh contracts."""
    anvil = AnvilProcess(extra_args=("--base-fee", str(BASE_FEE)))
    anvil.start()
    try:
        w3 = connect_rpc(anvil.url, timeout=60.0)
        registry, ledger = LedgerClient.deploy(w3, dev_account(0, w3.eth.chain_id), retry=FAST_RETRY)
        yield w3, registry, ledger
    finally:
        anvil.stop()


def _dear_block(w3) -> None:
    """A block of base fee :data:`BASE_FEE` on top (the deployment's blocks, below the gas target, lowered
    it)."""
    for method, params in (("anvil_setNextBlockBaseFeePerGas", [hex(BASE_FEE)]), ("anvil_mine", ["0x1"])):
        assert "error" not in w3.provider.make_request(method, params)
    assert w3.eth.get_block("latest")["baseFeePerGas"] == BASE_FEE


def _deployment(tmp_path, dear_chain) -> Path:
    w3, registry, ledger = dear_chain
    path = tmp_path / "deployment.json"
    path.write_text(json.dumps({"chain_id": w3.eth.chain_id, "rpc_url": w3.provider.endpoint_uri,
                                "registry": registry, "ledger": ledger, "from_block": 0}))
    return path


def _create_args(tmp_path, deployment: Path, name: str, stake, account: int, port: int) -> list[str]:
    run_file = tmp_path / f"{name}.toml"
    run_file.write_text(RUN_FILE.format(name=name, stake=stake))
    return ["create-run", str(run_file), "--deployment", str(deployment), "--data-dir", str(tmp_path / name),
            "--listen-port", str(port), "--confirmations", "1", "--dev-account", str(account), "--yes"]


def test_create_run_refuses_a_run_whose_reward_misses_the_gas_and_creates_it_when_told(dear_chain, tmp_path,
                                                                                      capsys):
    w3, registry, ledger = dear_chain
    deployment = _deployment(tmp_path, dear_chain)
    reader = LedgerClient(w3, None, registry, ledger)
    account = dev_account(4, w3.eth.chain_id).address
    nonce, runs = w3.eth.get_transaction_count(account), reader.run_count()
    _dear_block(w3)
    price = gas_price(w3)
    assert price >= BASE_FEE  # the chain is dear: 0.5 ETH a member pays no prover there
    proc = subprocess.run([sys.executable, "-m", "node.cli",
                           *_create_args(tmp_path, deployment, "small", 0.5, 4, 24971)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "the prover's reward does not cover its gas" in last and "2 x 0.5 ETH / 2 = 0.5 ETH" in last, last
    assert f"{price / 1e9:g} gwei today x 10" in last and "--allow-unpaid-proofs" in last, last
    assert "Traceback" not in proc.stderr
    assert w3.eth.get_transaction_count(account) == nonce and reader.run_count() == runs  # nothing sent
    assert not (tmp_path / "small").exists()  # nor written
    needed = re.search(r"stake needed at k=2 is ([0-9.]+) ETH", last).group(1)

    # --allow-unpaid-proofs: created, with the warning; a contributor joining it is warned too.
    assert main(_create_args(tmp_path, deployment, "small", 0.5, 4, 24971) + ["--allow-unpaid-proofs"]) == 0
    out = capsys.readouterr().out
    assert "warning: unpaid proofs (--allow-unpaid-proofs)" in out and "nobody paid to prove it" in out, out
    unpaid = reader.run_count()
    assert unpaid == runs + 1
    warning = joining_warning(reader.run_info(unpaid), w3)
    assert f"run {unpaid}'s reward does not cover a proof" in warning and "escrows" in warning, warning

    # The stake the refusal named is enough, with no flag: created; its escrow printed; no warning to join.
    assert main(_create_args(tmp_path, deployment, "enough", needed, 5, 24972)) == 0
    out = capsys.readouterr().out
    assert "a prover escrows 14 challenge bonds" in out and "warning: unpaid" not in out, out
    assert reader.run_count() == unpaid + 1 and joining_warning(reader.run_info(unpaid + 1), w3) == ""
    _start_warns_a_new_seat(tmp_path / "small" / "node.toml", tmp_path / "joiner", capsys)


def _start_warns_a_new_seat(organizer_toml: Path, data_dir: Path, capsys) -> None:
    """``start``'s pre-flight for another account of the unpaid run: the warning, then (no terminal to ask
    on) the seat refused with nothing sent."""
    from node.commands.preflight import preflight

    table = tomllib.loads(organizer_toml.read_text())
    table["data_dir"] = str(data_dir)
    table["ledger"]["dev_account"] = 6
    table["p2p"]["bootstrap"] = ["/ip4/127.0.0.1/tcp/24971/p2p/" + "12D3KooW" + "A" * 44]
    data_dir.mkdir()
    (data_dir / "node.toml").write_text(dump_toml(table))
    with pytest.raises(ConfigError, match="no terminal to ask on"):
        preflight(load_config(data_dir / "node.toml"), yes=False)
    out = capsys.readouterr().out
    assert "reward does not cover a proof at today's gas price" in out, out


# ---------------------------------------------------------------------- the demo's embedded chain
def test_the_demos_defaults_pass_on_its_chain_and_a_small_stake_is_refused(tmp_path):
    """The demo's run (k = 2, 1 ETH a member) pays a prover at its anvil's price; 0.01 ETH does not: the
    demo refuses it before createRun, and stops the chain it started."""
    from node.commands.demo import DEMO_QUORUM_BPS
    from node.commands.launcher import LocalRun

    settings = ["model.preset=tiny", "rounds=2", "diloco.inner_steps=2"]
    run = LocalRun(tmp_path / "demo", replicas=2, stages=1, split=False, settings=settings,
                   attest_quorum=2, attest_quorum_bps=DEMO_QUORUM_BPS, stake_wei=10**18,
                   allow_unpaid_proofs=False)
    try:
        run.setup()
        assert run.run_id == 1 and len(run.reward_notes) == 1, run.reward_notes
        # issue 79: the demo's games are as long as its largest stage needs (create-run's), 14 for tiny
        assert run.reward_notes[0].startswith("a prover escrows 14 challenge bonds x 0.1 ETH = 1.4 ETH")
    finally:
        run.stop()
    proc = subprocess.run([sys.executable, "-m", "node.cli", "demo", "--preset", "tiny", "--rounds", "1",
                           "--replicas", "2", "--stages", "1", "--stake", "0.01", "--no-reference", "--out",
                           str(tmp_path / "small")], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "the local run: the prover's reward does not cover its gas" in last, last
    assert "2 x 0.01 ETH / 2 = 0.01 ETH" in last and "--allow-unpaid-proofs" in last, last
    state = tmp_path / "small" / "deployment.json"
    assert not state.exists()  # refused before createRun: no run, no deployment file


def test_deploy_md_shows_what_create_run_says_for_its_run_file():
    """docs/DEPLOY.md's example refusal: its run file's model at 0.05 ETH and k = 3, at 1 gwei."""
    from node.commands.runfile import max_game_steps
    from node.config import config_from_dict

    cfg = config_from_dict({"model": {"preset": "llama-124m"}, "rounds": 200, "pipeline": {"num_stages": 2},
                            "diloco": {"inner_steps": 100, "num_replicas": 4}})
    params = RunParams(bytes(range(1, 33)), 2, 100, min_stake=5 * 10**16, quorum=3,
                       max_game_steps=max_game_steps(cfg))
    cost = prover_cost(params, 10**9)
    text = " ".join((ROOT / "docs" / "DEPLOY.md").read_text().split())
    assert cost.shortfall() in text and "stake_eth = 0.05" not in text
    assert f"{cost.gas:,} gas for the run file above ({cost.steps} steps)" in text
    # Its run file's own stake, 1 ETH at k = 3, pays a prover up to the price it names (~8.5 gwei).
    assert prover_cost(dataclasses.replace(params, min_stake=10**18), 8_500_000_000).covered
    assert not prover_cost(dataclasses.replace(params, min_stake=10**18), 8_600_000_000).covered
