"""tests/adversary.py's attacks of the worker (the training side): forged, malformed or over-declared
contributions, a forged start state or platform, a local fork (``diverge-*``) and a colluding quorum's
one-ulp change (``collude-root``). Each function returns the part classes of its attack (keyword arguments of
node.live.assembly.Kinds)."""

from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

logger = logging.getLogger("adversary")


#: The CPU model ``other-platform`` claims in its start states (tests/test_reexec_e2e.py looks for it).
OTHER_PLATFORM_CPU = "Claimed Other CPU @ 9.99GHz"


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
        def start_state_capture(self, outer_round, spill_dir=None):
            serialise = super().start_state_capture(outer_round, spill_dir)

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
        def start_state_capture(self, outer_round, spill_dir=None):
            serialise = super().start_state_capture(outer_round, spill_dir)

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
