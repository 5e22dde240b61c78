"""Screening on a cluster's ranks (training/cluster_screen.py; docs/CLUSTER.md): the same reports as one
process screening whole weights, with no whole weight set on rank 0."""

from __future__ import annotations

import gc

import torch

from training.screening import ModelLoss, decode_full, screen_contributions


def _reports(reports):
    return [(r.index, r.loss_before, r.loss_after, r.excluded, r.detail, r.loss_against, r.slope_error)
            for r in reports]


def test_screening_and_derive_on_the_ranks_give_one_process_results():
    """A 2-rank cluster node screens a round's contributions (its own, two that decode, one far too long,
    one no message, one of another round, one with a wrong shape in the last rank's tensor) against its
    current global state and against a kept earlier one (fork repair's ``derive``), by version 1 and by
    version 3 (per-window losses, the contribution against itself): the reports are the one-process
    screening's of the whole weights and the whole decoded contributions, bit for bit; rank 0 never
    fetches a tensor whole-stage at once (each fetch is one block's or the top's); the sessions are
    dropped after. A move to the kept state by its handles sends no state: each rank takes its own shard."""
    from training.cluster_replica import ClusterReplicaTrainer
    from training.cluster_screen import screen_on_ranks
    from training.compression import encode_contribution
    from training.config import DilocoConfig, ModelConfig
    from training.config_compression import CompressionConfig
    from training.config_training import TrainingConfig
    from training.diloco import aggregate_with_report
    from training.model import init_state_dict

    model, training = ModelConfig(), TrainingConfig(device="cpu", batch_size=4)
    diloco, compression = DilocoConfig(inner_steps=2), CompressionConfig()
    paired = DilocoConfig(inner_steps=2, round_budget_s=5.0, min_inner_steps=1, screen_rule="paired")
    cluster = ClusterReplicaTrainer(model, training, 2, init_state_dict(model, 0), timeout_s=300, threads=1)
    generator = torch.Generator().manual_seed(3)
    x = torch.randint(0, model.vocab_size, (4, model.block_size), generator=generator)
    y = torch.randint(0, model.vocab_size, (4, model.block_size), generator=generator)
    try:
        engine = cluster.outer_engine(0, diloco, compression)
        shapes = dict(engine.shapes)
        last = engine.plan.order[-1]  # the last rank's last tensor (chunk order)
        assert engine.plan.owner(last) == 1

        def contributions(outer_round: int) -> list[bytes]:
            cluster.begin_steps()
            tokens = torch.randint(0, model.vocab_size, (4, model.block_size + 1), generator=generator)
            cluster.train_step(tokens[:, :-1], tokens[:, 1:])
            cluster.end_steps()
            own, _ = engine.encode_contribution(outer_round)
            noise = {n: torch.randn(s, generator=generator) * 1e-3 for n, s in shapes.items()}
            loud = {n: t * 1e4 for n, t in noise.items()}
            wrong = dict(noise)
            wrong[last] = torch.zeros(tuple(d + 1 for d in shapes[last]))
            blobs = [encode_contribution(t, compression, stage_index=0, outer_round=r)[0]
                     for t, r in ((noise, outer_round), (loud, outer_round), (noise, outer_round + 1))]
            wrong_blob = encode_contribution(wrong, compression, stage_index=0, outer_round=outer_round)[0]
            return [own, blobs[0], blobs[1], b"\x93junk", blobs[2], wrong_blob]

        fetched: list[int] = []
        original = engine.screen_call

        def counting(op, *args, private=None):
            got = original(op, *args, private=private)
            if op == "screen_tensors":
                fetched.append(sum(t.numel() for t in got.values()))
            return got

        engine.screen_call = counting

        def check(outer_round, blobs, base, cfg):
            steps = [cfg.inner_steps] * len(blobs) if cfg.budgeted else None
            ours = screen_on_ranks(engine, outer_round, blobs, base, (x, y), model, cfg, steps,
                                   refuse_raw=True)
            decoded = [decode_full([b], [shapes], outer_round=outer_round, refuse_raw=True) for b in blobs]
            theirs = screen_contributions(ModelLoss(model, x, y), dict(base), decoded, cfg, steps)
            assert _reports(ours) == _reports(theirs)
            return ours

        blobs = contributions(0)
        kept_handles = (engine.global_weights, engine.momentum)
        kept = kept_handles[0]
        reports = check(0, blobs, kept, diloco)
        assert [r.loss_after is None for r in reports] == [False, False, False, True, True, True]
        assert reports[2].excluded and not reports[0].excluded and not reports[1].excluded
        assert fetched and max(fetched) < 0.5 * sum(torch.Size(s).numel() for s in shapes.values())
        check(0, blobs, kept, paired)
        # fork repair's derive on the kept base: aggregated on the ranks, its new state kept there; the
        # one-process aggregation's reports and state, and the apply's hash
        derived = engine.aggregate_on_ranks(0, kept_handles, blobs, {2: "screened"})
        whole = aggregate_with_report(dict(kept), dict(kept_handles[1]), blobs, diloco, stage_index=0,
                                      outer_round=0, compression_cfg=compression, excluded={2: "screened"})
        assert [(r.index, r.accepted, r.reason, r.norm, r.scale) for r in derived.contributions] == \
            [(r.index, r.accepted, r.reason, r.norm, r.scale) for r in whole.contributions]
        assert derived.weights_hash == whole.weights_hash
        pairs = ((derived.new_global, whole.new_global), (derived.new_momentum, whole.new_momentum))
        for ours, theirs in pairs:
            assert all(torch.equal(t, theirs[n]) for n, t in dict(ours).items())
        applied = engine.finish_round(0, blobs, excluded={2: "screened"})
        assert applied.weights_hash == derived.weights_hash
        check(1, contributions(1), engine.global_weights, diloco)
        # against the kept state before round 0's apply (fork repair's derive), which the ranks still hold
        assert not torch.equal(dict(kept)[last], dict(engine.global_weights)[last])
        check(0, blobs, kept, paired)
        assert engine.shard._sessions == {}
        # the engine moved back to the kept state by its handles: each rank takes its own shard (no whole
        # state is sent), the same state as the one sent whole
        sent: list = []
        command = cluster.outer

        def recording(args, private=None):
            sent.append((args[0], private))
            return command(args, private=private)

        cluster.outer = recording
        kept_weights, kept_momentum = dict(kept), dict(kept_handles[1])
        engine.move_global(kept, kept_handles[1])
        assert [(op, private) for op, private in sent if op == "move_global"] == [("move_global", None)]
        assert all(torch.equal(t, kept_weights[n]) for n, t in dict(engine.global_weights).items())
        assert all(torch.equal(t, kept_momentum[n]) for n, t in dict(engine.momentum).items())
        cluster.outer = command
        del kept, kept_handles
        gc.collect()
    finally:
        cluster.close()


def test_a_whole_base_is_screened_as_one_process_screens_it():
    """A base not kept on the ranks (a whole state in hand) is screened as one process screens it."""
    from training.cluster_screen import screen_on_ranks
    from training.config import DilocoConfig, ModelConfig
    from training.model import init_state_dict

    model = ModelConfig()
    weights = init_state_dict(model, 0)
    shapes = {n: tuple(t.shape) for n, t in weights.items()}

    class Engine:
        pass

    engine = Engine()
    engine.shapes = shapes
    x = torch.randint(0, model.vocab_size, (2, model.block_size), generator=torch.Generator().manual_seed(0))
    reports = screen_on_ranks(engine, 0, [b"\x93junk"], weights, (x, x), model, DilocoConfig(), None,
                              refuse_raw=True)
    assert [(r.index, r.loss_after) for r in reports] == [(0, None)]
    assert reports[0].loss_before == screen_contributions(ModelLoss(model, x, x), weights, [None],
                                                          DilocoConfig())[0].loss_before
