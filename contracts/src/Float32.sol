// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

/// @title Float32
/// @notice IEEE-754 binary32 and binary64 arithmetic in software, bit for bit what torch computes on a CPU:
/// round to nearest, ties to even; subnormals kept (no flush to zero); signed zeros and infinities as IEEE-754
/// says. A value is its encoding held in an unsigned integer (torch's `x.view(torch.int32)` read as unsigned).
/// It is what the on-chain fraud proof recomputes DiLoCoX's outer step with (training/diloco.py,
/// training/robust.py, training/codec_wire.py; docs/SOFTFLOAT.md).
/// @dev Every rounding goes through one of two functions, `_round32` and `_round64`: an operation computes its
/// exact result as `sig * 2**pow2` (an integer significand wide enough to decide the rounding: exact, or with a
/// sticky bit below every bit that matters) and rounds it once. No loop runs over bits.
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
                    r := or(and(xor(a, b), _SIGN32), _roundAt(sig, add(23, top), e1))
                    done := 1
                }
            }
            // sig to 24 bits by dropping `drop` bits (ties to even), placed at biased exponent e1 + 1; a carry
            // out of the significand moves into the exponent, and past the largest finite value gives infinity.
            function _roundAt(sig, drop, e1) -> bits {
                let q := shr(drop, sig)
                let unit := shl(drop, 1)
                let rest := and(sig, sub(unit, 1))
                // Up when 2 rest + (q odd) > unit: the rest exceeds half a unit, or is half and q is odd.
                q := add(q, gt(add(add(rest, rest), and(q, 1)), unit))
                bits := add(shl(23, e1), q)
                if gt(bits, 0x7f7fffff) { bits := _INF32 }
            }
        }
        if (!done) r = _mulGeneral(a, b);
    }

    function _mulGeneral(uint256 x, uint256 y) private pure returns (uint32) {
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
            (uint256 mx, uint256 ex) = _unpack32(absX);
            (uint256 my, uint256 ey) = _unpack32(absY);
            // x = mx 2^(ex-150), y = my 2^(ey-150): the 48-bit product is exact.
            return _round32(sign, mx * my, int256(ex + ey) - 300);
        }
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
                    r := or(and(xor(a, b), _SIGN32), _roundAt(sig, add(3, top), e1))
                    done := 1
                }
            }
            function _roundAt(sig, drop, e1) -> bits {
                let q := shr(drop, sig)
                let unit := shl(drop, 1)
                let rest := and(sig, sub(unit, 1))
                q := add(q, gt(add(add(rest, rest), and(q, 1)), unit))
                bits := add(shl(23, e1), q)
                if gt(bits, 0x7f7fffff) { bits := _INF32 }
            }
        }
        if (!done) r = _divGeneral(a, b);
    }

    function _divGeneral(uint256 x, uint256 y) private pure returns (uint32) {
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
            (uint256 mx, uint256 ex) = _unpack32(absX);
            (uint256 my, uint256 ey) = _unpack32(absY);
            // mx << 64 / my has at least 40 significant bits (mx >= 1, my < 2^24): with the remainder as a
            // sticky bit below them, rounding that once rounds the exact quotient.
            uint256 scaled = mx << 64;
            uint256 quotient = scaled / my;
            uint256 sticky = scaled % my == 0 ? 0 : 1;
            return _round32(sign, (quotient << 1) | sticky, int256(ex) - int256(ey) - 65);
        }
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
    function fromInt32(int256 v) internal pure returns (uint32) {
        unchecked {
            if (v == 0) return 0;
            if (v > 0) return _round32(0, uint256(v), 0);
            return _round32(_SIGN32, uint256(-v), 0); // -type(int256).min wraps to 2**255, its magnitude
        }
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
        if (!done) r = _mul64General(a, b);
    }

    function _mul64General(uint256 x, uint256 y) private pure returns (uint64) {
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
            (uint256 mx, uint256 ex) = _unpack64(absX);
            (uint256 my, uint256 ey) = _unpack64(absY);
            return _round64(sign, mx * my, int256(ex + ey) - 2150);
        }
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
            (uint256 mx, uint256 ex) = _unpack64(absX);
            (uint256 my, uint256 ey) = _unpack64(absY);
            // At least 57 significant quotient bits (mx >= 1, my < 2^53), then the sticky bit.
            uint256 scaled = mx << 110;
            uint256 quotient = scaled / my;
            uint256 sticky = scaled % my == 0 ? 0 : 1;
            return _round64(sign, (quotient << 1) | sticky, int256(ex) - int256(ey) - 111);
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
            (uint256 m, uint256 e) = _unpack64(absX);
            // x = m 2^k with k = e - 1075; make k even, then sqrt(x) = sqrt(m 2^128) 2^((k - 128) / 2), whose
            // integer part has at least 65 bits: with a sticky bit for a non-zero remainder, one rounding.
            int256 k = int256(e) - 1075;
            if (k & 1 != 0) {
                m <<= 1;
                k -= 1;
            }
            uint256 n = m << 128;
            uint256 root = _isqrt(n);
            uint256 sticky = root * root == n ? 0 : 1;
            return _round64(0, (root << 1) | sticky, (k - 128) / 2 - 1);
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
        if (!done) r = _toFloat32General(a);
    }

    function _toFloat32General(uint256 x) private pure returns (uint32) {
        unchecked {
            uint256 sign = (x >> 32) & _SIGN32;
            uint256 absX = x & _ABS64;
            if (absX >= _INF64) {
                if (absX == _INF64) return uint32(sign | _INF32);
                return uint32(sign | _INF32 | _QUIET32 | ((absX & _MANT64) >> 29));
            }
            if (absX == 0) return uint32(sign);
            (uint256 m, uint256 e) = _unpack64(absX);
            return _round32(sign, m, int256(e) - 1075);
        }
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
            uint256 p = _msb(absX);
            return uint64(sign | (((p + 873) << 52) + (absX << (52 - p))));
        }
    }

    /// @notice The integer `v` as a binary64, round to nearest even (exact when |v| <= 2**53).
    function fromInt(int256 v) internal pure returns (uint64) {
        unchecked {
            if (v == 0) return 0;
            if (v > 0) return _round64(0, uint256(v), 0);
            return _round64(_SIGN64, uint256(-v), 0);
        }
    }

    // ------------------------------------------------------------------------------------- internals

    /// @dev `a + (b ^ negate)`; the NaN rule sees `b` as given.
    function _add(uint256 x, uint256 y, uint256 negate) private pure returns (uint32 r) {
        bool done;
        assembly ("memory-safe") {
            // Fast path: both normal, no cancellation (same signs, or exponents 2 or more apart) and the result
            // normal before rounding. The sum then has a known width (23 + gap + 0 or 1 bits, or 22 + gap + 0 or 1
            // for a difference), so no search for its top bit.
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
                if gt(gap, 40) { gap := 40 } // see _addGeneral
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
                    drop := sub(add(gap, shr(add(23, gap), sig)), 1)
                    plain := gt(gap, 1)
                }
                let e1 := sub(add(sub(ex, gap), drop), 1)
                if and(plain, lt(e1, 254)) {
                    r := or(and(big, _SIGN32), _roundAt(sig, drop, e1))
                    done := 1
                }
            }
            function _roundAt(sig, drop, e1) -> bits {
                let q := shr(drop, sig)
                let unit := shl(drop, 1)
                let rest := and(sig, sub(unit, 1))
                q := add(q, gt(add(add(rest, rest), and(q, 1)), unit))
                bits := add(shl(23, e1), q)
                if gt(bits, 0x7f7fffff) { bits := _INF32 }
            }
        }
        if (!done) r = _addGeneral(x, y, negate);
    }

    function _addGeneral(uint256 x, uint256 y, uint256 negate) private pure returns (uint32) {
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
            return _round32(sign, sig, pow2);
        }
    }

    /// @dev The binary32 nearest `sign * sig * 2**pow2` (ties to even), `sign` 0 or 2**31, `sig` in (0, 2**254):
    /// overflow gives infinity, underflow a subnormal or zero.
    function _round32(uint256 sign, uint256 sig, int256 pow2) private pure returns (uint32 r) {
        assembly ("memory-safe") {
            // Bits to drop: down to 24 significant bits, or to the subnormal quantum 2^-149.
            let drop := sub(_msb(sig), 23)
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

            function _msb(v) -> m {
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
    function _round64(uint256 sign, uint256 sig, int256 pow2) private pure returns (uint64 r) {
        assembly ("memory-safe") {
            let drop := sub(_msb(sig), 52)
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

            function _msb(v) -> m {
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
    function _unpack32(uint256 abs) private pure returns (uint256 m, uint256 e) {
        assembly ("memory-safe") {
            e := shr(23, abs)
            m := and(abs, _MANT32)
            switch e
            case 0 { e := 1 }
            default { m := or(m, _HIDDEN32) }
        }
    }

    /// @dev Significand and biased exponent of a finite non-zero binary64 magnitude (subnormal: exponent 1).
    function _unpack64(uint256 abs) private pure returns (uint256 m, uint256 e) {
        assembly ("memory-safe") {
            e := shr(52, abs)
            m := and(abs, _MANT64)
            switch e
            case 0 { e := 1 }
            default { m := or(m, _HIDDEN64) }
        }
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

    /// @dev Index of the most significant set bit of `x > 0`.
    function _msb(uint256 x) private pure returns (uint256 r) {
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
    function _isqrt(uint256 n) private pure returns (uint256 x) {
        unchecked {
            x = 1 << ((_msb(n) >> 1) + 1);
            uint256 y = (x + n / x) >> 1;
            while (y < x) {
                x = y;
                y = (x + n / x) >> 1;
            }
        }
    }
}
