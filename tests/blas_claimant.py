"""A claimant of tests/test_platform_blas.py: trains one round of a short run in this process and pickles
its start states, claims and contributions. The test starts it under a math-library setting
(``MKL_CBWR=COMPATIBLE``) that the verifier does not have.

    python tests/blas_claimant.py OUT.pkl
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

OVERRIDES = ["model.preset=tiny", "pipeline.num_stages=1", "diloco.num_replicas=2", "diloco.inner_steps=2",
             "training.batch_size=4", "training.warmup_steps=2", "compression.min_compress_numel=512"]
THREADS = 1


def main(out: str) -> None:
    from node.config import load_config
    from training.data import corpus_from_config
    from training.reexec_sim import SimConfig, SimReplica, run_with_states

    torch.set_num_threads(THREADS)
    cfg = load_config(None, OVERRIDES)
    sim = SimConfig(corpus_from_config(cfg.training, cfg.model), cfg.model, cfg.training, cfg.diloco,
                    cfg.compression, cfg.pipeline.num_stages, rounds=1)
    replicas = [SimReplica(r, sim) for r in range(cfg.diloco.num_replicas)]
    record = run_with_states(replicas, sim)[0]
    Path(out).write_bytes(pickle.dumps({
        "round": record.outer_round, "claims": record.claims,
        "states": {replica: [part.to_bytes() for part in state.stages]
                       for replica, state in record.states.items()},
    }))


if __name__ == "__main__":
    main(sys.argv[1])
