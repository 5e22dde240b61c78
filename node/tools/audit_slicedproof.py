"""``dlx-node audit --reexecute``: judging an ejection whose evidence is a sliced proof (docs/PROTOCOL.md,
"Sliced exchange": a wrong partial, a bad bundle).

Such evidence carries no contribution to rerun: it is a self-contained signed proof, judged by the rule the
members judged it by (:mod:`node.slicedproof`), with the plans, the aggregators' replay and the strict decode
derived from the run document (:class:`node.slicedproof.RunSliceRules`). The auditor checks, in order:

* the proof names the ejected member, and its first item (the partial, or the contribution) is signed by
  the node key of the ejected member's seat;
* a wrong partial's close is signed by a member of the run and, where the archives sealed that round and
  stage, names each input as the record does (a close made up to misname an input would frame an honest
  aggregator: the judge takes each input's entry from the close);
* every input the judge needs is there: a bundle the proof lacks (or holds with other bytes than its
  signed reference names, which is refused) is taken from the archives (``<sha256>.slice``), checked
  against that reference; a bad-bundle proof without the bundle takes the archived one likewise;
* then the judge: guilty is ``ok`` (the ejection is justified); not guilty is ``FAIL`` naming the ejected
  member and its accuser (the chain ejected a member on a proof that does not hold).

An input neither the proof nor the archives hold makes the ejection unverifiable, with what is missing:
nobody is failed for missing inputs.
"""

from __future__ import annotations

import hashlib
from typing import Any

from node import protocol as msg
from node.slicedproof import (
    BAD_BUNDLE,
    WRONG_PARTIAL,
    RunSliceRules,
    bad_bundle_evidence,
    bundle_fault,
    decode_wrong_partial,
    judge_bad_bundle,
    judge_wrong_partial,
    usable_reference,
    wrong_partial_evidence,
)
from node.tools.report import FAIL, OK, UNVERIFIABLE, Check
from p2p.envelope import Envelope, decode_envelope
from p2p.errors import EnvelopeRejected
from training.slice_plan import SliceError
from training.errors import TrainingError
from training.slicebundle import parse_slice_reference

#: The verdicts of the sliced exchange's self-contained proofs.
SLICED_PROOFS = (WRONG_PARTIAL, BAD_BUNDLE)
_MAX_BLOB = 1 << 32


class ProofRefused(Exception):
    """The proof does not hold, for a reason found before the judge (the judge's own reasons come back as
    is)."""


class InputsMissing(Exception):
    """An input the proof needs is neither in it nor in the archives: the ejection is unverifiable here."""


class SlicedProofAuditor:
    """Judges sliced-proof ejections (module docstring) from a run's settings and archives.

    ``archives``: node.tools.audit_reexec's archives (``round_blob``); ``sealed``: round -> its sealed
    [stage, replica, peer id, hash hex] entries; ``account_of``: peer id -> account of every seat the run had.
    """

    def __init__(self, cfg: Any, run_id: int, archives: Any, sealed: dict[int, list[list]],
                 account_of: dict[str, str]) -> None:
        self.cfg, self.run_id, self.archives, self.sealed, self.account_of = cfg, run_id, archives, sealed, \
            account_of
        self.rules = RunSliceRules(cfg)

    def check(self, name: str, accusation: Any, env: Envelope, evidence: msg.Evidence) -> Check:
        """The audit item of the ejection ``accusation`` (a guilty AccusationRecord) whose evidence envelope
        ``env`` carries the sliced proof ``evidence``."""
        accused = accusation.accused.lower()
        accuser = (getattr(accusation, "accuser", "") or self.account_of.get(env.sender_peer_id, "")
                   or env.sender_peer_id)
        notes: list[str] = []
        try:
            accused_peer = self._accused_signer(accused, env, evidence)
            if evidence.verdict == WRONG_PARTIAL:
                evidence = self._complete_wrong_partial(evidence, notes)
                guilty, why = judge_wrong_partial(evidence, accused_peer, run_id=self.run_id,
                                                  max_blob_bytes=self.cfg.p2p.max_blob_bytes,
                                                  num_slices=self.rules.num_slices, replay=self.rules.replay,
                                                  close_standing=self.close_standing)
            else:
                evidence = self._complete_bad_bundle(evidence, notes)
                guilty, why = judge_bad_bundle(evidence, accused_peer, run_id=self.run_id,
                                               max_blob_bytes=self.cfg.p2p.max_blob_bytes,
                                               num_slices=self.rules.num_slices, decodes=self.rules.decodes)
        except InputsMissing as exc:
            return Check(name, UNVERIFIABLE, f"{evidence.verdict} proof: {exc}", env.round)
        except (ProofRefused, TrainingError, ValueError) as exc:
            guilty, why = False, str(exc)
        note = "".join(f"; {n}" for n in notes)
        if guilty:
            return Check(name, OK, f"{evidence.verdict} proof holds: {why}{note}", env.round)
        if guilty is None:
            why = f"{why}: not a stage of the run"
        return Check(name, FAIL,
                     f"{evidence.verdict} proof does not hold ({why}){note}: {accused} was ejected "
                     f"on it (accused by {accuser})", env.round)

    def _accused_signer(self, accused: str, env: Envelope, evidence: msg.Evidence) -> str:
        """The peer id that signed the proof's first item, which must be the ejected member's seat's key."""
        if env.kind != msg.EVIDENCE or "0x" + evidence.accused.hex() != accused:
            raise ProofRefused("the evidence does not name the ejected member")
        if not evidence.contributions:
            raise ProofRefused("the proof holds no signed envelope")
        try:
            signer = decode_envelope(evidence.contributions[0], _MAX_BLOB).sender_peer_id
        except (EnvelopeRejected, ValueError) as exc:
            raise ProofRefused(f"the proof's first item is no signed envelope: {exc}") from None
        if self.account_of.get(signer, "").lower() != accused:
            raise ProofRefused(
                f"the proof's envelope is signed by {signer}, not by the ejected member's node key")
        return signer

    # -- a wrong partial ------------------------------------------------------------------------------
    def _complete_wrong_partial(self, evidence: msg.Evidence, notes: list[str]) -> msg.Evidence:
        """The proof with every usable input's bundle (from the archives where the proof lacks it), after
        checking its close against the run's members and the archived record. Leaves what does not parse
        to the judge, which refuses it."""
        try:
            header, partial, closing, close, envelopes, bundles = decode_wrong_partial(evidence, _MAX_BLOB)
        except (ValueError, EnvelopeRejected, SliceError, msg.ProtocolError):
            return evidence
        if len(close.contributions) != len(envelopes) or len(bundles) != len(envelopes):
            return evidence
        stands, why = self.close_standing(closing.round, closing.stage, closing.sender_peer_id, close)
        if not stands:
            raise ProofRefused(why)
        slices = self.rules.num_slices(header.stage)
        if slices is None:
            return evidence
        filled, missing = list(bundles), []
        for i, (entry, envelope, bundle) in enumerate(zip(close.contributions, envelopes, bundles)):
            reference = usable_reference(envelope, entry, self.run_id, header.round, header.stage, slices,
                                         self.cfg.p2p.max_blob_bytes)
            if reference is None or hashlib.sha256(bundle).digest() == reference.bundle_digest:
                continue
            who = str(entry[1])[-8:]
            refused = "holds other bytes than" if bundle else "lacks"
            archived = self.archives.round_blob(header.round, reference.bundle_digest.hex(), "slice")
            if archived is None:
                missing.append(f"the proof {refused} the bundle {reference.bundle_digest.hex()[:12]} of "
                               f"{who}'s input and no archive holds it")
                continue
            notes.append(f"the proof {refused} the bundle of {who}'s input: the archived one is used")
            filled[i] = archived
        if missing:
            raise InputsMissing("; ".join(missing) + ": the slice cannot be replayed here")
        if filled == bundles:
            return evidence
        partial_env, close_env = evidence.contributions[0], evidence.contributions[3]
        return wrong_partial_evidence(evidence.accused, evidence.replica, partial_env, envelopes, filled,
                                      close_env, evidence.reason)

    def close_standing(self, outer_round: int, stage: int, signer: str, close: msg.Close) -> tuple[bool, str]:
        """The judge takes each input's entry from the proof's close: it must be a member's, and name each
        input as the archived record of its round and stage does (``close_standing`` of the judge)."""
        if signer not in self.account_of:
            return False, f"the proof's close is signed by {signer}, no member of the run"
        record = {str(e[3]).lower(): (int(e[1]), str(e[2])) for e in self.sealed.get(outer_round, [])
                  if int(e[0]) == stage}
        for entry in close.contributions:
            try:
                named, digest = (int(entry[0]), str(entry[1])), bytes(entry[2]).hex()
            except (TypeError, ValueError, IndexError):
                return False, "the proof's close holds a malformed entry"
            if digest in record and record[digest] != named:
                return False, (f"the proof's close names input {digest[:12]} as replica {named[0]} of "
                               f"{named[1][-8:]}, the archived record as replica {record[digest][0]} of "
                               f"{record[digest][1][-8:]}")
        return True, "a member's close naming each input as the record does"

    # -- a bad bundle -------------------------------------------------------------------------------
    def _complete_bad_bundle(self, evidence: msg.Evidence, notes: list[str]) -> msg.Evidence:
        """A proof whose envelope's signed reference is sound and that lacks the referenced bundle (or holds
        other bytes, refused) takes it from the archives; the judge then decides on it. Anything else goes
        to the judge as it is (the envelope alone decides a malformed body or reference)."""
        if len(evidence.contributions) not in (1, 2):
            return evidence
        try:
            header = decode_envelope(evidence.contributions[0], _MAX_BLOB)
            slices = self.rules.num_slices(header.stage)
            if header.kind != msg.CONTRIBUTION or slices is None or \
                    bundle_fault(header, header.payload, None, slices, self.rules.decodes):
                return evidence
            reference = parse_slice_reference(msg.decode_contribution_body(header.payload).blob, slices,
                                              _MAX_BLOB)
        except (EnvelopeRejected, ValueError, msg.ProtocolError):
            return evidence
        bundle = evidence.contributions[1] if len(evidence.contributions) == 2 else None
        if bundle is not None and hashlib.sha256(bundle).digest() == reference.bundle_digest:
            return evidence
        digest = reference.bundle_digest.hex()
        refused = "lacks" if bundle is None else "holds other bytes than"
        archived = self.archives.round_blob(header.round, digest, "slice")
        if archived is None:
            raise InputsMissing(
                f"the proof {refused} the bundle {digest[:12]} its envelope's sound reference "
                "names and no archive holds it")
        notes.append(f"the proof {refused} the bundle {digest[:12]}: the archived one is judged")
        return bad_bundle_evidence(evidence.accused, evidence.replica, evidence.contributions[0], archived,
                                   evidence.reason)
