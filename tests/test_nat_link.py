"""Run links with peers behind a NAT: relayed addresses round-trip, bogus ones are refused by name."""

import pytest

from node.commands.link import parse_run_link, relays_of, run_link
from node.errors import ConfigError

RELAY = "/ip4/203.0.113.7/tcp/4001/p2p/12D3KooWFhvohtgaaNRdphcg2YkWkoGuHRSSJLeRA3bKPtyZ5t9P"
PEER = "12D3KooWEmLVXeBBjJGvJshBzMnAjBWPK5Efb9qioDCrNp7X1HaR"
LEDGER = "0x" + "ab" * 20


def test_a_relayed_peer_round_trips_and_names_its_relay():
    relayed = f"{RELAY}/p2p-circuit/p2p/{PEER}"
    link = parse_run_link(run_link(31337, LEDGER, 1, "http://203.0.113.7:8545", [relayed, RELAY]))
    assert link.peers == (relayed, RELAY)
    assert relays_of(link.peers) == [RELAY]


@pytest.mark.parametrize("peer, says", [
    (f"{RELAY}/p2p-circuit/p2p/notapeerid", "not a peer id"),
    (f"{RELAY}/p2p-circuit/p2p/{PEER}/p2p-circuit/p2p/{PEER}", "exactly once"),
    (f"/ip4/203.0.113.7/tcp/99999/p2p/{PEER[:-1]}Z/p2p-circuit/p2p/{PEER}", "bad TCP port"),
    (f"{RELAY}/p2p-circuit/p2p/12D3KooWFhvohtgaaNRdphcg2YkWkoGuHRSSJLeRA3bKPtyZ5t9P", "same"),
])
def test_a_bogus_relayed_peer_in_a_link_is_refused(peer, says):
    with pytest.raises(ConfigError, match=says):
        parse_run_link(run_link(31337, LEDGER, 1, "http://203.0.113.7:8545", [peer]))


def test_a_hello_with_a_bogus_relayed_address_is_refused_and_a_good_one_kept():
    from node import protocol as msg

    good = msg.Hello("c0", 1, b"\x01" * 20, [f"{RELAY}/p2p-circuit/p2p/{PEER}"], 3, 2)
    assert msg.decode_payload(msg.HELLO, msg.encode_payload(good)) == good
    bogus = msg.Hello("c0", 1, b"\x01" * 20, [f"{RELAY}/p2p-circuit/p2p/{PEER}/p2p-circuit/p2p/{PEER}"], 3, 2)
    with pytest.raises(msg.ProtocolError, match="hello.addrs: .*exactly once"):
        msg.decode_payload(msg.HELLO, msg.encode_payload(bogus))
