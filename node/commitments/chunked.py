"""Version 2, "chunked": a record commits one stage leaf per stage (ledger.chunkproof.StageLeaf): the roots of
the stage's weights and outer momentum cut into chunks, and the hash of the round's factors (outer lr and
momentum, the accepted contributions' envelopes, payload roots and clip scales). A fraud proof opens one chunk
(docs/FRAUD_PROOF.md): the contract recomputes it with its own outer step, so the run's outer loop must be
that one. The factors are published beside each stage's state (``published_parts``), so a prover can hold
them to the run's values."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

from node.commitments.base import CommitmentScheme
from node.errors import ConfigError


def norms_key(stage_leaf: bytes) -> str:
    """The alias a stage's factors (and, version 3, its sum trees: its norm commitment) are served under."""
    return hashlib.sha256(b"dlx-node/norms/v1" + stage_leaf).hexdigest()


class ChunkedScheme(CommitmentScheme):
    """Version 2: stage leaves over chunk roots and factors; chunk proofs and availability challenges."""

    name = "chunked"
    version = 2
    chunked = True
    audit_note = "chunk proofs open its roots"
    weakness = ("diloco.commitments=chunked (version 2): its rounds bind no contribution to a member and its "
                "factors carry no norm commitment, so a fabricated contribution, a wrong clip scale or a "
                "non-finite piece a quorum lists cannot be proven wrong (safe: \"normed\", what \"auto\" "
                "gives)")

    def check_config(self, diloco) -> None:
        if not diloco.contract_outer_step:
            raise ConfigError(
                f"diloco.commitments={self.name!r} needs diloco.exchange = \"full\" "
                f"(now {diloco.exchange!r}), diloco.outer_lr_other_scale = 1 "
                f"(now {diloco.outer_lr_other_scale}) and "
                f"diloco.outer_optimizer = \"nesterov\" (now {diloco.outer_optimizer!r}): the fraud proof's "
                "outer step averages whole contributions and takes a Nesterov step with one outer lr; set "
                "diloco.commitments = \"hashed\"")

    def weights_root(self, stage_hashes: Sequence[bytes], stage_leaves: Sequence[bytes]) -> bytes:
        from ledger.chunkproof import chunked_weights_root
        from node.fraudproof import parse_stage_leaf

        leaves = [parse_stage_leaf(leaf, stage) for stage, leaf in enumerate(stage_leaves)]
        return chunked_weights_root(leaves)

    def attested_leaf(self, attestation, stage: int) -> bytes | None:
        from ledger.errors import LedgerInputError
        from node.fraudproof import parse_stage_leaf

        if not attestation.stage_leaf:
            return None
        try:
            parse_stage_leaf(attestation.stage_leaf, stage)
        except LedgerInputError:
            return None
        return attestation.stage_leaf

    def stage_state_of(self, stage: int, new_global: Mapping, new_momentum: Mapping, reports, contributions,
                       diloco, outer_round: int, *, envelopes: Sequence[bytes] | None = None,
                       decode_args: Mapping | None = None, bindings: Sequence | None = None):
        from node.fraudproof import stage_state_of

        return stage_state_of(stage, new_global, new_momentum, reports, contributions, diloco, outer_round,
                              envelopes=envelopes, decode_args=decode_args, norms=self.stage_norms,
                              bindings=bindings)

    def published_parts(self, leaf: bytes, state) -> list[tuple[str, bytes]]:
        """The stage's factors (and, version 3, its sum trees) under ``norms_key(leaf)``: a prover whose own
        factors differ opens them to hold them to the run's values (issue 62: a version-2 round's lr, mu,
        Nesterov flag, count and ranks are provable too, node/live/fraud/values.py)."""
        from ledger.normproof import encode_norm_state

        return [(norms_key(leaf), encode_norm_state(state.factors.encode(), state.sum_trees))]
