"""Encoder "v3": v2's selection every few rounds; in between each tensor keeps its coding, warm-started.

Selection rounds (:mod:`training.codec.reselect`) remember per tensor its
coding ``(codec, r, b)`` and, for ``lowrank(r, b)``, the basis
``B = V_r diag(sigma_r)`` (:func:`~training.codec.factorize.warm_basis`). The
rounds in between keep every tensor's coding (so the selection's byte count)
and factorize a ``lowrank(r, b)`` tensor by one warm power iteration from last
round's basis (:func:`~training.codec.factorize.factorize_warm`, PowerSGD's
step). The sliced exchange's encoders keep no state: with "v3" they code as v2.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from training.codec.coding import Coded, TensorOptions
from training.codec.factorize import Factorization, factorize_warm, warm_basis
from training.codec.memo import EncoderMemo
from training.codec.reselect import ReselectingEncoder
from training.config import EncoderVersion


class V3Encoder(ReselectingEncoder):
    """Encoder "v3" (module docstring)."""

    version = EncoderVersion.V3
    memo_bases = True

    def selection_memo(self, matrices: Mapping[str, torch.Tensor], coded: Mapping[str, Coded],
                       found: Mapping[str, TensorOptions]) -> EncoderMemo:
        choices, bases = {}, {}
        for name, winner in coded.items():
            candidate = winner.candidate
            choices[name] = candidate.key
            if candidate.codec == "lowrank":
                bases[name] = warm_basis(found[name].factors, tuple(matrices[name].shape), candidate.rank)
        return EncoderMemo(choices, bases)

    def warm_choices(self, tensors: Mapping[str, torch.Tensor], norms: Mapping[str, float], budget: int,
                     memo: EncoderMemo) -> dict[str, tuple[str, int, int]]:
        return {name: memo.choices[name] for name in norms}

    def warm_factors(self, name: str, matrix: torch.Tensor, rank: int,
                     memo: EncoderMemo) -> tuple[Factorization, torch.Tensor | None]:
        return factorize_warm(matrix, rank, memo.bases[name])
