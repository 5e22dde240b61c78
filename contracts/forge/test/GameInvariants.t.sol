// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {NodeRegistry} from "../src/NodeRegistry.sol";
import {TrainingLedger} from "../src/TrainingLedger.sol";
import {TrustBase} from "./TrustBase.sol";
import {GameCheck, TrustGame} from "./TrustGame.sol";
import {InvariantTargets} from "./Vm.sol";

/// @notice TrustGame's moves alone (issue 63): the coalition's runs, its answers (in the last block, relayed, after
/// junk, or none), its leaving and withdrawing, and blocks passing, with the live prover and the copier acting as
/// in TrustHandler, which mixes them among twenty other moves; here most sequences play a game to its proof.
contract GameHandler is TrustGame {
    constructor(TrainingLedger ledger_) TrustGame(ledger_) {}

    function blocksPass(uint256 blocks) external {
        ++calls;
        _roll(1 + blocks % (2 * WINDOW));
    }
}

/// @notice G7 over GameHandler's games, in the quick campaign beside TrustInvariants.t.sol (whose check it
/// repeats, GameCheck): every wrong round overturned within its proof window, every attester slashed and the slash
/// burned whole, the prover's bonds back and min(fund, half the slash) from the run's proof fund to whoever proved
/// it (the coalition's own proof included), a copier of its proof paid nothing.
contract GameInvariantsTest is GameCheck, InvariantTargets {
    GameHandler internal handler;

    function setUp() public {
        _castAddresses();
        NodeRegistry registry = new NodeRegistry(0);
        TrainingLedger ledger_ = new TrainingLedger(registry);
        for (uint256 key = 1; key <= OUTSIDER; ++key) register(registry, key);
        handler = new GameHandler(ledger_);
        targetContract(address(handler));
    }

    function invariant_every_wrong_round_overturned() public view {
        checkGameCases(handler, handler.ledger());
        uint256 n = handler.violationCount();
        vm.assertEq(n, 0, n == 0 ? "" : handler.violations(0));
    }
}
