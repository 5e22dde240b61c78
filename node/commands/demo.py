"""``dlx-node demo``: the README's main job.

A managed anvil, the contracts deployed, ``replicas x stages`` node processes
on loopback training a small GPT-2 with DiLoCoX, a live progress table, and a
summary read back from the chain: rounds, held-out loss per round, bytes sent
vs. what data-parallel AllReduce would have sent, and where the checkpoint is.

SIGINT and SIGTERM stop the demo in order: the node processes get SIGTERM
(each finishes its round bookkeeping and writes its state; SIGKILL after 20 s),
then anvil gets SIGTERM (it dumps ``chain-state.json``). Stopped during
training, the demo exits with 128 + the signal number (130, 143); after
training, with ``--keep``, a signal is the way to end it and it exits with 0.
Further signals during that stop are ignored, so it is never cut short.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from node.commands.launcher import LocalRun
from node.commands.liveview import LiveView
from node.config import load_config
from node.errors import ConfigError, NodeError
from training.config import LEGACY_OPTIMIZER

#: How the summary names an inner optimizer (training.optimizer's values).
OPTIMIZER_NAMES = {"adamw": "AdamW", "muon": "Muon"}

logger = logging.getLogger(__name__)


class _Stopped(Exception):
    """A SIGINT or SIGTERM arrived while the demo could be interrupted."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


class _Signals:
    """SIGINT/SIGTERM handling of the demo: the first signal raises :class:`_Stopped` in the main thread
    (unless the demo is already stopping); any later one is only reported."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.interruptible = True

    def handle(self, signum: int, _frame) -> None:
        first = self.received is None
        if first:
            self.received = signum
        if first and self.interruptible:
            raise _Stopped(signum)
        print(f"dlx-node demo: signal {signum}: already stopping (nodes, then the chain)", file=sys.stderr,
              flush=True)

    @contextmanager
    def installed(self) -> Iterator[_Signals]:
        previous = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


#: The demo's quorum fraction of the members in force, in basis points (its floor is --attest-quorum).
DEMO_QUORUM_BPS = 5000

#: The training benchmark's one current result (bench/bench_diloco.py): DiLoCoX against centralized
#: training at a real token budget, printed beside the demo's own short-run figure.
BENCHMARK_RESULT = Path(__file__).resolve().parents[2] / "bench" / "results" / "diloco.json"


def _dataset_model_settings(directory: Path) -> list[str]:
    """The model settings a prepared dataset (``dlx-node data prepare``) needs: its vocabulary and tokenizer."""
    from training.errors import ShardError
    from training.shards import TOKENIZER_NAME
    from training.sharded_corpus import read_manifest

    try:
        _, manifest = read_manifest(directory)
    except ShardError as exc:
        raise ConfigError(f"--data {directory}: {exc}") from None
    settings = [f"model.vocab_size={manifest.vocab_size}"]
    if manifest.tokenizer != "bytes":
        settings.append(f"model.tokenizer={directory / TOKENIZER_NAME}")
    return settings


def run_demo(args: argparse.Namespace) -> int:
    if args.replicas < 1 or args.stages < 1 or args.rounds < 1 or args.inner_steps < 1:
        raise ConfigError("--replicas, --stages, --rounds and --inner-steps must all be >= 1")
    data, model_settings = "", []
    if args.data:
        path = Path(args.data).expanduser().resolve()
        if path.is_dir():
            model_settings = _dataset_model_settings(path)
        elif not path.is_file():
            raise ConfigError(f"--data {args.data}: no such file or prepared dataset directory")
        data = str(path)
    settings = [f"model.preset={args.preset}", f"rounds={args.rounds}", f"diloco.inner_steps={args.inner_steps}",
                f"checkpoint_every={args.checkpoint_every}", f"training.data_path={data}", "round_timeout=120",
                *model_settings]
    if getattr(args, "spot_checks", None) is not None:
        settings.append(f"spot_checks={args.spot_checks}")
    shape = [f"pipeline.num_stages={args.stages}", f"diloco.num_replicas={args.replicas}"]
    settings += _budget_settings(args, settings + shape)
    cpu_limits = _throttled(args)
    load_config(None, settings + shape)
    out = Path(args.out).resolve()
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {out} is not empty: pick a new directory (a demo starts a fresh chain)")
    nodes = args.replicas * args.stages
    if not 1 <= args.attest_quorum <= nodes:
        raise ConfigError(f"--attest-quorum={args.attest_quorum}: must be in [1, {nodes}] (the number of nodes)")
    weak = args.attest_quorum < 2 or args.stake == 0
    if weak and not args.weak_run:
        raise ConfigError(f"--attest-quorum={args.attest_quorum} --stake={args.stake:g}: below the security "
                          "model's floor (k >= 2 counted signatures, a nonzero stake); pass --weak-run to accept "
                          "that one member commits and slashes alone (docs/TRUST.md)")
    if args.stake < 0:
        raise ConfigError(f"--stake={args.stake}: must be >= 0")
    from node.anvil import locate_anvil

    locate_anvil(required=True)  # the demo's chain: say how to get anvil before anything starts
    # The run's unbonding is LocalRun's default: the contract's floor (accusation deadline + dispute window),
    # never 0, so a member cannot leave and withdraw before a report lands.
    # The quorum grows with the run: max(--attest-quorum, half the members in force), so a few seats bought
    # into a larger run are never a quorum (docs/LEDGER.md).
    run = LocalRun(out, replicas=args.replicas, stages=args.stages, split=args.stages > 1, settings=settings,
                   attest_quorum=args.attest_quorum, attest_quorum_bps=DEMO_QUORUM_BPS,
                   stake_wei=int(args.stake * 10**18), allow_weak_quorum=weak, cpu_limits=cpu_limits)
    print(_headline(args, data, cpu_limits))
    view = LiveView()

    signals = _Signals()
    ok = keeping = False
    seeder = None
    stopped_by: int | None = None
    with signals.installed():
        try:
            ok = _train_and_report(run, args, out, view)
            if args.keep:
                keeping = True
                seeder = _keep_serving(run, out)
                while run.anvil is not None and run.anvil.running():
                    time.sleep(1)
        except _Stopped as stopped:
            signals.interruptible = False
            stopped_by = stopped.signum
            if not keeping:
                print(f"dlx-node demo: signal {stopped_by}: stopping the nodes, then the chain",
                      file=sys.stderr, flush=True)
        finally:
            signals.interruptible = False
            view.close()
            if seeder is not None:
                seeder.close()
            run.stop()
    if stopped_by is not None and not keeping:
        print(f"dlx-node demo: stopped; node data, logs and chain-state.json in {out}", file=sys.stderr, flush=True)
        return 128 + stopped_by
    if not ok:
        logs = ", ".join(str(s.log_path) for s in run.nodes)
        raise NodeError(f"demo did not finish cleanly; node logs: {logs}")
    return 0


def _headline(args: argparse.Namespace, data: str, cpu_limits: dict[int, float]) -> str:
    budget = (f" bounded by {args.round_budget:g} s (each replica declares the inner steps that fit)"
              if getattr(args, "round_budget", 0) else "")
    slowed = (f"; replica {args.replicas - 1} limited to {args.throttle:g} CPU (cgroup cpu quota)"
              if cpu_limits else "")
    return (f"dlx-node demo: {args.replicas} replicas x {args.stages} stages, model '{args.preset}', "
            f"{args.rounds} outer rounds of H={args.inner_steps}{budget}, data: {data or 'generated corpus'}{slowed}")


def _budget_settings(args: argparse.Namespace, settings: list[str]) -> list[str]:
    """``--round-budget S`` (and ``--min-inner-steps``): rounds bounded by time (docs/DILOCOX.md section 13);
    the fewest steps default to one more than the exchange overlaps, the least the run allows."""
    budget = getattr(args, "round_budget", 0.0) or 0.0
    least = getattr(args, "min_inner_steps", None)
    if budget <= 0:
        if budget < 0 or least is not None:
            raise ConfigError("--round-budget must be > 0 seconds (and --min-inner-steps needs it)")
        return []
    if least is None:
        least = load_config(None, settings).diloco.overlap + 1
    return [f"diloco.round_budget_s={budget}", f"diloco.min_inner_steps={least}"]


def _throttled(args: argparse.Namespace) -> dict[int, float]:
    """``--throttle CPUS``: the last replica's node processes share a cgroup v1 cpu quota of CPUS CPUs, a slow
    contributor on this machine (node/commands/throttle.py; needs root)."""
    cpus = getattr(args, "throttle", None)
    if cpus is None:
        return {}
    from node.commands.throttle import unavailable

    if not cpus > 0:
        raise ConfigError(f"--throttle {cpus}: must be a positive number of CPUs")
    if args.replicas < 2:
        raise ConfigError("--throttle slows the last of several replicas: give --replicas 2 or more")
    reason = unavailable()
    if reason is not None:
        raise ConfigError(f"--throttle needs root and the cgroup v1 cpu controller: {reason}")
    return {args.replicas - 1: cpus}


def _keep_serving(run: LocalRun, out: Path):
    """``--keep``: the nodes have ended; a seeder serves their archives over libp2p (node/commands/seeder.py), and
    the commands that pull a checkpoint through it and watch the run are printed."""
    from node.commands.link import run_link
    from node.commands.seeder import ArchiveSeeder

    from node.errors import DLX_ERRORS

    try:
        seeder = ArchiveSeeder.start([slot.data_dir for slot in run.nodes], run.run_id)
    except DLX_ERRORS as exc:  # the run is done and on chain: say how to pull without peers, go on
        archives = " ".join(f"--archive {slot.data_dir}" for slot in run.nodes)
        print(f"\nthe chain stays up at {run.url}; the seeder did not start ({exc}): pull from the archives with\n"
              f"  dlx-node pull --rpc {run.url} --run {run.run_id} --deployment {out / 'deployment.json'} "
              f"{archives} {out / 'model'} --pending", flush=True)
        return None
    checkpoint_every = load_config(run.nodes[0].config_path).checkpoint_every
    link = run_link(run.chain_id, run.ledger, run.run_id, run.url, [seeder.multiaddr],
                    checkpoint_every=checkpoint_every)
    print(f"\nthe chain stays up at {run.url}, and a seeder serves the nodes' checkpoints and archives at "
          f"{seeder.multiaddr}; Ctrl-C (or SIGTERM) stops both", flush=True)
    # The demo's chain mines a block per transaction only, so its last rounds stay inside their dispute window:
    # pull takes only final rounds unless --pending says it may take one that can still be disputed.
    print(f"pull the latest checkpoint the chain vouches for (--pending: the demo's last rounds are still inside "
          f"their dispute window, which a public chain closes as blocks pass):\n"
          f"  dlx-node pull '{link}' {out / 'model'} --pending", flush=True)
    print(f"watch the run in a browser:\n  dlx-node explorer --rpc {run.url} --run {run.run_id} --deployment "
          f"{out / 'deployment.json'}", flush=True)
    return seeder


def _train_and_report(run: LocalRun, args: argparse.Namespace, out: Path, view: LiveView) -> bool:
    """Start the chain and the nodes, wait for them, print and write the summary; True if all exited 0."""
    run.setup()
    print(f"chain: anvil (pid {run.anvil.pid}) at {run.url}, registry {run.registry}, ledger {run.ledger}, "
          f"run {run.run_id}", flush=True)
    print(f"run link (dlx-node join): {run.link(peers=2)}", flush=True)
    run.start()
    ok = run.wait(args.timeout, on_tick=view.tick)
    view.tick(run, force=True)
    view.close()
    summary = summarize(run)
    if getattr(args, "round_budget", 0) and getattr(args, "reference", True):
        print("no centralized reference: it trains H steps a round, not the tokens a time-bounded run declared",
              flush=True)
    elif getattr(args, "reference", True) and summary["rounds"]:
        print("training the centralized reference on the same tokens (skip with --no-reference) ...", flush=True)
        summary["centralized_reference_eval_loss"] = centralized_reference_loss(run, len(summary["rounds"]))
        summary["benchmark"] = benchmark_figure(BENCHMARK_RESULT)
    print(format_summary(summary), flush=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return ok


def centralized_reference_loss(run: LocalRun, rounds: int) -> float:
    """Held-out loss of data-parallel training (the run's inner optimizer) on the same tokens, schedule and eval
    batches as the run.

    :func:`training.simulate.centralized_reference` (the benchmark's DDP mode) on the
    run's own settings: what the demo's DiLoCoX loss should be read against.
    """
    from dataclasses import replace

    from training.data import corpus_from_config
    from training.simulate import centralized_reference

    cfg = load_config(run.nodes[0].config_path)
    training_cfg = cfg.training
    if training_cfg.data_path:
        training_cfg = replace(training_cfg, data_path=str(cfg.path(training_cfg.data_path)))
    corpus = corpus_from_config(training_cfg, cfg.model)
    quiet = logging.getLogger("training.simulate")  # its per-round lines would interleave with the summary
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        return centralized_reference(corpus, cfg.model, cfg.training, cfg.diloco, cfg.pipeline, rounds)
    finally:
        quiet.setLevel(level)


def benchmark_figure(path: Path) -> dict:
    """DiLoCoX against DDP in the training benchmark's current result at ``path``, read at run time.

    Returns ``{"path", "loss_vs_ddp", "fewer_bytes", "tokens", "rounds", "inner_steps", "data"}``, or
    ``{"path", "missing": reason}`` when the file is absent (an installed package has no bench/) or
    is not a bench_diloco.py result with both modes; the demo then says so instead of a figure.
    """
    try:
        result = json.loads(path.read_text())
        x = result["summary"]["diloco_x"]
        settings = result["args"]
        figure = {"path": str(path), "loss_vs_ddp": float(x["loss_vs_ddp"]),
                  "fewer_bytes": float(x["fewer_bytes_than_ddp"]),
                  "tokens": int(max(point["tokens"] for point in x["curve"])),
                  "rounds": int(settings["rounds"]), "inner_steps": int(settings["inner_steps"]),
                  "data": Path(str(settings["data"])).parent.name or str(settings["data"]),
                  # A result recorded before bench_diloco.py had --optimizer trained with AdamW.
                  "optimizer": str(settings.get("optimizer", LEGACY_OPTIMIZER))}
    except FileNotFoundError:
        return {"path": str(path), "missing": "not found (run bench/bench_diloco.py from a clone)"}
    except (OSError, ValueError, KeyError, TypeError) as exc:  # not a bench_diloco.py result with DDP and DiLoCoX
        return {"path": str(path), "missing": f"unreadable ({type(exc).__name__}: {exc})"}
    return figure


def summarize(run: LocalRun) -> dict:
    """Read the run back from the chain and the nodes' status files."""
    from ledger.records import from_micro
    from training.model import count_params

    client = run.client()
    history = client.history(run.run_id)
    cfg = load_config(run.nodes[0].config_path)
    params = count_params(cfg.model)
    rounds = [{"round": c.commit.round, "eval_loss": from_micro(c.commit.eval_loss_micro),
               "train_loss": from_micro(c.commit.train_loss_micro), "contributors": c.commit.num_contributors,
               "weights_root": c.commit.weights_root.hex(), "attesters": list(c.attesters),
               "tokens": c.commit.tokens}
              for c in history.commits]
    sent = sum(slot.status().get("bytes_sent", 0) for slot in run.nodes)
    # Pseudo-gradient traffic alone: every archived contribution envelope, counted once, is
    # fetched by the M-1 other replicas' holders of its stage.
    envelopes = {}
    for slot in run.nodes:
        for path in (slot.data_dir / "archive").glob("run-*/round-*/*.env"):
            envelopes[path.name] = path.stat().st_size
    exchange = sum(envelopes.values()) * max(0, run.replicas - 1)
    # Ring AllReduce of fp32 gradients every inner step: 2 (M-1)/M x model bytes per replica per step.
    m = run.replicas
    steps = len(rounds) * cfg.diloco.inner_steps
    # What the records count: H per contribution with fixed H, what each declared in a time-bounded run.
    tokens = sum(r["tokens"] for r in rounds) if cfg.diloco.budgeted else \
        steps * m * cfg.training.batch_size * cfg.model.block_size
    allreduce = int(2 * (m - 1) / m * params * 4 * steps * m) if m > 1 else 0
    checkpoints = [{"round": c.round, "content_hash": c.content_hash.hex(), "uri": c.uri}
                   for c in history.checkpoints]
    latest = checkpoints[-1] if checkpoints else None
    ckpt_path = None
    if latest is not None:
        for slot in run.nodes:
            p = slot.data_dir / "checkpoints" / f"round-{latest['round']:08d}.safetensors"
            if p.exists():
                ckpt_path = str(p)
                break
    # Re-execution spot checks of other replicas' rounds, per node (node/live/verifier.py; status.json).
    spot_checks = {}
    for slot in run.nodes:
        status = slot.status()
        spot_checks[slot.name] = {key: status.get(key, 0) for key in (
            "spot_checks", "spot_check_mismatches", "spot_checks_not_done", "spot_check_seconds", "chain_checks")}
    return {
        "spot_checks": spot_checks, "accusations": len(history.accusations),
        "run_id": run.run_id, "attest_quorum": history.run.quorum, "stake_wei": history.run.min_stake,
        "unbonding_blocks": history.run.unbonding_blocks,
        "members": len({m.account for m in history.memberships}),
        "rpc_url": run.url, "registry": run.registry, "ledger": run.ledger,
        "model_params": params, "rounds": rounds, "bytes_sent_all_nodes": sent,
        "pseudo_gradient_bytes": exchange, "inner_steps": cfg.diloco.inner_steps, "tokens": tokens,
        "round_budget_s": cfg.diloco.round_budget_s, "optimizer": cfg.training.optimizer,
        "tokens_per_step": cfg.training.batch_size * cfg.model.block_size,
        "data": "a generated corpus" if not cfg.training.data_path else Path(cfg.training.data_path).name,
        "allreduce_bytes_equivalent": allreduce, "checkpoints": checkpoints, "latest_checkpoint_file": ckpt_path,
        "disputes": len(history.disputes), "workdir": str(run.workdir),
        "node_dirs": [str(slot.data_dir) for slot in run.nodes],
    }


def _benchmark_lines(s: dict) -> list[str]:
    """What the demo's gap means: a few short rounds, beside the benchmark's figure at a real budget."""
    demo = (f"  this demo is {len(s['rounds'])} short rounds of H={s['inner_steps']} ({s.get('tokens', 0):,} tokens) "
            f"on {s.get('data', 'its data')}: a check that the system works, not a measure of the method;")
    bench = s.get("benchmark")
    if not bench:
        return [demo]
    if "missing" in bench:
        return [demo, f"  the training benchmark's result {bench['path']}: {bench['missing']}"]
    measured = (f"  at a real budget ({bench['tokens']:,} tokens of {bench['data']}, {bench['rounds']} rounds of "
                f"H={bench['inner_steps']}) DiLoCoX is {100 * bench['loss_vs_ddp']:+.1f}% against centralized "
                f"{OPTIMIZER_NAMES.get(bench.get('optimizer'), bench.get('optimizer'))} "
                f"with {bench['fewer_bytes']:.0f}x fewer bytes ({bench['path']}, from bench/bench_diloco.py)")
    return [demo, measured]


def format_summary(s: dict) -> str:
    lines = ["", (f"run {s['run_id']}: {len(s['rounds'])} rounds committed on chain ({s['model_params']:,} parameters), "
                  f"each signed by at least {s['attest_quorum']} of the run's {s['members']} staked members "
                  f"({s['stake_wei'] / 1e18:g} ETH each, unbonding {s['unbonding_blocks']} blocks)"),
             "  round  held-out  train   contributors  attesters  inner steps  weights root"]
    for r in s["rounds"]:
        steps = r.get("tokens", 0) // max(1, s.get("tokens_per_step", 1))  # of every contributor together
        lines.append(f"  {r['round']:>5}  {r['eval_loss']:8.4f}  {r['train_loss']:6.4f}  {r['contributors']:>12}  "
                     f"{len(r['attesters']):>9}  {steps:>11}  {r['weights_root'][:16]}")
    allreduce = s["allreduce_bytes_equivalent"]
    exchange = s["pseudo_gradient_bytes"]
    reference = s.get("centralized_reference_eval_loss")
    if reference is not None and s["rounds"]:
        final = s["rounds"][-1]["eval_loss"]
        optimizer = OPTIMIZER_NAMES.get(s.get("optimizer"), s.get("optimizer"))
        lines.append(f"held-out loss {final:.4f}; centralized data-parallel {optimizer} on the same tokens: {reference:.4f} "
                     f"({100 * (final / reference - 1):+.1f}%)")
        lines.extend(_benchmark_lines(s))
    lines.append(f"pseudo-gradients exchanged: {exchange / 1e6:.2f} MB; data-parallel AllReduce of fp32 gradients "
                 f"every step would have sent {allreduce / 1e6:.2f} MB "
                 f"({allreduce / exchange if exchange else float('nan'):.0f}x more, H={s['inner_steps']})")
    lines.append(f"all traffic of all nodes (gossip, contributions, checkpoint shards and copies): "
                 f"{s['bytes_sent_all_nodes'] / 1e6:.2f} MB")
    lines.append(f"checkpoints on chain: {len(s['checkpoints'])}; latest: "
                 f"{s['checkpoints'][-1] if s['checkpoints'] else 'none'}")
    lines.append(f"checkpoint file: {s['latest_checkpoint_file']}")
    if s.get("spot_checks"):
        checks = ", ".join(f"{name} {c['spot_checks']} ({c['spot_check_mismatches']} mismatches, "
                           f"{c['spot_checks_not_done']} not done, {c['spot_check_seconds']:.0f} s)"
                           for name, c in s["spot_checks"].items())
        lines.append(f"spot checks (another replica's round re-executed): {checks}; accusations: "
                     f"{s.get('accusations', 0)}")
    lines.append(f"disputes: {s['disputes']}; node data, logs and deployment.json in {s['workdir']}")
    archives = " ".join(f"--archive {p}" for p in s.get("node_dirs", []))
    lines.append(f"audit it (with --keep, while the chain runs):\n  dlx-node audit --rpc {s['rpc_url']} "
                 f"--run {s['run_id']} --deployment {s['workdir']}/deployment.json {archives}")
    return "\n".join(lines)
