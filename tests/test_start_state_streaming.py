"""A node's own start state is written to a file as it is made and linked into the blob store (issue 75,
"memory per held parameter"): the same bytes and hash as :func:`training.replica_capture.start_state_bytes`,
without the whole state in memory. The accounting is counted, not timed: tracemalloc counts every Python
buffer the serialisation allocates (the bytes of ``to_bytes`` are one), so the bound is per parameter held.
Also pinned: the tensors a stage's engine holds between rounds, counted by their storages."""

from __future__ import annotations

import hashlib
import tracemalloc

import torch

from node.config import load_config
from node.live.checks.heldstates import HeldStates
from p2p.blobstore import BlobStore
from training.config_compression import new_run_compression_settings
from training.pipeline import LocalReplicaTrainer
from training.reexec import round_meta
from training.replica_capture import StartStateCapture, capture_trainer_part, start_state_bytes
from training.replica_state import parse_stage_state
from training.stage_engine import StageEngine

PRESET = "tiny"
#: Python-allocated bytes that writing a start state may take, whatever the model's size: the file's buffer
#: and the records' headers (measured: 98 KB at 42,880 parameters, 173 KB at 867,072). Building the state in
#: memory takes all of it, about 40 bytes per parameter held.
WRITE_FIXED_BYTES = 256 << 10
#: Bytes per parameter the engine holds after a round with the one-step delay, besides the live weights and
#: the inner optimizer: global weights, outer momentum, residual, the round-start snapshot, and the decoded
#: contributions of the last applied round and of the one not applied yet (4 bytes each). It was 28 after an
#: apply: the delay's re-basing copied the round start and the pending round's end, one snapshot, twice.
ENGINE_BYTES_PER_PARAM = 24


def _stage(tmp_path=None):
    cfg = load_config(None, [f"model.preset={PRESET}", "diloco.inner_steps=2", "training.batch_size=2",
                             "pipeline.num_stages=1", "diloco.num_replicas=2",
                             *new_run_compression_settings()])
    trainer = LocalReplicaTrainer(cfg.model, cfg.training, 1)
    module, optimizer = trainer.stage_modules[0], trainer.optimizers[0]
    engine = StageEngine(0, dict(module.named_parameters()), cfg.diloco, cfg.compression,
                         exact=cfg.training.codec_kernels)
    return cfg, trainer, module, optimizer, engine


def _round(cfg, trainer, engine, outer_round: int, blobs: dict) -> None:
    gen = torch.Generator().manual_seed(outer_round)
    x = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.block_size), generator=gen)
    for _ in range(cfg.diloco.inner_steps):
        trainer.train_step(x, x.roll(1, 1))
    blobs[outer_round] = engine.encode_contribution(outer_round)[0]
    if outer_round >= 1:
        engine.apply_round(outer_round - 1, [blobs[outer_round - 1], blobs[outer_round - 1]])


def _held_bytes(tensors) -> int:
    seen, total = set(), 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _engine_tensors(engine: StageEngine):
    yield from engine.global_weights.values()
    yield from engine.momentum.values()
    yield from engine.compressor.residual.values()
    yield from engine._round_start.values()
    for group in (engine._round_end, engine._sent, engine._own_decoded):
        for snapshot in group.values():
            yield from snapshot.values()
    for _, decoded in engine._own_blob.values():
        yield from decoded.values()


def test_written_state_is_the_bytes_without_holding_them(tmp_path) -> None:
    cfg, trainer, module, optimizer, engine = _stage()
    blobs: dict[int, bytes] = {}
    for outer_round in range(2):
        _round(cfg, trainer, engine, outer_round, blobs)
    numel = sum(p.numel() for p in module.parameters())
    meta = round_meta(2, 0, cfg.model, cfg.diloco, run_rounds=3, num_stages=1, micro_batches=0)
    capture = StartStateCapture(meta, lambda stage: engine, {0: capture_trainer_part(module, optimizer)})

    tracemalloc.start()
    try:
        paths = capture.write(tmp_path / "states")
        _, write_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        want = capture()[0]
        _, bytes_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    written = paths[0].read_bytes()
    assert written == want == start_state_bytes(meta, engine, capture.parts[0])
    assert parse_stage_state(written).state_hash() == hashlib.sha256(want).digest()
    assert len(want) > 30 * numel  # weights, both moments, the engine's copies: ~40 bytes a parameter
    assert bytes_peak >= len(want)  # building the bytes holds them whole ...
    assert write_peak <= WRITE_FIXED_BYTES < len(want) // 4, write_peak  # ... writing them does not


def test_engine_holds_a_bounded_number_of_copies() -> None:
    cfg, trainer, module, _, engine = _stage()
    numel = sum(p.numel() for p in module.parameters())
    blobs: dict[int, bytes] = {}
    for outer_round in range(3):
        _round(cfg, trainer, engine, outer_round, blobs)
        held = _held_bytes(_engine_tensors(engine))
        assert held <= ENGINE_BYTES_PER_PARAM * numel, (outer_round, held / numel)
    assert held == ENGINE_BYTES_PER_PARAM * numel  # the bound is what it holds: no slack to hide a copy


def test_held_states_serve_a_written_file_packed(tmp_path) -> None:
    """A start state written to a file is kept as a packed blob (its tensors' data as shared pieces:
    tests/test_packed_states.py), never read whole; bytes (a caller's in-memory state) are stored as they
    are."""
    store = BlobStore(tmp_path / "blobs", max_blob_bytes=1 << 24)
    cfg, trainer, module, optimizer, engine = _stage()
    meta = round_meta(3, 0, cfg.model, cfg.diloco, run_rounds=5, num_stages=2, micro_batches=0)

    class StoreHost:
        calls: list[str] = []

        def provide_blob(self, data, announce: bool = True, link: bool = False) -> str:
            self.calls.append("blob")
            return store.put_bytes(data) if isinstance(data, bytes) else store.put_file(data, link=link)

        def provide_packed(self, path, cuts, compress=False) -> str:
            self.calls.append(f"packed {len(cuts)} cuts")
            return store.put_packed(path, cuts)

    host = StoreHost()
    states = HeldStates(host, tmp_path / "work", tmp_path / "evidence", num_stages=2, stop=None)
    capture = StartStateCapture(meta, lambda stage: engine, {1: capture_trainer_part(module, optimizer)})
    path = capture.write(states.writing_dir)[1]
    data = path.read_bytes()
    hashes = states.serve(3, {1: path, 0: b"state of stage 0"}, 0)
    assert hashes[1] == hashlib.sha256(data).digest()
    assert hashes[0] == hashlib.sha256(b"state of stage 0").digest()
    tensors = len(parse_stage_state(data).tensors)  # a cut per tensor's data
    assert host.calls == [f"packed {tensors} cuts", "blob"] and tensors > 10, host.calls
    assert not path.exists()  # the blob store holds its pieces
    assert store.packed(hashes[1].hex()).pread(0, len(data)) == data
    assert states.expected_part_bytes(1) == len(data)


def test_held_states_hold_a_rerun_file_for_the_chain_check(tmp_path) -> None:
    """A spot check's state parts stay in its job's files while the child reruns them; an exact rerun's are
    held for round t+1's chain check by hard-linking those files (node/live/checks/rerun.py)."""
    states = HeldStates(None, tmp_path / "work", tmp_path / "evidence", num_stages=2, stop=None)
    job = tmp_path / "job"
    job.mkdir()
    files = [job / "state-0.bin", job / "state-1.bin"]
    files[0].write_bytes(b"stage 0" * 500)
    files[1].write_bytes(b"stage 1" * 700)
    states.hold_linkable(4, 1, files)
    held = tmp_path / "work" / "linkable" / "round-00000004-replica1-0.part"
    assert held.samefile(files[0])  # a hard link: one copy of the state on disk, not two (issue 75)
    for path in files:
        path.unlink()  # the job's directory goes after the check
    assert states.linkable(4, 1) == [b"stage 0" * 500, b"stage 1" * 700]
    states.hold_linkable(5, 1, [b"bytes 0", b"bytes 1"])  # bytes as before
    assert states.linkable(5, 1) == [b"bytes 0", b"bytes 1"]
    assert not list((tmp_path / "work" / "linkable").glob(".*.tmp"))


def test_spilled_trainer_part_is_the_same_state_out_of_ram(tmp_path, caplog) -> None:
    """The copies a start state waits with (weights and both AdamW moments) go to a nameless file, not RAM
    (training/spilled.py): the same bytes once written, even after training went on, and nothing left on
    disk; where the file cannot be written they stay in RAM, with a warning, and nothing changes."""
    from training.spilled import SpilledTensors

    cfg, trainer, module, optimizer, engine = _stage()
    blobs: dict[int, bytes] = {}
    for outer_round in range(2):
        _round(cfg, trainer, engine, outer_round, blobs)
    meta = round_meta(2, 0, cfg.model, cfg.diloco, run_rounds=3, num_stages=1, micro_batches=0)
    in_ram = capture_trainer_part(module, optimizer)
    spill_dir = tmp_path / "spill"
    spilled = capture_trainer_part(module, optimizer, spill_dir=spill_dir)
    assert isinstance(spilled, SpilledTensors) and list(spill_dir.iterdir()) == []
    assert spilled.nbytes == sum(t.numel() * 4 for t in in_ram.values())
    assert set(spilled) == set(in_ram)
    x = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.block_size), generator=torch.Generator())
    trainer.train_step(x, x.roll(1, 1))  # the live weights and moments move on; the captures do not
    assert any(not torch.equal(p, in_ram[f"param/{n}"]) for n, p in module.named_parameters())
    for name, tensor in in_ram.items():
        assert torch.equal(spilled[name], tensor), name

    want = start_state_bytes(meta, engine, in_ram)
    tracemalloc.start()
    try:
        paths = StartStateCapture(meta, lambda stage: engine, {0: spilled}).write(tmp_path / "states")
        _, write_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert paths[0].read_bytes() == want
    largest = max(t.numel() * 4 for t in in_ram.values())  # read back one tensor at a time
    assert write_peak <= WRITE_FIXED_BYTES + 2 * largest < len(want) // 4, write_peak

    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    with caplog.at_level("WARNING"):
        kept = capture_trainer_part(module, optimizer, spill_dir=blocked / "spill")
    assert not isinstance(kept, SpilledTensors) and "kept in RAM" in caplog.text
    assert start_state_bytes(meta, engine, kept) == start_state_bytes(meta, engine, capture_trainer_part(
        module, optimizer))


def test_header_only_parse_refuses_what_the_full_parse_refuses(tmp_path) -> None:
    """A spot check reads a fetched start state's platform without reading its tensors
    (``parse_stage_state(tensors=False)``, ``check_stage_state_file``): it must refuse exactly what the full
    parse refuses, or a cheater's malformed state would be judged by its header alone."""
    import pytest

    from node.live.checks.spotcheck import SpotCheckJob
    from training.errors import ReplicaStateError
    from training.replica_state import check_stage_state_file

    cfg, trainer, module, optimizer, engine = _stage()
    meta = round_meta(0, 0, cfg.model, cfg.diloco, run_rounds=3, num_stages=1, micro_batches=0)
    data = start_state_bytes(meta, engine, capture_trainer_part(module, optimizer))
    full = parse_stage_state(data)
    light = parse_stage_state(data, tensors=False)
    path = tmp_path / "state.part"
    path.write_bytes(data)
    assert light.meta == full.meta == check_stage_state_file(path).meta and not light.tensors
    assert light.engine_counters == full.engine_counters and light.stage_index == full.stage_index
    bad = [data[:n] for n in (0, 3, 40, len(data) // 2, len(data) - 1)] + [data + b"\0", b"X" + data[1:]]
    first = data.index(b"param/")  # a tensor's name: out of order once its first byte is raised
    bad.append(data[:first] + b"z" + data[first + 1:])
    for case in bad:
        with pytest.raises(ReplicaStateError):
            parse_stage_state(case)
        with pytest.raises(ReplicaStateError):
            parse_stage_state(case, tensors=False)
        path.write_bytes(case)
        with pytest.raises(ReplicaStateError):
            check_stage_state_file(path)

    # A fetched part handed to a job as its file is moved in, not read: the same file the bytes would give.
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    fetched = job_dir / "fetch-0.part"
    fetched.write_bytes(data)
    job = SpotCheckJob(cfg.to_dict(), 0, 0, [], [fetched])
    job.write(job_dir)
    assert job.state_paths(job_dir)[0].read_bytes() == data and not fetched.exists()
    # The worker reads the claimant's platform from the job's file the same way (no tensor read), and a
    # state that does not parse leaves the verdict to the child.
    from node.live.checks.spotcheck import RerunWorker

    assert RerunWorker.kernels_for(job_dir) is None  # this state records no platform: nothing to emulate
    job.state_paths(job_dir)[0].write_bytes(data[:-1])
    assert RerunWorker.kernels_for(job_dir) is None


def test_a_map_a_held_frame_still_views_is_left_to_close_with_it(tmp_path) -> None:
    """A sampling profiler (node/live/costprofile.py, ``DLX_COST_PROFILE=1``) holds every thread's current
    frame while it walks the stacks; a frame that returns meanwhile keeps its locals, here a slice of the
    mapped file, so the map cannot be closed at the end of the read. A llama-20m node of the scale bench
    died of that BufferError serving its start state (2026-11-30, load 25). The read must still succeed:
    the map is unmapped when the last view of it goes. The tracer below keeps the frames the same way."""
    import sys

    from training.replica_state import check_stage_state_file, mapped_state_files

    cfg, trainer, module, optimizer, engine = _stage()
    meta = round_meta(0, 0, cfg.model, cfg.diloco, run_rounds=3, num_stages=1, micro_batches=0)
    data = start_state_bytes(meta, engine, capture_trainer_part(module, optimizer))
    path = tmp_path / "state.part"
    path.write_bytes(data)
    held = []

    def keep_frames(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "take":
            held.append(frame)

    sys.settrace(keep_frames)
    try:
        checked = check_stage_state_file(path)
        with mapped_state_files([path]) as maps:
            parsed = parse_stage_state(maps[0])
    finally:
        sys.settrace(None)
    assert held  # the frames were kept past their return, as a profiler's sample can keep them
    assert checked.meta == parsed.meta == parse_stage_state(data).meta
    assert set(parsed.tensors) == set(parse_stage_state(data).tensors)
    held.clear()
