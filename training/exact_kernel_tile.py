"""Kernel version 2's matrix product, blocked in registers (training/exact_kernel.py, docs/REPRODUCIBLE.md).

The same arithmetic as the plain loop (:func:`training.exact_kernel_numba.ordered_loop`): every output is
``((0 + a_0 b_0) + a_1 b_1) + ...``, ``k`` increasing, one float32 multiply and one float32 add at a time,
no fused multiply-add, no reassociation. Only which outputs are computed together changes: a tile of
:data:`MR` rows by :data:`NR` columns of ``c`` is held in vector registers for the whole of ``k`` (written
out once, at the end), where the plain loop loads and stores each output at every ``k``. Each lane of a
register is one output, so the tile changes no output's order of operations.

The tile's inner loop (:func:`_tile`) is written in LLVM IR with explicit vector types (``<W x float>``)
and plain ``fmul`` and ``fadd`` instructions without fast-math flags: LLVM may neither contract them into
an FMA nor reorder them, and legalises the vectors to the target's registers (4 SSE2 registers per vector,
2 AVX2 or one AVX-512). Operands are first copied into panels (``a``'s rows ``MR`` at a time, ``k``-major;
``b``'s columns ``NR`` at a time, ``k``-major), zero-padded to whole tiles; the padding's outputs are
computed and dropped (no output reads another's lanes).
"""

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

#: Lanes of one vector, vectors per tile row, rows per tile: a tile is MR x (NV W) outputs.
W, NV, MR = 16, 1, 8
NR = NV * W


@intrinsic
def _tile(typingctx, a_addr, b_addr, c_addr, inner):
    """``c[r, j] = sum_k a[k, r] b[k, j]`` (``k`` increasing from 0, one multiply and one add each) for
    the ``MR`` x ``NR`` tile whose panels start at the addresses: ``a`` ``inner`` x ``MR``, ``b`` ``inner``
    x ``NR``, ``c`` ``MR`` x ``NR``, float32, contiguous."""
    sig = types.void(types.uintp, types.uintp, types.uintp, types.intp)

    def codegen(context, builder, signature, args):
        a_int, b_int, c_int, count = args
        f32 = ir.FloatType()
        vec = ir.VectorType(f32, W)
        a_ptr = builder.inttoptr(a_int, f32.as_pointer())
        b_ptr = builder.inttoptr(b_int, vec.as_pointer())
        c_ptr = builder.inttoptr(c_int, vec.as_pointer())
        zero = ir.Constant(vec, [0.0] * W)
        accs = [[cgutils.alloca_once_value(builder, zero) for _ in range(NV)] for _ in range(MR)]
        splat_mask = ir.Constant(ir.VectorType(ir.IntType(32), W), [0] * W)
        with cgutils.for_range(builder, count) as loop:
            k = loop.index
            columns = [builder.load(builder.gep(b_ptr, [builder.add(builder.mul(k, k.type(NV)), k.type(v))]),
                                    align=4) for v in range(NV)]
            for r in range(MR):
                offset = builder.add(builder.mul(k, k.type(MR)), k.type(r))
                scalar = builder.load(builder.gep(a_ptr, [offset]), align=4)
                row = builder.shuffle_vector(builder.insert_element(ir.Constant(vec, ir.Undefined), scalar,
                                                                    ir.IntType(32)(0)),
                                             ir.Constant(vec, ir.Undefined), splat_mask)
                for v in range(NV):
                    product = builder.fmul(row, columns[v])  # a[i, k] * b[k, j], as the plain loop
                    builder.store(builder.fadd(builder.load(accs[r][v]), product), accs[r][v])
        for r in range(MR):
            for v in range(NV):
                builder.store(builder.load(accs[r][v]), builder.gep(c_ptr, [ir.IntType(64)(r * NV + v)]),
                              align=4)
        return context.get_dummy_value()

    return sig, codegen


@numba.njit(nogil=True, cache=True, fastmath=False, boundscheck=False)
def ordered(a, b, c):  # pragma: no cover: compiled
    """``c[p] = a[p] @ b[p]`` (any strides), each ``c[p, i, j]`` the sum over ``k`` in increasing order
    from 0, tile by tile (module docstring)."""
    count, rows, inner = a.shape
    cols = b.shape[2]
    row_panels, col_panels = (rows + MR - 1) // MR, (cols + NR - 1) // NR
    a_pack = np.zeros((row_panels, max(inner, 1), MR), dtype=np.float32)
    b_pack = np.zeros((col_panels, max(inner, 1), NR), dtype=np.float32)
    tile = np.empty((MR, NR), dtype=np.float32)
    for p in range(count):
        for i in range(rows):
            for k in range(inner):
                a_pack[i // MR, k, i % MR] = a[p, i, k]
        for k in range(inner):
            for j in range(cols):
                b_pack[j // NR, k, j % NR] = b[p, k, j]
        for jp in range(col_panels):
            j0 = jp * NR
            width = min(NR, cols - j0)
            for ip in range(row_panels):
                _tile(a_pack[ip].ctypes.data, b_pack[jp].ctypes.data, tile.ctypes.data, inner)
                i0 = ip * MR
                for r in range(min(MR, rows - i0)):
                    for j in range(width):
                        c[p, i0 + r, j0 + j] = tile[r, j]


@numba.njit(nogil=True, cache=True, fastmath=False, boundscheck=False)
def newton_schulz(x, a, b, c, steps):  # pragma: no cover: compiled
    """Muon's quintic iteration on float32 ``x`` (1, rows, cols), in place, as
    :func:`training.exact_optim.exact_orthogonalize` writes it with torch operations: ``steps`` times
    ``gram = x x^T``, ``poly = gram b + (gram gram) c``, ``x = x a + poly x``, each product :func:`ordered`,
    each elementwise operation one float32 multiply or add (the scalars rounded to float32 first, as torch
    does for a float32 tensor times a Python float)."""
    a32, b32, c32 = np.float32(a), np.float32(b), np.float32(c)
    rows, cols = x.shape[1], x.shape[2]
    gram = np.empty((1, rows, rows), dtype=np.float32)
    square = np.empty((1, rows, rows), dtype=np.float32)
    update = np.empty((1, rows, cols), dtype=np.float32)
    for _ in range(steps):
        ordered(x, x.transpose(0, 2, 1), gram)
        ordered(gram, gram, square)
        for i in range(rows):
            for j in range(rows):
                gram[0, i, j] = gram[0, i, j] * b32 + square[0, i, j] * c32
        ordered(gram, x, update)
        for i in range(rows):
            for j in range(cols):
                x[0, i, j] = x[0, i, j] * a32 + update[0, i, j]
