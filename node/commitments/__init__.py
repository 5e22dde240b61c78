"""The run's commitment scheme, one home for what differs between versions (docs/FRAUD_PROOF.md, "Where the
scheme lives"): the protocol (base.py), one module per version (hashed.py, chunked.py, normed.py) and the
registry by the run document's ``diloco.commitments`` (registry.py)."""

from node.commitments.base import CommitmentScheme
from node.commitments.registry import (
    SCHEMES,
    UNNAMED,
    register,
    scheme_named,
    scheme_of,
    scheme_of_version,
    unregister,
    version_name,
)

__all__ = [
    "SCHEMES",
    "UNNAMED",
    "CommitmentScheme",
    "register",
    "scheme_named",
    "scheme_of",
    "scheme_of_version",
    "stage_state",
    "unregister",
    "version_name",
]


def stage_state(stage: int, aggregation, contributions, diloco, outer_round: int, **options):
    """The run's scheme's state of ``stage`` after ``aggregation`` (training.diloco.Aggregation) of
    ``contributions`` (node.fraudproof.stage_state_of)."""
    scheme = scheme_of(diloco)
    return scheme.stage_state_of(stage, aggregation.new_global, aggregation.new_momentum,
                                 aggregation.contributions, contributions, diloco, outer_round, **options)
