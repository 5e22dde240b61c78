"""The in-process world of the live prover's tests (tests/test_fraud_live*.py; docs/FRAUD_PROOF.md): real
libp2p hosts (the committers publish their stage state under its leaf, the prover fetches it), a real EVM
(py-evm), the node's own parts (node/live/fraud/chunkstate.py, node/live/fraud/prover.py,
node/live/chain/onchain.py, node/live/state/roundbook.py). Members 1 and 2 (the quorum) collude; member 3,
honest and outside the quorum, proves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import threading

import torch

from ledger.chain import connect_pyevm
from ledger.chunkproof import StageLeaf, chunked_weights_root
from node import protocol as msg
from node.config import load_config
from node.fraudproof import initial_state
from node.live.chain.onchain import NodeChain
from node.live.fraud.chunkstate import ChunkedStates
from node.live.fraud.contribution_binding import ContributionBinder
from node.live.fraud.prover import FraudProver
from node.live.state.roundbook import RoundBook
from node.store.checkpoint import RunLayout
from p2p.config import P2PConfig
from p2p.host import P2PHost
from p2p.identity import Identity
from tests.fraud_fixtures import OTHER, tensors
from tests.ledger_fixtures import deploy, mine
from training.diloco import aggregate_with_report


SHAPES = {"a.weight": (16, 80), "b.bias": (70,)}
STAKE = 10**18
PROVER, COLLUDERS = 3, (1, 2)


class WithholdingStates(ChunkedStates):
    """A committer that publishes nothing of its state (the prover must challenge it on chain)."""

    def publish(self, outer_round, stage, leaf, weights, momentum) -> None:
        return None


class WithholdingFactors(ChunkedStates):
    """A committer that publishes its state but not its factors (the prover must challenge them on chain)."""

    def publish_part(self, outer_round, stage, alias, blob) -> None:
        return None


@dataclasses.dataclass
class World:
    cfg: object
    layout: RunLayout
    weights: dict
    momentum: dict
    blobs: list
    aggregation: object
    other: object  # stage 1's state, the same in both rounds
    hosts: list
    stop: threading.Event  # every prover's: set at the end, so no challenge expirer outlives its test
    bindings: list | None = None  # a version-3 run's: each blob's contributor and signature (_bindings)

    def __post_init__(self) -> None:
        if self.bindings is None and self.cfg.commitment_scheme.proves_factors:
            self.bindings = _bindings(self.cfg, self.blobs)


#: The ledger every fresh py-evm deployment (_setup's) gets: its deployer's nonces are the same each time.
_LEDGERS: list[str] = []


def _bindings(cfg, blobs: list, outer_round: int = 1) -> list:
    """Blob ``j`` signed by member ``j + 1`` for run 1 of a fresh py-evm deployment, what _setup creates, as
    a version-3 run's live contributors sign theirs (issue 62: node/live/fraud/contribution_binding.py)."""
    probe = deploy(connect_pyevm(), min_stake=STAKE)
    _LEDGERS.append(probe.ledger)
    signed = []
    for j, blob in enumerate(blobs):
        binder = ContributionBinder(1, NodeChain(probe.client(j + 1)), cfg.diloco,
                                    refuse_raw=cfg.compression.enabled)
        signed.append((probe.client(j + 1).address, binder.sign(outer_round, 0, blob, SHAPES)[1]))
    return signed


def _states(world: World, host, kind=ChunkedStates) -> ChunkedStates:
    states = kind(cfg=world.cfg, host=host, layout=world.layout, config_hash=world.layout.config_hash)
    states.replace(0, 0, initial_state(0, world.weights, world.momentum))
    return states


def _record(world: World, states: ChunkedStates, weights: dict, momentum: dict | None = None) -> bytes:
    envelopes = [hashlib.sha256(b"envelope" + blob).digest() for blob in world.blobs]
    return states.record(1, 0, weights, world.aggregation.new_momentum if momentum is None else momentum,
                         world.aggregation.contributions, world.blobs, envelopes, world.bindings)


def _one_element_changed(weights: dict) -> dict:
    changed = {name: tensor.clone() for name, tensor in weights.items()}
    value = changed["a.weight"][3, 17]
    changed["a.weight"][3, 17] = torch.nextafter(value, value + 1)  # one ulp: the smallest change there is
    return changed


def run_values(cfg, *, genesis: bool = False, **overrides) -> dict:
    """The per-round values create-run binds for ``cfg`` (issue 62: node/commitments/values.py's), the genesis
    root over the worlds' start (stage 0's initial state and OTHER's) if ``genesis``."""
    from ledger.runparams import DEFAULT_MAX_CONTRIBUTIONS, MAX_RANK
    from node.commitments.values import schedule_of
    from training.chunks import float64_bits

    schedule = schedule_of(cfg.diloco)
    values = {"schedule_root": schedule.root, "schedule_rounds": schedule.rounds,
              "nesterov": cfg.diloco.nesterov, "norm_clip_bits": float64_bits(cfg.diloco.norm_clip),
              "max_contributions": DEFAULT_MAX_CONTRIBUTIONS, "max_rank": MAX_RANK}
    return {**values, **overrides}


def _setup(world: World, tmp_path, states: ChunkedStates, committed_leaf: bytes, own_leaf: bytes,
           colluder_peer: str, *, values: dict | None = None, round_zero: bool = False,
           parent_closed: bool = True):
    """The chain (rounds 0 and 1 committed by the colluders, round 1 with ``committed_leaf``), the book of
    attestations the prover heard, and the prover (member 3, holding stage 0). The run is created with the
    commitments version of ``world.cfg`` (RunParams.commitments) and ``values`` (issue 62: run_values; None:
    unbound). ``round_zero``: only round 0 is committed, with ``committed_leaf``, on top of the run's genesis
    root over the world's start, which the prover holds as the run's genesis states. ``parent_closed``
    False: round 1 is committed while round 0's proof window is still open (its proofs wait, issue 62)."""
    deployment = deploy(connect_pyevm(), min_stake=STAKE)
    start_state = initial_state(0, world.weights, world.momentum)
    if round_zero:
        values = {**(values or run_values(world.cfg)),
                  "genesis_root": chunked_weights_root([start_state.leaf(), world.other.leaf()])}
    run = deployment.member_run((1, 2, 3), quorum=2, min_stake=STAKE,  # a proof's reward: the fund (issue 79)
                                commitments=world.cfg.commitment_scheme.version, values=values,
                                proof_fund=3 * STAKE)
    # what _bindings signed for: run 1 of the ledger every fresh deployment gets
    assert run.run_id == 1 and all(ledger == deployment.ledger for ledger in _LEDGERS)
    start = start_state.leaf().encode()
    other = world.other.leaf().encode()
    book, records = RoundBook(), []
    prover_peer, second = world.hosts[1].peer_id, Identity.generate().peer_id
    rounds = [(committed_leaf, own_leaf)] if round_zero else [(start, start), (committed_leaf, own_leaf)]
    for outer_round, (stage0, own0) in enumerate(rounds):
        if outer_round and parent_closed:  # round 0's window closes first: round 1's proof is taken at once
            mine(deployment.w3, run.client(1).run_struct(run.run_id)["disputeBlocks"])
        record = dataclasses.replace(run.next_record(), weights_root=chunked_weights_root(
            [StageLeaf.decode(stage0), StageLeaf.decode(other)]))
        run.client(1).commit_round(record, run.sign(record, COLLUDERS))
        records.append(record)
        for peer, leaf in ((colluder_peer, stage0), (second, stage0), (prover_peer, own0)):
            book.add_attestation(outer_round, 0, peer, _attestation(leaf))
            book.add_attestation(outer_round, 1, peer, _attestation(other))
    prover = FraudProver(run_id=run.run_id, chain=NodeChain(deployment.client(PROVER)), book=book,
                         states=states, stages=lambda: (0,), num_stages=2, stop=world.stop,
                         proofs_dir=tmp_path / "proofs",
                         genesis=[start_state, world.other] if round_zero else None)
    mine_record = dataclasses.replace(records[-1], weights_root=chunked_weights_root(
        [StageLeaf.decode(own_leaf), StageLeaf.decode(other)]))
    return deployment, run, records, prover, mine_record


def colluders_answerer(world: World, deployment, run_id: int, prover: FraudProver, colluders: ChunkedStates):
    """The colluders' own answerer of availability challenges (a colluder's prover beside it, reading the
    same round book as ``prover``), answering from their states ``colluders``."""
    from node.live.fraud.answerer import ChallengeAnswerer

    colluder = FraudProver(run_id=run_id, chain=NodeChain(deployment.client(COLLUDERS[0])), book=prover.book,
                           states=colluders, stages=lambda: (0,), num_stages=2, stop=world.stop)
    return ChallengeAnswerer(run_id=run_id, chain=colluder.chain, states=colluders, prover=colluder,
                             stop=world.stop)


def _attestation(leaf: bytes) -> msg.Attestation:
    return msg.Attestation(b"\x01" * 32, b"\x02" * 32, 2, float("nan"), float("nan"), 0, b"", b"", leaf)


NORMED_RUN = ["diloco.outer_lr=0.7", "diloco.outer_momentum=0.9", "pipeline.num_stages=2",
              "compression.enabled=false"]


@contextlib.contextmanager
def _normed_world(tmp_path, blobs: list, outer_round: int = 1):
    """A version-3 (normed) run's world over ``blobs`` (aggregated by the rule), with the colluders' config
    (version-2 factors, ``norm_clip`` 0: every scale 1.0) and their aggregation; hosts and provers stopped at
    the end. Yields (world, the colluders' config, their aggregation); ``outer_round``: the round the blobs
    and the aggregation are of."""
    cfg = load_config(None, [*NORMED_RUN, "diloco.commitments=normed"])
    chunked = load_config(None, [*NORMED_RUN, "diloco.commitments=chunked", "diloco.norm_clip=0"])
    layout = RunLayout(1, b"\x07" * 32, {}, (SHAPES, OTHER), chunked=True)
    weights, momentum = tensors(1, SHAPES), tensors(2, SHAPES, scale=0.1)
    aggregation = aggregate_with_report(weights, momentum, blobs, cfg.diloco, stage_index=0,
                                        outer_round=outer_round, compression_cfg=cfg.compression)
    colluded = aggregate_with_report(weights, momentum, blobs, chunked.diloco, stage_index=0,
                                     outer_round=outer_round, compression_cfg=chunked.compression)
    other = initial_state(1, tensors(3, OTHER), tensors(4, OTHER, 0.0))
    hosts = [P2PHost.start(P2PConfig(listen_port=0), Identity.generate(), data_dir=tmp_path / f"host{i}")
             for i in range(2)]
    stop = threading.Event()
    try:
        yield World(cfg, layout, weights, momentum, blobs, aggregation, other, hosts, stop), chunked, colluded
    finally:
        stop.set()
        for host in hosts:
            host.close()

