"""The contribution proof's bottom legs, measured (issue 78): the trace of a reproducible inner step
(training/step_trace.py) and StepProver's games (contracts/src/StepProver.sol) on real shapes.

Per model (``mini``; ``--models mini llama-20m`` adds the larger one):

* the trace: two inner steps of a fresh trainer in the reproducible mode (kernel version 3, batch 2), traced:
  ops per step by phase, the seconds the second step takes traced and untraced (the first compiles), and
  that the traced weights are the untraced ones bit for bit;
* the product game on the model's largest inner dimension ``k`` (the widest matmul of a block: the MLP's down
  projection, whose ``k`` is its hidden width), ``a`` (batch x block rows, ``k``) random, ``b`` the model's
  own initial weight: an honest claim against a challenger that disputes everything, and a one-ulp cheat
  against an honest challenger, on py-evm; each move's gas and calldata bytes, and the move count against
  ``2 + 2 ceil(log2 k) + 1``;
* an elementwise game (a one-ulp cheat in an add);
* the tree sum game (``tree_case``): a norm's statistic, the tree sum of squares over the model's width of
  each of the batch's rows (``TREESUM``): an honest claim against a challenger that disputes everything, a
  one-ulp cheat in one node of the tree and a misread element against an honest challenger; each move's gas
  and calldata, the move count against ``3 + 2 ceil(log2 n)``;
* the level over the H steps (``run_case``, once, not per model): tests/test_step_proof.py's five-op toy
  program run H = 100 times, a one-ulp cheat in step 70's update of W (carried on) against an honest
  challenger, and the honest run against a challenger that disputes everything: each move's gas and calldata,
  the moves;
* a claim's start disputed (``start_case``): ``challengeStart`` and ``proveStart`` on the ledger's StepProver,
  an honest claim upheld and a claim from another start refuted by the clock;
* a claim's end disputed (``end_case``): ``setEndRule``, ``challengeEnd`` and ``proveEnd`` on the ledger's
  StepProver in a run with the plain end rule, the toy round's contribution coded raw and quant (2 bits) by
  the run's encoder: an honest claim upheld on W's first and last elements and on a clamped quant element, and
  a true run whose payload is one element off refuted by the clock;
* a claim's batches disputed (``data_case``): ``setData``, ``challengeData`` and ``proveData`` on the ledger's
  StepProver in a run whose program reads each step's batch (an embedding lookup), an honest claim upheld, a
  claim on a batch one token off refuted by the clock, and a claim that commits the run's batches but ran a
  step on another refuted in its step game (``openOp`` opens the batch under the claim's ``batchRoot``).

The move bound of the whole game (issue 78) is ``log2(H) + log2(ops per step) + log2(k) + c`` halvings: the
ops per step measured here give it; the three levels are on chain, but a model's step is not mapped to a
program of on-chain ops yet, so the whole game is measured on the toy program only (docs/FRAUD_PROOF.md).

    python bench/bench_step_proof.py [--models mini llama-20m] [--out bench/results/step_proof.json]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.benchio import default_out, write_result  # noqa: E402
from ledger.chain import connect_pyevm  # noqa: E402
from ledger.chunkproof import tree_root  # noqa: E402
from ledger.stepproof import (  # noqa: E402
    ADD,
    MATMUL,
    MUL,
    Defender,
    Operation,
    StepProverClient,
    StepTrace,
    deploy,
    play,
    run_game,
    state_roots,
)
from training import exact_kernel  # noqa: E402
from training.exact_probe import trainer_for  # noqa: E402
from training.step_trace import (  # noqa: E402
    SUB,
    element_leaves,
    partial_sums,
    run_op,
    state_tensors,
    trace_steps,
    tree_levels,
)

BATCH = 2


def _bump(t: torch.Tensor, index: int) -> torch.Tensor:
    bits = t.detach().clone().contiguous().view(-1).view(torch.int32)
    bits[index] += 1
    return bits.view(torch.float32).view(t.shape)


def trace_case(preset: str) -> dict:
    cfg, plain = trainer_for(preset, "adamw", True, BATCH, 3)
    _, traced = trainer_for(preset, "adamw", True, BATCH, 3)

    def batches():
        generator = torch.Generator().manual_seed(7)
        return [tuple(torch.randint(0, cfg.vocab_size, (BATCH, cfg.block_size), generator=generator)
                      for _ in range(2)) for _ in range(2)]

    first, second = batches()
    plain.train_step(*first)  # the first step compiles the kernels
    began = time.perf_counter()
    plain.train_step(*second)
    plain_s = time.perf_counter() - began
    _, traces = trace_steps(traced, [first], tree_root)
    began = time.perf_counter()
    _, more = trace_steps(traced, [second], tree_root)
    traced_s = time.perf_counter() - began
    traces += more
    same = all(torch.equal(a.view(torch.int32), b.view(torch.int32))
               for (_, a), (_, b) in zip(state_tensors(plain), state_tensors(traced), strict=True))
    phases: dict[str, int] = {}
    for phase, _, _ in traces[0].ops:
        phases[phase] = phases.get(phase, 0) + 1
    return {"ops_per_step": len(traces[0].ops), "ops_by_phase": phases,
            "state_tensors": len(state_tensors(traced)), "step_seconds": round(plain_s, 3),
            "traced_step_seconds": round(traced_s, 3), "traced_bits_equal_untraced": same}, cfg, traced


def _widest_weight(trainer) -> torch.Tensor:
    """The 2-D weight with the largest input width (an ``nn.Linear`` weight is ``(out, in)``)."""
    weights = [p for m in trainer.stage_modules for n, p in m.named_parameters() if p.dim() == 2
               and "wte" not in n and "embed" not in n and "lm_head" not in n]
    return max(weights, key=lambda p: p.shape[1]).detach()


def game_case(cfg, trainer) -> dict:
    weight = _widest_weight(trainer)  # (out, k)
    b = weight.t().contiguous()  # (k, out)
    k = b.shape[0]
    generator = torch.Generator().manual_seed(1)
    a = torch.randn(BATCH * cfg.block_size, k, generator=generator)
    out = exact_kernel.ordered_matmul(a, b)
    w3 = connect_pyevm()
    client = StepProverClient(w3, deploy(w3, 10**15, 1000, "0x" + "00" * 20))  # op claims only: no ledger
    defender, challenger = w3.eth.accounts[1], w3.eth.accounts[2]
    rows, cols = a.shape[0], b.shape[1]
    cache: dict[int, list[int]] = {}

    def truth(elem, point):
        if elem not in cache:
            cache[elem] = partial_sums(a, b, elem // cols, elem % cols)
        return cache[elem][point]

    def op_of(result):
        return Operation(MATMUL, rows, k, cols, element_leaves(a), element_leaves(b), element_leaves(result),
                         rows * k, k * cols)

    honest = Defender(op_of(out), defender, truth)
    elem = out.numel() // 2 + 1
    won, honest_moves = play(client, client.claim(honest.op, defender), honest, challenger, elem,
                             lambda *_: False)
    honest_log = list(client.gas_log)
    client.gas_log.clear()
    cheat = Defender(op_of(_bump(out, elem)), defender, lambda e, p: truth(e, p) + (p > k // 3))
    lost = not play(client, client.claim(cheat.op, defender), cheat, challenger, elem,
                    lambda p, posted: posted == truth(elem, p))[0]
    cheat_log = list(client.gas_log)

    def per_move(log):
        moves: dict[str, dict] = {}
        for name, gas, size in log:
            entry = moves.setdefault(name, {"count": 0, "max_gas": 0, "max_calldata_bytes": 0})
            entry["count"] += 1
            entry["max_gas"] = max(entry["max_gas"], gas)
            entry["max_calldata_bytes"] = max(entry["max_calldata_bytes"], size)
        return moves

    x = torch.randn(rows * cols, generator=generator)
    bias = torch.randn(cols, generator=generator)
    wrong = _bump(x + bias.repeat(rows), 5)
    client.gas_log.clear()
    elementwise = Operation(ADD, rows * cols, 0, 1, element_leaves(x), element_leaves(bias),
                            element_leaves(wrong), rows * cols, cols)
    add_lost = not play(client, client.claim(elementwise, defender), Defender(elementwise, defender),
                        challenger, 5, lambda *_: False)[0]
    add_log = list(client.gas_log)
    everything = honest_log + cheat_log + add_log
    return {
        "product": {"rows": rows, "k": k, "cols": cols, "b": "the model's widest initial weight, transposed",
                    "honest_upheld": won, "one_ulp_cheat_proven": lost, "honest_game_moves": honest_moves,
                    "move_bound": 2 + 2 * math.ceil(math.log2(k)) + 1,
                    "honest_game": per_move(honest_log), "cheat_game": per_move(cheat_log)},
        "elementwise_add": {"elements": rows * cols, "one_ulp_cheat_proven": add_lost,
                            "moves": per_move(add_log)},
        "max_gas_any_move": max(gas for _, gas, _ in everything),
        "max_calldata_bytes_any_move": max(size for _, _, size in everything),
        "limits": {"gas": 10_000_000, "calldata_bytes": 128 * 1024},
    }


def tree_case(cfg) -> dict:
    """The tree sum game on a norm's statistic (module docstring), py-evm."""
    from tests.test_step_tree import _bumped, _cheat, _honest, _judge

    rows, n = BATCH * cfg.block_size, cfg.n_embd
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(2))
    x = x * x
    w3 = connect_pyevm()
    client = StepProverClient(w3, deploy(w3, 10**15, 50, "0x" + "00" * 20))  # op claims only: no ledger
    defender, challenger = w3.eth.accounts[1], w3.eth.accounts[2]
    elem = rows // 2 + 1
    honest = Defender(_honest(x).op, defender, _honest(x).sums)
    won, honest_moves = play(client, client.claim(honest.op, defender), honest, challenger, elem,
                             lambda *_: False)
    honest_log, results = list(client.gas_log), {}
    # the lowest sum node whose one ulp is not rounded away on the way up, in the first row that has one
    # below the sum's children (squares are positive: a child's ulp is at most half its parent's)
    for elem in range(elem, rows):
        truth = tree_levels(x, n, elem)
        node = next((up, i) for up in range(1, len(truth)) for i in range(len(truth[up - 1]) // 2)
                    if _bumped(truth, up, i)[-1] != truth[-1])
        if node[0] < len(truth) - 2:
            break
    misread = x.clone()
    misread[elem, n // 3] = -x[elem, n // 3]
    cheats = (("one_ulp_node", _bumped(truth, *node)), ("wrong_leaf", tree_levels(misread, n, elem)))
    for name, levels in cheats:
        cheat = _cheat(x, elem, levels)
        cheat = Defender(cheat.op, defender, cheat.sums)
        claim = client.claim(cheat.op, defender)
        cheat_won, moves = play(client, claim, cheat, challenger, elem, _judge(x, elem))
        results[name] = {"proven": not cheat_won and client.wrong(claim), "moves": moves}
    everything = client.gas_log
    return {"rows": rows, "n": n, "what": "the sum of squares of each row of the model's width (a norm's "
            "statistic)", "honest_upheld": won, "honest_game_moves": honest_moves,
            "move_bound": 3 + 2 * math.ceil(math.log2(n)), "cheat_row": elem,
            "node_cheat_level": node[0], "levels": len(truth) - 1, **results,
            "honest_game": _per_move(honest_log), "all_games": _per_move(everything),
            "max_gas_any_move": max(gas for _, gas, _ in everything),
            "max_calldata_bytes_any_move": max(size for _, _, size in everything)}


#: tests/test_step_proof.py's toy step: state x (3x4), W (4x8), bias (8); h = x W, y = h + bias, z = y * y,
#: W' = W - z, bias' = bias * y.
TOY = [(MATMUL, 3, 4, 8, 12, 32, 0, 1), (ADD, 24, 0, 1, 24, 8, 3, 2), (MUL, 24, 0, 1, 24, 24, 4, 4),
       (SUB, 32, 0, 1, 32, 24, 1, 5), (MUL, 8, 0, 1, 8, 24, 2, 4)]
TOY_COPIES = [0, 6, 7]


def _toy_steps(steps: int, cheat_step: int | None = None) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(4)
    state = [torch.randn(n, generator=generator) * 0.01 for n in (12, 32, 8)]  # stays finite for 100 steps
    out = []
    for i in range(steps):
        tensors = list(state)
        for j, (kind, rows, inner, cols, _al, _bl, ai, bi) in enumerate(TOY):
            result = run_op(kind, rows, inner, cols, tensors[ai], tensors[bi])
            tensors.append(_bump(result, 5) if (i, j) == (cheat_step, 3) else result)
        out.append(tensors)
        state = [tensors[c] for c in TOY_COPIES]
    return out


def _toy_trace(tensors) -> StepTrace:
    return StepTrace([element_leaves(t) for t in tensors], TOY, TOY_COPIES, 3)


def _toy_policy(truth_steps, mine_steps):
    """An honest challenger's step game at the split step (it sees the defender's tensors)."""
    def policy(i):
        truth, mine = truth_steps[i], mine_steps[i]
        true_trace = _toy_trace(truth)
        j = next(j for j in range(len(TOY)) if not torch.equal(mine[3 + j].view(torch.int32),
                                                                truth[3 + j].view(torch.int32)))
        elem = int((mine[3 + j].view(torch.int32) != truth[3 + j].view(torch.int32)).nonzero()[0])

        def sums_of(tensors, j_, e, point):
            _k, rows, inner, cols, _al, _bl, ai, bi = TOY[j_]
            return partial_sums(tensors[ai].view(rows, inner), tensors[bi].view(inner, cols), e // cols,
                                e % cols)[point]

        return dict(dispute=lambda last: ("trace", 0),
                    judge_root=lambda j_, root: root == tree_root(true_trace.tree(j_)),
                    pick=lambda op: elem, judge=lambda j_, p, bits: bits == sums_of(truth, j_, elem, p),
                    sums=lambda j_, e, p: sums_of(mine, j_, e, p))
    return policy


def run_case(steps: int = 100, cheat_step: int = 70) -> dict:
    """The level over the H steps on the toy program (module docstring)."""
    truth, mine = _toy_steps(steps), _toy_steps(steps, cheat_step)
    true_roots = state_roots([_toy_trace(t) for t in truth])
    from tests.step_binding_fixtures import bound_prover, subject_of  # a ledger listing the claim's

    client, committed = bound_prover(connect_pyevm(), 10**15, 1000, steps=steps)
    subject = subject_of(committed)
    defender, challenger = client.w3.eth.accounts[1], client.w3.eth.accounts[2]
    won, cheat_moves = run_game(client, [_toy_trace(t) for t in mine], defender, challenger, subject=subject,
                                judge_state=lambda i, root: root == true_roots[i],
                                step_policy=_toy_policy(truth, mine))
    cheat_log = list(client.gas_log)
    client.gas_log.clear()
    honest_won, honest_moves = run_game(
        client, [_toy_trace(t) for t in truth], defender, challenger, subject=subject,
        judge_state=lambda i, root: False,
        step_policy=lambda i: dict(dispute=lambda last: ("trace", 0), judge_root=lambda j, root: False,
                                   pick=lambda op: 0, judge=lambda j, p, bits: False,
                                   sums=lambda j, e, p: partial_sums(*_operands(truth[i], j), e // TOY[j][3],
                                                                     e % TOY[j][3])[p]))
    everything = cheat_log + client.gas_log
    return {"program": "tests/test_step_proof.py's five-op toy step", "steps": steps,
            "cheat_step": cheat_step,
            "one_ulp_cheat_proven": not won, "cheat_game_moves": cheat_moves, "honest_upheld": honest_won,
            "honest_game_moves": honest_moves, "step_halvings": math.ceil(math.log2(steps)),
            "max_gas_any_move": max(gas for _, gas, _ in everything),
            "max_calldata_bytes_any_move": max(size for _, _, size in everything),
            "moves": _per_move(everything)}


def start_case() -> dict:
    """A claim's start disputed (StepProver.challengeStart/proveStart) on the ledger's StepProver, py-evm: the
    toy round (its committed start the toy's state); an honest claim answers a dispute of W's last element, a
    claim from a start with W[5] changed cannot answer W[5] and the clock refutes it."""
    from ledger.stepproof import run_claim, start_opening
    from tests.step_binding_fixtures import subject_of, toy_origins
    from tests.test_step_proof_run import _run, _start_state, _traces
    from tests.test_step_start import _challenge_start, _setup

    w3 = connect_pyevm()
    client, _cases, committed = _setup(w3)
    origins, leaves = toy_origins(), committed.states[0].weight_leaves
    defender, challenger, outsider = (w3.eth.accounts[i] for i in (1, 2, 3))
    honest = _traces(_run(_start_state()))
    subject = subject_of(committed, 0)
    client._send("claimRun", defender, run_claim(honest, subject), subject.binding, value=client.bond)
    claim_id = bytes(client.contract.functions.runIdOf(run_claim(honest, subject), defender).call())
    game = _challenge_start(client, claim_id, challenger, 1, 31)
    client._send("proveStart", defender, game, start_opening(honest[0], origins, 1, 31, leaves))
    upheld = not client.wrong(claim_id)
    start = _start_state()
    start[1] = start[1].clone()
    start[1].view(-1)[5] += 0.25
    other, other_subject = _traces(_run(start)), subject_of(committed, 1)
    claim = run_claim(other, other_subject)
    client._send("claimRun", defender, claim, other_subject.binding, value=client.bond)
    other_id = bytes(client.contract.functions.runIdOf(claim, defender).call())
    game = _challenge_start(client, other_id, outsider, 1, 5)
    state = client.game(game)
    from tests.ledger_fixtures import mine

    mine(w3, state["defenderLeft"] + 1)
    client._send("timeout", outsider, game)
    return {"honest_upheld": upheld, "other_start_refuted": client.wrong(other_id),
            "max_gas_any_move": max(gas for name, gas, _ in client.gas_log if name != "claimRun"),
            "moves": _per_move(client.gas_log)}


def end_case() -> dict:
    """A claim's end disputed (StepProver.challengeEnd/proveEnd) on the ledger's StepProver, py-evm, in a run
    with the plain end rule: the toy round whose first contribution is the run's encoder's coding of the
    toy's S - E, raw and quant; an honest claim answers W's first and last elements (and the quant W's
    elements one and two), a true run whose raw payload is one element off cannot answer it and the clock
    refutes it."""
    from tests.ledger_fixtures import mine
    from tests.test_step_end import _challenge_end, _claim, _opening, _setup

    out: dict = {"moves": {}}
    for codec in ("raw", "quant"):
        w3 = connect_pyevm()
        client, _cases, committed, subject, pieces, bits = _setup(w3, codec=codec)
        defender, challenger = w3.eth.accounts[4], w3.eth.accounts[5]
        claim_id, traces = _claim(w3, client, subject, defender)
        for elem in (0, 31, 1, 2):
            game = _challenge_end(client, claim_id, challenger, 1, elem)
            client._send("proveEnd", defender, game, *_opening(committed, traces, pieces, bits, 1, elem))
        out[f"{codec}_honest_upheld"] = not client.wrong(claim_id)
        out[f"{codec}_bits"] = bits
        out["moves"][codec] = _per_move([m for m in client.gas_log if m[0] not in ("claimRun", "setProgram")])
    w3 = connect_pyevm()
    client, _cases, _committed, subject, _pieces, _bits = _setup(w3, off=5)
    claim_id, _traces = _claim(w3, client, subject, w3.eth.accounts[1])
    game = _challenge_end(client, claim_id, w3.eth.accounts[8], 1, 5)
    mine(w3, client.game(game)["defenderLeft"] + 1)
    client._send("timeout", w3.eth.accounts[8], game)
    out["payload_one_element_off_refuted"] = client.wrong(claim_id)
    out["max_gas_any_move"] = max(m["max_gas"] for moves in out["moves"].values() for m in moves.values())
    out["max_calldata_bytes_any_move"] = max(m["max_calldata_bytes"] for moves in out["moves"].values()
                                             for m in moves.values())
    return out


def data_case() -> dict:
    """A claim's batches disputed (StepProver.setData/challengeData/proveData) on the ledger's StepProver,
    py-evm, in a run whose program reads each step's batch (tests/step_data_fixtures.py: the toy step and an
    embedding lookup of the batch, 2 rows of 4 ids a step, an 800-id corpus): an honest claim answers the
    first token, the last and a chosen one; a claim whose step 3 ran on a batch one token off cannot answer
    that token and the clock refutes it; and a claim that commits the run's batches but ran step 3 on
    another loses its step game at the lookup (the batch opened under the claim's batchRoot: ``openOp``)."""
    from ledger.stepdata import DataClient, batch_root, data_opening
    from tests.ledger_fixtures import mine
    from tests.step_binding_fixtures import TOY_STEPS, subject_of
    from tests.step_data_fixtures import batches_of, claim_of, corpus_leaves, run_steps, terms, traces_of
    from tests.test_step_data import _honest_step_policy, _setup
    from tests.test_step_proof_run import _start_state
    from training.data_binding import batch_leaves

    w3 = connect_pyevm()
    client, committed = _setup(w3)
    data = DataClient(client)
    defender, challenger = w3.eth.accounts[4], w3.eth.accounts[5]
    subject = subject_of(committed, 1)
    batches = batches_of(subject.data_key, 1, TOY_STEPS)
    honest = traces_of(run_steps(_start_state(), batches), batches)
    claim = claim_of(honest, subject, batches)
    client._send("claimRun", defender, claim, subject.binding, value=client.bond)
    claim_id = bytes(client.contract.functions.runIdOf(claim, defender).call())
    leaves, corpus = [batch_leaves(b) for b in batches], list(corpus_leaves())
    for step, row, pos in ((0, 0, 0), (TOY_STEPS - 1, 1, 3), (2, 1, 2)):
        game = data.challenge(claim_id, step, row, pos, challenger)
        data.prove(game, defender, data_opening(terms(), leaves, corpus, subject.data_key, 1, step,
                                                terms().element(row, pos)))
    upheld = not client.wrong(claim_id)
    other = subject_of(committed, 0)
    used = batches_of(other.data_key, 1, TOY_STEPS)
    used[3][1, 2] = (used[3][1, 2] + 1) % 8
    claim = claim_of(traces_of(run_steps(_start_state(), used), used), other, used)
    client._send("claimRun", w3.eth.accounts[1], claim, other.binding, value=client.bond)
    other_id = bytes(client.contract.functions.runIdOf(claim, w3.eth.accounts[1]).call())
    game = data.challenge(other_id, 3, 1, 2, challenger)
    mine(w3, client.game(game)["defenderLeft"] + 1)
    client._send("timeout", challenger, game)
    data_log = [m for m in client.gas_log if m[0] not in ("claimRun", "setProgram")]
    client.gas_log.clear()
    true_batches = batches_of(other.data_key, 1, TOY_STEPS)
    truth, mine_ = run_steps(_start_state(), true_batches), run_steps(_start_state(), used)
    true_roots = state_roots(traces_of(truth, true_batches))
    won, moves = run_game(client, traces_of(mine_, used, committed=true_batches), w3.eth.accounts[2],
                          w3.eth.accounts[6], subject=other,
                          judge_state=lambda i, root: root == true_roots[i],
                          step_policy=_honest_step_policy(truth, mine_, true_batches),
                          batch_root=batch_root([batch_leaves(b) for b in true_batches]))
    step_log = list(client.gas_log)
    client.gas_log.clear()
    # the honest claim against a challenger that agrees up to the lookup and disputes it (every element)
    upheld_lookup, lookup_moves = run_game(
        client, honest, defender, w3.eth.accounts[7], subject=subject, claimed=True,
        judge_state=lambda i, root: False, batch_root=batch_root(leaves),
        step_policy=lambda i: dict(dispute=lambda last: ("trace", 0), judge_root=lambda j, root: j <= 5,
                                   pick=lambda op: op.rows * op.cols - 1, judge=lambda j, p, bits: False,
                                   sums=lambda j, e, p: 0))
    everything = data_log + step_log + client.gas_log
    return {"corpus_tokens": terms().tokens, "rows": terms().rows, "window": terms().window,
            "steps": TOY_STEPS, "honest_upheld": upheld, "one_token_off_refuted": client.wrong(other_id),
            "other_batch_under_true_root_refuted": not won, "step_game_moves": moves,
            "honest_lookup_upheld": upheld_lookup, "honest_lookup_moves": lookup_moves,
            "lookup_game": _per_move(client.gas_log),
            "max_gas_any_move": max(gas for _, gas, _ in everything),
            "max_calldata_bytes_any_move": max(size for _, _, size in everything),
            "moves": _per_move(data_log), "step_game": _per_move(step_log)}


def _operands(tensors, j):
    _k, rows, inner, cols, _al, _bl, ai, bi = TOY[j]
    return tensors[ai].view(rows, inner), tensors[bi].view(inner, cols)


def _per_move(log):
    moves: dict[str, dict] = {}
    for name, gas, size in log:
        entry = moves.setdefault(name, {"count": 0, "max_gas": 0, "max_calldata_bytes": 0})
        entry["count"] += 1
        entry["max_gas"] = max(entry["max_gas"], gas)
        entry["max_calldata_bytes"] = max(entry["max_calldata_bytes"], size)
    return moves


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mini"])
    parser.add_argument("--out", default=default_out(__file__))
    args = parser.parse_args(argv)
    load = list(os.getloadavg())
    result: dict = {"kernel_version": 3, "batch": BATCH, "models": {}}
    for preset in args.models:
        trace, cfg, trainer = trace_case(preset)
        game = game_case(cfg, trainer)
        ops = trace["ops_per_step"]
        trace["halvings_bound_for_h"] = {str(h): math.ceil(math.log2(h)) + math.ceil(math.log2(ops))
                                         + math.ceil(math.log2(game["product"]["k"])) for h in (30, 100, 500)}
        result["models"][preset] = {"trace": trace, "games": game, "tree_sum": tree_case(cfg)}
        print(preset, trace, game["max_gas_any_move"], game["max_calldata_bytes_any_move"], flush=True)
    result["steps_level"] = run_case()
    print("steps level", {k: v for k, v in result["steps_level"].items() if k != "moves"}, flush=True)
    result["start_dispute"] = start_case()
    print("start dispute", result["start_dispute"], flush=True)
    result["end_dispute"] = end_case()
    print("end dispute", result["end_dispute"], flush=True)
    result["data_dispute"] = data_case()
    print("data dispute", {k: v for k, v in result["data_dispute"].items()
                           if k not in ("moves", "step_game", "lookup_game")},
          flush=True)
    write_result(args.out, result, load)
    return 0


if __name__ == "__main__":
    sys.exit(main())
