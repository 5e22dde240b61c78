"""Encoders "v3" and "v4" (``compression.encoder``; issue 16 item 3): v2's selection every few rounds, memo between.

Both select exactly as "v2" (:func:`training.bandwidth.encode_within_bandwidth`,
the same bytes) every ``V3_RESELECT_ROUNDS``-th round and whenever they have
no memo, and keep a memo of that selection for the rounds in between
(:func:`encode_with_memo`). The memo is state: it lives in the stage engine's
state and the replica start state (:class:`EncoderMemo`), so a re-execution
of a warm round restores it and gets the same bytes (docs/DILOCOX.md
sections 3 and 11).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from training.bandwidth import (
    _Factors,
    _finish,
    _matrices,
    _Option,
    _quant_coded,
    _select,
    allocate,
    framing_bytes,
)
from training.codec_wire import matrix_view_shape
from training.compression import (
    CompressionStats,
    _Candidate,
    _candidates,
    _ColumnQuantizer,
    _factorize_warm,
    factorize,
)
from training.config import CompressionConfig
from training.errors import ContributionEncodeError


#: Encoder "v3" selects (as "v2") in the rounds ``t % V3_RESELECT_ROUNDS == 0`` and whenever it has no
#: memo of the previous round; in between it keeps each tensor's coding and warm-starts the factorization.
V3_RESELECT_ROUNDS = 4
_CODEC_IDS = {"quant": 0, "lowrank": 1}


@dataclass
class EncoderMemo:
    """Encoder "v3"'s / "v4"'s state of one stage: each tensor's coding, and what its warm rounds start from.

    ``choices[name] = (codec, rank, bits)`` of the last round. "v3": ``bases[name]``,
    the ``max(m, n) x rank`` factor the next round's power iteration on a
    low-rank tensor starts from (:func:`~training.compression._factorize_warm`).
    "v4": no bases; ``estimates[name]``, the last selection's estimated relative
    error of every candidate of the tensor (float32, in :func:`~training.compression._candidates`
    order), from which each warm round re-allocates the bytes (:func:`encode_with_memo`).
    """

    choices: dict[str, tuple[str, int, int]]
    bases: dict[str, torch.Tensor]
    estimates: dict[str, torch.Tensor] | None = None

    def to_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """``{"choice": {name: float32 [codec id, rank, bits]}, "basis": {name: float32 N x rank}}`` (copies),
        and ``"estimate": {name: float32 [one per candidate]}`` when the memo has estimates ("v4")."""
        out = {
            "choice": {
                name: torch.tensor([float(_CODEC_IDS[codec]), float(rank), float(bits)], dtype=torch.float32)
                for name, (codec, rank, bits) in self.choices.items()
            },
            "basis": {name: basis.detach().to(torch.float32).clone() for name, basis in self.bases.items()},
        }
        if self.estimates is not None:
            out["estimate"] = {name: value.detach().to(torch.float32).clone() for name, value in self.estimates.items()}
        return out

    @classmethod
    def from_tensors(cls, state: Mapping[str, Mapping[str, torch.Tensor]], shapes: Mapping[str, tuple[int, ...]],
                     cfg: CompressionConfig) -> "EncoderMemo":
        """Inverse of :meth:`to_tensors`, checked against the stage's shapes and candidates (ValueError)."""
        with_estimates = cfg.encoder == "v4"
        groups = {"choice", "basis", "estimate"} if with_estimates else {"choice", "basis"}
        if set(state) != groups:
            raise ValueError(f"encoder memo groups {sorted(state)}, expected {sorted(groups)}")
        codecs = {value: key for key, value in _CODEC_IDS.items()}
        choices, bases = {}, {}
        for name, value in state["choice"].items():
            if name not in shapes or tuple(value.shape) != (3,):
                raise ValueError(f"encoder memo choice {name!r}: unknown tensor or shape {tuple(value.shape)}")
            numbers = [float(x) for x in value.tolist()]
            if not all(math.isfinite(x) and x == int(x) for x in numbers) or int(numbers[0]) not in codecs:
                raise ValueError(f"encoder memo choice {name!r}: {numbers} is not a coding")
            codec, rank, bits = codecs[int(numbers[0])], int(numbers[1]), int(numbers[2])
            if _lookup(tuple(shapes[name]), cfg, (codec, rank, bits)) is None:
                raise ValueError(f"encoder memo choice {name!r}: {(codec, rank, bits)} is not a candidate")
            choices[name] = (codec, rank, bits)
        # "v3" keeps a basis per low-rank tensor, "v4" none.
        lowrank = {name for name, (codec, _, _) in choices.items() if codec == "lowrank" and cfg.encoder == "v3"}
        if set(state["basis"]) != lowrank:
            raise ValueError("encoder memo bases do not match its low-rank choices")
        for name, basis in state["basis"].items():
            size = max(matrix_view_shape(tuple(shapes[name])))
            if (tuple(basis.shape) != (size, choices[name][1]) or basis.dtype != torch.float32
                    or not bool(torch.isfinite(basis).all())):
                raise ValueError(f"encoder memo basis {name!r}: shape {tuple(basis.shape)} or values unusable")
            bases[name] = basis.detach().clone()
        if not with_estimates:
            return cls(choices, bases)
        if set(state["estimate"]) != set(choices):
            raise ValueError("encoder memo estimates do not match its choices")
        estimates = {}
        for name, value in state["estimate"].items():
            count = len(_candidates(tuple(shapes[name]), cfg))
            if (tuple(value.shape) != (count,) or value.dtype != torch.float32 or not bool(torch.isfinite(value).all())
                    or bool(torch.any(value < 0))):
                raise ValueError(f"encoder memo estimate {name!r}: shape {tuple(value.shape)} or values unusable")
            estimates[name] = value.detach().clone()
        return cls(choices, bases, estimates)


def _lookup(shape: tuple[int, ...], cfg: CompressionConfig, key: tuple[str, int, int]) -> _Candidate | None:
    return next((c for c in _candidates(shape, cfg) if (c.codec, c.rank, c.bits) == key), None)


def _warm_basis(factors: tuple[torch.Tensor, torch.Tensor, torch.Tensor], shape: tuple[int, int],
                rank: int) -> torch.Tensor:
    """The basis a selection round leaves for warm starts: ``S^T U_r = V_r diag(sigma_r)`` (``N x rank``).

    ``S`` is the ``k x N`` side of the matrix (:func:`~training.compression._factorize_warm`),
    ``U_r`` its top ``rank`` left singular vectors as the selection computed them.
    """
    u, sigma, v = factors
    other = v if shape[0] <= shape[1] else u
    return (other[:, :rank] * sigma[:rank]).contiguous()


#: Encoder versions that keep a memo of each tensor's coding between selections (:func:`encode_with_memo`).
MEMO_ENCODERS = ("v3", "v4")


def encode_with_memo(
    tensors: Mapping[str, torch.Tensor], cfg: CompressionConfig, budget: int, memo: EncoderMemo | None, *,
    stage_index: int, outer_round: int,
) -> tuple[bytes, dict[str, torch.Tensor], CompressionStats, EncoderMemo]:
    """Encoders "v3" and "v4" under a byte budget: ``(bytes, decoded, stats, next memo)``.

    Selection rounds (``outer_round % V3_RESELECT_ROUNDS == 0``, or no usable
    ``memo``) code exactly as "v2" (:func:`encode_within_bandwidth`, the same
    bytes) and remember each tensor's coding ("v4": and every candidate's
    estimated relative error). The rounds in between skip the candidates'
    estimates:

    * "v3" keeps every tensor's coding (so the selection's byte count) and
      factorizes a ``lowrank(r, b)`` tensor by one warm power iteration from last
      round's basis (:func:`~training.compression._factorize_warm`);
    * "v4" re-allocates the budget (:func:`allocate`) with each candidate's
      squared error estimated as the selection's relative estimate times this
      round's ``||X||^2`` (error feedback moves the error between tensors from
      round to round; the norms follow it, the estimates are not recomputed), and
      factorizes a ``lowrank(r, b)`` winner as "v2" does, at rank r
      (:func:`~training.compression._factorize_gram`, the fixed sketch).

    ``quant(b)`` is quantized at its b bits; each winner is coded and decoded
    exactly as the selection's winner would be. Deterministic given the input
    and the memo (the memo is part of the replica's state).
    """
    if cfg.encoder not in MEMO_ENCODERS:
        raise ContributionEncodeError(f"encoder {cfg.encoder!r} keeps no memo")
    v3 = cfg.encoder == "v3"
    matrices, norms = _matrices(tensors)
    warm = (memo is not None and outer_round % V3_RESELECT_ROUNDS != 0 and set(memo.choices) == set(matrices)
            and (v3 or memo.estimates is not None))  # a memo without estimates gives "v4" nothing to re-allocate
    if not warm:
        bases: dict[str, torch.Tensor | None] | None = {} if v3 else None
        codings: dict[str, list[_Option]] | None = None if v3 else {}
        chosen = _select(tensors, matrices, norms, cfg, budget, bases, codings)
        blob, decoded, stats, coded = _finish(tensors, matrices, norms, chosen, cfg, stage_index=stage_index,
                                              outer_round=outer_round)
        choices, next_bases = {}, {}
        for name, winner in coded.items():
            candidate = winner.candidate
            choices[name] = (candidate.codec, candidate.rank, candidate.bits)
            if candidate.codec == "lowrank" and v3:
                next_bases[name] = _warm_basis(bases[name], tuple(matrices[name].shape), candidate.rank)
        estimates = None if v3 else {
            name: torch.tensor([option.estimate for option in options], dtype=torch.float32)
            for name, options in codings.items()
        }
        return blob, decoded, stats, EncoderMemo(choices, next_bases, estimates)
    if v3:
        keep = {name: memo.choices[name] for name in matrices}
    else:
        keep = _reallocate(tensors, norms, cfg, budget, memo.estimates)
    chosen, next_bases = {}, {}
    for name, matrix in matrices.items():
        codec, rank, bits = keep[name]
        candidate = _lookup(tuple(tensors[name].shape), cfg, (codec, rank, bits))
        if candidate is None:
            raise ContributionEncodeError(f"{name!r}: encoder memo coding {(codec, rank, bits)} is not a candidate")
        if codec == "quant":
            quantizer = _ColumnQuantizer(matrix)
            chosen[name] = _Option(candidate, math.nan,
                                   lambda q=quantizer, c=candidate: _quant_coded(q, c, math.nan))
            continue
        if v3:
            factors, next_bases[name] = _factorize_warm(matrix, rank, memo.bases[name])
        else:
            factors = factorize(matrix, rank, "v2")
        chosen[name] = _Option(candidate, math.nan,
                               lambda f=_Factors(factors, rank), c=candidate: f.coded(c, math.nan))
    blob, decoded, stats, _ = _finish(tensors, matrices, norms, chosen, cfg, stage_index=stage_index,
                                      outer_round=outer_round)
    return blob, decoded, stats, EncoderMemo(keep, next_bases, memo.estimates)


def _reallocate(tensors, norms: Mapping[str, float], cfg: CompressionConfig, budget: int,
                estimates: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, int, int]]:
    """Encoder "v4"'s warm allocation: :func:`allocate` on ``(cost, (estimate * ||X||)^2)`` per candidate.

    ``estimates[name]`` are the last selection's relative errors (float32, in
    candidate order); the float64 squares make the choice a pure function of
    the memo and this round's norms.
    """
    overhead = 32 + sum(framing_bytes(name, tuple(tensors[name].shape)) for name in sorted(tensors))
    candidates, options = {}, {}
    for name, norm in norms.items():
        candidates[name] = _candidates(tuple(tensors[name].shape), cfg)
        options[name] = [(c.cost, (estimate * norm) ** 2)
                         for c, estimate in zip(candidates[name], estimates[name].tolist())]
    choice = allocate(options, budget - overhead)
    return {name: (lambda c: (c.codec, c.rank, c.bits))(candidates[name][choice[name]]) for name in norms}


encode_v3 = encode_with_memo  # the name the fifth pass shipped (in training.bandwidth then)
