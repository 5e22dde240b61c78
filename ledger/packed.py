"""A sequence of byte strings held in one buffer: how a node keeps a round's chunk leaves and sum trees.

A chunked run's stage state (:class:`ledger.chunkproof.StageState`) is thousands of short byte strings a round
(a 64-element chunk is 280 bytes; a sum tree node a 32-byte hash and a 96-byte sum), kept for the rounds
behind the commit lag. As Python objects each is a block of CPython's small-object allocator, whose 1 MiB
arenas go back to the system only once every block in them is free: the states of a few rounds held while the
commits lag (issue 45's soak: a leaver's seat stalled the commits eight rounds) left the allocator's arenas at
their high-water mark for the rest of the run, a step of RSS that never came back (docs/P2P.md, "What the soak
found"). Held here, a list of leaves is two allocations that are returned whole when the round is dropped.

:class:`PackedBytes` reads as an immutable ``Sequence[bytes]``: indexing gives a new ``bytes`` (a slice gives
a list of them), iteration, ``len``, and equality with any sequence of the same strings.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import overload


class PackedBytes(Sequence[bytes]):
    """Immutable byte strings held as one concatenated buffer and their end offsets (module docstring)."""

    __slots__ = ("_data", "_ends")

    def __init__(self, items: Iterable[bytes] = ()) -> None:
        if isinstance(items, PackedBytes):
            self._data, self._ends = items._data, items._ends
            return
        items = list(items)
        ends = array("q")
        total = 0
        for item in items:
            if not isinstance(item, (bytes, bytearray, memoryview)):
                raise TypeError(f"PackedBytes holds bytes, not {type(item).__name__}")
            total += len(item)
            ends.append(total)
        self._data = b"".join(items)
        self._ends = ends

    def __len__(self) -> int:
        return len(self._ends)

    @overload
    def __getitem__(self, index: int) -> bytes: ...

    @overload
    def __getitem__(self, index: slice) -> list[bytes]: ...

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        count = len(self._ends)
        if index < 0:
            index += count
        if not 0 <= index < count:
            raise IndexError(f"index {index} outside {count} items")
        start = self._ends[index - 1] if index else 0
        return self._data[start:self._ends[index]]

    def __iter__(self) -> Iterator[bytes]:
        start = 0
        data = self._data
        for end in self._ends:
            yield data[start:end]
            start = end

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedBytes):
            return self._data == other._data and self._ends == other._ends
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes, bytearray)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # as a list: equal to lists, so not hashable

    def __reduce__(self):
        return _unpickle, (self._data, self._ends)

    def __repr__(self) -> str:
        return f"PackedBytes({len(self)} items, {len(self._data)} bytes)"


def _unpickle(data: bytes, ends: array) -> PackedBytes:
    if not isinstance(data, bytes) or not isinstance(ends, array) or ends.typecode != "q":
        raise TypeError("not a pickled PackedBytes")
    held = PackedBytes.__new__(PackedBytes)
    held._data, held._ends = data, ends
    return held

