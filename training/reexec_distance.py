"""How far a rerun's contribution is from the claimed one (training/reexec.py's comparison).

Identical payload bytes are 0.0; otherwise both are decoded for the stage and round and the distance is the
relative L2 distance of the pseudo-gradients over every tensor of the stage (float64 sums). A claim that does
not decode is infinitely far: it can never pass a tolerance.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import msgpack
import torch

from training.codec_wire import decode_contribution
from training.config import DilocoConfig
from training.errors import ContributionDecodeError
from training.slice_plan import assemble_slices, live_plan


def relative_l2(theirs: Mapping[str, torch.Tensor], ours: Mapping[str, torch.Tensor]) -> float:
    """``||theirs - ours|| / ||ours||`` over every tensor of ``ours`` (float64 sums); 0 against 0 is 0."""
    difference = sum(float((theirs[n].double() - ours[n].double()).pow(2).sum()) for n in ours)
    reference = sum(float(ours[n].double().pow(2).sum()) for n in ours)
    if reference == 0.0:
        return 0.0 if difference == 0.0 else math.inf
    return math.sqrt(difference / reference)


def contribution_distance(
    claimed: bytes,
    recomputed: bytes,
    shapes: Mapping[str, tuple[int, ...]],
    *,
    stage_index: int,
    outer_round: int,
) -> float:
    """0.0 for identical payload bytes, else the relative L2 distance of the decoded pseudo-gradients.

    ``||decode(claimed) - decode(recomputed)|| / ||decode(recomputed)||``; the norm runs over every tensor of
    the stage (float64 sums). A claimed payload that does not decode for this stage and round is infinitely
    far.
    """
    if claimed == recomputed:
        return 0.0
    try:
        theirs = decode_contribution(claimed, shapes, stage_index=stage_index, outer_round=outer_round)
    except ContributionDecodeError:
        return math.inf
    ours = decode_contribution(recomputed, shapes, stage_index=stage_index, outer_round=outer_round)
    return relative_l2(theirs, ours)


def distance_for(diloco_cfg: DilocoConfig):
    """The distance of a claimed contribution from the rerun's for the run's exchange: the sliced one's
    (slices assembled first) or the full one's."""
    if diloco_cfg.sliced:
        return functools.partial(sliced_contribution_distance, diloco_cfg=diloco_cfg)
    return contribution_distance


def sliced_contribution_distance(
    claimed: bytes, recomputed: bytes, shapes: Mapping[str, tuple[int, ...]], diloco_cfg: DilocoConfig, *,
    stage_index: int, outer_round: int
) -> float:
    """:func:`contribution_distance` of a sliced contribution (``diloco.exchange = "sliced"``): both are the
    msgpack array of the A slice blobs (what the sliced encoder returns; the verifier packs the claimant's
    from the bundle its signed reference names); each slice is decoded for its sub-shapes and the slices are
    assembled before the distance is taken. A claim that does not unpack or decode is infinitely far."""
    if claimed == recomputed:
        return 0.0
    plan = live_plan(shapes, diloco_cfg.num_replicas, diloco_cfg.min_slice_numel)

    def whole(packed: bytes) -> dict[str, torch.Tensor]:
        blobs = msgpack.unpackb(packed, raw=False)
        if (
            not isinstance(blobs, list)
            or len(blobs) != plan.num_slices
            or not all(isinstance(b, bytes) for b in blobs)
        ):
            raise ContributionDecodeError(f"not {plan.num_slices} slice blobs")
        return assemble_slices(
            [
                decode_contribution(
                    blob, plan.slice_shapes(j), stage_index=stage_index, outer_round=outer_round
                )
                for j, blob in enumerate(blobs)
            ],
            plan,
        )

    try:
        theirs = whole(claimed)
    except (ContributionDecodeError, ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError,
            msgpack.StackError):
        return math.inf
    ours = whole(recomputed)
    return relative_l2(theirs, ours)
