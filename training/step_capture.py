"""The recorder under :mod:`training.step_compile`: which program tensor each storage holds, the constants,
and the ATen operations of a reproducible step mapped to program ops (issue 78; docs/FRAUD_PROOF.md "The
model's step as a program")."""

from __future__ import annotations

import contextlib
import math

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from training.step_ops import (
    CAST, CAT, DATA_INPUT, DTYPE_CODES, LAYOUT, MAX, ONEHOT, SCATTER, SELECT, TABLE_INPUT, Program,
    StepCompileError,
)
from training.step_trace import CONST_INPUT, GATHER, float32_bits

ADD, SUB, MUL, DIV = 1, 2, 3, 4
BINARY = {"add": ADD, "sub": SUB, "mul": MUL, "div": DIV, "rsub": SUB}
FUNCTIONS = {"exp": 1, "log": 2, "tanh": 3, "sigmoid": 4, "silu": 5, "gelu_tanh": 6, "rsqrt": 7}
SQRT = 8


def key_of(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def whole(t: torch.Tensor) -> bool:
    """``t`` is its storage, contiguous from element 0 to the end."""
    return t.is_contiguous() and t.storage_offset() == 0 \
        and t.numel() * t.element_size() == t.untyped_storage().nbytes()


def tensors_in(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in tensors_in(item)]
    return []


class Capture:
    """The program being built: which program tensor each storage holds now, the ops, the constants."""

    def __init__(self, keep_values: bool) -> None:
        self.program = Program()
        self.where: dict[int, tuple] = {}  # storage -> (program tensor, dtype, weak reference)
        self.broken: dict[int, str] = {}  # storage -> the unmapped operation that wrote it
        self.lengths: dict[int, int] = {}
        self.values: dict[int, torch.Tensor] | None = {} if keep_values else None
        self.layouts: dict[tuple, int] = {}
        self.table_keys: dict[tuple, int] = {}
        self.quiet = 0

    @contextlib.contextmanager
    def silent(self):
        self.quiet += 1
        try:
            yield
        finally:
            self.quiet -= 1

    # ------------------------------------------------------------------ following storages

    def tracked(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t.numel() > 0 \
            and (self._live(self.where, t) is not None or self._live(self.broken, t) is not None)

    @staticmethod
    def _live(table: dict, t: torch.Tensor):
        """``table``'s entry for ``t``'s storage; none where the storage it was made for has been freed (an
        address reused by a new storage: weak references, so that the step's tensors are freed as in
        training)."""
        entry = table.get(key_of(t))
        if entry is not None and entry[-1].expired():
            del table[key_of(t)]
            return None
        return entry

    def register(self, t: torch.Tensor, pid: int) -> None:
        """Storage of ``t`` holds program tensor ``pid`` now (``t`` must be the whole storage)."""
        if not whole(t):
            if t.storage_offset() or t.numel() * t.element_size() != t.untyped_storage().nbytes() \
                    or 0 in t.stride():
                self.mark_broken(t, "a write into part of a tensor")
                return
            # A dense result in another order (an elementwise op keeps its input's layout): the program
            # tensor is in the logical order; the storage's order is a SCATTER of it.
            with self.silent():
                flat = torch.as_strided(t, (t.numel(),), (1,), 0)
            layout = (0, t.dim(), *t.shape, *t.stride())
            pid = self.emit(SCATTER, t.numel(), 0, 1, pid, pid, flat, (t.numel(), *layout))
            t = flat
        self.broken.pop(key_of(t), None)
        self.where[key_of(t)] = (pid, t.dtype, StorageWeakRef(t.untyped_storage()))

    def mark_broken(self, t: torch.Tensor, why: str) -> None:
        if t.numel() > 0:
            self.where.pop(key_of(t), None)
            self.broken[key_of(t)] = (why, StorageWeakRef(t.untyped_storage()))

    def length(self, index: int) -> int:
        if CONST_INPUT <= index < TABLE_INPUT:
            return 1
        if index >= TABLE_INPUT:
            return self.program.tables[index - TABLE_INPUT].numel()
        return self.lengths[index]

    def emit(self, kind: int, rows: int, inner: int, cols: int, a: int, b: int, value: torch.Tensor,
             extra: tuple = (), b_len: int | None = None) -> int:
        pid = self.program.state + len(self.program.ops)
        a_len = self.length(a)
        self.program.ops.append((kind, rows, inner, cols, a_len, self.length(b) if b_len is None else b_len,
                                 a, b))
        self.program.extras.append(tuple(int(v) for v in extra))
        self.lengths[pid] = value.numel()
        if self.values is not None:
            with self.silent():
                self.values[pid] = value.detach().reshape(-1).clone()
        return pid

    # ------------------------------------------------------------------ operands

    def constant(self, t: torch.Tensor) -> int:
        """The program input of a tensor no input of the step reaches: a scalar when all its elements are
        the same float32, else a table."""
        with self.silent():
            flat = t.detach().contiguous().reshape(-1)
            if flat.dtype.is_floating_point and flat.numel():
                as32 = flat.to(torch.float32)
                bits = as32.view(torch.int32)
                if bool((bits == bits[0]).all()):
                    return CONST_INPUT + float32_bits(as32[0])
            key = (flat.dtype, tuple(flat.shape), flat.numpy().tobytes())
            if key not in self.table_keys:
                self.table_keys[key] = TABLE_INPUT + len(self.program.tables)
                self.program.tables.append(flat.clone())
            return self.table_keys[key]

    def resolve(self, t, shape=None) -> int:
        """The program input holding ``t`` (broadcast to ``shape``) contiguously: its program tensor, a
        ``LAYOUT`` of it, or a constant."""
        if not isinstance(t, torch.Tensor):
            return CONST_INPUT + float32_bits(float(t))
        view = t if shape is None or tuple(t.shape) == tuple(shape) else t.expand(shape)
        broken = self._live(self.broken, t)
        if broken is not None:
            raise StepCompileError(f"the step reads a tensor {tuple(t.shape)} written by "
                                   f"{broken[0]}, "
                                   "which the compiler does not map")
        entry = self._live(self.where, t)
        if entry is None:
            return self.constant(view)
        pid, dtype, _ref = entry
        if dtype != t.dtype:
            raise StepCompileError(f"the step reads a {dtype} tensor as {t.dtype}")
        if whole(view):
            return pid
        sizes, strides, offset = tuple(view.shape), tuple(view.stride()), view.storage_offset()
        cache = (pid, sizes, strides, offset)
        if cache not in self.layouts:
            with self.silent():  # the value only where it is kept (emit reads its size otherwise)
                value = view.contiguous() if self.values is not None else view
            self.layouts[cache] = self.emit(LAYOUT, view.numel(), 0, 1, pid, pid, value,
                                            (offset, len(sizes), *sizes, *strides))
        return self.layouts[cache]

    def as_pid(self, index: int, value: torch.Tensor) -> int:
        """A program tensor holding input ``index`` (a constant copied out by a ``LAYOUT`` op)."""
        if index < self.program.state + len(self.program.ops) or index == DATA_INPUT:
            return index
        n = value.numel()
        stride = 0 if self.length(index) == 1 else 1
        return self.emit(LAYOUT, n, 0, 1, index, index, value, (0, 1, n, stride))

    def operand(self, t, shape) -> int:
        """An elementwise operand for an output of ``shape``: read as ``e % len`` where ``t`` is contiguous
        and broadcast along leading dimensions only, else made contiguous at ``shape``."""
        if not isinstance(t, torch.Tensor):
            return self.resolve(t)
        if not self.tracked(t):  # a constant broadcast along leading dimensions: the rows it repeats
            while t.dim() and (t.size(0) == 1 or t.stride(0) == 0):
                t = t[0]
        dims = list(t.shape)
        while dims and dims[0] == 1:
            dims.pop(0)
        suffix = list(shape)[len(shape) - len(dims):] if dims else []
        if dims == suffix and (t.is_contiguous() or not self.tracked(t)):
            return self.resolve(t.reshape(-1) if not self.tracked(t) else t)
        return self.resolve(t, shape)


# ---------------------------------------------------------------------- the ATen operations mapped


def _binary(cap: Capture, func, name: str, args, kwargs):
    base = name.rstrip("_")
    if kwargs.get("alpha", 1) != 1 or len(args) > 2 or kwargs.get("rounding_mode") is not None:
        return _unmapped(cap, func, name, args, kwargs)
    x, y = args[0], args[1]
    shape = torch.broadcast_shapes(*(tuple(v.shape) for v in (x, y) if isinstance(v, torch.Tensor)))
    first, second = cap.operand(x, shape), cap.operand(y, shape)
    if base == "rsub":
        first, second = second, first
    out = func(*args, **kwargs)
    if out.dtype != torch.float32:
        cap.mark_broken(out, f"{name} of {out.dtype}")
        return out
    cap.register(out, cap.emit(BINARY[base], out.numel(), 0, 1, first, second, out))
    return out


def _neg(cap: Capture, func, name: str, args, kwargs):
    x = args[0]
    first = cap.operand(x, x.shape)
    out = func(*args, **kwargs)
    cap.register(out, cap.emit(MUL, out.numel(), 0, 1, first, CONST_INPUT + float32_bits(-1.0), out))
    return out


def _where(cap: Capture, func, name: str, args, kwargs):
    cond, x, y = args
    shape = torch.broadcast_shapes(*(tuple(v.shape) for v in args if isinstance(v, torch.Tensor)))
    mask, first, second = cap.operand(cond, shape), cap.operand(x, shape), cap.operand(y, shape)
    out = func(*args, **kwargs)
    cap.register(out, cap.emit(SELECT, out.numel(), 0, 1, first, second, out, (mask,)))
    return out


def _amax(cap: Capture, func, name: str, args, kwargs):
    x, dims = args[0], args[1] if len(args) > 1 else kwargs.get("dim", ())
    dims = [dims] if isinstance(dims, int) else list(dims)
    if len(dims) != 1:
        return _unmapped(cap, func, name, args, kwargs)
    dim = dims[0] % x.dim()
    source = cap.resolve(x)
    out = func(*args, **kwargs)
    rows, inner = math.prod(x.shape[:dim]), x.shape[dim]
    cap.register(out, cap.emit(MAX, rows, inner, x.numel() // (rows * inner), source, source, out))
    return out


def _copy_like(cap: Capture, func, name: str, args, kwargs):
    """``clone``, ``_to_copy``, ``copy_``: the same program tensor (made contiguous), or a ``CAST``."""
    if name == "copy_":
        dst, src = args[0], args[1]
        source = cap.resolve(src, dst.shape)
        before = src.dtype
    else:
        src = args[0]
        source, before = cap.resolve(src), src.dtype
    out = func(*args, **kwargs)
    if out.dtype != before:
        pid = cap.emit(CAST, out.numel(), 0, 1, source, source, out, (DTYPE_CODES[out.dtype],))
    else:
        pid = cap.as_pid(source, out)
    cap.register(out, pid)
    return out


def _index(cap: Capture, func, name: str, args, kwargs):
    weight, indices = args
    if len(indices) != 1 or weight.dim() != 2 or indices[0] is None:
        return _unmapped(cap, func, name, args, kwargs)
    ids, table = cap.resolve(indices[0]), cap.resolve(weight)
    out = func(*args, **kwargs)
    cap.register(out, cap.emit(GATHER, indices[0].numel(), 0, weight.size(1), ids, table, out))
    return out


def _cat(cap: Capture, func, name: str, args, kwargs):
    parts, dim = args[0], (args[1] if len(args) > 1 else kwargs.get("dim", 0))
    dim %= parts[0].dim()
    rows = math.prod(parts[0].shape[:dim])
    sources = [cap.resolve(p) for p in parts]
    out = func(*args, **kwargs)
    pid, width, done = sources[0], parts[0].numel() // max(rows, 1), [parts[0]]
    for part, source in zip(parts[1:], sources[1:]):
        done.append(part)
        with cap.silent():
            size = rows * width + part.numel()
            value = torch.cat(done, dim) if cap.values is not None else torch.empty(size)
        pid = cap.emit(CAT, rows, width, part.numel() // rows, pid, source, value)
        width += part.numel() // rows
    cap.register(out, pid)
    return out


def _slice_backward(cap: Capture, func, name: str, args, kwargs):
    grad, sizes, dim, start, end, step = args
    source = cap.resolve(grad)
    out = func(*args, **kwargs)
    with cap.silent():
        view = out.narrow(dim, 0, out.size(dim))[(slice(None),) * dim + (slice(start, end, step),)]
    layout = (view.storage_offset(), view.dim(), *view.shape, *view.stride())
    cap.register(out, cap.emit(SCATTER, out.numel(), 0, 1, source, source, out, (out.numel(), *layout)))
    return out


def _scatter_value(cap: Capture, func, name: str, args, kwargs):
    target, dim, index, value = args
    if cap.tracked(target) or target.dim() != 2 or dim % 2 != 1 or tuple(index.shape) != (target.size(0), 1):
        return _unmapped(cap, func, name, args, kwargs)
    with cap.silent():
        empty = not bool(target.any())
    if not empty:
        return _unmapped(cap, func, name, args, kwargs)
    source = cap.resolve(index)
    out = func(*args, **kwargs)
    cap.register(out, cap.emit(ONEHOT, target.size(0), 0, target.size(1), source,
                               CONST_INPUT + float32_bits(float(value)), out, (DTYPE_CODES[out.dtype],)))
    return out


HANDLERS = {**{n: _binary for n in ("add", "sub", "mul", "div", "rsub", "add_", "sub_", "mul_", "div_")},
            "neg": _neg, "where": _where, "amax": _amax, "clone": _copy_like, "_to_copy": _copy_like,
            "copy_": _copy_like, "index": _index, "cat": _cat, "slice_backward": _slice_backward,
            "scatter_": _scatter_value}


#: Operations whose result does not depend on their inputs' values (a constant, then followed as one).
CREATORS = frozenset({"full_like", "zeros_like", "ones_like", "empty_like", "new_zeros", "new_ones",
                      "new_empty", "new_full", "new_empty_strided", "empty_strided", "_local_scalar_dense"})


def _unmapped(cap: Capture, func, name: str, args, kwargs):
    out = func(*args, **kwargs)
    _pass_through(cap, name, args, out)
    return out


def _pass_through(cap: Capture, name: str, args, out) -> None:
    """An op not mapped: a view of a followed storage keeps it; a new result of followed inputs (or an
    in-place change of one) is marked, so that reading it is an error naming ``name``."""
    inputs = [t for t in tensors_in(list(args)) if cap.tracked(t)]
    if not inputs or name in CREATORS:
        return
    sources = {key_of(t) for t in inputs}
    for t in tensors_in(out):
        if t.numel() and (key_of(t) not in sources or name.endswith("_")):
            cap.mark_broken(t, f"aten.{name}")


class Recorder(TorchDispatchMode):
    def __init__(self, cap: Capture) -> None:
        super().__init__()
        self.cap = cap

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.cap.quiet:
            return func(*args, **kwargs)
        name = func.overloadpacket.__name__
        handler = HANDLERS.get(name)
        inputs = tensors_in([list(args), list(kwargs.values())])
        if handler is not None and any(self.cap.tracked(t) for t in inputs):
            return handler(self.cap, func, name, args, kwargs)
        out = func(*args, **kwargs)
        _pass_through(self.cap, name, args, out)
        return out
