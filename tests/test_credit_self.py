"""The node's read-back credits itself with every committed round of its result (docs/TRUST.md, G2; issue 63).

A member that signed the committed result with another checkpoint hash or loss figure (it heard a holder's
shard or attestation the quorum did not) is left out of the commit; ``ReadBack.verify`` attests its own
signed record, which the ledger credits, so it never falls behind. A record of another result is a fork,
not attested. And the record is signed over the head before its round, even when the round is committed
between the node's reads. Real TrainingLedger (py-evm and anvil), real LedgerClient, NodeChain, ReadBack and
Committer.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from ledger import errors
from node.live.chain.onchain import NodeChain
from node.live.chain.readback import ReadBack
from tests.ledger_fixtures import digest


def reading_node(client, run_id: int):
    """What ReadBack reads of a node (the committer's context), with this member's chain."""
    seen = SimpleNamespace(confirmed=[], agreed=[], diverged=[])
    node = SimpleNamespace(chain=NodeChain(client), run_id=run_id, fraud=None,
                           cfg=SimpleNamespace(round_timeout=5.0),
                           on_confirmed=seen.confirmed.append,
                           forks=SimpleNamespace(agreed=seen.agreed.append,
                                                 diverged=lambda *args: seen.diverged.append(args[0])))
    return ReadBack(node, checkpoints=None, wait=lambda predicate, timeout: predicate()), seen


@pytest.mark.parametrize("differing", [{"checkpoint_hash": digest("a checkpoint")}, {"eval_loss_micro": 1},
                                       {}], ids=["checkpoint", "losses", "left-out"])
def test_a_member_left_out_of_the_commit_of_its_result_attests_its_own_record(deployment, differing):
    run = deployment.member_run((1, 2, 3), quorum=2, inactivity_rounds=2)
    member = run.client(3)
    readback, seen = reading_node(member, run.run_id)
    for _ in range(3):
        committed, _tx = run.commit(signers=(1, 2))
        mine = replace(committed, **differing)
        readback.verify(committed.round, mine, member.sign_record(mine))
        seat = member.member(run.run_id, member.address)
        assert seat.active_round == committed.round + 1, differing
    assert seen.agreed == [0, 1, 2] and seen.diverged == []
    with pytest.raises(errors.LedgerMemberNotInactive):
        run.client(1).eject_inactive(run.run_id, member.address)


def test_a_member_whose_result_is_not_the_committed_one_does_not_attest(deployment):
    run = deployment.member_run((1, 2, 3), quorum=2, inactivity_rounds=2)
    member = run.client(3)
    readback, seen = reading_node(member, run.run_id)
    committed, _tx = run.commit(signers=(1, 2))
    forked = replace(committed, weights_root=digest("forked"))
    readback.verify(committed.round, forked, member.sign_record(forked))
    assert seen.diverged == [0] and seen.agreed == []
    assert member.member(run.run_id, member.address).active_round == 0  # a fork credits nothing


class CommitsBetweenReads(NodeChain):
    """A member's chain where another member's commit of the round lands right after this node found the
    round uncommitted, before it reads the chain head (``commit``: the commit, sent once)."""

    def __init__(self, client, commit) -> None:
        super().__init__(client)
        self.commit = commit

    def head_of(self, run_id: int) -> bytes:
        if self.commit is not None:
            self.commit, commit = None, self.commit
            commit()
        return super().head_of(run_id)


def test_the_record_is_signed_over_the_head_before_the_round_even_if_it_commits_meanwhile(deployment):
    """A commit landing between the node's read of the round and of the head made the head the round's own:
    the node signed a record no quorum could commit and no attest could credit; it takes the head before."""
    from node.live.record.committer import Committer

    run = deployment.member_run((1, 2, 3), quorum=2)
    run.commit(signers=(1, 2))
    record = run.next_record("round 1")
    chain = CommitsBetweenReads(run.client(3),
                                lambda: run.client(1).commit_round(record, run.sign(record, (1, 2))))
    committer = Committer.__new__(Committer)  # its chain step alone, without its thread
    committer.node = SimpleNamespace(chain=chain, run_id=run.run_id)
    onchain, prev_head = committer.prev_head(1)
    assert onchain == record and prev_head == record.prev_head != chain.head_of(run.run_id)
    assert committer.prev_head(2) == (None, chain.head_of(run.run_id))  # not committed: the current head
