"""node/arenas.py: a node process bounds glibc's malloc arenas as it starts (issue 45, "RSS flat")."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from node import arenas
from node.arenas import M_ARENA_MAX, M_MMAP_THRESHOLD, NODE_ARENAS, NODE_MMAP_THRESHOLD, fix_mmap_threshold, limit_arenas

# Eight threads that each malloc while the others do; then glibc's own account of its arenas.
_ARENAS_USED = textwrap.dedent("""
    import ctypes, sys, threading
    from node.arenas import _glibc, limit_arenas
    libc = _glibc()
    if libc is None:
        print("no-glibc"); sys.exit(0)
    if sys.argv[1] == "limit":
        assert limit_arenas()
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    barrier = threading.Barrier(8)
    def work():
        barrier.wait()
        blocks = [libc.malloc(4096) for _ in range(2000)]
        for block in blocks:
            libc.free(block)
    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads: t.start()
    for t in threads: t.join()
    libc.malloc_stats()  # one "Arena N:" block per arena, on stderr
""")


def _arenas_used(mode: str, env: dict | None = None) -> int | None:
    done = subprocess.run([sys.executable, "-c", _ARENAS_USED, mode], capture_output=True, text=True, timeout=120,
                          env=env)
    assert done.returncode == 0, done.stderr
    if "no-glibc" in done.stdout:
        return None
    return sum(1 for line in done.stderr.splitlines() if line.startswith("Arena "))


def test_a_node_process_keeps_at_most_two_arenas_where_threads_would_take_more():
    import os

    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    unbounded = _arenas_used("default", env)
    if unbounded is None:
        pytest.skip("not glibc: there is no arena limit to set")  # musl/macOS: limit_arenas is a no-op
    assert unbounded > NODE_ARENAS  # the threads do take arenas of their own without the limit
    assert _arenas_used("limit", env) <= NODE_ARENAS


class FakeLibc:
    def __init__(self, answer: int = 1) -> None:
        self.calls: list[tuple[int, int]] = []
        self.answer = answer
        outer = self

        class Mallopt:
            argtypes = restype = None

            def __call__(self, param, value):
                outer.calls.append((param, value))
                return outer.answer

        self.mallopt = Mallopt()


def test_the_limit_is_set_once_unless_the_environment_chose(monkeypatch):
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    libc = FakeLibc()
    assert limit_arenas(libc=libc) and libc.calls == [(M_ARENA_MAX, NODE_ARENAS)]
    assert not limit_arenas(libc=FakeLibc(answer=0))  # refused: said so, nothing raised
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    libc = FakeLibc()
    assert not limit_arenas(libc=libc) and libc.calls == []
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    monkeypatch.setattr(arenas, "_glibc", lambda: None)
    assert not limit_arenas()  # no glibc: nothing to do


@pytest.mark.parametrize("command,limited", [(["start", "--config", "x.toml"], True), (["join", "dlx://x"], True),
                                             (["status"], False)])
def test_start_and_join_set_the_limit_before_anything_else(monkeypatch, command, limited):
    from node import cli
    from node.commands import faces

    order: list[str] = []
    monkeypatch.setattr(arenas, "limit_arenas", lambda: order.append("arenas"))
    monkeypatch.setattr(arenas, "fix_mmap_threshold", lambda: order.append("mmap"))
    monkeypatch.setattr(cli, "configure_logging", lambda *a: order.append("logging"))
    monkeypatch.setattr(cli, "tame_libp2p_logging", lambda *a: None)
    monkeypatch.setattr("node.anvil.locate_anvil", lambda: None)
    monkeypatch.setitem(faces.COMMANDS, command[0], lambda args: order.append(args.command) or 0)
    assert cli.main(command) == 0
    assert order == (["arenas", "mmap", "logging", command[0]] if limited else ["logging", command[0]])



# A 1 MiB block is mmapped (above the threshold) and freed; then glibc's account of where the next one went.
_NEXT_BLOCK = textwrap.dedent("""
    import ctypes, sys
    from node.arenas import _glibc, fix_mmap_threshold
    libc = _glibc()
    if libc is None:
        print("no-glibc"); sys.exit(0)
    if sys.argv[1] == "fixed":
        assert fix_mmap_threshold()
    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                    "fsmblks", "uordblks", "fordblks", "keepcost")]
    libc.mallinfo2.restype = Info
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.free(libc.malloc(1 << 20))
    before = libc.mallinfo2().hblks
    block = libc.malloc(1 << 20)
    print(libc.mallinfo2().hblks - before)  # 1 if the second block got pages of its own
    libc.free(block)
""")


@pytest.mark.parametrize("mode,mmapped", [("default", 0), ("fixed", 1)])
def test_a_freed_large_block_does_not_move_the_next_into_the_arenas(mode, mmapped):
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    done = subprocess.run([sys.executable, "-c", _NEXT_BLOCK, mode], capture_output=True, text=True, timeout=120,
                          env=env)
    assert done.returncode == 0, done.stderr
    if "no-glibc" in done.stdout:
        pytest.skip("not glibc: there is no threshold to fix")
    assert int(done.stdout) == mmapped  # glibc's sliding threshold took the freed block's size; fixed, it did not


def test_the_threshold_is_fixed_unless_the_environment_chose(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    libc = FakeLibc()
    assert fix_mmap_threshold(libc=libc) and libc.calls == [(M_MMAP_THRESHOLD, NODE_MMAP_THRESHOLD)]
    assert not fix_mmap_threshold(libc=FakeLibc(answer=0))
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    libc = FakeLibc()
    assert not fix_mmap_threshold(libc=libc) and libc.calls == []
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    monkeypatch.setattr(arenas, "_glibc", lambda: None)
    assert not fix_mmap_threshold()
