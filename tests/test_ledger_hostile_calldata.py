"""Hostile calldata at every state-changing function of TrainingLedger and its AggregationProver, on py-evm
and anvil.

The contract's functions are enumerated from its ABI, so a function added later is covered without editing
this file. Each one gets calldata no honest client sends: the selector alone, a truncated head, a dynamic
argument whose offset points far outside the calldata, a length word of 2**64, dirty high bits in an address /
uint64 / bool word, and random words. Each transaction must revert (receipt status 0), whoever sends it (a
member of the run or an unregistered stranger), and afterwards every view of the run's state must read exactly
as before, and the run must still commit its next round.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from ledger.account import dev_account
from tests.ledger_fixtures import digest

ARTIFACTS = Path(__file__).resolve().parents[1] / "contracts/artifacts"
LEDGER = json.loads((ARTIFACTS / "TrainingLedger.json").read_text())
PROVER = json.loads((ARTIFACTS / "AggregationProver.json").read_text())
STAKE = 10**15
BOND = 10**14
MEMBERS = (1, 2, 3, 4)
STRANGER = 8
WORD = 32


def _functions(mutability: set[str], artifact: dict = LEDGER) -> list[dict]:
    return [{**item, "artifact": artifact} for item in artifact["abi"]
            if item["type"] == "function" and item["stateMutability"] in mutability]


def _selector(item: dict) -> bytes:
    signature = f"{item['name']}({','.join(_canonical(arg) for arg in item['inputs'])})"
    return bytes.fromhex(item.get("artifact", LEDGER)["methodIdentifiers"][signature])


def _canonical(arg: dict) -> str:
    if arg["type"].startswith("tuple"):
        return "(" + ",".join(_canonical(part) for part in arg["components"]) + ")" \
            + arg["type"][len("tuple"):]
    return arg["type"]


def _is_dynamic(arg: dict) -> bool:
    kind = arg["type"]
    if kind in ("bytes", "string") or kind.endswith("[]"):
        return True
    if kind.startswith("tuple"):
        return any(_is_dynamic(part) for part in arg["components"])
    return False


def _head_words(arg: dict) -> int:
    """Words an argument takes in the head: one for a dynamic one (its offset), its size for a static
    tuple."""
    if _is_dynamic(arg) or not arg["type"].startswith("tuple"):
        return 1
    return sum(_head_words(part) for part in arg["components"])


def _word(value: int) -> bytes:
    return (value % 2**256).to_bytes(WORD, "big")


def _variants(item: dict, run_id: int, rng: random.Random) -> dict[str, bytes]:
    """Malformed calldata for ``item``, keyed by what is wrong with it."""
    selector, inputs = _selector(item), item["inputs"]
    heads = [_head_words(arg) for arg in inputs]
    width = sum(heads)
    variants = {"selector only": selector, "truncated head": selector + b"\x00" * (max(width, 1) * WORD - 1)}
    for position, arg in enumerate(inputs):
        start = sum(heads[:position])
        words = [_word(run_id)] + [_word(0)] * (width - 1)
        if _is_dynamic(arg):
            far = list(words)
            far[start] = _word(2**255)
            variants[f"arg {position} offset past the calldata"] = selector + b"".join(far)
            huge = list(words)
            huge[start] = _word(width * WORD)
            variants[f"arg {position} length 2**64"] = selector + b"".join(huge) + _word(2**64)
        elif arg["type"] in ("address", "bool", "uint64") and width > 0:
            dirty = list(words)
            dirty[start] = _word(2**200 + 2 if arg["type"] != "bool" else 2)
            variants[f"arg {position} ({arg['type']}) with dirty high bits"] = selector + b"".join(dirty)
    for index in range(2):
        variants[f"random words {index}"] = selector + rng.randbytes((width + 3) * WORD)
    return variants


def _send(w3, index: int, to: str, data: bytes) -> int:
    """Send raw calldata from dev account ``index`` with ample gas; the receipt's status."""
    account = dev_account(index, w3.eth.chain_id)
    base = w3.eth.get_block("latest")["baseFeePerGas"]
    tx = {"to": to, "data": data, "value": 0, "gas": 3_000_000, "chainId": w3.eth.chain_id,
          "nonce": w3.eth.get_transaction_count(account.address, "pending"),
          "maxFeePerGas": 2 * base + 10**9, "maxPriorityFeePerGas": 10**9}
    tx_hash = w3.eth.send_raw_transaction(account.sign_transaction(tx).raw_transaction)
    return w3.eth.wait_for_transaction_receipt(tx_hash, timeout=30)["status"]


def _state(run) -> dict:
    """Every view of the run's state a hostile call could change."""
    reader = run.client(MEMBERS[0])
    run_id = run.run_id
    state = {
        "balance": run.deployment.w3.eth.get_balance(run.deployment.ledger),
        "run": reader.run_struct(run_id), "members": reader.member_count(run_id),
        "commits": reader.commit_count(run_id), "head": reader.head_of(run_id),
        "quorum": reader.quorum_of(run_id), "counted": reader.counted_count(run_id),
        "case": reader.dispute_case(run_id, 0), "final": reader.is_final(run_id, 0),
        "record": reader.record_hash_of(run_id, 0), "slashed": reader.slashed_total(),
        "forfeited": reader.forfeited_total(),
    }
    for index in (*MEMBERS, STRANGER):
        state[f"member {index}"] = reader.member(run_id, run.client(index).address)
    return state


@pytest.fixture
def disputed_run(deployment):
    """Four staked members, round 0 committed and disputed (an open case holds a bond)."""
    # Windows far longer than the few hundred blocks the hostile transactions mine: nothing lapses meanwhile.
    run = deployment.member_run(MEMBERS, quorum=2, min_stake=STAKE, bond=BOND, accusation_blocks=5_000,
                                dispute_blocks=5_000, tenure_rounds=1)
    committed, _ = run.commit(signers=(1, 2))
    other = replace(committed, weights_root=digest("another root"))
    run.client(3).dispute(other, run.client(3).sign_record(other))
    return run


#: Writes whose every argument is valid (issue 62): a proof commitment is any 32-byte word (it shows nothing
#: of the proof), and it changes no run's state (the state compared below).
TAKES_ANY_WORD = {"commitProof"}


def test_malformed_calldata_reverts_and_changes_nothing(disputed_run):
    run = disputed_run
    w3, ledger = run.deployment.w3, run.deployment.ledger
    prover = run.client(MEMBERS[0]).prover_address
    before = {**_state(run), "prover balance": w3.eth.get_balance(prover)}
    rng = random.Random(41)
    tried = 0
    # The ledger's functions, and the fraud prover's (proveWrongAggregation, the availability challenge).
    for artifact, address in ((LEDGER, ledger), (PROVER, prover)):
        for item in _functions({"nonpayable", "payable"}, artifact):
            if item["name"] in TAKES_ANY_WORD:
                continue
            for what, data in _variants(item, run.run_id, rng).items():
                for sender in (MEMBERS[0], STRANGER):
                    status = _send(w3, sender, address, data)
                    assert status == 0, f"{item['name']}: {what} from account {sender} did not revert"
                    tried += 1
    # An unknown selector and a bare value transfer have no function to reach.
    assert _send(w3, STRANGER, ledger, bytes.fromhex("deadbeef") + _word(run.run_id)) == 0
    assert _send(w3, STRANGER, ledger, b"") == 0
    writes = {"nonpayable", "payable"}
    assert tried >= 8 * (len(_functions(writes)) + len(_functions(writes, PROVER)) - len(TAKES_ANY_WORD))
    assert {**_state(run), "prover balance": w3.eth.get_balance(prover)} == before
    # The run is not wedged: its next round commits.
    run.commit(signers=(1, 2))
    assert run.client(1).commit_count(run.run_id) == 2


def test_malformed_calldata_to_views_is_an_error_not_a_value(disputed_run):
    """eth_call of a view with a truncated head reverts; a reader never gets a made-up value back."""
    run = disputed_run
    w3, ledger = run.deployment.w3, run.deployment.ledger
    for item in _functions({"view", "pure"}):
        if not item["inputs"]:
            continue
        data = _selector(item) + b"\x00" * (_head_words(item["inputs"][0]) * WORD - 1)
        with pytest.raises(Exception) as info:
            w3.eth.call({"to": ledger, "data": data})
        assert "revert" in str(info.value).lower() or "execution" in str(info.value).lower(), \
            (item["name"], info.value)
