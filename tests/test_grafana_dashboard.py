"""docs/grafana/dlx-node.json plots only metrics a node really exports."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana" / "dlx-node.json"
PROMQL_WORDS = {"rate", "irate", "deriv", "increase", "sum", "min", "max", "avg", "by", "without", "on",
                "ignoring", "label_values", "instance", "and", "or", "unless"}

#: Scrape what the node's exporter (node.commands.start.start_metrics, the code `dlx-node start` runs for
#: metrics_port) serves after one progress update, in a process of its own (prometheus_client's registry
#: is global).
SCRAPE = """
import socket, sys, urllib.request
from node.commands.start import start_metrics
from node.live.state.status import Progress
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
update = start_metrics(port)
update(Progress(inner_steps=4))
sys.stdout.write(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode())
"""


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (label matchers and range selectors stripped)."""
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r'"[^"]*"', "", expr)
    return {name for name in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr) if name not in PROMQL_WORDS}


def dashboard_queries(dashboard: dict) -> list[str]:
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            queries.append(variable["definition"])
    return queries


def test_the_expression_parser_finds_metric_names():
    assert metric_names('rate(dlx_bytes_sent{instance=~"$instance"}[1m])') == {"dlx_bytes_sent"}
    assert metric_names('max(dlx_round{instance=~"a"} - dlx_last_commit)') == {"dlx_round", "dlx_last_commit"}
    assert metric_names("label_values(dlx_round, instance)") == {"dlx_round"}


def test_every_plotted_metric_is_in_a_nodes_metrics_output():
    dashboard = json.loads(DASHBOARD.read_text())
    plotted = set().union(*(metric_names(q) for q in dashboard_queries(dashboard)))
    assert {"dlx_round", "dlx_last_commit", "dlx_loss", "dlx_eval_loss", "dlx_bytes_sent"} <= plotted
    scrape = subprocess.run([sys.executable, "-c", SCRAPE], capture_output=True, text=True, timeout=120,
                            check=True)
    exported = {line.split("{")[0].split()[0] for line in scrape.stdout.splitlines()
                if line and not line.startswith("#")}
    assert not plotted - exported, f"plotted but not exported: {sorted(plotted - exported)}"
    assert all(panel["datasource"]["uid"] == "${datasource}" for panel in dashboard["panels"])
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
