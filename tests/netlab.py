"""A small internet on one machine: every site in its own network namespace, behind an access link with a
rate, a one-way delay per destination and jitter; some sites behind NAT. Shared by the slow tests and
the benches (bench/bench_netlab.py measures it, bench/bench_soak.py runs a day of training on it).

::

    site i (public):  <p>-s<i>  eth0 100.64.<i>.2 (tun) ==fwd==  l<i> (tun) --+
                                                                             +-- <p>-core 100.64.0.1
    site j (NAT):     <p>-s<j> 10.0.<j>.2 -- <p>-r<j> wan 100.64.<j>.2 ==fwd== l<j> --+  (router; the chain)

``==fwd==`` is one emulated access link: a process of tests/netlab_fwd.c (compiled with gcc at first use)
holding two TUN devices, one in the site's namespace (or its NAT router's) and one in the core. What the
site sends is held for ``delay_ms[site][destination]`` (plus up to ``jitter_ms``), then handed to the
core; what it receives passes at once, so the one-way delay of the path i -> j is exactly the one
configured for it, and the round trip is the sum of both ways. ``tc tbf`` on both TUN devices gives the
link its rate (upload on the site's side, download on the core's). The core routes between the links
and is where the orchestrator (the chain, a test's driver) runs: 100.64.0.1, reached with the
``chain_delay_ms`` of each link. NAT routers use tests/netns_lab.py's nftables rules (masquerade out of
``wan``, unsolicited inbound dropped).

Nothing here sleeps in the node's code: the nodes run unchanged; the delay is in the packets' path.
Namespaces are named ``dlxlab-<pid>-<n>-...``; :meth:`NetLab.close` stops the forwarders it started
and deletes the namespaces (with every device and rule inside). :func:`remove_leftovers` deletes those
of labs whose process is gone (a run killed outright). What it cannot model: docs/P2P.md, "Network
emulator".
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from netns_lab import NAT_RULES, LabUnavailable  # noqa: E402

__all__ = ["CORE_IP", "LabUnavailable", "NetLab", "Site", "remove_leftovers", "unavailable_reason"]

CORE_IP = "100.64.0.1"
PREFIX = "dlxlab"
FORWARDER_SOURCE = Path(__file__).resolve().parent / "netlab_fwd.c"
_counter = itertools.count()


@dataclass
class Site:
    """One place on the emulated internet: a namespace its nodes run in (one node, or a split cluster's)."""

    name: str
    rate_mbit: float = 1000.0
    nat: bool = False


@dataclass
class NetLab:
    """Build with ``NetLab(sites, delay_ms)`` (raises :class:`LabUnavailable`), always :meth:`close`.

    ``delay_ms[a][b]``: one-way delay of the path from site ``a`` to site ``b`` (milliseconds; missing
    pairs take ``default_delay_ms``). ``chain_delay_ms``: one-way from every site to the core.
    """

    sites: list[Site]
    delay_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    jitter_ms: float = 0.0
    default_delay_ms: float = 0.0
    chain_delay_ms: float = 0.0
    seed: int = 0
    workdir: Path | None = None
    core: str = ""
    namespaces: dict[str, str] = field(default_factory=dict)  # site -> the namespace its nodes run in
    forwarders: dict[str, subprocess.Popen] = field(default_factory=dict)
    _made: list[str] = field(default_factory=list)
    _own_workdir: bool = False  # made here (no workdir given): removed by close()

    def __post_init__(self) -> None:
        reason = unavailable_reason()
        if reason:
            raise LabUnavailable(reason)
        names = [s.name for s in self.sites]
        if len(set(names)) != len(names) or not 1 <= len(names) <= 250:
            raise ValueError(f"sites {names}: need 1-250 distinct names")
        remove_leftovers()
        self.prefix = f"{PREFIX}-{os.getpid()}-{next(_counter)}"
        self._own_workdir = self.workdir is None
        self.workdir = Path(self.workdir or tempfile.mkdtemp(prefix=f"{self.prefix}-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self._build(forwarder_binary(self.workdir))
        except BaseException:
            self.close()
            raise

    # -- addresses -------------------------------------------------------------------------------

    def index(self, site: str) -> int:
        return 1 + [s.name for s in self.sites].index(site)

    def public_ip(self, site: str) -> str:
        """Where the rest of the lab sees the site (its NAT router's WAN address if it is NATed)."""
        return f"100.64.{self.index(site)}.2"

    def host_ip(self, site: str) -> str:
        """The address the site's nodes listen on (a private one behind NAT)."""
        spec = self.sites[self.index(site) - 1]
        return f"10.0.{self.index(site)}.2" if spec.nat else self.public_ip(site)

    def cmd(self, site: str | None, *argv: str) -> list[str]:
        """``argv`` run inside ``site``'s namespace (None: the core)."""
        return ["ip", "netns", "exec", self.namespaces[site] if site else self.core, *argv]

    def one_way_ms(self, source: str, destination: str) -> float:
        return float(self.delay_ms.get(source, {}).get(destination, self.default_delay_ms))

    # -- building ----------------------------------------------------------------------------------

    def _add(self, name: str) -> str:
        _run("ip", "netns", "add", name)
        self._made.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")
        return name

    def _build(self, binary: Path) -> None:
        self.core = self._add(f"{self.prefix}-core")
        _run("ip", "netns", "exec", self.core, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        for spec in self.sites:
            i = self.index(spec.name)
            host = self._add(f"{self.prefix}-s{i}")
            self.namespaces[spec.name] = host
            edge, tun = host, "eth0"
            if spec.nat:
                edge, tun = self._add(f"{self.prefix}-r{i}"), "wan"
                _run("ip", "-n", edge, "link", "add", "lan", "type", "veth", "peer", "name", "eth0", "netns",
                     host)
                _run("ip", "-n", edge, "addr", "add", f"10.0.{i}.1/24", "dev", "lan")
                _run("ip", "-n", edge, "link", "set", "lan", "up")
                _run("ip", "-n", host, "addr", "add", f"10.0.{i}.2/24", "dev", "eth0")
                _run("ip", "-n", host, "link", "set", "eth0", "up")
                _run("ip", "-n", host, "route", "add", "default", "via", f"10.0.{i}.1")
                _run("ip", "netns", "exec", edge, "sysctl", "-qw", "net.ipv4.ip_forward=1")
                _run("ip", "netns", "exec", edge, "nft", "-f", "-", stdin=NAT_RULES)
            _run("ip", "-n", edge, "tuntap", "add", "mode", "tun", "name", tun)
            _run("ip", "-n", self.core, "tuntap", "add", "mode", "tun", "name", f"l{i}")
            self._start_forwarder(binary, spec.name, edge, tun, f"l{i}")
            _run("ip", "-n", edge, "addr", "add", f"{self.public_ip(spec.name)}/32", "dev", tun)
            _run("ip", "-n", self.core, "addr", "add", f"{CORE_IP}/32", "dev", f"l{i}")
            for namespace, device in ((edge, tun), (self.core, f"l{i}")):
                _run("ip", "-n", namespace, "link", "set", device, "txqueuelen", "1000", "up")
                _run("ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root",
                     *tbf_args(spec.rate_mbit))
            _run("ip", "-n", edge, "route", "add", "default", "dev", tun)
            _run("ip", "-n", self.core, "route", "add", f"{self.public_ip(spec.name)}/32", "dev", f"l{i}")

    def _start_forwarder(self, binary: Path, site: str, edge: str, tun: str, core_tun: str) -> None:
        pairs = []
        for other in self.sites:
            if other.name != site:
                pairs += [self.public_ip(other.name), str(round(self.one_way_ms(site, other.name) * 1000))]
        pairs += [CORE_IP, str(round(self.chain_delay_ms * 1000))]
        proc = subprocess.Popen(
            [str(binary), str(self.stats_path(site)), edge, tun, self.core, core_tun,
             str(round(self.default_delay_ms * 1000)), str(round(self.jitter_ms * 1000)),
             str(self.seed + self.index(site)), *pairs],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.forwarders[site] = proc
        line = proc.stdout.readline()
        if line.strip() != "ready":
            raise LabUnavailable(f"forwarder of {site}: {proc.stderr.read().strip() or 'exited'}")

    # -- reading -----------------------------------------------------------------------------------

    def stats_path(self, site: str) -> Path:
        return self.workdir / f"link-{site}.json"

    def link_stats(self, site: str) -> dict:
        """The forwarder's counters (rewritten once a second): per destination IP sent packets, bytes,
        SYNs; received packets, bytes."""
        try:
            return json.loads(self.stats_path(site).read_text())
        except (OSError, ValueError):
            return {}

    def forwarder_cpu_s(self) -> float:
        """CPU seconds (user + system) the forwarders used so far."""
        return sum(process_cpu_s(p.pid) for p in self.forwarders.values() if p.poll() is None)

    def close(self) -> None:
        for proc in self.forwarders.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.forwarders.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        self._made.clear()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> NetLab:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


#: Run inside a namespace by the probes: a UDP echo server / a TCP sink, one line of JSON out when done.
_ECHO = """
import json, socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("0.0.0.0", int(sys.argv[1])))
s.settimeout(float(sys.argv[2]))
print("ready", flush=True)
try:
    while True:
        data, addr = s.recvfrom(2048); s.sendto(data, addr)
except socket.timeout:
    pass
"""
_PING = """
import json, socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(5)
rtts = []
for n in range(int(sys.argv[3])):
    t = time.perf_counter(); s.sendto(str(n).encode(), (sys.argv[1], int(sys.argv[2])))
    try:
        while s.recv(2048) != str(n).encode():
            pass
        rtts.append((time.perf_counter() - t) * 1000)
    except socket.timeout:
        pass
    time.sleep(0.05)
print(json.dumps(rtts))
"""
_SINK = """
import json, socket, sys, time
srv = socket.create_server(("0.0.0.0", int(sys.argv[1]))); srv.settimeout(60)
print("ready", flush=True)
conn, _ = srv.accept(); total = 0; first = last = None
while data := conn.recv(1 << 20):
    now = time.perf_counter(); first = first or now; last = now; total += len(data)
print(json.dumps({"bytes": total, "seconds": (last - first) if first else 0.0}))
"""
_SOURCE = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
block = b"x" * (1 << 16); end = time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    c.sendall(block)
c.close()
"""


def _serve(lab: NetLab, site: str | None, script: str, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen(lab.cmd(site, sys.executable, "-c", script, *args), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        raise LabUnavailable(f"probe server in {site}: {proc.stderr.read()[-500:]}")
    return proc


def probe_rtt(lab: NetLab, source: str, destination: str, count: int = 20, port: int = 9901) -> list[float]:
    """Round-trip times (ms) of ``count`` UDP echoes from ``source`` to ``destination``'s public address."""
    server = _serve(lab, destination, _ECHO, str(port), "10")
    try:
        done = subprocess.run(lab.cmd(source, sys.executable, "-c", _PING, lab.public_ip(destination),
                                      str(port), str(count)), capture_output=True, text=True, timeout=120)
        return json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else []
    finally:
        server.kill()
        server.wait(timeout=10)


def probe_throughput(lab: NetLab, source: str, destination: str, seconds: float = 5.0,
                     port: int = 9902) -> dict:
    """One TCP stream from ``source`` to ``destination`` for ``seconds``: Mbit/s received, and the CPU
    seconds the lab's forwarders used meanwhile (the emulator's own cost)."""
    sink = _serve(lab, destination, _SINK, str(port))
    cpu_before, started = lab.forwarder_cpu_s(), time.monotonic()
    try:
        subprocess.run(lab.cmd(source, sys.executable, "-c", _SOURCE, lab.public_ip(destination), str(port),
                               str(seconds)), capture_output=True, text=True, timeout=seconds + 60,
                       check=True)
        out, _ = sink.communicate(timeout=60)
    finally:
        if sink.poll() is None:
            sink.kill()
            sink.wait(timeout=10)
    wall = time.monotonic() - started
    figures = json.loads(out.strip().splitlines()[-1])
    mbit = figures["bytes"] * 8 / 1e6 / figures["seconds"] if figures["seconds"] else 0.0
    cpu = lab.forwarder_cpu_s() - cpu_before
    return {"mbit_s": round(mbit, 1), "bytes": figures["bytes"], "seconds": round(figures["seconds"], 2),
            "forwarder_cpu_s": round(cpu, 2), "forwarder_cpu_share": round(cpu / wall, 3)}


def tbf_args(rate_mbit: float) -> list[str]:
    """tc tbf for ``rate_mbit``: a bucket of 4 ms at the rate (at least 3 full frames, tbf's floor for the
    kernel's timer) and a queue of 50 ms at the rate."""
    burst = max(4500, int(rate_mbit * 1e6 / 8 * 0.004))
    return ["tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "50ms"]


def random_delays(sites: list[str], low_ms: float, high_ms: float,
                  rng: random.Random) -> dict[str, dict[str, float]]:
    """A symmetric matrix of one-way delays drawn uniformly from [low_ms, high_ms]."""
    delays: dict[str, dict[str, float]] = {s: {} for s in sites}
    for i, a in enumerate(sites):
        for b in sites[i + 1:]:
            delays[a][b] = delays[b][a] = round(rng.uniform(low_ms, high_ms), 1)
    return delays


def _run(*argv: str, stdin: str | None = None) -> None:
    result = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise LabUnavailable(f"{' '.join(argv)}: {result.stderr.strip() or result.returncode}")


def unavailable_reason() -> str | None:
    """Why a lab cannot be built here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool, package in (("ip", "iproute2"), ("nft", "nftables"), ("tc", "iproute2"), ("gcc", "gcc")):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install -y {package})"
    if not os.path.exists("/dev/net/tun"):
        return "no /dev/net/tun (TUN devices)"
    return None


def forwarder_binary(workdir: Path) -> Path:
    """tests/netlab_fwd.c compiled with gcc -O2 (once per source version, in the temp directory)."""
    source = FORWARDER_SOURCE.read_bytes()
    binary = Path(tempfile.gettempdir()) / f"dlx-netlab-fwd-{hashlib.sha256(source).hexdigest()[:12]}"
    if not binary.exists():
        partial = workdir / "netlab_fwd.partial"
        done = subprocess.run(["gcc", "-O2", "-Wall", "-o", str(partial), str(FORWARDER_SOURCE)],
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise LabUnavailable(f"gcc could not build the forwarder: {done.stderr.strip()[-500:]}")
        os.replace(partial, binary)
    return binary


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def remove_leftovers() -> list[str]:
    """Delete the namespaces of labs whose process is gone (and stop their forwarders); the names removed."""
    try:
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    removed = []
    for name in re.findall(rf"^({PREFIX}-(\d+)-\d+-\S+)", names, re.MULTILINE):
        namespace, pid = name[0], int(name[1])
        if Path(f"/proc/{pid}").exists():
            continue
        # forwarders of that lab (started by this module) hold its devices
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                try:
                    argv = (proc / "cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                if argv and b"dlx-netlab-fwd-" in argv[0] and namespace.encode() in argv:
                    try:
                        os.kill(int(proc.name), 15)
                    except OSError:
                        pass
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)
        removed.append(namespace)
    if removed:
        time.sleep(0.2)
    return removed
