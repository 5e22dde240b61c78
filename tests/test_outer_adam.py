"""Outer Adam (diloco.outer_optimizer = "adam"; FedAdam, arXiv 2003.00295) as a setting of the engine (issue
46).

Its settings are checked at load time, its run document names it only when it is chosen (every older hash is
unchanged), its state (both moments, stacked) is in the start state and the checkpoint's layout, its step
replays bit-exactly in another process and in the audit's replayer, and a contribution of an outer-Adam run
reruns to the same bytes with the full and the sliced exchange. It is not fraud-provable on chain: it commits
"hashed".
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from test_muon import BEFORE_MUON_DEFAULT, HONEST, PERTURBED, ROUNDS, SlicedPerturbed, _records
from test_sliced_reexec import SlicedReplica

from node.commitments import scheme_of
from node.config import load_config
from node.errors import ConfigError
from node.runconfig import canonical_json, config_hash, node_config_from_run, parse_run_document, run_document
from node.store.checkpoint import RunLayout, stage_problems
from node.tools.audit_replay import Replayer
from tests.rerun_fixtures import assert_honest_exact_and_cheat_caught, rerun_checker
from training.compression import encode_contribution
from training.config import OUTER_ADAM_ONLY, DilocoConfig
from training.config_compression import CompressionConfig
from training.data import generated_corpus
from training.diloco import aggregate, outer_state_shape, outer_step, zero_outer_state
from training.errors import ReplicaStateError, TrainingConfigError
from training.hashing import stage_weights_hash, weights_root
from training.reexec_sim import PerturbedReplica, SimConfig, SimReplica
from training.replica_restore import restore_replica
from tests.rerun_fixtures import assert_honest_exact_and_cheat_caught, rerun_checker

ADAM = dict(outer_optimizer="adam", outer_lr=0.01)


@pytest.mark.parametrize("bad, message", [
    (dict(outer_optimizer="lamb"), "diloco.outer_optimizer='lamb': must be one of nesterov, adam"),
    (dict(outer_optimizer="adam", outer_adam_beta1=1.0), r"diloco.outer_adam_beta1=1.0: must be in \[0, 1\)"),
    (dict(outer_optimizer="adam", outer_adam_beta2=-0.1),
     r"diloco.outer_adam_beta2=-0.1: must be in \[0, 1\)"),
    (dict(outer_optimizer="adam", outer_adam_beta1=True),
     r"diloco.outer_adam_beta1=True: must be in \[0, 1\)"),
    (dict(outer_optimizer="adam", outer_adam_eps=0.0),
     "diloco.outer_adam_eps=0.0: must be a finite number > 0"),
    (dict(outer_optimizer="adam", outer_adam_eps=float("inf")),
     "diloco.outer_adam_eps=inf: must be a finite"),
    (dict(outer_adam_beta2=0.999),
     "diloco.outer_adam_beta2=0.999 is a setting of diloco.outer_optimizer = \"adam\""),
    (dict(outer_adam_eps=1e-6),
     "diloco.outer_adam_eps=1e-06 is a setting of diloco.outer_optimizer = \"adam\""),
    (dict(outer_optimizer="adam", outer_momentum=0.9),
     "diloco.outer_momentum=0.9 is a setting of the Nesterov"),
    (dict(outer_optimizer="adam", nesterov=False), "diloco.nesterov=False is a setting of the Nesterov"),
    (dict(outer_optimizer="adam", outer_final_momentum=0.1, outer_decay="linear", outer_decay_rounds=10),
     "diloco.outer_final_momentum=0.1 is a setting of the Nesterov"),
])
def test_bad_outer_adam_settings_are_refused_saying_why(bad, message):
    with pytest.raises(TrainingConfigError, match=message):
        DilocoConfig(**bad)


@pytest.mark.parametrize("version, message", [
    ("chunked", "diloco.outer_optimizer = \"nesterov\" \\(now 'adam'\\)"),
    ("normed", "the fraud proof's outer step"),
])
def test_outer_adam_is_refused_by_a_fraud_provable_scheme(version, message):
    """The commitment scheme (node/commitments/) says what it needs of the outer loop."""
    diloco = DilocoConfig(outer_optimizer="adam", commitments=version)
    with pytest.raises(ConfigError, match=message):
        scheme_of(diloco).check_config(diloco)


def test_outer_adam_is_not_fraud_provable_and_commits_hashed():
    assert DilocoConfig().commitments == "normed" and DilocoConfig().outer_moments == 1
    adam = DilocoConfig(**ADAM)
    assert adam.commitments == "hashed" and not scheme_of(adam).chunked and adam.outer_moments == 2
    with pytest.raises((ConfigError, TrainingConfigError), match="diloco.commitments"):
        load_config(None, ["diloco.outer_optimizer=adam", "diloco.commitments=chunked"])


@pytest.mark.parametrize("settings", list(BEFORE_MUON_DEFAULT))
def test_nesterov_runs_keep_their_document_and_hash_and_an_adam_run_names_its_settings(settings):
    older = run_document(load_config(None, [*settings, "diloco.commitments=hashed"]))
    assert config_hash(older).hex() == BEFORE_MUON_DEFAULT[settings]
    assert not {"outer_optimizer", *OUTER_ADAM_ONLY} & set(older["diloco"])
    explicit = run_document(load_config(None, [*settings, "diloco.commitments=hashed",
                                               "diloco.outer_optimizer=nesterov"]))
    assert canonical_json(explicit) == canonical_json(older)
    adam = run_document(load_config(None, [*settings, "diloco.outer_optimizer=adam", "diloco.outer_lr=0.01",
                                           "diloco.outer_adam_beta2=0.999", "diloco.outer_adam_eps=1e-6"]))
    assert {k: adam["diloco"][k] for k in ("outer_optimizer", *OUTER_ADAM_ONLY)} == {
        "outer_optimizer": "adam", "outer_adam_beta1": 0.9, "outer_adam_beta2": 0.999, "outer_adam_eps": 1e-6}
    assert "commitments" not in adam["diloco"]  # "hashed", version 1, by its absence
    again = node_config_from_run(parse_run_document(canonical_json(adam), config_hash(adam)))
    assert (again.diloco.outer_optimizer, again.diloco.outer_adam_beta2, again.diloco.outer_adam_eps) == (
        "adam", 0.999, 1e-6)
    assert config_hash(run_document(again)) == config_hash(adam) != config_hash(older)


def _tensors(seed: int, shapes: dict, scale: float = 1.0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {n: scale * torch.randn(s, generator=generator) for n, s in shapes.items()}


SHAPES = {"transformer.h.0.attn.c_attn.weight": (8, 24), "transformer.wte.weight": (16, 8),
          "transformer.h.0.ln_1.bias": (8,)}


def test_the_outer_adam_step_is_fedadam_elementwise_with_stacked_moments():
    cfg = DilocoConfig(**ADAM, outer_lr_other_scale=2.0, commitments="hashed")
    weights, delta = _tensors(0, SHAPES), _tensors(1, SHAPES, 0.01)
    moments = zero_outer_state(cfg, weights)
    assert {n: tuple(m.shape) for n, m in moments.items()} == {n: (2, *s) for n, s in SHAPES.items()}
    assert outer_state_shape(DilocoConfig(), (3, 4)) == (3, 4)
    new, new_moments = outer_step(weights, moments, delta, cfg, 0)
    for name in SHAPES:
        m = 0.1 * delta[name].double()
        v = 0.01 * delta[name].double() ** 2
        # the per-group outer lr applies too
        lr = 0.01 if name == "transformer.h.0.attn.c_attn.weight" else 0.02
        torch.testing.assert_close(new_moments[name][0].double(), m, rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(new_moments[name][1].double(), v, rtol=1e-5, atol=1e-12)
        # First step, no bias correction: (1 - b1) / sqrt(1 - b2) = 1, a step of lr * sign(Delta).
        torch.testing.assert_close(new[name].double(), weights[name].double() - lr * m / (v.sqrt() + 1e-8),
                                   rtol=1e-5, atol=1e-6)
    # A weight that never moved stays where it is (0 / (0 + eps)), and the step reads the moments it is given.
    still = {n: torch.zeros(s) for n, s in SHAPES.items()}
    same, kept = outer_step(new, new_moments, still, cfg, 1)
    assert all(torch.equal(kept[n][0], 0.9 * new_moments[n][0]) for n in SHAPES)
    assert not any(torch.equal(same[n], new[n]) for n in SHAPES)  # the first moment still moves them


REPLAY = textwrap.dedent(
    """
    import sys
    import torch
    torch.set_num_threads(int(sys.argv[2]))
    from training.config import DilocoConfig
    from training.diloco import aggregate
    case = torch.load(sys.argv[1])
    new, moments, digest = aggregate(case["weights"], case["momentum"], case["contributions"],
                                     DilocoConfig(**case["cfg"]), stage_index=1, outer_round=5)
    print(digest.hex(), moments["h.1.mlp.c_fc.weight"].double().sum().item())
    """
)


def test_an_outer_adam_aggregation_replays_bit_exactly_in_another_process(tmp_path):
    shapes = {"h.1.attn.c_attn.weight": (64, 192), "h.1.mlp.c_fc.weight": (64, 256), "h.1.ln_1.bias": (64,)}
    weights = _tensors(7, shapes)
    moments = {n: torch.stack((0.01 * t, 1e-4 * t * t)) for n, t in _tensors(8, shapes).items()}
    compression = CompressionConfig(error_budget=0.3, bit_choices=[2, 4, 8, 16], min_compress_numel=1024)
    contributions = [encode_contribution(_tensors(10 + replica, shapes, 0.01), compression, stage_index=1,
                                         outer_round=5)[0] for replica in range(3)]
    cfg = dict(outer_optimizer="adam", outer_lr=0.003, outer_adam_beta2=0.999, outer_lr_other_scale=0.5)
    _, new_moments, digest = aggregate(weights, moments, contributions, DilocoConfig(**cfg), stage_index=1,
                                       outer_round=5)
    case = tmp_path / "case.pt"
    torch.save({"weights": weights, "momentum": moments, "contributions": contributions, "cfg": cfg}, case)
    replayed = subprocess.run(
        [sys.executable, "-c", REPLAY, str(case), "1"], capture_output=True, text=True, timeout=120,
        check=True
    ).stdout.split()
    assert replayed == [digest.hex(), repr(new_moments["h.1.mlp.c_fc.weight"].double().sum().item())]
    with pytest.raises(Exception, match="momentum shape"):  # a Nesterov-shaped state is refused, not misread
        aggregate(weights, {n: m[0] for n, m in moments.items()}, contributions, DilocoConfig(**cfg),
                  stage_index=1, outer_round=5)


def _sim(**diloco) -> SimConfig:
    """A Muon run with outer Adam whose settings are those an auditor rebuilds from its run document."""
    overrides = ["model.preset=tiny", "training.seed=3", "training.batch_size=4", "training.warmup_steps=2",
                 "training.optimizer=muon", "diloco.inner_steps=3", "diloco.num_replicas=2",
                 "diloco.outer_optimizer=adam", "diloco.outer_lr=0.01", "diloco.outer_adam_beta2=0.95",
                 "compression.min_compress_numel=512"] + [f"diloco.{key}={value}"
                                                          for key, value in diloco.items()]
    cfg = node_config_from_run(run_document(load_config(None, overrides)))
    assert (cfg.diloco.outer_optimizer, cfg.diloco.outer_adam_beta2) == ("adam", 0.95)
    return SimConfig(corpus=generated_corpus(seed=0, n_bytes=30_000), model=cfg.model, training=cfg.training,
                     diloco=cfg.diloco, compression=cfg.compression, num_stages=2, rounds=ROUNDS)


# Full exchange with the default delay correction and with "eager" (arXiv 2502.12996), the sliced exchange.
METHODS = {
    "full": ({}, SimReplica, PerturbedReplica),
    "full-eager": (dict(delay_correction="eager"), SimReplica, PerturbedReplica),
    "sliced": (dict(exchange="sliced"), SlicedReplica, SlicedPerturbed),
}


@pytest.mark.parametrize("method", list(METHODS))
def test_an_outer_adam_contribution_reruns_bit_exactly_chains_and_a_cheat_does_not(method):
    """Its start state carries both moments; the rerun (which takes the outer step of the round before, and
    "eager"'s estimate) gives the same bytes; the next state chains; a 1% cheat is caught."""
    diloco, honest, cheat = METHODS[method]
    sim = _sim(**diloco)
    SlicedReplica.partials = {}
    records = _records(sim, honest, cheat)
    partials = dict(SlicedReplica.partials)

    check = rerun_checker(sim, records, partials)

    moments = records[2].states[HONEST].stages[0].group("momentum")
    weights = records[2].states[HONEST].stages[0].group("global")
    assert all(tuple(m.shape) == (2, *weights[n].shape) for n, m in moments.items())
    assert any(bool(m[1].abs().sum() > 0) for m in moments.values())  # a second moment, after a round applied
    assert_honest_exact_and_cheat_caught(check, records, HONEST, PERTURBED, ROUNDS)


def test_an_outer_adam_start_state_round_trips_and_a_nesterov_run_refuses_it():
    sim = _sim()
    records = _records(sim, SimReplica, PerturbedReplica)
    state = records[2].states[HONEST]
    _, engines = restore_replica(state, sim.model, sim.training, sim.diloco, sim.compression)
    for engine, part in zip(engines, state.stages):
        saved = part.group("momentum")
        assert set(saved) == set(engine.momentum)
        assert all(torch.equal(engine.momentum[n], saved[n]) for n in saved)
    nesterov = DilocoConfig(inner_steps=3, num_replicas=2)
    with pytest.raises(ReplicaStateError, match="momentum"):
        restore_replica(state, sim.model, sim.training, nesterov, sim.compression)


def test_the_audit_replayer_and_the_checkpoint_layout_take_outer_adam_state():
    sim = _sim()
    replicas = [SimReplica(HONEST, sim), SimReplica(PERTURBED, sim)]
    from training.reexec_sim import run_with_states

    records = run_with_states(replicas, sim)
    document = run_document(load_config(None, [
        "model.preset=tiny", "training.seed=3", "training.batch_size=4", "training.warmup_steps=2",
        "training.optimizer=muon", "diloco.inner_steps=3", "diloco.num_replicas=2",
        "diloco.outer_optimizer=adam", "diloco.outer_lr=0.01", "diloco.outer_adam_beta2=0.95",
        "compression.min_compress_numel=512", "pipeline.num_stages=2"]))
    replayer = Replayer(document)
    replayer.start_from_initial()
    assert all(tuple(m.shape)[0] == 2 for stage in replayer.momentum for m in stage.values())
    for record in records:
        root = replayer.apply(record.outer_round, [record.contributions[s] for s in range(2)])
    engines = replicas[HONEST].engines
    assert root == weights_root([stage_weights_hash(engine.global_weights) for engine in engines])
    for stage, engine in enumerate(engines):
        assert all(torch.equal(replayer.momentum[stage][n], engine.momentum[n]) for n in engine.momentum)
    layout = RunLayout.of_document(1, config_hash(document), document)
    assert layout.outer_moments == 2 and not layout.chunked
    weights, moments = engines[0].global_weights, engines[0].momentum
    assert stage_problems(layout, 0, weights, moments, stage_weights_hash(weights)) == []
    problems = stage_problems(layout, 0, weights, {n: m[0] for n, m in moments.items()}, None)
    assert problems and "momentum" in problems[0]
