"""A verifier's rerun of a cluster node's round (issue 75; training/cluster_rerun.py, docs/CLUSTER.md)."""

from __future__ import annotations

import pytest
import torch

from training.fingerprint import PlatformFingerprint


def _platform(cluster: str) -> PlatformFingerprint:
    from training.platform import prepare_platform

    return prepare_platform("cpu", "fp32", False, cluster=cluster).fingerprint()


def test_the_ranks_a_verifier_reruns_on():
    """A claim of N ranks reruns on N ranks where the verifier may run N processes or more, else on one."""
    from training.cluster_rerun import claimed_ranks, rerun_ranks

    two, one = _platform("fsdp2;ranks=2"), _platform("")
    assert (claimed_ranks(two), claimed_ranks(one), claimed_ranks(None)) == (2, 1, 1)
    assert [rerun_ranks(two, p) for p in (0, 1, 2, 4)] == [1, 1, 2, 2]
    assert [rerun_ranks(one, p) for p in (1, 4)] == [1, 1]
    assert rerun_ranks(_platform("fsdp2;ranks=4"), 2) == 1  # fewer processes than the claim: one process


@pytest.mark.slow
def test_a_cluster_round_reruns_bit_exactly_on_as_many_processes_and_within_tolerance_on_one():
    """A 2-process cluster (the node's path: FSDP2 inner steps, sharded outer state) trains and encodes round
    0 from its start state; a verifier allowed 2 processes reruns it from the start state's bytes on 2 ranks
    of its own: the same contribution bytes, the same fingerprint (the same-platform rule: exact), and the
    next start state's inner AdamW state is the claimant's, bit for bit. A verifier of one process reruns it
    on the whole batch: other bytes, another platform, within the tolerance rule's pass bound."""
    from training.cluster_replica import ClusterReplicaTrainer
    from training.config import DilocoConfig, ModelConfig
    from training.config_compression import CompressionConfig
    from training.config_training import TrainingConfig
    from training.data import generated_corpus, round_batches
    from training.fingerprint import EXACT, RULE_SAME_PLATFORM, WITHIN_TOLERANCE, compare_rerun
    from training.model import init_state_dict
    from training.reexec_distance import contribution_distance
    from training.reexec_rerun import reexecute
    from training.reexec_rules import round_meta
    from training.replica_capture import start_state_bytes
    from training.replica_state import ReplicaStartState, parse_stage_state
    from training.schedule import inner_lr, set_lr

    model, training = ModelConfig(), TrainingConfig(device="cpu", batch_size=4)
    diloco, compression = DilocoConfig(inner_steps=2), CompressionConfig()
    corpus = generated_corpus()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cluster = ClusterReplicaTrainer(model, training, 2, init_state_dict(model, training.seed), threads=1)
        try:
            engine = cluster.outer_engine(0, diloco, compression)
            meta = round_meta(0, 0, model, diloco, run_rounds=3, num_stages=1, threads=1,
                              platform=cluster.platform.fingerprint())
            state_bytes = start_state_bytes(meta, engine, cluster.capture_part())
            batches = round_batches(corpus, training.seed, 0, 0, 2, training.batch_size, model.block_size)
            cluster.begin_steps()
            for step, (x, y) in enumerate(batches[:2]):
                set_lr([cluster.optimizer], inner_lr(training, step, meta.lr_total_steps))
                cluster.train_step(x, y)
            cluster.end_steps()
            claimed, _stats = engine.encode_contribution(0)
            trained = cluster.capture_part()
        finally:
            cluster.close()
        state = ReplicaStartState((parse_stage_state(state_bytes),))
        assert state.meta.platform.cluster == "fsdp2;ranks=2"
        rerun = reexecute(state, corpus, model, training, diloco, compression, processes=2)
        assert rerun.payloads[0] == claimed
        assert rerun.platform.cluster == "fsdp2;ranks=2"
        verdict = compare_rerun(meta.platform, rerun.platform, 0.0, claimed_threads=1,
                                rerun_threads=rerun.threads)
        assert (verdict.verdict, verdict.rule) == (EXACT, RULE_SAME_PLATFORM)
        following = rerun.next_state.stages[0].tensors  # round 1's start state: the cluster's AdamW state
        moments = [name for name in trained if name.startswith("adam.exp_avg")]
        assert moments and all(torch.equal(following[name], trained[name]) for name in moments)
        single = reexecute(state, corpus, model, training, diloco, compression, processes=1)
        assert single.platform.cluster == "" and single.payloads[0] != claimed
        shapes = {name[len("param/"):]: tuple(t.shape) for name, t in trained.items()
                  if name.startswith("param/")}
        distance = contribution_distance(claimed, single.payloads[0], shapes, stage_index=0, outer_round=0)
        verdict = compare_rerun(meta.platform, single.platform, distance, claimed_threads=1,
                                rerun_threads=single.threads)
        assert 0.0 < distance < 1e-4 and verdict.verdict == WITHIN_TOLERANCE
    finally:
        torch.set_num_threads(threads)


def test_audit_processes_option_is_checked():
    """``dlx-node audit --processes N``: a count of processes in [1, 256], else a clear error."""
    from node.errors import ConfigError
    from node.tools.audit_cli import _processes

    assert [_processes(v) for v in ("1", "2", 256)] == [1, 2, 256]
    for bad in ("0", "-1", "two", "257", None):
        with pytest.raises(ConfigError, match="--processes"):
            _processes(bad)
