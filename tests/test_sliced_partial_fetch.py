"""A holder of the sliced exchange fetches announced partials in the background
(node.live.exchange.partialfetch), over real libp2p hosts: a provider that does not answer holds up no other
partial, and a partial whose signer is gone comes from a live peer that holds it (one that does not answers
not_found, and costs nothing else)."""

from __future__ import annotations

import hashlib
import threading
from types import SimpleNamespace

import pytest

from node.live.exchange.partialfetch import PartialFetcher
from node.live.exchange.sliced import SlicedExchange
from p2p.backoff import RetryBook
from p2p.config import P2PConfig
from p2p.envelope import Envelope
from p2p.host import P2PHost
from p2p.identity import Identity

pytestmark = pytest.mark.timeout(180)


class SlowSignerExchange(SlicedExchange):
    """Fault injection: the fetch from one provider waits until the test lets it go (a starved signer)."""

    slow_provider = ""
    gate = threading.Event()
    slow_calls = 0

    def _fetch(self, digest, provider):
        if provider == self.slow_provider:
            type(self).slow_calls += 1
            self.gate.wait(120)
        return super()._fetch(digest, provider)


def _holder(host, tmp_path, fallback: list[str]) -> SlowSignerExchange:
    """The parts of a SlicedExchange its partial fetches use, on a real host."""
    exchange = SlowSignerExchange.__new__(SlowSignerExchange)
    exchange.host, exchange.peer_id, exchange.incoming = host, host.peer_id, tmp_path / "incoming"
    exchange.turn_timeout = 30.0
    exchange.pool = SimpleNamespace(fallback_providers=lambda: list(fallback))
    exchange._cond = threading.Condition()
    exchange._partials = PartialFetcher(exchange._fetch_partial, exchange._wake)
    return exchange


def _partial(identity: Identity, slice_index: int) -> bytes:
    return Envelope.create(identity, 7, 3, "partial", bytes([slice_index]) * 600, stage=0,
                           replica=1).to_bytes()


def test_a_slow_signer_holds_up_no_other_partial_and_a_gone_signers_partial_comes_from_a_holder(tmp_path):
    ids = {name: Identity.generate() for name in ("holder", "slow", "keeper", "bystander", "gone")}
    start = lambda name: P2PHost.start(P2PConfig(), ids[name], data_dir=tmp_path / name)  # noqa: E731
    with start("holder") as holder, start("slow") as slow, start("keeper") as keeper, \
            start("bystander") as bystander:
        gone = start("gone")
        slice0, slice1 = _partial(ids["slow"], 0), _partial(ids["gone"], 1)
        slow.provide_blob(slice0, announce=False)
        gone.provide_blob(slice1, announce=False)
        keeper.provide_blob(slice1, announce=False)  # a holder that applied it serves it on
        for peer in (slow, keeper, bystander, gone):
            holder.connect(peer.listen_addrs[0])
        gone_id = gone.peer_id
        gone.close()  # its signer left after announcing it
        exchange = _holder(holder, tmp_path, [bystander.peer_id, keeper.peer_id])
        SlowSignerExchange.slow_provider, SlowSignerExchange.slow_calls = slow.peer_id, 0
        digest0, digest1 = hashlib.sha256(slice0).digest(), hashlib.sha256(slice1).digest()
        try:
            assert exchange._partials.get(3, digest0, slow.peer_id) is None  # under way, not waited for
            # The old holder fetched on its waiting thread: slice 1 waited for slice 0's provider.
            assert exchange._partials.get(3, digest1, gone_id, wait=120) == slice1
            assert exchange._partials.in_flight(digest0)  # the slow provider still has not answered
            assert exchange._partials.get(3, digest0, slow.peer_id) is None  # one fetch at a time per partial
            assert SlowSignerExchange.slow_calls == 1
            SlowSignerExchange.gate.set()
            assert exchange._partials.get(3, digest0, slow.peer_id, wait=120) == slice0
            assert SlowSignerExchange.slow_calls == 1
            assert not bystander.has_blob(digest1.hex())  # not_found: it never held it
            exchange._partials.forget_before(4)
            assert not exchange._partials.in_flight(digest0)
        finally:
            SlowSignerExchange.gate.set()
            exchange._partials.close()


def test_a_partial_nobody_serves_is_not_fetched_in_a_loop(tmp_path):
    """A fetch that failed is tried again only after ``retry_after`` seconds, and get() says None
    meanwhile."""
    calls = []
    woken = []

    def fetch(digest, sender):
        calls.append(digest)

    fetcher = PartialFetcher(fetch, lambda: woken.append(1), retry_after=3600.0)
    try:
        assert fetcher.get(1, b"\x01" * 32, "signer", wait=0.5) is None
        while fetcher.in_flight(b"\x01" * 32):
            threading.Event().wait(0.05)
        # failed under an hour ago: not asked again
        assert fetcher.get(1, b"\x01" * 32, "signer", wait=0.2) is None
        assert len(calls) == 1 and not woken
    finally:
        fetcher.close()


def test_a_provider_whose_slice_read_failed_is_not_asked_again_on_every_pass(tmp_path):
    """An aggregator waiting for a withheld input asked its provider again on every 0.2 s pass (a retry storm:
    ~10 requests a second per slice for whole turns); now a failed read waits BUNDLE_RETRY_S."""
    import node.live.exchange.sliced_reads as reads
    from training.slicebundle import parse_slice_reference, slice_bundle

    blobs = [bytes([j]) * (400 + j) for j in range(4)]
    bundle, data = slice_bundle(blobs)
    reference = parse_slice_reference(data, 4, len(bundle))
    with P2PHost.start(P2PConfig(), Identity.generate(), data_dir=tmp_path / "holder") as holder, \
            P2PHost.start(P2PConfig(), Identity.generate(), data_dir=tmp_path / "member") as member:
        holder.connect(member.listen_addrs[0])
        asked = []

        class CountingHost:  # the real host; it counts the range requests it sends
            def __getattr__(self, name):
                return getattr(holder, name)

            def fetch_blob_range(self, *args, **kwargs):
                asked.append(args[0])
                return holder.fetch_blob_range(*args, **kwargs)

        exchange = _holder(CountingHost(), tmp_path, [])
        now = [0.0]  # the book's clock: the passes below come "at once", then BUNDLE_RETRY_S later
        exchange._read_failed = RetryBook(reads.BUNDLE_RETRY_S, clock=lambda: now[0])
        exchange.evidence_dir = tmp_path / "evidence"
        try:
            assert exchange._read_slice(reference, 2, member.peer_id) is None  # withheld: not_found
            assert len(asked) == 1
            for _ in range(5):  # the waiting loop's next passes
                assert exchange._read_slice(reference, 2, member.peer_id) is None
            assert len(asked) == 1  # not asked again
            member.provide_blob(bundle, announce=False)
            now[0] += reads.BUNDLE_RETRY_S
            assert exchange._read_slice(reference, 2, member.peer_id) == blobs[2]
        finally:
            exchange._partials.close()
