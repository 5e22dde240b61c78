"""Traffic, round time and CPU per node as the number of replicas grows: measured in local runs, then
modelled.

    nice -n 19 python bench/bench_scale.py [--replicas 4,8,16] [--rounds 3] [--inner-steps 2]
        [--exchange sliced] [--attacker none,withhold]

Each point is a real local run (anvil, one-node clusters of the ``tiny`` model,
2 stages chained in each node, spot checks off so that only the exchange is
measured). While it runs, the script samples every node's ``status.json`` and
``/proc/<pid>/stat`` twice a second; from the moment a node starts round 0 to
its last finished round it reports, per node and per round: the round time,
the application bytes its libp2p host sent and received (blobs, gossip, sync),
the gossip messages it published and was delivered (run-topic messages,
heartbeat hellos included; gossipsub's own forwarding is not counted) and the
CPU seconds of its process. Also the mean contribution envelope size. The model
extends the measurement: today every holder of a stage fetches every other
replica's contribution of it, so a node receives about ``(R - 1) x C`` bytes
per round (``C``: one replica's contribution envelopes, all stages) and serves
as much; gossip adds messages per peer. Writes bench/results/scale.json
(``--exchange sliced``: scale_sliced.json; ``--curve``: scale_curve.json), overwriting it.
``--exchange sliced`` runs the opt-in sliced exchange (docs/PROTOCOL.md, "Sliced
exchange"): contribution envelopes carry constant-size slice references, slices
(read by range from each replica's bundle) and partials travel as blobs, so
``/dlx/blob/1.0.0`` is the exchange's own traffic in both modes.

``--attacker`` runs each replica count once per entry of its list, the last node running that attack
(``none``: no attacker), all into the one result of the mode.

``--curve [FULL.json,SLICED.json]`` runs nothing: it puts the measured points of
both exchanges side by side with the per-node model of each to 1024 replicas
(:func:`sliced_model`: the live sliced exchange's terms, with the sizes the
measurement gave) and writes ``--out``.

Past anvil's 9 funded dev accounts the launcher funds generated ones
(``ledger.account.dev_account``), so a local run may have up to ``MAX_NODES``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.benchio import RESULTS, write_result  # noqa: E402
from node.commands.launcher import LocalRun  # noqa: E402

#: Attacks of tests/sliced_adversary.py (the others are tests/adversary.py's).
SLICED_ATTACKS = ("withhold", "wrong-root", "wrong-blob", "two-partials", "bad-slice", "bad-reference",
                  "slices-huge-1e3", "slices-sign-flip", "slices-noise", "slices-zero")

_TICK = os.sysconf("SC_CLK_TCK")
_COUNTERS = ("bytes_sent", "bytes_received", "gossip_messages_sent", "gossip_messages_received")


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU of a live process and its reaped children (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return sum(int(fields[i]) for i in (11, 12, 13, 14)) / _TICK  # utime stime cutime cstime


class NodeWatch:
    """What one node process did between the start of its round 0 and its last finished round."""

    def __init__(self, slot) -> None:
        self.slot = slot
        self.cpu_last = 0.0
        self.start: dict | None = None  # time, cpu and counters when round 0 began
        self.finishes: dict[int, float] = {}  # round -> time it was first seen finished
        self.status: dict = {}

    def sample(self, now: float) -> None:
        cpu = cpu_seconds(self.slot.process.pid) if self.slot.process.poll() is None else None
        if cpu is not None:
            self.cpu_last = cpu
        status = self.slot.status()
        if not status:
            return
        self.status = status
        if self.start is None and status.get("state") == "training" and status.get("round", -1) >= 0:
            self.start = {"time": now, "cpu": self.cpu_last, "traffic": status.get("traffic", {}),
                          **{k: status.get(k, 0) for k in _COUNTERS}}
        finished = status.get("last_finished", -1)
        if finished >= 0 and finished not in self.finishes:
            self.finishes[finished] = now

    def summary(self, exit_code: int) -> dict:
        rounds = len(self.finishes)
        start = self.start or {"time": 0.0, "cpu": 0.0, "traffic": {}, **{k: 0 for k in _COUNTERS}}
        end = max(self.finishes.values()) if self.finishes else start["time"]
        per_round = lambda value: value / rounds if rounds else None  # noqa: E731
        times = [self.finishes[r] for r in sorted(self.finishes)]
        envelopes = list((self.slot.data_dir / "archive").rglob("*.env"))
        slices = own_bundles(self.slot.data_dir / "archive", self.status.get("peer_id", ""))
        return {
            "name": self.slot.name, "exit": exit_code, "rounds_finished": rounds,
            "weights_root": self.status.get("weights_root", ""),
            "startup_cpu_seconds": start["cpu"],
            "seconds_per_round": per_round(end - start["time"]),
            "round_intervals": [b - a for a, b in zip(times, times[1:])],
            "cpu_per_round": per_round(self.cpu_last - start["cpu"]),
            **{f"{k}_per_round": per_round(self.status.get(k, 0) - start[k]) for k in _COUNTERS},
            **{f"{k}_total": self.status.get(k, 0) for k in _COUNTERS},
            "traffic_per_round": {
                protocol: {key: per_round(value - start["traffic"].get(protocol, {}).get(key, 0))
                           for key, value in counters.items()}
                for protocol, counters in self.status.get("traffic", {}).items()},
            "cpu_total": self.cpu_last,
            "envelope_bytes": sum(p.stat().st_size for p in envelopes), "envelopes": len(envelopes),
            "own_slice_bytes_per_round": per_round(sum(p.stat().st_size for p in slices)),
        }


def own_bundles(archive: Path, peer_id: str) -> list[Path]:
    """The slice bundles (sliced exchange) this node's own contribution envelopes reference: a coordinator
    also archives every bundle it fetched to close (``*.slice`` too), which are not its own bytes."""
    from node.protocol import ProtocolError, decode_contribution_body
    from p2p.envelope import decode_envelope
    from p2p.errors import P2PError
    from training.slicebundle import REFERENCE_PREFIX

    own = set()
    for path in archive.rglob("*.env"):
        try:
            env = decode_envelope(path.read_bytes(), 1 << 26)
            if env.sender_peer_id == peer_id and env.kind == "contribution":
                reference = decode_contribution_body(env.payload).blob
                if reference.startswith(REFERENCE_PREFIX):
                    start = len(REFERENCE_PREFIX) + 4
                    own.add(reference[start:start + 32].hex())
        except (ValueError, P2PError, ProtocolError):  # not an envelope of this run's kinds: not counted
            continue
    return [path for path in archive.rglob("*.slice") if path.stem in own]


def traffic_mean(nodes: list[dict]) -> dict:
    """Per protocol, the mean over nodes of each per-round counter."""
    table: dict[str, dict[str, list[float]]] = {}
    for node in nodes:
        for protocol, counters in node["traffic_per_round"].items():
            for key, value in counters.items():
                if value is not None:
                    table.setdefault(protocol, {}).setdefault(key, []).append(value)
    return {protocol: {key: statistics.mean(values) for key, values in counters.items()}
            for protocol, counters in table.items()}


def one_run(workdir: Path, replicas: int, args, attacker: str = "") -> dict:
    settings = ["model.preset=tiny", f"diloco.inner_steps={args.inner_steps}", "training.batch_size=4",
                f"rounds={args.rounds}", f"round_timeout={args.round_timeout}",
                f"join_timeout={args.join_timeout}", "checkpoint_every=1000", "spot_checks=0",
                f"diloco.exchange={args.exchange}", *args.setting]
    if (workdir / "deployment.json").exists():  # a previous run's chain and identities: start afresh
        shutil.rmtree(workdir)
    run = LocalRun(workdir, replicas=replicas, stages=2, split=False, settings=settings)
    run.setup()
    if attacker:  # the last node misbehaves (issue 33: the exchange's traffic with one attacker)
        script = "sliced_adversary.py" if attacker in SLICED_ATTACKS else "adversary.py"
        run.nodes[-1].command = [sys.executable, str(ROOT / "tests" / script), attacker]
    watches = [NodeWatch(slot) for slot in run.nodes]
    loads = []  # 1-minute load average, every 10 s
    started = time.monotonic()
    try:
        run.start()
        deadline = started + args.timeout
        ticks = 0
        while run.running() and time.monotonic() < deadline:
            now = time.monotonic()
            for watch in watches:
                watch.sample(now)
            if ticks % 20 == 0:
                with open("/proc/loadavg") as f:
                    loads.append(float(f.read().split()[0]))
            ticks += 1
            time.sleep(0.5)
        timed_out = bool(run.running())
        wall = time.monotonic() - started
        for watch in watches:
            watch.sample(time.monotonic())
        commits = run.client().history(run.run_id).commits
    finally:
        run.stop()
    for watch in watches:  # status.json's final write (on stop) carries the last counters
        watch.status = watch.slot.status() or watch.status
    nodes = [w.summary(w.slot.process.returncode) for w in watches]
    rounds = len(commits)

    def mean(key: str) -> float | None:
        values = [n[key] for n in nodes if n[key] is not None]
        return statistics.mean(values) if values else None

    envelope_mean = (sum(n["envelope_bytes"] for n in nodes) / max(sum(n["envelopes"] for n in nodes), 1))
    honest = nodes[:-1] if attacker else nodes
    return {
        "replicas": replicas, "nodes_count": len(nodes), "rounds_committed": rounds,
        "commit_contributors": [c.commit.num_contributors for c in commits],
        "weights_roots_agree": len({n["weights_root"] for n in honest}) == 1,
        "attacker": attacker or None,
        "honest_exits_zero": all(n["exit"] == 0 for n in honest),
        "honest_blob_received_per_node_round": traffic_mean(honest).get("/dlx/blob/1.0.0",
                                                                        {}).get("received"),
        "honest_blob_sent_per_node_round": traffic_mean(honest).get("/dlx/blob/1.0.0", {}).get("sent"),
        "exits": [n["exit"] for n in nodes], "timed_out": timed_out,
        "wall_seconds": wall, "load_1min_samples": loads,
        "seconds_per_round": mean("seconds_per_round"),
        "sent_per_node_round": mean("bytes_sent_per_round"),
        "received_per_node_round": mean("bytes_received_per_round"),
        "gossip_sent_per_node_round": mean("gossip_messages_sent_per_round"),
        "gossip_received_per_node_round": mean("gossip_messages_received_per_round"),
        "cpu_per_node_round": mean("cpu_per_round"),
        "startup_cpu_per_node": mean("startup_cpu_seconds"),
        "traffic_per_node_round": traffic_mean(nodes),
        "contribution_envelope_bytes": envelope_mean,
        "replica_contribution_bytes": envelope_mean * 2,  # one envelope per stage, 2 stages
        # sliced: what a replica codes per round (its slice
        # bundles, every stage); the envelopes carry references
        "replica_slice_bytes": mean("own_slice_bytes_per_round"),
        "exchange": args.exchange, "settings": settings,
        "blob_received_per_node_round": traffic_mean(nodes).get("/dlx/blob/1.0.0", {}).get("received"),
        "blob_sent_per_node_round": traffic_mean(nodes).get("/dlx/blob/1.0.0", {}).get("sent"),
        "nodes": nodes,
    }


def model(points: list[dict], sizes: list[int]) -> list[dict]:
    """Per-node traffic per round for R replicas: (R - 1) contributions in, as many out, plus the
    per-peer gossip overhead fitted from the measured points (least squares on R - 1)."""
    xs = [p["replicas"] - 1 for p in points]
    ys = [p["received_per_node_round"] for p in points]
    c = sum(p["replica_contribution_bytes"] for p in points) / len(points)
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys))
             / max(sum((x - mean_x) ** 2 for x in xs), 1e-9))
    intercept = mean_y - slope * mean_x
    return [{"replicas": r, "contribution_bytes_in": (r - 1) * c,
             "fitted_received_per_node_round": intercept + slope * (r - 1)} for r in sizes]


def envelope_framing() -> int:
    """Bytes a signed envelope adds to its payload (a real one, built and measured)."""
    from p2p.envelope import Envelope
    from p2p.identity import Identity

    identity = Identity.generate()
    return len(Envelope.create(identity, 1, 1, "partial", b"", stage=1, replica=1).to_bytes())


def sliced_model(replicas: int, stage_shapes: list[dict], envelope_bytes: float, slice_bytes: float,
                 framing: int, min_slice_numel: int = 1024, transfer_timeout: float | None = None) -> dict:
    """Blob bytes one node receives per round in the live sliced exchange (every stage held), by term.

    Per stage, A = the live plan's slice count (``min(R, elements // min_slice_numel)``), a node
    aggregating A/R slices on average. Only a slice's aggregators and the round's coordinator fetch
    the closed contribution envelopes (a holder judges a close by the signed announces):
    envelopes ``f x (R - 1) x E`` with ``f = 1 - (1 - A/R)(1 - 1/R)``, the share of nodes that
    aggregate or coordinate the stage (constant size E: the reference, not a manifest);
    as aggregator (A/R) x (R - 1) x (record(A) + B/A), B = one replica's slice bytes of the stage;
    partials (A - A/R) x (envelope framing + partial header + B/A). With A capped by the minimum
    slice every term is flat in R; at A = R the envelopes and records are linear. ``envelope_bytes``
    E and ``slice_bytes`` B (per stage) come from a measured run.

    Issue 33 (docs/PROTOCOL.md, "Withholding costs only the withholder"): the round's coordinator
    fetches every closed contribution's whole bundle before closing, ``(1/R) x (R - 1) x bundle`` per
    node on average (``coordinator_bundles``; its own round: ``coordinator_round_received``). With
    one withholding member (``with_withholder``), the rounds it coordinates (1/R of them) are spoiled:
    every holder reads the inputs it can of every slice at the last turn, ``(R - 2) x B``, then the
    round runs again under the next coordinator (every term once more); the rounds others coordinate
    cost nothing more (it is left out). Its mean per node and round, and a spoiled round's, are
    ``with_withholder`` and ``spoiled_round_received``.

    One attacker as an aggregator (it is candidate 0 of A/R of a stage's slices per round on average):
    when it withholds its partial, the next candidate in the fallback order reads what an aggregator
    reads, ``(R - 1) x (E + record(A) + B/A)`` (``slice_read``), once per slice (the mean over nodes,
    ``with_withholding_aggregator``); when it signs a wrong partial and the fallback the right one,
    every holder replays that slice (docs/PROTOCOL.md, "Receiving partials"), ``slice_read`` each
    (``with_wrong_partial_replayed``; a holder's round with one such slice per stage:
    ``replay_round_received``). A member that withholds only its bundle after an honest coordinator
    closed costs nothing: its slices are read from the coordinator instead (same bytes).

    Latency, not bytes: a holder refuses a close whose partials never came once the first
    ``CANDIDATE_TURNS`` candidates' turns and its own replay's turn have passed,
    ``(min(R, CANDIDATE_TURNS) + 1) x transfer_timeout`` per stage (rule 3; it was ``(R + 1) x``), and
    the stages are applied one after the other, so a withholding coordinator of every stage delays its
    round by ``spoiled_round_delay_s`` = stages x that (the node's default ``p2p.transfer_timeout``
    unless given) before the next coordinator's close; ``spoiled_round_delay_s_every_turn`` is the
    ``(R + 1) x`` rule's.
    """
    from node.live.exchange.sliced_partials import CANDIDATE_TURNS
    from p2p.config import P2PConfig

    transfer_timeout = P2PConfig().transfer_timeout if transfer_timeout is None else transfer_timeout
    from training.slice_plan import live_plan
    from training.slicebundle import BUNDLE_PREFIX, record_size
    from training.slicemessages import PARTIAL_PREFIX

    terms = {"envelopes": 0.0, "slice_inputs": 0.0, "records": 0.0, "partials": 0.0,
             "coordinator_bundles": 0.0}
    slices = []
    peak = 0.0  # a node that aggregates a slice of every stage it holds in the round (the role rotates)
    coordinating = 0.0  # a node that coordinates every stage it holds in the round
    replay = 0.0  # a holder's last-turn reads of every slice's inputs in a spoiled round
    slice_read = 0.0  # what reading one slice's inputs costs (an aggregator's, a fallback's or a replay's)
    attacker_slices = 0.0  # slices per round (all stages) whose candidate 0 is the one attacker, on average
    fallback = replays = 0.0
    for shapes in stage_shapes:
        count = live_plan(shapes, replicas, min_slice_numel).num_slices
        slices.append(count)
        share = count / replicas
        fetching = 1 - (1 - share) * (1 - 1 / replicas)
        partial = framing + len(PARTIAL_PREFIX) + 44 + slice_bytes / count
        terms["envelopes"] += fetching * (replicas - 1) * envelope_bytes
        terms["slice_inputs"] += share * (replicas - 1) * slice_bytes / count
        terms["records"] += share * (replicas - 1) * record_size(count)
        terms["partials"] += (count - share) * partial
        bundle = len(BUNDLE_PREFIX) + 4 + count * record_size(count) + slice_bytes
        terms["coordinator_bundles"] += (replicas - 1) * bundle / replicas
        peak += (replicas - 1) * (envelope_bytes + record_size(count) + slice_bytes / count) + (count - 1) \
            * partial
        coordinating += (replicas - 1) * (envelope_bytes + bundle)
        replay += max(0, replicas - 2) * (slice_bytes + count * record_size(count))
        read = (replicas - 1) * (envelope_bytes + record_size(count) + slice_bytes / count)
        slice_read += read
        attacker_slices += share
        fallback += share * read / replicas  # one fallback candidate reads the inputs of each withheld slice
        replays += share * read  # every holder replays each slice with a wrong and a right partial
    honest = sum(terms.values())
    return {"replicas": replicas, "min_slice_numel": min_slice_numel, "slices": slices,
            "blob_received_per_node_round": honest, "terms": terms,
            "aggregator_round_received": peak, "coordinator_round_received": coordinating,
            "with_withholder": honest + (replay + honest) / replicas,
            "spoiled_round_received": replay + honest,
            "slice_read": slice_read, "attacker_slices_per_round": attacker_slices,
            "with_withholding_aggregator": honest + fallback,
            "with_wrong_partial_replayed": honest + replays,
            "replay_round_received": honest + slice_read,
            "transfer_timeout": transfer_timeout,
            "spoiled_round_delay_s": len(stage_shapes) * (min(replicas, CANDIDATE_TURNS) + 1)
                * transfer_timeout,
            "spoiled_round_delay_s_every_turn": len(stage_shapes) * (replicas + 1) * transfer_timeout}


def point_min_slice(point: dict) -> int:
    """The diloco.min_slice_numel a measured point ran with (1024 when it was not set)."""
    for item in point.get("settings", []):
        key, _, value = item.partition("=")
        if key.strip() == "diloco.min_slice_numel":
            return int(value)
    return 1024


def curve(full_path: str, sliced_paths: list[str], sizes: list[int], min_slices: list[int]) -> dict:
    """Measured points of both exchanges side by side, and both models to ``sizes`` (module docstring);
    the sliced model for each minimum slice in ``min_slices`` (``sliced_models``) and for the one the
    largest measured sliced point ran with (``sliced_model``)."""
    from training.slice_plan import live_plan
    from training.config import ModelConfig
    from training.slicebundle import BUNDLE_PREFIX, record_size
    from training.stages import split_stages, stage_param_shapes

    full = [p for p in json.loads(Path(full_path).read_text())["measured"] if is_clean(p)]
    sliced = [p for path in sliced_paths for p in json.loads(Path(path).read_text())["measured"]
              if is_clean(p)]
    model_cfg = ModelConfig(preset="tiny")
    stage_shapes = [stage_param_shapes(model_cfg, spec) for spec in split_stages(model_cfg.n_layer, 2)]
    largest = max(sliced, key=lambda p: (p["replicas"], point_min_slice(p) == 1024))
    measured_min = point_min_slice(largest)

    def constants(point: dict) -> tuple[float, list[int]]:
        """B, one replica's slice bytes per stage (its bundle without the header and records), and A."""
        counts = [live_plan(shapes, point["replicas"], point_min_slice(point)).num_slices
                  for shapes in stage_shapes]
        per_stage_bundle = point["replica_slice_bytes"] / len(stage_shapes)
        return per_stage_bundle - len(BUNDLE_PREFIX) - 4 - statistics.mean(
            count * record_size(count) for count in counts), counts

    slice_bytes, counts = constants(largest)
    # Each minimum slice's model takes B from the largest point measured with it (on tiny, B grows with A).
    by_min = {m: max([p for p in sliced if point_min_slice(p) == m] or [largest], key=lambda p: p["replicas"])
              for m in min_slices}
    model_bytes = {m: constants(point)[0] for m, point in by_min.items()}
    framing = envelope_framing()
    butterfly = RESULTS / "butterfly.json"
    butterfly_rows = (json.loads(butterfly.read_text())["traffic"].get("tiny", {}).get("rows", [])
                      if butterfly.exists() else [])
    rows = []
    for replicas in sorted({*(p["replicas"] for p in full + sliced), *sizes}):
        row = {"replicas": replicas}
        for name, points in (("full", full), ("sliced", sliced)):
            matching = [p for p in points if p["replicas"] == replicas]
            if name == "sliced" and len(matching) > 1:  # several minimum slices measured at this size
                row["sliced_measured_by_min_slice"] = {
                    str(point_min_slice(p)): {"blob_received": p["blob_received_per_node_round"],
                                              "blob_sent": p["blob_sent_per_node_round"],
                                              "seconds_per_round": p["seconds_per_round"]} for p in matching}
                matching = [p for p in matching if point_min_slice(p) == measured_min] or matching
            point = matching[0] if matching else None
            if point is not None:
                row[f"{name}_measured"] = {
                    "blob_received": point["blob_received_per_node_round"],
                    "blob_sent": point["blob_sent_per_node_round"],
                    "all_received": point["received_per_node_round"],
                    "all_sent": point["sent_per_node_round"],
                    "seconds_per_round": point["seconds_per_round"],
                    "load_last": (point["load_1min_samples"] or [None])[-1]}
        row["full_model_blob_received"] = (replicas - 1) * (full[0]["replica_contribution_bytes"] if full
                                                            else 0)
        row["sliced_model"] = sliced_model(replicas, stage_shapes, largest["contribution_envelope_bytes"],
                                           slice_bytes, framing, measured_min)
        row["sliced_models"] = {}
        for m in min_slices:  # B measured at this size and minimum if there is such a point (B grows with A)
            same = next((p for p in sliced if p["replicas"] == replicas and point_min_slice(p) == m), None)
            row["sliced_models"][str(m)] = sliced_model(
                replicas, stage_shapes, by_min[m]["contribution_envelope_bytes"],
                model_bytes[m] if same is None else constants(same)[0], framing, m)
        # bench_butterfly's in-process model of the same model's two stages (its own budget and plan:
        # H = 50, min_slice_numel 8,192, so A = 2 on tiny; signed slice messages, not bundles).
        stages = [r for r in butterfly_rows if r["replicas"] == replicas]
        if stages:
            row["butterfly_model"] = {
                "sliced_mean_received": sum(r["sliced_mean_in"] for r in stages),
                "sliced_aggregator_received": sum(r["sliced_aggregator"]["bytes_in"] for r in stages),
                "all_to_all_received": sum(r["all_to_all"]["bytes_in"] for r in stages),
                "slices": [r["sliced_aggregator"]["slices"] for r in stages]}
        rows.append(row)
    return {"full": full_path, "sliced": sliced_paths, "butterfly": str(butterfly), "model_constants": {
        "envelope_bytes": largest["contribution_envelope_bytes"], "slice_bytes_per_stage": slice_bytes,
        "envelope_framing": framing, "from_replicas": largest["replicas"],
        "from_min_slice_numel": measured_min, "from_slices": counts, "slice_bytes_per_stage_by_min_slice": {
            str(m): {"slice_bytes_per_stage": model_bytes[m], "from_replicas": by_min[m]["replicas"],
                     "from_min_slice_numel": point_min_slice(by_min[m])} for m in min_slices}}, "rows": rows}


def is_clean(point: dict) -> bool:
    """A run the model may use: every node finished every round, exited 0 and ended on the same weights."""
    return (not point.get("attacker") and not point["timed_out"] and point["weights_roots_agree"]
            and all(e == 0 for e in point["exits"])
            and point["rounds_committed"] > 0 and point["received_per_node_round"] is not None)


def _fmt(value: float | None, scale: float = 1.0) -> str:
    return "n/a" if value is None else f"{value / scale:.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", default="4,8,16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--inner-steps", type=int, default=2)
    parser.add_argument("--round-timeout", type=float, default=300)
    parser.add_argument("--join-timeout", type=float, default=600)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--setting", action="append", default=[], metavar="KEY=VALUE",
                        help="one more node setting for every run (repeatable), e.g. "
                             "p2p.gossip_resync_interval=0")
    parser.add_argument("--exchange", choices=("full", "sliced"), default="full",
                        help="diloco.exchange of every run (docs/PROTOCOL.md, \"Sliced exchange\")")
    parser.add_argument("--attacker", default="",
                        help="the last node runs this attack (tests/sliced_adversary.py "
                        "or tests/adversary.py), e.g. withhold; roots are compared over the honest nodes. A "
                        "comma list runs each replica count once per entry, \"none\" for no "
                        "attacker (none,withhold)")
    parser.add_argument("--workdir", default="/tmp/dlx-bench-scale")
    parser.add_argument("--out", default="",
                        help="default: the one current result of the mode, bench/results/scale.json (full "
                             "exchange), scale_sliced.json (--exchange sliced) or scale_curve.json (--curve)")
    parser.add_argument("--curve", default="", nargs="?",
                        const=f"{RESULTS / 'scale.json'},{RESULTS / 'scale_sliced.json'}",
                        metavar="FULL.json,SLICED.json[,SLICED2.json...]",
                        help="no run: the two exchanges' measured points and models side by side, to --out "
                             "(without a value: the current scale.json and scale_sliced.json)")
    parser.add_argument("--model-min-slices", default="1024,4096",
                        help="--curve: the diloco.min_slice_numel values to model the sliced exchange with")
    args = parser.parse_args()
    if not args.out:
        name = "scale_curve.json" if args.curve else ("scale_sliced.json" if args.exchange == "sliced"
                                                      else "scale.json")
        args.out = str(RESULTS / name)
    if args.curve:
        full_path, *sliced_paths = args.curve.split(",")
        table = curve(full_path, sliced_paths, [8, 16, 64, 256, 1024],
                      [int(m) for m in args.model_min_slices.split(",")])
        for row in table["rows"]:
            measured = lambda name: _fmt(row.get(f"{name}_measured", {}).get("blob_received"), 1e3)  # noqa: E731
            print(f"{row['replicas']:>5} replicas: blob bytes in per node and round, full {measured('full')} "
                  f"kB measured / {row['full_model_blob_received'] / 1e3:.1f} kB modelled; sliced "
                  f"{measured('sliced')} kB measured / "
                  f"{row['sliced_model']['blob_received_per_node_round'] / 1e3:.1f} kB modelled "
                  f"(A = {row['sliced_model']['slices']}; "
                  + ", ".join(f"min slice {m}: {model['blob_received_per_node_round'] / 1e3:.1f} kB, A = "
                              f"{model['slices']}" for m, model in row["sliced_models"].items())
                  + "); bench_butterfly's model: sliced "
                  f"{_fmt(row.get('butterfly_model', {}).get('sliced_mean_received'), 1e3)} kB, all-to-all "
                  f"{_fmt(row.get('butterfly_model', {}).get('all_to_all_received'), 1e3)} kB")
        write_result(args.out, table)
        print(f"wrote {args.out}")
        return 0
    points = []
    attackers = ["" if a.strip() in ("", "none") else a.strip() for a in args.attacker.split(",")]
    for replicas, attacker in [(int(r), a) for r in args.replicas.split(",") for a in attackers]:
        point = one_run(Path(args.workdir) / f"r{replicas}{'-' + attacker if attacker else ''}", replicas,
                        args, attacker)
        points.append(point)
        print(f"{replicas:>3} replicas{', attacker ' + attacker if attacker else ''}: "
              f"{point['rounds_committed']} rounds committed "
              f"(contributors {point['commit_contributors']}, exits {point['exits']}), "
              f"{_fmt(point['seconds_per_round'])} s/round; per node and round "
              f"{_fmt(point['sent_per_node_round'], 1e3)} kB sent, "
              f"{_fmt(point['received_per_node_round'], 1e3)} kB received, "
              f"{_fmt(point['gossip_sent_per_node_round'])} gossip msgs sent, "
              f"{_fmt(point['gossip_received_per_node_round'])} received, "
              f"{_fmt(point['cpu_per_node_round'])} CPU s, "
              f"blobs {_fmt(point['blob_received_per_node_round'], 1e3)} kB in / "
              f"{_fmt(point['blob_sent_per_node_round'], 1e3)} kB out ({args.exchange} exchange) "
              f"(one replica's contribution {point['replica_contribution_bytes'] / 1e3:.1f} kB; "
              f"load {point['load_1min_samples'][-1:] or '?'})", flush=True)
        write(args, points, [])
    clean = [p for p in points if is_clean(p)]
    # The linear model describes the full exchange only.
    modelled = model(clean, [16, 64, 256, 1024]) if clean and args.exchange == "full" else []
    for m in modelled:
        print(f"{m['replicas']:>5} replicas (model): {m['fitted_received_per_node_round'] / 1e6:.2f} MB "
              f"received per node and round")
    write(args, points, modelled)
    print(f"wrote {args.out}")
    return 0


def write(args, points: list[dict], modelled: list[dict]) -> None:
    """Write the results so far (after every run: a later run that hangs keeps the earlier ones)."""
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    write_result(args.out, {"args": vars(args), "load_at_end": load, "measured": points, "model": modelled})


if __name__ == "__main__":
    sys.exit(main())
