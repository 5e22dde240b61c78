"""The demo's summary: the centralized reference loss, the benchmark figure and the lines printed
at the end."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

from node.commands.demorewards import rewards_lines, rewards_summary
from node.commands.launcher import LocalRun
from node.config import load_config
from training.config import LEGACY_OPTIMIZER

#: How the summary names an inner optimizer (training.optimizer's values).
OPTIMIZER_NAMES = {"adamw": "AdamW", "muon": "Muon"}


#: The training benchmark's one current result (bench/bench_diloco.py): DiLoCoX against centralized
#: training at a real token budget, printed beside the demo's own short-run figure.
BENCHMARK_RESULT = Path(__file__).resolve().parents[2] / "bench" / "results" / "diloco.json"
#: The benchmark's result per model family (a Llama demo is read against the Llama run of the benchmark, a
#: BPE tokenizer's figure, not GPT-2's byte-level one).
BENCHMARK_RESULTS = {"gpt2": BENCHMARK_RESULT, "llama": BENCHMARK_RESULT.with_name("diloco_llama.json")}


def benchmark_result(family: str) -> Path:
    """The training benchmark's result for a model family (GPT-2's for a family it did not run)."""
    return BENCHMARK_RESULTS.get(family, BENCHMARK_RESULT)


#: Where the benchmarks' centralized runs of other inner optimizers lie (bench/bench_convergence.py): the
#: strongest DDP on the training benchmark's model and tokens is read from there.
CONVERGENCE_RESULT = BENCHMARK_RESULT.with_name("convergence.json")


def centralized_reference_losses(
    run: LocalRun, rounds: int, say: Callable[[str], None] | None = None
) -> dict[str, float]:
    """Held-out loss of data-parallel training with each inner optimizer (``OPTIMIZER_NAMES``, the run's
    first) on the same tokens, schedule and eval batches as the run: ``{optimizer: loss}``.

    The strongest of them is what the demo's DiLoCoX loss is read against (issue 66): with the
    default AdamW run, centralized Muon on the same tokens is the stronger baseline at the demo's size.
    Each trains in one intra-op thread (issue 80: with torch's default of one thread per core, a
    loaded 2-core machine made them 2-3x slower than one thread, and 40-65 minutes in all);
    ``say`` gets a progress line per round with the time left at that pace.
    """
    from training.exact_linalg import one_thread

    cfg = load_config(run.nodes[0].config_path)
    optimizers = [cfg.training.optimizer, *(o for o in OPTIMIZER_NAMES if o != cfg.training.optimizer)]
    with one_thread():
        return {optimizer: centralized_reference_loss(run, rounds, optimizer, ReferenceProgress(
            OPTIMIZER_NAMES[optimizer], say) if say else None) for optimizer in optimizers}


class ReferenceProgress:
    """``progress(done, total)`` of one centralized reference, said as one line per round (at most one
    every ``every_s`` seconds, and always the last), with the time left at the pace so far."""

    def __init__(self, name: str, say: Callable[[str], None], every_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name, self.say, self.every_s, self.clock = name, say, every_s, clock
        self.started = clock()
        self.last_said: float | None = None

    def __call__(self, done: int, total: int) -> None:
        now = self.clock()
        if done < total and self.last_said is not None and now - self.last_said < self.every_s:
            return
        self.last_said = now
        elapsed = now - self.started
        left = elapsed / done * (total - done) if done else 0.0
        tail = "done" if done == total else f"about {_duration(left)} left"
        self.say(f"  centralized {self.name}: round {done}/{total}, {_duration(elapsed)} so far, {tail}")


def _duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def strongest(losses: dict[str, float]) -> tuple[str, float]:
    """``(optimizer, loss)`` of the lowest centralized loss (the first named on a tie)."""
    best = min(losses, key=lambda name: losses[name])
    return best, losses[best]


def centralized_reference_loss(
    run: LocalRun, rounds: int, optimizer: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> float:
    """Held-out loss of data-parallel training (the run's inner optimizer, or ``optimizer``) on the same
    tokens, schedule and eval batches as the run.

    :func:`training.simulate.centralized_reference` (the benchmark's DDP mode) on the
    run's own settings.
    """
    from dataclasses import replace

    from training.data import corpus_from_config
    from training.simulate import centralized_reference

    cfg = load_config(run.nodes[0].config_path)
    training_cfg = cfg.training
    if training_cfg.data_path:
        training_cfg = replace(training_cfg, data_path=str(cfg.path(training_cfg.data_path)))
    corpus = corpus_from_config(training_cfg, cfg.model)
    reference_cfg = cfg.training if optimizer is None else replace(cfg.training, optimizer=optimizer)
    quiet = logging.getLogger("training.simulate")  # its per-round lines would interleave with the summary
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        return centralized_reference(corpus, cfg.model, reference_cfg, cfg.diloco, cfg.pipeline, rounds,
                                     progress=progress)
    finally:
        quiet.setLevel(level)


def benchmark_figure(path: Path, convergence: Path | None = CONVERGENCE_RESULT) -> dict:
    """DiLoCoX against DDP in the training benchmark's current result at ``path``, read at run time.

    Returns ``{"path", "loss_vs_ddp", "fewer_bytes", "tokens", "rounds", "inner_steps", "data", ...}``, or
    ``{"path", "missing": reason}`` when the file is absent (an installed package has no bench/) or
    is not a bench_diloco.py result with both modes; the demo then says so instead of a figure. With
    ``"strongest_ddp"`` (:func:`strongest_ddp`) where ``convergence`` holds a DDP run on the same tokens.
    """
    try:
        result = json.loads(path.read_text())
        x = result["summary"]["diloco_x"]
        settings = result["args"]
        figure = {"path": str(path), "loss_vs_ddp": float(x["loss_vs_ddp"]),
                  "fewer_bytes": float(x["fewer_bytes_than_ddp"]),
                  "tokens": int(max(point["tokens"] for point in x["curve"])),
                  "rounds": int(settings["rounds"]), "inner_steps": int(settings["inner_steps"]),
                  "family": str(settings.get("family", "gpt2")), "preset": str(settings.get("preset", "")),
                  "data": Path(str(settings["data"])).parent.name or str(settings["data"]),
                  # A result recorded before bench_diloco.py had --optimizer trained with AdamW.
                  "optimizer": str(settings.get("optimizer", LEGACY_OPTIMIZER))}
        if x.get("held_out_loss") is not None:
            figure["loss"] = float(x["held_out_loss"])
            best = strongest_ddp(convergence, settings, figure) if convergence is not None else None
            if best is not None:
                figure["strongest_ddp"] = best
    except FileNotFoundError:
        return {"path": str(path), "missing": "not found (run bench/bench_diloco.py from a clone)"}
    # not a bench_diloco.py result with DDP and DiLoCoX
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return {"path": str(path), "missing": f"unreadable ({type(exc).__name__}: {exc})"}
    return figure


def strongest_ddp(path: Path, settings: dict, figure: dict) -> dict | None:
    """The lowest held-out loss of a DDP run in bench/bench_convergence.py's result at ``path`` on the
    training benchmark's tokens: the same family, preset, data, seed, replicas, per-replica batch, rounds and
    H (so the same batches); ``{"path", "optimizer", "loss", "loss_vs"}`` (DiLoCoX's loss against it), None
    where no run matches or the file is absent or unreadable (the figure then goes without it)."""
    try:
        result = json.loads(path.read_text())
        if Path(str(result["data"])).name != figure["data"]:
            return None
        family = settings.get("family") or "gpt2"
        matching = [
            run for run in result["runs"]
            if run["mode"] == "ddp" and run["family"] == family and int(run["tokens"]) == figure["tokens"]
            and run["settings"]["model"].get("preset") == settings.get("preset")
            and int(run["settings"].get("training", {}).get("seed", 0)) == int(settings.get("seed", 0))
            and int(run["replicas"]) == int(settings["replicas"])
            and int(run["batch_per_replica"]) == int(settings["batch_size"])
            and int(run["inner_steps"]) == figure["inner_steps"]]
        if not matching:
            return None
        best = min(matching, key=lambda run: float(run["held_out_loss"]))
        loss = float(best["held_out_loss"])
        optimizer = str(best["settings"].get("training", {}).get("optimizer", LEGACY_OPTIMIZER))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return {"path": str(path), "optimizer": optimizer, "loss": loss, "loss_vs": figure["loss"] / loss - 1}


def summarize(run: LocalRun) -> dict:
    """Read the run back from the chain and the nodes' status files."""
    from ledger.records import from_micro
    from training.model import count_params

    client = run.client()
    history = client.history(run.run_id)
    cfg = load_config(run.nodes[0].config_path)
    params = count_params(cfg.model)
    declared = _declared_steps(run, cfg)
    rounds = [{"round": c.commit.round, "eval_loss": from_micro(c.commit.eval_loss_micro),
               "train_loss": from_micro(c.commit.train_loss_micro), "contributors": c.commit.num_contributors,
               "weights_root": c.commit.weights_root.hex(), "attesters": list(c.attesters),
               "tokens": c.commit.tokens, "declared_steps": declared.get(c.commit.round, [])}
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
        else:  # the nodes kept it split (storage.checkpoints = "stages"): the whole file from their stages
            from node.store.checkpoint_split import assemble_in_dirs

            p = Path(run.workdir) / f"checkpoint-round-{latest['round']:08d}.safetensors"
            if assemble_in_dirs([slot.data_dir for slot in run.nodes], latest["round"],
                                bytes.fromhex(latest["content_hash"]), p):
                ckpt_path = str(p)
    # Re-execution spot checks of other replicas' rounds,
    # per node (node/live/checks/verifier.py; status.json).
    spot_checks = {}
    for slot in run.nodes:
        status = slot.status()
        spot_checks[slot.name] = {key: status.get(key, 0) for key in (
            "spot_checks", "spot_check_mismatches", "spot_checks_not_done", "spot_check_seconds",
            "chain_checks")}
    return {
        "spot_checks": spot_checks, "accusations": len(history.accusations),
        "run_id": run.run_id, "attest_quorum": history.run.quorum, "stake_wei": history.run.min_stake,
        "unbonding_blocks": history.run.unbonding_blocks,
        "members": len({m.account for m in history.memberships}),
        "rpc_url": run.url, "registry": run.registry, "ledger": run.ledger,
        "model_params": params, "rounds": rounds, "family": cfg.model.family, "bytes_sent_all_nodes": sent,
        "pseudo_gradient_bytes": exchange, "inner_steps": cfg.diloco.inner_steps, "tokens": tokens,
        "round_budget_s": cfg.diloco.round_budget_s, "optimizer": cfg.training.optimizer,
        "tokens_per_step": cfg.training.batch_size * cfg.model.block_size,
        "data": "a generated corpus" if not cfg.training.data_path else Path(cfg.training.data_path).name,
        "allreduce_bytes_equivalent": allreduce, "checkpoints": checkpoints,
        "latest_checkpoint_file": ckpt_path, "disputes": len(history.disputes), "workdir": str(run.workdir),
        "node_dirs": [str(slot.data_dir) for slot in run.nodes],
        "rewards": rewards_summary(run),  # the run's reward pool and each member's earnings (issue 77)
    }


def _declared_steps(run: LocalRun, cfg) -> dict[int, list[int]]:
    """round -> the inner steps each replica's last-stage contribution declared, by replica, in a run bounded
    by time (read from the nodes' archives, as the audit recomputes them); {} in a fixed-H run."""
    if not cfg.diloco.budgeted:
        return {}
    from node.live.state.closesteps import envelope_steps
    from node.tools.audit_archives import AuditArchives

    archives = AuditArchives([slot.data_dir for slot in run.nodes], run.run_id)
    steps_range = (cfg.diloco.min_inner_steps or 1, cfg.diloco.inner_steps)
    last = cfg.pipeline.num_stages - 1
    declared: dict[int, list[int]] = {}
    for round_index, entries in archives.sealed().items():
        steps = []
        for _stage, _replica, _peer, hash_hex in sorted(e for e in entries if e[0] == last):
            envelope = archives.envelope(round_index, hash_hex)
            steps.append(envelope_steps(envelope, steps_range) if envelope is not None else 0)
        declared[round_index] = steps
    return declared


def _steps_cell(r: dict, tokens_per_step: int) -> str:
    """The round's inner steps, all replicas together; each replica's too where they declared different
    counts (a run bounded by time)."""
    total = r.get("tokens", 0) // max(1, tokens_per_step)
    each = r.get("declared_steps") or []
    if len(set(each)) > 1:
        return f"{total} ({'+'.join(map(str, each))})"
    return str(total)


def _benchmark_lines(s: dict) -> list[str]:
    """What the demo's gap means: a few short rounds, beside the benchmark's figure at a real budget."""
    demo = (f"  this demo is {len(s['rounds'])} short rounds of H={s['inner_steps']} ({s.get('tokens', 0):,} "
            f"tokens) on {s.get('data', 'its data')}: a check that the system works, not a "
            "measure of the method;")
    bench = s.get("benchmark")
    if not bench:
        return [demo]
    if "missing" in bench:
        return [demo, f"  the training benchmark's result {bench['path']}: {bench['missing']}"]
    model = f"{bench['preset']}, " if bench.get("preset") else ""
    measured = (
        f"  at a real budget ({model}{bench['tokens']:,} tokens of {bench['data']}, {bench['rounds']} rounds "
        f"of H={bench['inner_steps']}) DiLoCoX is {100 * bench['loss_vs_ddp']:+.1f}% against centralized "
        f"{OPTIMIZER_NAMES.get(bench.get('optimizer'), bench.get('optimizer'))} "
        f"with {bench['fewer_bytes']:.0f}x fewer bytes ({bench['path']}, from bench/bench_diloco.py)")
    best = bench.get("strongest_ddp")
    if not best:
        return [demo, measured]
    strongest = (f"  against the strongest centralized run measured on those tokens (data-parallel "
                 f"{OPTIMIZER_NAMES.get(best['optimizer'], best['optimizer'])}, {best['loss']:.4f} in "
                 f"{best['path']}, from bench/bench_convergence.py) it is {100 * best['loss_vs']:+.1f}%")
    return [demo, measured, strongest]


def _reference_lines(s: dict, final: float) -> list[str]:
    """The run's loss against centralized training on the same tokens: with its own inner optimizer, and
    against the strongest of every optimizer trained (where another is stronger)."""
    reference = s["centralized_reference_eval_loss"]
    optimizer = OPTIMIZER_NAMES.get(s.get("optimizer"), s.get("optimizer"))
    lines = [f"held-out loss {final:.4f}; centralized data-parallel {optimizer} on the same tokens: "
             f"{reference:.4f} ({100 * (final / reference - 1):+.1f}%)"]
    best = s.get("strongest_centralized")
    if best and best["optimizer"] != s.get("optimizer"):
        name = OPTIMIZER_NAMES.get(best["optimizer"], best["optimizer"])
        lines.append(f"  the strongest centralized run on the same tokens, data-parallel {name}: "
                     f"{best['eval_loss']:.4f} ({100 * (final / best['eval_loss'] - 1):+.1f}% against it)")
    elif best:
        others = ", ".join(f"{OPTIMIZER_NAMES.get(o, o)} {loss:.4f}"
                           for o, loss in s.get("centralized_reference_eval_losses", {}).items()
                           if o != best["optimizer"])
        if others:
            lines.append(f"  ({optimizer} is the strongest centralized run on the same tokens; also trained: "
                         f"{others})")
    return lines


def format_summary(s: dict) -> str:
    lines = ["", (f"run {s['run_id']}: {len(s['rounds'])} rounds committed on chain ({s['model_params']:,} "
                  f"parameters), each signed by at least {s['attest_quorum']} of the run's {s['members']} "
                  f"staked members ({s['stake_wei'] / 1e18:g} ETH each, unbonding "
                  f"{s['unbonding_blocks']} blocks)"),
             "  round  held-out  train   contributors  attesters  weights root      inner steps"]
    for r in s["rounds"]:
        lines.append(
            f"  {r['round']:>5}  {r['eval_loss']:8.4f}  {r['train_loss']:6.4f}  {r['contributors']:>12}  "
            f"{len(r['attesters']):>9}  {r['weights_root'][:16]}  "
            f"{_steps_cell(r, s.get('tokens_per_step', 1)):>11}")
    allreduce = s["allreduce_bytes_equivalent"]
    exchange = s["pseudo_gradient_bytes"]
    if s.get("centralized_reference_eval_loss") is not None and s["rounds"]:
        lines.extend(_reference_lines(s, s["rounds"][-1]["eval_loss"]))
        lines.extend(_benchmark_lines(s))
    lines.append(
        f"pseudo-gradients exchanged: {exchange / 1e6:.2f} MB; data-parallel AllReduce of fp32 gradients "
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
    if s.get("rewards"):
        lines.extend(rewards_lines(s["rewards"]))
    lines.append(f"disputes: {s['disputes']}; node data, logs and deployment.json in {s['workdir']}")
    archives = " ".join(f"--archive {p}" for p in s.get("node_dirs", []))
    lines.append(f"audit it (with --keep, while the chain runs):\n  dlx-node audit --rpc {s['rpc_url']} "
                 f"--run {s['run_id']} --deployment {s['workdir']}/deployment.json {archives}")
    return "\n".join(lines)
