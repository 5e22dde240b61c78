"""Every bit-exact path of a recorded short run, computed in this process: run by tests/test_cross_isa.py in
subprocesses under several ``ATEN_CPU_CAPABILITY`` values and thread counts, which compare what they print.

    python tests/isa_probe.py RUN.pkl THREADS                     # prints one JSON object
    python tests/isa_probe.py RUN.pkl THREADS --no-wire-vectors   # without libp2p and eth-account

(``--no-wire-vectors``: the aarch64 python of scripts/setup-arm-emulation.sh has torch and numpy only; libp2p
0.8.1 needs fastecdsa 2.3.2, which PyPI has no aarch64 wheel of. ``wire_vectors`` is then ``null``.)

``RUN.pkl`` (written by the test): the run's config overrides and, per round, the start states, claims and
contributions of tests/test_cross_isa.py's claimants. Printed: the portable initial weights' hash, the codec's
sketch, the decode of every contribution, the data order, the weights root the audit's replay
(``node.tools.audit_replay.Replayer``, the audit's own code) gives for every round, every re-execution's
verdict, the re-encode of a fixed pseudo-gradient, and whether the wire vectors rebuild to the committed file.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for tensor in tensors:
        h.update(tensor.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main(run_path: str, threads: int, wire_vectors: bool = True) -> dict:
    torch.set_num_threads(threads)
    from node.config import load_config
    from node.runconfig import canonical_json, run_document
    from node.tools.audit_replay import Replayer
    from training.codec.factorize import sketch
    from training.codec_wire import decode_contribution
    from training.compression import encode_within_bandwidth
    from training.data import corpus_from_config, round_batches
    from training.model import init_state_dict
    from training.reexec import check_state_chain, verify_contribution
    from training.stages import split_stages, stage_param_shapes

    run = pickle.loads(Path(run_path).read_bytes())
    cfg = load_config(None, run["overrides"])
    document = json.loads(canonical_json(run_document(cfg)))
    out: dict = {"capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads()}

    initial = init_state_dict(cfg.model, cfg.training.seed)
    out["init"] = digest(*initial.values())
    out["sketch"] = digest(sketch(64, 24, torch.float32, cfg.compression.sketch))
    corpus = corpus_from_config(cfg.training, cfg.model)
    out["data"] = digest(*(t for replica in range(2) for x, y in round_batches(
        corpus, cfg.training.seed, replica, 1, cfg.diloco.inner_steps, cfg.training.batch_size,
        cfg.model.block_size)
        for t in (x, y)))

    specs = split_stages(cfg.model.n_layer, cfg.pipeline.num_stages)
    shapes = [stage_param_shapes(cfg.model, spec) for spec in specs]
    records = run["records"]
    out["decode"] = [digest(*decode_contribution(payload, shapes[stage], stage_index=stage,
                                                 outer_round=record["round"]).values())
                     for record in records for stage, payloads in sorted(record["contributions"].items())
                     for payload in payloads]

    # The codec's encode of a fixed pseudo-gradient (the one a re-execution re-encodes is checked below too).
    update = {name: initial[name] * 0.01 for name in shapes[0]}
    payload, _, _ = encode_within_bandwidth(update, cfg.compression, 20_000, stage_index=0, outer_round=0)
    out["encode"] = hashlib.sha256(payload).hexdigest()[:16]

    replayer = Replayer(document)
    replayer.start_from_initial()
    out["roots"] = [replayer.apply(record["round"],
                                   [record["contributions"][stage] for stage in range(len(specs))]
                                   ).hex() for record in records]
    # The replay's weights after the last round, as a version-1
    # root (the run's own roots are version 2 where it is
    # chunked): what the members' engines hold (tests/test_cross_isa.py compares it with theirs).
    from training.hashing import stage_weights_hash, weights_root

    out["weights"] = weights_root([stage_weights_hash(weights) for weights in replayer.weights]).hex()

    out["verdicts"], out["distances"], out["chains"] = [], [], []
    for index, record in enumerate(records):
        previous = records[index - 1]["contributions"] if index > 0 else None
        for replica, parts in sorted(record["states"].items()):
            check = verify_contribution(
                parts, record["claims"][replica], corpus, cfg.model, cfg.training, cfg.diloco,
                cfg.compression, outer_round=record["round"], replica=replica, run_rounds=len(records),
                previous_contributions=previous, threads=run["claimant_threads"])
            out["verdicts"].append(check.verdict)
            out["distances"].append(max(check.distances.values(), default=None))
            if index + 1 < len(records) and check.next_state_hashes is not None:
                claimed = [claim.state_hash for claim in records[index + 1]["claims"][replica]]
                out["chains"].append(check_state_chain(check.next_state_hashes, claimed))

    out["wire_vectors"] = None
    if wire_vectors:
        sys.path.insert(0, str(ROOT / "tests" / "vectors"))
        import make_vectors

        out["wire_vectors"] = make_vectors.render() == (ROOT / "tests" / "vectors" / "wire.json").read_text()
    return out


if __name__ == "__main__":
    print(
        json.dumps(main(sys.argv[1], int(sys.argv[2]), wire_vectors="--no-wire-vectors" not in sys.argv[3:])))
