"""Encoder "v4": v2's selection every few rounds; in between the bytes are re-allocated from its estimates.

Selection rounds (:mod:`training.codec.reselect`) remember per tensor its
coding and every candidate's estimated relative error ``est_c`` (float32, in
candidate order). The rounds in between re-allocate the budget (the same
greedy rule, :func:`~training.codec.allocation.allocate`) with each
candidate's squared error estimated as ``(est_c ||X||)^2``, the selection's
relative estimate times this round's norm (error feedback moves the error
between tensors from round to round; the norms follow it, the estimates are
not recomputed), and factorize a ``lowrank(r, b)`` winner as "v2" does, at
rank r (:func:`~training.codec.factorize.factorize_gram`, the fixed sketch).
The memo holds no basis. The sliced exchange's encoders code as v2.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from training.codec.allocation import allocate, contribution_overhead
from training.codec.coding import Coded, TensorOptions, candidates
from training.codec.factorize import Factorization, factorize_gram
from training.codec.memo import EncoderMemo
from training.codec.reselect import ReselectingEncoder
from training.config import EncoderVersion


class V4Encoder(ReselectingEncoder):
    """Encoder "v4" (module docstring)."""

    version = EncoderVersion.V4
    memo_estimates = True

    def memo_usable(self, memo: EncoderMemo) -> bool:
        return memo.estimates is not None  # a memo without estimates gives nothing to re-allocate

    def selection_memo(self, matrices: Mapping[str, torch.Tensor], coded: Mapping[str, Coded],
                       found: Mapping[str, TensorOptions]) -> EncoderMemo:
        choices = {name: winner.candidate.key for name, winner in coded.items()}
        estimates = {
            name: torch.tensor([option.estimate for option in tensor.options], dtype=torch.float32)
            for name, tensor in found.items()
        }
        return EncoderMemo(choices, {}, estimates)

    def warm_choices(self, tensors: Mapping[str, torch.Tensor], norms: Mapping[str, float], budget: int,
                     memo: EncoderMemo) -> dict[str, tuple[str, int, int]]:
        """:func:`allocate` on ``(cost, (estimate * ||X||)^2)`` per candidate.

        ``memo.estimates[name]`` are the last selection's relative errors
        (float32, in candidate order); the float64 squares make the choice a
        pure function of the memo and this round's norms.
        """
        overhead = contribution_overhead(tensors)
        tensor_candidates, options = {}, {}
        for name, norm in norms.items():
            tensor_candidates[name] = candidates(tuple(tensors[name].shape), self.cfg)
            options[name] = [(c.cost, (estimate * norm) ** 2)
                             for c, estimate in zip(tensor_candidates[name], memo.estimates[name].tolist())]
        choice = allocate(options, budget - overhead)
        return {name: tensor_candidates[name][choice[name]].key for name in norms}

    def warm_factors(self, name: str, matrix: torch.Tensor, rank: int,
                     memo: EncoderMemo) -> tuple[Factorization, torch.Tensor | None]:
        return factorize_gram(matrix, rank, self.cfg.sketch), None
