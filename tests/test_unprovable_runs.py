"""Issue 79 point 3: runs whose parameters make a part of the fraud proof impossible, made by hand on py-evm
and on a real anvil (``chain_w3``).

A creator can bind no schedule, no genesis root, or games too short for the run's largest stage
(``max_game_steps`` 2 where ``create-run`` gives 9): the chain takes such a run, and nobody can prove one of
its wrong rounds wrong. An honest node refuses to join or sign in it, one message naming the parameter, before
it stakes anything (``NodeChain.check_run``, which ``join`` and ``start`` run before ``ensure_member``), and
``audit`` marks its history unprovable, in the verdict and in the JSON.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from ledger.client import LedgerClient
from ledger.runparams import RunParams
from node.commitments.values import check_run_values, max_game_steps, run_values, values_of
from node.config import load_config
from node.errors import ConfigError
from node.live.chain.onchain import NodeChain
from node.runconfig import canonical_json, config_hash, run_document
from node.tools.audit import audit_run
from node.tools.report import INCOMPLETE, OK, UNVERIFIABLE, write_json
from tests.ledger_fixtures import FAST_RETRY, chain_w3, deploy, make_record  # noqa: F401 (chain_w3: both chains)

#: What each hand-made run leaves out, and the parameter the refusal names.
CASES = {
    "no-schedule": ({"schedule_rounds": 0, "schedule_root": bytes(32)}, "schedule_rounds"),
    "no-genesis": ({"genesis_root": bytes(32)}, "genesis_root"),
    "short-games": ({"max_game_steps": 2}, "max_game_steps"),
}


@pytest.fixture(scope="module")
def cfg():
    return load_config(None, ["model.preset=tiny", "diloco.commitments=normed", "rounds=3"])


def params(cfg, **changes) -> RunParams:
    """The RunParams ``create-run`` gives ``cfg``'s run, with ``changes`` (a creator's hand-made ones)."""
    return dataclasses.replace(RunParams(
        config_hash(run_document(cfg)), cfg.pipeline.num_stages, cfg.diloco.inner_steps,
        max_rounds=cfg.rounds, quorum=1, quorum_bps=0, commitments=cfg.commitment_scheme.version,
        max_game_steps=max_game_steps(cfg),
        **run_values(cfg)), **changes)


def created(w3, cfg, **changes):
    """A deployment and a run of ``cfg``'s document created on chain with ``changes``; returns the deployment,
    the run id and the NodeChain of a registered would-be member (dev account 2)."""
    deployment = deploy(w3)
    creator = deployment.register(1)
    run_id = creator.create_run_with(params(cfg, **changes), allow_weak_quorum=True)
    return deployment, run_id, NodeChain(deployment.register(2))


def check(chain: NodeChain, run_id: int, cfg) -> None:
    chain.check_run(run_id, config_hash(run_document(cfg)), cfg.rounds, commitments=cfg.diloco.commitments,
                    cfg=cfg)


@pytest.mark.parametrize("case", list(CASES))
def test_an_honest_node_refuses_a_run_whose_wrong_rounds_are_unprovable_before_staking(chain_w3, cfg, case):
    changes, named = CASES[case]
    deployment, run_id, chain = created(chain_w3, cfg, **changes)
    info = chain.run_info(run_id)
    assert {name: getattr(info, name) for name in changes} == changes  # the chain took the hand-made run
    with pytest.raises(ConfigError, match="make a wrong round unprovable") as refused:
        check(chain, run_id, cfg)
    message = str(refused.value)
    assert f"({named}: " in message and message.count(": the chain ") == 1, message  # one, naming it
    if named == "max_game_steps":
        assert f"fewer than the {max_game_steps(cfg)} a stage of" in message
    assert chain.client.member(run_id, chain.client.address) is None  # nothing staked
    assert deployment.client(1).member_count(run_id) == 0


def test_the_run_create_run_would_make_is_joined(chain_w3, cfg):
    _, run_id, chain = created(chain_w3, cfg)
    check(chain, run_id, cfg)  # no refusal
    assert check_run_values(cfg, values_of(chain.run_info(run_id))) == []


def test_the_proof_bound_and_the_listing_bound_are_named():
    """Values the contract refuses at createRun today, refused by the node too (a node is not to trust the
    contract it reads to have checked them): a proof past its gas bound, fewer contributions than listed."""
    cfg = load_config(None, ["model.preset=tiny", "diloco.commitments=normed"])
    mine = {**run_values(cfg), "max_game_steps": max_game_steps(cfg)}
    assert check_run_values(cfg, mine) == []
    (over,) = check_run_values(cfg, {**mine, "max_contributions": 60})
    assert over.startswith("max_contributions: a proof of 60 contributions at rank 64 may need ")
    (few,) = check_run_values(cfg, {**mine, "max_contributions": 2})
    assert few.startswith("max_contributions: the chain allows 2, fewer than the 6")
    hashed = load_config(None, ["model.preset=tiny", "diloco.commitments=hashed"])
    assert check_run_values(hashed, {}) == []  # a hashed run proves nothing by design: not this rule's


def test_audit_marks_an_unprovable_runs_history_unprovable(chain_w3, cfg, tmp_path):
    deployment, run_id, _ = created(chain_w3, cfg, schedule_rounds=0, schedule_root=bytes(32),
                                    max_game_steps=2)
    member = deployment.client(1)
    member.join_run(run_id)
    archive = tmp_path / "archive"
    archive.mkdir()
    (archive / "run.json").write_bytes(canonical_json(run_document(cfg)))
    record = make_record(run_id, 0, member.head_of(run_id), "round 0")
    member.commit_round(record, [member.sign_record(record)])
    reader = LedgerClient(chain_w3, None, deployment.registry, deployment.ledger, retry=FAST_RETRY)
    report = audit_run(reader, run_id, archives=[archive])
    provable = next(c for c in report.general if c.name == "fraud provable")
    assert provable.status == UNVERIFIABLE and report.verdict == INCOMPLETE
    assert report.fraud_provable is False
    assert [p.split(":")[0] for p in report.unprovable] == ["schedule_rounds", "max_game_steps"]
    assert "history unprovable (the run's schedule_rounds, max_game_steps make" in report.summary()
    data = json.loads(write_json(report, tmp_path / "a.json").read_text())
    assert data["fraud_provable"] is False and len(data["unprovable"]) == 2
    # the same document on a run create-run would make: provable
    deployment, run_id, _ = created(chain_w3, cfg)
    reader = LedgerClient(chain_w3, None, deployment.registry, deployment.ledger, retry=FAST_RETRY)
    report = audit_run(reader, run_id, archives=[archive])
    assert next(c for c in report.general if c.name == "fraud provable").status == OK
    assert report.fraud_provable is True and report.unprovable == []
