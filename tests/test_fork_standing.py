"""When a round's result can be relied on before the chain's verdict (node/live/record/forkrepair.py).

docs/PROTOCOL.md, "The rounds a fork touched". Two things wait on how round t stands: the apply of
round t+1 (``ForkRepair.due``: a forked round t is re-based in place, never found only after round
t+1 was applied on it) and the announcement of a round whose start state holds round t
(``ForkRepair.announceable``: round t+2 with the delay; without the overlap it binds no applied
result, so nothing but this rule keeps a round begun on a forked result out of the record). Both wait
until the chain's verdict of round t is here or the attestations heard confirm this node's result
(``attested_standing``), at most a round timeout; the announcement is withheld on a forked round and
when the wait runs out. The real runs are tests/test_fork_no_overlap_e2e.py and
tests/test_fork_recovery_e2e.py; here the round book, round state and config are real, the chain,
the station, the coordinator and the membership stand-ins at their boundary. A wait that must end on
a verdict runs under a long round timeout, so only the verdict can end it: no outcome depends on timing.
"""

from __future__ import annotations

import math
import threading

import pytest
from node_fixtures import TINY
from parts_fixtures import loose_base

from ledger.errors import ChainUnavailable
from ledger.merkle import merkle_root
from node import protocol as msg
from node.config import load_config
from node.live.record.forkrepair import ForkRepair
from node.live.record.standing import (AGREED, CONFIRMED, CONTESTED, FORKED, NOT_OURS, PENDING,
                                      attested_standing)
from node.live.state.roundbook import RoundBook
from node.live.state.roundstate import RoundState
from node.live.state.status import StateFile

OURS, THEIRS = (b"\x0a" * 32, b"\x0b" * 32), (b"\x0c" * 32, b"\x0d" * 32)  # (weights hash, root)
ME, PEER_A, PEER_B = "peer-me", "peer-a", "peer-b"


def test_the_attestations_confirm_a_result_only_a_quorum_names_and_no_other_result_could_gather_one():
    assert attested_standing(OURS, {OURS: 2, THEIRS: 1}, threshold=2) == CONFIRMED  # an honest member
    assert attested_standing(OURS, {OURS: 1, THEIRS: 2}, threshold=2) == CONTESTED  # the forked member
    assert attested_standing(OURS, {OURS: 1}, threshold=2) == PENDING  # the peers' attestations not here yet
    assert attested_standing(OURS, {OURS: 1, THEIRS: 1}, threshold=2) == CONTESTED  # as often as ours
    # two quorums: the chain decides
    assert attested_standing(OURS, {OURS: 2, THEIRS: 2}, threshold=2) == CONTESTED
    # A quorum of one: any other result heard could be committed as well.
    assert attested_standing(OURS, {OURS: 2, THEIRS: 1}, threshold=1) == CONTESTED
    assert attested_standing(OURS, {OURS: 1}, threshold=1) == CONFIRMED  # a member alone in its round
    assert attested_standing(OURS, {THEIRS: 1}, threshold=2) == CONTESTED  # our own attestation not filed
    assert attested_standing(OURS, {}, threshold=2) == PENDING


class Chain:
    def __init__(self, quorum: int | None = 2) -> None:
        self.quorum = quorum

    def quorum_of(self, run_id: int) -> int:
        if self.quorum is None:
            raise ChainUnavailable("the RPC is down")
        return self.quorum


class Station:
    first_round = 0  # this process contributed from round 0 on (no catch-up)

    def held_stages(self):
        return (0,)


class Coordinator:
    def __init__(self, closes: dict[int, msg.Close]) -> None:
        self.closes = closes

    def accepted(self, outer_round: int, stage: int):
        return self.closes.get(outer_round)


class Membership:
    peer_id = ME

    def __init__(self, alive: set[str]) -> None:
        self._alive = alive

    def alive(self) -> set[str]:
        return set(self._alive)


class SlicedExchange:
    holds_all_envelopes = False  # the record cannot be re-derived here: a verdict of "forked" re-enters


class Lifecycle:
    def __init__(self) -> None:
        self.diverged_rounds: list[int] = []

    def diverged(self, outer_round: int) -> None:
        self.diverged_rounds.append(outer_round)


def attestation(result: tuple[bytes, bytes]) -> msg.Attestation:
    return msg.Attestation(result[0], result[1], 3, math.nan, math.nan, 0, b"", b"")


def close_of(*peers: str) -> msg.Close:
    return msg.Close([(replica, peer, bytes([replica + 1]) * 32, 100) for replica, peer in enumerate(peers)])


def forks_at(tmp_path, *, attested: dict[str, str], alive=(PEER_A, PEER_B), quorum: int | None = 2,
             round_timeout: float = 600.0, settings=()) -> tuple[ForkRepair, RoundBook]:
    """A node that computed round 2 (its weights OURS[0], on a close of itself and both peers) and heard
    ``attested`` (peer -> "ours" or "theirs") of it."""
    cfg = load_config(None, [*TINY, f"round_timeout={round_timeout}", f"data_dir={tmp_path}", *settings])
    book, rounds = RoundBook(), RoundState(station=None)
    close = close_of(ME, PEER_A, PEER_B)
    rounds.stage_hashes[2] = {0: OURS[0]}
    results = {"ours": (OURS[0], merkle_root([entry[2] for entry in close.contributions])), "theirs": THEIRS}
    for peer, result in attested.items():
        book.add_attestation(2, 0, peer, attestation(results[result]))
    base = loose_base(cfg=cfg, station=Station(), book=book, rounds=rounds, stop=threading.Event(),
                      state=StateFile(tmp_path / "state.json", cfg.ledger.run_id))
    forks = ForkRepair(base, chain=Chain(quorum), coordinator=Coordinator({2: close}),
                       exchange=SlicedExchange(), lifecycle=Lifecycle(), membership=Membership(set(alive)))
    forks.agreed(0)  # the committer's verdict of an earlier round: it reads the chain's quorum then
    return forks, book


def later(action, *args) -> threading.Thread:
    """``action(*args)`` on another thread, once the main thread is waiting (any moment will do)."""
    thread = threading.Thread(target=action, args=args)
    thread.start()
    return thread


def test_an_honest_member_announces_and_applies_at_once_when_a_quorum_attests_its_result(tmp_path):
    forks, _book = forks_at(tmp_path, attested={ME: "ours", PEER_A: "ours", PEER_B: "theirs"})  # B forked
    assert forks.standing(2, "test") == CONFIRMED
    assert forks.announceable(4)  # round 4 began on round 2: announced without the chain's verdict
    assert forks.due(3) == []


def test_a_forked_member_holds_round_t_plus_2_until_the_verdict_and_then_withholds_it(tmp_path):
    forks, _book = forks_at(tmp_path, attested={ME: "ours", PEER_A: "theirs", PEER_B: "theirs"})
    assert forks._standing_now(2) == CONTESTED
    verdict = later(forks.diverged, 2, None, None, None)  # the chain's record differs from ours
    assert not forks.announceable(4)  # only the verdict ends the wait (the round timeout is 600 s)
    verdict.join()
    assert forks.standing(2, "test") == FORKED and forks.lifecycle.diverged_rounds == [2]
    assert forks.announceable(3)  # round 3 began on round 1, which stands (nothing of it computed here)


def test_a_member_whose_peers_have_not_attested_yet_waits_for_them_or_for_the_verdict(tmp_path):
    forks, book = forks_at(tmp_path, attested={ME: "ours"})
    assert forks._standing_now(2) == PENDING
    peer = later(book.add_attestation, 2, 0, PEER_A, book.snapshot_attestations(2, 0)[ME])
    assert forks.announceable(4)  # a second attestation of our result: a quorum of 2
    peer.join()
    forks, _book = forks_at(tmp_path, attested={ME: "ours"})
    verdict = later(forks.agreed, 2)
    assert forks.due(3) == [] and forks.standing(2, "test") == AGREED
    verdict.join()


def test_a_verdict_that_never_comes_withholds_the_round_after_the_round_timeout(tmp_path):
    forks, _book = forks_at(tmp_path, attested={ME: "ours", PEER_A: "theirs"}, round_timeout=0.3)
    assert not forks.announceable(4)
    assert forks.due(3) == []  # the apply goes on (a fork found later re-enters from the chain)


def test_the_threshold_is_the_chains_quorum_of_the_close_members_still_present(tmp_path):
    # Both peers gone (a dead partner): this node alone attests, and waits on nobody.
    forks, _book = forks_at(tmp_path, attested={ME: "ours"}, alive=())
    assert forks.standing(2, "test") == CONFIRMED
    # The RPC was down since the start and the quorum was
    # never read: every present member of the close attests.
    forks, _book = forks_at(tmp_path, attested={ME: "ours", PEER_A: "ours"}, quorum=None, round_timeout=0.3)
    assert forks.standing(2, "test") == PENDING
    forks, _book = forks_at(tmp_path, attested={ME: "ours", PEER_A: "ours", PEER_B: "ours"}, quorum=None)
    assert forks.standing(2, "test") == CONFIRMED


@pytest.mark.parametrize(("settings", "begun_on_round_2"), [((), 4), (("diloco.overlap_steps=2",), 4),
                                                            (("diloco.one_step_delay=false",), 3)])
def test_the_round_judged_is_the_one_the_start_state_holds(tmp_path, settings, begun_on_round_2):
    forks, _book = forks_at(tmp_path, attested={ME: "ours", PEER_A: "theirs", PEER_B: "theirs"},
                            round_timeout=0.3, settings=settings)
    assert not forks.announceable(begun_on_round_2)  # begun on the contested round 2
    assert forks.announceable(1) and forks.announceable(0)  # begun on the initial weights
    assert forks.standing(5, "test") == NOT_OURS  # a round this life did not compute: nothing to hold


def test_a_round_caught_up_after_a_restart_is_not_waited_on(tmp_path):
    # Its peers attested round 2 long before this life, and may not send it again: nothing confirms it here.
    forks, _book = forks_at(tmp_path, attested={ME: "ours"})
    forks.station.first_round = 3  # the restarted node entered at round 3, catching up round 2
    assert forks.standing(2, "test") == NOT_OURS and forks.announceable(4)


def test_the_state_before_a_round_is_let_go_once_the_chain_agrees_with_the_round(tmp_path):
    """A base is held only until the chain's verdict of its round (issue 75: each is 2 x the stage's bytes on
    disk); a round not settled yet keeps its own, and a fork of it still finds it."""
    forks, _book = forks_at(tmp_path, attested={PEER_A: "ours", PEER_B: "ours"})
    for outer_round in (2, 3, 4):
        forks.remember_base(outer_round, 0, ({"w": outer_round}, {"m": outer_round}))
    forks.agreed(3)
    assert not forks.holds_base(3)
    assert forks.holds_base(2) and forks.holds_base(4)
    forks.agreed(2)
    assert not forks.holds_base(2) and forks.holds_base(4)
