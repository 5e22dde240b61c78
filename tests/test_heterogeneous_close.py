"""A time-bounded run's close names each contribution's declared steps, and the record's ``tokens`` is their
sum (issue 44, node/live/state/closesteps.py): exact, where a fixed-H record counts H per contribution.

Real signed envelopes (p2p.envelope), real codec blobs and slice references; the coordinator's rooms are
tests/test_node_rooms.py's (a stand-in pool that holds the envelopes it is given). Last, the demo's flags for
such a run (``--round-budget``, ``--throttle``).
"""

from __future__ import annotations

import hashlib

import msgpack
import pytest
import torch
from test_node_rooms import Pool, rooms

from node import protocol as msg
from node.live.state.closesteps import close_steps, envelope_steps, record_tokens, steps_problem
from node.live.exchange.closejudge import PENDING
from node.tools.audit_rounds import _steps_range, _token_check
from node.tools.report import FAIL, OK
from p2p.envelope import Envelope
from p2p.identity import Identity
from training.codec_wire import declare_steps
from training.compression import encode_contribution
from training.config_compression import CompressionConfig
from training.slicebundle import counted_steps, slice_bundle

RANGE = (2, 8)


def _blob(steps: int | None) -> bytes:
    tensors = {"w": torch.full((4, 4), 0.5)}
    blob, _decoded, _stats = encode_contribution(tensors, CompressionConfig(enabled=False), stage_index=1,
                                                 outer_round=3)
    return blob if steps is None else declare_steps(blob, steps)


def _envelope(identity, blob: bytes, replica: int) -> bytes:
    body = msg.encode_contribution_body(msg.ContributionBody(b"s" * 32, b"d" * 32, blob))
    return Envelope.create(identity, 7, 3, msg.CONTRIBUTION, body, stage=1, replica=replica).to_bytes()


def test_a_fixed_h_close_is_the_same_bytes_and_a_budgeted_one_names_its_steps():
    entries = [[0, "peer-a", b"a" * 32, 10], [1, "peer-b", b"b" * 32, 12]]
    fixed = msg.encode_payload(msg.Close(entries))
    # no "steps" key: a fixed-H close is unchanged
    assert msgpack.unpackb(fixed) == {"contributions": entries}
    assert msg.decode_payload(msg.CLOSE, fixed) == msg.Close(entries)
    budgeted = msg.encode_payload(msg.Close(entries, [5, 0]))
    assert msg.decode_payload(msg.CLOSE, budgeted).steps == [5, 0]
    for bad in ([5], [5, -1], [5, 1 << 32], [5, True], [5, 2.0]):
        with pytest.raises(msg.ProtocolError, match="close.steps"):
            msg.decode_payload(msg.CLOSE, msgpack.packb({"contributions": entries, "steps": bad}))
    with pytest.raises(msg.ProtocolError, match="left out"):
        msg.decode_payload(msg.CLOSE, msgpack.packb({"contributions": entries, "steps": []}))
    with pytest.raises(msg.ProtocolError, match="exactly the keys"):
        msg.decode_payload(msg.CLOSE, msgpack.packb({"contributions": entries, "steps": [1, 1], "x": 1}))


def test_what_an_envelope_counts_whatever_the_exchange():
    identity = Identity.generate()
    assert envelope_steps(_envelope(identity, _blob(5), 0), RANGE) == 5
    assert envelope_steps(_envelope(identity, _blob(None), 0), RANGE) == 0  # declares nothing: bad_steps
    assert envelope_steps(_envelope(identity, _blob(9), 0), RANGE) == 0  # above H
    assert envelope_steps(b"not an envelope", RANGE) == 0
    _bundle, reference = slice_bundle([_blob(4), _blob(4)], 4)  # the sliced exchange: the reference declares
    assert envelope_steps(_envelope(identity, reference, 0), RANGE) == 4 == counted_steps(reference, RANGE)
    assert counted_steps(slice_bundle([b"a", b"b"])[1], RANGE) == 0  # a fixed-H reference


def _held(identity, counts):
    envelopes = [_envelope(identity, _blob(steps), replica) for replica, steps in enumerate(counts)]
    return {hashlib.sha256(e).digest(): e for e in envelopes}, envelopes


def test_the_coordinator_names_the_counts_and_a_holder_refuses_a_close_that_misnames_one():
    identity = Identity.generate()
    held, envelopes = _held(identity, [8, 3, 2])
    entries = [[r, f"peer-{r}", hashlib.sha256(e).digest(), len(e)] for r, e in enumerate(envelopes)]
    assert close_steps(entries, held, RANGE) == [8, 3, 2]
    assert close_steps(entries, held, None) == []
    honest = msg.Close(entries, [8, 3, 2])
    assert steps_problem(honest, held, RANGE) is None
    assert "names 5 inner steps" in steps_problem(msg.Close(entries, [8, 5, 2]), held, RANGE)
    assert "2 declared step counts for 3" in steps_problem(msg.Close(entries, [8, 3]), held, RANGE)
    assert "0 declared step counts" in steps_problem(msg.Close(entries), held, RANGE)
    assert "fixed-H" in steps_problem(honest, held, None)
    assert steps_problem(msg.Close(entries, [8, 5, 2]), {}, RANGE) is None  # nothing held here shows it


class HeldPool(Pool):
    def __init__(self, held: dict[bytes, bytes]) -> None:
        super().__init__()
        self.envelopes = held

    def have(self, _round, _stage) -> dict:
        return dict(self.envelopes)


def test_the_judge_refuses_a_misnamed_count_where_it_holds_the_envelope():
    identity = Identity.generate()
    _book, _membership, _pool, coordinator = rooms()
    held, envelopes = _held(identity, [8, 3])
    pool = HeldPool(held)
    coordinator.contributions, coordinator.steps_range = pool, RANGE
    peers = ["peer-a", "peer-b"]
    entries = [[r, peers[r], hashlib.sha256(e).digest(), len(e)] for r, e in enumerate(envelopes)]
    pool.held.update((r, peers[r], entries[r][2]) for r in range(2))
    assert coordinator.judge(3, 1, "c-good", msg.Close(entries, [8, 3])) is None
    assert "names 7 inner steps" in coordinator.judge(3, 1, "c-lies", msg.Close(entries, [8, 7]))
    assert "declared step counts" in coordinator.judge(3, 1, "c-none", msg.Close(entries))
    pool.lazy = True  # the sliced exchange: only the form is judged (holders hold different envelopes)
    assert coordinator.judge(3, 1, "c-lazy", msg.Close(entries, [8, 7])) == PENDING  # waits for announces


def test_the_record_counts_what_was_declared_and_the_audit_recomputes_it():
    close = msg.Close([[0, "a", b"a" * 32, 1], [1, "b", b"b" * 32, 1], [2, "c", b"c" * 32, 1]], [8, 3, 0])
    assert record_tokens(close, 8, 64, budgeted=True) == 11 * 64
    # fixed H: as before
    assert record_tokens(msg.Close(close.contributions), 8, 64, budgeted=False) == 3 * 8 * 64
    document = {"diloco": {"inner_steps": 8, "round_budget_s": 2.0, "min_inner_steps": 2},
                "training": {"batch_size": 4}, "model": {"block_size": 16}}
    assert _steps_range(document) == RANGE and _steps_range({"diloco": {"inner_steps": 8}}) is None
    payloads = [_blob(8), _blob(3), b""]  # b"": an absent input of the sliced exchange counts nothing

    class Commit:
        tokens = 11 * 64

    assert _token_check(Commit, payloads, RANGE, document).status == OK
    Commit.tokens = 3 * 8 * 64  # H per contribution: an upper bound, no longer the record's figure
    check = _token_check(Commit, payloads, RANGE, document)
    assert check.status == FAIL and "declare 704" in check.reason


# ----------------------------------------------------------------------------- the demo's flags


def _demo_args(**overrides):
    import argparse

    fields = dict(replicas=3, stages=1, rounds=2, inner_steps=20, preset="tiny", checkpoint_every=1, data="",
                  round_budget=0.0, min_inner_steps=None, throttle=None)
    fields.update(overrides)
    return argparse.Namespace(**fields)


def test_the_demo_bounds_rounds_by_time_and_refuses_bad_flags_by_name():
    from node.commands.demo import _budget_settings, _throttled
    from node.errors import ConfigError

    base = ["model.preset=tiny", "diloco.inner_steps=20"]
    assert _budget_settings(_demo_args(), base) == []
    # The fewest steps default to one more than the exchange overlaps (auto: H // 10 = 2 of 20).
    assert _budget_settings(_demo_args(round_budget=3.0), base) == ["diloco.round_budget_s=3.0",
                                                                    "diloco.min_inner_steps=3"]
    assert _budget_settings(_demo_args(round_budget=3.0, min_inner_steps=5),
                            base)[1] == "diloco.min_inner_steps=5"
    for bad in (dict(round_budget=-1.0), dict(min_inner_steps=4)):
        with pytest.raises(ConfigError, match="--round-budget"):
            _budget_settings(_demo_args(**bad), base)
    assert _throttled(_demo_args()) == {}
    with pytest.raises(ConfigError, match="positive number of CPUs"):
        _throttled(_demo_args(throttle=0.0))
    with pytest.raises(ConfigError, match="--replicas 2 or more"):
        _throttled(_demo_args(throttle=0.5, replicas=1))


def test_the_demo_throttles_the_last_replica_where_the_cpu_controller_is_writable():
    from node.commands.demo import _throttled
    from node.commands.throttle import unavailable
    from node.errors import ConfigError

    reason = unavailable()
    if reason is None:
        assert _throttled(_demo_args(throttle=0.25)) == {2: 0.25}
    else:  # not root, or no cgroup v1: refused with the reason
        with pytest.raises(ConfigError, match="needs root"):
            _throttled(_demo_args(throttle=0.25))
