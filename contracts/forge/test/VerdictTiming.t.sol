// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {NodeRegistry} from "../src/NodeRegistry.sol";
import {TrainingLedger} from "../src/TrainingLedger.sol";
import {TrustBase} from "./TrustBase.sol";

/// @notice A round's verdict is signed by members counted before the block of its commit, as its quorum was
/// counted. The counterexample of the 1,000,000-call campaign (seeds 0xd200-0xd203, six calls): two rounds
/// committed in one block, the second counting a coalition joiner whose tenure ended; the joiner then signed
/// the first round's verdict, and two coalition founders with it overturned an honest round (quorum 3 of 6
/// counted), slashing its honest attesters.
contract VerdictTimingTest is TrustBase {
    NodeRegistry internal registry;
    TrainingLedger internal ledger;
    uint256 internal runId;

    function setUp() public {
        _castAddresses();
        registry = new NodeRegistry(0);
        ledger = new TrainingLedger(registry);
        for (uint256 key = 1; key <= OUTSIDER; ++key) register(registry, key);
        vm.prank(who(1));
        runId = ledger.createRun(runParams(keccak256("timing")), "timing");
        for (uint256 key = 1; key <= 6; ++key) {
            vm.prank(who(key));
            ledger.joinRun{value: STAKE}(runId, bytes32("cpu"));
        }
        vm.roll(block.number + 1);
    }

    function _record(string memory label) internal view returns (TrainingLedger.Record memory) {
        uint64 round = ledger.commitCount(runId);
        return TrainingLedger.Record({
            runId: runId,
            round: round,
            prevHead: ledger.headOf(runId),
            weightsRoot: keccak256(abi.encode(label, "weights", round)),
            contributionsRoot: keccak256(abi.encode(label, "contributions", round)),
            trainLossMicro: 3_000_000,
            evalLossMicro: 3_100_000,
            tokens: 4096,
            numContributors: 4,
            checkpointHash: bytes32(0)
        });
    }

    function _keys(uint256 a, uint256 b, uint256 c) internal pure returns (uint256[] memory keys) {
        keys = new uint256[](3);
        (keys[0], keys[1], keys[2]) = (a, b, c);
    }

    function _founders(uint256 extra) internal pure returns (uint256[] memory keys) {
        keys = new uint256[](extra == 0 ? 6 : 7);
        for (uint256 i = 0; i < 6; ++i) keys[i] = i + 1;
        if (extra != 0) keys[6] = extra;
    }

    function _commit(uint256[] memory signers, string memory label)
        internal
        returns (TrainingLedger.Record memory record, address[] memory attesters)
    {
        record = _record(label);
        vm.prank(who(1));
        ledger.commitRound(record, signAll(signers, recordDigest(ledger, record)));
        uint256[] memory sorted = sortByAddress(signers);
        attesters = new address[](sorted.length);
        for (uint256 i = 0; i < sorted.length; ++i) attesters[i] = who(sorted[i]);
    }

    function test_a_member_counted_after_a_commit_in_its_block_cannot_sign_its_verdict() public {
        _commit(_founders(0), "honest"); // round 0
        vm.roll(block.number + 1);
        vm.prank(who(COALITION_JOINER));
        ledger.joinRun{value: STAKE}(runId, bytes32("cpu")); // joinRound 1: counted from round 3 (tenure 2)
        vm.roll(block.number + 1);
        _commit(_founders(0), "honest"); // round 1
        vm.roll(block.number + 1);
        (TrainingLedger.Record memory two, address[] memory attesters) = _commit(_founders(0), "honest");
        vm.assertEq(ledger.runOf(runId).countedCount, 6, "round 2's quorum was counted over the six founders");
        _commit(_founders(COALITION_JOINER), "honest"); // round 3, same block: credits and counts the joiner
        vm.assertEq(ledger.runOf(runId).countedCount, 7, "the joiner counts from round 3");

        TrainingLedger.Record memory other = _record("other"); // any differing record of round 2 opens a case
        other.round = 2;
        other.prevHead = two.prevHead;
        vm.prank(who(5));
        ledger.dispute{value: BOND}(two, other, sign(5, recordDigest(ledger, other)));

        bytes memory coalition = signAll(_keys(5, 6, COALITION_JOINER), roundVerdictDigest(ledger, two, false));
        vm.expectRevert(
            abi.encodeWithSelector(
                TrainingLedger.LedgerSignerNotInForce.selector, runId, who(COALITION_JOINER), uint64(block.number)
            )
        );
        ledger.resolveDispute(two, false, coalition, attesters);

        // The round's own counted members still settle it: three honest founders uphold it.
        ledger.resolveDispute(two, true, signAll(_keys(1, 2, 3), roundVerdictDigest(ledger, two, true)), attesters);
        vm.assertTrue(ledger.disputeCaseOf(runId, 2).status == TrainingLedger.DisputeStatus.Upheld, "upheld");
        for (uint256 key = 1; key <= 4; ++key) {
            vm.assertTrue(ledger.memberOf(runId, who(key)).status == TrainingLedger.MemberStatus.Active, "not slashed");
        }
    }

    /// @notice The campaign's second counterexample (eight calls, after the first fix): a coalition seat left in
    /// the block of an honest commit, before it, so that round's quorum was counted without it (2 of 4); with the
    /// other coalition founder it then signed the round's verdict and overturned it.
    function test_a_member_that_left_in_a_commits_block_cannot_sign_its_verdict() public {
        _commit(_founders(0), "honest"); // round 0
        vm.roll(block.number + 1);
        vm.prank(who(6));
        ledger.leaveRun(runId); // the coalition seat leaves, then honest members commit in the same block
        vm.prank(who(4));
        ledger.leaveRun(runId);
        uint256[] memory honest = _keys(1, 2, 3);
        (TrainingLedger.Record memory one, address[] memory attesters) = _commit(honest, "honest"); // round 1
        vm.assertEq(ledger.runOf(runId).countedCount, 4, "round 1's quorum was counted without the leavers");

        TrainingLedger.Record memory other = _record("other");
        other.round = 1;
        other.prevHead = one.prevHead;
        vm.prank(who(5));
        ledger.dispute{value: BOND}(one, other, sign(5, recordDigest(ledger, other)));
        uint256[] memory coalition = new uint256[](2);
        (coalition[0], coalition[1]) = (5, 6);
        bytes memory signatures = signAll(coalition, roundVerdictDigest(ledger, one, false));
        vm.expectRevert(
            abi.encodeWithSelector(TrainingLedger.LedgerSignerNotInForce.selector, runId, who(6), uint64(block.number))
        );
        ledger.resolveDispute(one, false, signatures, attesters);
        // Later blocks change nothing: the seat was gone when the round's quorum was counted.
        vm.roll(block.number + 1);
        vm.expectRevert(
            abi.encodeWithSelector(
                TrainingLedger.LedgerSignerNotInForce.selector, runId, who(6), uint64(block.number - 1)
            )
        );
        ledger.resolveDispute(one, false, signatures, attesters);
    }
}
