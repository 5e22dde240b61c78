// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;
import {WithVm} from "./Vm.sol";
import {NodeRegistry} from "../src/NodeRegistry.sol";
import {TrainingLedger} from "../src/TrainingLedger.sol";
contract SmokeTest is WithVm {
    function test_deploys() public {
        NodeRegistry r = new NodeRegistry(0);
        TrainingLedger l = new TrainingLedger(r);
        vm.assertEq(l.runCount(), 0, "no run");
    }
}
