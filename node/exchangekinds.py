"""What the offline tools must know of each exchange kind, by ``diloco.exchange``, without the live node.

The live exchanges (node/live/exchange/, registry.py) take these traits as their class attributes, so
the audit and the node read one table."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True)
class ExchangeTraits:
    """One exchange kind's facts. ``holds_all_envelopes``: a holder holds (and archives) every closed
    envelope of the stages it aggregates; ``lazy_pool``: the pool fetches announced contributions only
    for the rounds and stages this node may close; ``omitted_from_document``: the [diloco] settings its run
    document leaves out (the full exchange's: the hash of every run made before the sliced one unchanged)."""

    name: str
    holds_all_envelopes: bool
    lazy_pool: bool
    omitted_from_document: tuple[str, ...] = ()


#: The kinds by ``diloco.exchange`` (docs/PROTOCOL.md, "Sliced exchange").
EXCHANGE_TRAITS: Mapping[str, ExchangeTraits] = MappingProxyType(
    {
        "full": ExchangeTraits(
            "full",
            holds_all_envelopes=True,
            lazy_pool=False,
            omitted_from_document=("exchange", "min_slice_numel"),
        ),
        "sliced": ExchangeTraits("sliced", holds_all_envelopes=False, lazy_pool=True),
    }
)


def traits_of(document: Mapping | None) -> ExchangeTraits:
    """The exchange traits a run document names (none named, or no document: the full exchange)."""
    return EXCHANGE_TRAITS[(document or {}).get("diloco", {}).get("exchange", "full")]
