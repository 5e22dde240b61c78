"""A stage's memory cuts of issue 75 change no bit: an engine whose transmitted updates wait in a file
(``StageEngine.spill_dir``, set by the node) encodes, applies, restores a dropped contribution and writes its
start state exactly as one that keeps them in RAM, holding 8 bytes per parameter less; a consumed rerun
(``reexecute(consume=True)``: the restore keeps the parsed tensors, the next state is the live tensors)
gives the payloads and next-state hashes of a rerun that copies."""

from __future__ import annotations

import torch

from node.config import load_config
from training.config_compression import new_run_compression_settings
from training.data import corpus_from_config
from training.pipeline import LocalReplicaTrainer
from training.reexec import reexecute, round_meta
from training.replica_capture import StartStateCapture, capture_trainer_part, initial_replica_state
from training.replica_state import ReplicaStartState, parse_stage_state
from training.spilled import SpilledTensors
from training.stage_engine import StageEngine


def tiny_stage(settings=()):
    """A one-stage tiny replica, its module and optimizer, and its engine (shared by the engine tests)."""
    cfg = load_config(None, ["model.preset=tiny", "diloco.inner_steps=2", "training.batch_size=2",
                             "pipeline.num_stages=1", "diloco.num_replicas=2",
                             *new_run_compression_settings(), *settings])
    trainer = LocalReplicaTrainer(cfg.model, cfg.training, 1)
    module, optimizer = trainer.stage_modules[0], trainer.optimizers[0]
    engine = StageEngine(0, dict(module.named_parameters()), cfg.diloco, cfg.compression,
                         exact=cfg.training.codec_kernels)
    return cfg, trainer, module, optimizer, engine


def _in_ram(engine: StageEngine) -> int:
    """Bytes of the transmitted updates the engine holds as tensors (not in a file)."""
    return sum(t.numel() * 4 for sent in engine._sent.values() if not isinstance(sent, SpilledTensors)
               for t in sent.values())


def test_spilled_transmitted_updates_change_no_bit(tmp_path) -> None:
    runs = []
    for spill in (None, tmp_path / "spill"):
        cfg, trainer, module, optimizer, engine = tiny_stage()
        engine.spill_dir = spill
        blobs, hashes, states, held = {}, [], [], []
        for outer_round in range(4):
            meta = round_meta(outer_round, 0, cfg.model, cfg.diloco, run_rounds=5, num_stages=1,
                              micro_batches=0)
            capture = StartStateCapture(meta, lambda _stage: engine,
                                        {0: capture_trainer_part(module, optimizer, tmp_path / "parts")})
            path = capture.write(tmp_path / f"states-{spill is None}")[0]
            states.append(path.read_bytes())
            assert capture()[0] == states[-1]  # the bytes built whole are the file's
            gen = torch.Generator().manual_seed(outer_round)
            x = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.block_size), generator=gen)
            for _ in range(cfg.diloco.inner_steps):
                trainer.train_step(x, x.roll(1, 1))
            if outer_round % 2:  # the split encode (the node's), and the whole one
                engine.prepare_encode(outer_round)
            blobs[outer_round] = engine.encode_contribution(outer_round)[0]
            if outer_round >= 1:
                previous = [blobs[outer_round - 1], blobs[outer_round - 1]]
                prepared = engine.prepare_aggregation(outer_round - 1, previous) if outer_round == 2 else None
                engine.apply_round(outer_round - 1, previous, prepared=prepared)
                hashes.append(engine.weights_hash())
            if outer_round == 2:
                assert engine.contribution_dropped(2)  # read back from the file into the residual
            held.append(_in_ram(engine))
        runs.append((blobs, hashes, states, held, engine.compressor.state_dict()))
    (blobs, hashes, states, held, residual), (blobs2, hashes2, states2, held2, residual2) = runs
    assert blobs == blobs2 and hashes == hashes2 and states == states2
    assert residual.keys() == residual2.keys()
    assert all(torch.equal(residual[n], residual2[n]) for n in residual)
    assert max(held) > 0 and held2 == [0] * len(held2)


def test_a_consumed_rerun_is_the_copying_rerun(tmp_path) -> None:
    cfg = load_config(None, ["model.preset=tiny", "diloco.inner_steps=2", "training.batch_size=2",
                             "rounds=3", "pipeline.num_stages=2", f"data_dir={tmp_path}",
                             *new_run_compression_settings()])
    corpus = corpus_from_config(cfg.training, cfg.model)

    def rerun(replica: int, consume: bool):
        meta = round_meta(0, replica, cfg.model, cfg.diloco, run_rounds=cfg.rounds, num_stages=2, threads=1)
        state = initial_replica_state(meta, cfg.model, cfg.training, cfg.diloco, cfg.compression)
        state = ReplicaStartState(tuple(parse_stage_state(part.to_bytes()) for part in state.stages))
        return state, reexecute(state, corpus, cfg.model, cfg.training, cfg.diloco, cfg.compression,
                                consume=consume)

    state, copying = rerun(0, False)
    consumed_state, consumed = rerun(0, True)
    assert copying.payloads == consumed.payloads
    assert copying.next_state.stage_hashes() == consumed.next_state.stage_hashes()
    assert all(part.tensors for part in state.stages)  # the copying rerun left its input alone
    assert not any(part.tensors for part in consumed_state.stages)  # the consumed one took it over
    # Round 1 from each next state, round 0's contributions of both replicas applied first.
    other = rerun(1, False)[1]
    previous = {s: [copying.payloads[s], other.payloads[s]] for s in range(2)}
    start = copying.next_state.stages
    again = [reexecute(ReplicaStartState(tuple(parse_stage_state(p.to_bytes()) for p in start)), corpus,
                       cfg.model, cfg.training, cfg.diloco, cfg.compression, previous_contributions=previous,
                       consume=consume) for consume in (False, True)]
    assert again[0].payloads == again[1].payloads and again[0].applied_hashes == again[1].applied_hashes
    assert again[0].next_state.stage_hashes() == again[1].next_state.stage_hashes()
