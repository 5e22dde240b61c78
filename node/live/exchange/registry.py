"""The exchange kinds by ``diloco.exchange`` (docs/PROTOCOL.md, "Sliced exchange"): the one table
that names them."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from node.live.exchange.full import FullExchange
from node.live.exchange.protocol import Exchange
from node.live.exchange.sliced import SlicedExchange

#: The exchange kinds by ``diloco.exchange``.
EXCHANGES: Mapping[str, type[Exchange]] = MappingProxyType({"full": FullExchange, "sliced": SlicedExchange})

