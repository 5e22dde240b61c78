// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {Float32} from "./Float32.sol";
import {Float32General} from "./Float32General.sol";

/// @title NormRule
/// @notice DiLoCoX's norm rule (docs/DILOCOX.md section 10) from exact sums of squares, as the fraud proof of a
/// wrong clip scale recomputes it (docs/FRAUD_PROOF.md, "The clip scales"): `n_j = sqrt(double(S_j))`, the lower
/// median of the `n_j` (or `n_j / k_j` in a run whose rounds are bounded by time), `bound = normClip * med`,
/// `s_j = 1` or `bound / n_j`, every operation binary64 and correctly rounded (`Float32`).
/// @dev A sum of squares of float32 values is an exact integer in the unit 2^-298 (the square of the smallest
/// subnormal, 2^-149): the square of a float32 `m 2^(e - 150)` (`m` its 24-bit significand, `e` its biased
/// exponent, 1 for a subnormal) is `m^2 2^(2e - 2)` units, below 2^554. It is held in three 256-bit words
/// `(hi, mid, lo)`, big-endian (768 bits): a stage of 2^64 such squares would still fit (2^618). A sum that
/// would not fit is not an honest one (`overflow`).
library NormRule {
    /// @notice log2 of the unit of a sum of squares: a sum `S` stands for `S * 2^-298`.
    uint256 internal constant UNIT_LOG2 = 298;
    uint64 internal constant ONE = 0x3FF0000000000000; // binary64 1.0
    uint64 internal constant INF = 0x7FF0000000000000; // binary64 +inf

    /// @dev `(hi, mid, lo) + square(x)` for a finite binary32 `x`; `overflow` if the sum passes 2^768.
    function addSquare(uint256 hi, uint256 mid, uint256 lo, uint32 x)
        internal
        pure
        returns (uint256, uint256, uint256, bool overflow)
    {
        unchecked {
            (uint256 m, uint256 e) = _unpack(uint256(x) & 0x7FFFFFFF);
            if (m == 0) return (hi, mid, lo, false);
            uint256 square = m * m; // < 2^48
            uint256 shift = 2 * e - 2; // 0 .. 506
            uint256 r = shift & 255;
            uint256 low = square << r;
            uint256 high = r == 0 ? 0 : square >> (256 - r);
            return shift < 256 ? add(hi, mid, lo, 0, high, low) : add(hi, mid, lo, high, low, 0);
        }
    }

    /// @dev The 768-bit sum of two 768-bit integers; `overflow` if it passes 2^768.
    function add(uint256 ah, uint256 am, uint256 al, uint256 bh, uint256 bm, uint256 bl)
        internal
        pure
        returns (uint256 hi, uint256 mid, uint256 lo, bool overflow)
    {
        unchecked {
            lo = al + bl;
            uint256 carry = lo < al ? 1 : 0;
            mid = am + bm;
            uint256 next = mid < am ? 1 : 0;
            mid += carry;
            if (mid < carry) next = 1;
            hi = ah + bh;
            overflow = hi < ah;
            hi += next;
            if (hi < next) overflow = true;
        }
    }

    /// @notice The binary64 nearest `(hi, mid, lo) * 2^-298` (ties to even): always finite and normal or zero.
    function toDouble(uint256 hi, uint256 mid, uint256 lo) internal pure returns (uint64) {
        unchecked {
            if (hi == 0 && mid == 0) {
                return lo == 0 ? 0 : Float32General.round64(0, lo, -int256(UNIT_LOG2));
            }
            // Keep the top 254 bits and a sticky bit for the rest: one rounding of the exact value.
            uint256 top = hi != 0 ? 512 + Float32General.msb(hi) : 256 + Float32General.msb(mid);
            uint256 shift = top - 253; // 3 .. 514
            uint256 window;
            bool sticky;
            if (shift >= 512) {
                uint256 t = shift - 512;
                window = hi >> t;
                sticky = (hi & ((1 << t) - 1)) != 0 || mid != 0 || lo != 0;
            } else if (shift >= 256) {
                uint256 t = shift - 256;
                window = (mid >> t) | (t == 0 ? 0 : hi << (256 - t));
                sticky = (t != 0 && (mid & ((1 << t) - 1)) != 0) || lo != 0;
            } else {
                window = (lo >> shift) | (mid << (256 - shift));
                sticky = (lo & ((1 << shift) - 1)) != 0;
            }
            uint256 sig = (window << 1) | (sticky ? 1 : 0);
            return Float32General.round64(0, sig, int256(shift) - int256(UNIT_LOG2) - 1);
        }
    }

    /// @notice The clip scales of the norm rule from the accepted contributions' exact sums of squares.
    /// @param sums Three words (hi, mid, lo) per contribution, in the factors' order.
    /// @param steps Each contribution's declared inner steps (a run bounded by time: the rule compares
    /// `n_j / k_j`), or empty (fixed H).
    /// @param normClip The run's `norm_clip` as binary64 (0: the rule is off, every scale 1).
    function scales(uint256[] memory sums, uint256[] memory steps, uint64 normClip)
        internal
        pure
        returns (uint64[] memory result)
    {
        uint256 count = sums.length / 3;
        uint64[] memory norms = new uint64[](count);
        for (uint256 j = 0; j < count; ++j) {
            uint64 norm = Float32.sqrt64(toDouble(sums[3 * j], sums[3 * j + 1], sums[3 * j + 2]));
            if (steps.length != 0) norm = Float32.div64(norm, Float32.fromInt(int256(steps[j])));
            norms[j] = norm;
        }
        result = new uint64[](count);
        if (count == 0) return result;
        uint64 bound = normClip == 0 ? INF : Float32.mul64(normClip, lowerMedian(norms));
        for (uint256 j = 0; j < count; ++j) {
            result[j] = Float32.le64(norms[j], bound) ? ONE : Float32.div64(bound, norms[j]);
        }
    }

    /// @notice `sorted(values)[(n - 1) / 2]` of non-negative, non-NaN binary64 values (their encodings order as
    /// integers).
    function lowerMedian(uint64[] memory values) internal pure returns (uint64) {
        uint64[] memory sorted = new uint64[](values.length);
        for (uint256 i = 0; i < values.length; ++i) {
            uint64 value = values[i];
            uint256 k = i;
            while (k > 0 && sorted[k - 1] > value) {
                sorted[k] = sorted[k - 1];
                --k;
            }
            sorted[k] = value;
        }
        return sorted[(values.length - 1) / 2];
    }

    /// @dev Significand and biased exponent of a binary32 magnitude (a subnormal's exponent is 1; zero: m = 0).
    function _unpack(uint256 abs) private pure returns (uint256 m, uint256 e) {
        e = abs >> 23;
        m = abs & 0x007FFFFF;
        if (e == 0) e = 1;
        else m |= 0x00800000;
    }
}
