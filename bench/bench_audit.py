"""Audit benchmark: the chain part of ``dlx-node audit`` on a long history, and the replay cost per round.

Usage::

    .venv/bin/python bench/bench_audit.py [--rounds 1000] [--replay-preset tiny ...]
        [--out bench/results/audit.json]

1. Chain part: a managed anvil, a deployment, ``--quorum`` registered nodes (valid ed25519 bindings) that
   join a run of quorum k = ``--quorum``, ``--rounds`` rounds each signed by all k members (EIP-712) and
   committed directly with :class:`ledger.client.LedgerClient`; then :func:`node.tools.audit.audit_run`
   without evidence and without replay is timed: history read (paginated event scan), contract bytecode,
   genesis and hash chain link by link, every binding signature, every member's key, every round's k
   attesters against the membership in force. Target: <= 5 s for 1000 rounds. (Without evidence the
   audit is INCOMPLETE: only the chain items are asserted ok.)
2. Replay: a real short run (2 ``dlx-node start`` processes, 2 replicas x 2 stages each, ``--replay-rounds``
   rounds, model preset ``--replay-preset``), then a full audit with both nodes' archives; the per-round
   replay seconds (decode + average + outer step + hash of every stage) are reported. ``--no-run`` skips it
   and keeps the previous replay results of ``--out``, marked as such.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ledger.account import dev_account
from ledger.chain import connect_rpc
from ledger.anvil import AnvilProcess
from ledger.client import LedgerClient
from ledger.hashchain import next_head
from ledger.records import RoundRecord
from node.tools.audit import ATTESTED, FAIL, OK, PASSED, UNVERIFIABLE, WITHIN_MAX_ROUNDS, audit_run
from p2p.identity import Identity


def _digest(label: str) -> bytes:
    return hashlib.sha256(label.encode()).digest()


def chain_part(rounds: int, quorum: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        anvil = AnvilProcess(state_file=Path(tmp) / "chain.json")
        url = anvil.start()
        try:
            w3 = connect_rpc(url, wait=10)
            chain_id = w3.eth.chain_id
            registry, ledger = LedgerClient.deploy(w3, dev_account(0, chain_id))
            members = [LedgerClient(w3, dev_account(i, chain_id), registry, ledger)
                       for i in range(1, quorum + 1)]
            for member in members:
                identity = Identity.generate()
                member.register(identity.public_key_bytes, identity.sign(member.my_binding_message()))
            node = members[0]
            run_id = node.create_run(_digest("bench run"), 2, 50, quorum=quorum, quorum_bps=0,
                                     allow_weak_quorum=quorum < 2)
            for member in members:
                member.join_run(run_id)
            head = node.head_of(run_id)
            started = time.perf_counter()
            for index in range(rounds):
                record = RoundRecord(
                    run_id,
                    index,
                    head,
                    _digest(f"w{index}"),
                    _digest(f"c{index}"),
                    3_000_000 - index,
                    3_100_000 - index,
                    8 * 50 * 64 * 2,
                    4,
                )
                node.commit_round(record, [member.sign_record(record) for member in members])
                head = next_head(head, record)
                if (index + 1) % 100 == 0:
                    print(f"committed {index + 1}/{rounds} rounds", file=sys.stderr)
            commit_seconds = time.perf_counter() - started
            reader = LedgerClient(w3, None, registry, ledger)  # read-only, as the auditor's
            started = time.perf_counter()
            report = audit_run(reader, run_id, replay=False)
            wall = time.perf_counter() - started
            counts = report.counts()
            chain_items_ok = all(c.status == OK for c in report.general if c.name != "run document") and all(
                c.status == OK
                for r in report.rounds
                for c in r.checks
                if c.name in ("hash chain link", ATTESTED, WITHIN_MAX_ROUNDS)
            )
            assert all(len(r.attesters) == quorum for r in report.rounds)
            assert chain_items_ok and counts[FAIL] == 0, [
                c.line() for c in report.all_checks() if c.status == FAIL
            ]
            return {
                "rounds": rounds,
                "quorum": quorum,
                "verdict_without_evidence": report.verdict,
                "commit_all_seconds": round(commit_seconds, 2),
                "read_history_seconds": report.timings["read_history_s"],
                "chain_checks_seconds": report.timings["chain_checks_s"],
                "chain_part_seconds": report.timings["chain_total_s"],
                "audit_wall_seconds_no_evidence": round(wall, 3),
                "items": counts,
                "target_seconds": 5.0,
                "within_target": report.timings["chain_total_s"] <= 5.0,
            }
        finally:
            anvil.stop()


def replay_part(preset: str, rounds: int) -> dict:
    from node.commands.launcher import LocalRun

    settings = [
        f"model.preset={preset}",
        "diloco.inner_steps=4",
        "training.batch_size=4",
        "round_timeout=120",
        "checkpoint_every=1",
        f"rounds={rounds}",
        "join_timeout=60",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        run = LocalRun(Path(tmp), replicas=2, stages=2, split=False, settings=settings)
        try:
            run.setup()
            started = time.perf_counter()
            run.start()
            if not run.wait(900):
                raise SystemExit("the short run did not finish; see the node logs")
            run_seconds = time.perf_counter() - started
            report = audit_run(run.client(), run.run_id, archives=[s.data_dir for s in run.nodes])
        finally:
            run.stop()
    assert report.verdict == PASSED and report.counts()[UNVERIFIABLE] == 0, [
        c.line() for c in report.all_checks() if c.status != OK
    ]
    from training.config import MODEL_PRESETS

    return {
        "preset": preset,
        "model": MODEL_PRESETS[preset],
        "replicas": 2,
        "stages": 2,
        "rounds": rounds,
        "run_seconds": round(run_seconds, 1),
        "replay_seconds_per_round": [r.replay_seconds and round(r.replay_seconds, 4) for r in report.rounds],
        "replay_mean_seconds_per_round": report.timings.get("replay_mean_s_per_round"),
        "audit_total_seconds": report.timings["total_s"],
        "all_rounds_ok": all(r.status == OK for r in report.rounds),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--quorum", type=int, default=3, help="members of the run, all signing every round")
    parser.add_argument(
        "--replay-preset",
        action="append",
        choices=["tiny", "mini", "small"],
        help="model preset of the short run (repeatable; default tiny)",
    )
    parser.add_argument("--replay-rounds", type=int, default=3)
    parser.add_argument("--no-run", action="store_true", help="skip the real short run (replay cost)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "audit.json"))
    args = parser.parse_args()
    result = {
        "benchmark": "audit",
        "command": "python bench/bench_audit.py " + " ".join(sys.argv[1:]),
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
        "chain_part": chain_part(args.rounds, args.quorum),
    }
    print(json.dumps(result["chain_part"], indent=1))
    previous = Path(args.out)
    if args.no_run and previous.exists():
        old = json.loads(previous.read_text())
        if "replay" in old:
            result["replay"] = old["replay"]
            result["replay_from_previous_command"] = old.get("replay_from_previous_command",
                                                             old.get("command"))
    if not args.no_run:
        result["replay"] = []
        for preset in args.replay_preset or ["tiny"]:
            result["replay"].append(replay_part(preset, args.replay_rounds))
            print(json.dumps(result["replay"][-1], indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
