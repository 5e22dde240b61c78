"""The soak's churn and its loop (bench/bench_soak.py): kills and restarts, the chain RPC outage, a member
leaving for good and one joining, at fixed fractions of the run; the once-a-second watch of exits and
commits, and a sample every ``--sample-s`` (bench/soak_sampling.py).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.soak_sampling import take_sample

#: The nftables table that drops the chain's RPC port during the outage.
OUTAGE_TABLE = "dlxsoak"
#: How long a member that left is given to finish its round and exit after SIGTERM before it is killed.
LEAVE_STOP_S = 180.0


class Soak:
    """The run's churn, its watch and its samples (see module docstring)."""

    def __init__(self, run, args, spec: dict, site_of: dict[str, str], rpc_url: str, anvil_port: int) -> None:
        self.run, self.args, self.spec, self.site_of = run, args, spec, site_of
        self.rpc_url, self.anvil_port = rpc_url, anvil_port
        self.client = run.client()
        self.started = time.time()
        self.link = ""
        self.spare_account: int | None = None
        self.joiner: subprocess.Popen | None = None
        self.joiner_dir = Path(args.workdir).resolve() / "joiner"
        self.left: set[str] = set()
        self.asked_down: set[int] = set()  # pids this harness killed or stopped
        self.events: list[dict] = []
        self.unexpected_exits: list[dict] = []
        self.first_seen: dict[int, float] = {}
        self.samples: list[dict] = []
        # where the nodes' light probes write (bench_soak --no-probe: none)
        self.probe_dir: Path | None = None
        self.outage_on = False
        self.outage_lock = threading.Lock()
        self.outage_timer: threading.Timer | None = None
        self.schedule = [] if args.no_churn else self._schedule()

    def _schedule(self) -> list[tuple[float, str, object]]:
        duration = self.args.duration_min * 60
        by_site = {self.site_of[s.name]: s for s in self.run.nodes}
        nat_sites = [n for n, s in self.spec["sites"].items() if s["nat"]]
        singles = [c["name"] for c in self.spec["clusters"] if not c["split"] and not c["nat"]
                   and c["name"] != "c0"]
        split = next((s for s in self.run.nodes
                      if self.spec["clusters"][int(s.cluster.split("-")[1])]["split"]),
                     None)
        plan = []
        if singles:
            plan += [(0.15, "kill", by_site[singles[0]])]
        plan += [(0.30, "outage", None)]
        if nat_sites:
            plan += [(0.45, "kill", by_site[nat_sites[0]])]
        if singles:
            plan += [(0.55, "leave", by_site[singles[-1]])]
        plan += [(0.65, "join", None)]
        if split is not None:
            plan += [(0.80, "kill", split)]
        return sorted(((at * duration, kind, slot) for at, kind, slot in plan), key=lambda e: e[0])

    def now(self) -> float:
        return round(time.time() - self.started, 1)

    def event(self, kind: str, **fields) -> dict:
        entry = {"at_s": self.now(), "kind": kind, **fields}
        self.events.append(entry)
        print(json.dumps(entry), flush=True)
        return entry

    # -- the faults ----------------------------------------------------------------------------------

    def kill(self, slot) -> None:
        if slot.process is None or slot.process.poll() is not None:
            return
        self.asked_down.add(slot.process.pid)
        state = slot.status().get("state", "")
        self.run.kill(slot, signal.SIGKILL)
        self.event("kill", node=slot.name, site=self.site_of[slot.name], state=state)
        time.sleep(5)
        self.run.start_node(slot)
        self.event("restart", node=slot.name)

    def outage_begin(self) -> None:
        rules = (f"table inet {OUTAGE_TABLE} {{\n chain input {{\n  type filter hook input priority filter; "
                 f"policy accept;\n  iifname != \"lo\" tcp dport {self.anvil_port} drop\n }}\n}}\n")
        subprocess.run(["nft", "-f", "-"], input=rules, text=True, check=True, timeout=30)
        self.outage_on = True
        self.event("rpc_outage_begin", seconds=self.args.outage_s)
        # Ended on its own timer: the loop may be busy with a kill or a leave when the minute is up.
        self.outage_timer = threading.Timer(self.args.outage_s, self.outage_end)
        self.outage_timer.start()

    def outage_end(self) -> None:
        with self.outage_lock:
            self._outage_end()

    def _outage_end(self) -> None:
        if self.outage_on:
            subprocess.run(["nft", "delete", "table", "inet", OUTAGE_TABLE], capture_output=True, timeout=30)
            self.outage_on = False
            self.event("rpc_outage_end")

    def leave(self, slot) -> None:
        done = subprocess.run([sys.executable, "-m", "node.cli", "leave", "--config", str(slot.config_path),
                               "--yes"],
                              capture_output=True, text=True, timeout=300)
        self.event("leave", node=slot.name, exit_code=done.returncode, out=done.stdout.strip()[-300:])
        if slot.process is not None and slot.process.poll() is None:
            self.asked_down.add(slot.process.pid)
            self.stop_member(slot)
        self.left.add(slot.name)

    def stop_member(self, slot) -> None:
        """SIGTERM a member that left and wait for it to finish its round and exit; at load 40 on two cores
        that took over 30 s (the launcher's wait, which ended the first run on this code at minute 34), so
        wait up to LEAVE_STOP_S, record how long it took, and SIGKILL it (recorded) only past that."""
        started = time.monotonic()
        slot.process.send_signal(signal.SIGTERM)
        try:
            slot.process.wait(timeout=LEAVE_STOP_S)
            self.event("stopped", node=slot.name, after_s=round(time.monotonic() - started, 1))
        except subprocess.TimeoutExpired:
            slot.process.kill()
            slot.process.wait(timeout=30)
            self.event("killed_after_leave", node=slot.name, after_s=round(time.monotonic() - started, 1))

    def join(self) -> None:
        if self.spare_account is None:
            return
        site = self.spec["sites"]["joiner"]
        self.joiner_dir.mkdir(parents=True, exist_ok=True)
        log = self.joiner_dir.parent / "joiner.log"
        self.joiner = subprocess.Popen(
            ["ip", "netns", "exec", site["ns"], sys.executable, "-m", "node.cli", "--log-file", str(log),
             "join", self.link, "--data-dir", str(self.joiner_dir), "--dev-account", str(self.spare_account),
             "--yes", "--no-progress", "--listen-host", site["host_ip"], "--listen-port", "4101",
             "--set", "torch_threads=1", "--set", f"round_timeout={self.args.round_timeout}",
             "--set", f"join_timeout={self.args.join_timeout}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
        self.site_of["joiner"] = "joiner"
        self.event("join", node="joiner", account=self.spare_account)

    # -- the loop ------------------------------------------------------------------------------------

    def members(self) -> list[tuple[str, subprocess.Popen | None, Path]]:
        out = [(s.name, s.process, s.data_dir) for s in self.run.nodes]
        if self.joiner is not None:
            out.append(("joiner", self.joiner, self.joiner_dir))
        return out

    def loop(self) -> None:
        duration = self.args.duration_min * 60
        next_sample = 0.0
        while True:
            elapsed = time.time() - self.started
            if self.args.rounds == 0 and elapsed >= duration:
                return
            if self.args.rounds and not self.run.running():
                return
            if elapsed > duration + 1800:
                self.event("gave_up")
                return
            while self.schedule and self.schedule[0][0] <= elapsed:
                _, kind, slot = self.schedule.pop(0)
                if kind == "outage":
                    self.outage_begin()
                else:
                    getattr(self, kind)(*([slot] if slot is not None else []))
            self.check_exits()
            self.poll_rounds()
            if elapsed >= next_sample:
                self.sample()
                next_sample = elapsed + self.args.sample_s
            time.sleep(1)

    def check_exits(self) -> None:
        """A node that exits unasked is a failure of the run: recorded, then started again (soak mode)."""
        for slot in self.run.nodes:
            if slot.name in self.left or slot.process is None or slot.process.poll() is None:
                continue
            if slot.process.pid in self.asked_down:
                continue
            if self.args.rounds and slot.process.returncode == 0:
                continue  # the run ended (--rounds): its nodes exit by themselves
            self.asked_down.add(slot.process.pid)
            self.unexpected_exits.append({"node": slot.name, "code": slot.process.returncode,
                                          "at_s": self.now()})
            if not self.args.rounds:
                self.run.start_node(slot)

    def poll_rounds(self) -> int | None:
        """The last committed round, noting when each round was first seen (polled once a second)."""
        try:
            last = self.client.last_round(self.run.run_id)
        except Exception as exc:  # the orchestrator's own RPC is local; record, do not stop the soak
            self.event("poll_error", error=str(exc)[:200])
            return None
        at = self.now()
        for r in range(0 if not self.first_seen else max(self.first_seen) + 1,
                       (last if last is not None else -1) + 1):
            self.first_seen[r] = at
        return last

    def sample(self) -> None:
        last = self.poll_rounds()
        self.samples.append(take_sample(self.members(), self.spec["sites"], self.now(), last, self.probe_dir))

    def stop(self) -> None:
        self.outage_end()
        if self.joiner is not None and self.joiner.poll() is None:
            self.asked_down.add(self.joiner.pid)
            self.joiner.send_signal(signal.SIGTERM)
        for slot in self.run.nodes:
            if slot.process is not None:
                self.asked_down.add(slot.process.pid)
        self.sample()
        self.run.stop_nodes()
        if self.joiner is not None:
            try:
                self.joiner.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.joiner.kill()
