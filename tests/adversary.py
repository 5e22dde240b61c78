"""A misbehaving run member, built from the node's own classes, run as a real process by the tests.

    python tests/adversary.py ATTACK [dlx-node arguments...]

patches one behaviour of :class:`node.live.node.Node`'s rooms for ATTACK, then
runs the normal ``dlx-node`` command line, so everything else (joining,
signing, gossip, the chain) is the real node's. Attacks:

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
- ``diverge-once``: not an attack but what a fork does to a member: in round 2
  it aggregates the close without its first entry, so its weights leave the
  quorum's record; honest otherwise. It must dispute, re-enter from the
  chain's record and contribute again.
- ``doctored-shard``: on every checkpoint round, the stage shards it serves carry another model
  config (``n_head`` 8) and weights shifted by 0.01, while it attests the honest weights hash:
  holders of other stages must not build (or sign) a checkpoint from it, and pull must never
  install its config.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONTRIBUTION_ATTACKS = ("huge-1e3", "huge-1e6", "sign-flip", "noise", "stale", "zero", "perturb")
ATTACKS = ("malformed-payload", *CONTRIBUTION_ATTACKS, "copy", "late", "empty-close", "duplicate-close",
           "equivocating-close", "censoring-close", "phantom-close", "absurd-hello", "forge-state",
           "diverge-once", "doctored-shard")


def malformed_payload() -> None:
    from node.live.replica import ReplicaWorker

    honest_encode = ReplicaWorker.encode

    def encode(self, stage, outer_round):
        blob, stats = honest_encode(self, stage, outer_round)  # keeps the engine's round counters right
        return bytes((b ^ 0x5A) for b in blob), stats

    ReplicaWorker.encode = encode


def forged_contribution(attack: str) -> None:
    """Re-encode the member's own honest pseudo-gradient after ``attack`` changed it."""
    import torch

    from node.live.replica import ReplicaWorker
    from training.codec_wire import decode_contribution
    from training.compression import encode_contribution

    honest_encode = ReplicaWorker.encode
    previous: dict[int, dict] = {}

    def encode(self, stage, outer_round):
        blob, stats = honest_encode(self, stage, outer_round)  # keeps the engine's round counters right
        shapes = {name: tuple(t.shape) for name, t in self.engines[stage].global_weights.items()}
        honest = decode_contribution(blob, shapes, stage_index=stage, outer_round=outer_round)
        generator = torch.Generator().manual_seed(1000 * outer_round + stage)
        if attack == "stale":
            forged, previous[stage] = previous.get(stage, honest), honest
        else:
            forged = {name: forge(attack, value, generator) for name, value in honest.items()}
        blob, _decoded, _stats = encode_contribution(forged, self.cfg.compression, stage_index=stage,
                                                     outer_round=outer_round)
        return blob, stats

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

    ReplicaWorker.encode = encode


def copying_free_rider() -> None:
    """Announce, as its own, another replica's contribution of the same round."""
    import time

    from node.live.node import Node
    from node.live.protocol import decode_contribution_body
    from p2p.envelope import decode_envelope
    from training.codec_wire import decode_contribution
    from training.compression import encode_contribution

    honest_encode_of = Node._publish_contributions

    def publish(self, outer_round):
        worker = self.worker
        honest_encode = worker.encode

        def encode(stage, r):
            blob, stats = honest_encode(stage, r)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # wait for someone else's contribution of the round
                theirs = list(self.contributions.have(r, stage).values())
                if theirs:
                    envelope = decode_envelope(theirs[0], self.cfg.p2p.max_blob_bytes)
                    payload = decode_contribution_body(envelope.payload).blob
                    shapes = {n: tuple(t.shape) for n, t in worker.engines[stage].global_weights.items()}
                    copied = decode_contribution(payload, shapes, stage_index=stage, outer_round=r)
                    blob, _decoded, _stats = encode_contribution(copied, self.cfg.compression, stage_index=stage,
                                                                 outer_round=r)
                    break
                time.sleep(0.2)
            return blob, stats

        worker.encode = encode
        try:
            return honest_encode_of(self, outer_round)
        finally:
            del worker.encode

    Node._publish_contributions = publish


def late_delivery() -> None:
    """Announce an honest contribution only after the others' round deadline."""
    import time

    from node.live.node import Node

    honest_publish = Node._publish_contributions

    def publish(self, outer_round):
        time.sleep(self.cfg.round_timeout + 10)
        return honest_publish(self, outer_round)

    Node._publish_contributions = publish


def empty_close() -> None:
    from node.live import protocol as msg
    from node.live.coordination import RoundCoordinator

    honest_try_close = RoundCoordinator._try_close
    sent: set[tuple[int, int]] = set()

    def try_close(self, outer_round, stage, final, alive):
        if (outer_round, stage) not in sent:
            sent.add((outer_round, stage))
            self.gossip(outer_round, msg.CLOSE, msg.Close([]), stage)
        return honest_try_close(self, outer_round, stage, final, alive)

    RoundCoordinator._try_close = try_close


def duplicate_close() -> None:
    from node.live import protocol as msg
    from node.live.coordination import RoundCoordinator

    honest_try_close = RoundCoordinator._try_close
    sent: set[tuple[int, int]] = set()

    def try_close(self, outer_round, stage, final, alive):
        close = honest_try_close(self, outer_round, stage, final, alive)
        if close is not None and (outer_round, stage) not in sent:
            sent.add((outer_round, stage))
            entries = list(close.contributions)
            self.gossip(outer_round, msg.CLOSE, msg.Close([entries[0], *entries]), stage)
        return close

    RoundCoordinator._try_close = try_close


def censoring_close() -> None:
    from node.live import coordination
    from node.live import protocol as msg
    from node.live.coordination import RoundCoordinator

    honest_init, honest_order = RoundCoordinator.__init__, coordination.committer_order
    me: dict[str, str] = {}

    def init(self, *args, **kwargs):
        honest_init(self, *args, **kwargs)
        me["peer_id"] = self.peer_id

    def order(round_index, peer_ids):  # it believes it leads every round
        ranked = honest_order(round_index, peer_ids)
        mine = me.get("peer_id")
        return [mine, *(p for p in ranked if p != mine)] if mine in ranked else ranked

    def try_close(self, outer_round, stage, final, alive):
        own = [a for a in self.book.snapshot_announces(outer_round, stage).values() if a.peer_id == self.peer_id]
        if not own:
            return None
        close = msg.Close([[own[0].replica, own[0].peer_id, own[0].envelope_hash, own[0].size]])
        data = self.gossip(outer_round, msg.CLOSE, close, stage)
        self.book.add_close(outer_round, stage, self.peer_id, close, data)
        return close

    RoundCoordinator.__init__, coordination.committer_order = init, order
    RoundCoordinator._try_close = try_close


def equivocating_close() -> None:
    from node.live import coordination
    from node.live import protocol as msg
    from node.live.coordination import RoundCoordinator

    honest_init, honest_order = RoundCoordinator.__init__, coordination.committer_order
    honest_try_close = RoundCoordinator._try_close
    me: dict[str, str] = {}

    def init(self, *args, **kwargs):
        honest_init(self, *args, **kwargs)
        me["peer_id"] = self.peer_id

    def order(round_index, peer_ids):  # the attacker believes it leads every round: it closes in each
        ranked = honest_order(round_index, peer_ids)
        mine = me.get("peer_id")
        return [mine, *(p for p in ranked if p != mine)] if mine in ranked else ranked

    def try_close(self, outer_round, stage, final, alive):
        close = honest_try_close(self, outer_round, stage, final, alive)
        if close is not None and len(close.contributions) > 1:
            self.gossip(outer_round, msg.CLOSE, msg.Close(close.contributions[:-1]), stage)
        return close

    RoundCoordinator.__init__, coordination.committer_order = init, order
    RoundCoordinator._try_close = try_close


def phantom_close() -> None:
    import logging
    import os

    from node.live import protocol as msg
    from node.live.coordination import RoundCoordinator

    honest_try_close = RoundCoordinator._try_close
    attacked: set[tuple[int, int]] = set()

    def try_close(self, outer_round, stage, final, alive):
        if (outer_round, stage) in attacked:
            return None  # a second, honest close would be equivocation: it waits for the next coordinator
        published = []
        real_gossip, real_add = self.gossip, self.book.add_close
        self.gossip = lambda *args: published.append(args) or b""  # the honest close, kept back
        self.book.add_close = lambda *args: None
        try:
            close = honest_try_close(self, outer_round, stage, final, alive)
        finally:
            self.gossip, self.book.add_close = real_gossip, real_add
        if close is None:
            return None
        entries = [list(e) for e in close.contributions]
        victims = [e for e in entries if e[1] != self.peer_id]
        if not victims:
            return None
        victims[0][2] = os.urandom(32)
        entries.sort(key=lambda e: (e[0], e[1], e[2]))
        self.gossip(outer_round, msg.CLOSE, msg.Close(entries), stage)
        attacked.add((outer_round, stage))
        logging.getLogger(__name__).warning("adversary: phantom close of round %d stage %d published",
                                            outer_round, stage)
        return None

    RoundCoordinator._try_close = try_close


def absurd_hello() -> None:
    import dataclasses

    from node.live import protocol as msg

    honest_encode = msg.encode_payload

    def encode_payload(message):
        if isinstance(message, msg.Hello):
            message = dataclasses.replace(message, training_round=10**12)
        return honest_encode(message)

    msg.encode_payload = encode_payload  # the node signs what this returns


def forged_start_state() -> None:
    import torch

    from node.live.replica import ReplicaWorker

    honest_capture = ReplicaWorker.start_state_capture

    def capture(self, outer_round):
        serialise = honest_capture(self, outer_round)

        def forged():
            # Where the node reads the engines for the start state (on its lane, after the previous
            # round's encode and before this round's): the debt is dropped before it is bound.
            if outer_round >= 1:
                for stage in self.stages:
                    compressor = self.engines[stage].compressor
                    compressor.residual = {n: torch.zeros_like(r) for n, r in compressor.residual.items()}
            return serialise()

        return forged

    ReplicaWorker.start_state_capture = capture


def diverging_once() -> None:
    import logging

    from node.live.replica import ReplicaWorker

    honest_apply = ReplicaWorker.apply

    def apply(self, stage, outer_round, contributions, excluded=None, prepared=None):
        if outer_round == 2 and len(contributions) > 1:
            logging.getLogger(__name__).warning("adversary: round 2 stage %d aggregated without the close's first "
                                                "entry", stage)
            excluded, prepared = {**(excluded or {}), 0: "diverge-once"}, None
        return honest_apply(self, stage, outer_round, contributions, excluded=excluded, prepared=prepared)

    ReplicaWorker.apply = apply


def doctored_shard() -> None:
    import logging

    from node.live.exchange import serve_blob
    from node.live.node import Node
    from node.store.checkpoint import Checkpoint, write_checkpoint

    def write_shard(self, outer_round, stage, weights_hash):
        weights, momentum = self.worker.global_state(stage)
        doctored = {name: tensor + 0.01 for name, tensor in weights.items()}
        model_config = {**self.layout.model_config, "n_head": 8}
        shard = Checkpoint(self.run_id, outer_round, model_config, self.config_hash, {stage: weights_hash},
                           doctored, momentum)
        path = self.checkpoint_dir / f"shard-{outer_round:08d}-stage{stage}.safetensors"
        digest = write_checkpoint(path, shard)
        serve_blob(self.host, path.read_bytes())
        logging.getLogger(__name__).warning("adversary: doctored shard %s of round %d stage %d", digest.hex()[:12],
                                            outer_round, stage)
        return digest

    Node._write_shard = write_shard


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in ATTACKS:
        print(f"usage: adversary.py {{{'|'.join(ATTACKS)}}} [dlx-node arguments]", file=sys.stderr)
        return 2
    attack = sys.argv.pop(1)
    if attack in CONTRIBUTION_ATTACKS:
        forged_contribution(attack)
    else:
        {"malformed-payload": malformed_payload, "copy": copying_free_rider, "late": late_delivery,
         "empty-close": empty_close, "duplicate-close": duplicate_close, "equivocating-close": equivocating_close,
         "censoring-close": censoring_close, "phantom-close": phantom_close, "absurd-hello": absurd_hello,
         "forge-state": forged_start_state, "diverge-once": diverging_once,
         "doctored-shard": doctored_shard}[attack]()
    from node.cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
