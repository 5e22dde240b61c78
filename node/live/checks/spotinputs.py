"""What a spot check of (round, replica) reads, gathered in every topology (docs/PROTOCOL.md, "Spot checks").

A replica's round is rerun whole, all stages in one process
(:func:`training.reexec.reexecute`): a stage cannot be rerun alone from its own
start state, since each of its inner steps reads the activations of the stage
before, the gradients of the stage after, and the global gradient norm of every
stage (clipping). So a check needs, for every stage of the replica, the signed
contribution envelope (it binds the stage's start state and the round's data),
the start state it binds, and round t-1's closed contributions of every stage
(the delayed outer step the round applies).

A whole-replica node seals every stage of a round in its archive. A node of a
*split* cluster (one stage per node) seals only the stage it holds. When round
``t`` is recorded on chain, this module binds the round's contributions of every
stage to the record: the closes the node heard (every stage's, gossiped) are
combined until the Merkle root of their envelope hashes, stage by stage, is the
record's ``contributions_root``, and the attested stage weights hashes until
their root is the record's ``weights_root``. Both lists are kept next to the
sealed round (``recorded.json``, :meth:`node.store.archive.Archive.record_round`).
An envelope the node does not hold is then fetched by its hash from its signer
and the other holders of its stage, checked (hash, signature, round, stage,
replica, signer, body) and archived, so that ``audit --reexecute`` over the
node's archive finds it too. Anything not served in time, or refused, makes
the check *not done*: nobody is accused for missing inputs.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ledger.errors import LedgerInputError
from ledger.merkle import merkle_root
from node import protocol as msg
from node.commitments import CommitmentScheme
from node.errors import NodeError, StateError
from node.fsutil import write_when_space
from node.store.archive import ArchivedContribution
from p2p.envelope import Envelope, decode_envelope
from p2p.errors import EnvelopeRejected, P2PError

logger = logging.getLogger(__name__)

#: Combinations of candidate closes (or attested hashes) tried against the record before giving up: a round
#: normally has one close per stage; equivocating coordinators add a few.
MAX_COMBINATIONS = 256
#: How long one envelope fetch waits for its providers.
ENVELOPE_FETCH_TIMEOUT_S = 60.0


class InputsUnavailable(NodeError):
    """A spot check's inputs are not here, not served in time, or not bound to the record: check not done."""


class InputRefused(InputsUnavailable):
    """A peer served bytes that are not the input the record binds (wrong hash, signer, round, stage...)."""


@dataclass(frozen=True)
class HeardRound:
    """What this node heard of a round's closes and attestations when the round was recorded on chain."""

    # stage -> distinct closes, each a tuple of (replica, peer, hash)
    closes: dict[int, list[tuple[tuple, ...]]]
    attested: dict[int, list[bytes]]  # stage -> distinct weights hashes attested (this node's first)
    # the run's commitments (node/commitments/): how the record's weights root is built
    scheme: CommitmentScheme
    # A chunked run's: stage -> weights hash -> the stage leaf
    # first attested with it (node/live/fraud/chunkstate.py).
    leaves: dict[int, dict[bytes, bytes]] = field(default_factory=dict)


def heard_round(outer_round: int, num_stages: int, closes: Callable, attestations: Callable,
                own_hashes: dict[int, bytes], scheme: CommitmentScheme) -> HeardRound:
    """Snapshot the book's closes and attestations of ``outer_round`` (``closes``/``attestations``:
    :meth:`node.live.state.roundbook.RoundBook.snapshot_closes` / ``snapshot_attestations``) in a run of
    commitment ``scheme``."""
    heard_closes: dict[int, list[tuple[tuple, ...]]] = {}
    attested: dict[int, list[bytes]] = {}
    leaves: dict[int, dict[bytes, bytes]] = {}
    for stage in range(num_stages):
        distinct = []
        for close, _data in closes(outer_round, stage).values():
            entries = tuple((int(r), str(p), bytes(h)) for r, p, h, _size in close.contributions)
            if entries not in distinct:
                distinct.append(entries)
        heard_closes[stage] = distinct
        hashes = [own_hashes[stage]] if stage in own_hashes else []
        for attestation in attestations(outer_round, stage).values():
            if attestation.weights_hash not in hashes:
                hashes.append(attestation.weights_hash)
            leaf = scheme.attested_leaf(attestation, stage)
            if leaf:
                leaves.setdefault(stage, {}).setdefault(attestation.weights_hash, leaf)
        attested[stage] = hashes
    return HeardRound(heard_closes, attested, scheme, leaves)


def bind_to_record(heard: HeardRound, num_stages: int, contributions_root: bytes,
                   weights_root: bytes) -> tuple[list[ArchivedContribution], list[bytes]]:
    """The round's contributions of every stage and its stage weights hashes, chosen among what was heard so
    that their roots are the record's; raises :class:`InputsUnavailable` if no combination is."""
    stages = range(num_stages)
    options = [heard.closes.get(stage, []) for stage in stages]
    chosen = None
    for combination in itertools.islice(itertools.product(*options), MAX_COMBINATIONS):
        if merkle_root([h for entries in combination for (_r, _p, h) in entries]) == contributions_root:
            chosen = combination
            break
    if chosen is None:
        raise InputsUnavailable(f"no closes heard here ({[len(o) for o in options]} per stage) give the "
                                "record's contributions root")
    hashes = None
    for combination in itertools.islice(itertools.product(*[heard.attested.get(s, []) for s in stages]),
                                        MAX_COMBINATIONS):
        if _root_of(heard, list(combination)) == weights_root:
            hashes = list(combination)
            break
    if hashes is None:
        raise InputsUnavailable("no attested stage hashes heard here give the record's weights root")
    entries = [ArchivedContribution(stage, replica, peer, digest)
               for stage, close in zip(stages, chosen) for (replica, peer, digest) in close]
    return entries, hashes


def _root_of(heard: HeardRound, hashes: list[bytes]) -> bytes | None:
    """The record's weights root of these stage hashes in the run's scheme (a chunked one's over the stage
    leaves attested with them: None where one is missing)."""
    try:
        return heard.scheme.weights_root(hashes,
                                         [heard.leaves.get(s, {}).get(h, b"") for s, h in enumerate(hashes)])
    except LedgerInputError:
        return None


def parse_fetched_contribution(data: bytes, entry: ArchivedContribution, outer_round: int, run_id: int,
                               max_bytes: int) -> Envelope:
    """A fetched envelope, if it is the contribution the record binds at ``entry``; else
    :class:`InputRefused`."""
    if hashlib.sha256(data).digest() != entry.envelope_hash:
        raise InputRefused(f"served bytes do not hash to envelope {entry.envelope_hash.hex()[:16]}")
    try:
        env = decode_envelope(data, max_bytes)
        msg.decode_contribution_body(env.payload)
    except (EnvelopeRejected, msg.ProtocolError) as exc:
        raise InputRefused(
            f"envelope {entry.envelope_hash.hex()[:16]} is not a contribution: {exc}") from None
    found = (env.kind, env.run_id, env.round, env.stage, env.replica, env.sender_peer_id)
    wanted = (msg.CONTRIBUTION, run_id, outer_round, entry.stage, entry.replica, entry.peer_id)
    if found != wanted:
        raise InputRefused(f"envelope {entry.envelope_hash.hex()[:16]} is {found[:5]} signed by "
                           f"{found[5][-8:]}, not {wanted[:5]} signed by {entry.peer_id[-8:]}")
    return env


class ReplicaInputs:
    """A replica's envelopes of every stage and the record's stage hashes, from the archive or the stage
    holders."""

    def __init__(self, *, archive, host, membership, run_id: int, peer_id: str, num_stages: int,
                 max_blob_bytes: int, work_dir: Path) -> None:
        self.archive = archive
        self.host = host
        self.membership = membership
        self.run_id = run_id
        self.peer_id = peer_id
        self.num_stages = num_stages
        self.max_blob_bytes = max_blob_bytes
        self.work_dir = work_dir
        self.fetched = 0  # envelopes fetched from other stages' holders (status, logs)

    def record(self, outer_round: int, heard: HeardRound, contributions_root: bytes,
               weights_root: bytes) -> None:
        """Bind the round heard to its record and keep it with the sealed round (module docstring)."""
        entries, hashes = bind_to_record(heard, self.num_stages, contributions_root, weights_root)
        try:
            self.archive.record_round(outer_round, entries, hashes)
        except (StateError, OSError) as exc:
            raise InputsUnavailable(f"round {outer_round}'s record not kept: {exc}") from None

    def contributions(self, outer_round: int) -> list[ArchivedContribution] | None:
        """The round's contributions of every stage: as recorded, else as sealed here (a whole replica's
        node)."""
        recorded = self.archive.recorded(outer_round)
        return recorded[0] if recorded is not None else self.archive.sealed(outer_round)

    def committed(self, outer_round: int) -> dict[int, bytes]:
        """stage -> the record's weights hash of ``outer_round`` (empty if not recorded here)."""
        recorded = self.archive.recorded(outer_round)
        return {} if recorded is None else dict(enumerate(recorded[1]))

    def envelopes(self, outer_round: int, replica: int) -> list[Envelope]:
        """``replica``'s contribution envelopes of ``outer_round``, one per stage in stage order (fetched and
        archived if this node does not hold them); raises :class:`InputsUnavailable`."""
        entries = sorted((c for c in self.contributions(outer_round) or [] if c.replica == replica),
                         key=lambda c: c.stage)
        if [c.stage for c in entries] != list(range(self.num_stages)):
            raise InputsUnavailable(
                f"round {outer_round}: replica {replica}'s contributions of every stage are not "
                "in the round as recorded here")
        return [self.envelope(outer_round, entry) for entry in entries]

    def envelope(self, outer_round: int, entry: ArchivedContribution) -> Envelope:
        """One recorded contribution envelope: from the archive, else fetched from its holders and
        archived."""
        try:
            data = self.archive.get(outer_round, entry.envelope_hash)
            return decode_envelope(data, self.max_blob_bytes)
        except StateError:
            pass
        placements = dict(self.membership.placements)
        providers = [entry.peer_id] + sorted(p for p, placed in placements.items()
                                             if entry.stage in placed.stages and p not in (entry.peer_id,
                                                                                          self.peer_id))
        dest = self.work_dir / f"envelope-{entry.envelope_hash.hex()}.part"
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.host.fetch_blob(entry.envelope_hash.hex(), dest, providers=providers,
                                 timeout=ENVELOPE_FETCH_TIMEOUT_S)
            data = dest.read_bytes()
        except (P2PError, OSError) as exc:
            raise InputsUnavailable(f"round {outer_round} stage {entry.stage}: envelope "
                                    f"{entry.envelope_hash.hex()[:16]} of replica {entry.replica} not served "
                                    f"by its {len(providers)} holder(s): {exc}") from None
        finally:
            dest.unlink(missing_ok=True)
        try:
            env = parse_fetched_contribution(data, entry, outer_round, self.run_id, self.max_blob_bytes)
        except InputRefused:
            self._forget(entry)
            raise
        # The archive's copy is for the audit; a full disk
        # must not fail the check that has the bytes in memory.
        write_when_space(lambda: self.archive.put(outer_round, data), size=len(data), kind="archive",
                         what=f"round {outer_round}'s fetched contribution "
                              f"{entry.envelope_hash.hex()[:16]} (archive)")
        self.fetched += 1
        return env

    def _forget(self, entry: ArchivedContribution) -> None:
        try:
            self.host.remove_blob(entry.envelope_hash.hex())
        except (P2PError, OSError, ValueError) as exc:
            logger.debug("refused envelope %s not removed: %s", entry.envelope_hash.hex()[:16], exc)
