// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {AggregationProver} from "../AggregationProver.sol";

/// @title AnswerRelay
/// @notice Test only (issue 62): forwards an availability answer to an AggregationProver from its own calldata,
/// which is not answerChallenge's (the leaf and path are packed in one bytes argument), so a reader of the
/// outer transaction's calldata cannot find the path: the answer must be read from AvailabilityAnswered.
contract AnswerRelay {
    /// @notice Answer challenge `id` of `prover` with `packed` = abi.encode(leaf, path).
    function relay(AggregationProver prover, bytes32 id, bytes calldata packed) external {
        (bytes memory leaf, bytes32[] memory path) = abi.decode(packed, (bytes, bytes32[]));
        prover.answerChallenge(id, leaf, path);
    }
}
