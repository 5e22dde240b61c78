"""The network emulator itself (tests/netlab.py): the delay it gives is never less than asked, the rate never
more, NAT keeps unsolicited traffic out, and close() leaves no namespace behind. Bounds only, no timing
goals: a loaded machine can only add delay and take rate away. Skips, with the reason, where the emulator
cannot be built (not root, no ip/nft/tc/gcc, no TUN)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from netlab import LabUnavailable, NetLab, Site, probe_rtt, probe_throughput  # noqa: E402


@pytest.mark.timeout(240)
def test_delay_rate_and_nat_are_what_was_asked_at_least_and_at_most(tmp_path):
    try:
        lab = NetLab([Site("a", 1000), Site("b", 20), Site("n", 1000, nat=True)],
                     {"a": {"b": 30, "n": 5}, "b": {"a": 10}, "n": {"a": 5}}, workdir=tmp_path)
    except LabUnavailable as exc:
        pytest.skip(f"cannot build the network emulator here: {exc}")
    namespaces = [lab.core, *lab.namespaces.values()]
    try:
        rtts = probe_rtt(lab, "a", "b", count=5)
        assert len(rtts) == 5 and min(rtts) >= 30 + 10, rtts  # a -> b 30 ms, b -> a 10 ms
        stream = probe_throughput(lab, "b", "a", seconds=2)
        assert 0 < stream["mbit_s"] <= 20 * 1.1, stream  # b's upload is tbf-limited to 20 Mbit/s
        assert lab.link_stats("b")["sent"][lab.public_ip("a")]["syns"] >= 1  # the stream's dial, counted
        assert len(probe_rtt(lab, "n", "a", count=2)) == 2  # out of the NAT and back: answered
        assert probe_rtt(lab, "a", "n", count=2) == []  # into it unsolicited: dropped
    finally:
        lab.close()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    assert not any(name in listed for name in namespaces), listed
