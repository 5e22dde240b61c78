"""A misbehaving run member, built from the node's own classes, run as a real process by the tests.

    python tests/adversary.py ATTACK [dlx-node arguments...]

patches one behaviour of :class:`node.live.node.Node`'s rooms for ATTACK, then
runs the normal ``dlx-node`` command line, so everything else (joining,
signing, gossip, the chain) is the real node's. Attacks:

- ``malformed-payload``: every contribution's payload is replaced by bytes of
  the same length that do not decode (still validly signed by the member).
- ``empty-close``: as coordinator, the member first publishes a signed close
  with no entries, then behaves honestly (its second close is equivocation).
- ``equivocating-close``: the member acts as the coordinator of every (round,
  stage) and publishes two valid but different closes of each: every
  contribution, and all but the last one (honest nodes must skip it,
  whichever they saw first).
- ``absurd-hello``: every hello claims the member trains round 10**12 (a
  joiner that believed it would enter out of reach); otherwise honest.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ATTACKS = ("malformed-payload", "empty-close", "equivocating-close", "absurd-hello")


def malformed_payload() -> None:
    from node.live.replica import ReplicaWorker

    honest_encode = ReplicaWorker.encode

    def encode(self, stage, outer_round):
        blob, stats = honest_encode(self, stage, outer_round)  # keeps the engine's round counters right
        return bytes((b ^ 0x5A) for b in blob), stats

    ReplicaWorker.encode = encode


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


def absurd_hello() -> None:
    import dataclasses

    from node.live import protocol as msg

    honest_encode = msg.encode_payload

    def encode_payload(message):
        if isinstance(message, msg.Hello):
            message = dataclasses.replace(message, training_round=10**12)
        return honest_encode(message)

    msg.encode_payload = encode_payload  # the node signs what this returns


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in ATTACKS:
        print(f"usage: adversary.py {{{'|'.join(ATTACKS)}}} [dlx-node arguments]", file=sys.stderr)
        return 2
    attack = sys.argv.pop(1)
    {"malformed-payload": malformed_payload, "empty-close": empty_close, "equivocating-close": equivocating_close,
     "absurd-hello": absurd_hello}[attack]()
    from node.cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
