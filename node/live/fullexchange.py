"""The full exchange (``diloco.exchange = "full"``): every holder fetches every closed contribution.

Each holder of a stage fetches the closed set's envelopes (announced ones in the
background as soon as they are announced), decodes them, screens them
(docs/DILOCOX.md section 10) and takes the outer step on their average; with
the one-step delay the pure part of it is prepared while the next round trains.
"""

from __future__ import annotations

import logging
import time

from node import protocol as msg
from node.live.exchange import Exchange
from node.live.roundstate import StageInputs
from p2p.envelope import decode_envelope

logger = logging.getLogger(__name__)


class FullExchange(Exchange):
    """Every closed contribution to every holder (see module docstring)."""

    def check_blob(self, stage: int, outer_round: int, blob: bytes) -> None:
        self.station.worker().check_contribution(stage, outer_round, blob)

    def contribution_blob(self, outer_round: int, stage: int, blob: bytes) -> bytes:
        return blob

    def gather(self, outer_round: int, stage: int, close: msg.Close, waited: dict[str, float],
               prepare: bool) -> StageInputs:
        worker = self.station.worker()
        mark = time.monotonic()
        envelopes = self.pool.collect(outer_round, stage, close)
        waited["fetch_wait"] += time.monotonic() - mark
        mark = time.monotonic()
        payloads = [msg.decode_contribution_body(decode_envelope(e, self.max_blob_bytes).payload).blob
                    for e in envelopes]
        screened, _reports = worker.screen(outer_round, payloads)
        prepared = None
        if prepare:
            prepared = worker.prepare_aggregation(stage, outer_round, payloads, screened)
            for envelope in envelopes:  # stored now (idempotent): the apply's own put then writes nothing
                self.archive.put(outer_round, envelope)
        waited["aggregate"] += time.monotonic() - mark
        return StageInputs(close, envelopes, payloads, screened, prepared)

    def apply(self, outer_round: int, stage: int, inputs: StageInputs):
        worker = self.station.worker()
        screened = inputs.screened
        if inputs.prepared is not None and not worker.prepared_valid(stage, inputs.prepared, outer_round):
            # (Never in the loop's order: nothing applies a round between the prefetch and here.)
            logger.warning("round %d stage %d: prefetched aggregation is stale; aggregating again",
                           outer_round, stage)
            screened, _reports = worker.screen(outer_round, inputs.payloads)
        result = worker.apply(stage, outer_round, inputs.payloads, excluded=screened, prepared=inputs.prepared)
        return result, inputs.envelopes
