"""Which recorded contributions this node re-executes: the sampled draw, routed by declared platform (issue
42).

A pure function of chain-bound data, so every node derives every other node's checks alike and no
clock or arrival order moves them: round ``t``'s attested weights root, the replicas and signers its
record binds (the sealed contributions), and each signer's platform as declared on chain when it
joined (``MemberJoined``'s ``platform``: :func:`training.declaration.platform_declaration`).

Two draws, each by :func:`training.reexec.sample_score` (docs/DILOCOX.md section 11, "Sampling rule"):

* **everyone**: verifier ``v`` checks replica ``i`` with probability ``spot_checks / (replicas - 1)``, as
  before routing: every contribution keeps its expected ``spot_checks`` checks from the whole run;
* **routed**: where the run has verifiers (other than ``i``'s own signers) whose declaration can judge one
  of ``i``'s signers' declarations bit-exactly (:func:`training.declaration.can_judge`: the same platform,
  or the same CPU model, torch build, device and precision on a CPU that has the claimant's instruction
  set, which reruns under the claimant's kernels: "emulated"), each of them checks ``i`` with probability
  ``spot_checks / len(those)``: a claimant of a platform another member can judge gets, in expectation,
  ``spot_checks`` checks by a verifier whose rerun is bit-exact (judged "exact" or "emulated", never
  "undecided").

A verifier checks ``i`` if either draw picks it (the same score under two rates: with one platform in
the run the two draws coincide and nothing is rerun twice). The first draw stays so that declaring a
platform only a colluding member shares never takes a contribution out of the other members' checks.
"""

from __future__ import annotations

from dataclasses import dataclass

from training.declaration import NO_PLATFORM, can_judge
from training.reexec import sample_score


@dataclass(frozen=True)
class DrawnCheck:
    """One replica a verifier re-executes, and whether only the routed draw picked it (``same_platform``: the
    verifier can judge it exactly or by emulation, :func:`routed_verifiers`)."""

    replica: int
    same_platform: bool


def routed_verifiers(replica: int, signers: dict[int, set[str]], declared: dict[str, bytes]) -> list[str]:
    """The round's signers of other replicas whose declaration can judge, bit-exactly, a declaration of one of
    ``replica``'s signers (:func:`training.declaration.can_judge`), sorted; a member that declared no platform
    is judged by nobody this way."""
    own = signers.get(replica, set())
    platforms = {declared.get(peer, NO_PLATFORM) for peer in own} - {NO_PLATFORM}
    pool = {peer for other, peers in signers.items() if other != replica for peer in peers} - own
    return sorted(peer for peer in pool
                  if any(can_judge(declared.get(peer, NO_PLATFORM), platform) for platform in platforms))


def draw_checks(record_hash: bytes, verifier: str, outer_round: int, signers: dict[int, set[str]],
                declared: dict[str, bytes], spot_checks: float, own_replica: int | None) -> list[DrawnCheck]:
    """The replicas ``verifier`` (a peer id) re-executes in ``outer_round`` (module docstring), in replica
    order.

    ``signers``: replica -> the peer ids that signed its contributions of the round (the sealed record);
    ``declared``: peer id -> its declared platform (absent or :data:`NO_PLATFORM`: declared none).
    """
    if spot_checks <= 0:
        return []
    replicas = sorted(signers)
    rate = min(1.0, spot_checks / (max(2, len(replicas)) - 1))
    out = []
    for replica in replicas:
        if replica == own_replica or verifier in signers[replica]:
            continue
        same = routed_verifiers(replica, signers, declared)
        routed = min(1.0, spot_checks / len(same)) if verifier in same else 0.0
        score = sample_score(record_hash, verifier.encode(), outer_round, replica)
        if score < max(rate, routed):
            out.append(DrawnCheck(replica, score >= rate))
    return out


