// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {NodeRegistry} from "../src/NodeRegistry.sol";
import {RewardPool} from "../src/RewardPool.sol";
import {TrainingLedger} from "../src/TrainingLedger.sol";
import {QuirkyToken} from "../src/test/QuirkyToken.sol";
import {PoolHandler} from "./PoolHandler.sol";
import {TrustBase} from "./TrustBase.sol";
import {InvariantTargets} from "./Vm.sol";

/// @notice The cheatcodes the campaign's tally uses (bench/fuzz_forge_pool.py reads it): an environment variable
/// and a line appended to a file under cache/ (foundry.toml's fs_permissions).
interface VmTally {
    function envOr(string calldata name, string calldata defaultValue) external view returns (string memory);
    function writeLine(string calldata path, string calldata data) external;
    function toString(uint256 value) external pure returns (string memory);
}

/// @notice The reward pool's invariants (issue 77; tests/trust_pool.py's R1-R5) after every call of PoolHandler's
/// actors: `forge test --root contracts/forge --match-contract PoolInvariantsTest` (tests/test_forge_pool.py;
/// the long campaign: bench/fuzz_forge_pool.py).
contract PoolInvariantsTest is TrustBase, InvariantTargets {
    uint128 internal constant AMOUNT = 10 ** 15;
    NodeRegistry internal registry;
    TrainingLedger internal ledger;
    PoolHandler internal handler;
    uint256 internal runId;

    function setUp() public {
        _castAddresses();
        registry = new NodeRegistry(0);
        ledger = new TrainingLedger(registry);
        for (uint256 key = 1; key <= OUTSIDER; ++key) register(registry, key);
        TrainingLedger.RunParams memory params = runParams(keccak256("pool"));
        vm.prank(who(1));
        runId = ledger.createRun(params, "pool");
        for (uint256 key = 1; key <= 6; ++key) {
            vm.prank(who(key));
            ledger.joinRun{value: STAKE}(runId, bytes32("cpu"));
        }
        vm.roll(block.number + 1);
        QuirkyToken token = new QuirkyToken();
        token.setMode(QuirkyToken.Mode.FeeOnTransfer, 1_000);
        RewardPool ethPool = new RewardPool(ledger);
        RewardPool tokenPool = new RewardPool(ledger);
        RewardPool.PoolParams memory pool = RewardPool.PoolParams({
            amountPerRound: AMOUNT, attesterBps: 2_000, contributionSlots: 6, attesterSlots: 8,
            claimBlocks: params.unbondingBlocks, token: address(0)
        });
        vm.prank(who(1));
        ethPool.createPool{value: 6 * AMOUNT}(runId, pool, 6 * AMOUNT);
        pool.token = address(token);
        token.mint(who(1), 8 * AMOUNT);
        vm.prank(who(1));
        token.approve(address(tokenPool), 8 * AMOUNT);
        vm.prank(who(1));
        tokenPool.createPool(runId, pool, 8 * AMOUNT);
        handler = new PoolHandler(ledger, runId, ethPool, tokenPool, token);
        vm.deal(address(handler), 1000 ether);
        targetContract(address(handler));
    }

    /// @notice R1-R5 after every call, in one campaign; a failure names the invariant it broke.
    function invariant_pool_books() public view {
        vm.assertEq(bytes(handler.violation()).length, 0, handler.violation());
        for (uint256 p = 0; p < 2; ++p) {
            RewardPool pool = handler.pools(p);
            RewardPool.Pool memory view_ = pool.poolOf(runId);
            uint256 funded = handler.funded(p);
            uint256 paid = handler.paid(p);
            uint256 held = p == 0 ? address(pool).balance : handler.token().balanceOf(address(pool));
            vm.assertEq(held, funded - paid, "R4: the pool's balance is not funded - claimed");
            vm.assertEq(view_.funded, funded, "R4: funded is not what arrived");
            vm.assertEq(view_.claimed, paid, "R4: claimed is not what the claims paid");
            uint256 free = view_.free;
            for (uint64 r = view_.firstRound; r < view_.nextRound; ++r) {
                RewardPool.RoundBudget memory budget = pool.roundOf(runId, r);
                vm.assertLe(budget.paid, budget.budget, "R1: a round paid past its budget");
                vm.assertEq(budget.budget, AMOUNT, "R1: a round reserved another budget");
                vm.assertEq(budget.paid, handler.paidOfRound(p, r), "R1: a round's paid is not its claims'");
                if (!budget.swept) free += budget.budget - budget.paid;
                vm.assertTrue(ledger.isFinal(runId, r), "R2: a round opened that is not final");
            }
            vm.assertEq(free, funded - paid, "R1: free + open budgets != funded - claimed");
        }
    }

    function _forgedSecond(uint256 seed) internal view returns (bool) {
        (, bool first,) = handler.entryOf(seed, 0);
        (, bool second,) = handler.entryOf(seed, 1);
        (, bool third,) = handler.entryOf(seed, 2);
        return !first && second && !third;
    }

    /// @notice After each sequence, where POOL_TALLY names a file (under cache/), one line of what its calls did:
    /// attestations paid, contributions paid and refused, forged entries refused, an overturned round's claims
    /// refused, convicted members' claims refused, the token's re-entries refused, whether a round was overturned.
    function afterInvariant() public {
        VmTally tally = VmTally(address(uint160(uint256(keccak256("hevm cheat code")))));
        string memory path = tally.envOr("POOL_TALLY", string(""));
        if (bytes(path).length == 0) return;
        uint256[8] memory counts = [
            handler.claimsPaid(), handler.contributionsPaid(), handler.contributionsRefused(),
            handler.forgedRefused(), handler.overturnedRefused(), handler.convictedRefused(),
            handler.reentriesRefused(), handler.overturned() == 0 ? 0 : 1
        ];
        string memory line = tally.toString(counts[0]);
        for (uint256 i = 1; i < 8; ++i) line = string.concat(line, " ", tally.toString(counts[i]));
        tally.writeLine(path, line);
    }

    /// @notice The handler's actors do what they say, step by step: a final round's attestations and contributions
    /// paid once, a copier's and a forged entry's claim refused, a convicted attester's claim refused, an overturned
    /// round's credits refused, the armed token's call refused, a top-up of each pool counted.
    function test_the_actors_pay_and_refuse() public {
        // round 0 lists three contributions (fixed H) whose entry 1 alone is forged: the first such seed
        uint256 seed = 3;
        while (!_forgedSecond(seed)) seed += 16;
        vm.assertTrue(handler.commit(0, seed), "round 0 committed");
        handler.blocksPass(39);
        handler.claim(0, 0, 0, 1);
        handler.claim(1, 0, 1, 1);
        vm.assertEq(handler.claimsPaid(), 2, "two attestations paid");
        handler.claim(0, 0, 0, 1);
        vm.assertEq(handler.claimsPaid(), 2, "a paid attestation claimed again is refused");
        handler.claimContribution(0, 0, 0, 1);
        handler.claimContribution(1, 0, 2, 1);
        vm.assertEq(handler.contributionsPaid(), 2, "two contributions paid, one slot of six each");
        handler.claimContribution(0, 0, 0, 4); // another account copies entry 0's claim
        handler.claimContribution(0, 0, 1, 1); // the forged entry
        vm.assertEq(handler.contributionsPaid(), 2, "a copier and a forged entry are refused");
        vm.assertEq(handler.forgedRefused(), 1, "the forged entry refused");
        vm.assertTrue(handler.commit(0, seed), "round 1 committed");
        handler.convict(0, 0);
        vm.assertEq(handler.convictions(), 1, "an attester of the last round convicted");
        vm.assertEq(handler.convictedRefused(), 1, "its claim refused");
        handler.blocksPass(39);
        for (uint256 r = 2; r < 6; ++r) handler.commit(0, seed); // six rounds stand: the run may be overturned
        handler.overturn(seed << 16); // a multiple of four: the fresh round 6 (listing `seed`, mask 0) overturned
        vm.assertEq(handler.overturned(), 7, "round 6 overturned");
        vm.assertGe(handler.overturnedRefused(), 2, "its contribution and attestation refused");
        handler.tokenReenters(0);
        handler.tokenReenters(1);
        vm.assertEq(handler.reentriesRefused(), 2, "the token's calls refused");
        handler.fund(0, 2, 8);
        handler.fund(1, 2, 8);
        vm.assertEq(bytes(handler.violation()).length, 0, handler.violation());
        invariant_pool_books();
    }
}
