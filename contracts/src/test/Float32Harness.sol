// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {Float32} from "../Float32.sol";

/// @title Float32Harness
/// @notice Test-only batch front end of the `Float32` library: one call applies one operation to thousands of
/// operands, so tests/test_float32.py and bench/fuzz_float32.py compare it with torch bit for bit. Not deployed
/// by a node.
/// @dev Operands and results are packed big-endian, fixed width per operation (`_shape`): 4 bytes for a
/// binary32, 8 for a binary64, 32 for an int256 (two's complement), 1 for a bool. A binary operation takes `b`
/// as long as `a`; a unary one takes an empty `b`. Operation numbers (tests/float32_reference.py mirrors them):
/// 0 add, 1 sub, 2 mul, 3 div, 4 mul64, 5 toFloat32, 6 toFloat64, 7 fromInt, 8 fromInt32, 9 isNaN32,
/// 10 isFinite32, 11 same32, 12 div64, 13 sqrt64, 14 lt64, 15 le64; 255 is the identity (the gas baseline).
contract Float32Harness {
    uint256 private constant _IDENTITY = 255;

    /// @notice Applies operation `op` to every operand of `a` (and `b`), returning the packed results.
    function run(uint256 op, bytes calldata a, bytes calldata b) external pure returns (bytes memory out) {
        (function(uint256, uint256) pure returns (uint256) f, uint256 width, uint256 outWidth, uint256 n) =
            _prepare(op, a, b);
        out = _allocate(n, outWidth);
        for (uint256 i = 0; i < n; ++i) {
            _store(out, i, outWidth, f(_load(a, i, width), _load(b, i, width)));
        }
    }

    /// @notice The gas of operation `op` on each operand (pair), as 4-byte big-endian counts: what the call into
    /// the library costs, measured with gasleft() around it, less the same measurement around the identity.
    function gasUsed(uint256 op, bytes calldata a, bytes calldata b) external view returns (bytes memory out) {
        (function(uint256, uint256) pure returns (uint256) f, uint256 width,, uint256 n) = _prepare(op, a, b);
        function(uint256, uint256) pure returns (uint256) identity = _identity;
        out = _allocate(n, 4);
        for (uint256 i = 0; i < n; ++i) {
            uint256 x = _load(a, i, width);
            uint256 y = _load(b, i, width);
            uint256 before = gasleft();
            identity(x, y);
            uint256 baseline = before - gasleft();
            before = gasleft();
            f(x, y);
            uint256 spent = before - gasleft();
            _store(out, i, 4, spent > baseline ? spent - baseline : 0);
        }
    }

    function _prepare(uint256 op, bytes calldata a, bytes calldata b)
        private
        pure
        returns (function(uint256, uint256) pure returns (uint256) f, uint256 width, uint256 outWidth, uint256 n)
    {
        bool binary;
        (f, width, outWidth, binary) = _shape(op);
        n = a.length / width;
        require(n * width == a.length, "Float32Harness: a is not a whole number of operands");
        require(b.length == (binary ? a.length : 0), "Float32Harness: b does not match a");
    }

    function _shape(uint256 op)
        private
        pure
        returns (function(uint256, uint256) pure returns (uint256) f, uint256 width, uint256 outWidth, bool binary)
    {
        if (op == 0) return (_add, 4, 4, true);
        if (op == 1) return (_sub, 4, 4, true);
        if (op == 2) return (_mul, 4, 4, true);
        if (op == 3) return (_div, 4, 4, true);
        if (op == 4) return (_mul64, 8, 8, true);
        if (op == 5) return (_toFloat32, 8, 4, false);
        if (op == 6) return (_toFloat64, 4, 8, false);
        if (op == 7) return (_fromInt, 32, 8, false);
        if (op == 8) return (_fromInt32, 32, 4, false);
        if (op == 9) return (_isNaN32, 4, 1, false);
        if (op == 10) return (_isFinite32, 4, 1, false);
        if (op == 11) return (_same32, 4, 1, true);
        if (op == 12) return (_div64, 8, 8, true);
        if (op == 13) return (_sqrt64, 8, 8, false);
        if (op == 14) return (_lt64, 8, 1, true);
        if (op == 15) return (_le64, 8, 1, true);
        if (op == _IDENTITY) return (_identity, 4, 4, false);
        revert("Float32Harness: unknown operation");
    }

    function _allocate(uint256 n, uint256 outWidth) private pure returns (bytes memory out) {
        // 32 spare bytes: each result is written as a whole word, whose tail the next result overwrites.
        out = new bytes(n * outWidth + 32);
        assembly ("memory-safe") {
            mstore(out, mul(n, outWidth))
        }
    }

    function _load(bytes calldata data, uint256 i, uint256 width) private pure returns (uint256 value) {
        assembly ("memory-safe") {
            // Past the end of `data` (an empty `b`) this reads zeros or other calldata: unary ops ignore it.
            value := shr(sub(256, shl(3, width)), calldataload(add(data.offset, mul(i, width))))
        }
    }

    function _store(bytes memory out, uint256 i, uint256 width, uint256 value) private pure {
        assembly ("memory-safe") {
            mstore(add(add(out, 32), mul(i, width)), shl(sub(256, shl(3, width)), value))
        }
    }

    function _add(uint256 x, uint256 y) private pure returns (uint256) {
        return Float32.add(uint32(x), uint32(y));
    }

    function _sub(uint256 x, uint256 y) private pure returns (uint256) {
        return Float32.sub(uint32(x), uint32(y));
    }

    function _mul(uint256 x, uint256 y) private pure returns (uint256) {
        return Float32.mul(uint32(x), uint32(y));
    }

    function _div(uint256 x, uint256 y) private pure returns (uint256) {
        return Float32.div(uint32(x), uint32(y));
    }

    function _mul64(uint256 x, uint256 y) private pure returns (uint256) {
        return Float32.mul64(uint64(x), uint64(y));
    }

    function _toFloat32(uint256 x, uint256) private pure returns (uint256) {
        return Float32.toFloat32(uint64(x));
    }

    function _toFloat64(uint256 x, uint256) private pure returns (uint256) {
        return Float32.toFloat64(uint32(x));
    }

    function _fromInt(uint256 x, uint256) private pure returns (uint256) {
        return Float32.fromInt(int256(x));
    }

    function _fromInt32(uint256 x, uint256) private pure returns (uint256) {
        return Float32.fromInt32(int256(x));
    }

    function _isNaN32(uint256 x, uint256) private pure returns (uint256) {
        return Float32.isNaN32(uint32(x)) ? 1 : 0;
    }

    function _isFinite32(uint256 x, uint256) private pure returns (uint256) {
        return Float32.isFinite32(uint32(x)) ? 1 : 0;
    }

    function _same32(uint256 x, uint256 y) private pure returns (uint256) {
        return Float32.same32(uint32(x), uint32(y)) ? 1 : 0;
    }

    function _div64(uint256 x, uint256 y) private pure returns (uint256) {
        return Float32.div64(uint64(x), uint64(y));
    }

    function _sqrt64(uint256 x, uint256) private pure returns (uint256) {
        return Float32.sqrt64(uint64(x));
    }

    function _lt64(uint256 x, uint256 y) private pure returns (uint256) {
        return Float32.lt64(uint64(x), uint64(y)) ? 1 : 0;
    }

    function _le64(uint256 x, uint256 y) private pure returns (uint256) {
        return Float32.le64(uint64(x), uint64(y)) ? 1 : 0;
    }

    function _identity(uint256 x, uint256) private pure returns (uint256) {
        return x;
    }
}
