"""Every listed contribution bound to a member (issue 62; docs/FRAUD_PROOF.md, "The binding"), on py-evm and
on anvil.

A version-3 round's factors carry, for each contribution the aggregation accepted, its contributor's member
account and that account's EIP-712 signature of the contribution's run, round, stage, payload root, norm root
and steps. A quorum that lists a contribution nobody sent (with weights consistent with it: no chunk or
norm proof sees it) cannot sign it with a member's key: the round is proven wrong and its attesters slashed.
So is a member listed twice, and a round listing more than the run's ``maxContributions``. A right round with
real signatures still reverts ``ProverRoundCorrect`` / ``ProverNormCorrect``.
"""

from __future__ import annotations

import dataclasses

import pytest

from ledger import errors
from ledger.chunkproof import Factors
from ledger.contribution_binding import ContributionClaim, compact, expand, recover_contributor
from ledger.errors import LedgerInputError
from tests.fraud_fixtures import DILOCO, aggregated_round, bound, commit, contribution, tensors
from tests.ledger_fixtures import chain_w3, deploy, mine  # noqa: F401 (chain_w3: the py-evm / anvil fixture)

SHAPES = {"w": (2, 40)}  # 80 elements: a full chunk and a short one
NORMED = dataclasses.replace(DILOCO, commitments="normed")
STAKE = 10**18
OUTSIDER = 8  # a dev account that never joins the runs below


@pytest.fixture(scope="module")
def honest():
    """Round 1 of three raw contributions, aggregated honestly (the weights consistent with all three)."""
    blobs = [contribution(SHAPES, "raw", 100 + i, scale=1e-2) for i in range(3)]
    return aggregated_round(SHAPES, blobs, NORMED)


def overturned(committed) -> bool:
    reader = committed.deployment.client(3)
    if reader.invalid_from(committed.run_id) != 1:
        return False
    return all(reader.member(committed.run_id, committed.deployment.client(index).address).status == "slashed"
               for index in committed.attesters)


def assert_proven(committed, *, by: str) -> None:
    """The round holds a proof of kind ``by`` ("norm": the scales' proof, which opens no chunk; "chunk"), and
    sending it overturns the round and slashes both attesters."""
    prover = committed.prover()
    if by == "norm":
        assert prover.norm_proof_holds(committed.scale_proof())
        prover.prove_wrong_norm(committed.scale_proof())
    else:
        assert prover.proof_holds(committed.proof(1))
        prover.prove_wrong_aggregation(committed.proof(1))
    assert overturned(committed)


def test_a_right_round_with_real_signatures_is_not_proven(chain_w3, honest):
    committed = commit(deploy(chain_w3, min_stake=STAKE), honest, honest.honest, stake=STAKE)
    norms = committed.states[1].factors.norms
    assert norms.bound and len(set(norms.contributors)) == 3
    prover = committed.prover()
    with pytest.raises(errors.ProverRoundCorrect):
        prover.prove_wrong_aggregation(committed.proof(1))
    with pytest.raises(errors.ProverNormCorrect):
        prover.prove_wrong_norm(committed.scale_proof())
    assert prover.invalid_from(committed.run_id) is None


@pytest.mark.parametrize("by", ["norm", "chunk"])
def test_a_contribution_signed_by_a_non_member_is_proven(chain_w3, honest, by):
    """The fabricated contribution: the quorum lists a third piece and signs it with an account of its own
    that holds no seat (the weights are the honest aggregation of all three)."""
    committed = commit(deploy(chain_w3, min_stake=STAKE), honest, honest.honest, stake=STAKE,
                       contributors=(1, 2, OUTSIDER))
    assert_proven(committed, by=by)


def test_an_unsigned_contribution_is_proven(chain_w3, honest):
    """Factors that list contributions without the binding (a node that signs nothing, or a quorum that drops
    it): none of them is bound to a member."""
    unsigned = honest.honest
    assert not unsigned.factors.norms.bound
    committed = commit(deploy(chain_w3, min_stake=STAKE), honest, unsigned, stake=STAKE, contributors=())
    assert committed.states[1].factors.norms.contributors == ()
    assert_proven(committed, by="norm")


def test_a_members_signature_over_another_payload_root_is_proven(chain_w3, honest):
    """Member 3 signed a contribution (its own, with another payload root); the quorum copies that signature
    beside a piece member 3 never sent: it recovers to another account than the one listed."""
    deployment = deploy(chain_w3, min_stake=STAKE)
    state, factors = honest.honest, honest.honest.factors
    run_id = deployment.client(1).run_count() + 1  # the run commit() creates
    signed = bound(state, [deployment.client(i) for i in (1, 2, 3)], run_id, 1)
    forged = ContributionClaim(run_id, 1, 0, factors.payload_roots[0], factors.norms.roots[2])
    signatures = list(signed.factors.norms.signatures)
    signatures[2] = deployment.client(3).sign_contribution(forged)
    norms = dataclasses.replace(signed.factors.norms, signatures=tuple(signatures))
    committed = commit(deployment, honest, dataclasses.replace(signed, factors=dataclasses.replace(
        factors, norms=norms)), stake=STAKE)
    assert committed.run_id == run_id
    assert_proven(committed, by="norm")


def test_a_member_listed_twice_is_proven(chain_w3, honest):
    """Member 1 sent two contributions (or the quorum lists its one twice): each signature is its own and
    valid, but one member has one contribution a stage."""
    committed = commit(deploy(chain_w3, min_stake=STAKE), honest, honest.honest, stake=STAKE,
                       contributors=(1, 2, 1))
    assert_proven(committed, by="chunk")


def test_more_than_max_contributions_is_proven(chain_w3, honest):
    committed = commit(deploy(chain_w3, min_stake=STAKE), honest, honest.honest, stake=STAKE,
                       max_contributions=2)
    assert committed.prover().run_info(committed.run_id).max_contributions == 2
    assert_proven(committed, by="norm")


def test_a_contributor_not_yet_a_member_in_the_round_is_proven_while_disputable(chain_w3, honest):
    """Account 7 signs a contribution to round 1 and joins only after round 1 is committed: no seat of it was
    in force in the round."""
    deployment = deploy(chain_w3, min_stake=STAKE)
    committed = commit(deployment, honest, honest.honest, stake=STAKE, contributors=(1, 2, 7))
    deployment.register(7)
    deployment.client(7).join_run(committed.run_id)
    assert_proven(committed, by="norm")


def mine_to(w3, block: int) -> None:
    """Mine until the next transaction lands in block ``block``."""
    mine(w3, max(0, block - 1 - w3.eth.block_number))


@pytest.mark.parametrize("by", ["norm", "chunk"])
def test_a_non_members_own_signature_is_proven_after_a_parent_committed_just_before(chain_w3, honest, by):
    """The back-to-back move: the quorum commits round 1 in the block after round 0 and lists a fabricated
    contribution signed by an outsider's key under the outsider's own address (a valid signature: only the
    seat tells). A proof of round 1 waits for round 0's window (``ProverParentOpen``), which closes a block
    after round 1's dispute window: the seats must still be read then (they were only within the dispute
    window before: ``ProverNormCorrect``, the round kept)."""
    committed = commit(deploy(chain_w3, min_stake=STAKE), honest, honest.honest, stake=STAKE,
                       contributors=(1, 2, OUTSIDER), gap=0)
    prover, run_id = committed.prover(), committed.run_id
    parent, child = (prover.commit_block_of(run_id, r) for r in (0, 1))
    disputes = prover.run_struct(run_id)["disputeBlocks"]
    assert child == parent + 1
    opens_at, closes_at = prover.proof_window_of(run_id, 1)
    assert opens_at == parent + disputes and closes_at > opens_at + 2
    mine_to(chain_w3, opens_at + 1)  # the proof's commitment in this block, the proof in the next
    if by == "norm":
        receipt = prover.prove_wrong_norm(committed.scale_proof())
    else:
        receipt = prover.prove_wrong_aggregation(committed.proof(1))
    assert child + disputes < receipt["blockNumber"] < closes_at  # past round 1's own dispute window
    assert overturned(committed)


def test_a_right_round_listing_a_member_that_left_after_it_and_withdrew_is_never_proven(chain_w3, honest):
    """No false proof from the longer reading of the seats: member 3 contributed to round 1 (committed the
    block after round 0), left in the block after it and withdraws as early as the rules allow (the run's
    unbonding the least createRun takes, the proof window's bound). Within the whole proof window its seat is
    still there (unbonding) and in force in round 1, at the window's first block and at its last; once
    withdrawn (a seat deleted reads as never joined) the seats are no longer read and the window is closed."""
    deployment = deploy(chain_w3, min_stake=STAKE)
    committed = commit(deployment, honest, honest.honest, stake=STAKE, gap=0, max_game_steps=1)
    prover, run_id, leaver = committed.prover(), committed.run_id, deployment.client(3)
    run = prover.run_struct(run_id)
    bound_ = run["disputeBlocks"] + 4 * run["accusationBlocks"]  # LedgerCore.proofWindowBound at 1 game step
    assert run["unbondingBlocks"] == bound_
    leaver.leave_run(run_id)
    seat = leaver.member(run_id, leaver.address)
    committed_at = prover.commit_block_of(run_id, 1)
    assert seat.left_round == 2 and seat.unbonding_end == committed_at + 1 + bound_
    opens_at, closes_at = prover.proof_window_of(run_id, 1)
    assert committed_at + run["disputeBlocks"] < closes_at <= seat.unbonding_end

    def refused(*kinds) -> None:
        with pytest.raises(kinds):
            prover.prove_wrong_norm(committed.scale_proof(), commit=False)
        with pytest.raises(kinds):
            prover.prove_wrong_aggregation(committed.proof(1), commit=False)
        assert prover.invalid_from(run_id) is None

    # A refused proof is refused by its gas estimate, which anvil runs in the latest block's context and
    # py-evm in the next block's: with the latest block at closes_at - 2, then closes_at - 1, both backends
    # try the window's last block.
    for latest in (opens_at, closes_at - 2, closes_at - 1):
        mine(chain_w3, latest - chain_w3.eth.block_number)
        refused(errors.ProverNormCorrect, errors.ProverRoundCorrect)
    mine(chain_w3, seat.unbonding_end - chain_w3.eth.block_number)
    leaver.withdraw_stake(run_id)
    assert leaver.member(run_id, leaver.address) is None
    refused(errors.ProverNormCorrect, errors.ProverRoundCorrect, errors.ProverProofWindowClosed)


def test_the_binding_round_trips_and_recovers(honest):
    from ledger.account import dev_account

    account = dev_account(1, 131277322940537)
    factors = honest.honest.factors
    claim = ContributionClaim(5, 1, 0, factors.payload_roots[0], factors.norms.roots[0])
    from ledger.contribution_binding import sign_contribution

    signature = sign_contribution(account, claim, 131277322940537, "0x" + "11" * 20)
    assert expand(*compact(signature)) == signature
    assert recover_contributor(claim, signature, 131277322940537, "0x" + "11" * 20) == account.address
    assert recover_contributor(claim, signature, 1, "0x" + "11" * 20) != account.address  # another chain
    other = dataclasses.replace(claim, steps=3)
    assert recover_contributor(other, signature, 131277322940537, "0x" + "11" * 20) != account.address
    norms = dataclasses.replace(honest.honest.factors.norms, contributors=(account.address,) * 3,
                                signatures=(signature,) * 3)
    factors = dataclasses.replace(honest.honest.factors, norms=norms)
    assert Factors.decode(factors.encode()) == factors
    with pytest.raises(LedgerInputError):  # a binding for some contributions only
        dataclasses.replace(norms, contributors=(account.address,), signatures=(signature,))
    with pytest.raises(LedgerInputError):  # a high-s (malleable) signature
        high = signature[:32] + (2**256 - 1).to_bytes(32, "big") + signature[64:]
        dataclasses.replace(norms, signatures=(high,) * 3)


def test_the_nodes_own_binding_is_what_the_contract_holds_right(chain_w3, honest):
    """The live node's side end to end: each contributor's binder signs its own blob (the roots derived from
    the codec blob, node.fraudproof.contribution_claim), the committer's stage state copies the signatures in
    (stage_state_of(bindings=...)), and the contract holds that round right."""
    from node.commitments import stage_state
    from node.live.chain.onchain import NodeChain
    from node.live.fraud.contribution_binding import ContributionBinder
    from training.diloco import aggregate_with_report

    deployment = deploy(chain_w3, min_stake=STAKE)
    run_id = deployment.client(1).run_count() + 1  # the run commit() creates
    signed = [ContributionBinder(run_id, NodeChain(deployment.client(j + 1)), NORMED, refuse_raw=False).sign(
        1, 0, blob, SHAPES) for j, blob in enumerate(honest.blobs)]
    bindings = [(deployment.client(j + 1).address, signature) for j, (_, signature) in enumerate(signed)]
    # the round's aggregation as aggregated_round made it (the same seeded weights and momentum)
    aggregation = aggregate_with_report(tensors(1, SHAPES), tensors(2, SHAPES, scale=0.1), honest.blobs,
                                        NORMED, stage_index=0, outer_round=1)
    state = stage_state(0, aggregation, honest.blobs, NORMED, 1,
                        decode_args={"stage_index": 0, "outer_round": 1}, bindings=bindings)
    assert state.factors.norms.bound and state.leaf() != honest.honest.leaf()
    committed = commit(deployment, honest, state, stake=STAKE)
    assert committed.run_id == run_id
    with pytest.raises(errors.ProverNormCorrect):
        committed.prover().prove_wrong_norm(committed.scale_proof())
    with pytest.raises(errors.ProverRoundCorrect):
        committed.prover().prove_wrong_aggregation(committed.proof(1))
