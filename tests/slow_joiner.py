"""A joiner whose catch-up is slow (a loaded machine, a large checkpoint), run as a real process by the tests.

    python tests/slow_joiner.py SECONDS [dlx-node arguments...]

runs the normal ``dlx-node`` command line; its ``start`` builds the node with a finisher that
sleeps SECONDS before the first round it finishes without having trained it (the first catch-up
round after its entry), as a joiner restoring and catching up on a starved machine does
(tests/test_join_round_cost.py, bench/bench_join.py). Everything else is the honest node.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from adversary import run_with  # noqa: E402

logger = logging.getLogger("slow_joiner")


def slow_catch_up(seconds: float) -> dict:
    from node.live.round.finisher import RoundFinisher

    class SlowCatchUp(RoundFinisher):
        slept = False

        def finish(self, outer_round: int, overlap_tail: bool = False) -> None:
            if not SlowCatchUp.slept and outer_round not in self.rounds.trained:
                SlowCatchUp.slept = True
                logger.warning("slow joiner: catching up round %d after %.0f s", outer_round, seconds)
                time.sleep(seconds)
            super().finish(outer_round, overlap_tail)

    return {"finisher": SlowCatchUp}


def main() -> int:
    if len(sys.argv) < 2:
        print("usage: slow_joiner.py SECONDS [dlx-node arguments]", file=sys.stderr)
        return 2
    return run_with(slow_catch_up(float(sys.argv.pop(1))))


if __name__ == "__main__":
    sys.exit(main())
