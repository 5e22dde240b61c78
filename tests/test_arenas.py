"""node/arenas.py: a node process bounds glibc's malloc arenas as it starts (issue 45, "RSS flat")."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from node import arenas
from node.arenas import (
    LARGE_BLOCK_BYTES,
    M_ARENA_MAX,
    M_MMAP_THRESHOLD,
    NODE_ARENAS,
    limit_arenas,
    map_large_blocks,
)

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
    done = subprocess.run([sys.executable, "-c", _ARENAS_USED, mode], capture_output=True, text=True,
                          timeout=120, env=env)
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


@pytest.mark.parametrize("command,limited",
                         [(["start", "--config", "x.toml"], True), (["join", "dlx://x"], True),
                          (["status"], False)])
def test_start_and_join_set_the_limit_before_anything_else(monkeypatch, command, limited):
    from node import cli
    from node.commands import faces

    order: list[str] = []
    monkeypatch.setattr(arenas, "limit_arenas", lambda: order.append("arenas"))
    monkeypatch.setattr(arenas, "start_heap_trimmer", lambda: None)  # its own test below
    monkeypatch.setattr(cli, "configure_logging", lambda *a: order.append("logging"))
    monkeypatch.setattr(cli, "tame_libp2p_logging", lambda *a: None)
    monkeypatch.setattr("node.anvil.locate_anvil", lambda: None)
    monkeypatch.setitem(faces.COMMANDS, command[0], lambda args: order.append(args.command) or 0)
    assert cli.main(command) == 0
    assert order == (["arenas", "logging", command[0]] if limited else ["logging", command[0]])



# 64 MiB in 4 KiB blocks, all freed but the last (it pins the heap's top, so glibc's own trim of the top
# cannot give the pages back); then the process's anonymous resident pages before and after trim_heap.
#: glibc's malloc, free and memset through ctypes, and the process's anonymous resident KiB.
_LIBC = """\
libc = _glibc()
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
def anon_kib():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssAnon:"))
"""

_TRIMMED = textwrap.dedent("""
    import ctypes, sys
    from node.arenas import _glibc, trim_heap
    if _glibc() is None:
        print("no-glibc"); sys.exit(0)
    {prelude}
    blocks = [libc.malloc(4096) for _ in range(16384)]
    for block in blocks:
        libc.memset(block, 1, 4096)  # resident
    for block in blocks[:-1]:
        libc.free(block)
    before = anon_kib()
    took = trim_heap()
    print(before, anon_kib(), took)
""").replace("{prelude}\n", _LIBC)


def test_trim_heap_gives_the_pages_freed_inside_the_heap_back():
    done = subprocess.run([sys.executable, "-c", _TRIMMED], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    if "no-glibc" in done.stdout:  # musl/macOS: nothing to trim, and trim_heap says so
        assert arenas.trim_heap() is None
        return
    before, after, took = done.stdout.split()
    assert int(before) - int(after) > 48 * 1024, done.stdout  # most of the 64 MiB freed is no longer resident
    assert float(took) >= 0


# The same 64 MiB freed inside the heap, left to the node's trimmer (no trim_heap call): it trims once it sees
# the arenas' free bytes, and the pages leave the resident set. Waits for the trim by its count, not by time.
_TRIMMER = textwrap.dedent("""
    import ctypes, sys, time
    from node.arenas import _glibc, heap_figures, start_heap_trimmer
    if _glibc() is None or heap_figures() is None:
        print("no-glibc"); sys.exit(0)
    {prelude}
    blocks = [libc.malloc(4096) for _ in range(16384)]
    for block in blocks:
        libc.memset(block, 1, 4096)
    trimmer = start_heap_trimmer(every=0.05)
    assert start_heap_trimmer() is trimmer  # one a process
    before = anon_kib()
    for block in blocks[:-1]:
        libc.free(block)
    while trimmer.trims == 0:
        time.sleep(0.05)
    print(before, anon_kib(), heap_figures()["free_in_arenas_bytes"])
""").replace("{prelude}\n", _LIBC)


def test_the_heap_trimmer_gives_freed_pages_back_without_being_called():
    done = subprocess.run([sys.executable, "-c", _TRIMMER], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    if "no-glibc" in done.stdout:
        return
    before, after, free = (int(v) for v in done.stdout.split())
    assert free >= 48 << 20  # the blocks are free in the arena...
    assert before - after > 48 * 1024, done.stdout  # ...and their pages no longer resident


def test_the_heap_trimmer_is_off_with_dlx_heap_trim_0(monkeypatch):
    monkeypatch.setenv("DLX_HEAP_TRIM", "0")
    assert arenas.start_heap_trimmer() is None


def test_trim_heap_does_nothing_without_glibc(monkeypatch):
    arenas._trimming_libc.cache_clear()
    monkeypatch.setattr(arenas, "_glibc", lambda: None)
    try:
        assert arenas.trim_heap() is None
    finally:
        arenas._trimming_libc.cache_clear()


# A node's imports, then the settling, then a run's churn of path names, each traced: the interned strings'
# table is a dict whose rebuild is one block (tracemalloc attributes it to the line that interned).
_SETTLED = textwrap.dedent("""
    import json, sys, tracemalloc
    import node.live.node  # what a node has imported when it takes its seat
    from node.arenas import settle_interned_strings

    def table_blocks(snapshot, filename):
        return sorted(t.size for t in snapshot.traces if t.size >= 1 << 20
                      and t.traceback[0].filename.endswith(filename))

    tracemalloc.start()
    settled = settle_interned_strings()
    at_settle = table_blocks(tracemalloc.take_snapshot(), "arenas.py")
    tracemalloc.stop()
    tracemalloc.start()
    for index in range(400_000):  # more than the settled table's free entries: a run's path names, interned
        sys.intern(f"round-{index:08d}")
    in_run = table_blocks(tracemalloc.take_snapshot(), "<string>")
    print(json.dumps([settled, at_settle, in_run]))
""")


def test_the_interned_strings_table_is_rebuilt_at_its_lasting_size_as_the_node_takes_its_seat():
    done = subprocess.run([sys.executable, "-c", _SETTLED], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    settled, at_settle, in_run = json.loads(done.stdout)
    # The settling runs on CPython 3.11 only (node/arenas.py); elsewhere it must do nothing at all.
    assert settled is (sys.implementation.name == "cpython" and sys.version_info[:2] == (3, 11))
    if not settled:
        assert at_settle == []
        return
    # The settling rebuilt the table (one block of MiBs); the run's churn rebuilt it again at that same size,
    # where without the settling its first rebuild doubles it (2^18 -> 2^19 slots, 3.7 -> 7.3 MiB).
    assert len(at_settle) == 1 and at_settle[0] > 3 << 20
    assert in_run and set(in_run) == set(at_settle)


def test_large_blocks_are_mapped_on_their_own_unless_the_environment_chose(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    libc = FakeLibc()
    assert map_large_blocks(libc=libc) and libc.calls == [(M_MMAP_THRESHOLD, LARGE_BLOCK_BYTES)]
    assert not map_large_blocks(libc=FakeLibc(answer=0))  # refused: said so, nothing raised
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    untouched = FakeLibc()
    assert not map_large_blocks(libc=untouched) and untouched.calls == []


def test_a_freed_large_block_leaves_the_resident_set():
    """In a real process: a 64 MiB block freed after a smaller one was freed (glibc's threshold then sits
    at that one's size) stays resident by default below the threshold's 32 MiB cap; with the fixed threshold
    every block of 1 MiB or more is unmapped on free. Counted in pages, not timed."""
    code = textwrap.dedent("""
        import ctypes, sys
        from node.arenas import _glibc, map_large_blocks
        libc = _glibc()
        if libc is None:  # musl, macOS: the setting is a no-op that says so
            assert not map_large_blocks()
            print("no-glibc"); sys.exit(0)
        if sys.argv[1] == "map":
            assert map_large_blocks()
        libc.malloc.restype = ctypes.c_void_p
        libc.malloc.argtypes = [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
        def rss():
            return int(open("/proc/self/statm").read().split()[1]) * 4096
        libc.free(libc.malloc(24 << 20))  # a mapped block freed: the default threshold moves up to it
        blocks = [libc.malloc(2 << 20) for _ in range(32)]  # 64 MiB in 2 MiB blocks
        for block in blocks:
            ctypes.memset(block, 1, 2 << 20)
        before = rss()
        for block in blocks:
            libc.free(block)
        print(before - rss())
    """)
    import os

    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    given_back = {}
    for mode in ("default", "map"):
        done = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, timeout=120,
                              env=env)
        assert done.returncode == 0, done.stderr
        if "no-glibc" in done.stdout:
            return  # checked in the child: map_large_blocks() reported it set nothing
        given_back[mode] = int(done.stdout.split()[-1])
    assert given_back["map"] >= 60 << 20  # every 2 MiB block unmapped when freed
    assert given_back["default"] < given_back["map"]
