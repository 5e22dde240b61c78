"""The CLI's log set-up keeps py-libp2p's routine noise out of INFO logs, and keeps its real errors."""

from __future__ import annotations

import io
import logging

import pytest

from node.cli import configure_logging, tame_libp2p_logging


@pytest.fixture
def captured():
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, logging.getLogger("libp2p").level)
    stream = io.StringIO()

    def setup(level: str) -> io.StringIO:
        configure_logging(level)
        root.handlers[0].stream = stream
        tame_libp2p_logging(root.level)
        return stream

    yield setup
    root.handlers[:], root.level = saved[0], saved[1]
    logging.getLogger("libp2p").setLevel(saved[2])


def _emit() -> None:
    logging.getLogger("libp2p.transport.tcp.tcp").error(
        "Failed to open TCP stream: all attempts to connect to 127.0.0.1:30596 failed")
    logging.getLogger("libp2p.transport.tcp.tcp").error(
        "Unexpected error opening TCP stream: %s",
        "Failed to connect 10.45.2.2:4001 from 10.45.1.2:4001: [Errno 99] "
        "Cannot assign requested address")
    logging.getLogger("libp2p.transport.tcp.tcp").error("Unexpected error opening TCP stream: %s",
                                                        "KeyError('x')")
    auto = logging.getLogger("libp2p.network.auto_connector")
    auto.setLevel(logging.INFO)  # as the module does at import
    auto.info("AUTO_CONNECTOR_STATE: num_connections=0 (in_flight=0)")
    logging.getLogger("libp2p.pubsub.gossipsub").error("handler crashed: boom")
    host = logging.getLogger("libp2p.host.basic_host")
    host.error("Failed to open stream to peer 12D3KooWA:\n  Error: protocol write failed\n  Protocols: "
               "['/libp2p/autonat/1.0.0']\n  Connection State: established=False, handshake=False")
    host.error("Failed to open stream to peer 12D3KooWB:\n  Error: negotiation refused\n  Connection State: "
               "established=True, handshake=True")
    # A stream's multistream-select negotiation broken off by a reset (raised to the opener as well).
    client = logging.getLogger("libp2p.protocol_muxer.multiselect_client")
    client.error("MultiselectClient handshake: read failed: %s", "fail to read from multiselect communicator")
    client.error("MultiselectClient handshake: write failed: %s", "fail to write to multiselect communicator")
    host.error("Failed to open stream to peer 12D3KooWC:\n  Error: protocol read failed: fail to read from "
               "multiselect communicator, protocol=/ipfs/kad/1.0.0\n  Connection State: "
               "established=True, handshake=False")
    # ... but a peer answering the handshake with something else, or a negotiation timing out, is kept.
    client.error("MultiselectClient: invalid handshake %r", "/not-multistream/9")
    host.error(
        "Failed to open stream to peer 12D3KooWD:\n  Error: response timed out after 30s, protocols tried: "
        "['/libp2p/dcutr']\n  Connection State: established=True, handshake=False")
    logging.getLogger("node.live.node").info("round 1 committed")


def test_info_logs_drop_dial_failures_and_libp2p_chatter_but_keep_its_errors(captured):
    text = captured("info")
    _emit()
    out = text.getvalue()
    assert "Failed to open TCP stream" not in out and "AUTO_CONNECTOR_STATE" not in out
    # a dial failure; a bug kept
    assert "Cannot assign requested address" not in out and "KeyError('x')" in out
    assert "handler crashed: boom" in out and "round 1 committed" in out
    assert "12D3KooWA" not in out  # a stream on a closed connection: a peer that left
    assert "12D3KooWB" in out  # on a live connection: kept
    assert "fail to read from multiselect" not in out and "fail to write to multiselect" not in out
    assert "12D3KooWC" not in out  # the same broken negotiation, as the host reports it
    assert "invalid handshake" in out and "12D3KooWD" in out


def test_debug_logs_keep_everything(captured):
    text = captured("debug")
    _emit()
    out = text.getvalue()
    assert "Failed to open TCP stream" in out and "AUTO_CONNECTOR_STATE" in out and "handler crashed" in out
    assert "12D3KooWA" in out and "12D3KooWB" in out and "12D3KooWC" in out
    assert "fail to read from multiselect" in out and "fail to write to multiselect" in out
    assert "Cannot assign requested address" in out
