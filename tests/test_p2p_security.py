"""The host offers and accepts Noise + yamux only: plaintext, secio and mplex dialers are refused."""

import multiaddr
import pytest
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as create_new_x25519_key_pair
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.security.insecure.transport import PLAINTEXT_PROTOCOL_ID, InsecureTransport
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.security.secio import transport as secio
from libp2p.stream_muxer.mplex.mplex import MPLEX_PROTOCOL_ID, Mplex
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux
from libp2p.transport.tcp.tcp import TCP

from p2p.config import P2PConfig
from p2p.host import P2PHost
from p2p.identity import Identity

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    host = P2PHost.start(P2PConfig(), Identity.generate(), data_dir=tmp_path_factory.mktemp("target"))
    yield host
    host.close()


def security_options(kind, key_pair):
    if kind == "plaintext":
        return {PLAINTEXT_PROTOCOL_ID: InsecureTransport(key_pair)}
    if kind == "secio":
        return {secio.ID: secio.Transport(key_pair)}
    return {
        NOISE_PROTOCOL_ID: NoiseTransport(key_pair, noise_privkey=create_new_x25519_key_pair().private_key)
    }


def dial(target_addr, security, muxer):
    """Dial ``target_addr`` from a stock py-libp2p host restricted to one security and one muxer."""
    key_pair = create_new_key_pair()
    muxers = {YAMUX_PROTOCOL_ID: Yamux} if muxer == "yamux" else {MPLEX_PROTOCOL_ID: Mplex}
    dialer = new_host(
        key_pair=key_pair, sec_opt=security_options(security, key_pair), muxer_opt=muxers, transports=[TCP()]
    )

    async def attempt():
        async with dialer.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
            try:
                with trio.fail_after(15):
                    await dialer.connect(info_from_p2p_addr(multiaddr.Multiaddr(target_addr)))
                return True
            except trio.TooSlowError:
                raise
            except Exception:  # the refusal surfaces as one of several libp2p errors
                return False
            finally:
                await dialer.close()

    return trio.run(attempt)


def test_noise_yamux_dialer_is_accepted(target):
    assert dial(target.listen_addrs[0], "noise", "yamux") is True


@pytest.mark.parametrize("security,muxer", [("plaintext", "yamux"), ("secio", "yamux"), ("noise", "mplex")])
def test_other_security_or_muxer_is_refused(target, security, muxer):
    before = set(target.peers())
    assert dial(target.listen_addrs[0], security, muxer) is False
    assert set(target.peers()) == before


def test_host_does_not_offer_plaintext_when_dialling(target, tmp_path):
    """Our host dialling a plaintext-only listener fails too (it never falls back)."""
    key_pair = create_new_key_pair()
    listener = new_host(
        key_pair=key_pair,
        sec_opt=security_options("plaintext", key_pair),
        muxer_opt={YAMUX_PROTOCOL_ID: Yamux},
        transports=[TCP()],
    )
    outcome = {}

    async def serve_and_dial():
        async with listener.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
            addr = str(listener.get_addrs()[0])
            try:
                await trio.to_thread.run_sync(target.connect, addr, 10)
                outcome["connected"] = True
            except Exception as exc:  # the expected DialError
                outcome["error"] = exc
            await listener.close()

    trio.run(serve_and_dial)
    assert "connected" not in outcome
    assert type(outcome["error"]).__name__ in ("DialError", "P2PTimeout")
