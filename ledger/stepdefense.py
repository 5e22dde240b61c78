"""The defender's side of a contribution case, one move at a time (issue 78; docs/FRAUD_PROOF.md "The node
defends its contributions").

``ledger.stepproof.run_game`` plays both sides of a game in one loop (the tests' and the bench's). A node that
defends its contribution plays one side only, against a challenger it does not control, over as many blocks
as the clock allows: each time it looks, it reads a game's state and sends the one move that is its own, if
any (:func:`defender_move`), or ends a game whose challenger let its clock run out (:func:`challenger_out`).
The moves are those of ``run_game``'s honest defender (the same openings: ``StepTrace.op_opening``,
``copy_proof``, ``output_opening``, ``sum_step_opening``, ``start_opening``, ``end_opening``,
``ledger.stepdata.data_opening``), so an honest defender never
loses for the same reason (docs/FRAUD_PROOF.md "The top level").

:func:`cases_opened` and :func:`games_on` read the contract's ``CaseOpened`` and ``Challenged`` logs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import contracts
from ledger.chunkproof import tree_root
from ledger.errors import LedgerInputError
from ledger.events import EventDecoder, scan_logs, topic_uint
from ledger.stepdata import CorpusTree, DataTerms, data_opening
from ledger.stepproof import (
    PHASES,
    StepTrace,
    end_opening,
    output_opening,
    start_opening,
    state_roots,
    sum_step_opening,
    tree_children,
)

#: The phases in which a game waits for nobody (not started, or decided).
IDLE = (PHASES.index("None"), PHASES.index("Done"))


@dataclass
class DataSide:
    """What an honest defender answers a data dispute from (``ledger.stepdata``): the run's data terms, the
    corpus's chunk leaves (the data root's; or its ``CorpusTree``, which reads a leaf again when asked), each
    step's batch leaves (the claim's ``batchRoot``'s), the claim's data key and round."""

    terms: DataTerms
    corpus: list[bytes] | CorpusTree
    batches: list[list[bytes]]
    key: str
    round: int


@dataclass
class DefenseSide:
    """What an honest defender answers from: its traces of the claim's steps (``traces[i]``: step ``i``), the
    run's state origins and the committed start's weight chunk leaves (for a start dispute), and
    ``sums(step, op, elem, point)``: the bits of a product's partial sum or of a tree sum's node ``point =
    (level, index)`` (``training.step_trace.op_point`` of its own tensors); for an end dispute, the
    contribution's payload pieces (``payload``; empty: it holds none, so it cannot answer one) and each state
    tensor's quant bit width (``bits``, 0 for raw); for a data dispute, the run's corpus and the claim's
    batches (``data``; None: it cannot answer one)."""

    traces: list[StepTrace]
    origins: list[bytes]
    committed: list[bytes]
    sums: Callable[[int, int, int, int], int]
    payload: list[bytes] = field(default_factory=list)
    bits: list[int] = field(default_factory=list)
    data: DataSide | None = None
    roots: list[bytes] = field(init=False)

    def __post_init__(self) -> None:
        self.roots = state_roots(self.traces)


@dataclass
class GameMemory:
    """What a defender remembers of one game between its moves: the step the steps' bisection ended on and
    the op the ops' bisection ended on (the game's ``lo`` holds each only until the next level starts)."""

    step: int | None = None
    op: int | None = None


def defender_move(game_id: bytes, game: dict, side: DefenseSide,
                  memory: GameMemory) -> tuple[str, tuple] | None:
    """The move (StepProver function name, arguments) the defender owes in ``game`` (``gameOf``'s fields by
    name, ``StepProverClient.game``), or None when it is not the defender's turn.

    Raises:
        LedgerInputError: the game reached a level whose step or op this memory never saw (a defender that
            started watching mid-game); its clock then decides.
    """
    phase = PHASES[game["phase"]]
    if not game["defenderTurn"] or game["phase"] in IDLE:
        return None
    lo, hi = game["lo"], game["hi"]
    mid = (lo + hi) // 2
    if phase == "Steps":
        return "postStateRoot", (game_id, side.roots[mid])
    if phase == "Start":
        return "proveStart", (game_id, start_opening(side.traces[0], side.origins, game["copyLeaf"],
                                                     game["elem"], side.committed))
    if phase == "End":
        if not side.payload:
            raise LedgerInputError(f"game {game_id.hex()[:12]}: an end dispute, and this defender holds no "
                                   "payload pieces of the contribution")
        q, bits = game["copyLeaf"], side.bits[game["copyLeaf"]] if side.bits else 0
        return "proveEnd", (game_id, *end_opening(side.traces[-1], side.origins, q, game["elem"],
                                                  side.committed, side.payload, bits))
    if phase == "Data":
        if side.data is None:
            raise LedgerInputError(f"game {game_id.hex()[:12]}: a data dispute, and this defender holds no "
                                   "corpus and batches of the claim")
        d = side.data
        return "proveData", (game_id, data_opening(d.terms, d.batches, d.corpus, d.key, d.round, lo,
                                                   game["elem"]))
    if phase == "Trace":  # the steps' bisection ended on step lo (or the claim is of one step)
        memory.step = lo
        trace = _trace(side, memory)
        return "postTrace", (game_id, tree_root(trace.tree(len(trace.specs))))
    trace = _trace(side, memory)
    if phase == "Copy":
        return "proveCopy", (game_id, *trace.copy_proof(game["copyLeaf"]))
    if phase == "Ops":
        return "postRoot", (game_id, tree_root(trace.tree(mid)))
    if phase == "OpOpen":
        memory.op = lo
        return "openOp", (game_id, trace.op_opening(lo))
    if phase == "Open":  # the challenger picked an element of op lo's output
        memory.op = lo
        return "openOutput", (game_id, *output_opening(trace.operation(lo), game["elem"]))
    if memory.op is None:
        raise LedgerInputError(f"game {game_id.hex()[:12]}: in {phase} without the op it split on")
    if phase == "Sums":
        return "postSum", (game_id, side.sums(memory.step, memory.op, game["elem"], mid))
    if phase == "Tree":  # the disputed node (lo of level hi) of a tree sum: its two children
        children = tree_children(trace.specs[memory.op][2], hi, lo)
        return "postChildren", (game_id, *(side.sums(memory.step, memory.op, game["elem"], node)
                                           for node in children))
    if phase == "Final":
        return "proveStep", (game_id, *sum_step_opening(trace.operation(memory.op), game["elem"], lo))
    raise LedgerInputError(f"game {game_id.hex()[:12]}: phase {phase} is not a defender's")


def _trace(side: DefenseSide, memory: GameMemory) -> StepTrace:
    if memory.step is None:
        raise LedgerInputError("a step game whose step this defender never saw (it watched from mid-game)")
    return side.traces[memory.step]


def challenger_out(game: dict, head: int) -> bool:
    """Whether ``game``'s challenger let its clock run out by block ``head``: its turn, and ``timeout`` holds
    at ``head`` itself (the contract's ``block.number - turnSince > challengerLeft``). A ``timeout`` mined in
    the next block would hold one block earlier, but a node's preflight (``eth_estimateGas``; anvil's) runs it
    at the head: so the defender sends it one block after the earliest, which costs it nothing (the
    challenger's clock stays spent)."""
    if game["defenderTurn"] or game["phase"] in IDLE:
        return False
    return head - game["turnSince"] > game["challengerLeft"]


def _decoder() -> EventDecoder:
    return EventDecoder(contracts.artifact("StepProver")["abi"])


def cases_opened(client, prover: str, run_id: int, from_block: int, to_block: int) -> list[dict]:
    """The ``CaseOpened`` events of run ``run_id`` on the StepProver at ``prover`` in [from_block, to_block]
    (``client``: a ``ledger.client.LedgerClient``), in chain order, fields by name and ``block``."""
    decoder = _decoder()
    logs = scan_logs(client.w3, prover, [decoder.topic("CaseOpened"), None, topic_uint(run_id)],
                     from_block, to_block, client.log_page_blocks, client.sender.rpc)
    return [{**event.args, "block": event.block_number}
            for event in map(decoder.decode, logs) if event is not None]


def games_on(client, prover: str, claim_id: bytes, from_block: int, to_block: int) -> list[dict]:
    """The ``Challenged`` events (each a game) on claim ``claim_id`` in [from_block, to_block]: ``gameId``,
    ``challenger``, ``elem`` and ``block``."""
    decoder = _decoder()
    logs = scan_logs(client.w3, prover, [decoder.topic("Challenged"), None, "0x" + bytes(claim_id).hex()],
                     from_block, to_block, client.log_page_blocks, client.sender.rpc)
    return [{**event.args, "block": event.block_number}
            for event in map(decoder.decode, logs) if event is not None]
