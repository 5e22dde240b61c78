"""End to end across NATs: one run trained by a public node and two nodes each behind its own NAT.

Network namespaces made here (tests/netns_lab.py: nftables masquerade, unsolicited inbound dropped),
real anvil, real node processes (tests/nat_run.py orchestrates from inside the public namespace).
The public node relays (``p2p.relay_serve``); the NATed nodes reserve a slot on it
(``p2p.relay_use``), find each other through the DHT, connect through the relay and try to punch a
direct hole (DCUtR). Prints the table of paths per pair and the rounds committed. Skips, with the
reason, where namespaces or nft cannot be made.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from netns_lab import PUBLIC_IP, SITE_IPS, LabUnavailable, NatLab

ROUNDS = 3


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", ["hole-punch", "relay-only"])
def test_a_run_across_two_nats_commits_every_round(tmp_path, capsys, mode):
    """``hole-punch``: the defaults. ``relay-only``: DCUtR off, so the NATed pair trains through the relay
    the whole run (what a pair behind symmetric NATs gets)."""
    try:
        lab = NatLab()
    except LabUnavailable as exc:
        pytest.skip(f"cannot build network namespaces with NAT here: {exc}")
    try:
        spec = {"public_ip": PUBLIC_IP, "sites": [[ns, ip] for ns, ip in zip(lab.sites, SITE_IPS)]}
        proc = subprocess.run(
            lab.cmd(lab.public, sys.executable, str(Path(__file__).parent / "nat_run.py"), json.dumps(spec),
                    str(tmp_path / "run"), str(ROUNDS), "720",
                    *(["relay-only"] if mode == "relay-only" else [])),
            capture_output=True, text=True, timeout=840, env=dict(os.environ),
        )
    finally:
        lab.close()
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(lines[-1])
    assert result["ok"], result.get("logs", "")[-8000:]
    assert result["committed"] == list(range(ROUNDS)), result
    assert all(n == 3 for n in result["contributors"]), result  # every node, NATed or not, contributed
    # The NATed nodes advertised their relayed addresses (what their hellos carry).
    for name, place in result["placement"].items():
        if place.startswith("nat"):
            assert any("/p2p-circuit/p2p/" in a for a in result["listen_addrs"].get(name, [])), result

    names = sorted(result["placement"])
    pairs = [(left, right) for i, left in enumerate(names) for right in names[i + 1:]]
    with capsys.disabled():
        print(f"\nNAT run ({mode}): {len(names)} nodes, rounds committed {result['committed']} "
              f"(contributors {result['contributors']})")
        print(f"  {'pair':40} {'path (left side)':18} | path (right side)")
        for left, right in pairs:
            label = f"{left}[{result['placement'][left]}] - {right}[{result['placement'][right]}]"
            print(f"  {label:40} {_path(result['paths'][left].get(right)):18} | "
                  f"{_path(result['paths'][right].get(left))}")
    # Every pair met, one way or the other; the two NATed nodes only through the relay (or a hole
    # punched from a relayed connection): nothing dials into a site directly.
    for left, right in pairs:
        records = [r for r in (result["paths"][left].get(right), result["paths"][right].get(left)) if r]
        assert records, (left, right, result)
        if "public" not in (result["placement"][left], result["placement"][right]):
            assert all("direct" not in r["seen"] for r in records), (left, right, records)
            if mode == "relay-only":
                assert all(r["seen"] == ["relayed"] for r in records), (left, right, records)


def _path(record: dict | None) -> str:
    """The last path seen, and the others seen before it."""
    if record is None:
        return "-"
    return record["last"] + (f" (seen: {', '.join(record['seen'])})" if len(record["seen"]) > 1 else "")
