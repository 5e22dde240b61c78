"""Byzantine members in real runs: one attacker among the replicas, one run per attack.

    python bench/bench_byzantine.py [--replicas 4] [--rounds 8] [--inner-steps 20] [--attacks a,b,...]
                                    [--exchange sliced]

Each run is a real local run (anvil, ``--replicas`` one-node clusters of the
``mini`` model on tinyshakespeare) in which the last replica is the tests'
adversary harness (``tests/adversary.py``: the real node with one behaviour
patched), plus one honest run with the same seeds. For every run it records:
which nodes exited and how, the rounds committed and how many contributors
each held, how often the attacker's contributions were excluded (from the
honest nodes' archives), ``dlx-node audit``'s verdict, and the held-out loss
of the final global weights (the last checkpoint, evaluated on the run's eval
batches) against the honest run's. Writes bench/results/byzantine.json.

Goals (issue 12): no honest node exits in any run; every malicious
contribution is excluded or its harm bounded; final held-out loss within 5% of
the honest run for every attack; the audit passes on every run.

``--exchange sliced`` (issue 33) runs the same with ``diloco.exchange = "sliced"``:
the sliced exchange's own attacks (``tests/sliced_adversary.py``: withholding,
wrong partials, bad slices and references, and the forged contributions cut
into slices) plus the full exchange's attacks on closes and hellos, which do not
depend on the exchange; it writes bench/results/byzantine_sliced.json. There
the audit (of every node's archive: a holder archives only the bundles it
read) passes or names the attacker (a wrong partial is applied alike and
caught after the fact, or accused by the holders' spot checks of partials).
``--reexecute all`` makes the audit rerun every contribution and judge every
ejection (a sliced proof by the members' rule: node/tools/audit_slicedproof.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.benchio import default_corpus, write_result  # noqa: E402
from node.commands.launcher import LocalRun  # noqa: E402
from node.config import load_config  # noqa: E402

ADVERSARY = [sys.executable, str(ROOT / "tests" / "adversary.py")]
SLICED_ADVERSARY = [sys.executable, str(ROOT / "tests" / "sliced_adversary.py")]
SLICED_ATTACKS = ("withhold", "wrong-root", "wrong-blob", "two-partials", "bad-slice", "bad-reference",
                  "slices-malformed", "slices-huge-1e3", "slices-huge-1e6", "slices-sign-flip",
                  "slices-noise", "slices-stale", "slices-zero", "slices-copy")
DEFAULT_SLICED_ATTACKS = (*SLICED_ATTACKS, "late", "empty-close", "duplicate-close", "equivocating-close",
                          "censoring-close", "absurd-hello", "first-cluster")
DEFAULT_ATTACKS = ("malformed-payload", "huge-1e3", "huge-1e6", "sign-flip", "noise", "stale", "zero", "copy",
                   "late", "empty-close", "duplicate-close", "equivocating-close", "censoring-close",
                   "absurd-hello", "first-cluster")
#: Attacks that are a configuration, not patched behaviour: the real node with that setting.
CONFIG_ATTACKS = {"first-cluster": ("cluster", "0-sorts-first")}
#: The corpus (``--data``; default tinyshakespeare as ``dlx-node data fetch tinyshakespeare`` keeps it).
DATA = ""


def held_out_loss(node_cfg_path: Path, checkpoint: Path) -> float:
    """Held-out loss of a checkpoint's global weights on the run's eval batches."""
    from dataclasses import replace

    from node.store.checkpoint import read_checkpoint
    from training.data import corpus_from_config, eval_batches
    from training.pipeline import LocalReplicaTrainer

    cfg = load_config(node_cfg_path)
    training_cfg = cfg.training
    if training_cfg.data_path:
        training_cfg = replace(training_cfg, data_path=str(cfg.path(training_cfg.data_path)))
    corpus = corpus_from_config(training_cfg, cfg.model)
    weights = read_checkpoint(checkpoint).weights
    trainer = LocalReplicaTrainer(cfg.model, cfg.training, cfg.pipeline.num_stages, state_dict=weights)
    return trainer.eval_loss(eval_batches(corpus, cfg.training.eval_batches, cfg.training.batch_size,
                                          cfg.model.block_size))


def excluded_from_archive(slot, attacker_peer: str) -> dict:
    """Rounds in which an honest node's sealed archive holds / lacks the attacker's contributions."""
    held, rounds, excluded, reasons = 0, 0, 0, set()
    for sealed in sorted((slot.data_dir / "archive").glob("run-*/round-*/round.json")):
        doc = json.loads(sealed.read_text())
        entries = doc.get("contributions", [])  # [stage, replica, peer id, hash]
        rounds += 1
        held += any(entry[2] == attacker_peer for entry in entries)
        # [stage, replica, peer id, hash, reason, detail] of what the aggregation left out
        mine = [entry for entry in doc.get("excluded", []) if entry[2] == attacker_peer]
        excluded += bool(mine)
        reasons.update(entry[4] for entry in mine)
    evidence = len(list((slot.data_dir / "evidence").glob("*.envelope")))
    return {"rounds_sealed": rounds, "rounds_with_attacker": held, "rounds_attacker_excluded": excluded,
            "exclusion_reasons": sorted(reasons), "evidence_files": evidence}


def one_run(workdir: Path, attack: str | None, args) -> dict:
    settings = [
        f"model.preset={args.preset}", f"diloco.inner_steps={args.inner_steps}", f"rounds={args.rounds}",
        f"checkpoint_every={args.rounds}", "join_timeout=120", f"round_timeout={args.round_timeout}",
        f"training.data_path={DATA}",
    ]
    if args.exchange == "sliced":
        settings += ["diloco.exchange=sliced", f"p2p.transfer_timeout={args.transfer_timeout}",
                     f"spot_checks={args.spot_checks}"]
    run = LocalRun(workdir, replicas=args.replicas, stages=1, split=False, settings=settings,
                   attest_quorum=args.attest_quorum)
    run.setup()
    attacker = run.nodes[-1]
    if attack in CONFIG_ATTACKS:  # e.g. a new cluster whose name sorts before every other
        key, value = CONFIG_ATTACKS[attack]
        text = attacker.config_path.read_text()
        lines = [f'{key} = "{value}"' if line.startswith(f"{key} = ") else line for line in text.splitlines()]
        attacker.config_path.write_text("\n".join(lines) + "\n")
    elif attack in SLICED_ATTACKS:
        attacker.command = [*SLICED_ADVERSARY, attack]
    elif attack is not None:
        attacker.command = [*ADVERSARY, attack]
    started = time.monotonic()
    run.start()
    honest = run.nodes[:-1] if attack is not None else run.nodes
    charged = None
    try:
        run.wait(args.timeout)
        charged = accusations(run, attacker) if attack is not None else None
    finally:
        run.stop()
    seconds = time.monotonic() - started
    exits = {slot.name: slot.process.returncode for slot in run.nodes}
    result = {"attack": attack or "honest", "attest_quorum": args.attest_quorum, "seconds": round(seconds, 1),
              "exit_codes": exits,
              "honest_exits_nonzero": [s.name for s in honest if s.process.returncode != 0]}
    state = json.loads((honest[0].data_dir / "state.json").read_text())
    result["rounds_finished"] = state.get("last_finished", -1) + 1
    checkpoint = honest[0].data_dir / "checkpoints" / f"round-{args.rounds - 1:08d}.safetensors"
    result["held_out"] = held_out_loss(honest[0].config_path, checkpoint) if checkpoint.exists() else None
    if attack is not None:
        result["archive"] = excluded_from_archive(honest[0], attacker.peer_id)
    # A sliced run's holders archive only their own bundles and the inputs they fetched, so the auditor
    # reads every member's archive, the attacker's too: docs/PROTOCOL.md, "What an auditor replays" (an
    # archive only supplies bytes that the signed record binds). The full exchange: one holder's.
    audit_lines = audit(run, run.nodes if args.exchange == "sliced" else honest[:1], result, args.reexecute)
    if attack is not None:
        result["audit"]["names_attacker"] = names_attacker(audit_lines, attacker.peer_id,
                                                           (charged or {}).get("account"))
        result["accusations"] = charged
    return result


def names_attacker(tail: list[str], peer_id: str, account: str | None) -> bool:
    """Whether the audit's lines name the attacker: a FAIL that names its peer id, or an accusation of its
    account (or its slashing) that the audit lists (not one it opened against another member)."""
    marks = [peer_id.lower()] + ([f"accusation of {account}".lower(), f"member {account} slashed".lower()]
                                 if account else [])
    return any(mark in line.lower() for line in tail for mark in marks)


def accusations(run: LocalRun, attacker) -> dict:
    """Accusations on the run's chain against the attacker, and how they ended (the chain still running)."""
    from ledger.account import dev_account

    try:
        client = run.client()
        history = client.history(run.run_id)
        account = dev_account(attacker.account, client.chain_id).address.lower()
        against = [a for a in history.accusations if a.accused.lower() == account]
        return {"opened": len(against), "guilty": sum(bool(a.guilty) for a in against),
                "others_accused": len(history.accusations) - len(against),
                "slashed": any(s.account.lower() == account for s in history.slashings), "account": account}
    except Exception as exc:  # noqa: BLE001 - a bench records what it could not read
        return {"error": str(exc)}


def audit(run: LocalRun, slots, result: dict, reexecute: str | None = None) -> list[str]:
    """``dlx-node audit`` of the run against a chain restarted from its state file (with ``--reexecute``
    if given): its exit code and last lines go to ``result["audit"]``; returns every line it printed."""
    from ledger.anvil import AnvilProcess

    anvil = AnvilProcess(state_file=run.workdir / "chain-state.json")
    url = anvil.start()
    try:
        deployment = json.loads((run.workdir / "deployment.json").read_text())
        out = subprocess.run(
            [sys.executable, "-m", "node.cli", "audit", "--rpc", url, "--ledger", deployment["ledger"],
             "--registry", deployment["registry"], "--run", str(run.run_id),
             *[arg for slot in slots for arg in ("--archive", str(slot.data_dir))], "--data", str(DATA),
             "--json", str(run.workdir / "audit.json"), *(["--reexecute", reexecute] if reexecute else [])],
            capture_output=True, text=True, timeout=1800, cwd=ROOT)
    finally:
        anvil.stop()
    lines = (out.stdout + out.stderr).strip().splitlines()
    result["audit"] = {"exit_code": out.returncode, "tail": lines[-12:]}
    if reexecute:
        result["audit"]["reexecution"] = reexecution_summary(run.workdir / "audit.json")
    return lines


def reexecution_summary(report_path: Path) -> dict:
    """What ``--reexecute`` found (the audit's JSON report): reruns per status, and each guilty ejection's
    check (a sliced proof's judgement or an evidence rerun) with its status and reason."""
    try:
        general = json.loads(report_path.read_text()).get("general", [])
    except (OSError, ValueError) as exc:
        return {"error": str(exc)}
    reruns: dict[str, int] = {}
    for check in general:
        if check["name"].startswith("re-execution of round"):
            reruns[check["status"]] = reruns.get(check["status"], 0) + 1
    ejections = [{"status": c["status"], "reason": c["reason"][:300]} for c in general
                 if c["name"].startswith("ejection of")]
    return {"reruns": reruns, "ejections": ejections}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="mini")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--round-timeout", type=float, default=60.0)
    parser.add_argument("--attest-quorum", type=int, default=2,
                        help="member signatures a round's record needs (k); with k = 1 the attacker alone "
                             "can commit a record")
    parser.add_argument("--timeout", type=float, default=1200.0, help="bound on one run (seconds)")
    parser.add_argument("--attacks", default=None,
                        help="comma-separated (default: every attack of the exchange)")
    parser.add_argument("--exchange", choices=("full", "sliced"), default="full")
    parser.add_argument("--transfer-timeout", type=float, default=20.0, help="p2p.transfer_timeout (sliced)")
    parser.add_argument("--spot-checks", type=float, default=0.06, help="spot_checks (sliced: of partials)")
    parser.add_argument("--reexecute", default=None,
                        help="the audit's --reexecute (N or all): rerun contributions "
                        "and judge every ejection's evidence (default: no re-execution)")
    parser.add_argument("--workdir", default="/tmp/dlx-bench-byzantine")
    parser.add_argument("--data", default=None,
                        help="the training text (default: tinyshakespeare as 'dlx-node data fetch "
                             "tinyshakespeare' keeps it, fetched if missing)")
    parser.add_argument("--out", default=None, help="default bench/results/byzantine.json, "
                        "byzantine_sliced.json with --exchange sliced")
    parser.add_argument("--append", action="store_true", help="add to --out's runs instead of starting over "
                        "(the honest run is then not repeated)")
    args = parser.parse_args()
    global DATA
    DATA = args.data or default_corpus()
    if args.attacks is None:
        args.attacks = ",".join(DEFAULT_SLICED_ATTACKS if args.exchange == "sliced" else DEFAULT_ATTACKS)
    if args.out is None:
        args.out = str(ROOT / "bench" / "results" / ("byzantine_sliced.json" if args.exchange == "sliced"
                                                      else "byzantine.json"))
    attacks = [a for a in args.attacks.split(",") if a]
    earlier = json.loads(Path(args.out).read_text()) if args.append else {}
    results = earlier.get("runs", [])
    # An appended result keeps what each earlier part recorded (its command, date, commit, load).
    parts = [*earlier.get("earlier_parts", []), *([earlier["recorded"]] if "recorded" in earlier else [])]
    load_at_start = list(os.getloadavg())
    for attack in ([] if args.append else [None]) + attacks:
        workdir = Path(args.workdir) / (attack or "honest")
        if workdir.exists():
            import shutil

            shutil.rmtree(workdir)
        result = one_run(workdir, attack, args)
        results.append(result)
        print(json.dumps({k: v for k, v in result.items() if k != "audit"}), flush=True)
        write_result(args.out,
                     {"settings": vars(args), "runs": results, **({"earlier_parts": parts} if parts else {})},
                     load_at_start)
    honest = results[0]["held_out"]
    print(f"\n{'attack':<26} {'exits':>6} {'attacker closed in (excluded)':>30} {'held-out':>9} "
          f"{'vs honest':>9} audit (names attacker) accused/guilty")
    for r in results:
        loss = r["held_out"]
        delta = f"{100 * (loss / honest - 1):+.1f}%" if loss and honest else "n/a"
        archive = r.get("archive", {})
        seen = (f"{archive.get('rounds_with_attacker', '-')}/{archive.get('rounds_sealed', '-')} "
                f"(excl. {archive.get('rounds_attacker_excluded', '-')})")
        name = f"{r['attack']} (k={r.get('attest_quorum', 1)})"
        print(f"{name:<26} {len(r['honest_exits_nonzero']):>6} {seen:>30} "
              f"{loss if loss is None else round(loss, 4)!s:>9} {delta:>9} {r['audit']['exit_code']} "
              f"({r['audit'].get('names_attacker', '-')}) "
              f"{(r.get('accusations') or {}).get('opened', '-')}"
              f"/{(r.get('accusations') or {}).get('guilty', '-')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
