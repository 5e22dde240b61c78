"""``dlx-node explorer``: the read-only run page and its JSON, against a real anvil chain.

A run with four staked members commits rounds (one with a checkpoint), one member is accused and another
disputes a round; the explorer is the real CLI in a child process, read over HTTP, and the page is rendered
in headless chromium. Hostile requests get specific 4xx answers; a chain that goes away gives 503.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest
from browser import rendered_dom
from ledger_fixtures import deploy, digest

from ledger.chain import connect_rpc
from ledger.anvil import AnvilProcess
from node.commands.explorer import explorer_for_client

STAKE = 10**15
BOND = 10**14
REPO = Path(__file__).resolve().parents[1]


def _get(url: str, method: str = "GET") -> tuple[int, dict | str]:
    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            code, body, kind = answer.status, answer.read(), answer.headers.get("Content-Type", "")
    except urllib.error.HTTPError as exc:
        code, body, kind = exc.code, exc.read(), exc.headers.get("Content-Type", "")
    return code, json.loads(body) if kind.startswith("application/json") else body.decode()


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"gave up waiting for {what}")


@pytest.fixture
def watched_run(anvil_session, tmp_path):
    """A run on the session's anvil: 3 rounds (round 2 with a checkpoint), an accusation, a dispute."""
    w3 = connect_rpc(anvil_session.url, timeout=10.0)
    deployment = deploy(w3)
    run = deployment.member_run((1, 2, 3, 4), quorum=2, min_stake=STAKE, bond=BOND)
    run.commit("a")
    committed, _ = run.commit("b")
    run.commit("c", checkpoint_hash=digest("checkpoint 2"))
    theirs = replace(committed, weights_root=digest("member 4's own result"))
    run.client(4).dispute(theirs, run.client(4).sign_record(theirs))
    run.client(1).accuse(run.run_id, run.client(3).address, digest("evidence"))
    deployment_file = tmp_path / "deployment.json"
    deployment_file.write_text(json.dumps({"registry": deployment.registry, "ledger": deployment.ledger}))
    return anvil_session.url, run, deployment_file


def test_explorer_shows_the_run_live_and_refuses_bad_requests(watched_run, tmp_path):
    url, run, deployment_file = watched_run
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(
        [sys.executable, "-m", "node.cli", "explorer", "--rpc", url, "--run", str(run.run_id), "--deployment",
         str(deployment_file), "--port", "0", "--refresh", "0.2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        line = process.stdout.readline()
        assert "explorer of run" in line and "http://127.0.0.1:" in line, line + process.stderr.read()
        base = line.split(" at ")[1].split(" ")[0]

        code, page = _get(base)
        assert code == 200 and "<title>dlx-node explorer</title>" in page
        code, snap = _get(base + "api/snapshot")
        assert code == 200
        assert [r["round"] for r in snap["rounds"]] == [0, 1, 2] and snap["rounds_total"] == 3
        assert snap["checks"]["ok"] is True and snap["checks"]["failed"] == 0
        assert all(r["verified"]["hash_chain"]["ok"] and r["verified"]["attesters"]["ok"]
                   for r in snap["rounds"])
        assert len(snap["rounds"][0]["attesters"]) == 2 and snap["rounds"][0]["tx"].startswith("0x")
        assert snap["rounds"][2]["checkpoint"]["hash"] == "0x" + digest("checkpoint 2").hex()
        assert snap["rounds"][0]["checkpoint"] is None
        assert snap["rounds"][0]["eval_loss"] == pytest.approx(3.6)
        assert [d["disputer"] for d in snap["rounds"][1]["disputes"]] == [run.client(4).address]
        members = {m["account"]: m for m in snap["run"]["members"]}
        assert len(members) == 4 and all(m["status"] == "active" and m["stake_wei"] >= STAKE
                                         for m in members.values())
        assert members[run.client(2).address]["stake_wei"] == STAKE  # neither accused, accuser nor disputer
        [accusation] = snap["accusations"]
        assert (accusation["accused"], accusation["accuser"], accusation["status"]) == (
            run.client(3).address, run.client(1).address, "open")

        code, view = _get(base + "api/rounds?from=1&limit=1")
        assert code == 200 and [r["round"] for r in view["rounds"]] == [1] and view["total"] == 3
        code, info = _get(base + "api/run")
        assert code == 200 and info["run_id"] == run.run_id and info["rounds_committed"] == 3
        code, acc = _get(base + "api/accusations")
        assert code == 200 and len(acc["disputes"]) == 1 and len(acc["accusations"]) == 1
        code, checks = _get(base + "api/checks")
        assert code == 200 and any(i["name"] == "hash chain link round 2" for i in checks["items"])

        # Hostile requests: specific answers, and the server goes on.
        for query, message in (("limit=abc", "not a whole number"), ("limit=0", "within 1..5000"),
                               ("limit=99999999", "within 1..5000"), ("limit=1&limit=2", "given 2 times"),
                               ("from=-3", "not a whole number"),
                               ("limit=" + "9" * 40, "not a whole number")):
            code, answer = _get(base + "api/rounds?" + query)
            assert code == 400 and message in answer["error"], (query, answer)
        code, answer = _get(base + "../../etc/passwd")
        assert code == 404 and "no such path" in answer["error"]
        code, answer = _get(base + "api/snapshot", method="POST")
        assert code == 405 and "read-only" in answer["error"]

        # Live: a new round shows up without restarting the explorer.
        run.commit("d")
        _wait_for(lambda: _get(base + "api/snapshot")[1]["rounds_total"] == 4, 60, "round 3 on the page")

        dom = rendered_dom(base, tmp_path / "chromium")
        assert dom.count('<tr class="round"') == 4, dom[:2000]
        assert 'id="verdict" data-ok="true"' in dom
        assert dom.count('<tr class="member"') == 4 and dom.count('<tr class="accusation"') == 1
        assert 'class="eval-loss" data-points="4"' in dom
        assert "not live" not in dom.split('id="error"')[1][:200]
    finally:
        process.terminate()
        process.wait(timeout=20)


def test_a_chain_that_goes_away_leaves_the_last_snapshot_marked_not_live_at_once(tmp_path):
    with AnvilProcess() as anvil:
        w3 = connect_rpc(anvil.url, timeout=5.0)
        deployment = deploy(w3)
        run = deployment.member_run((1, 2), quorum=2)
        run.commit("a")
        explorer = explorer_for_client(run.reader, run.run_id, refresh=0.0).start()
        try:
            code, snap = _get(explorer.url + "api/snapshot")
            assert code == 200 and snap["rounds_total"] == 1
            anvil.stop()
            # Not empty tables for half a minute while the client retries: the last snapshot, marked, at once.
            started = time.monotonic()
            code, answer = _get(explorer.url + "api/snapshot")
            assert code == 200 and answer["rounds_total"] == 1 and answer["not_live"], answer.get("not_live")
            assert time.monotonic() - started < 15
            assert "HTTPConnectionPool" not in answer["not_live"] and len(answer["not_live"]) < 200
            code, page = _get(explorer.url)  # the page itself is still served; it says it is not live
            assert code == 200 and "not live" in page
        finally:
            explorer.close()


def _whole(units: int) -> str:
    """``units`` (18 decimals) as the page writes them: exact, trailing zeros dropped."""
    whole, rest = divmod(units, 10**18)
    fraction = str(rest).rjust(18, "0").rstrip("0")
    return f"{whole}.{fraction}" if fraction else str(whole)


@pytest.mark.parametrize("in_token", [False, True], ids=["eth", "token"])
def test_explorer_shows_the_reward_pool_and_each_members_credits(request, tmp_path, in_token):
    """(issue 77) A normed run with a pool (in ETH, or in an ERC-20): round 0 final, member 1's contribution
    and member 2's attestation claimed; the explorer (its pool from deployment.json's reward_pool, as the
    command finds it) shows the pool's books and each member's credits, in its JSON and on the page."""
    from ledger_fixtures import fresh_anvil_w3
    from reward_fixtures import params, reward_run, token_run

    w3 = fresh_anvil_w3(request, timeout=10.0)
    rr, token = token_run(deploy(w3)) if in_token else (reward_run(deploy(w3), pool=params()), None)
    rr.commit([[(1, None), (3, None)], [(2, None)]], signers=(1, 2))
    rr.commit([[(1, None)], [(2, None)]], signers=(1, 2), label="pending")  # round 1: not final
    rr.mine_to_final(0)
    rr.claim(1, 0, 0)
    rr.claim_attestation(2, 0)
    deployment_file = tmp_path / "deployment.json"
    deployment_file.write_text(json.dumps({"registry": rr.deployment.registry, "ledger": rr.deployment.ledger,
                                           "reward_pool": rr.pool_address}))
    from argparse import Namespace

    from node.commands.explorer import _pool

    reader = rr.run.reader
    pool_of_run = _pool(reader, Namespace(pool="", deployment=str(deployment_file)))
    assert pool_of_run.address == rr.pool_address  # the command's default: deployment.json's reward_pool
    explorer = explorer_for_client(reader, rr.run_id, pool=pool_of_run).start()
    try:
        base = explorer.url
        code, pool = _get(base + "api/pool")
        assert code == 200 and pool["address"] == rr.pool_address
        contribution, attestation = rr.expected_share(0, 0, 1), rr.expected_attester_share(0)
        assert pool["claimed_amount"] == contribution + attestation
        assert pool["funded_amount"] == 10 * params().amount_per_round
        assert pool["balance_amount"] == pool["funded_amount"] - pool["claimed_amount"]
        assert not [key for key in pool if key.endswith("_wei")]  # a token pool's amounts are not wei
        members = {m["account"]: m for m in pool["members"]}
        one, two = members[rr.address(1)], members[rr.address(2)]
        # member 1: its claimed contribution and its attestation of round 0 (claimable), its attestation of
        # round 1 (pending); its round-1 contribution is known only once claimed
        assert one["claimed_amount"] == contribution and one["claimable_amount"] == attestation
        assert one["pending_amount"] == attestation and one["final_amount"] == contribution + attestation
        assert two["claimed_amount"] == attestation and two["earned_amount"] == 2 * attestation
        assert members[rr.address(3)]["earned_amount"] == 0  # listed, unclaimed: its factors are the nodes'
        dom = rendered_dom(base, tmp_path / "chromium")
        assert dom.count('<tr class="credit"') == len(pool["members"]) >= 3, dom[:2000]
        assert rr.pool_address in dom
        # named as `dlx-node rewards --json` names them: the unit of the amounts, and how they show whole
        symbol = "QRK" if in_token else "ETH"
        assert (pool["unit"], pool["token"], pool["decimals"], pool["symbol"]) == (
            ("token units", token.address, 18, "QRK") if in_token else ("wei", None, 18, "ETH"))
        assert f"{_whole(params().amount_per_round)} {symbol} a final round" in dom  # whole tokens or ETH
        assert f'id="pool-unit">{symbol}<' in dom
        assert ((f"(token {token.address})" if in_token else "(token 0x") in dom) == in_token
        assert f"claimed {_whole(contribution + attestation)} {symbol}" in dom
    finally:
        explorer.close()
