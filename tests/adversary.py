"""A misbehaving run member, built from the node's own classes, run as a real process by the tests.

    python tests/adversary.py ATTACK [dlx-node arguments...]

builds the node from subclasses of its honest parts for ATTACK (the attacks live in tests/adversary_worker.py,
tests/adversary_exchange.py, tests/adversary_chain.py and tests/adversary_collusion.py) (a
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
- ``collude-lr``: a member of a colluding quorum (issue 62): in round 1 it steps with outer lr 7.0 and commits
  factors that say so, its weights consistent with them (tests/adversary_collusion.py).
- ``collude-lr-late``: ``collude-lr``, serving nothing of its state, and answering every availability
  challenge truthfully in the last blocks of its window.
- ``takeover``: a coalition member (issue 41, attack 1; ``DLX_COALITION`` names the coalition,
  ``DLX_COALITION_DIR`` is where its members share signatures): it commits every round it can with
  the fewest honest signatures the quorum needs, then tries to eject the honest members it left
  out, to commit a back door with the coalition's signatures and to slash an honest member by a
  verdict the coalition signs.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONTRIBUTION_ATTACKS = ("huge-1e3", "huge-1e6", "sign-flip", "noise", "stale", "zero", "perturb")
ATTACKS = ("malformed-payload", *CONTRIBUTION_ATTACKS, "copy", "late", "empty-close", "duplicate-close",
           "equivocating-close", "censoring-close", "phantom-close", "absurd-hello", "forge-state",
           "diverge-once", "diverge-late", "diverge-slow-verdict", "fork-close", "doctored-shard",
           "other-momentum", "takeover", "over-declare", "other-platform", "collude-root")

from adversary_chain import absurd_hello, doctored_shard, other_momentum, takeover  # noqa: E402  (tests/ on the path)
from adversary_collusion import COLLUSION_ATTACKS, collusion_parts  # noqa: E402
from adversary_exchange import (censoring_close, copying_free_rider, duplicate_close, empty_close,  # noqa: E402
                                equivocating_close, forking_close, late_delivery, phantom_close)
from adversary_worker import (OTHER_PLATFORM_CPU, claiming_another_platform, colluding_root,  # noqa: E402,F401
                              diverging_late, diverging_once, diverging_slow_verdict, forged_contribution,
                              forged_start_state, malformed_payload, over_declaring)

ATTACKS = (*ATTACKS, *COLLUSION_ATTACKS)


def attack_parts(attack: str) -> dict:
    """The part classes of ``attack`` (keyword arguments of node.live.assembly.Kinds)."""
    if attack in CONTRIBUTION_ATTACKS:
        return forged_contribution(attack)
    if attack in COLLUSION_ATTACKS:
        return collusion_parts(attack)
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
