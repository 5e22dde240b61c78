"""A small internet in network namespaces: one public network and two sites, each behind its own NAT.

::

    site 1: <p>-h1 10.0.1.2 --- 10.0.1.1 <p>-r1 198.51.100.11 --+
                                         (nft masquerade)       |
                                                                +-- br0 198.51.100.1  <p>-pub
                                                                |   (relay, chain, public nodes)
    site 2: <p>-h2 10.0.2.2 --- 10.0.2.1 <p>-r2 198.51.100.12 --+

The routers masquerade what leaves their WAN side (nftables, like a home router or a cloud NAT
gateway) and drop whatever arrives there that is not a reply: the public network has no route to
10.0.x.x, so a site's host can be reached only through a connection it opened (or a hole it
punched). A router has no default route, so a dial of the other site's private address fails at
once (ICMP net unreachable) instead of hanging.

Namespaces are named ``dlxnat-<pid>-<n>-...`` so parallel runs never collide; :meth:`NatLab.close`
deletes them (and with them every veth and nft rule inside) and is idempotent.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess

PUBLIC_IP = "198.51.100.1"
ROUTER_WAN_IPS = ("198.51.100.11", "198.51.100.12")
SITE_IPS = ("10.0.1.2", "10.0.2.2")

# Masquerade out of the WAN side; drop (not refuse) anything arriving there that is not part of a
# connection the site opened, as home routers and cloud NAT gateways do. Without the drop, Linux
# answers an early hole-punch SYN with a RST and kills the simultaneous open.
NAT_RULES = """table ip nat {
  chain postrouting {
    type nat hook postrouting priority srcnat; policy accept;
    oifname "wan" masquerade
  }
}
table ip filter {
  chain input {
    type filter hook input priority filter; policy accept;
    iifname "wan" ct state established,related accept
    iifname "wan" drop
  }
  chain forward {
    type filter hook forward priority filter; policy accept;
    iifname "wan" ct state established,related accept
    iifname "wan" drop
  }
}
"""
_counter = itertools.count()


class LabUnavailable(RuntimeError):
    """Namespaces or NAT cannot be made here (not root, no ``ip``/``nft``, no netns support)."""


def _run(*argv: str, stdin: str | None = None) -> None:
    result = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise LabUnavailable(f"{' '.join(argv)}: {result.stderr.strip() or result.returncode}")


def unavailable_reason() -> str | None:
    """Why a lab cannot be built here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return (f"`{tool}` is not installed (apt-get install -y "
                    f"{'iproute2' if tool == 'ip' else 'nftables'})")
    return None


class NatLab:
    """Build with ``NatLab()`` (raises :class:`LabUnavailable`), use :meth:`cmd`, always :meth:`close`."""

    def __init__(self) -> None:
        reason = unavailable_reason()
        if reason:
            raise LabUnavailable(reason)
        prefix = f"dlxnat-{os.getpid()}-{next(_counter)}"
        self.public = f"{prefix}-pub"
        self.routers = (f"{prefix}-r1", f"{prefix}-r2")
        self.sites = (f"{prefix}-h1", f"{prefix}-h2")
        self._made: list[str] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _add(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._made.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        self._add(self.public)
        _run("ip", "-n", self.public, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.public, "addr", "add", f"{PUBLIC_IP}/24", "dev", "br0")
        _run("ip", "-n", self.public, "link", "set", "br0", "up")
        for index, (router, site) in enumerate(zip(self.routers, self.sites), start=1):
            self._add(router)
            self._add(site)
            # veths are created inside the namespaces directly: nothing is left in the root one.
            _run("ip", "-n", router, "link", "add", "wan", "type", "veth", "peer", "name", f"port{index}",
                 "netns", self.public)
            _run("ip", "-n", self.public, "link", "set", f"port{index}", "master", "br0", "up")
            _run("ip", "-n", router, "addr", "add", f"{ROUTER_WAN_IPS[index - 1]}/24", "dev", "wan")
            _run("ip", "-n", router, "link", "set", "wan", "up")
            _run("ip", "-n", router, "link", "add", "lan", "type", "veth", "peer", "name", "eth0", "netns",
                 site)
            _run("ip", "-n", router, "addr", "add", f"10.0.{index}.1/24", "dev", "lan")
            _run("ip", "-n", router, "link", "set", "lan", "up")
            _run("ip", "-n", site, "addr", "add", f"{SITE_IPS[index - 1]}/24", "dev", "eth0")
            _run("ip", "-n", site, "link", "set", "eth0", "up")
            _run("ip", "-n", site, "route", "add", "default", "via", f"10.0.{index}.1")
            _run("ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            _run("ip", "netns", "exec", router, "nft", "-f", "-", stdin=NAT_RULES)

    def cmd(self, namespace: str, *argv: str) -> list[str]:
        """``argv`` run inside ``namespace`` (for subprocess)."""
        return ["ip", "netns", "exec", namespace, *argv]

    def close(self) -> None:
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        self._made.clear()

    def __enter__(self) -> NatLab:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
