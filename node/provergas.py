"""The prover's reward against its gas (docs/FRAUD_PROOF.md, "The reward against the gas"; docs/TRUST.md).

A member that proves a wrong round is paid ``min(fund, slashed / 2)`` from the run's proof fund (issue 79: the
slash is burned whole, so a coalition proving itself loses all of it), at least ``min(fund, quorum x minStake
/ 2)`` (every wrong round has at least ``quorum`` attesters, each slashed whole); create-run deposits the fund
(:func:`proof_fund_for`). It gets back the bonds it escrowed; it pays
the gas of at most ``maxGameSteps`` availability challenges, one expiry, the proof's commitment and the
proof, whose gas the contract bounds at ``createRun`` (``LedgerCore.proofCost``, at most 10M, counting 32
slashed attesters; each further one adds at most ``PROOF_GAS_PER_ATTESTER`` and pays ``stake / 2``, and a run
holds at most ``MAX_SEATS`` = 256 members: issue 79, point 4). Proving is a
gain only while the reward exceeds that gas at the price of the day the prover sends it; the contract does
not check it (the stake and the quorum are the creator's), so the node does: ``create-run`` and the demo
refuse a run whose reward would not cover the prover's worst-case gas at today's price times
:data:`PRICE_SPIKE_FACTOR` (``--allow-unpaid-proofs`` creates it anyway), and ``join`` and ``start`` warn
a contributor about to take a seat in such a run (a member would be the one to prove).

Only a chunked run (commitments version 2 or 3) has a fraud proof; a hashed run's rounds are disputed, not
proven, so nothing here applies to it (:func:`prover_cost` returns None).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from decimal import Decimal

from ledger.runparams import PROOF_BASE_ATTESTERS, PROOF_GAS_PER_ATTESTER, PROOF_MAX_GAS, proof_cost

logger = logging.getLogger(__name__)

#: The most one availability challenge (``challengeAvailability``) cost, rounded up: 309,744 gas, a sum-tree
#: leaf's challenge at 9 contributions of rank 32 (198k-310k over every leaf, codec and count;
#: bench/results/fraud_proof.json ``availability_rows``, bench/bench_fraud_proof.py on anvil). A challenge's
#: target carries the stage's factors, so it grows with the contributions listed; the bench measures up to
#: the most a run may list. tests/test_prover_gas.py checks it against every row of that file.
CHALLENGE_GAS = 310_000
#: One unanswered challenge settled (``expireChallenge``): 190,538 gas at every count (the same file's
#: ``expire_gas``).
EXPIRE_GAS = 190_538
#: The proof's commitment (``AggregationProver.commitProof``, commit-reveal: docs/FRAUD_PROOF.md "The reward
#: goes to who found the fraud"): 45,820 gas on py-evm and anvil (tests/test_prover_gas.py measures it).
COMMIT_GAS = 45_820
#: The check prices the prover's gas at this many times today's price. The prover does not pay today: it
#: sends its challenges and proof during the game, up to ``proofWindowBound`` blocks after the commit (3,264
#: blocks, about 11 hours, at the defaults), and a wrong round is most worth forcing through when the chain
#: is congested. An EIP-1559 base fee rises 12.5% a block while blocks are full (tenfold in about 20 blocks,
#: four minutes), and mainnet's has moved more than tenfold within hours in past congestion; a reward that
#: covers ten times today's price still pays the prover through all but the rarest spikes.
PRICE_SPIKE_FACTOR = 10
#: What --allow-unpaid-proofs gives up (said by the refusal and by the warning when it is passed).
UNPAID = ("a wrong round may then stand with nobody paid to prove it (the audit and the dispute remain: "
          "docs/FRAUD_PROOF.md, \"The reward against the gas\")")


@dataclass(frozen=True)
class ProverCost:
    """A run's prover's worst case at one gas price (wei figures)."""

    steps: int  # maxGameSteps: the most challenges a game takes
    proof_gas: int  # the contract's bound on the run's proof (proofCost, at most PROOF_MAX_GAS)
    price: int  # wei per gas today (:func:`gas_price`)
    quorum: int  # k: the fewest attesters a wrong round has, each slashed whole
    stake: int  # minStake
    bond: int  # a challenge's bond, escrowed and returned to the winner
    fund: int | None = None  # the run's proof fund (issue 79); None: what create-run deposits, :attr:`cost`

    @property
    def gas(self) -> int:
        """The prover's worst-case gas: every challenge, one expiry, the commitment and the proof."""
        return self.steps * CHALLENGE_GAS + EXPIRE_GAS + COMMIT_GAS + self.proof_gas

    @property
    def spike_price(self) -> int:
        """The price the check assumes: today's times :data:`PRICE_SPIKE_FACTOR`."""
        return self.price * PRICE_SPIKE_FACTOR

    @property
    def cost(self) -> int:
        """What the worst case costs at :attr:`spike_price`."""
        return self.gas * self.spike_price

    @property
    def reward(self) -> int:
        """The least a proof pays: half the stakes of ``quorum`` slashed attesters, at most the run's proof
        fund, which pays it (issue 79: the slash is burned whole)."""
        fund = self.cost if self.fund is None else self.fund
        return min(self.quorum * self.stake // 2, fund)

    @property
    def seat_cost(self) -> int:
        """What one more attester adds to the proof's gas (its slash; issue 79) at :attr:`spike_price`: a
        round signed by more than the quorum pays the prover ``stake / 2`` more per attester, and must cost it
        less than that."""
        return PROOF_GAS_PER_ATTESTER * self.spike_price

    @property
    def covered(self) -> bool:
        return self.reward >= self.cost and self.stake // 2 >= self.seat_cost

    @property
    def stake_needed(self) -> int:
        """The least ``minStake`` (wei, rounded up to a micro-ETH) whose reward covers :attr:`cost`."""
        least = max(-(-2 * self.cost // max(self.quorum, 1)), 2 * self.seat_cost)
        return -(-least // 10**12) * 10**12

    @property
    def escrow(self) -> int:
        """The prover's liquidity up front: a bond per challenge, returned when it wins."""
        return self.steps * self.bond

    def shortfall(self) -> str:
        """Why the reward does not cover the gas, with every number."""
        half = self.quorum * self.stake // 2
        paid = (f"at least quorum x stake / 2 = {self.quorum} x {eth(self.stake)} / 2 = {eth(half)}"
                if self.reward == half else
                f"at most the run's proof fund, {eth(self.reward)} (issue 79: not the slash, which burns)")
        return (f"a member that proves a wrong round is paid {paid}, but may pay {self.gas:,} gas "
                f"({self.steps} challenges x {CHALLENGE_GAS:,}, one expiry {EXPIRE_GAS:,}, the commitment "
                f"{COMMIT_GAS:,} and the proof {self.proof_gas:,}) = {eth(self.cost)} at {gwei(self.price)} "
                f"today x {PRICE_SPIKE_FACTOR} (price spikes) = {gwei(self.spike_price)}; the stake needed "
                f"at k={self.quorum} is {exact_eth(self.stake_needed)}")

    def liquidity(self) -> str:
        """The escrow a prover must hold, in one line."""
        return (f"a prover escrows {self.steps} challenge bonds x {eth(self.bond)} = {eth(self.escrow)} up "
                f"front (returned when it wins), plus its gas ({self.gas:,} at most)")


def eth(wei: int) -> str:
    return f"{wei / 1e18:.6g} ETH"


def exact_eth(wei: int) -> str:
    """``wei`` in ETH, every digit kept (a figure to copy into a run file's ``stake_eth``)."""
    return f"{(Decimal(wei) / 10**18).normalize():f} ETH"


def gwei(wei: int) -> str:
    return f"{wei / 1e9:.6g} gwei"


def prover_gas(max_contributions: int, max_rank: int) -> int:
    """The proof's gas bound of a run (``proofCost``, which createRun holds under :data:`PROOF_MAX_GAS`)."""
    return min(proof_cost(max_contributions, max_rank)[0], PROOF_MAX_GAS)


def prover_cost(run, price: int) -> ProverCost | None:
    """The prover's worst case of ``run`` (a RunParams before createRun, a RunInfo after) at ``price`` wei per
    gas; None for a hashed run (no fraud proof)."""
    from node.commitments import scheme_of_version
    from node.errors import ConfigError

    try:
        if not scheme_of_version(run.commitments).chunked:
            return None
    except ConfigError:
        return None  # a version this node does not know: its check_run refuses the run with that reason
    # the proof's bound counts PROOF_BASE_ATTESTERS slashed attesters; a larger quorum adds its slashes
    extra = max(0, run.quorum - PROOF_BASE_ATTESTERS) * PROOF_GAS_PER_ATTESTER
    return ProverCost(steps=run.max_game_steps,
                      proof_gas=prover_gas(run.max_contributions, run.max_rank) + extra,
                      price=price, quorum=run.quorum, stake=run.min_stake, bond=run.bond)


def proof_fund_for(run, w3) -> int:
    """The wei create-run deposits into a new run's proof fund (issue 79): the prover's worst case at today's
    price times :data:`PRICE_SPIKE_FACTOR` (:attr:`ProverCost.cost`), so an honest finder's gas is paid,
    and no more, so that a coalition proving its own wrong round recovers little of what it loses (its
    slashed stakes are burned whole); 0 for a hashed run."""
    cost = prover_cost(run, gas_price(w3))
    return 0 if cost is None else cost.cost


def gas_price(w3) -> int:
    """Wei per gas a transaction pays on ``w3``'s chain now: the latest base fee plus the suggested tip, or
    ``eth_gasPrice`` where that is more (a chain without EIP-1559: ``eth_gasPrice`` alone)."""
    from web3.exceptions import Web3Exception

    quoted = w3.eth.gas_price
    base = w3.eth.get_block("latest").get("baseFeePerGas")
    if base is None:
        return quoted
    try:
        tip = w3.eth.max_priority_fee  # eth_maxPriorityFeePerGas, else web3's eth_feeHistory estimate
    except (Web3Exception, ValueError):  # neither served: eth_gasPrice holds the RPC's tip
        tip = 0
    return max(quoted, base + tip)


def check_reward(run, w3, *, allow: bool, where: str) -> list[str]:
    """Before createRun: the lines to print (the escrow; with ``allow``, the warning), or ConfigError naming
    the numbers when the reward does not cover the prover's gas (:func:`prover_cost`)."""
    from node.errors import ConfigError

    cost = prover_cost(run, gas_price(w3))
    if cost is None:
        return []
    lines = [cost.liquidity()]
    if not cost.covered:
        if not allow:
            raise ConfigError(
                f"{where}: the prover's reward does not cover its gas: {cost.shortfall()}. Raise the "
                "stake (or the quorum), or pass --allow-unpaid-proofs to create it anyway (a test chain): "
                f"{UNPAID}")
        lines.append(f"warning: unpaid proofs (--allow-unpaid-proofs): {cost.shortfall()}; {UNPAID}")
    return lines


def joining_warning(info, w3, fund: int | None = None) -> str:
    """For a contributor taking a seat in run ``info``: a warning when its reward does not cover a proof at
    today's price ("" when it does, for a hashed run, or when the price cannot be read: logged). ``fund``: the
    run's proof fund on chain (issue 79: the reward is paid from it); None: not read."""
    import dataclasses

    from web3.exceptions import Web3Exception

    try:
        cost = prover_cost(info, gas_price(w3))
        if cost is not None and fund is not None:
            cost = dataclasses.replace(cost, fund=fund)
    except (Web3Exception, OSError, ValueError) as exc:
        logger.info("the gas price was not read (%s): the prover's reward is not checked", exc)
        return ""
    if cost is None or cost.covered:
        return ""
    return (f"warning: run {info.run_id}'s reward does not cover a proof at today's gas price: "
            f"{cost.shortfall()}. A member would be the one to prove a wrong round; here proving it costs "
            f"more than it pays, so a wrong round may stand. {cost.liquidity()}")
