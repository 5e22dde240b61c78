"""What this node signed in earlier lives: a restarted node says it again identically, or says nothing.

Peers keep the first envelope of every (sender, round, kind, stage) slot; a second one
with another payload is equivocation (p2p.envelope.EnvelopeValidator keeps both as
evidence, and a record signed twice is slashed on chain). A restarted node re-derives
what it finishes again (attestations of rounds it finished before, closes it adopts
from its archive), and that can come out otherwise than before the kill: a round
re-based on the chain's record after a fork (node/live/record/forkrepair.py), figures that
left with the process. So every slot this node signs is written down (the envelope,
before it is published) and, in a later life, a message for a slot it signed before
is published only if its payload is the same (signed anew: peers drop it as "the same
payload re-signed", and a peer that lost it takes it); otherwise it is not published
at all and the earlier envelope stands.

Only earlier lives are checked: within one life the node's rooms never sign two
versions of a slot (tests/adversary.py does, on purpose). Kinds that may be re-signed
freely (hellos, accusations, verdicts, partial announces) are not kept.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path

from node.fsutil import atomic_write_bytes
from p2p.envelope import Envelope, decode_envelope
from p2p.errors import P2PError

logger = logging.getLogger(__name__)

#: Rounds of signed slots kept behind the newest one written.
ROUNDS_KEPT = 128


class SaidLog:
    """The slots this node signed, on disk under ``root`` (see module docstring)."""

    def __init__(self, *, root: Path, exempt_kinds: tuple[str, ...], max_bytes: int) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.exempt_kinds = frozenset(exempt_kinds)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        #: (round, kind, stage) -> payload sha256 of what an earlier life signed (read once, at start).
        self._earlier: dict[tuple[int, str, int], bytes] = {}
        self._newest = -1
        for path in self.root.glob("*/*.env"):
            try:
                outer_round = int(path.parent.name)
                env = decode_envelope(path.read_bytes(), self.max_bytes)
            except (ValueError, OSError, P2PError) as exc:
                logger.warning("signed log: %s unreadable (%s); dropped", path, exc)
                path.unlink(missing_ok=True)
                continue
            self._earlier[(outer_round, env.kind, env.stage)] = hashlib.sha256(env.payload).digest()
            self._newest = max(self._newest, outer_round)

    def conflicts(self, outer_round: int, kind: str, stage: int, payload: bytes) -> bool:
        """Whether an earlier life signed another payload for this slot (then this one must not go out)."""
        earlier = self._earlier.get((outer_round, kind, stage))
        return earlier is not None and earlier != hashlib.sha256(payload).digest()

    def earlier(self, outer_round: int, kind: str, stage: int) -> bytes | None:
        """The envelope an earlier life signed for this slot, if it is still on disk."""
        path = self._path(outer_round, kind, stage)
        return path.read_bytes() if (outer_round, kind, stage) in self._earlier and path.exists() else None

    def write(self, envelope: Envelope, data: bytes) -> None:
        """Keep ``data`` (the signed envelope) as this slot's, before it is published."""
        if envelope.kind in self.exempt_kinds:
            return
        path = self._path(envelope.round, envelope.kind, envelope.stage)
        if (envelope.round, envelope.kind, envelope.stage) in self._earlier and path.exists():
            return  # the earlier life's envelope stays the slot's evidence
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, data, durable=False)
        with self._lock:
            if envelope.round <= self._newest:
                return
            self._newest = envelope.round
        for old in self.root.iterdir():
            if old.is_dir() and old.name.isdigit() and int(old.name) < self._newest - ROUNDS_KEPT:
                for file in old.iterdir():
                    file.unlink(missing_ok=True)
                old.rmdir()

    def _path(self, outer_round: int, kind: str, stage: int) -> Path:
        return self.root / f"{outer_round:012d}" / f"{kind}-{stage}.env"
