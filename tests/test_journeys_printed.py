"""The commands a newcomer is handed (issue 65, points 9-12), each run as printed (the real ``dlx-node``).

One module-scoped run as ``dlx-node demo --preset llama-* --data DIR --keep`` leaves it: a ``llama-tiny`` node
on a prepared dataset with a trained BPE tokenizer, trained to its end on a real anvil, then what ``--keep``
does (node/commands/demo.py ``_keep_serving``: the seeder over the node's directory, the empty blocks that
close the dispute windows of a chain that mines per transaction, the printed commands). The printed ``pull``
takes the run's tokenizer from the seeder and the round as final; ``audit LINK`` and the audit command of the
pulled model's README pass through the seeder alone; the printed generate snippet runs without a warning.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest
from browser import rendered_dom
from node_fixtures import TINY, run_logs

from training.data import generated_text
from training.prepare import prepare_dataset, train_tokenizer

pytestmark = [pytest.mark.timeout(900)]
CLI = [sys.executable, "-m", "node.cli"]


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, input="",
                          check=False)


@pytest.fixture(scope="module")
def kept(tmp_path_factory):
    """(run, printed text of --keep, the demo's directory): a finished llama-tiny run kept as the demo keeps
    it."""
    import contextlib
    import io

    from node.commands.demo import _keep_serving
    from node.commands.launcher import LocalRun

    root = tmp_path_factory.mktemp("llama-kept")
    text = root / "corpus.txt"
    text.write_text(generated_text(seed=5, n_bytes=60_000))
    tokenizer = train_tokenizer([text], 320)
    prepare_dataset([text], root / "ds", tokenizer, shard_tokens=8192)
    out = root / "demo"
    run = LocalRun(out, replicas=1, stages=1, split=False, attest_quorum=1, attest_quorum_bps=0,
                   allow_weak_quorum=True,
                   settings=["model.preset=llama-tiny", f"model.vocab_size={tokenizer.vocab_size}",
                             f"model.tokenizer={root / 'ds' / 'tokenizer.json'}",
                             f"training.data_path={root / 'ds'}", "diloco.inner_steps=4",
                             "training.batch_size=4", "rounds=2", "checkpoint_every=1", "round_timeout=120"])
    seeder = None
    try:
        run.setup()
        run.start()
        assert run.wait(600, progress=True), run_logs(run)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            seeder = _keep_serving(run, out)
        assert seeder is not None, printed.getvalue()
        yield run, printed.getvalue(), out
    finally:
        if seeder is not None:
            seeder.close()
        run.stop()


def _printed_after(text: str, heading: str) -> list[str]:
    lines = text.splitlines()
    line = next(lines[i + 1] for i, line in enumerate(lines) if line.startswith(heading))
    return shlex.split(line.strip())


@pytest.fixture(scope="module")
def pulled(kept, tmp_path_factory):
    """The printed pull, run as printed (its output directory moved to a fresh one): (the run, its output,
    the model directory)."""
    run, printed, out = kept
    args = _printed_after(printed, "pull the latest checkpoint the chain vouches for")
    assert args[:2] == ["dlx-node", "pull"] and args[-1] == str(out / "model"), args
    model = tmp_path_factory.mktemp("pulled") / "model"
    done = run_cli(*args[1:-1], str(model))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return run, done.stdout + done.stderr, model


def test_keep_closes_the_dispute_windows_so_the_printed_pull_is_plain_and_final(kept, pulled):
    _run, printed, _out = kept
    _run, output, _model = pulled
    # Issue 65 point 11: the plain pull was refused ("not final until block 88", a block an idle chain never
    # mines); the demo mines the blocks that close the windows and prints a pull without --pending.
    assert "rounds are final" in printed and "--pending" not in printed.split("pull the latest")[1], printed
    # Issue 79 point 6: final is the chain's isFinal (dispute and proof windows), which the demo mines to.
    assert re.search(r"round 1 is final \(the chain's isFinal; its proof window closed at block \d+\)",
                     output), output


def test_the_printed_pull_of_a_llama_run_takes_the_runs_tokenizer_from_the_seeder(pulled):
    transformers = pytest.importorskip("transformers")
    _run, output, model = pulled
    # Issue 65 point 9: the seeder did not serve the run's tokenizer ("found neither in --archive nor on
    # peers", exit 3); now the pulled directory is a LlamaForCausalLM with that tokenizer.
    tok = transformers.AutoTokenizer.from_pretrained(model)
    assert tok("To be")["input_ids"] and (model / "tokenizer.json").is_file()
    assert type(transformers.AutoModelForCausalLM.from_pretrained(model)).__name__ == "LlamaForCausalLM"


def test_the_printed_generate_snippets_run_without_a_warning(pulled):
    pytest.importorskip("transformers")
    _run, output, model = pulled
    # Issue 65 point 12: generate() warned that max_new_tokens and max_length were both set (the latter from
    # generation_config.json). Both snippets, pull's printed lines and the model card's, run as written.
    lines = output.splitlines()
    load = next(line for line in lines if line.startswith("from transformers import"))
    generate = next(line for line in lines if line.startswith("print(tok.decode(model.generate("))
    card = (model / "README.md").read_text()
    snippet = card.split("```python\n", 1)[1].split("```", 1)[0].replace('"./model"', repr(str(model)))
    for code in (f"{load}\n{generate}\n", snippet):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                              check=False)
        assert done.returncode == 0, code + done.stderr[-3000:]
        assert done.stdout.strip(), code
        assert "max_new_tokens" not in done.stderr and "max_length" not in done.stderr, done.stderr[-3000:]


def _link(printed: str) -> str:
    return next(a for a in _printed_after(printed, "pull the latest checkpoint") if a.startswith("dlx://"))


def test_audit_of_the_run_link_passes_through_the_seeder_alone(kept, tmp_path):
    import json

    _run, printed, _out = kept
    # Issue 65 point 10: no archive or peer listed the rounds' contributions (INCOMPLETE, exit 13): the
    # nodes' close gossip is gone with them; the seeder serves each round's list under its contributions
    # root, and the run's prepared dataset (the replay screens on its held-out batches), with no --data.
    done = run_cli("audit", _link(printed), "--json", str(tmp_path / "audit.json"))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    assert "PASSED" in done.stdout and not _not_ok(done.stdout), done.stdout[-4000:]
    report = json.loads((tmp_path / "audit.json").read_text())
    for verdict in report["rounds"]:
        statuses = {check["name"]: check["status"] for check in verdict["checks"]}
        assert statuses["contributions root"] == statuses["weights root (replay)"] == "ok", verdict


def test_a_reexecute_through_the_link_alone_reruns_from_the_peers(kept, tmp_path):
    import json

    _run, printed, _out = kept
    # Issue 80 point 1: through the seeder link alone (no --archive) no contribution was rerun: the audit
    # printed PASSED with no rerun line and "reexecuted": {} in its JSON (then INCOMPLETE, "no --archive was
    # given"). Now the seeder serves the start states the envelopes bind, the reruns read the run's peers, and
    # round 1's rerun takes round 0's exclusions from the audit's own replay of round 0.
    done = run_cli("audit", _link(printed), "--reexecute", "all", "--json", str(tmp_path / "a.json"))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    assert "PASSED" in done.stdout and not _not_ok(done.stdout), done.stdout[-4000:]
    assert "re-executed 2 of 2 sampled contributions (asked: all): 2 exact, 0 emulated, 0 tolerance" \
        in done.stdout, done.stdout[-4000:]
    report = json.loads((tmp_path / "a.json").read_text())
    assert report["verdict"] == "PASSED" and report["ok"]
    assert report["reexecution"] == {"asked": "all", "recorded": 2, "sampled": 2, "rerun": 2, "why_not": "",
                                     "from": "peers"}, report["reexecution"]
    # What it cannot check, said exactly: without the replay (--no-replay) round 0's exclusions are unknown,
    # so round 1 cannot be rerun; round 0 (no round before it) still is. Not PASSED.
    done = run_cli("audit", _link(printed), "--no-replay", "--reexecute", "all", "--json",
                   str(tmp_path / "b.json"))
    assert done.returncode == 13, done.stdout[-4000:] + done.stderr[-3000:]
    assert "re-executed 1 of 2 sampled contributions (asked: all): 1 exact, 0 emulated, 0 tolerance; " \
        "1 not rerun; not rerun: 1 sampled not rerun (1 without their inputs" in done.stdout, \
        done.stdout[-4000:]
    assert "re-execution of round 1 replica 0: unverifiable (round 0's exclusions (which the next round's " \
        "start needs) are known only from the audit's replay of it, and its replay is unverifiable: replay " \
        "skipped (--no-replay))" in done.stdout, done.stdout[-4000:]
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["reexecution"]["rerun"] == 1 and report["verdict"] == "INCOMPLETE"


def test_the_audit_command_of_the_pulled_models_readme_passes(pulled):
    _run, _output, model = pulled
    card = (model / "README.md").read_text()
    line = next(line for line in card.splitlines() if line.startswith("dlx-node audit "))
    assert "--bootstrap /ip4/127.0.0.1/tcp/" in line, line
    done = run_cli(*shlex.split(line)[1:])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    assert "PASSED" in done.stdout, done.stdout[-4000:]


def _not_ok(stdout: str) -> str:
    return "\n".join(line for line in stdout.splitlines() if "UNVERIFIABLE" in line or "FAIL" in line)


def test_audit_reexecute_all_shows_its_progress_on_a_terminal_and_counts_its_reruns(kept):
    import os

    run, printed, _out = kept
    # Issue 65 point 17: minutes in silence. On a terminal: rounds and reruns done of how many, with an
    # estimate of the time left; the summary says how many contributions were rerun and how.
    main, terminal = os.openpty()
    audit = subprocess.Popen([*CLI, "audit", _link(printed), "--archive", str(run.nodes[0].data_dir),
                              "--reexecute", "all"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=terminal, text=True)
    os.close(terminal)
    shown = b""
    while True:
        try:
            chunk = os.read(main, 4096)
        except OSError:  # EIO: the terminal's other end is closed
            break
        if not chunk:
            break
        shown += chunk
    os.close(main)
    stdout = audit.stdout.read()
    assert audit.wait(timeout=600) == 0, stdout[-4000:] + shown.decode(errors="replace")[-3000:]
    bar = shown.decode(errors="replace")
    assert "0/2 rounds checked" in bar and "2/2 rounds checked" in bar, bar[-3000:]
    assert "0/2 contributions re-executed" in bar and "estimating the time left" in bar, bar[-3000:]
    assert re.search(r"1/2 contributions re-executed \(round \d replica 0\), about \d+ (s|min)", bar), bar
    assert "2/2 contributions re-executed" in bar and "done in" in bar, bar[-3000:]
    # One replica on this machine's CPU: both reruns are bit-exact here.
    rerun = "re-executed 2 of 2 sampled contributions (asked: all): 2 exact, 0 emulated, 0 tolerance"
    assert rerun in stdout, stdout


def test_the_llama_runs_summary_reads_the_llama_benchmark_and_names_each_replicas_steps(kept):
    from node.commands.demosummary import benchmark_figure, benchmark_result, format_summary, summarize

    run, _printed, _out = kept
    summary = summarize(run)
    summary["centralized_reference_eval_loss"] = summary["rounds"][-1]["eval_loss"]  # not trained here
    summary["benchmark"] = benchmark_figure(benchmark_result(summary["family"]))
    text = format_summary(summary)
    # Issue 65 point 12: a Llama demo was read against the GPT-2 byte-level benchmark figure.
    assert summary["family"] == "llama", summary
    assert summary["benchmark"]["path"].endswith("diloco_llama.json"), summary["benchmark"]
    assert "at a real budget (llama-mini, " in text and "diloco_llama.json" in text, text
    # A fixed-H run: every replica declared H, the column shows the round's steps (4, one replica).
    assert all(r["declared_steps"] == [] for r in summary["rounds"])
    rows = [line.split() for line in text.splitlines() if re.match(r"\s+\d+\s+\d+\.\d{4}", line)]
    assert [row[-1] for row in rows] == ["4", "4"], text
    # Where replicas declared different steps (a run bounded by time), each one's count beside the sum.
    budgeted = dict(summary, rounds=[dict(summary["rounds"][0], tokens=40 * summary["tokens_per_step"],
                                          declared_steps=[14, 13, 13])])
    assert "  40 (14+13+13)" in format_summary(budgeted)


def test_the_printed_explorer_serves_at_once_and_its_loss_chart_has_axis_values(kept, tmp_path):
    import json
    import time
    import urllib.request

    _run, printed, _out = kept
    args = _printed_after(printed, "watch the run in a browser")
    assert args[:2] == ["dlx-node", "explorer"], args
    explorer = subprocess.Popen([*CLI, *args[1:], "--port", "0"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    try:
        line = explorer.stdout.readline()
        assert "http://127.0.0.1:" in line, line + explorer.stderr.read()
        base = line.split(" at ")[1].split(" ")[0]
        # Issue 65 point 16: a fresh page showed empty tables for 30-38 s; the first snapshot comes at once.
        started = time.monotonic()
        with urllib.request.urlopen(base + "api/snapshot", timeout=30) as reply:
            snapshot = json.loads(reply.read())
        assert time.monotonic() - started < 10 and [r["round"] for r in snapshot["rounds"]] == [0, 1]
        dom = rendered_dom(base, tmp_path / "chromium")
        # ... and the loss chart has its values: the loss axis from the lowest to the highest recorded loss
        # (2 decimals), the round axis at rounds 0 and 1.
        losses = [v for r in snapshot["rounds"] for v in (r["eval_loss"], r["train_loss"])]
        y_ticks = [float(v) for v in re.findall(r'class="y-tick">([\d.]+)</text>', dom)]
        assert len(y_ticks) == 4, dom[:3000]
        assert y_ticks[0] == pytest.approx(min(losses), abs=0.006) \
            and y_ticks[-1] == pytest.approx(max(losses), abs=0.006), (y_ticks, losses)
        assert re.findall(r'class="x-tick">(\d+)</text>', dom) == ["0", "1"], dom[:3000]
        assert 'class="eval-loss" data-points="2"' in dom
    finally:
        explorer.terminate()
        explorer.wait(timeout=20)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_time_bounded_runs_summary_reads_each_replicas_declared_steps(make_run):
    from node.commands.demosummary import format_summary, summarize

    # Two replicas, rounds bounded by time: each replica declares the inner steps it trained (the count is the
    # machine's load's; the summary reads them from the archived envelopes, as the audit recomputes them).
    run = make_run(replicas=2, stages=1, split=False, settings=[
        *TINY, "diloco.inner_steps=12", "diloco.round_budget_s=0.3", "diloco.min_inner_steps=2",
        "diloco.overlap_steps=0", "rounds=2", "join_timeout=60"])
    run.start()
    assert run.wait(1200, progress=True), run_logs(run)
    summary = summarize(run)
    text = format_summary(summary)
    for r in summary["rounds"]:
        each = r["declared_steps"]
        assert len(each) == 2 and all(2 <= n <= 12 for n in each), (r, text)
        assert r["tokens"] == sum(each) * summary["tokens_per_step"], (r, text)  # what the record counts
        cell = f"{sum(each)} ({each[0]}+{each[1]})" if each[0] != each[1] else str(sum(each))
        row = next(line for line in text.splitlines() if line.startswith(f"  {r['round']:>5}  "))
        assert row.endswith(f"  {cell:>11}"), (row, cell)
