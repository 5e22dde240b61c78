"""The low-rank factorizations the encoders use: top-``rank`` ``(U, sigma, V)`` of a matrix, deterministic.

Which one a run uses is its encoder's choice (``training/codec/v1.py`` ...):
:func:`factorize_range` (v1), :func:`factorize_gram` (v2, and v3 / v4 when
they select) and :func:`factorize_warm` (v3 between selections). Each is a
pure function of its input on one platform and thread count, so a
re-executing verifier gets the same bytes.
"""

from __future__ import annotations

import torch

from training.config import DEFAULT_RANDOM, RandomSource
from training.portable_rng import standard_normal

FACTOR_SEED = 0x5EED  # fixed seed of the randomized range finder
EXACT_SVD_MAX_DIM = 96  # min(m, n) up to which an exact SVD is cheaper than sketching
OVERSAMPLE = 8
POWER_ITERATIONS = 2

Factorization = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (U, sigma, V)

# the fixed sketches, drawn once per shape
_SKETCHES: dict[tuple[int, int, torch.dtype, str], torch.Tensor] = {}


def sketch(n: int, columns: int, dtype: torch.dtype, source: str = DEFAULT_RANDOM) -> torch.Tensor:
    """The fixed ``n x columns`` standard normal sketch of the run's ``compression.sketch`` (cached; never
    modified).

    ``"philox"``: the stream ``dlx-sketch/<FACTOR_SEED>/<n>x<columns>`` of :mod:`training.portable_rng`, the
    same bits on every machine (float64 values, rounded once to ``dtype``). ``"torch"`` (runs made before
    ``compression.sketch``): ``torch.randn`` from a generator seeded with ``FACTOR_SEED``, whose float32
    kernel differs by CPU instruction set, so only machines with the run's kernel re-encode its bytes.
    """
    key = (n, columns, dtype, source)
    if key not in _SKETCHES:
        if len(_SKETCHES) >= 64:
            _SKETCHES.clear()
        if source == RandomSource.TORCH:
            generator = torch.Generator().manual_seed(FACTOR_SEED)
            _SKETCHES[key] = torch.randn(n, columns, generator=generator, dtype=dtype)
        else:
            values = standard_normal(f"dlx-sketch/{FACTOR_SEED}/{n}x{columns}".encode(), n * columns)
            _SKETCHES[key] = torch.from_numpy(values).reshape(n, columns).to(dtype)
    return _SKETCHES[key]


def factorize_range(matrix: torch.Tensor, rank: int, sketch_source: str = DEFAULT_RANDOM) -> Factorization:
    """Encoder "v1": top-``rank`` ``(U, sigma, V)`` of ``matrix``; deterministic for given input.

    Exact SVD when the matrix is small; otherwise Halko et al.'s randomized
    range finder with ``POWER_ITERATIONS`` subspace iterations and a FIXED
    Gaussian sketch (seed ``FACTOR_SEED``), so re-encoding the same input on
    the same platform gives the same bytes.
    """
    m, n = matrix.shape
    if min(m, n) <= max(EXACT_SVD_MAX_DIM, rank + OVERSAMPLE):
        u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
        return u[:, :rank], s[:rank], vh[:rank].t()
    basis, _ = torch.linalg.qr(matrix @ sketch(n, rank + OVERSAMPLE, matrix.dtype, sketch_source))
    for _ in range(POWER_ITERATIONS):
        basis, _ = torch.linalg.qr(matrix.t() @ basis)
        basis, _ = torch.linalg.qr(matrix @ basis)
    u_small, s, vh = torch.linalg.svd(basis.t() @ matrix, full_matrices=False)
    return (basis @ u_small)[:, :rank], s[:rank], vh[:rank].t()


def stable_eigh(symmetric: torch.Tensor, eigh=torch.linalg.eigh) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.linalg.eigh``; where LAPACK's float32 solver does not converge or returns NaN without saying so
    (both seen on the Gram matrix of a sliced exchange's average of a few decoded low-rank slices, whose
    eigenvalues repeat at zero: one live aggregator died of it, another coded a NaN scale), the same in
    float64, then with a diagonal shift of 1e-7 of the trace's mean. A pure function of the input on one
    platform, so a partial coded through it still replays bit for bit; inputs that converged are unchanged.

    ``eigh``: the solver (``torch.linalg.eigh``); a test passes one that fails the way LAPACK did, since
    whether a given float32 matrix makes a given LAPACK build fail depends on the CPU.
    """
    try:
        values, vectors = eigh(symmetric)
        if bool(torch.isfinite(values).all()) and bool(torch.isfinite(vectors).all()):
            return values, vectors
    except torch.linalg.LinAlgError:
        pass
    wide = symmetric.double()
    try:
        values, vectors = eigh(wide)
    except torch.linalg.LinAlgError:
        shift = 1e-7 * float(torch.diagonal(wide).abs().mean()) + 1e-30
        values, vectors = eigh(wide + shift * torch.eye(wide.shape[0], dtype=wide.dtype))
        values = values - shift
    return values.to(symmetric.dtype), vectors.to(symmetric.dtype)


def factorize_gram(matrix: torch.Tensor, rank: int, sketch_source: str = DEFAULT_RANDOM) -> Factorization:
    """Encoder "v2": top-``rank`` ``(U, sigma, V)`` of ``matrix`` through its small Gram matrix.

    With ``X`` of shape ``m x n`` and ``k = min(m, n)``, ``G = X X^T`` (or
    ``X^T X``) is only ``k x k`` (128 x 128 for every matrix of ``mini``), so
    the subspace iteration of Halko et al. (2011, Algorithm 4.4) runs on ``G``
    instead of ``X``: ``Y = G Omega`` (the fixed sketch, ``rank + 8`` columns),
    ``POWER_ITERATIONS`` x ``Y = G qr(Y)``, then Rayleigh-Ritz, ``eigh(Y^T G Y)``
    with ``Y = qr(Y)``. Each step on ``G`` is two steps on ``X`` (``G`` already
    squares the spectrum), and the products are ``k x k x (rank + 8)`` instead
    of ``m x n x (rank + 8)``. ``sigma = sqrt(eigenvalue)``, and the other side
    ``V = X^T U / sigma`` (zero where ``sigma`` is). Deterministic for given
    input on one platform; squaring the spectrum costs float32 accuracy only
    in singular values below ~1e-3 of the largest, far beyond what a rank <= 64
    coding keeps. When ``rank + 8 >= k``, ``eigh(G)`` directly.
    """
    m, n = matrix.shape
    wide = m <= n
    side = matrix if wide else matrix.t()  # k x max(m, n)
    gram = side @ side.t()
    size = gram.shape[0]
    columns = rank + OVERSAMPLE
    if columns >= size:
        values, vectors = stable_eigh(gram)
    else:
        basis = gram @ sketch(size, columns, gram.dtype, sketch_source)
        for _ in range(POWER_ITERATIONS):
            basis, _ = torch.linalg.qr(basis)
            basis = gram @ basis
        basis, _ = torch.linalg.qr(basis)
        values, small = stable_eigh(basis.t() @ gram @ basis)
        vectors = basis @ small
    # eigh sorts ascending: the top ``rank`` are the last, largest first after the flip.
    values, vectors = values.flip(0)[:rank], vectors.flip(1)[:, :rank]
    sigma = torch.sqrt(values.clamp_min(0.0))
    positive = sigma > 0
    other = (side.t() @ vectors) / torch.where(positive, sigma, 1.0)
    # A singular value so small that X^T u / sigma overflows float32 (an exactly low-rank matrix, such
    # as the sliced exchange's average of a few decoded low-rank slices: its noise eigenvalues reach
    # 1e-40) carries nothing: that component is dropped, not coded as inf (which quantized to NaN).
    # Every factorization whose columns were finite is unchanged, bit for bit.
    kept = positive & torch.isfinite(other).all(dim=0)
    other = torch.where(kept, other, 0.0)
    sigma = torch.where(kept, sigma, 0.0)
    return (vectors, sigma, other) if wide else (other, sigma, vectors)


def factorize_warm(
    matrix: torch.Tensor, rank: int, basis: torch.Tensor
) -> tuple[Factorization, torch.Tensor]:
    """Encoder "v3" between selections: ``((U, sigma, V), next basis)`` from one warm power iteration.

    PowerSGD's step (Vogels et al. 2019): last round's factor seeds this
    round's single power iteration. With ``S`` the ``k x N`` side of ``X``
    (``X`` if ``m <= n``, else ``X^T``) and ``B`` (``N x rank``) the previous basis::

        P = qr(S B),  Q = S^T P          (S ~= P Q^T, the best approximation within span(P))
        sigma_j = |Q_j|,  V_j = Q_j / sigma_j (0 where sigma_j = 0)

    and ``Q`` is the next basis. Two products of ``k x N x rank`` and one QR of
    ``k x rank``, against v2's Gram matrix, three QRs and an ``eigh``. The
    columns are not singular vectors (``V`` is not orthogonal); the coding
    needs none: its rank is fixed and ``P Q^T`` is the same product whatever
    the rotation within ``span(P)``. Deterministic for given input on one
    platform and thread count.
    """
    m, n = matrix.shape
    wide = m <= n
    side = matrix if wide else matrix.t()  # k x max(m, n)
    left, _ = torch.linalg.qr(side @ basis)  # k x rank, orthonormal
    right = side.t() @ left  # N x rank
    sigma = torch.linalg.vector_norm(right, dim=0)
    positive = sigma > 0
    unit = torch.where(positive, right / torch.where(positive, sigma, 1.0), 0.0)
    return ((left, sigma, unit) if wide else (unit, sigma, left)), right


def warm_basis(factors: Factorization, shape: tuple[int, int], rank: int) -> torch.Tensor:
    """The basis a selection round leaves for :func:`factorize_warm`: ``S^T U_r = V_r diag(sigma_r)`` (``N x
    rank``).

    ``S`` is the ``k x N`` side of the matrix, ``U_r`` its top ``rank`` left
    singular vectors as the selection computed them.
    """
    u, sigma, v = factors
    other = v if shape[0] <= shape[1] else u
    return (other[:, :rank] * sigma[:rank]).contiguous()
