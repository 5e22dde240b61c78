"""A member that publishes hostile partials in the sliced exchange, run as a real process by the tests.

    python tests/sliced_adversary.py ATTACK [dlx-node arguments...]

- ``wrong-root``: every partial it aggregates binds an inputs root of zeros
  (validly signed; every holder must refuse it and take the fallback's).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ATTACKS = ("wrong-root",)


def wrong_root() -> None:
    from node.live.sliced import SlicedExchange
    from training.butterfly import partial_payload

    def make_payload(self, slice_index, num_slices, root, members, blob):
        return partial_payload(slice_index, num_slices, bytes(32), members, blob)

    SlicedExchange.make_payload = make_payload


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in ATTACKS:
        print(f"usage: sliced_adversary.py {{{'|'.join(ATTACKS)}}} [dlx-node arguments]", file=sys.stderr)
        return 2
    attack = sys.argv.pop(1)
    {"wrong-root": wrong_root}[attack]()
    from node.cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
