"""Encoders that select as "v2" every few rounds and keep a memo in between (v3, v4; issue 16 item 3).

Selection rounds (``outer_round % RESELECT_ROUNDS == 0``, or no usable memo)
code exactly as "v2" (the same bytes) and remember each tensor's coding, plus
what the kind's warm rounds need (:meth:`ReselectingEncoder.selection_memo`).
The rounds in between skip the candidates' estimates: the kind says which
coding each tensor gets (:meth:`ReselectingEncoder.warm_choices`) and how a
low-rank winner is factorized (:meth:`ReselectingEncoder.warm_factors`);
``quant(b)`` is quantized at its b bits, and each winner is coded and decoded
exactly as a selection's winner would be. Deterministic given the input and
the memo (the memo is part of the replica's state:
:class:`~training.codec.memo.EncoderMemo`).
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Mapping

import torch

from training.codec.base import tensor_matrices
from training.codec.coding import (
    BalancedFactors,
    Coded,
    ColumnQuantizer,
    Option,
    TensorOptions,
    lookup,
    quant_coded,
)
from training.codec.factorize import Factorization
from training.codec.memo import EncoderMemo
from training.codec.stats import CompressionStats
from training.codec.v2 import V2Encoder
from training.errors import ContributionEncodeError

#: A reselecting encoder selects (as "v2") in the rounds ``t % RESELECT_ROUNDS == 0`` and whenever it has no
#: usable memo of the previous round; in between it codes from its memo.
RESELECT_ROUNDS = 4


class ReselectingEncoder(V2Encoder):
    """v2's selection every ``RESELECT_ROUNDS``-th round, a memo in between (module docstring)."""

    keeps_memo = True

    # ------------------------------------------------------------------ what a reselecting kind defines

    def memo_usable(self, memo: EncoderMemo) -> bool:
        """Whether ``memo`` holds what this kind's warm rounds need."""
        return True

    @abstractmethod
    def selection_memo(self, matrices: Mapping[str, torch.Tensor], coded: Mapping[str, Coded],
                       found: Mapping[str, TensorOptions]) -> EncoderMemo:
        """The memo a selection round leaves: from each tensor's winner and every option it had."""

    @abstractmethod
    def warm_choices(self, tensors: Mapping[str, torch.Tensor], norms: Mapping[str, float], budget: int,
                     memo: EncoderMemo) -> dict[str, tuple[str, int, int]]:
        """Each non-empty tensor's coding ``(codec, rank, bits)`` in a round between selections."""

    @abstractmethod
    def warm_factors(self, name: str, matrix: torch.Tensor, rank: int,
                     memo: EncoderMemo) -> tuple[Factorization, torch.Tensor | None]:
        """``((U, sigma, V), next basis or None)`` of a low-rank winner in a round between selections."""

    # ------------------------------------------------------------------ the round

    def encode_round(
        self, tensors: Mapping[str, torch.Tensor], budget: int, memo: EncoderMemo | None, *, stage_index: int,
        outer_round: int,
    ) -> tuple[bytes, dict[str, torch.Tensor], CompressionStats, EncoderMemo]:
        """One round under a byte budget: ``(bytes, decoded, stats, next memo)`` (module docstring)."""
        matrices, norms = tensor_matrices(tensors)
        warm = (memo is not None and outer_round % RESELECT_ROUNDS != 0 and set(memo.choices) == set(matrices)
                and self.memo_usable(memo))
        if not warm:
            chosen, found = self.select(tensors, matrices, norms, budget)
            blob, decoded, stats, coded = self.finish(
                tensors, matrices, norms, chosen, stage_index=stage_index, outer_round=outer_round
            )
            return blob, decoded, stats, self.selection_memo(matrices, coded, found)
        keep = self.warm_choices(tensors, norms, budget, memo)
        chosen, next_bases = self.warm_options(tensors, matrices, keep, memo)
        blob, decoded, stats, _ = self.finish(tensors, matrices, norms, chosen, stage_index=stage_index,
                                              outer_round=outer_round)
        return blob, decoded, stats, EncoderMemo(keep, next_bases, memo.estimates)

    def warm_options(self, tensors: Mapping[str, torch.Tensor], matrices: Mapping[str, torch.Tensor],
                     keep: Mapping[str, tuple[str, int, int]], memo: EncoderMemo | None,
                     ) -> tuple[dict[str, Option], dict[str, torch.Tensor]]:
        """``({name: option}, {name: next basis})`` of the tensors in ``matrices`` in a round between
        selections, each coded as ``keep[name]`` says (a node that is a cluster calls it for a rank's
        tensors: training/cluster_encode.py)."""
        chosen, next_bases = {}, {}
        for name, matrix in matrices.items():
            codec, rank, bits = keep[name]
            candidate = lookup(tuple(tensors[name].shape), self.cfg, (codec, rank, bits))
            if candidate is None:
                raise ContributionEncodeError(
                    f"{name!r}: encoder memo coding {(codec, rank, bits)} is not a candidate"
                )
            if codec == "quant":
                quantizer = ColumnQuantizer(matrix, self.clip)
                chosen[name] = Option(candidate, math.nan,
                                      lambda q=quantizer, c=candidate: quant_coded(q, c, math.nan))
                continue
            factors, basis = self.warm_factors(name, matrix, rank, memo)
            if basis is not None:
                next_bases[name] = basis
            balanced = BalancedFactors(factors, rank, self.clip)
            chosen[name] = Option(candidate, math.nan, lambda f=balanced, c=candidate: f.coded(c, math.nan))
        return chosen, next_bases
