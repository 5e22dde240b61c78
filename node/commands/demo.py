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
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from node.commands.demosummary import (
    benchmark_figure,
    benchmark_result,
    centralized_reference_losses,
    strongest,
    format_summary,
    summarize,
)
from node.commands.launcher import LocalRun
from node.commands.liveview import LiveView
from node.config import load_config
from node.errors import ConfigError, NodeError
from training.config_compression import new_run_compression_settings

logger = logging.getLogger(__name__)


class _Stopped(Exception):
    """A SIGINT or SIGTERM arrived while the demo could be interrupted."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


#: Seconds after which a signal whose stop did not reach the demo's handler is delivered again.
REDELIVER_S = 1.0


class _Signals:
    """SIGINT/SIGTERM handling of the demo: a signal raises :class:`_Stopped` in the main thread while the
    demo can be interrupted; once it is stopping, any later one is only reported.

    The raise lands in whatever frame the main thread is in, and Python drops an exception raised where it
    cannot propagate (an at-fork hook such as logging's while the demo starts its node processes, a
    finalizer): it prints "Exception ignored" and the demo would run on to its end. So the signal is
    delivered again every ``REDELIVER_S`` seconds until the stop is taken (``interruptible`` cleared)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.interruptible = True
        self._timer: threading.Timer | None = None

    def handle(self, signum: int, _frame) -> None:
        if self.received is None:
            self.received = signum
        if self.interruptible:
            self._deliver_again_later()
            raise _Stopped(self.received)
        print(f"dlx-node demo: signal {signum}: already stopping (nodes, then the chain)", file=sys.stderr,
              flush=True)

    def _deliver_again_later(self) -> None:
        if self._timer is None:
            self._timer = threading.Timer(REDELIVER_S, self._deliver_again)
            self._timer.daemon = True
            self._timer.start()

    def _deliver_again(self) -> None:
        self._timer = None
        if self.interruptible and self.received is not None:
            os.kill(os.getpid(), self.received)

    @contextmanager
    def installed(self) -> Iterator[_Signals]:
        previous = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            self.interruptible = False
            if self._timer is not None:
                self._timer.cancel()
            for s, handler in previous.items():
                signal.signal(s, handler)


#: The demo's quorum fraction of the members in force, in basis points (its floor is --attest-quorum).
DEMO_QUORUM_BPS = 5000


def _dataset_model_settings(directory: Path) -> list[str]:
    """The model settings a prepared dataset (``dlx-node data prepare``) needs: its vocabulary and
    tokenizer."""
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


def _demo_settings(args: argparse.Namespace) -> tuple[list[str], str]:
    """The run's settings for the demo's arguments (its own, then ``--set``'s), checked before anything
    starts, and the data path they name ("" for the built-in corpus)."""
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
    settings = [f"model.preset={args.preset}", f"rounds={args.rounds}",
                f"diloco.inner_steps={args.inner_steps}", f"checkpoint_every={args.checkpoint_every}",
                f"training.data_path={data}", "round_timeout=120", *model_settings]
    if getattr(args, "spot_checks", None) is not None:
        settings.append(f"spot_checks={args.spot_checks}")
    shape = [f"pipeline.num_stages={args.stages}", f"diloco.num_replicas={args.replicas}"]
    settings += _budget_settings(args, settings + shape)
    # A new run's codec (issue 66, docs/DILOCOX.md section 14), as node.toml's template sets it.
    settings += new_run_compression_settings()
    settings += list(getattr(args, "overrides", None) or [])  # --set: over the demo's own settings
    if load_config(None, settings + shape).training.reproducible and args.stages > 1:
        raise ConfigError("training.reproducible = true trains a replica in one process (a replica split "
                          "over processes is refused: docs/REPRODUCIBLE.md): give --stages 1")
    return settings, data


def run_demo(args: argparse.Namespace) -> int:
    settings, data = _demo_settings(args)
    cpu_limits = _throttled(args)
    out = Path(args.out).resolve()
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {out} is not empty: pick a new directory (a demo starts a fresh chain)")
    nodes = args.replicas * args.stages
    if not 1 <= args.attest_quorum <= nodes:
        raise ConfigError(
            f"--attest-quorum={args.attest_quorum}: must be in [1, {nodes}] (the number of nodes)")
    weak = args.attest_quorum < 2 or args.stake == 0
    if weak and not args.weak_run:
        raise ConfigError(f"--attest-quorum={args.attest_quorum} --stake={args.stake:g}: below the security "
                          "model's floor (k >= 2 counted signatures, a nonzero stake); pass --weak-run to "
                          "accept that one member commits and slashes alone (docs/TRUST.md)")
    if args.stake < 0:
        raise ConfigError(f"--stake={args.stake}: must be >= 0")
    pool_eth = getattr(args, "pool_eth", 0.0)
    if not pool_eth >= 0:
        raise ConfigError(f"--pool={pool_eth}: must be >= 0 ETH a round (0: no reward pool)")
    from node.anvil import locate_anvil

    locate_anvil(required=True)  # the demo's chain: say how to get anvil before anything starts
    # The run's unbonding is LocalRun's default: the contract's floor (accusation deadline + dispute window),
    # never 0, so a member cannot leave and withdraw before a report lands.
    # The quorum grows with the run: max(--attest-quorum, half the members in force), so a few seats bought
    # into a larger run are never a quorum (docs/LEDGER.md).
    run = LocalRun(out, replicas=args.replicas, stages=args.stages, split=args.stages > 1, settings=settings,
                   attest_quorum=args.attest_quorum, attest_quorum_bps=DEMO_QUORUM_BPS,
                   stake_wei=int(args.stake * 10**18), allow_weak_quorum=weak, cpu_limits=cpu_limits,
                   allow_unpaid_proofs=getattr(args, "allow_unpaid_proofs", False),
                   init_from=getattr(args, "init_from", "") or "", pool_per_round_wei=int(pool_eth * 10**18))
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
        print(f"dlx-node demo: stopped; node data, logs and chain-state.json in {out}", file=sys.stderr,
              flush=True)
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
    model = f"from {args.init_from}" if getattr(args, "init_from", "") else f"'{args.preset}'"
    return (f"dlx-node demo: {args.replicas} replicas x {args.stages} stages, model {model}, "
            f"{args.rounds} outer rounds of H={args.inner_steps}{budget}, data: "
            f"{data or 'generated corpus'}{slowed}")


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
    """``--keep``: the nodes have ended; a seeder serves their archives over libp2p (node/commands/seeder.py),
    and the commands that pull a checkpoint through it and watch the run are printed."""
    from node.commands.link import run_link
    from node.commands.seeder import ArchiveSeeder
    from node.errors import DLX_ERRORS

    cfg = load_config(run.nodes[0].config_path)
    data = [cfg.path(cfg.training.data_path)] if cfg.training.data_path else []
    try:  # a prepared dataset (a directory) is served too: an audit through the seeder reads its batches
        seeder = ArchiveSeeder.start([slot.data_dir for slot in run.nodes], run.run_id,
                                     datasets=[d for d in data if (d / "manifest.json").is_file()])
    except DLX_ERRORS as exc:  # the run is done and on chain: say how to pull without peers, go on
        archives = " ".join(f"--archive {slot.data_dir}" for slot in run.nodes)
        print(f"\nthe chain stays up at {run.url}; the seeder did not start ({exc}): pull from the archives "
              f"with\n  dlx-node pull --rpc {run.url} --run {run.run_id} --deployment "
              f"{out / 'deployment.json'} {archives} {out / 'model'} --pending", flush=True)
        return None
    link = run_link(run.chain_id, run.ledger, run.run_id, run.url, [seeder.multiaddr],
                    checkpoint_every=cfg.checkpoint_every)
    print(f"\nthe chain stays up at {run.url}, and a seeder serves the nodes' checkpoints and archives at "
          f"{seeder.multiaddr}; Ctrl-C (or SIGTERM) stops both", flush=True)
    mined = _close_dispute_windows(run)
    if mined is not None:
        print(f"the demo's chain mines a block only per transaction: mined {mined} empty blocks, so every "
              "round's dispute and proof windows (which a public chain closes as blocks pass) are over and "
              "its rounds are final (the chain's isFinal)", flush=True)
        print(f"pull the latest checkpoint the chain vouches for:\n  dlx-node pull '{link}' {out / 'model'}",
              flush=True)
        _print_final_rewards(run)
    else:  # its rounds stay inside their dispute window: pull takes only final rounds unless --pending
        print("pull the latest checkpoint the chain vouches for (--pending: the demo's last rounds are still "
              f"inside their dispute window, which the chain closes as blocks pass):\n"
              f"  dlx-node pull '{link}' {out / 'model'} --pending", flush=True)
    print(f"watch the run in a browser:\n  dlx-node explorer --rpc {run.url} --run {run.run_id} --deployment "
          f"{out / 'deployment.json'}", flush=True)
    return seeder


def _print_final_rewards(run: LocalRun) -> None:
    """The members' earnings again once the rounds are final (claimable now: ``dlx-node rewards --claim``)."""
    from node.commands.demorewards import rewards_lines, rewards_summary
    from node.errors import DLX_ERRORS

    try:
        rewards = rewards_summary(run)
    except DLX_ERRORS as exc:  # the run and its model are fine; only this report is missing
        print(f"the reward pool could not be read: {exc}", flush=True)
        return
    if rewards is not None:
        print("\n".join(["now that its rounds are final:", *rewards_lines(rewards)]), flush=True)


def _close_dispute_windows(run: LocalRun) -> int | None:
    """On a chain that mines only on demand (the demo's anvil), mine the blocks that close the last committed
    round's windows (``anvil_mine``) until the chain calls it final (``isFinal``: its dispute and proof
    windows closed, issue 79), so a plain ``pull`` takes its rounds as final; return how many blocks, None
    where the rounds are not final (not such a chain, nothing committed, or it refused)."""
    from ledger.chain import connect_rpc
    from node.commands.chainops import mines_on_demand

    w3 = connect_rpc(run.url, wait=5)
    client = run.client()
    last = client.last_round(run.run_id)
    if not mines_on_demand(w3) or last is None:
        return None
    step, mined = client.run_info(run.run_id).dispute_blocks + 2, 0
    for _ in range(64):  # a proof window is a few dispute windows (ledger.runparams.proof_window_bound)
        if client.is_final(run.run_id, last):
            return mined
        if "error" in w3.provider.make_request("anvil_mine", [hex(step)]):
            return None
        mined += step
    return None


def _train_and_report(run: LocalRun, args: argparse.Namespace, out: Path, view: LiveView) -> bool:
    """Start the chain and the nodes, wait for them, print and write the summary; True if all exited 0."""
    run.setup()
    for line in run.reward_notes:
        print(line, flush=True)
    print(f"chain: anvil (pid {run.anvil.pid}) at {run.url}, registry {run.registry}, ledger {run.ledger}, "
          f"run {run.run_id}", flush=True)
    print(f"run link (dlx-node join, while the nodes run; --keep prints a seeder's link for after): "
          f"{run.link(peers=2)}", flush=True)
    run.start()
    ok = run.wait(args.timeout, on_tick=view.tick)
    view.tick(run, force=True)
    view.close()
    summary = summarize(run)
    if getattr(args, "round_budget", 0) and getattr(args, "reference", True):
        print(
            "no centralized reference: it trains H steps a round, not the tokens a time-bounded run declared",
            flush=True)
    elif getattr(args, "reference", True) and summary["rounds"]:
        print("training the centralized references on the same tokens, AdamW and Muon (skip with "
              "--no-reference) ...",
              flush=True)
        losses = centralized_reference_losses(run, len(summary["rounds"]),
                                              say=lambda line: print(line, flush=True))
        summary["centralized_reference_eval_losses"] = losses
        summary["centralized_reference_eval_loss"] = losses[summary["optimizer"]]
        best, loss = strongest(losses)
        summary["strongest_centralized"] = {"optimizer": best, "eval_loss": loss}
        summary["benchmark"] = benchmark_figure(benchmark_result(summary["family"]))
    print(format_summary(summary), flush=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return ok


