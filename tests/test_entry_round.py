"""Which round a (re)starting node enters at: the round being trained when it still can, never one it cannot
train from the weights it holds (node/live/round/entry.py).

With the one-step delay round t trains from the global weights of round t - 2. A restarted node used
to enter one round after the highest round the others train, sitting out a round it could have made
(issue 30: "each replica back within two rounds"). The real runs are bench/bench_restart.py and
bench/bench_chaos.py --split; here the chain, the membership and the pipeline are stand-ins at their
boundary and the book is the real one.
"""

from __future__ import annotations

import threading

import pytest
from node_fixtures import TINY
from parts_fixtures import loose_base, loose_rooms

from node.config import load_config
from node.errors import NetworkUnreachable, StateError
from node.exitcodes import exit_code_for
from node.live.round.entry import RunEntry
from node.live.round.resume import first_contributed_round
from node.live.state.roundbook import Announced, RoundBook
from node.live.state.status import StateFile
from node.runconfig import config_hash, run_document
from node.store.checkpoint import RunLayout
from p2p.errors import P2PError
from training.schedule import pending_after_round


class Chain:
    def __init__(self, last_round: int) -> None:
        self.last = last_round

    def last_round(self, run_id: int) -> int:
        return self.last

    def checkpoints(self, run_id: int) -> list:
        return []  # none published: the node enters from its own (initial) weights


class Members:
    """The others train ``training`` (every round from ``first`` on)."""

    def __init__(self, training: int, first: int = 0) -> None:
        self.training, self.first = training, first

    def live_training_round(self, last_committed: int, window: int) -> int:
        return self.training

    def claimed_rounds(self, last_committed: int, window: int) -> list[tuple[int, int]]:
        return [(self.first, self.training)] if self.training >= 0 else []


class Worker:
    stages = (0,)

    def agree_on_round(self, proposal: int) -> int:
        return proposal


class Coordinator:
    def judge(self, outer_round, stage, coordinator, close):
        return None  # every close heard is valid


def entry(tmp_path, *, last_committed: int, training: int, book: RoundBook | None = None) -> RunEntry:
    cfg = load_config(None, [*TINY, f"data_dir={tmp_path}", "pipeline.num_stages=2"])
    state = StateFile(tmp_path / "state.json", cfg.ledger.run_id)
    base = loose_base(cfg=cfg, book=book or RoundBook(), state=state, checkpoint_dir=tmp_path / "checkpoints",
                      incoming_dir=tmp_path / "incoming", stop=threading.Event())
    rooms = loose_rooms(chain=Chain(last_committed), membership=Members(training), coordinator=Coordinator())
    return RunEntry(base, rooms, worker=Worker(), contributor=None, finisher=None)


def announce(book: RoundBook, outer_round: int, stage: int) -> None:
    book.add_announce(outer_round, stage, Announced("12D3KooWpeer", 0, b"\x01" * 32, 100))


@pytest.fixture
def delay(tmp_path) -> int:
    pending = pending_after_round(load_config(None, TINY).diloco)
    assert pending == 1, "these cases are written for the default one-step delay"
    return pending


def test_a_restarted_node_enters_the_round_being_trained_while_nobody_has_finished_it(tmp_path, delay):
    run_entry = entry(tmp_path, last_committed=5, training=7)
    start, catch_up = run_entry.entry_point()
    assert start == 7  # not 8: the others' coordinators wait for it in round 7
    assert catch_up == list(range(7))  # from its initial weights (no checkpoint here)


def test_once_a_contribution_to_the_round_is_announced_it_enters_the_next(tmp_path, delay):
    book = RoundBook()
    announce(book, 7, 1)  # a replica finished training round 7 (any stage counts)
    start, _ = entry(tmp_path, last_committed=5, training=7, book=book).entry_point()
    assert start == 8


def test_never_a_round_it_contributed_to_in_an_earlier_life(tmp_path, delay):
    run_entry = entry(tmp_path, last_committed=5, training=7)
    run_entry.state.update(last_contributed=7)
    start, _ = run_entry.entry_point()
    assert start == 8


def test_a_survivor_enters_no_round_it_cannot_train_from_the_weights_it_applied(tmp_path, delay):
    # A survivor that sat rounds out applied every round before next_round. Round t trains from the
    # weights of round t - 2: after applying round 6 (next_round 7) the earliest is round 8, even while
    # nobody has announced round 7; after applying round 5 it is round 7.
    run_entry = entry(tmp_path, last_committed=5, training=7)
    assert run_entry.agree_again(7) == 8
    assert run_entry.agree_again(6) == 7


def test_a_round_nobody_else_would_ever_close_is_still_entered(tmp_path, delay):
    # A single replica whose survivor sat round 5 out (abandoned, nothing announced): nobody else trains,
    # so round 5 is entered though the survivor applied round 4 (it would otherwise stay open forever).
    run_entry = entry(tmp_path, last_committed=3, training=-1)
    assert run_entry.agree_again(5) == 5


def test_a_node_killed_after_contributing_round_0_does_not_enter_round_0_again(tmp_path, delay):
    """bench/bench_soak.py (issue 45): with 50-200 ms links round 0 stayed open long enough for a node
    killed in its exchange to restart before anything was committed; the fresh-run shortcut put it back
    in round 0, which its earlier life had signed, and it exited ("refusing to re-sign", exit 4)."""
    for training in (-1, 0):  # the others' round 0 (or nobody's yet, as the restarted node sees it)
        run_entry = entry(tmp_path / str(training), last_committed=-1, training=training)
        run_entry.state.update(last_contributed=0)
        start, catch_up = run_entry.entry_point()
        assert start >= 1, (training, start)
        assert catch_up == list(range(start))  # round 0 is re-announced and applied, not re-signed


def test_the_open_round_of_a_run_nobody_trains_yet_is_round_0(tmp_path):
    assert entry(tmp_path, last_committed=-1, training=-1).open_round(-1) == 0


def test_a_restarted_node_declares_its_entry_round_not_an_earlier_round_it_re_announced():
    """Killed in round 4's exchange, re-entering at 7: its hellos name 7, so nobody waits for it in 5 and 6
    (bench_chaos.py --split: each of them waited out the round deadline)."""
    assert first_contributed_round(7, {4}) == 7
    assert first_contributed_round(7, set()) == 7
    # After a whole-run restart its re-announced rounds lead up to the entry round: declared from the first.
    assert first_contributed_round(6, {4, 5}) == 4
    assert first_contributed_round(6, {2, 4, 5}) == 4


def test_a_survivor_that_finished_rounds_while_waiting_enters_the_round_being_trained(tmp_path, delay):
    # It applied round 6 (next_round 7) while sitting out; it still holds the global state of round 5 (and 6):
    # round 7 trains from round 5's, so it enters the round
    # the others train (RunEntry.reenter goes back to 5).
    run_entry = entry(tmp_path, last_committed=5, training=7)
    assert run_entry.agree_again(7, held={5: {}, 6: {}}) == 7
    # only round 6's state: round 8 is the first it can train
    assert run_entry.agree_again(7, held={6: {}}) == 8
    book = RoundBook()
    announce(book, 7, 0)  # the others are done training round 7: waiting for this replica would stall them
    assert entry(tmp_path, last_committed=5, training=7, book=book).agree_again(7, held={5: {}, 6: {}}) == 8


class Published:
    def __init__(self, round_index: int) -> None:
        self.round, self.content_hash = round_index, bytes([round_index]) * 32


class PublishingChain(Chain):
    """Checkpoints of rounds 4, 5 and 6 published; none of them can be fetched here."""

    class client:
        address = "0x" + "11" * 20

    def checkpoints(self, run_id: int) -> list:
        return [Published(r) for r in (4, 5, 6)]

    def disputed_rounds(self, run_id: int, exclude: str) -> set[int]:
        return set()


class UnreachableHost:
    def fetch_blob(self, *args, **kwargs):
        raise P2PError("no provider serves it")


def test_a_restarted_node_prefers_the_checkpoint_that_lets_it_train_the_open_round(tmp_path, delay):
    # The others train round 7 and round 6 is committed: the checkpoint of round 6 would let it train round 8
    # at the earliest, the one of round 5 round 7. It tries 5, then the older 4, the newer 6 last.
    cfg = load_config(None, [*TINY, f"data_dir={tmp_path}", "pipeline.num_stages=2"])
    members = Members(7)
    members.live_providers = lambda: []
    document = run_document(cfg)
    layout = RunLayout.of_document(cfg.ledger.run_id, config_hash(document), document)  # file-hashed
    base = loose_base(cfg=cfg, book=RoundBook(), state=StateFile(tmp_path / "state.json", cfg.ledger.run_id),
                      checkpoint_dir=tmp_path / "checkpoints", incoming_dir=tmp_path / "incoming",
                      stop=threading.Event(), layout=layout)
    rooms = loose_rooms(chain=PublishingChain(6), host=UnreachableHost(), membership=members,
                        coordinator=Coordinator())
    run_entry = RunEntry(base, rooms, worker=Worker(), contributor=None, finisher=None)
    with pytest.raises(NetworkUnreachable) as refused:  # none could be fetched: exit 10, not 4 (issue 65)
        run_entry.entry_point()
    assert not isinstance(refused.value, StateError) and exit_code_for(refused.value) == 10
    tried = [part.split(":")[0] for part in str(refused.value).split(": ", 1)[1].split(" | ")]
    assert tried == ["round 5", "round 4", "round 6"]
