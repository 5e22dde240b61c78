"""An honest node opens a contribution case where its accusation was not convicted (issue 78,
docs/FRAUD_PROOF.md "An honest node that opens a case itself"), on anvil: the node's case opener
(node/live/fraud/opener.py), built from its chain and the reward sources its data directory kept, follows an
accusation its spot checker opened on chain (``VerifierContext.on_accused``).

What is tested: with ``ledger.open_cases`` on, an accusation that lapses (no verdict quorum: the coalition
did not convict) is expired by the node, which opens a case against the accused member's contribution of
that round; nobody defends it, and from the deadline the node overturns the round (its attesters slashed, the
node paid). With the setting off (the default) the same lapse is logged with why and no case is opened. When
the accused defends a true claim (its own node's case defender), the case is dismissed and the opener's bond
is paid to it: the cost that keeps the setting off until a claim's end is bound.
"""

from __future__ import annotations

import hashlib
import logging
import threading

from node.live.chain.onchain import NodeChain
from node.live.fraud.defender import CaseDefender
from node.live.fraud.opener import CaseOpener
from tests.ledger_fixtures import mine
from tests.step_binding_fixtures import subject_of
from tests.test_case_defense import NODE, _setup, toy_program
from tests.test_step_case import _address
from tests.test_step_proof import _backend

ACCUSED = 1  # member 1 signed round 1's contribution 0 (and attests the round)


def _opener(committed, tmp_path, enabled: bool) -> CaseOpener:
    return CaseOpener(run_id=committed.run_id, chain=NodeChain(committed.deployment.client(NODE)),
                      data_dir=tmp_path, num_stages=1, enabled=enabled, stop=threading.Event())


def _accuse_and_lapse(w3, committed, opener: CaseOpener) -> None:
    """Member ``NODE`` accuses member ``ACCUSED`` of round 1 on chain; nobody signs a verdict: it lapses."""
    accuser, accused = committed.deployment.client(NODE), committed.deployment.client(ACCUSED)
    evidence = hashlib.sha256(b"round 1 replica 0 failed its spot check").digest()
    accuser.accuse(committed.run_id, accused.address, evidence)
    opener.accused(1, bytes.fromhex(accused.address[2:]), evidence)
    opener.poll()  # open: nothing yet
    assert not opener.opened
    state = accuser.accusation(committed.run_id, accused.address, evidence)
    mine(w3, max(0, state.deadline - w3.eth.block_number))


def test_a_lapsed_accusation_opens_a_case_that_overturns_the_undefended_round(request, tmp_path):
    w3 = _backend(request, "anvil")
    client, cases, committed, _states = _setup(w3, tmp_path)
    opener = _opener(committed, tmp_path, enabled=True)
    _accuse_and_lapse(w3, committed, opener)
    opener.poll()  # expires the accusation, commits a case against contribution 0
    mine(w3, 1)
    opener.poll()  # a block later it opens it
    subject = subject_of(committed, 0)
    case = cases.case(subject)
    assert case["opener"] == _address(w3, NODE) and len(opener.opened) == 1
    mine(w3, case["deadline"] - w3.eth.block_number)
    opener.poll()
    reader = committed.deployment.client(0)
    assert reader.invalid_from(committed.run_id) == 1 and not opener.opened
    attesters = reader.commit_record(committed.run_id, 1).attesters
    assert attesters and all(reader.member(committed.run_id, a).status == "slashed" for a in attesters)


def test_with_the_setting_off_a_lapse_is_logged_and_no_case_opened(request, tmp_path, caplog):
    w3 = _backend(request, "anvil")
    _client, cases, committed, _states = _setup(w3, tmp_path)
    opener = _opener(committed, tmp_path, enabled=False)
    caplog.set_level(logging.WARNING, logger="node.live.fraud.opener")
    _accuse_and_lapse(w3, committed, opener)
    opener.poll()
    assert "ledger.open_cases is off" in caplog.text
    assert cases.case(subject_of(committed, 0))["opener"] == "0x" + "00" * 20 and not opener.opened


def test_a_case_on_a_contribution_its_author_defends_is_dismissed_and_costs_the_bond(request, tmp_path):
    w3 = _backend(request, "anvil")
    client, cases, committed, states = _setup(w3, tmp_path)
    opener = _opener(committed, tmp_path, enabled=True)
    author = CaseDefender(run_id=committed.run_id, chain=NodeChain(committed.deployment.client(ACCUSED)),
                          states=states, program=toy_program(), data_dir=tmp_path, stop=threading.Event())
    _accuse_and_lapse(w3, committed, opener)
    opener.poll()
    mine(w3, 1)
    opener.poll()
    author.poll()  # the author's node claims a true run from the committed start
    case = cases.case(subject_of(committed, 0))
    assert case["claims"] == 1
    mine(w3, case["ends"] + 1 - w3.eth.block_number)
    author.poll()  # dismissed: the opener's bond is the author's
    opener.poll()
    assert not opener.opened
    assert committed.deployment.client(0).invalid_from(committed.run_id) is None
    assert client.contract.functions.balanceOf(_address(w3, NODE)).call() == 0
