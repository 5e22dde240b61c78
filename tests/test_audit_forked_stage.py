"""The audit's item for a contribution built on another result of round t-1 (a forked member's round).

A split replica forks stage by stage: each stage's member aggregates its own close and its own fork repair
re-bases it, so when one member took a close the record does not hold, only that stage's next contribution is
built elsewhere, and the holders leave only it out (reason ``other_result``); the partner stage, built on the
record, is aggregated. The soak of issue 45 (docs/P2P.md, "What the soak found") had exactly this at round 13:
the audit wanted the whole replica left out and FAILED an honest run. Real node archives
(node.store.archive.Archive, as the nodes seal them), read by the audit's own ReexecAuditor.
"""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

from node.store.archive import Archive, ArchivedContribution
from node.tools.audit_reexec import ReexecAuditor
from node.tools.audit_reexec_checks import built_elsewhere_check
from node.tools.report import FAIL, OK, UNVERIFIABLE

RUN_ID, ROUND = 1, 13
PEERS = {(0, 0): "peer-solo", (1, 0): "peer-solo", (0, 2): "peer-split-s0", (1, 2): "peer-split-s1"}


def _sealed(tmp_path, left_out_stages: tuple[int, ...]):
    """Three archives of round 13 as the soak's nodes sealed it: replica 0 (one node, both stages) and the two
    members of split replica 2; every holder of a stage whose replica-2 contribution is in ``left_out_stages``
    records it as excluded ``other_result``. Returns the archive directories."""
    envelopes = {key: f"envelope {key}".encode() for key in PEERS}
    hashes = {key: hashlib.sha256(data).digest() for key, data in envelopes.items()}
    holders = {"solo": [(0, 0), (1, 0), (0, 2), (1, 2)], "split-s0": [(0, 0), (0, 2)],
               "split-s1": [(1, 0), (1, 2)]}
    dirs = []
    for name, held in holders.items():
        root = tmp_path / name
        archive = Archive(root / "archive", RUN_ID)
        for key in held:
            archive.put(ROUND, envelopes[key])
        excluded = [[stage, replica, PEERS[(stage, replica)], hashes[(stage, replica)].hex(), "other_result",
                     "built on another result of round 12"]
                    for stage, replica in held if replica == 2 and stage in left_out_stages]
        archive.seal_round(ROUND, [ArchivedContribution(stage, replica, PEERS[(stage, replica)],
                                                        hashes[(stage, replica)]) for stage, replica in held],
                           excluded)
        dirs.append(root)
    return dirs


def _item(tmp_path, left_out_stages, forked_stages):
    auditor = ReexecAuditor(SimpleNamespace(cfg=None), _sealed(tmp_path, left_out_stages), RUN_ID, 0)
    return built_elsewhere_check("re-execution of round 13 replica 2", auditor, ROUND, 2, forked_stages,
                                 "stage(s) built on another result of round 12")


def test_a_forked_stage_left_out_while_its_partner_stage_was_aggregated_is_no_failure(tmp_path):
    """The soak's round 13: stage 1 of replica 2 forked and was left out; stage 0 followed the record."""
    item = _item(tmp_path, left_out_stages=(1,), forked_stages=(1,))
    assert item.status == UNVERIFIABLE, item.reason
    assert "stage(s) [0]" in item.reason and "left it out" in item.reason


def test_a_forked_stage_the_holders_aggregated_fails(tmp_path):
    assert _item(tmp_path, left_out_stages=(), forked_stages=(1,)).status == FAIL
    # Another stage left out does not cover the forked one.
    assert _item(tmp_path, left_out_stages=(0,), forked_stages=(1,)).status == FAIL


def test_a_whole_replica_forked_and_left_out_is_ok(tmp_path):
    item = _item(tmp_path, left_out_stages=(0, 1), forked_stages=(0, 1))
    assert item.status == OK, item.reason


def test_a_rerun_naming_no_forked_stage_of_the_replica_fails(tmp_path):
    assert _item(tmp_path, left_out_stages=(0, 1), forked_stages=()).status == FAIL
