"""Where a contribution's batches come from, as the chain recomputes it (issue 78; docs/FRAUD_PROOF.md "The
data's binding"): training/data_binding.py draws the batches by it, ledger/stepdata.py opens them, and
StepProverMath.windowOffset and batchDepth compute the same in the contract.

Row ``row`` of step ``step``'s batch of the contribution made by member account ``key`` (20 bytes) in round
``round`` is the window of the training split at::

    offset = u64be(sha256(b"dlx-node/round-batches/v2" || u64be(seed) || key || u64be(round)
                          || u64be(step) || u64be(row))[:8]) % n_start

(``n_start`` the split's length less the block size). A claim commits its steps' batches as a full tree of
``2**batch_depth(steps)`` 32-byte leaves (:func:`batch_words`), leaf ``k`` step ``k``'s token tensor root.
"""

from __future__ import annotations

import hashlib
import struct

WINDOWS_DOMAIN = b"dlx-node/round-batches/v2"
_U64_MAX = 2**64 - 1


def window_offset(seed: int, key: bytes, round_: int, step: int, row: int, n_start: int) -> int:
    """The window offset of row ``row`` of step ``step`` (module docstring); ValueError for a key that is not
    20 bytes, an integer outside [0, 2**64) or no window start."""
    key = bytes(key)
    if len(key) != 20:
        raise ValueError(f"a data key is a 20-byte account, not {len(key)} bytes")
    for name, value in (("seed", seed), ("round", round_), ("step", step), ("row", row)):
        if not 0 <= value <= _U64_MAX:
            raise ValueError(f"{name}={value}: must be in [0, 2**64)")
    if n_start < 1:
        raise ValueError(f"no valid window start (n_start={n_start})")
    digest = hashlib.sha256(WINDOWS_DOMAIN + struct.pack(">Q", seed) + key
                            + struct.pack(">QQQ", round_, step, row)).digest()
    return int.from_bytes(digest[:8], "big") % n_start


def batch_depth(steps: int) -> int:
    """ceil(log2 steps): the depth of a claim's batch tree (0 for one step)."""
    return max(0, (steps - 1).bit_length())


def batch_words(step_roots: list[bytes]) -> list[bytes]:
    """The batch tree's leaves: each step's token tensor root, then zero words up to ``2**batch_depth``."""
    return list(step_roots) + [bytes(32)] * ((1 << batch_depth(len(step_roots))) - len(step_roots))
