"""Calldata and moves of StepProver (contracts/src/StepProver.sol), the innermost legs of the contribution
proof (issue 78, docs/FRAUD_PROOF.md "The contribution proof").

A claim is one operation of a reproducible inner step: ``kind(a, b) = out`` over tensors committed by their
own chunk trees (``training.step_trace.tensor_root``: the tensor's chunk leaves, ``ledger.merkle`` tree). The
caller hands this module the tensors' chunk leaves (bytes; this package knows no torch) and, for a product,
the partial sums' bits of the challenged element (``training.step_trace.partial_sums``); for a tree sum, its
tree's nodes' bits (``training.step_trace.tree_levels``).

:class:`StepProverClient` sends the moves; :func:`play` runs one game between a :class:`Defender` and a
challenger's ``judge`` policy (``honest_judge`` agrees with a posted sum exactly when it is the true one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import contracts
from ledger.chunkproof import tree_path, tree_root

CHUNK = 64
ADD, SUB, MUL, DIV, MATMUL, GATHER, TREESUM = 1, 2, 3, 4, 5, 6, 7
UNARY, UNARY_SLOPE = 8, 9  # ``inner`` the function code (ledger.stepfunctions.CODES), ``b`` unread
#: A program input index naming the step's batch (StepProver.DATA_INPUT): the claim's ``batchRoot`` leaf.
DATA_INPUT = 2**32 - 1
#: A program input index ``CONST_INPUT + bits`` names the one-element tensor of float32 ``bits``
#: (StepProverMath.CONST_INPUT, ``constRoot``): a constant operand, such as the count a mean divides by.
CONST_INPUT = 2**32


def const_leaf(bits: int) -> bytes:
    """The one chunk leaf of the one-element tensor of float32 ``bits`` (training/chunks.py: u32 tensor 0,
    u64 offset 0, u64 cols 1, u32 count 1, the bits, big-endian)."""
    return (0).to_bytes(12, "big") + (1).to_bytes(8, "big") + (1).to_bytes(4, "big") + bits.to_bytes(4, "big")
PHASES = ("None", "Open", "Sums", "Final", "Done", "Trace", "TraceEnd", "Ops", "OpOpen", "Pick", "Copy",
          "Steps", "Start", "End", "Data", "Tree")
#: StepProver.endRuleOf's plain end: nothing carried between rounds, no low-rank piece (``set_end_rule``).
PLAIN_END = 1


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


def output_opening(op: Operation, elem: int) -> tuple:
    """``openOutput``'s openings of element ``elem`` of ``op``'s output: the element, and for an elementwise
    op its two inputs (a product's and a tree sum's are empty: its partial sums are bisected, its tree
    descended next)."""
    if op.kind in (MATMUL, TREESUM):
        return opening(op.out, elem), EMPTY, EMPTY
    if op.kind == GATHER:  # out[e] = b[a[e // cols] * cols + e % cols]
        token = op.a[elem // op.cols // CHUNK]
        pos = 24 + 4 * (elem // op.cols % CHUNK)
        place = int.from_bytes(token[pos:pos + 4], "big") * op.cols + elem % op.cols
        return (opening(op.out, elem), opening(op.a, elem // op.cols),
                opening(op.b, place) if place < op.b_len else EMPTY)
    if op.kind in (UNARY, UNARY_SLOPE):  # out[e] = f(a[e]): b unread
        return opening(op.out, elem), opening(op.a, elem), EMPTY
    return opening(op.out, elem), opening(op.a, elem % op.a_len), opening(op.b, elem % op.b_len)


def sum_step_opening(op: Operation, elem: int, k: int) -> tuple:
    """``proveStep``'s openings of the product ``op``'s step ``k`` of element ``elem``: ``a[r, k]``,
    ``b[k, c]``; of a tree sum's leaf ``k`` of element ``elem = (r, c)``: ``a[r, k, c]`` (``b`` empty)."""
    if op.kind == TREESUM:
        return opening(op.a, (elem // op.cols * op.inner + k) * op.cols + elem % op.cols), EMPTY
    row, col = elem // op.cols, elem % op.cols
    return opening(op.a, row * op.inner + k), opening(op.b, k * op.cols + col)


def deploy(w3, bond: int, clock_blocks: int, ledger: str, sender: str | None = None) -> str:
    """Deploy StepProver's libraries (``contracts.STEP_LIBRARIES``), then StepProver linked to them and bound
    to the TrainingLedger at ``ledger`` (run claims are about its records), from the committed artifacts;
    StepProver's address."""
    sender = sender or w3.eth.accounts[0]

    def create(bytecode: str, abi: list, *args) -> str:
        tx = w3.eth.contract(abi=abi, bytecode=bytecode).constructor(*args).transact({"from": sender})
        return w3.eth.wait_for_transaction_receipt(tx)["contractAddress"]

    libraries: dict[str, str] = {}
    for name in (*contracts.MATH_LIBRARIES, *contracts.STEP_LIBRARIES):  # each linked to the ones before
        artifact = contracts.artifact(name)
        libraries[name] = create(contracts.link(artifact, libraries), artifact["abi"])
    artifact = contracts.artifact("StepProver")
    return create(contracts.link(artifact, libraries), artifact["abi"], bond, clock_blocks, ledger)


class StepProverClient:
    """The moves of StepProver at ``address``, each returning its receipt (``gas_log``: (move, gas, calldata
    bytes) of every move sent)."""

    def __init__(self, w3, address: str, bond: int | None = None) -> None:
        """``bond``: what a claim and a challenge bond (None: the contract's ``bond``; the ledger's
        StepProver, whose ``bond`` is zero, takes each run's own: ``ledger.stepcase.run_stake``)."""
        self.w3 = w3
        self.contract = w3.eth.contract(address=address, abi=contracts.artifact("StepProver")["abi"])
        self.bond = self.contract.functions.bond().call() if bond is None else bond
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
        names = ("claimId", "challenger", "phase", "defenderTurn", "midPosted", "elem", "lo", "hi",
                 "defenderLeft", "challengerLeft", "turnSince", "moves", "copyLeaf", "loRoot", "hiRoot",
                 "midRoot", "stepKey")
        return dict(zip(names, self.contract.functions.gameOf(game_id).call()))

    def wrong(self, claim_id: bytes) -> bool:
        return bool(self.contract.functions.claimOf(claim_id).call()[1])

    def set_program(self, creator: str, run_id: int, claim: tuple, origins: list[bytes] | None = None):
        """Fix run ``run_id``'s step program to ``claim``'s (a ``RunClaim``: :func:`program_hash`) and its
        state tensors' origins (:func:`origin_leaf`, one per state tensor; None: none, so no start is
        provable); the run's creator, before its first commit."""
        origin_root = tree_root(origins) if origins else ZERO
        return self._send("setProgram", creator, run_id, program_hash(claim), origin_root)

    def set_end_rule(self, creator: str, run_id: int, rule: int = PLAIN_END):
        """Fix run ``run_id``'s end rule (StepProver.setEndRule: its claims' ends disputed element by
        element); the run's creator, once, before its first commit."""
        return self._send("setEndRule", creator, run_id, rule)

    def program_of(self, run_id: int) -> bytes:
        """Run ``run_id``'s program hash (zero: none)."""
        return bytes(self.contract.functions.programOf(run_id).call())


def tree_children(count: int, level: int, index: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The nodes ``(level, index)`` whose sum is node ``index`` of level ``level`` (not a carried node) of a
    tree sum over ``count`` elements (``training.exact_math.tree_sum``): ``index`` and ``index + c // 2`` of
    the level below, ``c`` its node count (StepProver ``postChildren``, ``pickChild``)."""
    below = count
    for _ in range(level - 1):
        below = (below + 1) // 2
    return (level - 1, index), (level - 1, index + below // 2)


@dataclass
class Defender:
    """A defender of ``op``: ``sums`` (bits) are what it posts at each point of element ``elem``'s game: for
    a product the partial sums of its k-order (``point`` an int), for a tree sum its tree's nodes (``point``
    a ``(level, index)`` pair); an honest defender's are ``partial_sums`` and ``tree_levels``
    (``training.step_trace.op_point``); a cheat's are anything."""

    op: Operation
    account: str
    sums: Callable[[int, object], int] | None = None  # (elem, point) -> bits it posts


def play(client: StepProverClient, claim_id: bytes, defender: Defender, challenger: str, elem: int,
         judge: Callable[[int, int], bool]) -> tuple[bool, int]:
    """Challenge element ``elem`` and play the game to its end; ``judge(point, posted bits)`` is the
    challenger's answer (agree?): in a tree sum's descent, about the left child of the two posted (its
    ``(level, index)``), agreeing disputes the right one. Returns (defender won, moves)."""
    game_id = client.challenge(claim_id, elem, challenger)
    return element_game(client, claim_id, game_id, defender, challenger, elem, judge)


def element_game(client: StepProverClient, claim_id: bytes, game_id: bytes, defender: Defender,
                 challenger: str, elem: int, judge: Callable[[int, int], bool]) -> tuple[bool, int]:
    """The element game of ``game_id`` from its ``Open`` phase (element ``elem``) to its end."""
    op = defender.op
    client._send("openOutput", defender.account, game_id, *output_opening(op, elem))
    while (state := client.game(game_id))["phase"] in (PHASES.index("Sums"), PHASES.index("Tree")):
        if state["phase"] == PHASES.index("Tree"):
            left, right = tree_children(op.inner, state["hi"], state["lo"])
            posted = defender.sums(elem, left)
            try:
                client._send("postChildren", defender.account, game_id, posted, defender.sums(elem, right))
            except Exception:  # noqa: BLE001 - children that do not add up to the node: its clock decides
                return _run_out(client, claim_id, game_id, challenger)
            client._send("pickChild", challenger, game_id, bool(judge(left, posted)))
            continue
        mid = (state["lo"] + state["hi"]) // 2
        posted = defender.sums(elem, mid)
        client._send("postSum", defender.account, game_id, posted)
        client._send("judge", challenger, game_id, bool(judge(mid, posted)))
    if state["phase"] == PHASES.index("Final"):
        client._send("proveStep", defender.account, game_id, *sum_step_opening(op, elem, state["lo"]))
        state = client.game(game_id)
    assert state["phase"] == PHASES.index("Done"), state
    return not client.wrong(claim_id), state["moves"]


# ------------------------------------------------------------------ one inner step (StepClaim)

ZERO = bytes(32)


def spec_leaf(kind: int, rows: int, inner: int, cols: int, a_len: int, b_len: int, a_index: int,
              b_index: int) -> bytes:
    """Program leaf of an op: eight 32-byte big-endian words (abi.encode of eight uint256)."""
    return b"".join(v.to_bytes(32, "big") for v in (kind, rows, inner, cols, a_len, b_len, a_index, b_index))


def copy_leaf(source: int) -> bytes:
    """Program leaf of a state tensor's next value: the trace leaf it is copied from."""
    return source.to_bytes(32, "big")


@dataclass
class StepTrace:
    """One side's trace of a program step: ``tensors[i]`` the chunk leaves of trace leaf ``i`` (the state's
    tensors, then each op's output), ``specs`` the program's ops (``spec_leaf`` arguments), ``copies`` the
    state's next values' trace leaves, ``depth`` the trace tree's."""

    tensors: list[list[bytes]]
    specs: list[tuple]
    copies: list[int]
    depth: int
    end: list[bytes] | None = None  # a state tree other than the copies' (a cheat's)
    batch: list[bytes] | None = None  # the step's batch (DATA_INPUT): its token tensor's chunk leaves
    batch_path: list[bytes] | None = None  # its root's path in the claim's batch tree

    def input_leaves(self, index: int) -> list[bytes]:
        """The chunk leaves of trace leaf ``index``, of the step's batch (:data:`DATA_INPUT`) or of a constant
        (:data:`CONST_INPUT`)."""
        if index >= CONST_INPUT:
            return [const_leaf(index - CONST_INPUT)]
        if index == DATA_INPUT:
            if self.batch is None:
                raise ValueError("the program reads the step's batch and this trace has none")
            return self.batch
        return self.tensors[index]

    def input_root(self, index: int, before: list[bytes]) -> tuple[bytes, list[bytes]]:
        """An op input's root and its path: in the trace tree ``before``, the batch's in the batch tree, or a
        constant's (no path: the contract recomputes its root)."""
        if index >= CONST_INPUT:
            return tree_root(self.input_leaves(index)), []
        if index == DATA_INPUT:
            return tree_root(self.input_leaves(index)), list(self.batch_path or [])
        return before[index], tree_path(before, index)

    @property
    def state_leaves(self) -> int:
        return len(self.copies)

    def program(self) -> list[bytes]:
        return [spec_leaf(*spec) for spec in self.specs] + [copy_leaf(c) for c in self.copies]

    def roots(self) -> list[bytes]:
        return [tree_root(leaves) for leaves in self.tensors]

    def tree(self, ops_done: int) -> list[bytes]:
        """The trace tree's leaves after ``ops_done`` ops."""
        filled = self.roots()[: self.state_leaves + ops_done]
        return filled + [ZERO] * ((1 << self.depth) - len(filled))

    def end_tree(self) -> list[bytes]:
        if self.end is not None:
            return self.end
        roots = self.roots()
        return [roots[c] for c in self.copies] + [ZERO] * ((1 << self.depth) - self.state_leaves)

    def claim(self) -> tuple:
        return (tree_root(self.program()), self.state_leaves, len(self.specs), self.depth,
                tree_root(self.tree(0)), tree_root(self.end_tree()))

    def operation(self, j: int) -> Operation:
        kind, rows, inner, cols, a_len, b_len, a_index, b_index = self.specs[j]
        return Operation(kind, rows, inner, cols, self.input_leaves(a_index), self.input_leaves(b_index),
                         self.tensors[self.state_leaves + j], a_len, b_len)

    def copy_proof(self, leaf: int) -> tuple:
        """``proveCopy``'s arguments (after the game id) for state leaf ``leaf`` of the end tree: its value
        and path, and for a state tensor the program's copy entry and its source's path in the last trace
        tree."""
        ops, end, program = len(self.specs), self.end_tree(), self.program()
        if leaf >= self.state_leaves:
            return end[leaf], tree_path(end, leaf), b"", [], []
        return (end[leaf], tree_path(end, leaf), program[ops + leaf], tree_path(program, ops + leaf),
                tree_path(self.tree(ops), self.copies[leaf]))

    def op_opening(self, j: int) -> tuple:
        program, before, out = self.program(), self.tree(j), self.state_leaves + j
        spec = self.specs[j]
        return (program[j], tree_path(program, j), self.roots()[out], tree_path(before, out),
                *self.input_root(spec[6], before), *self.input_root(spec[7], before))


def step_game(client: StepProverClient, trace: StepTrace, defender: str, challenger: str, *,
              dispute: Callable[[bytes], tuple[str, int]], judge_root: Callable[[int, bytes], bool],
              pick: Callable[[Operation], int], judge: Callable[[int, int, int], bool],
              sums: Callable[[int, int, int], int], post_root: Callable[[int], bytes] | None = None,
              claimed: bool = False) -> tuple[bool, int]:
    """Claim ``trace``'s step as ``defender`` and play a challenger's game on it to its end.

    The defender posts its own trace (``post_root(j)`` overrides the tree root it posts after op ``j``).
    The challenger: ``dispute(defender's last trace root)`` is ("copy", leaf) or ("trace", 0);
    ``judge_root(j, root)``; ``pick(defender's op)`` the element; ``judge(op index, point, bits)``.
    ``sums(op index, elem, point)``: the partial sums the defender posts; ``claimed``: the defender's claim is
    on chain already (another game on it). Returns (defender won, moves)."""
    claim = trace.claim()
    if not claimed:
        client._send("claimStep", defender, claim, value=client.bond)
    claim_id = bytes(client.w3.keccak(_abi_encode_step(claim, defender)))
    client._send("challengeStep", challenger, claim_id, value=client.bond)
    game_id = bytes(client.contract.functions.gameIdOf(claim_id, challenger).call())
    return play_step(client, claim_id, game_id, trace, defender, challenger, dispute=dispute,
                     judge_root=judge_root, pick=pick, judge=judge, sums=sums, post_root=post_root)


def play_step(client: StepProverClient, claim_id: bytes, game_id: bytes, trace: StepTrace, defender: str,
              challenger: str, *, dispute, judge_root, pick, judge, sums, post_root=None) -> tuple[bool, int]:
    """The step game of ``game_id`` (phase ``Trace``) on ``trace`` to its end (``step_game``'s policies)."""
    ops = len(trace.specs)
    root_after = post_root or (lambda j: tree_root(trace.tree(j)))
    last = root_after(ops)
    client._send("postTrace", defender, game_id, last)
    kind, leaf = dispute(last)
    if kind == "copy":
        client._send("disputeCopy", challenger, game_id, leaf)
        try:
            client._send("proveCopy", defender, game_id, *trace.copy_proof(leaf))
        except Exception:  # noqa: BLE001 - a defender that cannot prove lets its clock run out
            return _run_out(client, claim_id, game_id, challenger)
        state = client.game(game_id)
        return not client.wrong(claim_id), state["moves"]
    client._send("disputeTrace", challenger, game_id)
    while (state := client.game(game_id))["phase"] == PHASES.index("Ops"):
        mid = (state["lo"] + state["hi"]) // 2
        posted = root_after(mid)
        client._send("postRoot", defender, game_id, posted)
        client._send("judgeRoot", challenger, game_id, bool(judge_root(mid, posted)))
    j = client.game(game_id)["lo"]
    try:
        client._send("openOp", defender, game_id, trace.op_opening(j))
    except Exception:  # noqa: BLE001 - its trees do not open: the clock decides
        return _run_out(client, claim_id, game_id, challenger)
    op = trace.operation(j)
    elem = pick(op)
    client._send("pickElement", challenger, game_id, elem)
    return element_game(client, claim_id, game_id, Defender(op, defender, lambda e, p: sums(j, e, p)),
                        challenger, elem, lambda p, bits: judge(j, p, bits))


def _run_out(client: StepProverClient, claim_id: bytes, game_id: bytes, caller: str) -> tuple[bool, int]:
    """Mine past the defender's clock and call ``timeout``."""
    state = client.game(game_id)
    for _ in range(int(state["defenderLeft"]) + 1):
        client.w3.provider.make_request("evm_mine", [])
    client._send("timeout", caller, game_id)
    return not client.wrong(claim_id), client.game(game_id)["moves"]


def _abi_encode_step(claim: tuple, defender: str) -> bytes:
    from eth_abi import encode

    return encode(["(bytes32,uint32,uint32,uint8,bytes32,bytes32)", "address"], [claim, defender])


# ------------------------------------------------------------------ a contribution's H inner steps (RunClaim)


def run_claim(traces: list[StepTrace], subject, batch_root: bytes = ZERO) -> tuple:
    """The contract's ``RunClaim`` of one side's traces of H steps of one program: the state root before the
    first step and the state root its last step ends in, about ``subject`` (``ledger.stepbinding.RunSubject``:
    the contribution and the round's start on the ledger's record, and its data key), its steps' batches
    ``batch_root`` (``ledger.stepdata.batch_root``; zero: none)."""
    first = traces[0]
    return (tree_root(first.program()), first.state_leaves, len(first.specs), first.depth,
            tree_root(first.tree(0)), tree_root(traces[-1].end_tree()), len(traces), *subject.fields(),
            bytes(batch_root), subject.data_key)


def program_hash(claim: tuple) -> bytes:
    """The hash StepProver.setProgram fixes a run's program by: keccak256(abi.encode(programRoot, stateLeaves,
    ops, depth)) of a ``RunClaim`` (:func:`run_claim`'s first four fields)."""
    from eth_abi import encode
    from eth_utils import keccak

    return keccak(encode(["bytes32", "uint32", "uint32", "uint8"], list(claim[:4])))


#: An origin's tensor index for a state tensor that starts at zero (not in the committed start).
ZERO_START = 2**32 - 1


def origin_leaf(tensor: int, numel: int, first_chunk: int, stage_chunks: int) -> bytes:
    """Where a state tensor of ``numel`` elements lies in the committed start: tensor ``tensor`` of the stage,
    whose element 0 is in chunk ``first_chunk`` of the stage's ``stage_chunks`` (training/chunks.py layout);
    ``tensor`` :data:`ZERO_START`: a tensor that starts at zero."""
    from eth_abi import encode

    return encode(["uint32", "uint64", "uint64", "uint64"], [tensor, numel, first_chunk, stage_chunks])


def start_opening(trace: StepTrace, origins: list[bytes], q: int, elem: int, committed: list[bytes]) -> tuple:
    """The contract's ``StartOpening`` of element ``elem`` of state tensor ``q`` of ``trace``'s first state,
    and of the chunk of the committed start (``committed``: the stage's weight chunk leaves) that holds it."""
    from eth_abi import decode

    tensor, numel, first, _chunks = decode(["uint32", "uint64", "uint64", "uint64"], origins[q])
    start, leaves = trace.tree(0), trace.tensors[q]
    state = (leaves[elem // 64], tree_path(leaves, elem // 64)) if elem < numel else (b"", [])
    chunk = first + elem // 64
    zero = tensor == ZERO_START or elem >= numel
    held = (b"", []) if zero else (committed[chunk], tree_path(committed, chunk))
    return (origins[q], tree_path(origins, q), start[q], tree_path(start, q), state, held)


def end_opening(last: StepTrace, origins: list[bytes], q: int, elem: int, committed: list[bytes],
                payload: list[bytes], bits: int = 0) -> tuple:
    """``proveEnd``'s arguments (after the game id) for element ``elem`` of state tensor ``q`` of the state
    ``last`` (the trace of a claim's last step) ends in: a ``StartOpening`` of the end (its origin, the
    tensor's root in the end tree and the element, the chunk of the committed start that holds it), the
    contribution's payload piece of that chunk (``payload``: its pieces, training/chunks.py
    ``payload_leaves``) and ``bits``, the tensor's quant bit width (0 for a raw piece)."""
    from eth_abi import decode

    tensor, numel, first, _chunks = decode(["uint32", "uint64", "uint64", "uint64"], origins[q])
    end, leaves = last.end_tree(), last.tensors[last.copies[q]]
    inside = elem < numel and tensor != ZERO_START
    state = (leaves[elem // 64], tree_path(leaves, elem // 64)) if inside else (b"", [])
    chunk = first + elem // 64
    held = (committed[chunk], tree_path(committed, chunk)) if inside else (b"", [])
    piece = (payload[chunk], tree_path(payload, chunk)) if inside else (b"", [])
    return (origins[q], tree_path(origins, q), end[q], tree_path(end, q), state, held), piece, bits


def state_roots(traces: list[StepTrace]) -> list[bytes]:
    """The state roots ``S_0 .. S_H`` of one side's traces (``S_i``: the state tree before step ``i``)."""
    return [tree_root(t.tree(0)) for t in traces] + [tree_root(traces[-1].end_tree())]


def run_game(client: StepProverClient, traces: list[StepTrace], defender: str, challenger: str, *, subject,
             judge_state: Callable[[int, bytes], bool], step_policy: Callable[[int], dict],
             post_state: Callable[[int], bytes] | None = None, claimed: bool = False,
             challenged: bool = False, batch_root: bytes = ZERO) -> tuple[bool, int]:
    """Claim ``traces`` (H steps) about ``subject`` (``ledger.stepbinding.RunSubject``) as ``defender`` and
    play a challenger's game on them to the end.

    The defender posts the state roots of its own traces (``post_state(i)`` overrides the root after step
    ``i``); the challenger answers ``judge_state(i, root)`` (agree?) and, once the split step ``i`` is found,
    plays its step game with ``step_policy(i)`` (``step_game``'s keywords: dispute, judge_root, pick, judge,
    sums); ``batch_root``: the batches the claim commits (``ledger.stepdata.batch_root``). Returns (defender
    won, moves)."""
    claim = run_claim(traces, subject, batch_root)
    if not claimed:
        client._send("claimRun", defender, claim, subject.binding, value=client.bond)
    claim_id = bytes(client.contract.functions.runIdOf(claim, defender).call())
    if not challenged:  # else ``challenger``'s game on the claim is open already
        client._send("challengeRun", challenger, claim_id, value=client.bond)
    game_id = bytes(client.contract.functions.gameIdOf(claim_id, challenger).call())
    roots = state_roots(traces)
    posted_after = post_state or (lambda i: roots[i])
    while (state := client.game(game_id))["phase"] == PHASES.index("Steps"):
        mid = (state["lo"] + state["hi"]) // 2
        posted = posted_after(mid)
        client._send("postStateRoot", defender, game_id, posted)
        client._send("judgeStateRoot", challenger, game_id, bool(judge_state(mid, posted)))
    step = state["lo"]
    return play_step(client, claim_id, game_id, traces[step], defender, challenger, **step_policy(step))
