"""docs/TRUST.md's guarantees as forge invariants inside the EVM (contracts/forge, tests/forge_campaign.py).

The default suite runs a quick campaign (8 sequences of 64 calls of each of its three invariants: G1-G7 and
exact solvency after every call of TrustHandler's actors, G3 against the coalition's verdicts at close
quarters (VerdictInvariants.t.sol) and G7 over the fraud-proof game's moves alone (GameInvariants.t.sol));
the slow suite a long one; the bench (bench/fuzz_forge.py) at least 1,000,000 calls.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.forge_campaign import FORGE, FORGE_ROOT, GAME, INVARIANT, QUICK, VERDICTS, run_campaign


def forge_test(contract: str, **env: str) -> str:
    """``forge test`` of one test contract; its output, after checking that nothing failed."""
    done = subprocess.run([str(FORGE), "test", "--match-contract", contract], cwd=FORGE_ROOT,
                          env={**os.environ, **env, "NO_COLOR": "1"}, capture_output=True, text=True,
                          timeout=900, check=False)
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "[FAIL" not in out, out[-3000:]
    return out


def test_a_quick_invariant_campaign_finds_no_violation():
    campaign = run_campaign(runs=8, depth=64, seed=0x5EED, timeout=600, match=QUICK)
    assert campaign.passed, f"forge invariant campaign failed: {campaign.failures}\n{campaign.output[-3000:]}"
    assert {name: counts[:2] for name, counts in campaign.invariants.items()} == {
        INVARIANT: (8, 8 * 64), VERDICTS: (8, 8 * 64), GAME: (8, 8 * 64)}, campaign.invariants


@pytest.mark.slow
def test_a_long_invariant_campaign_finds_no_violation():
    campaign = run_campaign(runs=200, depth=500, seed=0xD1C0, timeout=3600)
    assert campaign.passed, f"forge invariant campaign failed: {campaign.failure}\n{campaign.output[-3000:]}"
    assert campaign.calls == 200 * 500


def test_the_fraud_proof_game_moves_step_by_step():
    """TrustGame.t.sol (issue 62): last-block, relayed and junk-first answers, silence, a copier of the proof
    and a coalition that leaves at once each end with the wrong round overturned by the one prover, every
    attester slashed, its bonds back and half the slash from the run's proof fund; right rounds stand. Issue
    79's moves: the coalition's own proof pays it only from the fund (funding its own run, it loses more than
    its whole stake), a short fund pays what it holds, a squatter opening every step first blocks none, a
    contributor that left before the commit (in its block, withdrawn, rejoined) leaves the round right, a run
    fills to its seat cap and a leave frees a seat, a hashed run takes no challenge."""
    out = forge_test("TrustGameTest")
    assert out.count("[PASS]") == 12, out[-3000:]


def test_a_member_counted_later_in_a_commits_block_cannot_sign_its_verdict():
    """VerdictTiming.t.sol: the long campaign's two counterexamples (a coalition joiner counted by a second
    commit in the round's block, a coalition seat that left in it before the commit: each tipped the round's
    verdict) refused with LedgerSignerNotInForce."""
    out = forge_test("VerdictTimingTest")
    assert out.count("[PASS]") == 2, out[-3000:]


def test_calldata_fuzzing_of_every_external_function_finds_no_unexpected_success():
    """CalldataFuzz.t.sol: junk, plausible words, cut commits, proofs with paths of any size: all refused."""
    out = forge_test("CalldataFuzzTest", FOUNDRY_FUZZ_RUNS="256")
    assert out.count("[PASS]") == 4, out[-3000:]


def test_the_reward_pool_keeps_its_books_in_a_quick_campaign():
    """PoolInvariants.t.sol (issue 77): R1-R5 after every call of PoolHandler's actors (commits listing signed
    contributions, claims of attestations and contributions by their accounts and others, top-ups of an ETH
    and a fee-on-transfer token pool, sweeps, a convicted attester's claim, an overturned round's claims, the
    re-entrant token), 16 sequences of 64 calls (foundry.toml); and the actors step by step (a final round's
    attestations and contributions paid once, a copier's, a forged entry's, a convicted attester's, an
    overturned round's and the armed token's calls refused)."""
    out = forge_test("PoolInvariantsTest")
    assert "[PASS] invariant_pool_books() (runs: 16, calls: 1024" in out, out[-3000:]
    assert "[PASS] test_the_actors_pay_and_refuse()" in out, out[-3000:]


def test_the_end_rule_and_the_end_relation_hold_in_the_evm():
    """StepProverEnd.t.sol (issue 78, the claim's end): setEndRule only by the run's creator, once, only the
    plain rule (1), and refused after the run's first commit; challengeEnd refused without the rule (and of
    an unknown claim); proveEnd on a claim bound to two committed rounds: the honest raw and quant answers
    taken, one ulp (raw) or one code (quant) off refused, a later answer's other width refused, the clock's
    last block taken and the next refused, timeout refuting the silent claim; rne against float32 addition's
    own rounding (random words, and the halves and integers with an ulp either side); endHolds of a raw piece
    and of a quant piece, one off refused, 256 fuzz runs each."""
    out = forge_test("StepProverEndTest", FOUNDRY_FUZZ_RUNS="256")
    assert out.count("[PASS]") == 13, out[-3000:]
