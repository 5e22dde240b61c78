"""A stage engine's outer state kept in files (``StageEngine.keep_outer_state_in``, the node's
``storage.outer_state = "disk"``; training/stage_engine_outer.py) changes no bit: the contributions, the
weights hashes, the start states and the residual are an engine's in RAM, for every delay correction, with and
without error feedback, outer Nesterov and outer Adam; between rounds none of it is held in RAM. A file of
another length is refused when read, never used; a process killed between the outer step and the commit
leaves no file behind, and the state it restarts from (the checkpoint, the round's contributions) gives the
hash the uninterrupted run committed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.test_engine_spill import tiny_stage

from training.reexec import round_meta
from training.replica_capture import StartStateCapture, capture_trainer_part
from training.spilled import SpillFileError, SpilledTensors, ZeroTensors, unheld
from training.stage_engine import StageEngine

ROOT = Path(__file__).resolve().parent.parent


def _outer_in_ram(engine: StageEngine) -> int:
    """Bytes of the outer state (global weights, momentum, snapshots, residual) held as tensors in RAM."""
    parts = [engine.global_weights, engine.momentum, engine._round_start, *engine._round_end.values(),
             engine.compressor.residual]
    return sum(4 * t.numel() for part in parts if not unheld(part) for t in part.values())


def _train(cfg, trainer, outer_round: int) -> None:
    gen = torch.Generator().manual_seed(outer_round)
    x = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.block_size), generator=gen)
    for _ in range(cfg.diloco.inner_steps):
        trainer.train_step(x, x.roll(1, 1))


def _run(tmp_path: Path, settings, outer_dir: Path | None, rounds: int = 4):
    """Rounds in the node's order (start state, inner steps, apply of the previous round, encode); every
    figure a round makes, and the outer state's bytes in RAM after each round."""
    cfg, trainer, module, optimizer, engine = tiny_stage(settings)
    engine.keep_outer_state_in(outer_dir)
    engine.spill_dir = outer_dir
    early, no_delay = engine.lookahead, not cfg.diloco.one_step_delay  # apply t-1 before encoding t; no delay
    blobs, hashes, states, held = {}, [], [], []
    for outer_round in range(rounds):
        meta = round_meta(outer_round, 0, cfg.model, cfg.diloco, run_rounds=rounds + 1, num_stages=1,
                          micro_batches=0)
        capture = StartStateCapture(meta, lambda _stage: engine,
                                    {0: capture_trainer_part(module, optimizer, outer_dir)})
        states.append(capture.write(tmp_path / f"states-{outer_dir is None}")[0].read_bytes())
        _train(cfg, trainer, outer_round)

        def apply(previous=outer_round - 1) -> None:
            contributions = [blobs[previous], blobs[previous]]
            prepared = engine.prepare_aggregation(previous, contributions) if previous % 2 else None
            hashes.append(engine.finish_round(previous, contributions, prepared=prepared).weights_hash)
            hashes.append(engine.weights_hash())

        if outer_round >= 1 and early:
            apply()
        if engine.can_prepare and outer_round % 2:
            engine.prepare_encode(outer_round)
        blobs[outer_round] = engine.encode_contribution(outer_round)[0]
        if outer_round >= 1 and not early and not no_delay:
            apply()
        if no_delay:
            apply(outer_round)
        if outer_round == 2:
            assert engine.contribution_dropped(2)  # read back into the residual (a file's, or zeros)
        held.append(_outer_in_ram(engine))
    return blobs, hashes, states, held, engine


@pytest.mark.parametrize("settings", [
    pytest.param([], id="rebase"),
    pytest.param(["diloco.delay_correction=reset"], id="reset", marks=pytest.mark.slow),
    pytest.param(["diloco.delay_correction=lookahead"], id="lookahead", marks=pytest.mark.slow),
    pytest.param(["diloco.delay_correction=eager", "compression.error_feedback=true"], id="eager-feedback"),
    pytest.param(["diloco.one_step_delay=false", "diloco.outer_optimizer=adam"], id="no-delay-adam"),
    pytest.param(["compression.error_feedback=true"], id="rebase-feedback", marks=pytest.mark.slow),
])
def test_outer_state_on_disk_changes_no_bit(tmp_path, settings) -> None:
    blobs, hashes, states, held, ram = _run(tmp_path, settings, None)
    blobs2, hashes2, states2, held2, disk = _run(tmp_path, settings, tmp_path / "outer")
    assert blobs == blobs2 and hashes == hashes2
    assert states == states2  # the start states, written from the files, are the same bytes
    residual, residual2 = ram.compressor.state_dict(), disk.compressor.state_dict()
    assert residual.keys() == residual2.keys()
    assert all(torch.equal(residual[n], residual2[n]) for n in residual)
    assert min(held) > 0 and held2 == [0] * len(held2)  # nothing of the outer state in RAM between rounds
    assert isinstance(disk.global_weights, SpilledTensors) and isinstance(disk.momentum, SpilledTensors)
    if "compression.error_feedback=true" not in settings:
        assert isinstance(disk.compressor.residual, ZeroTensors)  # no residual allocated without feedback
    assert os.listdir(tmp_path / "outer") == []  # the files have no name


def test_an_outer_state_file_of_another_length_is_refused_not_read(tmp_path) -> None:
    *_, engine = _run(tmp_path, [], tmp_path / "outer", rounds=2)
    want = engine.weights_hash()
    weights = engine.global_weights
    length = os.fstat(weights.fileno()).st_size
    os.ftruncate(weights.fileno(), length + 4096)  # grown
    with pytest.raises(SpillFileError, match=f"holds {length + 4096} bytes, not the {length} written"):
        engine.weights_hash()
    os.ftruncate(weights.fileno(), length)  # as written again: read as before
    assert engine.weights_hash() == want
    os.ftruncate(weights.fileno(), length - 4)  # cut short
    with pytest.raises(SpillFileError, match="refused, not read"):
        engine.weights_hash()
    with pytest.raises(SpillFileError):
        engine.state_dict()
    with pytest.raises(SpillFileError):
        engine.apply_round(1, [b"x"])  # the round's aggregation reads the state: refused before any change
    assert engine.last_applied == 0 and engine.global_weights is weights


_KILLED_CHILD = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    import torch
    torch.set_num_threads(int(sys.argv[2]))  # the test's own count: float training's bits depend on it
    sys.path.insert(0, {root!r})
    from tests.test_outer_state_disk import killed_mid_apply
    killed_mid_apply(Path(sys.argv[1]))
""")


def killed_mid_apply(workdir: Path) -> None:
    """Round 0 and 1 (outer state on disk), the node's commit of round 0 (its checkpoint) and round 1's
    contributions sealed (the archive); killed by SIGKILL once round 1's outer step is made and taken by the
    engine, before the local weights follow it and before anything is committed."""
    from node.store.checkpoint import Checkpoint, write_checkpoint

    cfg, trainer, module, optimizer, engine = tiny_stage()
    engine.keep_outer_state_in(workdir / "outer")
    blobs = {}
    for outer_round in range(2):
        _train(cfg, trainer, outer_round)
        blobs[outer_round] = engine.encode_contribution(outer_round)[0]
        if outer_round == 1:
            (workdir / "round-0.bin").write_bytes(blobs[0])  # sealed: its bytes are what a restart reads
            (workdir / "apply-started").touch()

            def killed(*_args, **_kwargs):
                os.kill(os.getpid(), signal.SIGKILL)

            engine.correction.follow = killed
            engine.apply_round(0, [blobs[0], blobs[0]])
        else:  # the last committed state before round 0 is applied: the initial one
            committed = Checkpoint(1, 0, {}, b"\0" * 32, {0: engine.weights_hash()}, engine.global_weights,
                                   engine.momentum)
            write_checkpoint(workdir / "checkpoint.safetensors", committed)


def test_a_node_killed_between_the_outer_step_and_the_commit_restarts_from_what_it_committed(tmp_path):
    from node.store.checkpoint import read_checkpoint

    (tmp_path / "outer").mkdir()
    child = subprocess.run([sys.executable, "-c", _KILLED_CHILD.format(root=str(ROOT)), str(tmp_path),
                            str(torch.get_num_threads())], capture_output=True, text=True, timeout=300)
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert (tmp_path / "apply-started").exists()
    assert os.listdir(tmp_path / "outer") == []  # nothing half written that a restart could find
    # The uninterrupted run, in RAM: the same round 0 (the same contribution), applied.
    cfg, trainer, _module, _optimizer, engine = tiny_stage()
    sealed = (tmp_path / "round-0.bin").read_bytes()
    for outer_round in range(2):
        _train(cfg, trainer, outer_round)
        blob = engine.encode_contribution(outer_round)[0]
        assert outer_round or blob == sealed
    committed = engine.apply_round(0, [sealed, sealed]).weights_hash
    # The restart (outer state on disk): the checkpoint it committed, then the sealed round re-applied.
    checkpoint = read_checkpoint(tmp_path / "checkpoint.safetensors")
    _cfg, _trainer, _m, _o, restarted = tiny_stage()
    restarted.keep_outer_state_in(tmp_path / "outer")
    restarted.rebase(checkpoint.weights, checkpoint.momentum, -1)
    assert isinstance(restarted.global_weights, SpilledTensors)
    assert restarted.absorb_round(0, [sealed, sealed]).weights_hash == committed == restarted.weights_hash()
    assert all(torch.equal(restarted.global_weights[n], engine.global_weights[n]) for n in engine.shapes)
