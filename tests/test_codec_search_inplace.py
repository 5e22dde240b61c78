"""The clipped-scale search computed in place (training/codec/coding.py, ``ColumnQuantizer._search``) gives
the same bits as the search it replaced: six whole-matrix temporaries per fraction, kept here as the
reference, on matrices that reach its corner cases (zero columns, negative values that round to -0.0, ties
between fractions, a column layout that is not row-major, a single row), with and without the reproducible
mode's fixed-order codec."""

from __future__ import annotations

import contextlib

import pytest
import torch

from training.codec.coding import CLIP_FRACTIONS, ColumnQuantizer
from training.codec_exact import qmax, reconstruct_quant
from training.exact_codec import ExactCodec


def reference_search(matrix: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The search as it was before it ran in place (main at c21a221d), operation for operation."""
    column_max = matrix.abs().amax(dim=0)
    limit = qmax(bits)
    best_limit = best_error = None
    for fraction in CLIP_FRACTIONS:
        column_limit = column_max * fraction
        scales = column_limit / limit
        safe = scales.clamp_min(torch.finfo(torch.float32).tiny)
        q_float = torch.clamp(torch.round(matrix / safe), -limit, limit).add_(0.0)
        residual = matrix - reconstruct_quant(q_float, scales.to(torch.float32))
        error = torch.sum(residual * residual, dim=0)
        if best_limit is None:
            best_limit, best_error = column_limit, error
            continue
        better = error < best_error
        best_limit = torch.where(better, column_limit, best_limit)
        best_error = torch.where(better, error, best_error)
    return best_limit, best_error


def _matrices() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(75)
    gauss = torch.randn(257, 33, generator=gen) * 1e-3
    gauss[:, 3] = 0.0  # a zero column: scale 0
    gauss[::7, 5] = -1e-9  # tiny negatives: round to -0.0
    ties = torch.ones(64, 8)  # every fraction codes a constant column the same way
    ties[:, 1] = torch.linspace(-1.0, 1.0, 64)
    heavy = torch.randn(300, 17, generator=gen) ** 3  # heavy tails: clipping wins
    return {
        "gaussian": gauss,
        "ties": ties,
        "heavy": heavy,
        "column_major": torch.randn(40, 129, generator=gen).t(),  # a transposed view, not row-major
        "one_row": torch.randn(1, 50, generator=gen),
        "large": torch.randn(4096, 96, generator=gen) * 3e-4,
    }


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


@pytest.mark.parametrize("exact", [0, 3])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_in_place_search_is_bit_identical(exact: int, bits: int) -> None:
    for name, matrix in _matrices().items():
        with ExactCodec(exact) if exact else contextlib.nullcontext():
            want_limit, want_error = reference_search(matrix, bits)
            got_limit, got_error = ColumnQuantizer(matrix, clip=True)._search(bits)
        assert torch.equal(_bits(got_limit), _bits(want_limit)), (name, bits, exact)
        assert torch.equal(_bits(got_error), _bits(want_error)), (name, bits, exact)


def test_clipped_integers_and_scales_unchanged() -> None:
    """What goes on the wire (integers, scales) from the searched limits: as the reference's limits give."""
    matrix = _matrices()["heavy"]
    quantizer = ColumnQuantizer(matrix, clip=True)
    q_float, scales = quantizer.quantize(2)
    limit, _ = reference_search(matrix, 2)
    want_scales = limit / qmax(2)
    safe = want_scales.clamp_min(torch.finfo(torch.float32).tiny)
    want_q = torch.clamp(torch.round(matrix / safe), -qmax(2), qmax(2)).add_(0.0)
    assert torch.equal(_bits(scales), _bits(want_scales))
    assert torch.equal(_bits(q_float), _bits(want_q))
    # and the search did pick clipped scales somewhere (the case is one where clipping matters)
    assert bool(torch.any(limit < matrix.abs().amax(dim=0)))
