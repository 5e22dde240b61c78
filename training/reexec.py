"""Re-execution spot checks: rerun another replica's round and compare it with what it signed (issue 13).

A contribution of replica ``i`` to round ``t`` binds (in its signed envelope)
the hash of the replica's start state (:mod:`training.replica_state`) and a
commitment to the round's data (:func:`data_commitment`). A verifier that
samples it (:func:`sample_replicas`) fetches the start state, checks both
bindings, and reruns the round exactly as the node runs it::

    restore trainer + engines from the start state        # training.replica_restore.restore_replica
    for action in round_actions(diloco, t):               # training.schedule, as node/live/node.py
        train:  H inner AdamW steps on round_batches(seed, i, t, k), lr = inner_lr(t*H + k)
        apply:  finish_round(t-1, the public contributions of round t-1)
        encode: skip_to(t); encode_contribution(t)         # error feedback, codec: the node's code
    compare the payloads with the signed ones             # contribution_distance -> verdict

A replica split over several processes (one stage per node, GPipe micro-batches)
is re-executed whole in one process: ``LocalReplicaTrainer.train_step`` with the
pipeline's ``micro_batches`` runs the one inner step (:func:`training.pipeline.inner_step`) with the
pipeline's arithmetic (per-micro-batch losses, gradients accumulated in
micro-batch order and divided by their count, clipping on the summed squared
norms), so the chained rerun is bit-exact with the split one
(``tests/test_training_reexec.py``).

Bit-exact on the same platform with the same intra-op thread count (the start
state records both; the rerun uses the claimant's thread count and precision on
the verifier's own device), and then demanded: any difference is a mismatch. On
another platform (another device, GPU model, library version, precision flags) or
thread count the float reductions run in another order: the payloads then differ
slightly and the check falls back to the relative L2 distance of the decoded
pseudo-gradients in three zones: passed, undecided (no verdict: needs a verifier of the
claimant's platform) or a mismatch (:func:`training.fingerprint.compare_rerun`; docs/DILOCOX.md
section 11, docs/GPU.md).

The rerun also yields the replica's start state of round ``t+1``; its hash
must equal the one the replica's round ``t+1`` contribution binds (chaining:
the private parts of the state, error-feedback residual and AdamW moments,
are checked through the transition they must follow), unless that state is
one a restart rebuilds from the record alone (:func:`restart_state_reason`).

The spot check's parts: the rerun (:mod:`training.reexec_rerun`), the check of a contribution against it
(:mod:`training.spot_check`), the sampling, commitments and state chain (:mod:`training.reexec_rules`) and the
distances (:mod:`training.reexec_distance`). Callers import them from here.
"""

from __future__ import annotations

from training.fingerprint import EXACT, MISMATCH, UNDECIDED, WITHIN_TOLERANCE
from training.reexec_distance import contribution_distance, sliced_contribution_distance
from training.reexec_rerun import Reexecution, reexecute, rerun_compiled
from training.reexec_rules import (
    RESTART_ATOL,
    RESTART_RTOL,
    STATE_MISMATCH,
    check_state_chain,
    claimed_steps,
    data_commitment,
    restart_state_reason,
    round_meta,
    sample_replicas,
    sample_score,
    start_global_round,
    steps_in_range,
)
from training.spot_check import (
    DATA_MISMATCH,
    DEFAULT_TOLERANCE,
    NO_APPLY,
    OTHER_RESULT,
    ContributionClaim,
    SpotCheck,
    verdict,
    verify_contribution,
)

#: The spot check's names, re-exported: callers import the spot check from here.
__all__ = [
    "DATA_MISMATCH",
    "DEFAULT_TOLERANCE",
    "EXACT",
    "MISMATCH",
    "NO_APPLY",
    "OTHER_RESULT",
    "RESTART_ATOL",
    "RESTART_RTOL",
    "STATE_MISMATCH",
    "UNDECIDED",
    "WITHIN_TOLERANCE",
    "ContributionClaim",
    "Reexecution",
    "SpotCheck",
    "check_state_chain",
    "claimed_steps",
    "contribution_distance",
    "data_commitment",
    "reexecute",
    "rerun_compiled",
    "restart_state_reason",
    "round_meta",
    "sample_replicas",
    "sample_score",
    "sliced_contribution_distance",
    "start_global_round",
    "steps_in_range",
    "verdict",
    "verify_contribution",
]
