"""The fraud proof an audit would submit for a wrong round of a chunked run (issue 43; docs/FRAUD_PROOF.md).

When the replay of a chunked run's round gives another weights root than the committed one, the audit says
what would get the round overturned on chain, and whether that already happened:

- **its own proof**: the replay holds this round's and the round before's stage states (node/tools/
  audit_replay.py); the committed state of the round comes from the round's published checkpoint, whose
  stage leaves must give the committed weights root (a chunked checkpoint carries them). The first chunk
  that differs is opened (node.fraudproof.proof_of_difference) and the proof checked with the contract's
  view ``isWrong``: it is printed (as ``proveWrongAggregation``'s argument, hex) only if the chain says it
  holds;
- **a kept proof**: a node's prover keeps every proof it sent (``proofs/`` of its data dir,
  node/live/fraud/prover.py), a chunk's or, in a version-3 run, a norm proof of the clip scales (checked with
  ``isWrongNorm``); one in an ``--archive`` for this round is checked the same way, so a proof nobody has to
  trust. (The audit cannot build a norm proof itself: the committed factors and sum trees are served by the
  round's attesters, not held in its checkpoint; nor, for the same reason, issue 62's proofs of factors the
  run does not allow, the values proof, the scales' proof and the proof of a piece past the run's rank of
  node/live/fraud/values.py: it checks and shows the ones a node kept, and says so (:data:`FACTORS_NOT_HELD`)
  where the committed factors are not its replay's. Fetching them from peers would not help an audit after
  the round's proof window: the attesters stop serving them when it closes, and the chain takes no proof
  after it, ``ProverProofWindowClosed``.)

Round 0 is proven against the run's genesis root (issue 62, ``RunParams.genesisRoot``): the replay starts
from the run document's initial state, which must give that root.

Either way the round's verdict gets a "fraud proof" item: ok with the proof (and "already proven on chain"
or "not yet submitted"), or unverifiable with the reason no proof could be built here.
"""

import dataclasses
import json
from typing import Any

from node.errors import DLX_ERRORS, StateError
from node.tools.evidence import checkpoint_digest, first_good_copy
from node.tools.report import OK, UNVERIFIABLE, Check
from training.jsonbound import loads_bounded

#: The deepest nesting a node's kept proof file may have (3 in practice); deeper is refused before decoding.
PROOF_FILE_DEPTH = 16


def check_fraud_proof(verdict: Any, record: Any, prev_commit: Any, replayer: Any, sources: list, client: Any,
                      history: Any, layout: Any) -> None:
    """Add the round's "fraud proof" item to ``verdict`` (a chunked round whose replay differs from its
    commit)."""
    from ledger.errors import LedgerError
    from ledger.normproof import SCALES

    commit = record.commit
    invalid = client.invalid_from(commit.run_id)
    if history.dispute_outcomes.get(commit.round) == "proven wrong":
        status = "already proven on chain"
    elif invalid is not None and invalid <= commit.round:
        status = f"already invalid on chain (from round {invalid})"
    else:
        status = "not yet submitted"
    candidates, why_not = [], []
    try:
        own = _own_proof(commit, prev_commit, replayer, sources, layout,
                         bytes(getattr(history.run, "genesis_root", b"") or b""))
        schedule = _run_schedule(replayer, history)
        if schedule is not None:  # issue 62: the run's schedule leaf of the round
            leaf, path = schedule.opening(commit.round)
            own = dataclasses.replace(own, schedule_leaf=leaf, schedule_path=path)
        candidates.append(("built from the replay and the round's checkpoint", own))
    except _NoProof as exc:
        why_not.append(str(exc))
    candidates += [("kept by a node's prover", proof) for proof in _kept_proofs(sources, commit)]
    for origin, proof in candidates:
        # a norm proof (docs/FRAUD_PROOF.md, "The clip scales")
        norm = getattr(proof, "contribution", None) is not None
        try:
            holds = (client.norm_proof_holds if norm else client.proof_holds)(proof, record.attesters)
        except (*DLX_ERRORS, LedgerError) as exc:
            why_not.append(f"a proof {origin} does not check on chain: {type(exc).__name__}: {exc}"[:300])
            continue
        view, function = ("isWrongNorm", "proveWrongNorm") if norm else ("isWrong", "proveWrongAggregation")
        if not holds:
            why_not.append(f"a proof {origin} does not hold on chain ({view} is false)")
            continue
        what = (("the clip scales" if proof.contribution == SCALES else
                 f"contribution {proof.contribution}'s sum at chunk {proof.chunk}") if norm
                else "the factors against the run's values" if not proof.new_weights  # issue 62
                else f"chunk {proof.chunk}")
        verdict.checks.append(Check("fraud proof", OK,
                                    f"stage {proof.stage} {what}, {origin}, holds on chain "
                                                       f"({view}); {status}"))
        verdict.notes.append(f"fraud proof ({function}'s argument): " + json.dumps(proof.to_json(),
                                                                                   sort_keys=True))
        return
    verdict.checks.append(Check("fraud proof", UNVERIFIABLE, f"no proof built here ({status}): "
                                + "; ".join(why_not or ["no committed state of the round was found"])))


def _run_schedule(replayer: Any, history: Any):
    """The run's committed schedule (issue 62) if its chain binds one, from the replayed document."""
    if not getattr(history.run, "schedule_rounds", 0) or getattr(replayer, "cfg", None) is None:
        return None
    from node.commitments.values import schedule_of

    return schedule_of(replayer.cfg.diloco, history.run.max_rounds)


#: Why the audit builds no proof of a round whose committed factors are not its replay's (issue 62).
FACTORS_NOT_HELD = (
    "the committed factors are not the replay's (another lr, mu, Nesterov flag, clip, scale, set of "
    "contributions or binding); a proof of them needs the committed factors, which the round's checkpoint "
    "does not hold and its attesters serve only while its proof window is open, when the live nodes' "
    "provers build that proof (the values, scales' or chunk proof: see the proofs nodes kept, --archive); "
    "after the window no proof is taken on chain")


class _NoProof(Exception):
    """Why the audit cannot build its own proof of the round."""


def _own_proof(commit: Any, prev_commit: Any, replayer: Any, sources: list, layout: Any,
               genesis_root: bytes = b""):
    """The proof of the first differing chunk from the replay and the round's checkpoint; round 0's against
    the run's genesis root (issue 62: ``RunParams.genesisRoot``, the replay's start), if the run binds one."""
    from ledger.chunkproof import StageState, chunked_weights_root
    from node.fraudproof import parse_stage_leaf, proof_of_difference
    from node.store.checkpoint import chunked_problems, parse_checkpoint
    from training.chunks import tensor_leaves

    if commit.round == 0 and not any(genesis_root):
        raise _NoProof("round 0 of a run without a genesis root has no committed start to recompute from")
    if commit.round != 0 and prev_commit is None:
        raise _NoProof("a round after a gap has no committed round before it to recompute from")
    if replayer is None or replayer.states is None or replayer.prev_states is None or layout is None:
        raise _NoProof("the replay does not hold this round's and the round before's states")
    prev_leaves = [state.leaf() for state in replayer.prev_states]
    start = genesis_root if commit.round == 0 else prev_commit.weights_root
    if chunked_weights_root(prev_leaves) != start:
        raise _NoProof("the replay's start is not the run's genesis root" if commit.round == 0 else
                       f"the replayed round {commit.round - 1} is not the committed one (an earlier round "
                       "differs)")
    if commit.round == 0:
        prev_commit = None  # build_proof: round -1's record is only the run id
    if not commit.has_checkpoint:
        raise _NoProof(
            "the round published no checkpoint: its committed state is had only from its attesters "
            "(a node's prover fetches it; see the proofs a node kept)")
    expected = commit.checkpoint_hash.hex()
    copy = first_good_copy(sources, lambda src: src.checkpoint(commit.round, expected), expected,
                           checkpoint_digest(layout, expected))
    if copy.data is None:
        raise _NoProof(f"no source holds the round's checkpoint {expected[:16]}")
    try:
        ckpt = parse_checkpoint(copy.data)  # its hash checked (a header-hashed run's: its header's)
    except StateError as exc:
        raise _NoProof(f"the round's checkpoint does not parse: {exc}") from None
    problems = chunked_problems(ckpt, layout, commit.weights_root) if len(ckpt.weights) \
        else ["it holds no tensors"]
    if problems:
        raise _NoProof("the round's checkpoint is not the committed state: " + "; ".join(problems)[:300])
    stages = [parse_stage_leaf(ckpt.stage_leaves[s], s) for s in range(layout.num_stages)]
    for stage, mine in enumerate(replayer.states):
        if mine.leaf() == stages[stage]:
            continue
        if stages[stage].factors_hash != mine.factors.digest():
            raise _NoProof(f"stage {stage}: {FACTORS_NOT_HELD}")
        names = layout.stage_names(stage)
        committed = StageState(stage, tensor_leaves({n: ckpt.weights[n] for n in names}),
                               tensor_leaves({n: ckpt.momentum[n] for n in names}), mine.factors,
                               mine.payload_leaves)
        proof, why = proof_of_difference(prev_commit, commit, prev_leaves, stages,
                                         replayer.prev_states[stage], mine, committed)
        if proof is None:
            raise _NoProof(f"stage {stage}: {why}")
        return proof
    raise _NoProof("every stage's committed leaf is the replayed one")


def _kept_proofs(sources: list, commit: Any) -> list:
    """The proofs (a chunk's, or a norm proof) nodes kept for this round in the sources (their
    ``proofs/``)."""
    from ledger.chunkproof import AggregationProof
    from ledger.normproof import NormProof

    found = []
    for source in sources:
        for data in getattr(source, "proofs", lambda _r: [])(commit.round):
            try:
                document = loads_bounded(data, PROOF_FILE_DEPTH)["proof"]
                kind = NormProof if isinstance(document, dict) and document.get("kind") == "norm" \
                    else AggregationProof
                proof = kind.from_json(document)
            except (*DLX_ERRORS, ValueError, KeyError, TypeError):
                continue  # a file that is no proof: nothing to check
            if tuple(proof.record) == tuple(commit.fields()):
                found.append(proof)
    return found
