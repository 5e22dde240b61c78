"""An encoder's memo: what encoders "v3" and "v4" carry from one round to the next (replica state).

The memo is state: it lives in the stage engine's state and the replica start
state, so a re-execution of a warm round restores it and gets the same bytes
(docs/DILOCOX.md sections 3 and 11). Which parts a memo has is its encoder
kind's (:attr:`training.codec.base.Encoder.memo_bases`, ``memo_estimates``);
:meth:`EncoderMemo.from_tensors` refuses any other.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from training.codec.coding import candidates, lookup
from training.codec_wire import matrix_view_shape
from training.config_compression import CompressionConfig

#: The number each codec is stored as in :meth:`EncoderMemo.to_tensors`.
CODEC_IDS = {"quant": 0, "lowrank": 1}


@dataclass
class EncoderMemo:
    """An encoder's state of one stage: each tensor's coding, and what its warm rounds start from.

    ``choices[name] = (codec, rank, bits)`` of the last round. "v3": ``bases[name]``,
    the ``max(m, n) x rank`` factor the next round's power iteration on a
    low-rank tensor starts from (:func:`~training.codec.factorize.factorize_warm`).
    "v4": no bases; ``estimates[name]``, the last selection's estimated relative
    error of every candidate of the tensor (float32, in :func:`~training.codec.coding.candidates`
    order), from which each warm round re-allocates the bytes (:mod:`training.codec.v4`).
    """

    choices: dict[str, tuple[str, int, int]]
    bases: dict[str, torch.Tensor]
    estimates: dict[str, torch.Tensor] | None = None

    def to_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """``{"choice": {name: float32 [codec id, rank, bits]}, "basis": {name: float32 N x rank}}`` (copies),
        and ``"estimate": {name: float32 [one per candidate]}`` when the memo has estimates ("v4")."""
        out = {
            "choice": {
                name: torch.tensor([float(CODEC_IDS[codec]), float(rank), float(bits)], dtype=torch.float32)
                for name, (codec, rank, bits) in self.choices.items()
            },
            "basis": {name: basis.detach().to(torch.float32).clone() for name, basis in self.bases.items()},
        }
        if self.estimates is not None:
            out["estimate"] = {
                name: value.detach().to(torch.float32).clone() for name, value in self.estimates.items()
            }
        return out

    @classmethod
    def from_tensors(
        cls,
        state: Mapping[str, Mapping[str, torch.Tensor]],
        shapes: Mapping[str, tuple[int, ...]],
        cfg: CompressionConfig,
        *,
        bases: bool,
        estimates: bool,
    ) -> EncoderMemo:
        """Inverse of :meth:`to_tensors`, checked against the stage's shapes and candidates (ValueError).

        ``bases``: the memo keeps a basis per low-rank tensor ("v3"), else none;
        ``estimates``: it keeps every candidate's estimate ("v4"), else none.
        """
        groups = {"choice", "basis", "estimate"} if estimates else {"choice", "basis"}
        if set(state) != groups:
            raise ValueError(f"encoder memo groups {sorted(state)}, expected {sorted(groups)}")
        codecs = {value: key for key, value in CODEC_IDS.items()}
        choices, found_bases = {}, {}
        for name, value in state["choice"].items():
            if name not in shapes or tuple(value.shape) != (3,):
                raise ValueError(
                    f"encoder memo choice {name!r}: unknown tensor or shape {tuple(value.shape)}"
                )
            numbers = [float(x) for x in value.tolist()]
            if not all(math.isfinite(x) and x == int(x) for x in numbers) or int(numbers[0]) not in codecs:
                raise ValueError(f"encoder memo choice {name!r}: {numbers} is not a coding")
            codec, rank, bits = codecs[int(numbers[0])], int(numbers[1]), int(numbers[2])
            if lookup(tuple(shapes[name]), cfg, (codec, rank, bits)) is None:
                raise ValueError(f"encoder memo choice {name!r}: {(codec, rank, bits)} is not a candidate")
            choices[name] = (codec, rank, bits)
        lowrank = {name for name, (codec, _, _) in choices.items() if codec == "lowrank" and bases}
        if set(state["basis"]) != lowrank:
            raise ValueError("encoder memo bases do not match its low-rank choices")
        for name, basis in state["basis"].items():
            size = max(matrix_view_shape(tuple(shapes[name])))
            if (tuple(basis.shape) != (size, choices[name][1]) or basis.dtype != torch.float32
                    or not bool(torch.isfinite(basis).all())):
                raise ValueError(
                    f"encoder memo basis {name!r}: shape {tuple(basis.shape)} or values unusable"
                )
            found_bases[name] = basis.detach().clone()
        if not estimates:
            return cls(choices, found_bases)
        if set(state["estimate"]) != set(choices):
            raise ValueError("encoder memo estimates do not match its choices")
        found_estimates = {}
        for name, value in state["estimate"].items():
            count = len(candidates(tuple(shapes[name]), cfg))
            if (
                tuple(value.shape) != (count,)
                or value.dtype != torch.float32
                or not bool(torch.isfinite(value).all())
                or bool(torch.any(value < 0))
            ):
                raise ValueError(
                    f"encoder memo estimate {name!r}: shape {tuple(value.shape)} or values unusable"
                )
            found_estimates[name] = value.detach().clone()
        return cls(choices, found_bases, found_estimates)
