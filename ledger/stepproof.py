"""Calldata and moves of StepProver (contracts/src/StepProver.sol), the innermost legs of the contribution
proof (issue 78, docs/FRAUD_PROOF.md "The contribution proof").

A claim is one operation of a reproducible inner step: ``kind(a, b) = out`` over tensors committed by their
own chunk trees (``training.step_trace.tensor_root``: the tensor's chunk leaves, ``ledger.merkle`` tree). The
caller hands this module the tensors' chunk leaves (bytes; this package knows no torch) and, for a product,
the partial sums' bits of the challenged element (``training.step_trace.partial_sums``).

:class:`StepProverClient` sends the moves; :func:`play` runs one game between a :class:`Defender` and a
challenger's ``judge`` policy (``honest_judge`` agrees with a posted sum exactly when it is the true one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import contracts
from ledger.chunkproof import tree_path, tree_root

CHUNK = 64
ADD, SUB, MUL, DIV, MATMUL = 1, 2, 3, 4, 5
PHASES = ("None", "Open", "Sums", "Final", "Done")


@dataclass(frozen=True)
class Operation:
    """An operation's shape and its tensors' chunk leaves (``a``, ``b``, ``out``)."""

    kind: int
    rows: int
    inner: int
    cols: int
    a: list[bytes]
    b: list[bytes]
    out: list[bytes]
    a_len: int
    b_len: int

    def as_tuple(self) -> tuple:
        """The contract's ``Op`` struct."""
        return (self.kind, self.rows, self.inner, self.cols, self.a_len, self.b_len,
                tree_root(self.a), tree_root(self.b), tree_root(self.out))


def opening(leaves: list[bytes], index: int) -> tuple[bytes, list[bytes]]:
    """The contract's ``Element`` for element ``index``: its chunk leaf and the leaf's path."""
    chunk = index // CHUNK
    return leaves[chunk], tree_path(leaves, chunk)


EMPTY = (b"", [])


def deploy(w3, bond: int, clock_blocks: int, sender: str | None = None) -> str:
    """Deploy StepProver from its committed artifact; its address."""
    artifact = contracts.artifact("StepProver")
    factory = w3.eth.contract(abi=artifact["abi"], bytecode=artifact["bytecode"])
    tx = factory.constructor(bond, clock_blocks).transact({"from": sender or w3.eth.accounts[0]})
    return w3.eth.wait_for_transaction_receipt(tx)["contractAddress"]


class StepProverClient:
    """The moves of StepProver at ``address``, each returning its receipt (``gas_log``: (move, gas, calldata
    bytes) of every move sent)."""

    def __init__(self, w3, address: str) -> None:
        self.w3 = w3
        self.contract = w3.eth.contract(address=address, abi=contracts.artifact("StepProver")["abi"])
        self.bond = self.contract.functions.bond().call()
        self.gas_log: list[tuple[str, int, int]] = []

    def _send(self, name: str, sender: str, *args, value: int = 0):
        fn = getattr(self.contract.functions, name)(*args)
        tx = fn.transact({"from": sender, "value": value, "gas": 15_000_000})
        receipt = self.w3.eth.wait_for_transaction_receipt(tx)
        if receipt["status"] != 1:
            raise RuntimeError(f"StepProver.{name} reverted")
        data = self.w3.eth.get_transaction(tx)["input"]
        self.gas_log.append((name, receipt["gasUsed"], len(bytes(data))))
        return receipt

    def claim(self, op: Operation, defender: str) -> bytes:
        self._send("claim", defender, op.as_tuple(), value=self.bond)
        return bytes(self.contract.functions.claimIdOf(op.as_tuple(), defender).call())

    def challenge(self, claim_id: bytes, elem: int, challenger: str) -> bytes:
        self._send("challenge", challenger, claim_id, elem, value=self.bond)
        return bytes(self.contract.functions.gameIdOf(claim_id, challenger).call())

    def game(self, game_id: bytes) -> dict:
        names = ("claimId", "challenger", "phase", "defenderTurn", "midPosted", "elem", "lo", "hi", "loSum",
                 "hiSum", "midSum", "defenderLeft", "challengerLeft", "turnSince", "moves")
        return dict(zip(names, self.contract.functions.gameOf(game_id).call()))

    def wrong(self, claim_id: bytes) -> bool:
        return bool(self.contract.functions.claimOf(claim_id).call()[1])


@dataclass
class Defender:
    """A defender of ``op``: ``sums`` (bits, for a product) are what it posts at each point of element
    ``elem``'s k-order; an honest defender's are ``partial_sums``; a cheat's are anything."""

    op: Operation
    account: str
    sums: Callable[[int, int], int] | None = None  # (elem, point) -> bits it posts


def play(client: StepProverClient, claim_id: bytes, defender: Defender, challenger: str, elem: int,
         judge: Callable[[int, int], bool]) -> tuple[bool, int]:
    """Challenge element ``elem`` and play the game to its end; ``judge(point, posted bits)`` is the
    challenger's answer (agree?). Returns (defender won, moves)."""
    game_id = client.challenge(claim_id, elem, challenger)
    op = defender.op
    if op.kind == MATMUL:
        client._send("openOutput", defender.account, game_id, opening(op.out, elem), EMPTY, EMPTY)
    else:
        client._send("openOutput", defender.account, game_id, opening(op.out, elem),
                     opening(op.a, elem % op.a_len), opening(op.b, elem % op.b_len))
    while (state := client.game(game_id))["phase"] == PHASES.index("Sums"):
        mid = (state["lo"] + state["hi"]) // 2
        posted = defender.sums(elem, mid)
        client._send("postSum", defender.account, game_id, posted)
        client._send("judge", challenger, game_id, bool(judge(mid, posted)))
    if state["phase"] == PHASES.index("Final"):
        row, col, k = elem // op.cols, elem % op.cols, state["lo"]
        client._send("proveStep", defender.account, game_id, opening(op.a, row * op.inner + k),
                     opening(op.b, k * op.cols + col))
        state = client.game(game_id)
    assert state["phase"] == PHASES.index("Done"), state
    return not client.wrong(claim_id), state["moves"]
