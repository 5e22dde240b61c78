"""A node's base and rooms for a unit test of one part: only the fakes the test gives, every other field
None."""

from __future__ import annotations

import dataclasses

from node.live.state.base import NodeBase
from node.live.rooms import Rooms


def loose_base(**given) -> NodeBase:
    """A :class:`NodeBase` holding ``given`` (``cfg`` sets ``run_id`` unless given); the rest None."""
    if "cfg" in given:
        given.setdefault("run_id", given["cfg"].ledger.run_id)
    return NodeBase(**{field.name: None for field in dataclasses.fields(NodeBase)} | given)


def loose_rooms(**given) -> Rooms:
    """A :class:`Rooms` holding ``given``; the rest None."""
    return Rooms(**{field.name: None for field in dataclasses.fields(Rooms)} | given)
