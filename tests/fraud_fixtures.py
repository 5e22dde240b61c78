"""Shared by tests/test_fraud_proof.py and bench/bench_fraud_proof.py: wire contributions of a chosen codec,
a real aggregation of them, and a chunked run that commits it (honestly or with a change) on a real EVM."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import torch

from ledger.account import dev_account, fund_accounts
from ledger.attest import order_signatures, pack_signatures
from ledger.chunkproof import Norms, StageState, build_proof, chunked_weights_root
from ledger.contribution_binding import ContributionClaim
from ledger.normproof import SumTree, scale_proof, sum_proof
from node.commitments import scheme_named, stage_state
from node.fraudproof import initial_state
from training.chunks import float64_bits
from training.codec_wire import CODEC_VERSION, matrix_view_shape
from training.codec_exact import f32_bytes, pack_ints, qmax
from training.config import DilocoConfig
from training.diloco import aggregate_with_report
from tests.ledger_fixtures import mine

# version 2 (normed: replace it)
DILOCO = DilocoConfig(outer_lr=0.7, outer_momentum=0.9, commitments="chunked")
OTHER = {"d.weight": (8, 8)}  # the run's second stage
FUNDED_DEV_ACCOUNTS = 10  # dev accounts 0-9 are funded on py-evm and anvil


def tensors(seed: int, shapes, scale: float = 1.0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(*shape, generator=generator) * scale for name, shape in shapes.items()}


def contribution(shapes, codec: str, seed: int, *, bits: int = 8, rank: int = 8, scale: float = 1e-3,
                 stage: int = 0, outer_round: int = 1) -> bytes:
    """Wire bytes of a contribution whose every tensor uses ``codec`` (1-D tensors: quant when lowrank),
    with random integers and scales: well-formed, decodable, any values."""
    rng = np.random.default_rng(seed)
    entries = []
    for name in sorted(shapes):
        shape = tuple(shapes[name])
        m, n = matrix_view_shape(shape)
        kind = "quant" if codec == "lowrank" and len(shape) < 2 else codec
        entry = {"n": name, "s": list(shape), "c": kind}
        if kind == "raw":
            entry["d"] = f32_bytes(torch.from_numpy(rng.standard_normal(m * n).astype(np.float32) * scale))
        elif kind == "quant":
            limit = qmax(bits)
            entry.update(b=bits, q=pack_ints(torch.from_numpy(rng.integers(-limit, limit + 1, m * n)), bits),
                         x=f32_bytes(torch.from_numpy(rng.uniform(0, scale, n).astype(np.float32))))
        else:
            r, limit = min(rank, m, n), qmax(bits)
            entry.update(b=bits, r=r, p=pack_ints(torch.from_numpy(rng.integers(-limit, limit + 1, m * r)),
                                                  bits),
                         q=pack_ints(torch.from_numpy(rng.integers(-limit, limit + 1, n * r)), bits),
                         w=rng.integers(0, 65536, r).astype("<u2").tobytes(),
                         x=f32_bytes(torch.tensor([scale * 1e-9], dtype=torch.float32)))
        entries.append(entry)
    return msgpack.packb({"v": CODEC_VERSION, "st": stage, "rd": outer_round, "t": entries},
                         use_bin_type=True)


@dataclasses.dataclass
class Round:
    """A stage's state before (round 0's commit) and after (round 1's) a real aggregation."""

    prev: StageState
    honest: StageState
    other: StageState  # stage 1, the same in both rounds
    blobs: list[bytes]


def aggregated_round(shapes, blobs: list[bytes], diloco: DilocoConfig = DILOCO, weights=None) -> Round:
    """Round 1 of stage 0: ``blobs`` aggregated (training/diloco.py) onto seeded weights (or ``weights``) and
    momentum."""
    weights, momentum = weights or tensors(1, shapes), tensors(2, shapes, scale=0.1)
    aggregation = aggregate_with_report(weights, momentum, blobs, diloco, stage_index=0, outer_round=1)
    honest = stage_state(0, aggregation, blobs, diloco, 1, decode_args={"stage_index": 0, "outer_round": 1})
    other = initial_state(1, tensors(3, OTHER), tensors(4, OTHER, 0.0))
    return Round(initial_state(0, weights, momentum), honest, other, blobs)


def changed(state: StageState, chunk: int, element: int, *, momentum: bool = False) -> StageState:
    """``state`` with one element's lowest mantissa bit flipped (its weight, or its momentum)."""
    leaves = list(state.momentum_leaves if momentum else state.weight_leaves)
    leaf = bytearray(leaves[chunk])
    leaf[24 + 4 * element + 3] ^= 1
    leaves[chunk] = bytes(leaf)
    return dataclasses.replace(state, **{"momentum_leaves" if momentum else "weight_leaves": leaves})


def lied_sum(state: StageState, contribution: int, chunk: int, delta: int = 1) -> StageState:
    """``state`` (version 3) whose committed sum tree of ``contribution`` says chunk ``chunk``'s sum of
    squares is ``delta`` units more than it is (the tree's total and the factors consistent with the lie)."""
    sums = list(state.sum_trees[contribution].sums)
    sums[chunk] += delta
    fake = SumTree.of(sums)
    norms = state.factors.norms
    roots, totals = list(norms.roots), list(norms.sums)
    roots[contribution], totals[contribution] = fake.root, fake.total
    factors = dataclasses.replace(state.factors, norms=dataclasses.replace(norms, roots=tuple(roots),
                                                                            sums=tuple(totals)))
    trees = list(state.sum_trees)
    trees[contribution] = fake
    return dataclasses.replace(state, factors=factors, sum_trees=trees)


def with_scale(state: StageState, contribution: int, bits: int) -> StageState:
    """``state`` whose factors commit clip scale ``bits`` (float64) for ``contribution``."""
    scales = list(state.factors.scale_bits)
    scales[contribution] = bits
    return dataclasses.replace(state, factors=dataclasses.replace(state.factors, scale_bits=tuple(scales)))


@dataclasses.dataclass
class Committed:
    """A chunked run on chain whose rounds 0 and 1 hold ``states`` (stage 0), signed by ``attesters``."""

    deployment: object
    run_id: int
    records: list
    stages: list  # [round][stage] StageLeaf
    states: list  # [round] StageState of stage 0
    attesters: tuple[int, ...]
    prover_index: int
    schedule: object = None  # the run's ledger.runvalues.Schedule (None: created without one)

    def proof(self, chunk: int):
        return build_proof(self.records[0], self.records[1], self.stages[0], self.stages[1], self.states[0],
                           self.states[1], chunk, self.schedule)

    def prover(self):
        return self.deployment.client(self.prover_index)

    def scale_proof(self):
        """The norm proof of round 1's clip scales (a version-3 round)."""
        leaves = [leaf.encode() for leaf in self.stages[1]]
        return scale_proof(self.records[1], leaves, 0, self.states[1].factors.encode())

    def sum_proof(self, contribution: int, chunk: int):
        """The norm proof of chunk ``chunk`` of ``contribution``'s sum tree in round 1 (a version-3 round)."""
        state = self.states[1]
        return sum_proof(self.records[1], [leaf.encode() for leaf in self.stages[1]], 0,
                         state.factors.encode(), state.weight_leaves, state.payload_leaves[contribution],
                         state.sum_trees[contribution], contribution, chunk)


def bound(state: StageState, clients, run_id: int, outer_round: int, stage: int = 0) -> StageState:
    """``state`` (version 3) whose factors carry each listed contribution's binding (issue 62): contribution
    ``j`` signed by ``clients[j]``'s account over the roots the factors list (what its contributor signs when
    it sends it; a client may appear twice, an outsider's client makes an unbound round)."""
    norms = state.factors.norms
    steps = norms.steps or (0,) * len(norms.roots)
    claims = [ContributionClaim(run_id, outer_round, stage, payload_root, norm_root, step)
              for payload_root, norm_root, step in zip(state.factors.payload_roots, norms.roots, steps)]
    clients = list(clients)[:len(claims)]
    norms = dataclasses.replace(norms, contributors=tuple(client.address for client in clients),
                                signatures=tuple(client.sign_contribution(claim)
                                                 for client, claim in zip(clients, claims)))
    return dataclasses.replace(state, factors=dataclasses.replace(state.factors, norms=norms))


def commit(deployment, round_: Round, new: StageState, *, stake: int, prover_index: int = 6,
           commitments: int | None = None, values: dict | None = None, schedule=None, contributors=None,
           max_contributions: int | None = None, gap: int | None = None, leaving: tuple[int, ...] = (),
           between=None, seats: int | None = None, signers: tuple[int, ...] = (1, 2),
           proof_fund: int | None = None, before=None, **run_params) -> Committed:
    """A new run on ``deployment`` (members 1, 2, 3, and as many more as ``new`` lists contributions; k = 2)
    whose round 0 is ``round_.prev`` and round 1 ``new``, both signed by members 1 and 2. ``commitments``: the
    run's version (RunParams); None: that of ``new``'s factors (3 if they carry the norm commitment, else 2).
    ``values``: the run's per-round values (RunParams.VALUES by name; issue 62), ``schedule`` the
    ledger.runvalues.Schedule whose root they name (its leaf goes into every chunk proof);
    ``max_contributions`` overrides the values' bound. Version-3 factors without a binding are bound first
    (:func:`bound`): contribution ``j`` signed by member ``j + 1``, or by dev account ``contributors[j]``
    (member or not). ``gap``: the blocks mined between the two commits (None: round 0's dispute window, so a
    proof of round 1 never waits for its parent; 0: round 1 in the block after round 0's). ``run_params``:
    further ``create_run`` keywords (the windows, ``max_game_steps``, ``unbonding_blocks``).
    ``leaving``: members
    that send ``leaveRun`` in round 1's commit block, mined ahead of the commit (higher tips; issue 79);
    ``between``: called with the run once round 0 is committed, before the gap. ``seats``: dev accounts
    4 .. ``seats`` join the run too, as founders (issue 79: a run at its largest quorum, :func:`fill_seats`);
    ``signers``: who signs both rounds (the rounds' attesters). ``proof_fund``: wei the creator puts in the
    run's proof fund, which pays a proof's reward (issue 79); None: a stake per member, so a proof is paid
    its full half of the slash of up to every member. ``before``: called with the run before round 0's commit
    (a run's step program is fixed then: StepProver.setProgram)."""
    if commitments is None:
        commitments = scheme_named("normed" if new.factors.norms is not None else "chunked").version
    listed = len(getattr(new.factors, "payload_roots", ()))  # junk factors list none
    members = tuple(range(1, max(4, listed + 1)))
    unfunded = [deployment.client(index).address for index in members if index >= FUNDED_DEV_ACCOUNTS]
    if unfunded:  # dev accounts from 10 on hold nothing (ledger.account.dev_account)
        funder = dev_account(0, deployment.w3.eth.chain_id)
        fund_accounts(deployment.w3, funder, unfunded, 2 * stake + 10**18)  # registry and run stakes, gas
    if max_contributions is not None:
        values = {**(values or {}), "max_contributions": max_contributions}
    extra = tuple(range(len(members) + 1, seats + 1)) if seats else ()
    if extra:
        _register(deployment, extra, stake)
    if proof_fund is None:
        proof_fund = len(members) * stake
    run = deployment.member_run(members, quorum=2, min_stake=stake, commitments=commitments, values=values,
                                proof_fund=proof_fund, **run_params)
    if extra:
        fill_seats(deployment, run.run_id, extra, stake)
        run = dataclasses.replace(run, members=members + extra)
    if before is not None:
        before(run)
    if getattr(new.factors, "norms", None) is not None and not new.factors.norms.bound:
        binders = contributors if contributors is not None else members
        new = bound(new, [deployment.client(index) for index in binders], run.run_id, 1)
    records, stages = [], []
    for state in (round_.prev, new):
        if records and between is not None:
            between(run)
        if records and gap != 0:  # by default round 0's window closes first (a proof of round 1 never waits)
            mine(deployment.w3, run.client(1).run_struct(run.run_id)["disputeBlocks"] if gap is None else gap)
        leaves = [state.leaf(), round_.other.leaf()]
        record = dataclasses.replace(run.next_record(), weights_root=chunked_weights_root(leaves))
        if leaving and records:
            _leave_in_the_commit_block(deployment.w3, run, record, leaving)
        else:
            run.client(1).commit_round(record, run.sign(record, signers))
        records.append(record)
        stages.append(leaves)
    return Committed(deployment, run.run_id, records, stages, [round_.prev, new], tuple(signers),
                     prover_index, schedule)


def _register(deployment, accounts: tuple[int, ...], stake: int) -> None:
    """Fund and register dev accounts ``accounts`` (from 10 on: generated keys holding nothing), a few dozen
    transactions a block."""
    from tests.chain_backends import batched
    from tests.ledger_fixtures import node_key, raw_public_key

    w3 = deployment.w3
    funder = [(0, (deployment.client(index).address, b""), 2 * stake + 10**18)
              for index in accounts if index >= FUNDED_DEV_ACCOUNTS]
    batched(w3, funder, gas=21_000)
    registry = deployment.client(0).registry_contract
    sends = []
    for index in accounts:
        client, key = deployment.client(index), node_key(index + 1)
        args = (raw_public_key(key), key.sign(client.my_binding_message()))
        data = bytes.fromhex(registry.encode_abi("register", args=args)[2:])
        sends.append((index, (registry.address, data), deployment.min_stake))
    batched(w3, sends)


def fill_seats(deployment, run_id: int, accounts: tuple[int, ...], stake: int) -> None:
    """Registered dev accounts ``accounts`` join run ``run_id`` with ``stake`` each, a few dozen a block."""
    from tests.chain_backends import batched

    ledger = deployment.client(0).ledger_contract
    data = bytes.fromhex(ledger.encode_abi("joinRun", args=(run_id, bytes(32)))[2:])
    batched(deployment.w3, [(index, (ledger.address, data), stake) for index in accounts])


def _leave_in_the_commit_block(w3, run, record, leaving: tuple[int, ...]) -> None:
    """Members ``leaving`` leave in one block with the commit of ``record`` (signed by 1 and 2), ahead of
    it."""
    from tests.chain_backends import in_one_block

    reader = run.client(1)
    ledger = reader.ledger_contract

    def call(name: str, args: tuple) -> tuple[str, bytes]:
        return ledger.address, bytes.fromhex(ledger.encode_abi(name, args=args)[2:])

    packed = pack_signatures(order_signatures(reader.record_digest(record), run.sign(record, (1, 2))))
    sends = [(index, call("leaveRun", (run.run_id,)), 0) for index in leaving]
    block = in_one_block(w3, [*sends, (1, call("commitRound", (record.fields(), packed)), 0)])
    assert reader.commit_block_of(run.run_id, record.round) == block


def normed_start(weights, momentum, diloco: DilocoConfig) -> StageState:
    """Stage 0's state before round 1 of a version-3 run: every record of such a run carries version-3 factors
    (the run's version: RunParams), round 0's those of no contribution."""
    start = initial_state(0, weights, momentum)
    norms = Norms(float64_bits(float(diloco.norm_clip)), (), (), ())
    return dataclasses.replace(start, factors=dataclasses.replace(start.factors, norms=norms))


CHAIN_SHAPES = {"w": (2, 40)}  # 80 elements: a full chunk and a short one
# normed -> [(state, weights, momentum)] after rounds 0, 1, ...
_CHAINS: dict[bool, list] = {False: [], True: []}


def honest_chain(round_: int, *, normed: bool = False) -> StageState:
    """The state of a one-stage run after ``round_``: round 0 is the seeded start, each later round aggregates
    two raw contributions onto the one before (cached: the fuzzer asks for the same rounds again and again).
    ``normed``: a version-3 run's (its factors carry the norm commitment, its states the sum trees)."""
    chain = _CHAINS[normed]
    diloco = dataclasses.replace(DILOCO, commitments="normed") if normed else DILOCO
    if not chain:
        weights, momentum = tensors(1, CHAIN_SHAPES), tensors(2, CHAIN_SHAPES, scale=0.0)
        start = normed_start(weights, momentum, diloco) if normed else initial_state(0, weights, momentum)
        chain.append((start, weights, momentum))
    while len(chain) <= round_:
        t = len(chain)
        _state, weights, momentum = chain[-1]
        blobs = [contribution(CHAIN_SHAPES, "raw", 1000 * t + i, scale=1e-2, outer_round=t) for i in range(2)]
        aggregation = aggregate_with_report(weights, momentum, blobs, diloco, stage_index=0, outer_round=t)
        state = stage_state(0, aggregation, blobs, diloco, t,
                            decode_args={"stage_index": 0, "outer_round": t})
        chain.append((state, aggregation.new_global, aggregation.new_momentum))
    return chain[round_][0]
