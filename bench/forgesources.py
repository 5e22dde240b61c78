"""What a forge campaign ran on: the sha256 of every source it compiled (contracts/src and its own test files
under contracts/forge/test), so a result made on older contracts shows it. Used by bench/fuzz_forge.py (the
trust campaign) and bench/fuzz_forge_pool.py (the reward pool's)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tests.forge_campaign import FORGE_ROOT

REPO = FORGE_ROOT.parent.parent


def one_tree(parts: list[dict]) -> dict[str, str]:
    """The sources that results of campaigns run apart all ran on ({} where none recorded any); refused
    (SystemExit) where they differ or only some recorded theirs: a merge is of one tree's campaigns."""
    ran_on = {digest(part["sources"]): part["sources"] for part in parts if part.get("sources")}
    if len(ran_on) > 1 or (ran_on and any(not part.get("sources") for part in parts)):
        raise SystemExit("the campaigns ran on different sources (or some recorded none): merge one tree's")
    return next(iter(ran_on.values()), {})


def sources(tests: tuple[str, ...]) -> dict[str, str]:
    """The sha256 of each source a campaign compiles: contracts/src's and its test files ``tests`` (under
    contracts/forge/test)."""
    files = sorted((REPO / "contracts" / "src").rglob("*.sol"))
    files += [FORGE_ROOT / "test" / name for name in tests]
    return {str(f.relative_to(REPO)): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


def digest(hashes: dict[str, str]) -> str:
    """One sha256 over the sources' names and hashes (the tree's fingerprint)."""
    return hashlib.sha256(json.dumps(hashes, sort_keys=True).encode()).hexdigest()


def stale(out: str, tests: tuple[str, ...]) -> int:
    """Print the sources (added, changed or gone) that differ from those the recorded campaign ran on (the
    campaign whose test files are ``tests``)."""
    recorded = json.loads(Path(out).read_text()).get("sources")
    if not recorded:
        print(f"{out} records no sources: its campaign's tree is unknown")
        return 1
    now = sources(tests)
    changed = sorted(name for name in recorded.keys() | now.keys() if recorded.get(name) != now.get(name))
    for name in changed:
        print(f"{'gone' if name not in now else 'new' if name not in recorded else 'changed'}: {name}")
    print(f"{len(changed)} of {len(now)} sources differ from the campaign's" if changed
          else "the campaign ran on these sources")
    return 1 if changed else 0
