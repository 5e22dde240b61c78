"""When a node whose round left the committed record disputes it (node/live/record/forkrepair.py).

A round computed on weights the record never had (the round before had already forked and was not
re-based) says nothing about the record: disputing it would accuse an honest quorum. Seen in
tests/test_fork_reentry_e2e.py before the rule: a member that forked in round 2 and applied round 3
on top disputed round 3. The real run is that test; here the chain, the exchange and the lifecycle
are stand-ins at their boundary (the record cannot be re-derived: the sliced exchange's case).
"""

from __future__ import annotations

import threading

from node_fixtures import TINY
from parts_fixtures import loose_base

from ledger.records import RoundRecord
from node.config import load_config
from node.live.record.forkrepair import ForkRepair
from node.live.state.status import StateFile

RECORD_ROOT = {2: b"\x02" * 32, 3: b"\x03" * 32}


class Chain:
    def __init__(self) -> None:
        self.disputed: list[int] = []

    def commit_of(self, run_id: int, round_index: int):
        return record(round_index, RECORD_ROOT[round_index]) if round_index in RECORD_ROOT else None

    def dispute(self, mine, signature) -> None:
        self.disputed.append(mine.round)


class SlicedExchange:
    holds_all_envelopes = False  # the record cannot be re-derived here


class Lifecycle:
    def __init__(self) -> None:
        self.diverged_rounds: list[int] = []

    def diverged(self, outer_round: int) -> None:
        self.diverged_rounds.append(outer_round)


def record(outer_round: int, weights_root: bytes) -> RoundRecord:
    return RoundRecord(run_id=1, round=outer_round, prev_head=b"\x00" * 32, weights_root=weights_root,
                       contributions_root=b"\x00" * 32, train_loss_micro=0, eval_loss_micro=0, tokens=0,
                       num_contributors=2)


def repair(tmp_path, own_round_2_root: bytes) -> tuple[ForkRepair, Chain, Lifecycle]:
    cfg = load_config(None, [*TINY, f"data_dir={tmp_path}"])
    state = StateFile(tmp_path / "state.json", cfg.ledger.run_id)
    state.record_round(2, own_round_2_root, False)
    chain, lifecycle = Chain(), Lifecycle()
    forks = ForkRepair(loose_base(cfg=cfg, state=state, stop=threading.Event()), chain=chain,
                       coordinator=None, exchange=SlicedExchange(), lifecycle=lifecycle, membership=None)
    return forks, chain, lifecycle


def test_a_round_computed_on_forked_weights_is_not_disputed(tmp_path):
    forks, chain, lifecycle = repair(tmp_path, own_round_2_root=b"\xff" * 32)  # round 2 had forked
    assert forks.left_record_before(3)
    forks.diverged(3, record(3, RECORD_ROOT[3]), record(3, b"\x33" * 32), signature=b"\x01" * 65)
    assert chain.disputed == []
    assert lifecycle.diverged_rounds == [3]  # it still re-enters from the chain


def test_a_round_computed_on_the_records_weights_is_disputed_when_it_cannot_be_re_derived(tmp_path):
    forks, chain, lifecycle = repair(tmp_path, own_round_2_root=RECORD_ROOT[2])
    assert not forks.left_record_before(3)
    forks.diverged(3, record(3, RECORD_ROOT[3]), record(3, b"\x33" * 32), signature=b"\x01" * 65)
    assert chain.disputed == [3]
    assert lifecycle.diverged_rounds == [3]
