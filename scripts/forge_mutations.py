#!/usr/bin/env python3
"""Mutation check of the forge invariants (issue 63): seed real bugs into a copy of the contracts and show
that the quick invariant campaign catches each.

Each mutation edits one line of one contract in a temporary copy of contracts/src beside a copy of the forge
suite (contracts/forge), runs the quick campaign (tests/forge_campaign.py's ``QUICK``: TrustInvariants.t.sol's
`invariant_trust_model`, VerdictInvariants.t.sol's coalition verdicts and GameInvariants.t.sol's fraud-proof
games, one compilation) and expects it to fail; the invariants that failed and the guarantee each names are
reported. The unmutated tree must pass first. docs/TRUST.md ("Mutations the invariants catch") lists them.

    python scripts/forge_mutations.py                # all, 16 runs x 64 calls of each invariant
    python scripts/forge_mutations.py --only tenure  # one (names below), e.g. to see its counterexample

"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.forge_campaign import FORGE_ROOT, QUICK, REPO, run_campaign  # noqa: E402


@dataclass(frozen=True)
class Mutation:
    name: str
    source: str  # under contracts/src
    old: str  # must occur exactly once in the source
    new: str
    bug: str


MUTATIONS = (
    Mutation("tenure", "LedgerCore.sol",
             "if (uint256(round) >= uint256(member.joinRound) + run.tenureRounds) {", "if (true) {",
             "drop the tenure check: a joiner counts from its first credited round"),
    Mutation("count-uncounted", "TrainingLedger.sol",
             "if (LedgerCore.credit(runId, run, member, signers[i], round)) ++counted;",
             "LedgerCore.credit(runId, run, member, signers[i], round);\n            ++counted;",
             "count a non-counted signer toward a commit's quorum"),
    Mutation("quorum-floor", "LedgerCore.sol", "(uint256(bps) * counted + BPS - 1) / BPS",
             "(uint256(bps) * counted) / BPS", "round the quorum fraction down instead of up"),
    Mutation("dispute-others-signature", "LedgerDisputes.sol",
             "if (disputer != msg.sender) revert "
             "TrainingLedger.LedgerDisputerNotSender(disputer, msg.sender);",
             "", "let `dispute` take another member's signature"),
    Mutation("reward-twice", "LedgerDisputes.sol", '(bool ok,) = payable(recipient).call{value: reward}("");',
             'payable(recipient).call{value: reward}("");\n'
             '        (bool ok,) = payable(recipient).call{value: reward}("");',
             "pay the prover's reward twice"),
    Mutation("withdraw-early", "LedgerMembership.sol", "if (block.number < member.unbondingEnd) {",
             "if (false) {",
             "let an unbonding member withdraw before its unbonding (and the accusation window) ends"),
    Mutation("verdict-no-quorum", "LedgerDisputes.sol",
             "if (signers.length < quorum) revert "
             "TrainingLedger.LedgerQuorumNotMet(quorum, signers.length);", "",
             "settle a round's disputes without the round's quorum"),
    Mutation("eject-live", "LedgerMembership.sol", "if (missed < run.inactivityRounds) {", "if (false) {",
             "eject a member however recently it attested"),
    Mutation("accuse-too-late", "LedgerAccusations.sol",
             "if (member.status == TrainingLedger.MemberStatus.Unbonding "
             "&& block.number >= member.unbondingEnd) {",
             "if (false) {", "accept an accusation after the accused's unbonding ended (locks its stake)"),
    Mutation("slash-unaccounted", "LedgerCore.sol", "s.slashedTotal += stake;", "",
             "slash a stake without accounting for it"),
    Mutation("leave-keeps-count", "LedgerCore.sol",
             "run.memberCount -= 1;\n        if (member.countedBlock != 0) run.countedCount -= 1;\n"
             "        emit",
             "run.memberCount -= 1;\n        emit", "a leaver keeps counting toward the quorum"),
    Mutation("expire-keeps-lock", "LedgerAccusations.sol",
             "s.members[runId][accused].openAccusations -= 1;", "",
             "a lapsed accusation keeps the accused's stake locked"),
    Mutation("same-block-leaver", "LedgerCore.sol",
             "unbondingBlocks <= blockNumber", "unbondingBlocks < blockNumber",
             "count a verdict signature of a seat that left in the accusation's or the commit's block "
             "(bugs the campaign found)"),
    Mutation("same-block-counted", "LedgerDisputes.sol",
             "_roundVerdictSigners(s, runId, uint64(committedAt), digest",
             "_roundVerdictSigners(s, runId, uint64(committedAt) + 1, digest",
             "count a round verdict's signature of a seat counted in the commit's block after it "
             "(the bug the 1,000,000-call campaign found)"),
    Mutation("final-in-window", "TrainingLedger.sol",
             "if (block.number < closesAt) return false;", "",
             "call a round final inside its (proof) window"),
    # issue 62: the fraud-proof game (TrustGame.sol's moves)
    Mutation("skip-stage-path", "ProverCommon.sol",
             "if (!verifyLeaf(leaf, stage, numStages, path, root)) {\n"
             "            revert AggregationProver.ProverBadStagePath(round, stage);\n        }", "",
             "skip a proof's Merkle path check of the stage leaf (`ProverCommon.openStageLeaf`)"),
    Mutation("skip-answer-path", "ProverAvailability.sol",
             "if (!opened) revert AggregationProver.ProverBadPath(0);", "",
             "accept an availability answer whose leaf and path do not open the committed root"),
    Mutation("clock-stops", "ProverAvailability.sol",
             "if (block.number >= closedAt && block.number >= game.continueBy) {",
             "if (block.number >= closedAt) {",
             "no chess clock: a game's next step only within the round's dispute window"),
    Mutation("reward-to-copier", "ProverAvailability.sol",
             "if (committedAt != 0 && committedAt < block.number) {", "if (true) {",
             "pay a proof's reward to its sender whether or not it committed to it first"),
    Mutation("bonds-kept", "ProverAvailability.sol", "amount = game.escrow;", "amount = 0;",
             "keep a winning challenger's escrowed bonds"),
    Mutation("unbonding-short", "LedgerCore.sol",
             "uint64 unbondingEnd = uint64(block.number) + run.unbondingBlocks;",
             "uint64 unbondingEnd = uint64(block.number) + run.disputeBlocks;",
             "end a leaver's unbonding with the dispute window, before its proof window and longest game"),
    Mutation("dispute-bond-short", "LedgerDisputes.sol",
             "if (msg.value != run.bond) revert", "if (msg.value < run.bond) revert",
             "accept a dispute bond other than the run's"),
    Mutation("binding-window-short", "ProverBinding.sol",
             "block.number < ledger.commitBlockOf(record.runId, record.round) + run.unbondingBlocks",
             "block.number < ledger.commitBlockOf(record.runId, record.round) + run.disputeBlocks",
             "read a listed contributor's seat only within the round's dispute window: a non-member's own "
             "signature in a round committed right after its parent stands"),
    # issue 79, one per fix
    Mutation("leave-unbinds", "ProverBinding.sol",
             "return member.status != TrainingLedger.MemberStatus.None && member.joinRound <= round;",
             "return member.status == TrainingLedger.MemberStatus.Active && member.joinRound <= round;",
             "a listed contributor that left before the commit (in its block, by a higher tip) unbinds its "
             "contribution: a right round proven wrong, its honest attesters slashed"),
    Mutation("challenge-id-without-challenger", "ProverAvailability.sol",
             "target.which, target.chunk, msg.sender));", "target.which, target.chunk));",
             "challenge ids omit the challenger: a squatter's copy blocks the walker's step"),
    Mutation("hashed-run-challenged", "ProverAvailability.sol",
             "if (run.commitments < 2) revert AggregationProver.ProverNoAnswerer(record.runId);", "",
             "a hashed run, whose nodes answer nothing, takes availability challenges: an outsider's expiry "
             "slashes a right round"),
    Mutation("seats-uncapped", "LedgerMembership.sol",
             "if (run.memberCount >= LedgerCore.MAX_SEATS) revert TrainingLedger.LedgerRunFull(runId, "
             "LedgerCore.MAX_SEATS);", "",
             "no seat cap: a run of ~1,234 seats commits a round whose proof does not fit a block"),
    Mutation("reward-from-slash", "LedgerDisputes.sol",
             "if (reward > fund) reward = fund;\n        s.proofFunds[runId] = fund - reward;\n"
             "        s.proofFundTotal -= reward;",
             "s.slashedTotal -= reward;",
             "pay the prover half the slash out of the slash (the old rule): a coalition proving its own "
             "round recovers half its stake"),
    Mutation("withdraw-forgets-seat", "LedgerMembership.sol", "member.pastUntil = run.commitCount + 1;", "",
             "a withdrawal forgets the withdrawn seat's rounds (issue 79 point 1): a contributor that left, "
             "withdrew and rejoined while its round was open unbinds its contribution"),
    Mutation("reward-beyond-fund", "LedgerDisputes.sol", "if (reward > fund) reward = fund;", "",
             "the reward is not capped by the run's proof fund (issue 79, the self-proof): a proof of a run "
             "whose fund is short reverts and its wrong round stands"),
)


#: The suites the quick campaign does not run (left out of a mutated tree: less to compile).
NOT_QUICK = ("CalldataFuzz.t.sol", "MoneySymbolic.t.sol", "TrustGame.t.sol", "VerdictTiming.t.sol",
             "Pool*.sol")


def mutated_tree(workdir: Path, mutation, left_out: tuple[str, ...] = NOT_QUICK) -> Path:
    """A copy of the forge suite whose src/ is a copy of contracts/src with ``mutation`` applied (its
    ``source`` under contracts/src, its ``old`` text replaced by ``new``); the test files matching
    ``left_out`` are not copied."""
    root = workdir / "forge"
    shutil.copytree(FORGE_ROOT, root, symlinks=False,
                    ignore=shutil.ignore_patterns("out", "cache", "src", *left_out))
    shutil.copytree(REPO / "contracts" / "src", root / "src")
    (workdir / "node_modules").symlink_to(REPO / "contracts" / "node_modules")  # the solc wrapper's solcjs
    if mutation is not None:
        path = root / "src" / mutation.source
        text = path.read_text()
        if text.count(mutation.old) != 1:
            raise SystemExit(f"mutation {mutation.name}: {mutation.old!r} occurs {text.count(mutation.old)} "
                             f"times in {mutation.source} (the contract changed: update the mutation)")
        path.write_text(text.replace(mutation.old, mutation.new))
    return root


def check(mutation: Mutation | None, runs: int, depth: int, seed: int, shrink: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="forge-mutation-") as tmp:
        campaign = run_campaign(runs, depth, seed, root=mutated_tree(Path(tmp), mutation), timeout=1800,
                                match=QUICK, shrink=shrink)
    name = mutation.name if mutation else "none"
    return {"mutation": name, "bug": mutation.bug if mutation else "(the contracts as they are)",
            "caught": not campaign.passed, "failure": campaign.failure, "caught_by": campaign.failures,
            "calls": campaign.calls, "invariants": campaign.invariants, "seconds": round(campaign.seconds, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", choices=[m.name for m in MUTATIONS])
    parser.add_argument("--runs", type=int, default=16)
    parser.add_argument("--depth", type=int, default=64)
    parser.add_argument("--seed", type=lambda v: int(v, 0), default=0x5EED)
    parser.add_argument("--shrink", type=int, default=0,
                        help="forge's shrink run limit for a counterexample (0: none, the fastest; the "
                             "reason is the same)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the unmutated run (it passed in an earlier call with the same settings)")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    results = [{"mutation": "none", "caught": False, "skipped": True} if args.no_baseline
               else check(None, args.runs, args.depth, args.seed, args.shrink)]
    print(json.dumps(results[0]), flush=True)
    for mutation in chosen:
        results.append(check(mutation, args.runs, args.depth, args.seed, args.shrink))
        print(json.dumps(results[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    baseline_ok = not results[0]["caught"]
    missed = [r["mutation"] for r in results[1:] if not r["caught"]]
    print(f"baseline {'passes' if baseline_ok else 'FAILS'}; {len(results) - 1 - len(missed)} of "
          f"{len(results) - 1} mutations caught" + (f"; missed: {', '.join(missed)}" if missed else ""))
    return 0 if baseline_ok and not missed else 1


if __name__ == "__main__":
    sys.exit(main())
