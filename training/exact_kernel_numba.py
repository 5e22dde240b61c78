"""Version 2's compiled loop (:func:`training.exact_kernel.ordered_matmul`), apart so that only a run that
uses it imports Numba. No ``fastmath``: every multiply and add is its own IEEE float32 operation (LLVM fuses
neither into an FMA nor reassociates them without the flags), and the compiler vectorises the innermost
loop, across outputs ``j``, which leaves each output's order of additions as written."""

import numba


@numba.njit(nogil=True, cache=True, fastmath=False, boundscheck=False)
def ordered(a, b, c):  # pragma: no cover: compiled
    """``c[p] = a[p] @ b[p]``, each ``c[p, i, j]`` the sum over ``k`` in increasing order from 0."""
    for p in range(a.shape[0]):
        for i in range(a.shape[1]):
            for j in range(b.shape[2]):
                c[p, i, j] = 0.0
            for k in range(a.shape[2]):
                aik = a[p, i, k]
                for j in range(b.shape[2]):
                    c[p, i, j] = c[p, i, j] + aik * b[p, k, j]
