"""The full exchange (``diloco.exchange = "full"``): every holder fetches every closed contribution.

Each holder of a stage fetches the closed set's envelopes (announced ones in the
background as soon as they are announced), decodes them, screens them
(docs/DILOCOX.md section 10), leaves out those built on another result of the
round before (:func:`node.binding.other_result_exclusions`, compared at the
apply, after any re-base) and takes the outer step on their average; with
the one-step delay the pure part of it is prepared while the next round trains.
"""

from __future__ import annotations

import logging
import time

from node import protocol as msg
from node.binding import other_result_exclusions
from node.fsutil import is_disk_full, report_disk_full
from node.live.exchange.parts import ContributionParts
from node.live.exchange.protocol import Exchange
from node.live.state.roundstate import StageInputs
from p2p.envelope import decode_envelope

logger = logging.getLogger(__name__)


class FullExchange(Exchange):
    """Every closed contribution to every holder (see module docstring); in parts where the run's
    ``diloco.exchange_parts`` is above 1 (:mod:`node.live.exchange.parts`)."""

    def __init__(self, base, **kwargs) -> None:
        super().__init__(base, **kwargs)
        if base.cfg.diloco.exchange_parts > 1:
            self.parts = ContributionParts(
                base.cfg.diloco.exchange_parts, messenger=self.messenger, host=self.host,
                station=self.station,
                run_id=self.run_id, max_bytes=self.max_blob_bytes, transfer_timeout=self.turn_timeout,
                streams=max(1, base.cfg.p2p.blob_concurrency), stop=self.stop)

    def gossip_handlers(self) -> dict:
        return {} if self.parts is None else {msg.PARTS_ANNOUNCE: self.parts.on_announce}

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
        screened.update(self._other_results(outer_round, stage, envelopes))
        prepared = None
        if prepare:
            prepared = worker.prepare_aggregation(stage, outer_round, payloads, screened)
            try:
                for envelope in envelopes:  # stored now (idempotent): the apply's own put then writes nothing
                    self.archive.put(outer_round, envelope)
            except OSError as exc:
                if not is_disk_full(exc):
                    raise
                report_disk_full(exc, f"round {outer_round}'s contributions archived at its apply instead "
                                      "(which waits for space)", kind="archive at prefetch")
        waited["aggregate"] += time.monotonic() - mark
        return StageInputs(close, envelopes, payloads, screened, prepared)

    def apply(self, outer_round: int, stage: int, inputs: StageInputs):
        worker = self.station.worker()
        screened = inputs.screened
        if inputs.prepared is not None and not worker.prepared_valid(stage, inputs.prepared, outer_round):
            # A re-base of round t-1 (node/live/record/forkrepair.py)
            # since the prefetch: its global state moved.
            logger.warning("round %d stage %d: prefetched aggregation is stale; aggregating again",
                           outer_round, stage)
            screened, _reports = worker.screen(outer_round, inputs.payloads)
        # Against round t-1 as it is here now (after any re-base): the record's at every honest holder.
        screened = {i: why for i, why in screened.items() if not isinstance(why, tuple)}
        screened.update(self._other_results(outer_round, stage, inputs.envelopes))
        result = worker.apply(stage, outer_round, inputs.payloads, excluded=screened,
                              prepared=inputs.prepared)
        return result, inputs.envelopes

    def _other_results(self, outer_round: int, stage: int, envelopes: list[bytes]) -> dict[int,
                                                                                           tuple[str, str]]:
        """The closed contributions built on another result of round t-1 than this holder's (left out)."""
        worker = self.station.worker()
        applied = [msg.decode_contribution_body(decode_envelope(e, self.max_blob_bytes).payload).applied_hash
                   for e in envelopes]
        return other_result_exclusions(worker.cfg.diloco, outer_round, applied, worker.global_hash(stage))
