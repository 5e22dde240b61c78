"""A peer's deeply nested JSON is refused, never the end of the node's process.

A node's process imports py_ecc (through web3's signing), which raises the interpreter's recursion limit to
100,000; ``json.loads`` then recurses in C past the thread's stack on deep nesting and the process dies of a
segmentation fault, which no ``except`` catches (training/jsonbound.py). A member's stage shard is parsed by
every node that builds the round's checkpoint, a claimant's start state by its verifiers, a checkpoint's
header by a joiner and a run document by every joiner: each of them, nested 65,536 deep, killed the process
before these readers bounded the depth. Each case runs in a child process with the node's imports, so a
regression is a failed test (exit -11), not a dead test run.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PRELUDE = """
import sys
sys.path.insert(0, {root!r})
import node.live.assembly  # the node's imports: py_ecc raises the recursion limit
assert sys.getrecursionlimit() >= 100_000, sys.getrecursionlimit()
DEEP = "[" * 65536


def refused(read, error):
    try:
        read()
    except error as exc:
        assert "nested" in str(exc), exc
    else:
        raise AssertionError("accepted")
"""

CASES = {
    "a stage shard's metadata (read_checkpoint)": """
        import torch
        from safetensors.torch import save_file
        from node.errors import StateError
        from node.store.checkpoint import read_checkpoint, parse_checkpoint
        save_file({"weights.w": torch.zeros(4)}, "shard.safetensors", metadata={"dlx": DEEP})
        refused(lambda: read_checkpoint("shard.safetensors"), StateError)
        refused(lambda: parse_checkpoint(open("shard.safetensors", "rb").read()), StateError)
    """,
    "a checkpoint header read by range (a joiner)": """
        import struct
        from node.errors import StateError
        from node.store.checkpoint import RunLayout
        from node.store.checkpoint_stage import fetch_checkpoint_stages
        data = struct.pack("<Q", len(DEEP)) + DEEP.encode()
        layout = RunLayout(1, b"c" * 32, {}, ({"w": (4,)},), True)
        refused(lambda: fetch_checkpoint_stages(lambda o, n: data[o:o + n], layout, 1, b"r" * 32, [0]),
                StateError)
    """,
    "a start state's header (a verifier)": """
        from training.errors import ReplicaStateError
        from training.replica_state import _parse_header
        refused(lambda: _parse_header(DEEP.encode()), ReplicaStateError)
    """,
    "a run document (a joiner)": """
        from node.errors import ConfigError
        from node.runconfig import parse_run_document
        refused(lambda: parse_run_document(DEEP.encode()), ConfigError)
    """,
}


def test_deep_nesting_from_a_peer_is_refused_not_a_segfault(tmp_path):
    # one child for every case (the node's imports take seconds): each prints its name first, so a crash
    # names the case it died in
    code = PRELUDE.format(root=str(ROOT)) + "".join(
        f"print({case!r}, flush=True)\nif True:\n" + textwrap.indent(textwrap.dedent(body), "    ")
        for case, body in sorted(CASES.items())) + "print('all refused', flush=True)\n"
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "all refused" in done.stdout, (
        done.returncode, done.stdout[-500:], done.stderr[-3000:])
    assert done.stdout.count("\n") == len(CASES) + 1
