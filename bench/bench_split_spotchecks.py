"""Benchmark: re-execution spot checks on a split cluster, read back from a finished ``dlx-node demo`` run.

A demo is 2 replicas x 2 stages, one stage per node (a split cluster): to check the other replica a node
gathers its stages (envelopes fetched by hash from the stage holders, start states from their signers) and
reruns the whole pipeline (node/live/checks/spotinputs.py). This script reads what the run's nodes logged and
wrote, and optionally the ``dlx-node audit --reexecute all --json`` report of the same run, and writes one
JSON (default bench/results/split_spotchecks.json):

- per node: the checks its draw named (``node.live.checks.routing.draw_checks``, the node's own function, over
  each recorded round's weights root, signers and the declared platforms), every spot check done
  (round, replica, verdict, rerun seconds in the child, check seconds including
  the fetches), the checks not done (with their reasons), the round-bound skips, the checks per round;
- the overhead: a node's spot-check seconds per round against its round's wall seconds (timing.jsonl
  "period" records). The rerun runs in a child process beside training, so this is the share of a round a
  node spends checking, not a slowdown measured against a run without checks;
- the audit's re-execution items and verdict, if given.

    dlx-node demo --spot-checks 0.5 --keep --out /tmp/demo       # then, while the chain runs:
    dlx-node audit ... --reexecute all --json /tmp/audit.json
    PYTHONPATH=. .venv/bin/python bench/bench_split_spotchecks.py --demo /tmp/demo/dlx-demo \\
        --audit-json /tmp/audit.json --rpc http://127.0.0.1:PORT \\
        --deployment /tmp/demo/dlx-demo/deployment.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

CHECK = re.compile(r"^(\S+) \w+\s+node\.live\.verifier: spot check of replica (\d+) round (\d+): (\w+) "
                   r"\(.*rerun ([\d.]+)s, check ([\d.]+)s\)")
NOT_DONE = re.compile(
    r"^(\S+) \w+\s+node\.live\.verifier: spot check of replica (\d+) round (\d+) not done: (.*)$")
SKIPPED = re.compile(r"spot checks of round (\d+) skipped: (\d+) rounds behind the chain")


def signers_of(node_dir: Path, run_id: int, outer_round: int) -> dict[int, set[str]] | None:
    """replica -> the peer ids that signed its contributions of the round, as the node's archive binds them to
    the record (``recorded.json``, else the round as sealed): what node.live.checks.verifier draws from."""
    from node.store.archive import Archive

    archive = Archive(node_dir / "archive", run_id)
    recorded = archive.recorded(outer_round)
    sealed = recorded[0] if recorded is not None else archive.sealed(outer_round)
    if sealed is None:
        return None
    signers: dict[int, set[str]] = {}
    for contribution in sealed:
        signers.setdefault(contribution.replica, set()).add(contribution.peer_id)
    return signers


def sampled(node_dir: Path, run_id: int, declared: dict[str, bytes]) -> list[dict]:
    """The checks the node's draw named: node.live.checks.routing.draw_checks (the function
    node.live.checks.verifier calls) over each recorded round's weights root, the round's signers and the
    declared platforms, to set against the checks done. ``routed``: only the routed draw picked it (a verifier
    that reruns it exactly or by emulation)."""
    from node.config import load_config
    from node.live.checks.routing import draw_checks

    cfg = load_config(node_dir / "node.toml")
    status = json.loads((node_dir / "status.json").read_text())
    roots = json.loads((node_dir / "state.json").read_text()).get("weights_roots", {})
    own = status["placement"]["replica"]
    out = []
    for r, root in sorted(roots.items(), key=lambda kv: int(kv[0])):
        signers = signers_of(node_dir, run_id, int(r))
        if signers is None:
            continue
        out += [{"round": int(r), "replica": check.replica, "routed": check.same_platform}
                for check in draw_checks(bytes.fromhex(root), status["peer_id"], int(r), signers, declared,
                                         cfg.spot_checks, own)]
    return out


def declarations(args, dirs: list[Path]) -> tuple[dict[str, bytes], str]:
    """peer id -> the platform it declared: read from the chain (--rpc and --deployment, as the nodes read
    it), else each node's own declaration computed here from its node.toml (right only on the machine it ran
    on)."""
    peers = {json.loads((d / "status.json").read_text())["peer_id"]: d for d in dirs}
    if args.rpc:
        from node.live.chain.onchain import NodeChain
        from node.tools.evidence import reader_client

        return NodeChain(reader_client(args)).declared_platforms(args.run, sorted(peers)), "chain"
    from node.config import load_config
    from node.platforms import own_platform

    return {peer: own_platform(load_config(d / "node.toml").training) for peer, d in peers.items()}, \
        "computed here"


def node_figures(node_dir: Path, run_id: int, declared: dict[str, bytes]) -> dict:
    checks, not_done, skipped = [], [], []
    for log in sorted(node_dir.glob("node-*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if m := CHECK.match(line):
                checks.append({"at": m[1], "replica": int(m[2]), "round": int(m[3]), "verdict": m[4],
                               "rerun_s": float(m[5]), "check_s": float(m[6])})
            elif m := NOT_DONE.match(line):
                not_done.append({"at": m[1], "replica": int(m[2]), "round": int(m[3]), "reason": m[4][:300]})
            elif m := SKIPPED.search(line):
                skipped.append({"round": int(m[1]), "behind": int(m[2])})
    periods = []
    timing = node_dir / "timing.jsonl"
    if timing.exists():
        periods = [r for r in map(json.loads, timing.read_text().splitlines()) if r.get("kind") == "period"]
    walls = [r["wall_s"] for r in periods if r.get("wall_s")]
    rounds_trained = len(periods)
    check_seconds = sum(c["check_s"] for c in checks)
    per_round: dict[int, int] = {}
    for c in checks:
        per_round[c["round"]] = per_round.get(c["round"], 0) + 1
    mean_wall = statistics.mean(walls) if walls else None
    status = {}
    try:
        status = json.loads((node_dir / "status.json").read_text())
    except (OSError, ValueError):
        pass
    drawn = sampled(node_dir, run_id, declared)
    done = {(c["round"], c["replica"]) for c in checks}
    return {
        "sampled": len(drawn), "sampled_routed": sum(d["routed"] for d in drawn),
        "sampled_done": sum((d["round"], d["replica"]) in done for d in drawn),
        "sampled_not_reached": [d for d in drawn if (d["round"], d["replica"]) not in done
                                and not any((n["round"], n["replica"]) == (d["round"], d["replica"])
                                            for n in not_done)],
        "checks": checks, "not_done": not_done, "skipped": skipped,
        "checks_per_round": {str(r): n for r, n in sorted(per_round.items())},
        "verdicts": sorted({c["verdict"] for c in checks}),
        "rounds_trained": rounds_trained, "round_wall_s_mean": mean_wall,
        "check_s_total": round(check_seconds, 2), "rerun_s_total": round(sum(c["rerun_s"] for c in checks),
                                                                         2),
        "check_s_per_round": round(check_seconds / rounds_trained, 2) if rounds_trained else None,
        "check_share_of_round": (round(check_seconds / rounds_trained / mean_wall, 3)
                                 if rounds_trained and mean_wall else None),
        "status": {k: status.get(k) for k in ("spot_checks", "spot_check_mismatches", "spot_checks_not_done",
                                               "spot_check_seconds", "chain_checks", "last_commit")},
    }


def audit_figures(path: Path) -> dict:
    doc = json.loads(path.read_text())
    items = []

    def walk(value):
        if isinstance(value, dict):
            name = value.get("name")
            if isinstance(name, str) and name.startswith(("re-execution", "ejection")):
                items.append({"name": name, "status": value.get("status"), "reason": value.get("reason")})
            for v in value.values():
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    walk(doc)
    statuses: dict[str, int] = {}
    for item in items:
        statuses[str(item["status"])] = statuses.get(str(item["status"]), 0) + 1
    return {"verdict": doc.get("verdict") or doc.get("summary", {}).get("verdict"),
            "reexecution_items": len(items), "by_status": statuses, "items": items}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--demo", required=True, help="the demo's --out directory")
    parser.add_argument("--audit-json", default=None, help="dlx-node audit --reexecute all --json output")
    parser.add_argument("--rpc", default="", help="the run's chain (the demo's --keep): read the declared "
                        "platforms from it, as the nodes do; else each node's is computed "
                        "here from its node.toml")
    parser.add_argument("--deployment", default="", help="the demo's deployment.json (with --rpc)")
    parser.add_argument("--registry", default="")
    parser.add_argument("--ledger", default="")
    parser.add_argument("--run", type=int, default=1, help="run id (default 1: the demo's)")
    parser.add_argument("--out", default="bench/results/split_spotchecks.json")
    args = parser.parse_args()
    demo = Path(args.demo)
    dirs = [d for d in sorted(demo.glob("r*n*")) if d.is_dir()]
    if not dirs:
        print(f"no node directories (r*n*) under {demo}", file=sys.stderr)
        return 2
    declared, declared_from = declarations(args, dirs)
    nodes = {d.name: node_figures(d, args.run, declared) for d in dirs}
    summary = {}
    try:
        summary = json.loads((demo / "summary.json").read_text())
    except (OSError, ValueError):
        pass
    out = {
        "what": "re-execution spot checks of a dlx-node demo run (split cluster: one stage per node)",
        "demo": str(demo), "rounds_committed": len(summary.get("rounds", [])),
        "accusations": summary.get("accusations"),
        "draw": ("node.live.checks.routing.draw_checks over each round's recorded signers and "
                 "their declared platforms"),
        "declared_platforms": {peer: platform.hex() for peer, platform in sorted(declared.items())},
        "declared_platforms_from": declared_from,
        "nodes": nodes,
        "total_checks": sum(len(n["checks"]) for n in nodes.values()),
        "total_not_done": sum(len(n["not_done"]) for n in nodes.values()),
        "all_exact": all(n["verdicts"] in ([], ["exact"]) for n in nodes.values()),
        "audit": audit_figures(Path(args.audit_json)) if args.audit_json else None,
    }
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(out, indent=1) + "\n")
    tmp.replace(path)
    for name, n in nodes.items():
        print(f"{name}: sampled {n['sampled']} ({n['sampled_routed']} routed only), done {len(n['checks'])} "
              f"{n['verdicts']}, {len(n['not_done'])} not done, {len(n['sampled_not_reached'])} not reached, "
              f"per round {n['checks_per_round']}, {n['check_s_per_round']} s/round vs round wall "
              f"{n['round_wall_s_mean']}")
    if out["audit"]:
        print(f"audit: {out['audit']['verdict']} {out['audit']['by_status']}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
