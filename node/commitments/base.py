"""What a commitment scheme is: how a run's records commit each stage's state (docs/FRAUD_PROOF.md, "Where the
scheme lives").

A run names its scheme once, in its run document (``diloco.commitments``, a name of the registry:
node/commitments/registry.py); the ledger holds it as ``RunParams.commitments``, the scheme's :attr:`version`.
Every part of the node that differs between versions (the record's weights root, a stage's leaf and factors,
the chunk states a node keeps and publishes, what the prover may prove, what the audit says) asks the run's
scheme object instead of testing which version it holds. A new version is one module with a subclass and one
line in the registry.

The torch-side building blocks (node.fraudproof) are imported where a method needs them, so that reading and
validating a configuration (node.config) stays free of torch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from ledger.chunkproof import Norms, StageState
    from ledger.normproof import SumTree
    from training.config import DilocoConfig
    from training.robust import ContributionReport


class CommitmentScheme:
    """One version of a run's commitments. Subclasses set the class attributes and override what differs."""

    #: The run document's ``diloco.commitments``: the scheme's one name.
    name: ClassVar[str] = ""
    #: ``RunParams.commitments``: the number the contract holds the run's rounds to (a uint8).
    version: ClassVar[int] = 0
    #: Whether a record's weights root is over stage leaves (chunk roots and factors): then every node keeps
    #: and publishes its stage states, proves wrong rounds and answers availability challenges
    #: (node/live/fraud/).
    chunked: ClassVar[bool] = False
    #: Whether the factors carry the norm commitment, so a wrong clip scale or sum of squares is provable
    #: (ledger/normproof.py) and the stage's norm state is published beside its state.
    proves_factors: ClassVar[bool] = False
    #: What the audit says opens a committed root of this scheme (node/tools/audit_replay.py).
    audit_note: ClassVar[str] = ""
    #: What a run of this scheme gives up against the trust model (issue 79), "" for none: ``create-run``
    #: refuses a new run of it without ``--weak-run``, and a node joining one logs it once (docs/TRUST.md).
    weakness: ClassVar[str] = ""

    # -- the configuration -------------------------------------------------------------------------------
    def check_config(self, diloco: DilocoConfig) -> None:
        """Raise ``ConfigError`` (saying how to fix it) if the run's outer loop cannot be committed by this
        scheme."""

    # -- the record ---------------------------------------------------------------------------------------
    def weights_root(self, stage_hashes: Sequence[bytes], stage_leaves: Sequence[bytes]) -> bytes:
        """The record's ``weightsRoot`` of a round from its stages' weight hashes and (a chunked scheme's)
        stage leaves, one per stage in stage order. ``LedgerInputError`` for a stage leaf that does not
        parse."""
        raise NotImplementedError

    def attested_leaf(self, attestation, stage: int) -> bytes | None:
        """What an attestation of ``stage`` adds to its result: its stage leaf (b"" where the scheme has
        none), or None if it carries none that parses (such an attestation counts for nothing)."""
        return b""

    # -- a stage's state ----------------------------------------------------------------------------------
    def stage_norms(self, accepted: Sequence[bytes], shapes: Mapping[str, tuple[int, ...]],
                    diloco: DilocoConfig,
                    decode_args: Mapping | None = None) -> tuple[Norms | None, list[SumTree]]:
        """The norm commitment of a stage's accepted contributions and their sum trees (None, []: none)."""
        return None, []

    def stage_state_of(self, stage: int, new_global: Mapping, new_momentum: Mapping,
                       reports: Sequence[ContributionReport], contributions: Sequence[bytes],
                       diloco: DilocoConfig, outer_round: int, *, envelopes: Sequence[bytes] | None = None,
                       decode_args: Mapping | None = None, bindings: Sequence | None = None) -> StageState:
        """The stage's committed state after a round (node.fraudproof.stage_state_of); only a chunked scheme
        has one."""
        raise NotImplementedError(f"the {self.name!r} commitments keep no stage state")

    def published_parts(self, leaf: bytes, state: StageState) -> list[tuple[str, bytes]]:
        """``(alias, blob)`` served beside the stage's state (its weights and momentum) for provers."""
        return []

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} version {self.version}>"
