"""Compiled inner steps for real (``training.compile``, inductor on this CPU; docs/DILOCOX.md section 11).

One tiny run (two replicas, one stage, H = 2, two rounds, one thread) trained compiled twice from the same
roots: the same payloads both times; its start states claim a compiled platform; a compiled rerun of a
compiled claim is bit-exact under the same-platform rule, in this process and in a fresh one that compiles
from an empty inductor cache (as another node would). The token-id check keeps the compiled forward one graph.

The run's tests are ``slow`` (inductor compiles the tiny model's forward and backward: about 40 s of CPU,
several minutes of wall time on a loaded 2-core machine): ``pytest -m slow tests/test_training_compile.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from training.config import DilocoConfig, ModelConfig, TrainingConfig
from training.config_compression import CompressionConfig
from training.data import generated_corpus
from training.errors import ModelInputError
from training.fingerprint import RULE_SAME_PLATFORM, fingerprint
from training.pipeline import LocalReplicaTrainer
from training.reexec import EXACT, verify_contribution
from training.reexec_sim import SimConfig, SimReplica, run_with_states
from training.stages import StageModule, split_stages

ROUNDS = 2


def _sim(compile: bool = True) -> SimConfig:
    return SimConfig(
        corpus=generated_corpus(seed=0, n_bytes=20_000), model=ModelConfig(preset="tiny"),
        training=TrainingConfig(seed=3, batch_size=4, warmup_steps=1, device="cpu", compile=compile),
        diloco=DilocoConfig(inner_steps=2, num_replicas=2),
        compression=CompressionConfig(min_compress_numel=512), num_stages=1, rounds=ROUNDS,
    )


@pytest.fixture(scope="module")
def one_thread():
    import torch._inductor.config as inductor_config

    threads, workers = torch.get_num_threads(), inductor_config.compile_threads
    torch.set_num_threads(1)
    inductor_config.compile_threads = 1  # no pool of compile workers for a model this small
    yield
    torch.set_num_threads(threads)
    inductor_config.compile_threads = workers


def _payloads(records) -> list[bytes]:
    return [payload for record in records for stage in sorted(record.contributions)
            for payload in record.contributions[stage]]


@pytest.fixture(scope="module")
def runs(one_thread):
    sim = _sim()
    first = run_with_states([SimReplica(r, sim) for r in range(2)], sim)
    second = run_with_states([SimReplica(r, sim) for r in range(2)], sim)
    return sim, first, second


@pytest.mark.slow
def test_compiled_training_is_deterministic_and_claims_a_compiled_platform(runs):
    sim, first, second = runs
    assert _payloads(first) == _payloads(second)
    claimed = first[1].states[0].meta.platform
    assert claimed.compiled.startswith("inductor;cc=")
    assert claimed == fingerprint(torch.device("cpu"), "fp32", compiled=True)
    assert claimed != fingerprint(torch.device("cpu"), "fp32")


@pytest.mark.slow
def test_a_compiled_rerun_of_a_compiled_claim_is_bit_exact(runs):
    sim, records, _ = runs
    record = records[1]
    # the verifier's own setting does not matter: the claim's does
    eager_verifier = _sim(compile=False).training
    check = verify_contribution(
        [part.to_bytes() for part in record.states[0].stages], record.claims[0], sim.corpus, sim.model,
        eager_verifier, sim.diloco, sim.compression, outer_round=1, replica=0, run_rounds=sim.rounds,
        previous_contributions=records[0].contributions,
    )
    assert check.verdict == EXACT and check.rule == RULE_SAME_PLATFORM, check.reason
    assert check.distances == {0: 0.0}


RERUN_IN_A_FRESH_PROCESS = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, sys.argv[2])
    from test_training_compile import _sim
    from training.reexec import verify_contribution
    case = torch.load(sys.argv[1], weights_only=False)
    sim = _sim(compile=False)
    check = verify_contribution(case["parts"], case["claims"], sim.corpus, sim.model, sim.training,
                                sim.diloco, sim.compression, outer_round=1, replica=0, run_rounds=sim.rounds,
                                previous_contributions=case["previous"])
    print(check.verdict, check.rule, max(check.distances.values()))
    """
)


@pytest.mark.slow
def test_a_fresh_process_compiling_from_an_empty_cache_reruns_the_claim_bit_exactly(runs, tmp_path):
    _, records, _ = runs
    case = tmp_path / "case.pt"
    torch.save({"parts": [p.to_bytes() for p in records[1].states[0].stages], "claims": records[1].claims[0],
                "previous": records[0].contributions}, case)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", RERUN_IN_A_FRESH_PROCESS, str(case),
                          os.path.dirname(__file__)],
                         capture_output=True, text=True, timeout=1800, check=True, env=env).stdout.split()
    assert out == [EXACT, RULE_SAME_PLATFORM, "0.0"]
    assert os.listdir(tmp_path / "inductor")  # it compiled for itself


def test_the_compiled_forward_is_one_graph_and_bad_ids_are_refused(one_thread):
    model = ModelConfig(preset="tiny")
    module = StageModule(model, split_stages(model.n_layer, 1)[0], seed=0)
    ids = torch.randint(0, model.vocab_size, (2, model.block_size))
    explained = torch._dynamo.explain(module)(ids)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    trainer = LocalReplicaTrainer(model, TrainingConfig(device="cpu", compile=True))
    bad = ids.clone()
    bad[0, 0] = model.vocab_size
    with pytest.raises(ModelInputError, match="token ids"):
        trainer.train_step(bad, ids)
