"""Version 1, "hashed": a record commits one hash of each stage's weights (training.hashing.weights_root).

No fraud proof opens it: a wrong round is found by re-execution and the dispute (docs/TRUST.md). Every run
made before version 2, and every run whose outer step the contract cannot recompute (the sliced exchange,
outer Adam, a decoupled outer lr), is hashed; a run document that names no ``diloco.commitments`` is a hashed
run's."""

from __future__ import annotations

from collections.abc import Sequence

from node.commitments.base import CommitmentScheme


class HashedScheme(CommitmentScheme):
    """Version 1: the Merkle root of the stage weight hashes; no stage leaves, no states, no proofs."""

    name = "hashed"
    version = 1
    audit_note = "no fraud proof opens its roots"
    weakness = ("diloco.commitments=hashed (version 1): no fraud proof opens its roots, so a wrong round a "
                "quorum commits stands (safe: \"normed\", what \"auto\" gives)")

    def weights_root(self, stage_hashes: Sequence[bytes], stage_leaves: Sequence[bytes]) -> bytes:
        from training.hashing import weights_root

        return weights_root(list(stage_hashes))
