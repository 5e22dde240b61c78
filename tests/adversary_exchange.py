"""tests/adversary.py's attacks of the exchange: the contributor (a copying free rider, a late delivery)
and the coordinator (empty, duplicate, censoring, equivocating, phantom and forking closes, an absurd hello).
Each function returns the part classes of its attack (keyword arguments of node.live.assembly.Kinds)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

logger = logging.getLogger("adversary")


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
