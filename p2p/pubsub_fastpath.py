"""py-libp2p's per-RPC signed peer records, made cheap (same bytes on the wire, same checks).

py-libp2p 0.8 attaches the sender's signed peer record to every pubsub RPC it sends
and verifies the one attached to every RPC it receives: on send it lists the host's
addresses (``BasicHost.get_addrs``) and re-marshals the cached record; on receive it
parses the envelope, checks its ed25519 signature and updates the peerstore. A peer
sends the same record bytes for as long as its addresses do not change, so at 16 nodes
on 2 cores these two calls were ~10% of a node's CPU (py-spy), for hellos alone.

Patched here:

* receive: a record is checked in full the first time a peer sends those exact bytes,
  and again once ``RECHECK_S`` has passed (the peerstore keeps it 2 hours); bytes that
  differ, or failed, are always checked in full;
* send: the record bytes are reused for ``SEND_CACHE_S`` before the addresses are
  listed again.

Applied by importing the module (``p2p.transport`` does).
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

import libp2p.pubsub.gossipsub as _gossipsub
import libp2p.pubsub.pubsub as _pubsub

#: A peer's unchanged record is checked in full again after this long.
RECHECK_S = 600.0
#: The local record's bytes are rebuilt (addresses listed) at most this often.
SEND_CACHE_S = 5.0
#: Records remembered as checked; the memo is cleared when it grows past this.
MAX_REMEMBERED = 4096

_original_consume = _pubsub.maybe_consume_signed_record
_original_env = _pubsub.env_to_send_in_RPC
_checked: dict[tuple[Any, bytes], float] = {}  # (peer id, record bytes) -> when checked in full
_sent: weakref.WeakKeyDictionary[Any, tuple[float, tuple[bytes, bool]]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def maybe_consume_signed_record(msg: Any, host: Any, peer_id: Any) -> bool:
    if not msg.HasField("senderRecord"):
        return True
    key = (peer_id, bytes(msg.senderRecord))
    now = time.monotonic()
    with _lock:
        when = _checked.get(key)
    if when is not None and now - when < RECHECK_S:
        return True
    ok = _original_consume(msg, host, peer_id)
    if ok:
        with _lock:
            if len(_checked) >= MAX_REMEMBERED:
                _checked.clear()
            _checked[key] = now
    return ok


def env_to_send_in_RPC(host: Any) -> tuple[bytes, bool]:
    now = time.monotonic()
    with _lock:
        cached = _sent.get(host)
    if cached is not None and now - cached[0] < SEND_CACHE_S:
        return cached[1][0], False
    result = _original_env(host)
    with _lock:
        _sent[host] = (now, result)
    return result


for _module in (_pubsub, _gossipsub):
    _module.maybe_consume_signed_record = maybe_consume_signed_record
    _module.env_to_send_in_RPC = env_to_send_in_RPC
