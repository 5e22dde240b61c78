// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

/// @title Float32General
/// @notice The general paths of the `Float32` soft-float and the rounding they share: what an operation does
/// when its fast path does not apply (a zero, subnormal, infinite or NaN operand, a result outside the normal
/// range, a cancelling sum), and the functions `Float32`'s other operations round with. Use `Float32`; this
/// library is its second half (docs/SOFTFLOAT.md).
/// @dev Every function here computes its exact result as `sig * 2**pow2` (an integer significand wide enough to
/// decide the rounding: exact, or with a sticky bit below every bit that matters) and rounds it once with
/// `round32` or `round64`. Values are encodings as in `Float32`; NaN rule as there.
library Float32General {
    uint256 private constant _SIGN32 = 0x80000000;
    uint256 private constant _ABS32 = 0x7FFFFFFF;
    uint256 private constant _INF32 = 0x7F800000;
    uint256 private constant _QUIET32 = 0x00400000;
    uint256 private constant _MANT32 = 0x007FFFFF;
    uint256 private constant _HIDDEN32 = 0x00800000;
    uint32 private constant _DEFAULT_NAN32 = 0xFFC00000;

    uint256 private constant _SIGN64 = 0x8000000000000000;
    uint256 private constant _ABS64 = 0x7FFFFFFFFFFFFFFF;
    uint256 private constant _INF64 = 0x7FF0000000000000;
    uint256 private constant _QUIET64 = 0x0008000000000000;
    uint256 private constant _MANT64 = 0x000FFFFFFFFFFFFF;
    uint256 private constant _HIDDEN64 = 0x0010000000000000;
    uint64 private constant _DEFAULT_NAN64 = 0xFFF8000000000000;

    /// @dev `Float32.mul` off its fast path: zeros, subnormals, infinities, NaNs, results outside the normal range.
    function mul(uint256 x, uint256 y) internal pure returns (uint32) {
        unchecked {
            uint256 sign = (x ^ y) & _SIGN32;
            uint256 absX = x & _ABS32;
            uint256 absY = y & _ABS32;
            if (absX >= _INF32 || absY >= _INF32) {
                if (absX > _INF32) return uint32(x | _QUIET32);
                if (absY > _INF32) return uint32(y | _QUIET32);
                if (absX == 0 || absY == 0) return _DEFAULT_NAN32; // 0 * inf
                return uint32(sign | _INF32);
            }
            if (absX == 0 || absY == 0) return uint32(sign);
            (uint256 mx, uint256 ex) = unpack32(absX);
            (uint256 my, uint256 ey) = unpack32(absY);
            // x = mx 2^(ex-150), y = my 2^(ey-150): the 48-bit product is exact.
            return round32(sign, mx * my, int256(ex + ey) - 300);
        }
    }

    /// @dev `Float32.div` off its fast path.
    function div(uint256 x, uint256 y) internal pure returns (uint32) {
        unchecked {
            uint256 sign = (x ^ y) & _SIGN32;
            uint256 absX = x & _ABS32;
            uint256 absY = y & _ABS32;
            if (absX >= _INF32 || absY >= _INF32) {
                if (absX > _INF32) return uint32(x | _QUIET32);
                if (absY > _INF32) return uint32(y | _QUIET32);
                if (absX == absY) return _DEFAULT_NAN32; // inf / inf
                return uint32(absX == _INF32 ? sign | _INF32 : sign); // inf / y, x / inf
            }
            if (absY == 0) return absX == 0 ? _DEFAULT_NAN32 : uint32(sign | _INF32);
            if (absX == 0) return uint32(sign);
            (uint256 mx, uint256 ex) = unpack32(absX);
            (uint256 my, uint256 ey) = unpack32(absY);
            // mx << 64 / my has at least 40 significant bits (mx >= 1, my < 2^24): with the remainder as a
            // sticky bit below them, rounding that once rounds the exact quotient.
            uint256 scaled = mx << 64;
            uint256 quotient = scaled / my;
            uint256 sticky = scaled % my == 0 ? 0 : 1;
            return round32(sign, (quotient << 1) | sticky, int256(ex) - int256(ey) - 65);
        }
    }

    /// @dev `Float32.mul64` off its fast path.
    function mul64(uint256 x, uint256 y) internal pure returns (uint64) {
        unchecked {
            uint256 sign = (x ^ y) & _SIGN64;
            uint256 absX = x & _ABS64;
            uint256 absY = y & _ABS64;
            if (absX >= _INF64 || absY >= _INF64) {
                if (absX > _INF64) return uint64(x | _QUIET64);
                if (absY > _INF64) return uint64(y | _QUIET64);
                if (absX == 0 || absY == 0) return _DEFAULT_NAN64;
                return uint64(sign | _INF64);
            }
            if (absX == 0 || absY == 0) return uint64(sign);
            (uint256 mx, uint256 ex) = unpack64(absX);
            (uint256 my, uint256 ey) = unpack64(absY);
            return round64(sign, mx * my, int256(ex + ey) - 2150);
        }
    }

    /// @dev `Float32.toFloat32` off its fast path: non-normal operands, and results outside binary32's normal range.
    function toFloat32(uint256 x) internal pure returns (uint32) {
        unchecked {
            uint256 sign = (x >> 32) & _SIGN32;
            uint256 absX = x & _ABS64;
            if (absX >= _INF64) {
                if (absX == _INF64) return uint32(sign | _INF32);
                return uint32(sign | _INF32 | _QUIET32 | ((absX & _MANT64) >> 29));
            }
            if (absX == 0) return uint32(sign);
            (uint256 m, uint256 e) = unpack64(absX);
            return round32(sign, m, int256(e) - 1075);
        }
    }

    /// @dev `a + (b ^ negate)` off `Float32`'s fast path; the NaN rule sees `b` as given.
    function add(uint256 x, uint256 y, uint256 negate) internal pure returns (uint32) {
        unchecked {
            uint256 absX = x & _ABS32;
            uint256 absY = y & _ABS32;
            if (absX >= _INF32 || absY >= _INF32) {
                if (absX > _INF32) return uint32(x | _QUIET32);
                if (absY > _INF32) return uint32(y | _QUIET32);
                y ^= negate;
                if (absX != _INF32) return uint32(y);
                if (absY == _INF32 && x != y) return _DEFAULT_NAN32; // inf - inf
                return uint32(x);
            }
            uint256 sign;
            uint256 sig;
            int256 pow2;
            assembly ("memory-safe") {
                y := xor(y, negate)
                if lt(absX, absY) {
                    let t := x
                    x := y
                    y := t
                    t := absX
                    absX := absY
                    absY := t
                }
                // |x| >= |y| from here: the result has x's sign unless it is an exact zero.
                let ex := shr(23, absX)
                let ey := shr(23, absY)
                let mx := and(absX, _MANT32)
                let my := and(absY, _MANT32)
                switch ex
                case 0 { ex := 1 }
                default { mx := or(mx, _HIDDEN32) }
                switch ey
                case 0 { ey := 1 }
                default { my := or(my, _HIDDEN32) }
                // Align x to y's exponent. Beyond a 40-bit gap y only acts as a sticky bit: x's significand is
                // then 2^63 or more, and any y < 2^24 is below a quarter of the result's unit in the last place
                // on either side of x, so y placed at 2^(ex - 40 - 150) rounds as y at 2^(ey - 150) does.
                let gap := sub(ex, ey)
                if gt(gap, 40) { gap := 40 }
                sig := shl(gap, mx)
                sign := and(x, _SIGN32)
                switch and(xor(x, y), _SIGN32)
                case 0 { sig := add(sig, my) } // zero only for (+0) + (+0) and (-0) + (-0): keeps the sign
                default {
                    sig := sub(sig, my)
                    if iszero(sig) { sign := 0 } // x + (-x) = +0 when rounding to nearest
                }
                pow2 := sub(sub(ex, gap), 150)
            }
            if (sig == 0) return uint32(sign);
            return round32(sign, sig, pow2);
        }
    }

    /// @dev The binary32 nearest `sign * sig * 2**pow2` (ties to even), `sign` 0 or 2**31, `sig` in (0, 2**254):
    /// overflow gives infinity, underflow a subnormal or zero.
    function round32(uint256 sign, uint256 sig, int256 pow2) internal pure returns (uint32 r) {
        assembly ("memory-safe") {
            // Bits to drop: down to 24 significant bits, or to the subnormal quantum 2^-149.
            let drop := sub(_top(sig), 23)
            let least := sub(sub(0, 149), pow2)
            if slt(drop, least) { drop := least }
            let q
            switch sgt(drop, 0)
            case 0 { q := shl(sub(0, drop), sig) }
            default {
                q := shr(drop, sig)
                // Up when the rest exceeds half a unit, or equals it and q is odd (ties to even). Beyond 255
                // bits the value is below 2^-150 (sig < 2^254): q and the rounding are both zero.
                let half := shl(sub(drop, 1), 1)
                let rest := and(sig, sub(shl(drop, 1), 1))
                q := add(q, and(lt(drop, 256), gt(add(rest, and(q, 1)), half)))
            }
            // q holds the hidden bit (or is a subnormal's significand): added to the biased exponent minus one
            // it gives the encoding, and a carry out of the significand moves into the exponent.
            let bits := add(shl(23, add(add(pow2, drop), 149)), q)
            if iszero(lt(bits, _INF32)) { bits := _INF32 }
            r := or(sign, bits)

            function _top(v) -> m {
                m := shl(7, gt(v, 0xffffffffffffffffffffffffffffffff))
                m := or(m, shl(6, gt(shr(m, v), 0xffffffffffffffff)))
                m := or(m, shl(5, gt(shr(m, v), 0xffffffff)))
                m := or(m, shl(4, gt(shr(m, v), 0xffff)))
                m := or(m, shl(3, gt(shr(m, v), 0xff)))
                m := or(m, shl(2, gt(shr(m, v), 0xf)))
                // Byte 16 + n of the table is floor(log2(n)) for n in 1..15.
                m := or(m, byte(add(16, shr(m, v)), 0x00000101020202020303030303030303))
            }
        }
    }

    /// @dev The binary64 nearest `sign * sig * 2**pow2` (ties to even), `sign` 0 or 2**63, `sig` in (0, 2**256)
    /// and below 2**254 when `pow2` < -1074.
    function round64(uint256 sign, uint256 sig, int256 pow2) internal pure returns (uint64 r) {
        assembly ("memory-safe") {
            let drop := sub(_top(sig), 52)
            let least := sub(sub(0, 1074), pow2)
            if slt(drop, least) { drop := least }
            let q
            switch sgt(drop, 0)
            case 0 { q := shl(sub(0, drop), sig) }
            default {
                q := shr(drop, sig)
                let half := shl(sub(drop, 1), 1)
                let rest := and(sig, sub(shl(drop, 1), 1))
                q := add(q, and(lt(drop, 256), gt(add(rest, and(q, 1)), half)))
            }
            let bits := add(shl(52, add(add(pow2, drop), 1074)), q)
            if iszero(lt(bits, _INF64)) { bits := _INF64 }
            r := or(sign, bits)

            function _top(v) -> m {
                m := shl(7, gt(v, 0xffffffffffffffffffffffffffffffff))
                m := or(m, shl(6, gt(shr(m, v), 0xffffffffffffffff)))
                m := or(m, shl(5, gt(shr(m, v), 0xffffffff)))
                m := or(m, shl(4, gt(shr(m, v), 0xffff)))
                m := or(m, shl(3, gt(shr(m, v), 0xff)))
                m := or(m, shl(2, gt(shr(m, v), 0xf)))
                m := or(m, byte(add(16, shr(m, v)), 0x00000101020202020303030303030303))
            }
        }
    }

    /// @dev Significand and biased exponent of a finite non-zero binary32 magnitude (subnormal: exponent 1).
    function unpack32(uint256 abs) internal pure returns (uint256 m, uint256 e) {
        assembly ("memory-safe") {
            e := shr(23, abs)
            m := and(abs, _MANT32)
            switch e
            case 0 { e := 1 }
            default { m := or(m, _HIDDEN32) }
        }
    }

    /// @dev Significand and biased exponent of a finite non-zero binary64 magnitude (subnormal: exponent 1).
    function unpack64(uint256 abs) internal pure returns (uint256 m, uint256 e) {
        assembly ("memory-safe") {
            e := shr(52, abs)
            m := and(abs, _MANT64)
            switch e
            case 0 { e := 1 }
            default { m := or(m, _HIDDEN64) }
        }
    }

    /// @dev Index of the most significant set bit of `x > 0`.
    function msb(uint256 x) internal pure returns (uint256 r) {
        assembly ("memory-safe") {
            r := shl(7, gt(x, 0xffffffffffffffffffffffffffffffff))
            r := or(r, shl(6, gt(shr(r, x), 0xffffffffffffffff)))
            r := or(r, shl(5, gt(shr(r, x), 0xffffffff)))
            r := or(r, shl(4, gt(shr(r, x), 0xffff)))
            r := or(r, shl(3, gt(shr(r, x), 0xff)))
            r := or(r, shl(2, gt(shr(r, x), 0xf)))
            r := or(r, byte(add(16, shr(r, x)), 0x00000101020202020303030303030303))
        }
    }

    /// @dev floor(sqrt(n)) for n > 0: Newton's iteration from a power of two above the root (quadratic, about
    /// seven steps for the 182-bit `n` of `sqrt64`).
    function isqrt(uint256 n) internal pure returns (uint256 x) {
        unchecked {
            x = 1 << ((msb(n) >> 1) + 1);
            uint256 y = (x + n / x) >> 1;
            while (y < x) {
                x = y;
                y = (x + n / x) >> 1;
            }
        }
    }
}
