"""A misbehaving run member, built from the node's own classes, run as a real process by the tests.

    python tests/adversary.py ATTACK [dlx-node arguments...]

builds the node from subclasses of its honest parts for ATTACK (a
:class:`node.live.assembly.Kinds`: the worker, the coordinator, the
contributor, the finisher, the heartbeat), then runs the normal ``dlx-node``
command line with them, so everything else (joining, signing, gossip, the
chain) is the real node's. Attacks:

- ``malformed-payload``: every contribution's payload is replaced by bytes of
  the same length that do not decode (still validly signed by the member).
- ``huge-1e3`` / ``huge-1e6``: the honest pseudo-gradient times 1e3 / 1e6,
  re-encoded with the run's codec (finite, decodable, validly signed).
- ``sign-flip``: the honest pseudo-gradient negated.
- ``noise``: Gaussian noise with the honest pseudo-gradient's norm per tensor.
- ``stale``: the previous round's honest pseudo-gradient re-encoded and
  re-signed for the current round.
- ``perturb``: the honest pseudo-gradient plus noise of 1% of its norm per
  tensor (passes every aggregation check; only re-execution catches it).
- ``zero``: a free rider that trains nothing useful and sends zeros.
- ``copy``: a free rider that copies another replica's contribution of the
  round (waits for it, then re-encodes it as its own).
- ``late``: an honest contribution announced only after the round deadline.
- ``empty-close``: as coordinator, the member first publishes a signed close
  with no entries, then behaves honestly (its second close is equivocation).
- ``equivocating-close``: the member acts as the coordinator of every (round,
  stage) and publishes two valid but different closes of each: every
  contribution, and all but the last one (honest nodes must skip it,
  whichever they saw first).
- ``duplicate-close``: as coordinator, the member first publishes a close that
  names one contribution twice, then behaves honestly (its second close is
  equivocation).
- ``censoring-close``: the member acts as the coordinator of every (round,
  stage) and closes as soon as its own contribution is ready, with only that
  one (a valid close that leaves every honest contribution out).
- ``phantom-close``: as coordinator, the member publishes, instead of its
  close, one that names a contribution nobody holds (an honest entry with a
  made-up envelope hash), and never closes honestly: honest nodes wait for it
  while its fetches make progress, refuse it after the stall limit, and the
  next coordinator closes.
- ``absurd-hello``: every hello claims the member trains round 10**12 (a
  joiner that believed it would enter out of reach); otherwise honest.
- ``forge-state``: from round 1 on, drops its error-feedback debt (zero
  residual) before each round starts, then trains and encodes honestly from
  that state: every contribution reruns exactly from the state it binds; only
  the chain (round t's rerun must end where round t+1 starts) catches it.
- ``diverge-once``: not an attack but a local fault: in round 2 it aggregates
  the close without its first entry, so its weights leave the quorum's record;
  honest otherwise. Its own close gives the record's result: it must not
  dispute, and it must re-base on the record and contribute again.
- ``diverge-late``: the ``diverge-once`` fault (leaving out the close's first two
  entries: screening may leave out the first anyway), and the member applies round 3
  without waiting for the chain's record of round 2 (as if that record came
  only after round 3 was applied): the fork can no longer be re-based in place,
  so the member must stop, re-enter from the chain's latest checkpoint
  (node/live/peers/lifecycle.py) and contribute again.
- ``diverge-slow-verdict``: the ``diverge-once`` fault, and the chain's verdict of round 2
  reaches the member's committer only once it encoded round 4 (as on a slow RPC; at most 50 s
  late): without the overlap round 4, begun on its forked round 2, is then encoded before the
  verdict; it must hold that announcement until the verdict and then withhold it.
- ``fork-close``: not an attack but what a fork does to a member: in round 2
  it takes a close without the first entry of the one it accepted (as if
  another coordinator's close had reached it first), aggregates and attests
  that; honest otherwise. Its own computation stands: it must dispute with its
  signed record, re-base on the quorum's record and contribute again.
- ``doctored-shard``: on every checkpoint round, the stage shards it serves carry another model
  config (``n_head`` 8) and weights shifted by 0.01, while it attests the honest weights hash:
  holders of other stages must not build (or sign) a checkpoint from it, and pull must never
  install its config.
- ``other-momentum``: on every checkpoint round, the stage shards it serves carry the honest weights and
  model config but outer momentum shifted by 0.01, while it attests the honest weights hash and stage leaf
  (issue 63): its honest co-holder and the holders of other stages must build one checkpoint alike (in a
  chunked run, from the momentum the stage leaf commits), so that no honest member's signature is left out
  of the commits and none becomes ejectable.
- ``over-declare``: in a time-bounded run (``diloco.round_budget_s``), trains the inner steps that fit in
  the budget and declares 2 more (at most H), to weigh more in the average: its data commitment and
  contributions are consistent with the declared count, only re-execution catches it.
- ``other-platform``: trains honestly, but every start state it binds claims another CPU model
  (:data:`OTHER_PLATFORM_CPU`) than the platform it declared when it joined: without the declared-platform
  rule a verifier would judge it by the cross-platform tolerance, where it passes (issue 42).
- ``collude-root``: a member of a colluding quorum (issue 43): in round 1 it changes one element of its
  stage's new weights by one ulp (every colluder the same element, so they attest and sign one record) and
  goes on from that state, attesting it and publishing it as its own (node/live/fraud/chunkstate.py). In a
  chunked (version 2) or normed (version 3, the default) run one honest member outside the quorum must prove
  the round wrong on chain by itself.
- ``takeover``: a coalition member (issue 41, attack 1; ``DLX_COALITION`` names the coalition,
  ``DLX_COALITION_DIR`` is where its members share signatures): it commits every round it can with
  the fewest honest signatures the quorum needs, then tries to eject the honest members it left
  out, to commit a back door with the coalition's signatures and to slash an honest member by a
  verdict the coalition signs.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONTRIBUTION_ATTACKS = ("huge-1e3", "huge-1e6", "sign-flip", "noise", "stale", "zero", "perturb")
ATTACKS = ("malformed-payload", *CONTRIBUTION_ATTACKS, "copy", "late", "empty-close", "duplicate-close",
           "equivocating-close", "censoring-close", "phantom-close", "absurd-hello", "forge-state",
           "diverge-once", "diverge-late", "diverge-slow-verdict", "fork-close", "doctored-shard",
           "other-momentum", "takeover", "over-declare", "other-platform", "collude-root")
#: The CPU model ``other-platform`` claims in its start states (tests/test_reexec_e2e.py looks for it).
OTHER_PLATFORM_CPU = "Claimed Other CPU @ 9.99GHz"

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------- the worker (training side)
def malformed_payload():
    from node.live.worker.replica import ReplicaWorker

    class MalformedWorker(ReplicaWorker):
        def encode(self, stage, outer_round):
            blob, stats = super().encode(stage, outer_round)  # keeps the engine's round counters right
            return bytes((b ^ 0x5A) for b in blob), stats

    return {"worker": MalformedWorker}


def forged_contribution(attack: str):
    """Re-encode the member's own honest pseudo-gradient after ``attack`` changed it."""
    import torch

    from node.live.worker.replica import ReplicaWorker
    from training.codec_wire import decode_contribution
    from training.compression import encode_contribution

    def forge(kind, value, generator):
        if kind.startswith("huge-"):
            return value * float(kind.removeprefix("huge-"))
        if kind == "sign-flip":
            return -value
        if kind == "perturb":  # subtle: passes robust aggregation, only a re-execution catches it
            noise = torch.randn(value.shape, generator=generator)
            return value + noise * (0.01 * value.norm() / noise.norm().clamp_min(1e-12))
        if kind == "noise":
            noise = torch.randn(value.shape, generator=generator)
            return noise * (value.norm() / noise.norm().clamp_min(1e-12))
        return torch.zeros_like(value)  # "zero"

    class ForgingWorker(ReplicaWorker):
        def __init__(self, **kwargs) -> None:
            super().__init__(**kwargs)
            self.previous: dict[int, dict] = {}  # stage -> the last round's honest pseudo-gradient

        def encode(self, stage, outer_round):
            blob, stats = super().encode(stage, outer_round)  # keeps the engine's round counters right
            shapes = {name: tuple(t.shape) for name, t in self.engines[stage].global_weights.items()}
            honest = decode_contribution(blob, shapes, stage_index=stage, outer_round=outer_round)
            generator = torch.Generator().manual_seed(1000 * outer_round + stage)
            if attack == "stale":
                forged, self.previous[stage] = self.previous.get(stage, honest), honest
            else:
                forged = {name: forge(attack, value, generator) for name, value in honest.items()}
            blob, _decoded, _stats = encode_contribution(forged, self.cfg.compression, stage_index=stage,
                                                         outer_round=outer_round)
            return blob, stats

    return {"worker": ForgingWorker}


def over_declaring(extra: int = 2):
    from node.live.worker.replica import ReplicaWorker

    class OverDeclaringWorker(ReplicaWorker):
        def declared_steps(self, outer_round):
            trained = super().declared_steps(outer_round)
            return None if trained is None else min(self.cfg.diloco.inner_steps, trained + extra)

    return {"worker": OverDeclaringWorker}


def claiming_another_platform():
    from node.live.worker.replica import ReplicaWorker
    from training.replica_state import parse_stage_state

    class OtherPlatformWorker(ReplicaWorker):
        def start_state_capture(self, outer_round):
            serialise = super().start_state_capture(outer_round)

            def relabelled():
                # What a cheater would do to be judged by the tolerance: claim a CPU no verifier has.
                out = {}
                for stage, data in serialise().items():
                    part = parse_stage_state(data)
                    platform = dataclasses.replace(part.meta.platform, device_name=OTHER_PLATFORM_CPU)
                    out[stage] = dataclasses.replace(part,
                                                     meta=dataclasses.replace(part.meta, platform=platform)
                                                     ).to_bytes()
                return out

            return relabelled

    return {"worker": OtherPlatformWorker}


def forged_start_state():
    import torch

    from node.live.worker.replica import ReplicaWorker

    class StateForgingWorker(ReplicaWorker):
        def start_state_capture(self, outer_round):
            serialise = super().start_state_capture(outer_round)

            def forged():
                # Where the node reads the engines for the start state (on its lane, after the previous
                # round's encode and before this round's): the debt is dropped before it is bound.
                if outer_round >= 1:
                    for stage in self.stages:
                        compressor = self.engines[stage].compressor
                        compressor.residual = {n: torch.zeros_like(r) for n, r in compressor.residual.items()}
                return serialise()

            return forged

    return {"worker": StateForgingWorker}


def diverging_once(left_out: int = 1):
    from node.live.worker.replica import ReplicaWorker

    class DivergingWorker(ReplicaWorker):
        def apply(self, stage, outer_round, contributions, excluded=None, prepared=None):
            if outer_round == 2 and len(contributions) > left_out:
                what = "first entry" if left_out == 1 else f"first {left_out} entries"
                logger.warning("adversary: round 2 stage %d aggregated without the close's %s", stage, what)
                excluded = {**(excluded or {}), **{i: "diverge-once" for i in range(left_out)}}
                prepared = None
            return super().apply(stage, outer_round, contributions, excluded=excluded, prepared=prepared)

    return {"worker": DivergingWorker}


#: The round whose weights ``collude-root`` changes (round 0 has no committed round before it to prove from).
COLLUDED_ROUND = 1


def colluding_root():
    import torch

    from node.live.worker.replica import ReplicaWorker
    from training.hashing import stage_weights_hash

    class ColludingWorker(ReplicaWorker):
        def apply(self, stage, outer_round, contributions, excluded=None, prepared=None):
            result = super().apply(stage, outer_round, contributions, excluded=excluded, prepared=prepared)
            if outer_round != COLLUDED_ROUND:
                return result
            engine = self.engines[stage]
            name = sorted(engine.global_weights)[0]
            tensor = engine.global_weights[name].clone()
            flat = tensor.view(-1)
            flat[0] = torch.nextafter(flat[0], flat[0] + 1)
            engine.global_weights = {**engine.global_weights, name: tensor}
            logger.warning("adversary: round %d stage %d: element 0 of %s changed by one ulp", outer_round,
                           stage, name)
            return dataclasses.replace(result, weights_hash=stage_weights_hash(engine.global_weights))

    return {"worker": ColludingWorker}


def diverging_late():
    from node.live.record.forkrepair import ForkRepair

    class LateVerdictForks(ForkRepair):
        def due(self, next_round):
            if next_round == 3:  # neither waits for round 2's verdict nor takes its re-base before round 3
                logger.warning(
                    "adversary: applying round 3 without waiting for the chain's record of round 2")
                return []
            return super().due(next_round)

    # Two entries left out: screening may leave out the first one anyway (then one alone forks nothing).
    return {**diverging_once(left_out=2), "forks": LateVerdictForks}


def diverging_slow_verdict(most_s: float = 50.0):
    import threading
    import time

    from node.live.record.forkrepair import ForkRepair

    class SlowVerdictForks(ForkRepair):
        def __init__(self, **kwargs) -> None:
            super().__init__(**kwargs)
            self.encoded_round_4 = threading.Event()

        def announceable(self, outer_round):
            if outer_round == 4:  # round 4 is encoded: whether to announce it is being decided
                self.encoded_round_4.set()
            return super().announceable(outer_round)

        def diverged(self, outer_round, onchain, mine, signature):
            if outer_round == 2:  # on the committer thread: the verdict reaches the node late
                logger.warning(
                    "adversary: the chain's verdict of round 2 reaches this node only after it encoded "
                    "round 4")
                deadline = time.monotonic() + most_s
                while not self.encoded_round_4.wait(0.5) and not self.stop.is_set() \
                        and time.monotonic() < deadline:
                    pass
            return super().diverged(outer_round, onchain, mine, signature)

    return {**diverging_once(), "forks": SlowVerdictForks}


# ---------------------------------------------------------------------- the contributor
def copying_free_rider():
    """Announce, as its own, another replica's contribution of the same round."""
    import time

    from node.live.worker.contributor import Contributor
    from node.protocol import decode_contribution_body
    from p2p.envelope import decode_envelope
    from training.codec_wire import decode_contribution
    from training.compression import encode_contribution

    class CopyingContributor(Contributor):
        def encode_stage(self, stage, outer_round):
            blob, stats = super().encode_stage(stage, outer_round)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # wait for someone else's contribution of the round
                theirs = list(self.pool.have(outer_round, stage).values())
                if theirs:
                    envelope = decode_envelope(theirs[0], self.cfg.p2p.max_blob_bytes)
                    payload = decode_contribution_body(envelope.payload).blob
                    shapes = {n: tuple(t.shape) for n, t in self.worker.engines[stage].global_weights.items()}
                    copied = decode_contribution(payload, shapes, stage_index=stage, outer_round=outer_round)
                    blob, _decoded, _stats = encode_contribution(copied, self.cfg.compression,
                                                                 stage_index=stage, outer_round=outer_round)
                    break
                time.sleep(0.2)
            return blob, stats

    return {"contributor": CopyingContributor}


def late_delivery():
    """Announce an honest contribution only after the others' round deadline."""
    import time

    from node.live.worker.contributor import Contributor

    class LateContributor(Contributor):
        def publish(self, outer_round):
            time.sleep(self.cfg.round_timeout + 10)
            return super().publish(outer_round)

    return {"contributor": LateContributor}


# ---------------------------------------------------------------------- the coordinator
def empty_close():
    from node import protocol as msg
    from node.live.exchange.coordination import RoundCoordinator

    class EmptyCloser(RoundCoordinator):
        def __init__(self, **kwargs) -> None:
            super().__init__(**kwargs)
            self.sent: set[tuple[int, int]] = set()

        def try_close(self, outer_round, stage, final, alive):
            if (outer_round, stage) not in self.sent:
                self.sent.add((outer_round, stage))
                self.gossip(outer_round, msg.CLOSE, msg.Close([]), stage)
            return super().try_close(outer_round, stage, final, alive)

    return {"coordinator": EmptyCloser}


def duplicate_close():
    from node import protocol as msg
    from node.live.exchange.coordination import RoundCoordinator

    class DuplicateCloser(RoundCoordinator):
        def __init__(self, **kwargs) -> None:
            super().__init__(**kwargs)
            self.sent: set[tuple[int, int]] = set()

        def try_close(self, outer_round, stage, final, alive):
            close = super().try_close(outer_round, stage, final, alive)
            if close is not None and (outer_round, stage) not in self.sent:
                self.sent.add((outer_round, stage))
                entries = list(close.contributions)
                self.gossip(outer_round, msg.CLOSE, msg.Close([entries[0], *entries]), stage)
            return close

    return {"coordinator": DuplicateCloser}


def leading_coordinator():
    """A coordinator that believes it leads every (round, stage) it holds: it closes in each."""
    from node.live.exchange.coordination import RoundCoordinator

    class Leader(RoundCoordinator):
        def rotation(self, outer_round, stage):
            ranked = super().rotation(outer_round, stage)
            return [self.peer_id, *(p for p in ranked if p != self.peer_id)] if self.peer_id in ranked \
                else ranked

    return Leader


def censoring_close():
    from node import protocol as msg

    class Censor(leading_coordinator()):
        def try_close(self, outer_round, stage, final, alive):
            own = [a for a in self.book.snapshot_announces(outer_round, stage).values()
                   if a.peer_id == self.peer_id]
            if not own:
                return None
            close = msg.Close([[own[0].replica, own[0].peer_id, own[0].envelope_hash, own[0].size]])
            data = self.gossip(outer_round, msg.CLOSE, close, stage)
            self.book.add_close(outer_round, stage, self.peer_id, close, data)
            return close

    return {"coordinator": Censor}


def equivocating_close():
    from node import protocol as msg

    class Equivocator(leading_coordinator()):
        def try_close(self, outer_round, stage, final, alive):
            close = super().try_close(outer_round, stage, final, alive)
            if close is not None and len(close.contributions) > 1:
                self.gossip(outer_round, msg.CLOSE, msg.Close(close.contributions[:-1]), stage)
            return close

    return {"coordinator": Equivocator}


def phantom_close():
    import os

    from node import protocol as msg
    from node.live.exchange.coordination import RoundCoordinator

    class PhantomCloser(RoundCoordinator):
        def __init__(self, **kwargs) -> None:
            super().__init__(**kwargs)
            self.attacked: set[tuple[int, int]] = set()

        def try_close(self, outer_round, stage, final, alive):
            if (outer_round, stage) in self.attacked:
                return  # a second, honest close would be equivocation: it waits for the next coordinator
            close = self.ready_close(outer_round, stage, final, alive)  # the honest close, kept back
            if close is None:
                return
            entries = [list(e) for e in close.contributions]
            victims = [e for e in entries if e[1] != self.peer_id]
            if not victims:
                return
            victims[0][2] = os.urandom(32)
            entries.sort(key=lambda e: (e[0], e[1], e[2]))
            self.gossip(outer_round, msg.CLOSE, msg.Close(entries), stage)
            self.attacked.add((outer_round, stage))
            logger.warning("adversary: phantom close of round %d stage %d published", outer_round, stage)
            return

    return {"coordinator": PhantomCloser}


def forking_close():
    from ledger.merkle import merkle_root
    from node import protocol as msg
    from node.live.exchange.coordination import RoundCoordinator

    class ForkingCoordinator(RoundCoordinator):
        def __init__(self, **kwargs) -> None:
            super().__init__(**kwargs)
            self.forked: dict[tuple[int, int], msg.Close] = {}

        def await_close(self, outer_round, stage, clock_from=None):
            close = super().await_close(outer_round, stage, clock_from=clock_from)
            if outer_round == 2 and len(close.contributions) > 1 and (outer_round, stage) not in self.forked:
                self.forked[(outer_round, stage)] = msg.Close(list(close.contributions[1:]))
                logger.warning("adversary: round 2 stage %d took a close without its first entry", stage)
            return self.forked.get((outer_round, stage), close)

        def accepted(self, outer_round, stage):
            return self.forked.get((outer_round, stage)) or super().accepted(outer_round, stage)

        def stage_root(self, outer_round, stage):
            return merkle_root([entry[2] for entry in self.accepted(outer_round, stage).contributions])

    return {"coordinator": ForkingCoordinator}


# ---------------------------------------------------------------------- the heartbeat and the finisher
def absurd_hello():
    from node.live.peers.heartbeat import Heartbeat

    class AbsurdHeartbeat(Heartbeat):
        def hello(self):
            return dataclasses.replace(super().hello(), training_round=10**12)

    return {"heartbeat": AbsurdHeartbeat}


def doctored_shard():
    from node.live.exchange.pool import serve_blob
    from node.live.round.finisher import RoundFinisher
    from node.store.checkpoint import Checkpoint, write_checkpoint

    class DoctoringFinisher(RoundFinisher):
        def write_shard(self, outer_round, stage, weights_hash):
            weights, momentum = self.worker.global_state(stage)
            doctored = {name: tensor + 0.01 for name, tensor in weights.items()}
            model_config = {**self.layout.model_config, "n_head": 8}
            shard = Checkpoint(self.run_id, outer_round, model_config, self.config_hash,
                               {stage: weights_hash}, doctored, momentum)
            path = self.checkpoint_dir / f"shard-{outer_round:08d}-stage{stage}.safetensors"
            digest = write_checkpoint(path, shard)
            serve_blob(self.host, path.read_bytes())
            logger.warning("adversary: doctored shard %s of round %d stage %d", digest.hex()[:12],
                           outer_round, stage)
            return digest

    return {"finisher": DoctoringFinisher}


def other_momentum():
    from node.live.exchange.pool import serve_blob
    from node.live.round.finisher import RoundFinisher
    from node.store.checkpoint import Checkpoint, write_checkpoint

    class OtherMomentumFinisher(RoundFinisher):
        def write_shard(self, outer_round, stage, weights_hash):
            weights, momentum = self.worker.global_state(stage)
            other = {name: tensor + 0.01 for name, tensor in momentum.items()}
            shard = Checkpoint(self.run_id, outer_round, dict(self.layout.model_config), self.config_hash,
                               {stage: weights_hash}, weights, other)
            path = self.checkpoint_dir / f"shard-{outer_round:08d}-stage{stage}.safetensors"
            digest = write_checkpoint(path, shard)
            serve_blob(self.host, path.read_bytes())
            logger.warning("adversary: shard %s of round %d stage %d serves other momentum",
                           digest.hex()[:12], outer_round, stage)
            return digest

    return {"finisher": OtherMomentumFinisher}


def takeover():
    """A coalition member (issue 41, attack 1): it wins every commit race with the fewest honest signatures
    the quorum needs, then tries to eject the honest members it left out, to commit a back door with its
    partners' signatures (shared through ``DLX_COALITION_DIR``) and to slash an honest member by a verdict of
    its own.
    ``DLX_COALITION``: the coalition's addresses, comma-separated."""
    import hashlib
    import os

    from ledger import errors
    from ledger.attest import recover_digest_signer
    from ledger.records import RoundRecord, Verdict
    from node.live.record.committer import Committer

    coalition = {a.strip().lower() for a in os.environ["DLX_COALITION"].split(",")}
    shared = Path(os.environ["DLX_COALITION_DIR"])

    def partners_signatures(name: str, own: bytes) -> list[bytes]:
        (shared / f"{name}-{own.hex()[:16]}.sig").write_bytes(own)
        return [p.read_bytes() for p in sorted(shared.glob(f"{name}-*.sig"))]

    class TakeoverCommitter(Committer):
        def _submit(self, outer_round, mine, found, quorum):
            node = self.node
            client = node.chain.client
            record, signatures = found
            digest = client.record_digest(record)
            ours = [s for s in signatures if recover_digest_signer(digest, s).lower() in coalition]
            honest = [s for s in signatures if recover_digest_signer(digest, s).lower() not in coalition]
            chosen = ours + honest[:max(0, quorum - len(ours))]
            if node.chain.commit_of(node.run_id, outer_round) is None:
                try:  # no waiting for its turn: it wins the race
                    node.chain.commit_round(record, chosen)
                    logger.warning("adversary: committed round %d with %d of %d honest signatures",
                                   outer_round, len(chosen) - len(ours), len(honest))
                except errors.LedgerError as exc:
                    logger.warning("adversary: commit of round %d lost: %s", outer_round, exc)
            self._take_over(client)
            return node.chain.commit_of(node.run_id, outer_round) is not None

        def _take_over(self, client):
            run_id = self.node.run_id
            history = client.history(run_id, with_registrations=False)
            honest = sorted(m.account for m in history.memberships
                            if m.account.lower() not in coalition and m.ended is None)
            for account in honest:
                try:
                    client.eject_inactive(run_id, account)
                    logger.warning("adversary: ejected %s", account)
                except errors.LedgerError as exc:
                    logger.warning("adversary: eject refused: %s", exc)
            count, head = client.commit_count(run_id), client.head_of(run_id)
            door = RoundRecord(run_id, count, head, hashlib.sha256(b"back door %d" % count).digest(),
                               hashlib.sha256(b"back door contributions").digest(), 1, 1, 1, 1, bytes(32))
            signatures = partners_signatures(f"door-{count}-{head.hex()[:16]}", client.sign_record(door))
            try:
                client.commit_round(door, signatures)
                logger.warning("adversary: committed a back door at round %d", count)
            except errors.LedgerError as exc:
                logger.warning("adversary: back door refused: %s", exc)
            if not honest:
                return
            evidence = hashlib.sha256(b"framed").digest()
            try:
                client.accuse(run_id, honest[0], evidence)
            except errors.LedgerError:
                pass  # a partner accused first, or already did
            verdict = Verdict(run_id, honest[0], evidence, True)
            signatures = partners_signatures("verdict", client.sign_verdict(verdict))
            try:
                client.resolve_accusation(verdict, signatures)
                logger.warning("adversary: slashed %s", honest[0])
            except errors.LedgerError as exc:
                logger.warning("adversary: verdict refused: %s", exc)

    return {"committer": TakeoverCommitter}


def attack_parts(attack: str) -> dict:
    """The part classes of ``attack`` (keyword arguments of node.live.assembly.Kinds)."""
    if attack in CONTRIBUTION_ATTACKS:
        return forged_contribution(attack)
    return {"malformed-payload": malformed_payload, "copy": copying_free_rider, "late": late_delivery,
            "empty-close": empty_close, "duplicate-close": duplicate_close,
            "equivocating-close": equivocating_close, "censoring-close": censoring_close,
            "phantom-close": phantom_close, "absurd-hello": absurd_hello, "forge-state": forged_start_state,
            "diverge-once": diverging_once, "diverge-late": diverging_late,
            "diverge-slow-verdict": diverging_slow_verdict, "fork-close": forking_close,
            "doctored-shard": doctored_shard, "other-momentum": other_momentum, "takeover": takeover,
            "over-declare": over_declaring,
            "other-platform": claiming_another_platform, "collude-root": colluding_root}[attack]()


def run_with(parts: dict) -> int:
    """The ``dlx-node`` command line, its ``start`` building the node from ``parts``."""
    from node.cli import main as cli_main
    from node.commands import faces
    from node.live.assembly import Kinds

    faces.COMMANDS["start"] = functools.partial(faces.cmd_start, kinds=Kinds(**parts))
    return cli_main()


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in ATTACKS:
        print(f"usage: adversary.py {{{'|'.join(ATTACKS)}}} [dlx-node arguments]", file=sys.stderr)
        return 2
    return run_with(attack_parts(sys.argv.pop(1)))


if __name__ == "__main__":
    sys.exit(main())
