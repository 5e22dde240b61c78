"""The pieces of contributions a node did not aggregate, for the proof that a round listing one is wrong
(issue 62; node/live/fraud/values.py, ``piece_past_rank``): a low-rank piece past the run's ``maxRank`` does
not decode on chain, and no honest node's decoder takes it either, so an honest node never holds its pieces in
a stage state. It keeps them here instead: from a contribution it closed and left out as undecodable
(:func:`left_out_pieces`, what ``ChunkedStates.record`` keeps), or from one it rejected when it fetched it,
whose signed envelope the exchange keeps as evidence (:func:`rejected_pieces`). Both are cut without the
strict decode (training.chunks.cut_payload).
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Sequence
from pathlib import Path

from ledger.chunkproof import tree_root
from ledger.runparams import MAX_RANK
from node import protocol as msg
from node.errors import DLX_ERRORS
from node.live.fraud.values import piece_past_rank
from p2p.envelope import decode_envelope
from training.chunks import cut_payload
from training.robust import UNDECODABLE, ContributionReport
from training.spilled import shapes_of

logger = logging.getLogger(__name__)

#: What cutting a blob no decoder took can raise (msgpack's errors are ValueErrors).
CUT_ERRORS = (ValueError, KeyError, TypeError, IndexError, AttributeError, struct.error)


def left_out_pieces(reports: Sequence[ContributionReport], payloads: Sequence[bytes],
                    weights: dict) -> dict[bytes, list[bytes]]:
    """Payload root -> pieces of each contribution the round left out as undecodable whose pieces can still
    be cut (training.chunks.cut_payload) and hold a low-rank piece past the rank any run allows (the
    decoder's, ``maxRank``'s largest): what a quorum may list and the chunk proof shows. Only those are kept
    (a low-rank contribution's pieces are large: about 27 MB for a ``mini`` stage at rank 32), not the
    contributions left out for other reasons, which no piece proves."""
    shapes = shapes_of(weights)  # a state kept in a file: not read for its shapes
    kept = {}
    for report in reports:
        if report.accepted or report.reason != UNDECODABLE or not 0 <= report.index < len(payloads):
            continue
        try:
            pieces = cut_payload(payloads[report.index], shapes)
        except CUT_ERRORS:
            continue
        if piece_past_rank(pieces, MAX_RANK) is not None:
            kept[tree_root(pieces)] = pieces
    return kept


def rejected_pieces(evidence_dir: Path, outer_round: int, stage: int, shapes: dict,
                    payload_root: bytes) -> list[bytes] | None:
    """The pieces under ``payload_root`` of a contribution this node rejected when it fetched it (its signed
    envelope kept as ``round-<t>-stage<s>-<hash>.envelope`` in ``evidence_dir`` by the exchange's pool), if
    one is there; None otherwise."""
    for path in sorted(evidence_dir.glob(f"round-{outer_round:08d}-stage{stage}-*.envelope")):
        try:
            data = path.read_bytes()
            blob = msg.decode_contribution_body(decode_envelope(data, len(data)).payload).blob
            pieces = cut_payload(blob, shapes)
        except (OSError, *CUT_ERRORS, *DLX_ERRORS) as exc:
            logger.debug("rejected contribution %s not cut: %s", path.name, exc)
            continue
        if tree_root(pieces) == payload_root:
            return pieces
    return None
