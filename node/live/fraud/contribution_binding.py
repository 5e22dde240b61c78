"""A version-3 run's contributions bound to their members (issue 62; docs/FRAUD_PROOF.md, "The binding").

The contributor signs, with its member account, the EIP-712 ``Contribution`` message of each contribution it
sends (:meth:`ContributionBinder.sign`: its payload root, sum-tree root and declared steps, derived from the
codec blob as the factors list them) and the signature travels in the contribution body
(``node.protocol.ContributionBody``: ``contributor`` and ``binding``). Every peer that fetches the
contribution checks it (:meth:`ContributionBinder.check`) and refuses a contribution whose binding is
missing, is not the sender's account or does not recover to it (:class:`ContributionUnbound`); the
committers copy each accepted contribution's account and signature into the factors (:func:`bindings_of`),
where ``AggregationProver`` holds them to the members of the round.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from eth_utils import to_checksum_address

from ledger.errors import LedgerInputError
from node.protocol import ContributionBody, ProtocolError, decode_contribution_body
from p2p.envelope import decode_envelope
from p2p.errors import EnvelopeRejected
from training.config import DilocoConfig

logger = logging.getLogger(__name__)


class ContributionUnbound(ProtocolError):
    """A contribution of a version-3 run without a valid binding: no signature, another account than the
    sender's, or a signature that does not recover to its contributor over its own roots. Refused."""


@dataclass(frozen=True)
class ContributionBinder:
    """Signs this node's contributions and checks its peers' (module docstring).

    ``chain``: this node's chain (``node.live.chain.onchain.NodeChain``: its account signs, its chain id and
    ledger name the EIP-712 domain); ``refuse_raw``: as the run's decode (``compression.enabled``)."""

    run_id: int
    chain: Any
    diloco: DilocoConfig
    refuse_raw: bool

    def _claim(self, outer_round: int, stage: int, blob: bytes, shapes: Mapping[str, tuple[int, ...]]):
        from node.fraudproof import contribution_claim  # torch: imported where a contribution is at hand

        return contribution_claim(blob, shapes, self.diloco, run_id=self.run_id, outer_round=outer_round,
                                  stage=stage, decode_args={"stage_index": stage, "outer_round": outer_round,
                                                            "refuse_raw": self.refuse_raw})

    def sign(self, outer_round: int, stage: int, blob: bytes,
             shapes: Mapping[str, tuple[int, ...]]) -> tuple[bytes, bytes]:
        """``(contributor, binding)`` of this node's contribution ``blob``: its account (20 bytes) and its
        signature of the contribution's message; ``(b"", b"")`` for a blob no round can accept (a non-finite
        value has no sum of squares): sent unbound, every peer refuses it, as every aggregation would."""
        try:
            claim = self._claim(outer_round, stage, blob, shapes)
        except ValueError as exc:  # LedgerInputError, ContributionDecodeError
            logger.warning("round %d stage %d: contribution sent unbound: %s", outer_round, stage, exc)
            return b"", b""
        return self.chain.account_bytes, self.chain.sign_contribution(claim)

    def check(self, outer_round: int, stage: int, body: ContributionBody,
              shapes: Mapping[str, tuple[int, ...]], sender_account: bytes | None) -> None:
        """Raise :class:`ContributionUnbound` unless ``body`` carries its sender's valid binding.
        ``sender_account``: the account the sender's hello named (None: not heard; the signature is still
        checked, and the contract holds the account to the round's members)."""
        if not body.binding:
            raise ContributionUnbound("contribution carries no binding signature (a version-3 run needs one)")
        if sender_account is not None and body.contributor != sender_account:
            raise ContributionUnbound(f"contribution bound to account 0x{body.contributor.hex()}, not its "
                                      f"sender's 0x{sender_account.hex()}")
        try:
            claim = self._claim(outer_round, stage, body.blob, shapes)
        except ValueError as exc:  # LedgerInputError, ContributionDecodeError: no round can accept it
            raise ContributionUnbound(f"contribution has no roots to bind: {exc}") from None
        try:
            signer = self.chain.contributor_of(claim, body.binding)
        except LedgerInputError as exc:
            raise ContributionUnbound(f"contribution's binding signature is malformed: {exc}") from None
        if bytes.fromhex(signer[2:]) != body.contributor:
            raise ContributionUnbound(f"contribution's binding signature recovers to {signer}, not its "
                                      f"contributor 0x{body.contributor.hex()} (signed over other roots)")


def bindings_of(bodies: Sequence[ContributionBody | None]) -> list[tuple[str, bytes] | None]:
    """Each body's ``(contributor, signature)`` as the factors list them (None: none, or no body)."""
    return [None if body is None or not body.binding
            else (to_checksum_address(body.contributor), body.binding) for body in bodies]


def bindings_in(envelopes: Sequence[bytes | None]) -> list[tuple[str, bytes] | None]:
    """:func:`bindings_of` the bodies of closed contribution envelopes (None: not held here, or unbound)."""
    bodies: list[ContributionBody | None] = []
    for data in envelopes:
        try:
            envelope = None if data is None else decode_envelope(data, len(data))
            bodies.append(None if envelope is None else decode_contribution_body(envelope.payload))
        except (EnvelopeRejected, ProtocolError):
            bodies.append(None)
    return bindings_of(bodies)
