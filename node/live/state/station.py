"""Where this node works in the run: its placement, the worker that trains there, the first round it
contributes to.

A node is placed only after its peers' hellos arrived, and its worker is built
only once it is placed; the rooms that run from the start (the gossip inbox,
the exchange, the spot checks, the messages this node signs) read the station
instead of holding either. It changes three times in a life, each by one of
its own methods: placed, worker held, entered (and the first round again when
a split cluster's pipeline re-forms).
"""

from __future__ import annotations

import threading

from node.live.state.topology import Placement


#: ``first_round`` of a node sitting rounds out while its split cluster's pipeline is down (node/live/round/
#: entry.py): it contributes to no round until it re-enters, so no coordinator waits for it.
NOT_CONTRIBUTING = 2**62


class Station:
    """This node's place in the run (see module docstring); empty until :meth:`place`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._placement: Placement | None = None
        self._worker = None  # node.live.worker.replica.ReplicaWorker
        #: The first round this process contributes to (announced in hellos; -1 while joining).
        self.first_round = -1

    def place(self, placement: Placement) -> None:
        """This node's cluster formed: it sits at ``placement``."""
        with self._lock:
            self._placement = placement

    def hold(self, worker) -> None:
        """The worker of the placed stages is built (its trainers may still be starting)."""
        with self._lock:
            self._worker = worker

    def contribute_from(self, outer_round: int) -> None:
        """Announce ``outer_round`` as the first round this process contributes to."""
        self.first_round = outer_round

    def catching_up(self, outer_round: int) -> bool:
        """Whether ``outer_round`` is a round this process entered after (it catches it up, contributing
        nothing: the run closed it, or closes it, without this node), not one it sits out
        (:data:`NOT_CONTRIBUTING`)."""
        return 0 <= outer_round < self.first_round < NOT_CONTRIBUTING

    def placement(self) -> Placement | None:
        return self._placement

    def replica(self) -> int:
        """This node's replica index; -1 before it is placed (the envelopes' "no replica")."""
        placement = self._placement
        return placement.replica if placement is not None else -1

    def worker(self):
        """The :class:`~node.live.worker.replica.ReplicaWorker` (None before :meth:`hold`)."""
        return self._worker

    def held_stages(self) -> tuple[int, ...]:
        """The stages this node's worker holds; empty before it has one."""
        worker = self._worker
        return worker.stages if worker is not None else ()
