// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {AggregationProver} from "../src/AggregationProver.sol";
import {NodeRegistry} from "../src/NodeRegistry.sol";
import {TrainingLedger} from "../src/TrainingLedger.sol";
import {TrustBase} from "./TrustBase.sol";

/// @notice Calldata fuzzing of every state-changing external function (issue 63): junk after each selector, strict
/// prefixes of a valid call, and fraud proofs and challenge answers with Merkle paths of every size, against a
/// run with two committed rounds. Every one must revert: 0 unexpected successes (`forge test --mc CalldataFuzz`).
/// createRun and NodeRegistry.register are left out: anyone may call them and well-formed calls succeed.
contract CalldataFuzzTest is TrustBase {
    NodeRegistry internal registry;
    TrainingLedger internal ledger;
    AggregationProver internal prover;
    uint256 internal runId;
    TrainingLedger.Record[2] internal records;
    address[] internal attesters;
    address internal constant STRANGER = address(0xBAD); // no registration, no seat, no ether sent

    function setUp() public {
        _castAddresses();
        registry = new NodeRegistry(0);
        ledger = new TrainingLedger(registry);
        prover = ledger.prover();
        for (uint256 key = 1; key <= 6; ++key) register(registry, key);
        vm.prank(who(1));
        runId = ledger.createRun(runParams(keccak256("calldata")), "");
        uint256[] memory keys = new uint256[](6);
        for (uint256 key = 1; key <= 6; ++key) {
            keys[key - 1] = key;
            vm.prank(who(key));
            ledger.joinRun{value: STAKE}(runId, bytes32(0));
        }
        for (uint64 round = 0; round < 2; ++round) {
            TrainingLedger.Record memory record = TrainingLedger.Record(
                runId, round, ledger.headOf(runId), keccak256(abi.encode("w", round)), keccak256("c"), 1, 1, 1, 1, 0
            );
            vm.prank(who(1));
            ledger.commitRound(record, signAll(keys, recordDigest(ledger, record)));
            records[round] = record;
        }
        uint256[] memory sorted = sortByAddress(keys);
        for (uint256 i = 0; i < sorted.length; ++i) attesters.push(who(sorted[i]));
    }

    function _selectors() internal pure returns (bytes4[20] memory s) {
        s = [
            TrainingLedger.joinRun.selector, TrainingLedger.leaveRun.selector, TrainingLedger.ejectInactive.selector,
            TrainingLedger.withdrawStake.selector, TrainingLedger.commitRound.selector, TrainingLedger.attest.selector,
            TrainingLedger.dispute.selector, TrainingLedger.resolveDispute.selector,
            TrainingLedger.invalidateByProof.selector, TrainingLedger.expireDispute.selector,
            TrainingLedger.reportEquivocation.selector, TrainingLedger.accuse.selector,
            TrainingLedger.resolveAccusation.selector, TrainingLedger.expireAccusation.selector,
            AggregationProver.proveWrongAggregation.selector, AggregationProver.proveWrongNorm.selector,
            AggregationProver.challengeAvailability.selector, AggregationProver.answerChallenge.selector,
            AggregationProver.expireChallenge.selector, NodeRegistry.unregister.selector
        ];
    }

    function _target(uint256 i) internal view returns (address) {
        return i < 14 ? address(ledger) : (i < 19 ? address(prover) : address(registry));
    }

    /// @notice Any bytes after any state-changing selector, from a stranger: refused.
    function testFuzz_junk_after_every_selector_reverts(uint8 which, bytes calldata junk) public {
        bytes4[20] memory selectors = _selectors();
        uint256 i = which % 20;
        vm.prank(STRANGER);
        (bool ok,) = _target(i).call(abi.encodePacked(selectors[i], junk));
        vm.assertFalse(ok, "a stranger's junk call succeeded");
    }

    /// @notice Well-formed words of the right count after any selector (runs and rounds that exist, members'
    /// addresses), from a stranger: refused.
    function testFuzz_plausible_words_after_every_selector_revert(uint8 which, uint8 words, uint256 seed) public {
        bytes4[20] memory selectors = _selectors();
        uint256 i = which % 20;
        bytes memory data = abi.encodePacked(selectors[i]);
        for (uint256 w = 0; w < words % 24; ++w) {
            uint256 pick = uint256(keccak256(abi.encode(seed, w))) % 4;
            uint256 value = pick == 0 ? runId : (pick == 1 ? uint256(uint160(who(1 + w % 6))) : (pick == 2 ? w : seed));
            data = bytes.concat(data, bytes32(value));
        }
        vm.prank(STRANGER);
        (bool ok,) = _target(i).call(data);
        vm.assertFalse(ok, "a stranger's plausible call succeeded");
    }

    /// @notice Every prefix of a valid commit (sent by a member) that cuts into its data is refused; the whole call
    /// succeeds.
    function testFuzz_truncated_commit_reverts(uint16 cut) public {
        TrainingLedger.Record memory record = TrainingLedger.Record(
            runId, 2, ledger.headOf(runId), keccak256("w2"), keccak256("c"), 1, 1, 1, 1, 0
        );
        uint256[] memory keys = new uint256[](6);
        for (uint256 key = 1; key <= 6; ++key) keys[key - 1] = key;
        bytes memory call = abi.encodeCall(TrainingLedger.commitRound, (record, signAll(keys, recordDigest(ledger, record))));
        // The last word's zero padding (6 x 65 signature bytes fill 13 words less 26 bytes) is not read: the ABI
        // decoder checks that a `bytes` ends within the calldata, not that its padding is there.
        uint256 length = cut % (call.length - 26);
        bytes memory prefix = new bytes(length);
        for (uint256 b = 0; b < length; ++b) prefix[b] = call[b];
        vm.prank(who(1));
        (bool ok,) = address(ledger).call(prefix);
        vm.assertFalse(ok, "a truncated commit succeeded");
        vm.prank(who(1));
        (ok,) = address(ledger).call(call);
        vm.assertTrue(ok, "the whole commit failed");
    }

    /// @notice Fraud proofs of a right round with Merkle paths of every size (0 .. 255 siblings) and any leaves,
    /// and answers to challenges that do not exist: refused.
    function testFuzz_proofs_with_paths_of_every_size_revert(uint8 size, uint32 stage, uint64 chunk, bytes calldata leaf)
        public
    {
        bytes32[] memory path = new bytes32[](size);
        for (uint256 k = 0; k < size; ++k) path[k] = keccak256(abi.encode(leaf, k));
        AggregationProver.Proof memory proof;
        proof.prevRecord = records[0];
        proof.record = records[1];
        proof.stage = stage;
        proof.chunk = chunk;
        proof.prevStageLeaf = leaf;
        proof.prevStagePath = path;
        proof.stageLeaf = leaf;
        proof.stagePath = path;
        proof.factors = leaf;
        proof.prevWeights = AggregationProver.Opening(leaf, path);
        proof.prevMomentum = AggregationProver.Opening(leaf, path);
        proof.newWeights = AggregationProver.Opening(leaf, path);
        proof.newMomentum = AggregationProver.Opening(leaf, path);
        proof.attesters = attesters;
        vm.prank(STRANGER);
        (bool ok,) = address(prover).call(abi.encodeCall(AggregationProver.proveWrongAggregation, (proof)));
        vm.assertFalse(ok, "a proof against a right round succeeded");
        AggregationProver.NormProof memory norm;
        norm.record = records[1];
        norm.stage = stage;
        norm.stageLeaf = leaf;
        norm.stagePath = path;
        norm.factors = leaf;
        norm.contribution = chunk;
        norm.weights = AggregationProver.Opening(leaf, path);
        norm.piece = AggregationProver.Opening(leaf, path);
        norm.sumLeaf = leaf;
        norm.sumPath = path;
        norm.attesters = attesters;
        vm.prank(STRANGER);
        (ok,) = address(prover).call(abi.encodeCall(AggregationProver.proveWrongNorm, (norm)));
        vm.assertFalse(ok, "a norm proof against a right round succeeded");
        vm.prank(STRANGER);
        (ok,) = address(prover).call(abi.encodeCall(AggregationProver.answerChallenge, (keccak256(leaf), leaf, path)));
        vm.assertFalse(ok, "an answer to no challenge succeeded");
    }
}
