"""A ledger whose round 1 lists three contributions, under a StepProver bound to it: what StepProver's run
claims (issue 78) are about (tests/test_step_proof_run.py, tests/test_step_proof_binding.py)."""

from __future__ import annotations

import dataclasses
import functools
import math

from ledger.stepbinding import RunSubject, bind_run
from ledger.stepproof import StepProverClient, deploy
from tests.fraud_fixtures import DILOCO, Committed, aggregated_round, commit, contribution
from tests.ledger_fixtures import deploy as deploy_ledger

SHAPES = {"w": (2, 40)}  # 80 elements: a full chunk and a short one
NORMED = dataclasses.replace(DILOCO, commitments="normed")
STAKE = 10**18


@functools.cache
def honest_round():
    """Round 1 of three raw contributions, aggregated honestly (tests/test_contribution_binding.py's)."""
    blobs = [contribution(SHAPES, "raw", 100 + i, scale=1e-2) for i in range(3)]
    return aggregated_round(SHAPES, blobs, NORMED)


#: The toy program's inner steps H (tests/test_step_proof_run.py): the runs' innerSteps.
TOY_STEPS = 6


def toy_program() -> tuple:
    """The toy step program's ``RunClaim`` fields (root, state leaves, ops, depth): the runs' program."""
    from ledger.stepproof import run_claim
    from tests.test_step_proof import _run_program, _trace
    from tests.test_step_proof_run import _start_state

    subject = RunSubject(0, 0, 0, bytes(32), bytes(32), ())
    return run_claim([_trace(_run_program(_start_state(), None, 0))], subject)[:4]


def fix_program(client: StepProverClient, program: tuple | None = None, origins: list[bytes] | None = None):
    """A ``commit`` hook: the run's creator fixes ``program`` (default: the toy's) and the state's ``origins``
    on ``client``'s prover."""
    def before(run):
        creator = run.deployment.client(run.members[0]).address
        client.set_program(creator, run.run_id, program or toy_program(), origins)
    return before


#: The toy's state (x, W, bias: tests/test_step_proof.py) as a stage's weights, names in the state's order.
TOY_SHAPES = {"a": (3, 4), "b": (4, 8), "c": (8,)}


@functools.cache
def toy_round():
    """Round 1 of three raw contributions aggregated onto a start whose weights are the toy's start state
    (tests/test_step_proof_run.py ``_start_state``): the committed start of a toy claim's first state."""
    from tests.test_step_proof_run import _start_state

    weights = dict(zip(TOY_SHAPES, (t.reshape(TOY_SHAPES[n]) for n, t in zip(TOY_SHAPES, _start_state()))))
    blobs = [contribution(TOY_SHAPES, "raw", 200 + i, scale=1e-2) for i in range(3)]
    return aggregated_round(TOY_SHAPES, blobs, NORMED, weights=weights)


def toy_origins() -> list[bytes]:
    """The toy state's origins in ``toy_round``'s committed start (state tensor ``q``: stage tensor ``q``)."""
    from ledger.stepproof import origin_leaf
    from training.chunks import stage_layout

    places = stage_layout(TOY_SHAPES)
    firsts = {p.tensor: p.index for p in reversed(places)}
    return [origin_leaf(q, math.prod(shape), firsts[q], len(places))
            for q, shape in enumerate(TOY_SHAPES.values())]


def bound_prover(w3, bond: int, clock: int, steps: int = TOY_STEPS) -> tuple[StepProverClient, Committed]:
    """A ledger on ``w3`` with a normed run of ``steps`` inner steps whose rounds 0 and 1 are committed
    (members 1-3), and a StepProver bound to it, where the run's program is the toy's."""
    round_ = honest_round()
    deployment = deploy_ledger(w3, min_stake=STAKE)
    client = StepProverClient(w3, deploy(w3, bond, clock, deployment.ledger))
    committed = commit(deployment, round_, round_.honest, stake=STAKE, inner_steps=steps,
                       before=fix_program(client))
    return client, committed


def subject_of(committed: Committed, index: int = 0) -> RunSubject:
    """The subject of a run claim about round 1's contribution ``index`` (stage 0), from round 0's start."""
    return bind_run(committed.records[1], committed.stages[1], committed.states[1].factors, index,
                    committed.records[0], committed.stages[0], 0)


def toy_start_and_end() -> tuple[dict, dict]:
    """The toy state before and after ``TOY_STEPS`` honest steps (tests/test_step_proof_run.py ``_run``), as
    the stage's named tensors: a toy contribution's ``S`` and ``E``."""
    from tests.test_step_proof import COPIES
    from tests.test_step_proof_run import _run, _start_state

    start = _start_state()
    last = _run(start)[-1]
    named = {n: t.reshape(TOY_SHAPES[n]) for n, t in zip(TOY_SHAPES, start)}
    return named, {n: last[c].reshape(TOY_SHAPES[n]) for n, c in zip(TOY_SHAPES, COPIES)}


def toy_coder(codec: str):
    """The run's encoder of a plain-end run (no error feedback, no low-rank): ``raw`` with compression off,
    ``quant`` a new run's codec (v2, "mse" scales, reproducible) with no tensor coded low-rank."""
    import torch  # noqa: F401  (the codec's tensors)

    from training.compression import ErrorFeedbackCompressor
    from training.config_compression import NEW_RUN_COMPRESSION, CompressionConfig

    cfg = (CompressionConfig(enabled=False) if codec == "raw"
           else CompressionConfig(**NEW_RUN_COMPRESSION, min_compress_numel=1 << 30))
    return ErrorFeedbackCompressor(TOY_SHAPES, cfg, exact=3)


@functools.cache
def toy_end_round(codec: str = "raw", off: int | None = None):
    """Round 1 whose contribution 0 is the run's encoder's coding (:func:`toy_coder`) of the toy's ``S - E``
    (``g``), with two random raw ones, aggregated onto the toy's start; ``off``: the payload codes ``g`` with
    W's element ``off`` one ulp off (what a coalition member's end one element off gives). Returns the round
    and contribution 0's blob."""
    import torch

    start, end = toy_start_and_end()
    g = {n: torch.sub(start[n], end[n]) for n in TOY_SHAPES}
    if off is not None:
        g["b"] = g["b"].clone()
        flat = g["b"].view(-1)
        flat[off] = torch.nextafter(flat[off], torch.tensor(float("inf")))
    blob = toy_coder(codec).compress(g, stage_index=0, outer_round=1)[0]
    others = [contribution(TOY_SHAPES, "raw", 300 + i, scale=1e-2) for i in range(2)]
    return aggregated_round(TOY_SHAPES, [blob, *others], NORMED, weights=start), blob


def end_subject(committed: Committed, blob: bytes):
    """The run claim's subject about contribution ``blob`` of round 1 (its index among the factors' payload
    roots) and its payload pieces."""
    from ledger.chunkproof import tree_root
    from training.chunks import payload_leaves

    pieces = payload_leaves(blob, TOY_SHAPES, stage_index=0, outer_round=1)
    index = list(committed.states[1].factors.payload_roots).index(tree_root(pieces))
    return subject_of(committed, index), pieces
