// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {Float32General} from "./Float32General.sol";

/// @title Float32
/// @notice IEEE-754 binary32 and binary64 arithmetic in software, bit for bit what torch computes on a CPU:
/// round to nearest, ties to even; subnormals kept (no flush to zero); signed zeros and infinities as IEEE-754
/// says. A value is its encoding held in an unsigned integer (torch's `x.view(torch.int32)` read as unsigned).
/// It is what the on-chain fraud proof recomputes DiLoCoX's outer step with (training/diloco.py,
/// training/robust.py, training/codec_wire.py; docs/SOFTFLOAT.md).
/// @dev Each operation computes its exact result as `sig * 2**pow2` (an integer significand wide enough to decide
/// the rounding: exact, or with a sticky bit below every bit that matters) and rounds it once. The common case
/// (normal operands, a normal result) takes a fast path here whose result width is known without a search for
/// its top bit; the rest, and the shared rounding, are `Float32General`'s. No loop runs over bits.
///
/// NaN rule (x86 SSE's, with `a` the first source operand): an operand NaN makes the result that NaN, quieted
/// (the first NaN operand, `a` before `b`); an invalid operation (inf - inf, 0 * inf, 0 / 0, inf / inf, the
/// square root of a negative number) gives the default NaN with the sign bit set, 0xFFC00000 (binary32) or
/// 0xFFF8000000000000 (binary64). ARM gives other NaN bits for the same operations, so a proof compares with
/// `same32`, which holds any two NaNs equal: no verdict depends on a NaN's payload.
library Float32 {
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

    // ------------------------------------------------------------------------------------- binary32

    /// @notice binary32 `a + b`, round to nearest even.
    function add(uint32 a, uint32 b) internal pure returns (uint32) {
        return _add(a, b, 0);
    }

    /// @notice binary32 `a - b`, round to nearest even (`a + (-b)`; a NaN `b` propagates with its own sign).
    function sub(uint32 a, uint32 b) internal pure returns (uint32) {
        return _add(a, b, _SIGN32);
    }

    /// @notice binary32 `a * b`, round to nearest even.
    function mul(uint32 a, uint32 b) internal pure returns (uint32 r) {
        bool done;
        assembly ("memory-safe") {
            // Fast path: both normal and the result normal before rounding; the rest takes the general path.
            let ex := and(shr(23, a), 0xff)
            let ey := and(shr(23, b), 0xff)
            if and(lt(sub(ex, 1), 254), lt(sub(ey, 1), 254)) {
                let sig := mul(or(and(a, _MANT32), _HIDDEN32), or(and(b, _MANT32), _HIDDEN32)) // in [2^46, 2^48)
                let top := shr(47, sig)
                let e1 := add(sub(add(ex, ey), 128), top) // the result's biased exponent minus one
                if lt(e1, 254) {
                    let drop := add(23, top)
                    // Drop `drop` bits, ties to even: up when 2 rest + (q odd) > unit, i.e. the rest exceeds half a
                    // unit, or is half and q is odd. q keeps the hidden bit: added to the biased exponent minus one
                    // it gives the encoding, a carry out of the significand moves into the exponent, and past the
                    // largest finite value the result is infinity.
                    let q := shr(drop, sig)
                    let unit := shl(drop, 1)
                    let rest := and(sig, sub(unit, 1))
                    q := add(q, gt(add(add(rest, rest), and(q, 1)), unit))
                    let bits := add(shl(23, e1), q)
                    if gt(bits, 0x7f7fffff) { bits := _INF32 }
                    r := or(and(xor(a, b), _SIGN32), bits)
                    done := 1
                }
            }
        }
        if (!done) r = Float32General.mul(a, b);
    }

    /// @notice binary32 `a / b`, round to nearest even.
    function div(uint32 a, uint32 b) internal pure returns (uint32 r) {
        bool done;
        assembly ("memory-safe") {
            let ex := and(shr(23, a), 0xff)
            let ey := and(shr(23, b), 0xff)
            if and(lt(sub(ex, 1), 254), lt(sub(ey, 1), 254)) {
                // Both normal: (mx << 26) / my has 26 or 27 bits (27 when mx >= my), then a sticky bit.
                let mx := or(and(a, _MANT32), _HIDDEN32)
                let my := or(and(b, _MANT32), _HIDDEN32)
                let scaled := shl(26, mx)
                let sig := or(shl(1, div(scaled, my)), gt(mod(scaled, my), 0))
                let top := iszero(lt(mx, my))
                let e1 := add(sub(add(ex, 125), ey), top)
                if lt(e1, 254) {
                    let drop := add(3, top)
                    // Rounded as in `mul`.
                    let q := shr(drop, sig)
                    let unit := shl(drop, 1)
                    let rest := and(sig, sub(unit, 1))
                    q := add(q, gt(add(add(rest, rest), and(q, 1)), unit))
                    let bits := add(shl(23, e1), q)
                    if gt(bits, 0x7f7fffff) { bits := _INF32 }
                    r := or(and(xor(a, b), _SIGN32), bits)
                    done := 1
                }
            }
        }
        if (!done) r = Float32General.div(a, b);
    }

    /// @notice Whether `a` is a binary32 NaN (quiet or signalling).
    function isNaN32(uint32 a) internal pure returns (bool) {
        return uint256(a) & _ABS32 > _INF32;
    }

    /// @notice Whether `a` is a finite binary32 (neither infinite nor NaN).
    function isFinite32(uint32 a) internal pure returns (bool) {
        return uint256(a) & _ABS32 < _INF32;
    }

    /// @notice Whether `a` and `b` are the same binary32: bit-equal, or both NaN (payloads differ by ISA).
    function same32(uint32 a, uint32 b) internal pure returns (bool) {
        return a == b || (isNaN32(a) && isNaN32(b));
    }

    /// @notice The integer `v` as a binary32, round to nearest even (exact when |v| <= 2**24).
    function fromInt32(int256 v) internal pure returns (uint32 r) {
        uint256 sign;
        uint256 magnitude;
        assembly ("memory-safe") {
            sign := shl(31, slt(v, 0))
            magnitude := v
            if sign { magnitude := sub(0, v) } // -type(int256).min wraps to 2**255, its magnitude
            // Fast path, 0 < |v| < 2^24 (exact): the top bit p, then the significand shifted up to bit 23.
            if and(gt(magnitude, 0), lt(magnitude, 0x1000000)) {
                let p := shl(4, gt(magnitude, 0xffff))
                p := or(p, shl(3, gt(shr(p, magnitude), 0xff)))
                p := or(p, shl(2, gt(shr(p, magnitude), 0xf)))
                p := or(p, byte(add(16, shr(p, magnitude)), 0x00000101020202020303030303030303))
                r := or(sign, add(shl(23, add(p, 126)), shl(sub(23, p), magnitude)))
            }
        }
        if (magnitude >= 0x1000000) r = Float32General.round32(sign, magnitude, 0);
    }

    // ------------------------------------------------------------------------------------- binary64

    /// @notice binary64 `a * b`, round to nearest even.
    function mul64(uint64 a, uint64 b) internal pure returns (uint64 r) {
        bool done;
        assembly ("memory-safe") {
            let ex := and(shr(52, a), 0x7ff)
            let ey := and(shr(52, b), 0x7ff)
            if and(lt(sub(ex, 1), 2046), lt(sub(ey, 1), 2046)) {
                let sig := mul(or(and(a, _MANT64), _HIDDEN64), or(and(b, _MANT64), _HIDDEN64)) // [2^104, 2^106)
                let top := shr(105, sig)
                let e1 := add(sub(add(ex, ey), 1024), top)
                if lt(e1, 2046) {
                    let drop := add(52, top)
                    let q := shr(drop, sig)
                    let unit := shl(drop, 1)
                    let rest := and(sig, sub(unit, 1))
                    q := add(q, gt(add(add(rest, rest), and(q, 1)), unit))
                    let bits := add(shl(52, e1), q)
                    if gt(bits, 0x7fefffffffffffff) { bits := _INF64 }
                    r := or(and(xor(a, b), _SIGN64), bits)
                    done := 1
                }
            }
        }
        if (!done) r = Float32General.mul64(a, b);
    }

    /// @notice binary64 `a / b`, round to nearest even.
    function div64(uint64 a, uint64 b) internal pure returns (uint64) {
        unchecked {
            uint256 x = a;
            uint256 y = b;
            uint256 sign = (x ^ y) & _SIGN64;
            uint256 absX = x & _ABS64;
            uint256 absY = y & _ABS64;
            if (absX >= _INF64 || absY >= _INF64) {
                if (absX > _INF64) return uint64(x | _QUIET64);
                if (absY > _INF64) return uint64(y | _QUIET64);
                if (absX == absY) return _DEFAULT_NAN64;
                return uint64(absX == _INF64 ? sign | _INF64 : sign);
            }
            if (absY == 0) return absX == 0 ? _DEFAULT_NAN64 : uint64(sign | _INF64);
            if (absX == 0) return uint64(sign);
            (uint256 mx, uint256 ex) = Float32General.unpack64(absX);
            (uint256 my, uint256 ey) = Float32General.unpack64(absY);
            // At least 57 significant quotient bits (mx >= 1, my < 2^53), then the sticky bit.
            uint256 scaled = mx << 110;
            uint256 quotient = scaled / my;
            uint256 sticky = scaled % my == 0 ? 0 : 1;
            return Float32General.round64(sign, (quotient << 1) | sticky, int256(ex) - int256(ey) - 111);
        }
    }

    /// @notice binary64 square root, round to nearest even (`sqrt(-0) = -0`; a negative `a` gives NaN).
    function sqrt64(uint64 a) internal pure returns (uint64) {
        unchecked {
            uint256 x = a;
            uint256 absX = x & _ABS64;
            if (absX > _INF64) return uint64(x | _QUIET64);
            if (absX == 0) return a;
            if (x & _SIGN64 != 0) return _DEFAULT_NAN64;
            if (absX == _INF64) return a;
            (uint256 m, uint256 e) = Float32General.unpack64(absX);
            // x = m 2^k with k = e - 1075; make k even, then sqrt(x) = sqrt(m 2^128) 2^((k - 128) / 2), whose
            // integer part has at least 65 bits: with a sticky bit for a non-zero remainder, one rounding.
            int256 k = int256(e) - 1075;
            if (k & 1 != 0) {
                m <<= 1;
                k -= 1;
            }
            uint256 n = m << 128;
            uint256 root = Float32General.isqrt(n);
            uint256 sticky = root * root == n ? 0 : 1;
            return Float32General.round64(0, (root << 1) | sticky, (k - 128) / 2 - 1);
        }
    }

    /// @notice binary64 `a < b` (false when either is NaN; -0 and +0 are equal).
    function lt64(uint64 a, uint64 b) internal pure returns (bool) {
        return _less64(a, b, false);
    }

    /// @notice binary64 `a <= b` (false when either is NaN; -0 and +0 are equal).
    function le64(uint64 a, uint64 b) internal pure returns (bool) {
        return _less64(a, b, true);
    }

    // ------------------------------------------------------------------------------------- conversions

    /// @notice binary64 -> binary32, round to nearest even (torch `.to(torch.float32)`; a NaN keeps its sign and
    /// the top 22 bits of its payload, quieted, as x86 `cvtsd2ss` does).
    function toFloat32(uint64 a) internal pure returns (uint32 r) {
        bool done;
        assembly ("memory-safe") {
            // Fast path: a normal binary64 whose binary32 is normal before rounding (biased exponent 897 + 1 ..
            // 897 + 254): drop 29 of the 53 significand bits.
            let e1 := sub(and(shr(52, a), 0x7ff), 897)
            if lt(e1, 254) {
                let sig := or(and(a, _MANT64), _HIDDEN64)
                let q := shr(29, sig)
                let rest := and(sig, 0x1fffffff)
                q := add(q, gt(add(add(rest, rest), and(q, 1)), 0x20000000))
                let bits := add(shl(23, e1), q)
                if gt(bits, 0x7f7fffff) { bits := _INF32 }
                r := or(and(shr(32, a), _SIGN32), bits)
                done := 1
            }
        }
        if (!done) r = Float32General.toFloat32(a);
    }

    /// @notice binary32 -> binary64, exact (a NaN keeps its sign and payload, quieted).
    function toFloat64(uint32 a) internal pure returns (uint64) {
        unchecked {
            uint256 x = a;
            uint256 sign = (x & _SIGN32) << 32;
            uint256 absX = x & _ABS32;
            if (absX >= _HIDDEN32) {
                if (absX < _INF32) return uint64(sign | ((absX + (896 << 23)) << 29)); // rebias 127 -> 1023
                if (absX == _INF32) return uint64(sign | _INF64);
                return uint64(sign | _INF64 | _QUIET64 | ((absX & _MANT32) << 29));
            }
            if (absX == 0) return uint64(sign);
            // Subnormal: absX 2^-149 with its top bit at p becomes the normal 2^(p-149) x 1.f.
            uint256 p = Float32General.msb(absX);
            return uint64(sign | (((p + 873) << 52) + (absX << (52 - p))));
        }
    }

    /// @notice The integer `v` as a binary64, round to nearest even (exact when |v| <= 2**53).
    function fromInt(int256 v) internal pure returns (uint64 r) {
        uint256 sign;
        uint256 magnitude;
        assembly ("memory-safe") {
            sign := shl(63, slt(v, 0))
            magnitude := v
            if sign { magnitude := sub(0, v) }
            // Fast path, 0 < |v| < 2^53 (exact): the top bit p, then the significand shifted up to bit 52.
            if and(gt(magnitude, 0), lt(magnitude, 0x20000000000000)) {
                let p := shl(5, gt(magnitude, 0xffffffff))
                p := or(p, shl(4, gt(shr(p, magnitude), 0xffff)))
                p := or(p, shl(3, gt(shr(p, magnitude), 0xff)))
                p := or(p, shl(2, gt(shr(p, magnitude), 0xf)))
                p := or(p, byte(add(16, shr(p, magnitude)), 0x00000101020202020303030303030303))
                r := or(sign, add(shl(52, add(p, 1022)), shl(sub(52, p), magnitude)))
            }
        }
        if (magnitude >= 0x20000000000000) r = Float32General.round64(sign, magnitude, 0);
    }

    // ------------------------------------------------------------------------------------- internals

    /// @dev `a + (b ^ negate)`; the NaN rule sees `b` as given.
    function _add(uint256 x, uint256 y, uint256 negate) private pure returns (uint32 r) {
        bool done;
        assembly ("memory-safe") {
            // Fast path: both normal and the result normal before rounding. Without cancellation (same signs, or
            // exponents 2 or more apart) the sum has a known width (23 + gap + 0 or 1 bits, or 22 + gap + 0 or 1
            // for a difference), so no search for its top bit; with it, the difference is below 2^25.
            let ex := and(shr(23, x), 0xff)
            let ey := and(shr(23, y), 0xff)
            if and(lt(sub(ex, 1), 254), lt(sub(ey, 1), 254)) {
                let big := x
                let small := xor(y, negate)
                if lt(and(x, _ABS32), and(y, _ABS32)) {
                    big := small
                    small := x
                    let t := ex
                    ex := ey
                    ey := t
                }
                let gap := sub(ex, ey)
                if gt(gap, 40) { gap := 40 } // see Float32General.add
                let mx := shl(gap, or(and(big, _MANT32), _HIDDEN32))
                let my := or(and(small, _MANT32), _HIDDEN32)
                let sig
                let drop
                let plain := 1
                switch and(xor(big, small), _SIGN32)
                case 0 {
                    sig := add(mx, my)
                    drop := add(gap, shr(add(24, gap), sig))
                }
                default {
                    sig := sub(mx, my)
                    switch gt(gap, 1)
                    case 1 { drop := sub(add(gap, shr(add(23, gap), sig)), 1) }
                    default {
                        // Cancellation: sig < 2^25 (exact unless it has 25 bits); find its top bit. A zero
                        // difference (+0) takes the general path.
                        plain := gt(sig, 0)
                        let top := shl(4, gt(sig, 0xffff))
                        top := or(top, shl(3, gt(shr(top, sig), 0xff)))
                        top := or(top, shl(2, gt(shr(top, sig), 0xf)))
                        top := or(top, byte(add(16, shr(top, sig)), 0x00000101020202020303030303030303))
                        drop := sub(top, 23) // negative (a left shift) when bits cancelled
                    }
                }
                let e1 := sub(add(sub(ex, gap), drop), 1)
                if and(plain, lt(e1, 254)) {
                    if slt(drop, 0) {
                        sig := shl(sub(0, drop), sig)
                        drop := 0
                    }
                    // Rounded as in `mul`.
                    let q := shr(drop, sig)
                    let unit := shl(drop, 1)
                    let rest := and(sig, sub(unit, 1))
                    q := add(q, gt(add(add(rest, rest), and(q, 1)), unit))
                    let bits := add(shl(23, e1), q)
                    if gt(bits, 0x7f7fffff) { bits := _INF32 }
                    r := or(and(big, _SIGN32), bits)
                    done := 1
                }
            }
        }
        if (!done) r = Float32General.add(x, y, negate);
    }

    /// @dev `a < b` (or `a <= b` when `orEqual`) on binary64, IEEE-754: false with a NaN, -0 == +0. An order key
    /// (all bits flipped for a negative value, the sign bit for a positive one) orders the encodings as numbers.
    function _less64(uint256 x, uint256 y, bool orEqual) private pure returns (bool less) {
        assembly ("memory-safe") {
            let absX := and(x, _ABS64)
            let absY := and(y, _ABS64)
            let keyX := xor(x, or(_SIGN64, mul(shr(63, x), _ABS64)))
            let keyY := xor(y, or(_SIGN64, mul(shr(63, y), _ABS64)))
            less := or(lt(keyX, keyY), and(orEqual, eq(keyX, keyY)))
            if iszero(or(absX, absY)) { less := orEqual } // -0 == +0
            if or(gt(absX, _INF64), gt(absY, _INF64)) { less := 0 }
        }
    }

}
