"""An in-process memory probe for bench/churn_memory.py (loaded as ``sitecustomize`` by a node's interpreter).

bench/churn_memory.py puts this directory first on the ``PYTHONPATH`` of the node it watches and sets
``DLX_CHURN_PROBE`` to a directory. In that process a daemon thread waits for ``<dir>/trigger`` to change;
each new content (a label) makes one sample, appended as a JSON line to ``<dir>/samples.jsonl``:

- ``rss_kib``: VmRSS from /proc/self/status, after a ``gc.collect()``;
- ``types``: the number of gc-tracked objects by type name (those with at least 200);
- ``containers``: for every object of a class from the node's, p2p's or py-libp2p's modules, the length of
  each dict/set/list/deque attribute (and of dict/set/list values one level inside a dict attribute), summed
  over the class's instances, keyed ``module.Class.attribute``; ``instances``: how many of each class.

- ``modules``: the same lengths for the module-level containers of those packages (``module.name``), and
  the current size of every ``functools.lru_cache`` among their module attributes (``module.name()``);
- ``referrers``: for the classes named in ``DLX_CHURN_PROBE_TRACE`` (comma-separated), who holds each
  instance (a frame's function, a dict's owner class, or a type), counted;
- ``malloc``: glibc's ``mallinfo2``: bytes in use (``in_use``), free but kept (``free``), mmapped
  (``mmapped``): growth in use that Python's allocated blocks do not show is C memory (torch, protobuf);
- ``yamux_streams``: py-libp2p's yamux streams alive, counted by state (still in their connection's table or
  not, closed, each direction closed, reset, opened here): what a long-lived connection keeps of streams done;
- ``tracemalloc``: with ``DLX_CHURN_PROBE_TRACEMALLOC=N`` set, tracing (N frames) starts at the first
  sample and every later sample gives the allocations still alive that grew most since the sample before,
  grouped by traceback (``top``) and by line (``lines``), and the traced total.

The pass runs with a long switch interval so the counts are of one moment. A bench tool, never imported by
the node itself: without ``DLX_CHURN_PROBE`` in the environment it does nothing.

**Light mode** (bench/bench_soak.py): with ``DLX_CHURN_PROBE_EVERY=S`` also set, no trigger is read and no
object is walked: every S seconds the process appends to ``<dir>/light-<pid>.jsonl`` what costs no pause,
VmRSS split into anonymous and file-backed pages, ``mallinfo2``, Python's allocated blocks, the live
threads and gc's generation counts. Several processes can share the directory (one file each). With
``DLX_CHURN_PROBE_DEEP_EVERY=D`` also set, every D seconds the full sample above (the object walk: a pause of
2.8-3.4 s in the soak at load 11) is appended to ``<dir>/deep-<pid>.jsonl``: what a long run's growth is made
of, by type and by container.
"""

from __future__ import annotations

import collections
import functools
import gc
import json
import os
import sys
import threading
import time
import types

_PREFIXES = ("node.", "p2p.", "libp2p.", "training.", "ledger.")
_TRACE = set(filter(None, os.environ.pop("DLX_CHURN_PROBE_TRACE", "").split(",")))
_SIZED = (dict, set, list, collections.deque, frozenset)
_FRAMES = int(os.environ.pop("DLX_CHURN_PROBE_TRACEMALLOC", "0") or 0)
_last_snapshot = None


def _status_kib(*keys: str) -> dict:
    out = {}
    with open("/proc/self/status") as status:
        for line in status:
            key = line.split(":", 1)[0]
            if key in keys:
                out[key] = int(line.split()[1])
    return out


def _light_sample() -> dict:
    memory = _status_kib("VmRSS", "RssAnon", "RssFile", "RssShmem")
    return {"time": time.time(), "pid": os.getpid(), "rss_kib": memory.get("VmRSS", 0),
            "rss_anon_kib": memory.get("RssAnon", 0), "rss_file_kib": memory.get("RssFile", 0),
            "allocated_blocks": sys.getallocatedblocks(), "malloc": _malloc(),
            "pymalloc": _pymalloc(), "mappings": _mappings(),
            "threads": threading.active_count(), "gc_count": list(gc.get_count()), "arena_max": _ARENA_MAX}


#: glibc's non-main arenas live in heaps of this size, mapped at an address aligned to it (HEAP_MAX_SIZE on
#: 64-bit: 2 x DEFAULT_MMAP_THRESHOLD_MAX).
_GLIBC_HEAP = 64 << 20
#: The parts of ``other`` known by a mapping's size (kB): a thread's stack at the default 8 MiB RLIMIT_STACK,
#: pymalloc's 1 MiB arena.
_OTHER_BY_SIZE = {8 << 10: "other_stacks", 1 << 10: "other_pymalloc"}


def _mappings() -> dict:
    """The anonymous resident pages (kB) by who mapped them, from /proc/self/smaps: glibc's main heap
    (``brk``: the ``[heap]`` mapping), its other arenas' heaps (``arenas``: anonymous mappings at a
    64 MiB-aligned address, a heuristic: a large mmap can land there too), the main thread's stack
    (``stacks``) and the rest (``other``: the other threads' stacks, pymalloc's 1 MiB arenas, glibc's mmapped
    chunks, torch's large buffers); ``files``: the private copies of file-backed pages (shared libraries'
    written data). ``other`` is split by the mapping's size, a heuristic again: ``other_stacks`` (8 MiB: a
    thread's stack at the default RLIMIT_STACK), ``other_pymalloc`` (1 MiB: pymalloc's arenas), the rest in
    ``other_chunks``, whose largest resident mappings are ``other_top`` ([size kB, anonymous kB], at most
    6)."""
    out = {"brk": 0, "arenas": 0, "stacks": 0, "other": 0, "files": 0,
           "other_stacks": 0, "other_pymalloc": 0, "other_chunks": 0}
    top: list[tuple[int, int]] = []
    kind, size = None, 0
    try:
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                head = line.split(None, 5)
                if not head[0].endswith(":"):  # a mapping's line: "start-end perms offset dev inode [name]"
                    start, end = (int(x, 16) for x in head[0].split("-", 1))
                    size = (end - start) >> 10
                    name = head[5].strip() if len(head) > 5 else ""
                    if name == "[heap]":
                        kind = "brk"
                    elif name.startswith("[stack"):
                        kind = "stacks"
                    elif name.startswith("["):
                        kind = None  # [vdso], [vvar], [vsyscall]
                    elif name or head[4] != "0":
                        kind = "files"
                    elif start % _GLIBC_HEAP == 0:
                        kind = "arenas"
                    else:
                        kind = "other"
                elif kind is not None and line.startswith("Anonymous:"):
                    kib = int(line.split()[1])
                    out[kind] += kib
                    if kind == "other":
                        part = _OTHER_BY_SIZE.get(size)
                        out[part or "other_chunks"] += kib
                        if part is None and kib:
                            top.append((size, kib))
    except (OSError, ValueError, IndexError):
        return {}
    out["other_top"] = sorted(top, key=lambda m: -m[1])[:6]
    return out


def _pymalloc() -> dict:
    """pymalloc's arenas (each 1 MiB, mapped on their own) and the bytes in its allocated blocks, from
    ``_PyObject_DebugMallocStats`` written into memory (``open_memstream``); {} where CPython or the C
    library has no such function."""
    import ctypes

    libc = _libc()
    try:
        stats = ctypes.pythonapi._PyObject_DebugMallocStats
        stats.argtypes, stats.restype = [ctypes.c_void_p], ctypes.c_int
        libc.open_memstream.restype = ctypes.c_void_p
        libc.open_memstream.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)]
        libc.fclose.argtypes, libc.free.argtypes = [ctypes.c_void_p], [ctypes.c_void_p]
    except AttributeError:
        return {}
    buffer, size = ctypes.c_void_p(), ctypes.c_size_t()
    handle = libc.open_memstream(ctypes.byref(buffer), ctypes.byref(size))
    if not handle:
        return {}
    try:
        stats(handle)
    finally:
        libc.fclose(handle)  # flushes: buffer and size are final only now
    try:
        text = ctypes.string_at(buffer, size.value).decode("ascii", "replace")
    finally:
        libc.free(buffer)
    wanted = {"# arenas allocated current": "arenas", "# bytes in allocated blocks": "allocated_bytes",
              "# bytes in available blocks": "available_bytes"}
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition("=")
        if key.strip() in wanted:
            out[wanted[key.strip()]] = int(value.strip().replace(",", ""))
    return out


def _light(directory: str, every: float, deep_every: float) -> None:
    path = os.path.join(directory, f"light-{os.getpid()}.jsonl")
    deep_path = os.path.join(directory, f"deep-{os.getpid()}.jsonl")
    next_deep = time.monotonic() + deep_every
    while True:
        try:
            line = json.dumps(_light_sample())
            with open(path, "a") as out:
                out.write(line + "\n")
            if deep_every > 0 and time.monotonic() >= next_deep:
                next_deep = time.monotonic() + deep_every
                deep = _sample("deep")
                deep.pop("referrers", None)
                with open(deep_path, "a") as out:
                    out.write(json.dumps(deep) + "\n")
        except Exception:  # a probe must never take the node down (a full disk, a /proc read)
            pass
        time.sleep(every)


def _rss_kib() -> int:
    return _status_kib("VmRSS").get("VmRSS", 0)


def _describe(referrer: object) -> str:
    """A referrer in a few words: a frame's function, a dict's owner class, else its type."""
    if isinstance(referrer, types.FrameType):
        return f"frame {referrer.f_code.co_qualname}"
    if isinstance(referrer, types.CoroutineType):
        return f"coroutine {referrer.cr_code.co_qualname}"
    if isinstance(referrer, dict):
        owners = [o for o in gc.get_referrers(referrer) if getattr(o, "__dict__", None) is referrer]
        if owners:
            return f"__dict__ of {type(owners[0]).__module__}.{type(owners[0]).__qualname__}"
    return type(referrer).__qualname__


def _referrers(objects: list, names: set[str]) -> dict:
    """For the instances of the classes named in ``names``: who holds them, counted by description."""
    held: collections.Counter = collections.Counter()
    for obj in objects:
        if type(obj).__qualname__ in names:
            for referrer in gc.get_referrers(obj):
                if referrer is objects:
                    continue
                held[f"{type(obj).__qualname__} <- {_describe(referrer)}"] += 1
    return dict(held)


@functools.cache
def _libc():
    """The C library, loaded once (every light sample calls into it)."""
    import ctypes

    return ctypes.CDLL(None)


def _malloc() -> dict:
    import ctypes

    class Info(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                     "fordblks", "keepcost")]

    try:
        libc = _libc()
        libc.mallinfo2.restype = Info
        info = libc.mallinfo2()
    except AttributeError:  # not glibc, or older than 2.33
        return {}
    return {"in_use": info.uordblks, "free": info.fordblks, "mmapped": info.hblkhd,
            "arenas": _malloc_arenas()}


@functools.cache
def _info_libc():
    """The C library with the signatures :func:`_malloc_arenas` calls, set once; None without malloc_info."""
    import ctypes

    libc = _libc()
    try:
        libc.open_memstream.restype = ctypes.c_void_p
        libc.open_memstream.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)]
        libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
        libc.fclose.argtypes = [ctypes.c_void_p]
        libc.free.argtypes = [ctypes.c_void_p]
    except AttributeError:
        return None
    return libc


def _malloc_arenas() -> list:
    """Each glibc arena's bytes in use and free-but-kept, main arena first, from ``malloc_info`` (mallinfo2
    sums
    them): whether an arena's pages grow with what it holds or with its holes. [] where glibc has no
    malloc_info."""
    import ctypes
    from xml.etree import ElementTree

    libc = _info_libc()
    if libc is None:
        return []
    buffer, size = ctypes.c_void_p(), ctypes.c_size_t()
    stream = libc.open_memstream(ctypes.byref(buffer), ctypes.byref(size))
    if not stream:
        return []
    try:
        libc.malloc_info(0, stream)
    finally:
        libc.fclose(stream)
        text = ctypes.string_at(buffer, size.value)
        libc.free(buffer)
    arenas = []
    for heap in ElementTree.fromstring(text).findall("heap"):
        free = sum(int(total.get("size", 0)) for total in heap.findall("total")
                   if total.get("type") in ("fast", "rest"))
        current = next((int(x.get("size", 0)) for x in heap.findall("system") if x.get("type") == "current"),
                       0)
        arenas.append({"in_use": current - free, "free": free})
    return arenas


def _yamux_state(stream) -> str:
    conn = getattr(stream, "conn", None)
    held = stream.stream_id in getattr(conn, "streams", {})
    flags = [name for name in ("closed", "send_closed", "recv_closed", "reset_received", "is_initiator")
             if getattr(stream, name, False)]
    return ("in table" if held else "dropped") + (": " + ",".join(flags) if flags else "")


def _modules() -> dict:
    """Module-level containers and lru_caches of the probed packages, by ``module.name``."""
    sizes: dict = {}
    for module_name, module in list(sys.modules.items()):
        if module is None or not (module_name + ".").startswith(_PREFIXES):
            continue
        for name, value in list(vars(module).items()):
            if isinstance(value, _SIZED) and len(value):
                sizes[f"{module_name}.{name}"] = len(value)
            elif (callable(getattr(value, "cache_info", None))
                  and getattr(value, "__module__", "") == module_name):
                try:
                    sizes[f"{module_name}.{name}()"] = value.cache_info().currsize
                except Exception:  # not an lru_cache after all
                    pass
    return sizes


#: The smallest block :func:`_traced` lists by holder.
_LARGE_BYTES = 128 * 1024


def _traced() -> dict:
    """Tracing's diff since the sample before (the first sample only starts it)."""
    import tracemalloc

    global _last_snapshot
    if not tracemalloc.is_tracing():
        tracemalloc.start(_FRAMES)
        return {"started": True}
    ignore = [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, __file__)]
    snapshot = tracemalloc.take_snapshot().filter_traces(ignore)
    result: dict = {"traced_bytes": tracemalloc.get_traced_memory()[0]}
    if _last_snapshot is not None:
        for key, grouping, count in (("top", "traceback", 25), ("lines", "lineno", 40)):
            result[key] = [{"size_diff": d.size_diff, "count_diff": d.count_diff, "size": d.size,
                            "where": [f"{f.filename}:{f.lineno}" for f in d.traceback][-_FRAMES:]}
                           for d in snapshot.compare_to(_last_snapshot, grouping)[:count]]
    # The blocks of 128 KiB and more (glibc's mmap threshold before it slides) still alive, by traceback: who
    # holds the large blocks that RSS grows by, where Python's allocator or numpy made them.
    large: dict = {}
    for trace in snapshot.traces:
        if trace.size >= _LARGE_BYTES:
            entry = large.setdefault(trace.traceback, [0, 0])
            entry[0] += 1
            entry[1] += trace.size
    result["large"] = [{"count": count, "size": size,
                        "where": [f"{f.filename}:{f.lineno}" for f in where][-_FRAMES:]}
                       for where, (count, size) in sorted(large.items(), key=lambda item: -item[1][1])[:25]]
    _last_snapshot = snapshot
    return result


#: How long the walk lets go of the GIL once, after lengthening the switch interval (see :func:`_sample`).
_SETTLE_S = 0.2


def _sample(label: str) -> dict:
    """One full sample. While it holds every object in a list no other thread may run: a thread preempted
    while it builds a tuple from an iterator (``tuple(generator)``) resizes that tuple when it resumes,
    which CPython refuses (``SystemError: Objects/tupleobject.c: bad argument to internal function``) if
    anyone else holds a reference to it, as the list does (it happened once in the hour's soak of
    2026-11-26, in a web3 formatter). So, before the walk: the switch interval goes to 30 s and this
    thread lets go of the GIL once for ``_SETTLE_S``: a thread that waits for the GIL asks its holder to
    drop it only when a whole wait of the interval passed without the GIL changing hands, so a wait begun
    under the old 5 ms ends without asking (the GIL changed hands meanwhile), later waits are 30 s, and a
    request left from before is reset when this thread takes the GIL back. The collector is off during
    the walk, so no finalizer runs (and perhaps blocks) in the middle; the walk calls nothing that blocks."""
    gc.collect()
    enabled = gc.isenabled()
    previous = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    time.sleep(_SETTLE_S)
    gc.disable()
    try:
        started = time.monotonic()
        objects = gc.get_objects()
        by_type: collections.Counter = collections.Counter()
        containers: collections.Counter = collections.Counter()
        instances: collections.Counter = collections.Counter()
        for obj in objects:
            cls = type(obj)
            by_type[cls.__name__] += 1
            module = getattr(cls, "__module__", "")
            if not isinstance(module, str) or not module.startswith(_PREFIXES):
                continue
            try:
                fields = vars(obj)
            except TypeError:
                continue
            name = f"{module}.{cls.__qualname__}"
            instances[name] += 1
            for attribute, value in list(fields.items()):
                if isinstance(value, _SIZED):
                    containers[f"{name}.{attribute}"] += len(value)
                    if isinstance(value, dict):
                        inner = sum(len(v) for v in list(value.values()) if isinstance(v, _SIZED))
                        if inner:
                            containers[f"{name}.{attribute}[*]"] += inner
        streams = collections.Counter(_yamux_state(o) for o in objects if type(o).__name__ == "YamuxStream")
        traced = _referrers(objects, _TRACE) if _TRACE else {}
        del objects
        modules = _modules()
        took = time.monotonic() - started
    finally:
        sys.setswitchinterval(previous)
        if enabled:
            gc.enable()
    return {"label": label, "time": time.time(), "pass_s": round(took, 2), "rss_kib": _rss_kib(),
            "allocated_blocks": sys.getallocatedblocks(), "malloc": _malloc(),
            "types": {k: v for k, v in by_type.items() if v >= 200},
            "containers": dict(containers), "instances": dict(instances), "modules": modules,
            "yamux_streams": dict(streams),
            "referrers": traced, **({"tracemalloc": _traced()} if _FRAMES else {})}


def _watch(directory: str) -> None:
    trigger = os.path.join(directory, "trigger")
    last = None
    while True:
        time.sleep(1.0)
        try:
            with open(trigger) as handle:
                label = handle.read().strip()
        except OSError:
            continue
        if label and label != last:
            last = label
            try:
                sample = _sample(label)
            except Exception as exc:  # a probe must never take the node down
                sample = {"label": label, "error": repr(exc)}
            with open(os.path.join(directory, "samples.jsonl"), "a") as out:
                out.write(json.dumps(sample) + "\n")


def _own_arena_max() -> int:
    """``DLX_CHURN_PROBE_ARENA_MAX=name=N,...``: a node whose ``--config`` lies in a directory ``name`` runs
    with glibc's ``M_ARENA_MAX`` at N (set here, before its threads start, and in its environment, which
    node/arenas.py then leaves alone): one run compares nodes with and without. 0 where not asked."""
    wanted = dict(item.split("=", 1) for item in os.environ.pop("DLX_CHURN_PROBE_ARENA_MAX", "").split(",")
                  if "=" in item)
    try:
        with open("/proc/self/cmdline", "rb") as handle:
            argv = handle.read().decode("utf-8", "replace").split("\0")
        config = argv[argv.index("--config") + 1]
    except (OSError, ValueError, IndexError):
        return 0
    arenas = int(wanted.get(os.path.basename(os.path.dirname(os.path.abspath(config))), 0))
    if arenas > 0:
        _libc().mallopt(-8, arenas)  # M_ARENA_MAX
        os.environ["MALLOC_ARENA_MAX"] = str(arenas)
    return arenas


# Popped: the processes this node starts (its spot-check reruns) inherit its environment, not the probe.
_ARENA_MAX = _own_arena_max()
_DIRECTORY = os.environ.pop("DLX_CHURN_PROBE", "")
_EVERY = float(os.environ.pop("DLX_CHURN_PROBE_EVERY", "0") or 0)
_DEEP_EVERY = float(os.environ.pop("DLX_CHURN_PROBE_DEEP_EVERY", "0") or 0)
if _DIRECTORY and _EVERY > 0:
    threading.Thread(target=_light, args=(_DIRECTORY, _EVERY, _DEEP_EVERY), name="churn-probe-light",
                     daemon=True).start()
elif _DIRECTORY:
    threading.Thread(target=_watch, args=(_DIRECTORY,), name="churn-probe", daemon=True).start()
