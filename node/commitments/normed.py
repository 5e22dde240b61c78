"""Version 3, "normed": version 2 whose factors also commit the norm rule's inputs (ledger.normproof): the
clip bound, each accepted contribution's declared steps (a budgeted run) and the exact sum of squares of each
of its chunks, with their sum tree. A wrong clip scale or sum of squares is then provable on chain too, and so
are factors of another version than the run's (docs/FRAUD_PROOF.md, "The clip scales", "The run's version").
Each stage's factors and sum trees are published beside its state, under ``norms_key``
(node/commitments/chunked.py, ``ChunkedScheme.published_parts``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from node.commitments.chunked import ChunkedScheme


class NormedScheme(ChunkedScheme):
    """Version 3: chunked, with the norm commitment in the factors; norm proofs too."""

    name = "normed"
    version = 3
    proves_factors = True
    audit_note = "chunk and norm proofs open its roots; factors of another version are proven wrong"
    weakness = ""  # version 2's is what this version closes

    def stage_norms(self, accepted: Sequence[bytes], shapes: Mapping[str, tuple[int, ...]], diloco,
                    decode_args: Mapping | None = None):
        from node.fraudproof import stage_norms

        return stage_norms(accepted, shapes, diloco, decode_args)
