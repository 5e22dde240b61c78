"""The files a chunked run's spilled stage states are kept in (node/live/fraud/chunkstate.py): pickled, and
read back only by the process that wrote them (an HMAC under a key of this process's, checked first)."""

from __future__ import annotations

import hashlib
import hmac
import pickle
import secrets

#: The key of this process's spilled states: a file is unpickled only if this process wrote it (a file someone
#: else wrote or changed in the data directory, or one of an earlier life, is refused before it is read).
_SPILL_KEY = secrets.token_bytes(32)
_TAG_BYTES = 32


class SpilledStateError(ValueError):
    """A spilled state file that this process did not write as it is (changed, truncated, an earlier
    life's)."""


def encode_spilled(state) -> bytes:
    """The spilled file's bytes of ``state`` (a StageState or a thinned one), tagged with this process's
    key."""
    # pickle: this node's own file, read back only by this process, and only once the tag below shows this
    # process wrote it (never a peer's bytes); every field of the dataclass survives (a version-3 state's sum
    # trees and norm factors too).
    body = pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
    return hmac.new(_SPILL_KEY, body, hashlib.sha256).digest() + body


def decode_spilled(data: bytes):
    """A state :func:`encode_spilled` of this process wrote; raises :class:`SpilledStateError` for anything
    else."""
    tag, body = data[:_TAG_BYTES], data[_TAG_BYTES:]
    if len(tag) != _TAG_BYTES or not hmac.compare_digest(tag,
                                                         hmac.new(_SPILL_KEY, body, hashlib.sha256).digest()):
        raise SpilledStateError(
            "spilled state was not written by this process as it is (changed or truncated)")
    return pickle.loads(body)
