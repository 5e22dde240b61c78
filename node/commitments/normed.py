"""Version 3, "normed": version 2 whose factors also commit the norm rule's inputs (ledger.normproof): the
clip bound, each accepted contribution's declared steps (a budgeted run) and the exact sum of squares of each
of its chunks, with their sum tree. A wrong clip scale or sum of squares is then provable on chain too, and so
are factors of another version than the run's (docs/FRAUD_PROOF.md, "The clip scales", "The run's version").
Each stage's factors and sum trees are published beside its state, under :func:`norms_key`
(``ChunkedScheme.published_parts``)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

from node.commitments.chunked import ChunkedScheme


def norms_key(stage_leaf: bytes) -> str:
    """The alias a version-3 stage's norm commitment is served under (its factors and sum trees)."""
    return hashlib.sha256(b"dlx-node/norms/v1" + stage_leaf).hexdigest()


class NormedScheme(ChunkedScheme):
    """Version 3: chunked, with the norm commitment in the factors; norm proofs too."""

    name = "normed"
    version = 3
    proves_factors = True
    audit_note = "chunk and norm proofs open its roots; factors of another version are proven wrong"

    def stage_norms(self, accepted: Sequence[bytes], shapes: Mapping[str, tuple[int, ...]], diloco,
                    decode_args: Mapping | None = None):
        from node.fraudproof import stage_norms

        return stage_norms(accepted, shapes, diloco, decode_args)
