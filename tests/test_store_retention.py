"""Retention (``[storage]``): old archive rounds and checkpoints go, what a restart or a peer needs stays."""

from __future__ import annotations

import hashlib

import pytest

from node.config import load_config
from node.errors import ConfigError
from node.store.archive import TRASH_PREFIX, Archive, ArchivedContribution
from node.store.retention import checkpoint_files, prune_archive, prune_checkpoints


def _sealed_archive(tmp_path, rounds: int) -> Archive:
    archive = Archive(tmp_path / "archive", run_id=3)
    for r in range(rounds):
        digest = archive.put(r, b"contribution %d" % r)
        archive.seal_round(r, [ArchivedContribution(0, 0, "peer", digest)])
    return archive


def test_archive_keeps_the_newest_rounds_and_every_uncommitted_one(tmp_path):
    archive = _sealed_archive(tmp_path, 10)
    archive.put(10, b"not sealed yet")  # an open round is never touched
    forgotten: list[str] = []
    assert prune_archive(archive, 3, committed_through=4, forget_blob=forgotten.append) == [0, 1, 2, 3, 4]
    # Rounds 5 and 6 are older than the newest 3 sealed ones but not committed: a restart re-applies them.
    assert archive.rounds() == [5, 6, 7, 8, 9, 10]
    assert forgotten == [hashlib.sha256(b"contribution %d" % r).hexdigest() for r in range(5)]
    assert prune_archive(archive, 3, committed_through=9, forget_blob=forgotten.append) == [5, 6]
    assert archive.rounds() == [7, 8, 9, 10] and archive.sealed(9) is not None
    assert prune_archive(archive, 0, committed_through=9) == []  # 0 keeps everything
    assert not list(archive.dir.glob(TRASH_PREFIX + "*"))


def test_a_removal_interrupted_by_a_crash_is_finished_later_and_never_looks_sealed(tmp_path):
    archive = _sealed_archive(tmp_path, 4)
    # What a crash between the rename and the removal leaves: out of the archive's namespace.
    archive.sealed_path(0).parent.rename(archive.dir / (TRASH_PREFIX + "round-00000000"))
    assert archive.rounds() == [1, 2, 3] and archive.sealed(0) is None
    prune_archive(archive, 0, committed_through=3)
    assert not list(archive.dir.glob(TRASH_PREFIX + "*"))


def _checkpoints(directory, rounds, full=True):
    directory.mkdir(exist_ok=True)
    for r in rounds:
        (directory / f"shard-{r:08d}-stage0.safetensors").write_bytes(b"shard %d" % r)
        if full:
            (directory / f"round-{r:08d}.safetensors").write_bytes(b"full %d" % r)


def test_checkpoints_keep_the_newest_committed_and_every_uncommitted_one(tmp_path):
    directory = tmp_path / "checkpoints"
    _checkpoints(directory, range(6))
    _checkpoints(directory, [6, 7], full=False)  # shards only: the full checkpoint was never assembled
    (directory / "notes.txt").write_text("not a checkpoint")
    forgotten: list[str] = []
    assert prune_checkpoints(directory, 1, committed_through=6, forget_blob=forgotten.append) == [0, 1, 2, 3,
                                                                                                  4]
    # Kept: round 5 (the newest committed full checkpoint: joiners download it), round 6 (the newest
    # committed round), round 7 (not committed yet).
    assert sorted(checkpoint_files(directory)) == [5, 6, 7]
    assert (directory / "notes.txt").exists()
    assert hashlib.sha256(b"full 0").hexdigest() in forgotten and hashlib.sha256(b"shard 4").hexdigest() \
        in forgotten
    assert prune_checkpoints(directory, 0, committed_through=7) == []  # 0 keeps everything
    assert prune_checkpoints(directory, 2, committed_through=-1) == []  # nothing committed: nothing goes


def test_storage_settings_load_validate_and_keep_the_old_name(tmp_path):
    cfg = load_config(None, ["storage.keep_rounds=20", "storage.keep_checkpoints=3"])
    assert (cfg.storage.keep_rounds, cfg.storage.keep_checkpoints) == (20, 3)
    default = load_config(None, []).storage
    # the default keeps what the chain's open windows need, no more; "all" is an explicit choice
    assert (default.retention, default.keep_rounds, default.keep_checkpoints) == ("windows", 0, 0)
    assert load_config(None, ["storage.retention=all"]).storage.retention == "all"
    with pytest.raises(ConfigError, match="storage.retention"):
        load_config(None, ["storage.retention=forever"])
    # the older setting still applies
    assert load_config(None, ["retention_rounds=7"]).storage.keep_rounds == 7
    with pytest.raises(ConfigError, match="storage.keep_checkpoints"):
        load_config(None, ["storage.keep_checkpoints=-1"])
    path = tmp_path / "node.toml"
    path.write_text("[storage]\nkeep_rounds = 5\n")
    assert load_config(path).storage.keep_rounds == 5


def test_state_json_stays_bounded_on_long_runs(tmp_path):
    from node.live.state.status import StateFile

    state = StateFile(tmp_path / "state.json", run_id=3)
    for outer_round in range(30):
        state.record_round(outer_round, bytes([outer_round]) * 32, committed_by_me=outer_round % 2 == 0,
                           keep=8)
        state.remember_signed(outer_round, bytes(32), bytes(65), keep=8)
    reloaded = StateFile(tmp_path / "state.json", run_id=3)
    assert sorted(map(int, reloaded.get("weights_roots"))) == list(range(22, 30))
    assert reloaded.get("committed") == list(range(14, 30, 2))  # the last 8 it committed
    assert reloaded.signed_record(29) is not None and reloaded.signed_record(21) is None


def test_attested_figures_survive_a_restart_as_they_were(tmp_path):
    """A restarted node attests a round it contributed to in an earlier life with that life's figures."""
    import math

    from node.live.state.status import StateFile

    state = StateFile(tmp_path / "state.json", run_id=3)
    for outer_round in range(10):
        state.remember_attested(outer_round, 2.5 + outer_round, math.nan if outer_round % 2 else 2.25, 4096,
                                keep=4)
    reloaded = StateFile(tmp_path / "state.json", run_id=3)
    assert reloaded.attested(5) is None  # only the last 4 are kept
    assert reloaded.attested(8) == (10.5, 2.25, 4096)
    train, held_out, tokens = reloaded.attested(9)
    assert (train, tokens) == (11.5, 4096) and math.isnan(held_out)
    assert "NaN" not in (tmp_path / "state.json").read_text()  # strict JSON
