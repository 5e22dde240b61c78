"""Whether a claim's end is what the contribution's payload codes, checked by the node before it claims (issue
78; docs/FRAUD_PROOF.md "The claim's end", "The node defends its contributions").

In a run with the plain end rule (StepProver ``endRuleOf`` 1) anyone may dispute one element of a run claim's
end: the defender must show that the contribution's payload piece of that element's chunk codes ``v = fl(S -
E)`` (``S`` the committed start, ``E`` the claim's end) and loses the game, and the claim, where it does not.
:func:`end_breaks` runs that check (StepProverMath ``endHolds``, the reference training/end_relation.py) on
every element of every state tensor of the program from the payload pieces themselves, so a node that would
lose an end dispute posts no claim (its bond would go to the first challenger naming the element) and says
why. :func:`piece_bits` names each state tensor's quant bit width for the defender's answers (the piece does
not carry it).
"""

from __future__ import annotations

import math
import struct

import numpy as np
import torch
from eth_abi import decode

from ledger.stepproof import ZERO_START
from training.chunks import CHUNK_ELEMENTS, CODEC_TAGS
from training.codec_exact import qmax

_PIECE_HEAD = struct.Struct(">BI")
_TINY = torch.finfo(torch.float32).tiny
#: The widest quant code StepProver takes (``bits`` 1 to 16).
MAX_BITS = 16


def _origin(leaf: bytes) -> tuple[int, int, int, int]:
    return tuple(decode(["uint32", "uint64", "uint64", "uint64"], leaf))


def _tensor_pieces(pieces, first: int, numel: int) -> tuple[int, np.ndarray, np.ndarray | None]:
    """The codec tag of state tensor elements ``0 .. numel - 1`` held in the pieces from chunk ``first`` on,
    and their values (raw: the float32 bit patterns; quant: ``q``, then each element's column scale's bits);
    ``(tag, empty, None)`` for pieces of mixed codecs or counts that do not fit (no element checks)."""
    tags, values, scales = set(), [], []
    for i in range(math.ceil(numel / CHUNK_ELEMENTS)):
        piece = bytes(pieces[first + i]) if first + i < len(pieces) else b""
        if len(piece) < _PIECE_HEAD.size:
            return -1, np.empty(0), None
        tag, count = _PIECE_HEAD.unpack_from(piece)
        if count != min(CHUNK_ELEMENTS, numel - i * CHUNK_ELEMENTS):
            return -1, np.empty(0), None
        tags.add(tag)
        body = piece[_PIECE_HEAD.size:]
        if tag == CODEC_TAGS["raw"] and len(body) == 4 * count:
            values.append(np.frombuffer(body, dtype=">u4"))
        elif tag == CODEC_TAGS["quant"] and len(body) == 6 * count:
            values.append(np.frombuffer(body[:2 * count], dtype=">i2"))
            scales.append(np.frombuffer(body[2 * count:], dtype=">u4"))
        else:
            return -1, np.empty(0), None
    if len(tags) != 1:
        return -1, np.empty(0), None
    tag = tags.pop()
    return tag, np.concatenate(values), np.concatenate(scales) if scales else None


def piece_bits(pieces, origins: list[bytes]) -> list[int]:
    """Each state tensor's quant bit width to name in its end disputes (0: raw, or no piece): the least ``b``
    whose ``qmax(b)`` holds every ``|q|`` of its elements. An honest encoder's width ``b'`` codes the same
    pieces under it: an element clamped at ``qmax(b')`` makes the least width ``b'`` itself, and an element
    not clamped is its exact rounding under any width that holds it."""
    out = []
    for leaf in origins:
        tensor, numel, first, _chunks = _origin(leaf)
        if tensor == ZERO_START:
            out.append(0)
            continue
        tag, values, _scales = _tensor_pieces(pieces, first, numel)
        if tag != CODEC_TAGS["quant"]:
            out.append(0)
            continue
        top = int(np.abs(values.astype(np.int32)).max()) if values.size else 0
        out.append(next((b for b in range(1, MAX_BITS + 1) if qmax(b) >= top), MAX_BITS))
    return out


def end_breaks(start: list[torch.Tensor], end: list[torch.Tensor], pieces, origins: list[bytes],
               bits: list[int], limit: int = 4) -> list[tuple[int, int, str]]:
    """The elements ``(state tensor, element, why)`` (at most ``limit``) of the end ``end`` whose payload
    piece (``pieces``: the contribution's, one per stage chunk) does not code ``fl(start - end)`` as
    ``proveEnd`` checks it (raw: the same bits, two NaNs agreeing; quant: ``clamp(rne(fl(v / max(x, tiny))),
    -qmax(b), qmax(b))``, ``b`` from ``bits``); a low-rank piece codes nothing. Empty: every end dispute is
    answered."""
    broken: list[tuple[int, int, str]] = []
    for q, leaf in enumerate(origins):
        tensor, numel, first, _chunks = _origin(leaf)
        if tensor == ZERO_START:
            continue  # the payload codes none of it: no opening is needed
        s, e = (t.reshape(-1)[:numel].to(torch.float32) for t in (start[q], end[q]))
        v = torch.sub(s, e)
        tag, values, scales = _tensor_pieces(pieces, first, numel)
        if tag == CODEC_TAGS["raw"]:
            sent = values.astype(np.uint32)
            mine = v.contiguous().view(torch.int32).numpy().view(np.uint32)
            nan = np.isnan(sent.view(np.float32)) & np.isnan(v.numpy())
            wrong = ~((sent == mine) | nan)
            why = "raw piece is not fl(S - E)"
        elif tag == CODEC_TAGS["quant"] and 1 <= bits[q] <= MAX_BITS:
            x = torch.from_numpy(scales.astype(np.uint32).view(np.float32).copy())
            top = float(qmax(bits[q]))
            expected = torch.clamp(torch.round(torch.div(v, x.clamp_min(_TINY))), -top, top).numpy()
            wrong = ~(expected == values.astype(np.float32))
            why = f"quant piece ({bits[q]} bits) is not the coding of fl(S - E)"
        else:
            wrong = np.ones(numel, dtype=bool)
            why = "the piece codes no element (low-rank, or not the stage's chunks)"
        for elem in np.flatnonzero(wrong)[:max(0, limit - len(broken))]:
            broken.append((q, int(elem), why))
    return broken
