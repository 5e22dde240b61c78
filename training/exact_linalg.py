"""Fixed-order linear algebra for the codec of a reproducible run: QR, symmetric eigensolver and SVD whose
every operation is a single IEEE operation or an exact product, in an order that depends on the shapes only.

LAPACK's ``geqrf``, ``syevd`` and ``gesdd`` block, thread and vectorise by the CPU and the math library, so
the codec's factorizations (training/codec/factorize.py) give other bits on another CPU model, thread count
or ``MKL_CBWR`` path. Under ``training.reproducible`` the codec runs in :class:`training.exact_codec.
ExactCodec`, which replaces them by these:

* :func:`householder_qr`: Householder reflections, column by column, in float64; each reflection's inner
  products are :func:`training.exact_math.tree_sum` reductions, its update one multiply and one subtract
  per element;
* :func:`jacobi_eigh`: the cyclic Jacobi method in float64 with the round-robin ("parallel") ordering: each
  sweep's ``n - 1`` rounds rotate ``n / 2`` disjoint pairs at once, the same pairs in the same order on
  every machine, until the off-diagonal mass is below ``(n JACOBI_EPSILON)^2`` of the total (at most
  ``JACOBI_SWEEPS`` sweeps);
* :func:`gram_svd`: the SVD through the small side's Gram matrix (an exact-split float64 product) and
  :func:`jacobi_eigh`, as the codec's encoder "v2" already factorizes.

Each result is rounded once to the input's dtype. The conventions (signs of ``Q``'s columns and of the
eigenvectors) may differ from LAPACK's; the codec needs none of them (it codes ``P Q^T`` and its subspaces).
"""

from __future__ import annotations

import contextvars
import math

import torch

from training import exact_kernel
from training.exact_math import exact_matmul, tree_sum

#: The kernel version whose square root the codec takes (training.exact_codec.ExactCodec sets it): before
#: version 3 torch's, whose CPU bits are the math library's path's (MKL's vector math on an Intel CPU with
#: AVX-512 rounds 0.87% of float32 roots otherwise than the correctly rounded root, its COMPATIBLE path 23%);
#: from version 3 the correctly rounded root (training.exact_kernel.sqrt), the same on every CPU.
ROOT_KERNELS: contextvars.ContextVar[int] = contextvars.ContextVar("codec_root_kernels", default=1)


def root(x: torch.Tensor) -> torch.Tensor:
    """The codec's square root of ``x`` under :data:`ROOT_KERNELS`."""
    return exact_kernel.sqrt(x, ROOT_KERNELS.get())

#: Slices of the float64 exact-split products (:func:`training.exact_math.exact_matmul`).
F64_SLICES = 3
JACOBI_SWEEPS = 30
FLUSH = 2.0 ** -200
JACOBI_EPSILON = 2.0 ** -52  # the sweeps stop at an off-diagonal sum of squares of (n eps)^2 of the total


class one_thread:  # noqa: N801 (a context manager, used as a decorator)
    """Run on one intra-op thread, the previous count restored after: the loops below are thousands of small
    kernels, which torch's thread pool only slows (by 10x and more on a loaded machine). The bits are the same
    on any thread count (nothing here reduces across threads)."""

    def __enter__(self):
        self.previous = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.previous)

    def __call__(self, func):
        def wrapped(*args, **kwargs):
            with one_thread():
                return func(*args, **kwargs)
        wrapped.__name__, wrapped.__doc__ = func.__name__, func.__doc__
        return wrapped


def matmul64(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (2-D, float64 result) by the exact-split product: the same bits whatever BLAS runs it."""
    return exact_matmul(a.to(torch.float64), b.to(torch.float64), F64_SLICES)


def _column_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the first dimension (fixed tree), that dimension dropped."""
    return tree_sum(x, 0).squeeze(0)


def _reflector(x: torch.Tensor) -> tuple[torch.Tensor, float, float] | None:
    """Householder vector ``v`` of the column ``x`` (``H x = alpha e_1``, ``H = I - scale v v^T``), or None
    for a zero column."""
    norm = float(root(_column_sum(x * x)))
    if norm == 0.0:
        return None
    head = float(x[0])
    alpha = -norm if head >= 0 else norm
    v = x.clone()
    v[0] = head - alpha
    square = float(_column_sum(v * v))
    if square == 0.0:
        return None
    return v, 2.0 / square, alpha


def _reflect(v: torch.Tensor, scale: float, block: torch.Tensor) -> torch.Tensor:
    """``(I - scale v v^T) block``: the inner products tree-summed, then one multiply and subtract each."""
    w = _column_sum(v.reshape(-1, 1) * block) * scale
    return block - v.reshape(-1, 1) * w.reshape(1, -1)


@one_thread()
def householder_qr(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reduced QR of a 2-D ``a`` (``m x k``): ``Q`` (``m x p``, orthonormal columns), ``R`` (``p x k``,
    upper triangular), ``p = min(m, k)``, in a fixed order (float64, rounded once to ``a``'s dtype)."""
    if a.dim() != 2:
        raise ValueError(f"householder_qr: a matrix, not shape {tuple(a.shape)}")
    work = a.detach().to(torch.float64).clone()
    m, k = work.shape
    p = min(m, k)
    reflectors = []
    for j in range(p):
        found = _reflector(work[j:, j])
        reflectors.append(found)
        if found is None:
            continue
        v, scale, alpha = found
        if j + 1 < k:
            work[j:, j + 1:] = _reflect(v, scale, work[j:, j + 1:])
        work[j, j] = alpha
        work[j + 1:, j] = 0.0
    q = torch.eye(m, p, dtype=torch.float64)
    for j in range(p - 1, -1, -1):
        if reflectors[j] is not None:
            v, scale, _ = reflectors[j]
            q[j:, :] = _reflect(v, scale, q[j:, :])
    return q.to(a.dtype), torch.triu(work[:p, :]).to(a.dtype)


def round_robin(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The ``n - 1`` rounds (``n`` even) of a round-robin tournament: index pairs ``(p, q)``, ``p < q``,
    every pair of ``0..n-1`` exactly once; player 0 stays, the others rotate."""
    players = list(range(n))
    rounds = []
    for _ in range(n - 1):
        pairs = [(players[i], players[n - 1 - i]) for i in range(n // 2)]
        p = torch.tensor([min(pair) for pair in pairs])
        q = torch.tensor([max(pair) for pair in pairs])
        rounds.append((p, q))
        players = [players[0], players[-1], *players[1:-1]]
    return rounds


def _rotate(a: torch.Tensor, vectors: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> None:
    """One round: the Jacobi rotations of the pairs ``(p, q)`` applied to ``a`` (both sides) and ``vectors``
    (Golub and Van Loan's ``sym.schur2``; ``t`` the smaller root, ``c = 1/sqrt(1+t^2)``, ``s = t c``)."""
    app, aqq, apq = a[p, p], a[q, q], a[p, q]
    rotating = apq != 0
    theta = (aqq - app) / (torch.where(rotating, apq, 1.0) * 2.0)
    sign = torch.where(theta >= 0, 1.0, -1.0)
    t = torch.where(rotating, sign / (theta.abs() + root(theta * theta + 1.0)), 0.0)
    c = 1.0 / root(t * t + 1.0)
    s = t * c
    rows_p, rows_q = a[p, :], a[q, :]
    cr, sr = c.reshape(-1, 1), s.reshape(-1, 1)
    a[p, :] = cr * rows_p - sr * rows_q
    a[q, :] = sr * rows_p + cr * rows_q
    for target in (a, vectors):
        cols_p, cols_q = target[:, p], target[:, q]
        target[:, p] = cols_p * c - cols_q * s
        target[:, q] = cols_p * s + cols_q * c


def _off_ratio(a: torch.Tensor) -> tuple[float, float]:
    """``(off-diagonal sum of squares / total, total)``."""
    total = float(_column_sum(_column_sum(a * a).reshape(-1, 1)))
    if total == 0.0:
        return 0.0, 0.0
    diagonal = torch.diagonal(a)
    off = total - float(_column_sum(diagonal * diagonal))
    return off / total, total


@one_thread()
def jacobi_eigh(symmetric: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(eigenvalues ascending, eigenvectors as columns)`` of a symmetric matrix, as ``torch.linalg.eigh``
    (the lower triangle is read, as torch's default ``UPLO="L"``), by the cyclic Jacobi method in a fixed
    order (float64; rounded once to the input's dtype)."""
    if symmetric.dim() != 2 or symmetric.shape[0] != symmetric.shape[1]:
        raise ValueError(f"jacobi_eigh: a square matrix, not shape {tuple(symmetric.shape)}")
    lower = torch.tril(symmetric.detach().to(torch.float64))
    n = lower.shape[0]
    size = n + n % 2  # an odd size gets a zero row and column, decoupled (its pairs never rotate)
    a = torch.zeros(size, size, dtype=torch.float64)
    a[:n, :n] = lower + torch.tril(lower, -1).t()
    vectors = torch.eye(size, dtype=torch.float64)
    if not bool(torch.isfinite(a).all()):
        raise torch.linalg.LinAlgError("jacobi_eigh: non-finite input")
    rounds = round_robin(size) if size > 1 else []
    for _ in range(JACOBI_SWEEPS):
        ratio, total = _off_ratio(a)
        if ratio <= (size * JACOBI_EPSILON) ** 2:
            break
        # entries below 2^-200 of the norm are set to zero: they change no bit that matters, and the
        # subnormal numbers they would decay into are a hundred times slower to compute with
        a = torch.where(a.abs() < math.sqrt(total) * FLUSH, 0.0, a)
        for p, q in rounds:
            _rotate(a, vectors, p, q)
    values = torch.diagonal(a)[:n]
    order = torch.sort(values, stable=True).indices
    return values[order].to(symmetric.dtype), vectors[:n, :n][:, order].to(symmetric.dtype)


def gram_svd(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reduced SVD ``(U, S, Vh)`` of a 2-D ``a``, singular values descending, through the Gram matrix of its
    smaller side and :func:`jacobi_eigh` (singular values far below the largest lose accuracy: the spectrum
    is squared); a zero singular value's other-side vector is zero."""
    if a.dim() != 2:
        raise ValueError(f"gram_svd: a matrix, not shape {tuple(a.shape)}")
    wide = a.shape[0] <= a.shape[1]
    side = (a if wide else a.t()).detach().to(torch.float64)  # k x N
    values, vectors = jacobi_eigh(matmul64(side, side.t()))
    values, vectors = values.flip(0), vectors.flip(1)
    sigma = root(values.clamp_min(0.0))
    positive = sigma > 0
    other = matmul64(side.t(), vectors) / torch.where(positive, sigma, 1.0)
    other = torch.where(positive, other, 0.0)
    u, v = (vectors, other) if wide else (other, vectors)
    return u.to(a.dtype), sigma.to(a.dtype), v.t().to(a.dtype)
