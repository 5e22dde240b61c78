"""No availability challenge where no honest node answers it (issue 79, point 5), on py-evm and on anvil.

No node of a version-1 (hashed) run runs the challenge answerer (node/live/fraud/answerer.py serves chunked
runs only), so an outsider could challenge a right round's stage leaf, let it expire (~188k gas), slash the
honest attesters, halt the run and be paid. ``challengeAvailability`` now refuses a hashed run
(``ProverNoAnswerer``): the one kind of run whose nodes answer nothing can be challenged with nothing.
"""

from __future__ import annotations

import pytest

from ledger import errors
from ledger.availability import stage_leaf_target
from tests.ledger_fixtures import chain_w3, deploy, mine  # noqa: F401 (chain_w3: the py-evm / anvil fixture)

STAKE = 10**18
OUTSIDER = 7


def test_a_hashed_runs_right_round_cannot_be_challenged_so_no_expiry_slashes(chain_w3):
    deployment = deploy(chain_w3, min_stake=STAKE)
    run = deployment.member_run((1, 2, 3), quorum=2, min_stake=STAKE, commitments=1, accusation_blocks=8,
                                dispute_blocks=8)
    record, _ = run.commit("right", signers=(1, 2))
    outsider = deployment.client(OUTSIDER)
    assert outsider.commitments_of(run.run_id) == 1
    with pytest.raises(errors.ProverNoAnswerer):
        outsider.challenge_availability(stage_leaf_target(record, 0))
    mine(chain_w3, 20)  # past every deadline a challenge opened then would have had
    with pytest.raises(errors.ProverNoAnswerer):
        outsider.challenge_availability(stage_leaf_target(record, 1))
    assert outsider.invalid_from(run.run_id) is None
    for index in (1, 2):
        seat = outsider.member(run.run_id, deployment.client(index).address)
        assert seat.status == "active" and seat.stake == STAKE
