"""A run whose step program reads each step's batch and whose data is fixed on chain (issue 78, docs/
FRAUD_PROOF.md "The data's binding"): tests/test_step_data.py's and bench/bench_step_proof.py's.

The program is tests/test_step_proof.py's toy step (state x, W, bias) with two ops more: an embedding's lookup
of the step's batch (``GATHER``: the batch's 8 ids, each a row of W seen as an 8 x 4 table) and W's update by
it (``W'' = W' + lookup``), so every token of a step's batch changes its end. The corpus is 800 ids in
[0, 8) (the table's rows); a step's batch is 2 rows of 4 ids (block size 3).
"""

from __future__ import annotations

import functools

import torch

from ledger.chunkproof import tree_root
from ledger.stepdata import DataTerms, batch_path, batch_root
from ledger.stepproof import DATA_INPUT, StepTrace, run_claim
from training.data import corpus_from_ids
from training.data_binding import batch_leaves, claim_batches, data_leaves
from training.step_trace import ADD, GATHER, element_leaves, run_op

ROWS, WINDOW, SEED = 2, 3, 11
#: The toy's five ops (trace leaves 3-7), the lookup (leaf 8) and W's update (leaf 9).
PROGRAM = [(5, 3, 4, 8, 12, 32, 0, 1), (ADD, 24, 0, 1, 24, 8, 3, 2), (3, 24, 0, 1, 24, 24, 4, 4),
           (2, 32, 0, 1, 32, 24, 1, 5), (3, 8, 0, 1, 8, 24, 2, 4),
           (GATHER, ROWS * (WINDOW + 1), 0, 4, ROWS * (WINDOW + 1), 32, DATA_INPUT, 1),
           (ADD, 32, 0, 1, 32, 32, 6, 8)]
COPIES = [0, 9, 7]
DEPTH = 4


@functools.cache
def corpus():
    generator = torch.Generator().manual_seed(21)
    ids = torch.randint(0, 8, (800,), generator=generator)
    return corpus_from_ids(ids, "00" * 32, source="<8-id corpus>")


@functools.cache
def corpus_leaves() -> tuple[bytes, ...]:
    return tuple(data_leaves(corpus()))


def terms() -> DataTerms:
    return DataTerms(tree_root(list(corpus_leaves())), SEED, corpus().split_tokens("train"), ROWS, WINDOW)


def batches_of(key: str, round_: int, steps: int) -> list[torch.Tensor]:
    """The run's batches of the contribution drawn with account ``key`` in ``round_``."""
    return claim_batches(corpus(), SEED, bytes.fromhex(key[2:]), round_, steps, ROWS, WINDOW)


def run_steps(state: list[torch.Tensor], batches: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Each step's trace tensors of the program run from ``state`` on ``batches`` (one a step)."""
    steps = []
    for batch in batches:
        tensors = [t.reshape(-1) for t in state]
        for kind, rows, inner, cols, _al, _bl, ai, bi in PROGRAM:
            a = batch if ai == DATA_INPUT else tensors[ai]
            tensors.append(run_op(kind, rows, inner, cols, a, tensors[bi]))
        steps.append(tensors)
        state = [tensors[c] for c in COPIES]
    return steps


def traces_of(steps: list[list[torch.Tensor]], used: list[torch.Tensor],
              committed: list[torch.Tensor] | None = None) -> list[StepTrace]:
    """The traces of ``steps`` (run on the batches ``used``), each step's batch path in the tree of the
    batches the claim commits (``committed``; default ``used``)."""
    leaves = [batch_leaves(b) for b in used]
    tree = [batch_leaves(b) for b in (committed if committed is not None else used)]
    return [StepTrace([element_leaves(t) for t in tensors], PROGRAM, COPIES, DEPTH, batch=leaves[i],
                      batch_path=batch_path(tree, i)) for i, tensors in enumerate(steps)]


def program_fields() -> tuple:
    """The program's ``RunClaim`` fields (root, state leaves, ops, depth)."""
    from ledger.stepbinding import RunSubject

    state = [torch.zeros(12), torch.zeros(32), torch.zeros(8)]
    batch = torch.zeros(ROWS, WINDOW + 1, dtype=torch.long)
    subject = RunSubject(0, 0, 0, bytes(32), bytes(32), ())
    return run_claim(traces_of(run_steps(state, [batch]), [batch]), subject)[:4]


def claim_of(traces: list[StepTrace], subject, batches: list[torch.Tensor]) -> tuple:
    """The run claim of ``traces`` committing ``batches``."""
    return run_claim(traces, subject, batch_root([batch_leaves(b) for b in batches]))
