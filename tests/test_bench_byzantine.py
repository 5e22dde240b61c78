"""bench/bench_byzantine.py's reading of the audit: when does it name the attacker."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from bench_byzantine import SLICED_ATTACKS, names_attacker  # noqa: E402

PEER = "12D3KooWPQEt64ykT28JHGmKzsWSkkWo1yhiNiur7za7ECVGQ6JK"
ATTACKER = "0x90f79bf6eb2c4f870365e785982e1f101e93b906"
HONEST = "0x70997970C51812dc3A010C7d01b50e0d17dc79C8"


def test_a_fail_naming_its_peer_id_or_an_accusation_of_its_account_names_the_attacker():
    fail = (
        f"round 0: FAIL -- partial s0 j1 by ECVGQ6JK (replay): the partial signed by {PEER} differs from its "
        "replay from the 3 inputs it binds")
    assert names_attacker(["audit of run 1 FAILED", fail], PEER, ATTACKER)
    accused = (f"accusation of {ATTACKER.upper().replace('0X', '0x')} by {HONEST} (evidence "
               "10f2, block 12): open")
    assert names_attacker([accused], PEER, ATTACKER)
    assert names_attacker([f"member {ATTACKER} slashed 0 wei at block 15 (a guilty verdict)"], PEER, ATTACKER)


def test_the_attacker_accusing_an_honest_member_or_a_passing_audit_does_not_name_it():
    by_attacker = f"accusation of {HONEST} by {ATTACKER} (evidence ad0f, block 10): open"
    assert not names_attacker([by_attacker, "audit of run 1 PASSED: 3 rounds"], PEER, ATTACKER)
    assert not names_attacker([by_attacker], PEER, None)  # its account unknown: only its peer id counts


def test_every_sliced_attack_is_one_the_sliced_adversary_knows():
    sys.path.insert(0, str(ROOT / "tests"))
    import sliced_adversary

    assert set(SLICED_ATTACKS) == set(sliced_adversary.ATTACKS)


def test_the_reexecution_summary_counts_reruns_and_lists_each_ejections_judgement(tmp_path):
    import json

    from bench_byzantine import reexecution_summary

    general = [{"name": "re-execution of round 0 replica 1", "status": "ok", "reason": "reproduced"},
               {"name": "re-execution of round 1 replica 2", "status": "FAIL",
                "reason": "does not reproduce"},
               {"name": "re-execution of round 1 replica 0", "status": "ok", "reason": "reproduced"},
               {"name": f"ejection of {ATTACKER} (evidence 10f2)", "status": "ok",
                "reason": "wrong-partial proof holds: round 0 stage 0"},
               {"name": "run document", "status": "ok", "reason": ""}]
    (tmp_path / "audit.json").write_text(json.dumps({"general": general}))
    summary = reexecution_summary(tmp_path / "audit.json")
    assert summary["reruns"] == {"ok": 2, "FAIL": 1}
    assert summary["ejections"] == [{"status": "ok", "reason": "wrong-partial proof holds: round 0 stage 0"}]
    assert "error" in reexecution_summary(tmp_path / "missing.json")
