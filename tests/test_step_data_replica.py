"""A split replica's later stage claims with its replica's data key (issue 78, docs/FRAUD_PROOF.md "The
replica's key"), on py-evm and on anvil.

Under ``training.data_windows = "account"`` every stage of a replica draws the windows of its stage-0 member's
account. A stage-1 contribution's run claim names that key and shows it: the same round's stage-0 leaf and
factors, the index of the replica's stage-0 contribution, the stage-1 member's EIP-712 signature of
``DataKey(runId, round, stage, payloadRoot, dataKey)`` and the key's (the stage-0 member's) counter-signature
``ReplicaPartner(runId, round, stage, member)`` naming the stage-1 member as its partner (StepProverBinding
``_dataKey``). The round here is two stages of three replicas: stage-0 contribution ``j`` is member
``j + 1``'s, stage-1 contribution ``j`` member ``j + 4``'s, replica ``j`` the pair. The program and the
corpus are tests/step_data_fixtures.py's.
"""

from __future__ import annotations

import dataclasses

import pytest

from ledger.stepbinding import (
    REPLICA_TYPES,
    DataKeyClaim,
    PartnerClaim,
    ReplicaKey,
    bind_run,
    recover_data_key_signer,
    sign_data_key,
)
from ledger.stepcase import ledger_step_prover, run_stake
from ledger.stepdata import DataClient
from ledger.stepproof import PHASES, StepProverClient
from tests.fraud_fixtures import bound, commit, contribution
from tests.ledger_fixtures import deploy as deploy_ledger
from tests.step_binding_fixtures import NORMED, STAKE, TOY_SHAPES, TOY_STEPS, fix_program, toy_round
from tests.step_data_fixtures import batches_of, claim_of, program_fields, run_steps, terms, traces_of
from tests.test_step_case import CLOCK, WINDOW as PROOF_WINDOW, _address, _lands_at, _named
from tests.test_step_data import _answer, _claim, _side
from tests.test_step_end import copied_in_one_block
from tests.test_step_proof import _backend
from tests.test_step_proof_run import _start_state

STAGE1 = (4, 5, 6)  # the members of stage-1 contributions 0, 1, 2
OUTSIDER, FRONT = 8, 9


def _stage1_state():
    """Stage 1 of round 1: three raw stage-1 contributions aggregated onto the toy's start (version 3)."""
    from node.commitments import stage_state
    from tests.fraud_fixtures import tensors
    from tests.test_step_proof_run import _start_state as start
    from training.diloco import aggregate_with_report

    weights = dict(zip(TOY_SHAPES, (t.reshape(TOY_SHAPES[n]) for n, t in zip(TOY_SHAPES, start()))))
    blobs = [contribution(TOY_SHAPES, "raw", 400 + i, scale=1e-2, stage=1) for i in range(3)]
    args = {"stage_index": 1, "outer_round": 1}
    aggregation = aggregate_with_report(weights, tensors(2, TOY_SHAPES, scale=0.1), blobs, NORMED, **args)
    return stage_state(1, aggregation, blobs, NORMED, 1, decode_args=args)


def _setup(w3, data: bool = True):
    """The ledger's StepProver over a two-stage run whose program reads each step's batch and whose data is
    fixed (``data``); round 1's stage 0 lists members 1-3's contributions, its stage 1 members 4-6's."""
    deployment = deploy_ledger(w3, min_stake=STAKE)
    client = StepProverClient(w3, ledger_step_prover(w3, deployment.ledger))
    fix = fix_program(client, program_fields())
    round_ = dataclasses.replace(toy_round(), other=_stage1_state())

    def before(run):
        fix(run)
        if data:
            DataClient(client).set_data(run.deployment.client(run.members[0]).address, run.run_id, terms())
        signers = [run.deployment.client(index) for index in STAGE1]
        round_.other = bound(round_.other, signers, run.run_id, 1, stage=1)

    committed = commit(deployment, round_, round_.honest, stake=STAKE, accusation_blocks=CLOCK,
                       dispute_blocks=PROOF_WINDOW, inner_steps=TOY_STEPS, before=before, seats=max(STAGE1))
    client.bond = run_stake(w3, deployment.ledger, committed.run_id)
    return client, committed, round_.other


def _signed(w3, committed, stage1, index: int, key: str, by: int, round_: int = 1) -> bytes:
    """Dev account ``by``'s signature of ``DataKey`` for stage-1 contribution ``index`` naming ``key``."""
    claim = DataKeyClaim(committed.run_id, round_, 1, stage1.factors.payload_roots[index], key)
    return sign_data_key(committed.deployment.client(by).account, claim, w3.eth.chain_id,
                         committed.deployment.ledger)


def _partner(w3, committed, member: int, by: int, round_: int = 1, stage: int = 1) -> bytes:
    """Dev account ``by``'s counter-signature naming dev account ``member`` its partner at ``stage``."""
    claim = PartnerClaim(committed.run_id, round_, stage, _address(w3, member))
    return sign_data_key(committed.deployment.client(by).account, claim, w3.eth.chain_id,
                         committed.deployment.ledger)


def _subject(committed, stage1, index: int, replica: ReplicaKey | None):
    """The subject of a claim about round 1's stage-1 contribution ``index`` (its key: ``replica``'s)."""
    return bind_run(committed.records[1], committed.stages[1], stage1.factors, index, committed.records[0],
                    committed.stages[0], 1, replica)


def _honest(w3, committed, stage1, index: int):
    """Stage-1 contribution ``index``'s subject keyed by its replica's stage-0 member, its member signing and
    the stage-0 member counter-signing."""
    key = _address(w3, index + 1)
    signature = _signed(w3, committed, stage1, index, key, STAGE1[index])
    partner = _partner(w3, committed, STAGE1[index], index + 1)
    replica = ReplicaKey(committed.states[1].factors, index, signature, partner)
    return _subject(committed, stage1, index, replica)


def _claim_on(subject):
    batches = batches_of(subject.data_key, 1, TOY_STEPS)
    traces = traces_of(run_steps(_start_state(), batches), batches)
    return claim_of(traces, subject, batches), traces, batches


def test_the_data_key_message_signs_and_recovers():
    """``DataKey``'s digest is its EIP-712 typed data's (what a wallet signs), and its signer recovers."""
    from eth_account import Account
    from eth_account.messages import encode_typed_data

    account = Account.from_key(b"\x07" * 32)
    claim = DataKeyClaim(3, 9, 1, b"\x11" * 32, "0x" + "ab" * 20)
    ledger = "0x" + "cd" * 20
    signable = encode_typed_data(full_message=claim.typed_data(31337, ledger))
    assert Account.recover_message(signable, signature=sign_data_key(account, claim, 31337, ledger)) \
        == account.address
    assert recover_data_key_signer(claim, sign_data_key(account, claim, 31337, ledger), 31337, ledger) \
        == account.address
    assert claim.digest(31337, ledger) != dataclasses.replace(claim, stage=2).digest(31337, ledger)
    partner = PartnerClaim(3, 9, 1, "0x" + "ab" * 20)
    signable = encode_typed_data(full_message=partner.typed_data(31337, ledger))
    assert Account.recover_message(signable, signature=sign_data_key(account, partner, 31337, ledger)) \
        == account.address
    assert partner.digest(31337, ledger) != dataclasses.replace(partner, round=8).digest(31337, ledger)


@pytest.mark.parametrize("backend", ["pyevm", pytest.param("anvil", marks=pytest.mark.slow)])
def test_a_later_stage_claims_with_its_replicas_key_and_answers_its_data(request, backend):
    """Stage-1 contribution 1 (member 5, replica 1) claims with member 2's key, the windows its replica read:
    taken, and a data dispute of its last block's token (the last step's last row's last token) is answered
    from the corpus at those windows in the defender's clock's last block; the same claim's copy sent by a
    front-runner in the same block is a claim of its own (each bonds, neither takes the other's)."""
    w3 = _backend(request, backend)
    client, committed, stage1 = _setup(w3)
    stake = client.bond
    subject = _honest(w3, committed, stage1, 1)
    assert subject.data_key == _address(w3, 2) and subject.stage == 1
    claim, traces, batches = _claim_on(subject)
    defender = _address(w3, OUTSIDER)  # anyone holding the inputs and the member's signature
    claim_id = _claim(client, defender, claim, subject)
    statuses = copied_in_one_block(w3, client, "claimRun", (claim, subject.binding), FRONT, 7)
    assert statuses == [1, 1]
    side = _side(traces, batches, subject)
    game = DataClient(client).challenge(claim_id, TOY_STEPS - 1, 1, 3, _address(w3, 7))
    state = client.game(game)
    _lands_at(w3, state["turnSince"] + state["defenderLeft"])  # the clock's last block
    _answer(client, game, side, defender)
    assert client.game(game)["phase"] == PHASES.index("Done") and not client.wrong(claim_id)
    assert client.contract.functions.balanceOf(defender).call() == stake


@pytest.mark.parametrize("backend", ["pyevm", "anvil"])
def test_a_later_stage_claim_naming_another_replicas_key_is_refused(request, backend):
    """Refused by name: a stage-1 member naming another replica's stage-0 key (its index in the stage-0
    factors) with its own signature of that key but no counter-signature of that key's owner (the known
    limit before the counter-signature: taken then), or with its own replica's stage-0 member's; the key's
    owner counter-signing another member, another stage or another round; the replica's key with the
    dataKey field naming another; the stage-1 member's own key without the replica's binding; a ``DataKey``
    signature of another round's message, an outsider's; a stage-0 opening that is not the round's stage-0
    leaf; a binding cut short. Taken: the honest binding, and the coalition of the stage-1 member with the
    other replica's stage-0 member (both sign: what stays possible, docs/FRAUD_PROOF.md)."""
    w3 = _backend(request, backend)
    client, committed, stage1 = _setup(w3)
    stake, sender = client.bond, _address(w3, OUTSIDER)
    member, key, other = _address(w3, STAGE1[1]), _address(w3, 2), _address(w3, 3)
    stage0 = committed.states[1].factors

    def refused(replica, data_key=None):
        subject = _subject(committed, stage1, 1, replica)
        if data_key is not None:
            subject = dataclasses.replace(subject, data_key=data_key)
        claim = _claim_on(subject)[0]
        return _named(client, "claimRun", sender, claim, subject.binding, value=stake)

    honest = _signed(w3, committed, stage1, 1, key, STAGE1[1])
    cosigned = _partner(w3, committed, STAGE1[1], 2)  # member 2 names member 5 its stage-1 partner
    # another replica's key (stage-0 contribution 2, member 3): the member signs it, member 3 never did
    naming_other = _signed(w3, committed, stage1, 1, other, STAGE1[1])
    assert refused(ReplicaKey(stage0, 2, naming_other, cosigned)) == "ProverStepWrongReplica"
    no_signature = b"\x00" * 64 + b"\x1b"  # r = s = 0: recovers nobody
    assert refused(ReplicaKey(stage0, 2, naming_other, no_signature)) == "ProverStepWrongReplica"
    assert refused(ReplicaKey(stage0, 2, honest, cosigned)) == "ProverStepWrongReplica"
    # member 3 counter-signing its own partner (member 6), another stage, another round
    for wrong in (_partner(w3, committed, STAGE1[2], 3), _partner(w3, committed, STAGE1[1], 3, stage=2),
                  _partner(w3, committed, STAGE1[1], 3, round_=0)):
        assert refused(ReplicaKey(stage0, 2, naming_other, wrong)) == "ProverStepWrongReplica"
    # the replica's own key counter-signed by someone else than its owner (the stage-1 member itself)
    assert refused(ReplicaKey(stage0, 1, honest, _partner(w3, committed, STAGE1[1], STAGE1[1]))) \
        == "ProverStepWrongReplica"
    # the replica's binding with the claim's dataKey naming another account
    assert refused(ReplicaKey(stage0, 1, honest, cosigned), data_key=other) == "ProverStepWrongDataKey"
    # the stage-1 member's own key, no replica binding (what a later stage named before)
    assert refused(None) == "ProverStepWrongReplica"
    assert _subject(committed, stage1, 1, None).data_key == member
    # the member's signature of round 0's message, and an outsider's of round 1's
    assert refused(ReplicaKey(stage0, 1, _signed(w3, committed, stage1, 1, key, STAGE1[1], round_=0),
                              cosigned)) == "ProverStepWrongReplica"
    assert refused(ReplicaKey(stage0, 1, _signed(w3, committed, stage1, 1, key, OUTSIDER), cosigned)) \
        == "ProverStepWrongReplica"
    # the stage-1 factors offered as stage 0's: their leaf is not stage 0's
    subject = _honest(w3, committed, stage1, 1)
    leaves = [leaf.encode() for leaf in committed.stages[1]]
    from eth_abi import decode, encode

    parts = list(decode(REPLICA_TYPES, subject.binding[8]))
    parts[0], parts[2] = leaves[1], stage1.factors.encode()
    swapped = encode(REPLICA_TYPES, parts)
    claim = _claim_on(subject)[0]
    assert _named(client, "claimRun", sender, claim, (*subject.binding[:8], swapped), value=stake) \
        == "ProverBadStagePath"
    # a truncated binding: the stage-0 opening's words only, and one without the counter-signature's
    for cut in (100, 224):
        assert _named(client, "claimRun", sender, claim, (*subject.binding[:8], subject.binding[8][:cut]),
                      value=stake) == "ProverStepWrongReplica"
    # and the honest one is taken
    _claim(client, sender, claim, subject)
    # a coalition of the stage-1 member and the other replica's stage-0 member, both signing, is taken
    coalition = _subject(committed, stage1, 1, ReplicaKey(stage0, 2, naming_other,
                                                          _partner(w3, committed, STAGE1[1], 3)))
    assert coalition.data_key == other
    _claim(client, sender, _claim_on(coalition)[0], coalition)


def test_a_run_without_data_terms_checks_no_key(request):
    """Without data terms no claim's batches are ever disputed (the terms are fixed before the first commit
    only), so a claim's key is not checked: a stage-1 claim naming its own member, without a replica binding,
    and one naming anyone are taken (py-evm)."""
    w3 = _backend(request, "pyevm")
    client, committed, stage1 = _setup(w3, data=False)
    subject = _subject(committed, stage1, 1, None)
    assert subject.data_key == _address(w3, STAGE1[1])
    _claim(client, _address(w3, OUTSIDER), _claim_on(subject)[0], subject)
    anyone = dataclasses.replace(subject, data_key=_address(w3, OUTSIDER))
    _claim(client, _address(w3, OUTSIDER), _claim_on(anyone)[0], anyone)


def test_stage_zero_claims_are_keyed_as_before_and_ignore_a_replica_binding(request):
    """A stage-0 claim's key is its own listed member whatever ``replica`` carries (py-evm)."""
    w3 = _backend(request, "pyevm")
    client, committed, stage1 = _setup(w3)
    subject = bind_run(committed.records[1], committed.stages[1], committed.states[1].factors, 0,
                       committed.records[0], committed.stages[0], 0,
                       ReplicaKey(committed.states[1].factors, 2, b"\x01" * 65, b"\x01" * 65))
    assert subject.data_key == _address(w3, 1) and subject.binding[8] == b""
    claim = _claim_on(subject)[0]
    junk = (*subject.binding[:8], b"\x13" * 300)
    _claim(client, _address(w3, OUTSIDER), claim, dataclasses.replace(subject, binding=junk))
    # a later stage's binding must name a listed stage-0 member, and its message a key that is an address
    from ledger.errors import LedgerInputError

    with pytest.raises(LedgerInputError, match="its factors list no member"):
        _subject(committed, stage1, 1, ReplicaKey(committed.states[1].factors, 3, b"\x01" * 65, b""))
    with pytest.raises(LedgerInputError, match="not an address"):
        DataKeyClaim(committed.run_id, 1, 1, b"\x00" * 32, "0x1234")
