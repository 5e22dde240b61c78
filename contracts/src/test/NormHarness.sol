// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {NormRule} from "../NormRule.sol";

/// @title NormHarness
/// @notice Test-only front end of the `NormRule` library: tests/test_norm_proof.py compares it with Python's
/// float (correct rounding) on random and edge operands. Not deployed by a node.
contract NormHarness {
    /// @notice The binary64 nearest each sum (three words each: hi, mid, lo; unit 2^-298).
    function toDouble(uint256[] calldata sums) external pure returns (uint64[] memory out) {
        out = new uint64[](sums.length / 3);
        for (uint256 j = 0; j < out.length; ++j) {
            out[j] = NormRule.toDouble(sums[3 * j], sums[3 * j + 1], sums[3 * j + 2]);
        }
    }

    /// @notice The exact sum of the squares of finite binary32 `values` (hi, mid, lo; unit 2^-298).
    function squareSum(uint32[] calldata values) external pure returns (uint256 hi, uint256 mid, uint256 lo) {
        for (uint256 k = 0; k < values.length; ++k) {
            (hi, mid, lo,) = NormRule.addSquare(hi, mid, lo, values[k]);
        }
    }

    /// @notice The norm rule's clip scales (NormRule.scales).
    function scales(uint256[] calldata sums, uint256[] calldata steps, uint64 normClip)
        external
        pure
        returns (uint64[] memory)
    {
        return NormRule.scales(sums, steps, normClip);
    }
}
