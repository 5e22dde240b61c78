// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {Float32} from "./Float32.sol";
import {Float32General} from "./Float32General.sol";

/// @title Float64Functions
/// @notice The elementwise functions of the reproducible mode, bit for bit (issue 78, docs/FRAUD_PROOF.md
/// "Elementwise functions"): StepProver's op kinds UNARY (8, `out[e] = f(a[e])`) and UNARY_SLOPE (9,
/// `out[e] = f'(a[e])`, the derivative training/exact_ops.py's ExactUnary backward multiplies by), the function
/// a code: 1 exp, 2 log, 3 tanh, 4 sigmoid, 5 silu, 6 gelu_tanh, 7 rsqrt, 8 sqrt (value only). Each is
/// training/exact_ops.py's float64 formula (`UNARY`, of training/exact_math.py's `exp64`, `log64`, `tanh64`),
/// one IEEE binary64 operation at a time in its order, rounded once to float32 (`Float32.toFloat32`); sqrt is
/// the correctly rounded float32 root (kernel version 3's, AdamW's), the binary64 root rounded to binary32
/// (53 >= 2 * 24 + 2 bits: the double rounding is exact). ledger/stepfunctions.py is the Python mirror.
/// A linked library called by StepProverMath (DELEGATECALL), or directly (`unaryMany`, eth_call).
/// @dev Values are encodings as in `Float32`. NaN payloads are not reproduced (a proof compares with `same32`).
library Float64Functions {
    using Float32 for uint32;
    using Float32 for uint64;

    uint8 internal constant UNARY = 8;
    uint8 internal constant UNARY_SLOPE = 9;
    uint32 internal constant SQRT = 8;

    uint256 private constant _SIGN = 0x8000000000000000;
    uint256 private constant _ABS = 0x7FFFFFFFFFFFFFFF;
    uint256 private constant _INF = 0x7FF0000000000000;
    uint256 private constant _QUIET = 0x0008000000000000;
    uint256 private constant _MANT = 0x000FFFFFFFFFFFFF;
    uint256 private constant _HIDDEN = 0x0010000000000000;
    uint64 private constant _NAN = 0xFFF8000000000000;
    uint64 private constant _NEG_INF = 0xFFF0000000000000;

    uint64 private constant _ONE = 0x3FF0000000000000;
    uint64 private constant _TWO = 0x4000000000000000;
    uint64 private constant _HALF = 0x3FE0000000000000;
    uint64 private constant _MINUS_HALF = 0xBFE0000000000000;
    uint64 private constant _MINUS_TWO = 0xC000000000000000;
    uint64 private constant _LN2_HI = 0x3FE62E42FEE00000; // training/exact_math.py's constants
    uint64 private constant _LN2_LO = 0x3DEA39EF35793C76;
    uint64 private constant _INV_LN2 = 0x3FF71547652B82FE;
    uint64 private constant _SQRT_HALF = 0x3FE6A09E667F3BCD;
    uint64 private constant _EXP_LOW = 0xC087480000000000; // -745
    uint64 private constant _EXP_HIGH = 0x4086280000000000; // 709
    uint64 private constant _GELU_C = 0x3FE9884533D43651; // sqrt(2 / pi)
    uint64 private constant _GELU_A = 0x3FA6E4E26D4801F7; // 0.044715
    uint64 private constant _GELU_3A = 0x3FC12BA9D1F60179; // 3 * 0.044715
    /// @dev 1/k!, k = 12 down to 0 (exp's Taylor terms, highest power first).
    bytes private constant _EXP_TERMS = hex"3E21EED8EFF8D8983E5AE64567F544E43E927E4FB7789F5C3EC71DE3A556C7343EFA01A01A01A01A"
        hex"3F2A01A01A01A01A3F56C16C16C16C173F811111111111113FA55555555555553FC55555555555553FE0000000000000"
        hex"3FF00000000000003FF0000000000000";
    /// @dev 2/k, k = 19, 17, ..., 1 (the odd series of 2 atanh(s) in s^2).
    bytes private constant _LOG_TERMS = hex"3FBAF286BCA1AF283FBE1E1E1E1E1E1E3FC11111111111113FC3B13B13B13B14"
        hex"3FC745D1745D17463FCC71C71C71C71C3FD24924924924923FD999999999999A3FE55555555555554000000000000000";

    /// @notice Whether `out` is op `kind` (UNARY or UNARY_SLOPE) of function `code` at `x` in float32, bit for bit
    /// (any NaNs agree); false for a code (or a slope) the contract does not recompute.
    function unaryHolds(uint8 kind, uint32 code, uint32 x, uint32 out) public pure returns (bool) {
        return validCode(kind, code) && unary(kind, code, x).same32(out);
    }

    /// @notice Whether `code` names a function of op `kind`: codes 1 to 8 for UNARY, 1 to 7 for UNARY_SLOPE
    /// (training computes no slope of sqrt).
    function validCode(uint8 kind, uint32 code) public pure returns (bool) {
        if (kind == UNARY) return code >= 1 && code <= SQRT;
        return kind == UNARY_SLOPE && code >= 1 && code < SQRT;
    }

    /// @notice Op `kind` of function `code` at float32 `x`: `f(x)` (UNARY) or `f'(x)` (UNARY_SLOPE), float32 bits
    /// (an invalid code: NaN).
    function unary(uint8 kind, uint32 code, uint32 x) public pure returns (uint32) {
        if (!validCode(kind, code)) return uint32(0xFFC00000);
        return formula(code, x.toFloat64(), kind == UNARY_SLOPE).toFloat32();
    }

    /// @notice `unary` at each of `xs` (a batch for one eth_call: tests and benchmarks).
    function unaryMany(uint8 kind, uint32 code, uint32[] calldata xs) external pure returns (uint32[] memory out) {
        out = new uint32[](xs.length);
        for (uint256 i = 0; i < xs.length; ++i) out[i] = unary(kind, code, xs[i]);
    }

    /// @notice The float64 value (or, `slope`, derivative) of function `code` (1 to 8) at `v`: training/exact_ops.py
    /// `UNARY`'s formulas, operation for operation.
    function formula(uint32 code, uint64 v, bool slope) public pure returns (uint64) {
        if (code == 1) return exp64(v); // exp: the slope is the value
        if (code == 2) return slope ? div(_ONE, v) : log64(v);
        if (code == 3) {
            uint64 y = tanh64(v);
            return slope ? sub64(_ONE, y.mul64(y)) : y;
        }
        if (code == 4 || code == 5) {
            uint64 s = div(_ONE, add64(exp64(neg(v)), _ONE));
            if (code == 4) return slope ? s.mul64(sub64(_ONE, s)) : s;
            return slope ? s.mul64(add64(v.mul64(sub64(_ONE, s)), _ONE)) : v.mul64(s);
        }
        if (code == 6) return _gelu(v, slope);
        uint64 root = v.sqrt64();
        if (code == SQRT) return root;
        uint64 inverse = div(_ONE, root); // rsqrt
        return slope ? inverse.mul64(inverse).mul64(inverse).mul64(_MINUS_HALF) : inverse;
    }

    /// @dev tanh-GELU: `t = tanh((v + v^3 A) C)`, value `v (t + 1) / 2`, slope
    /// `(t + 1) / 2 + v ((1 - t^2) C (v^2 3A + 1)) / 2` (the products left to right, as written in exact_ops.py).
    function _gelu(uint64 v, bool slope) private pure returns (uint64) {
        uint64 t = tanh64(add64(v, v.mul64(v).mul64(v).mul64(_GELU_A)).mul64(_GELU_C));
        uint64 t1 = add64(t, _ONE);
        if (!slope) return v.mul64(t1).mul64(_HALF);
        uint64 bracket = sub64(_ONE, t.mul64(t)).mul64(_GELU_C).mul64(add64(v.mul64(v).mul64(_GELU_3A), _ONE));
        return add64(t1.mul64(_HALF), v.mul64(bracket).mul64(_HALF));
    }

    /// @notice training/exact_math.py `exp64`: `x` clamped to [-745, 709], `n = round(x / ln 2)` (ties to even),
    /// `r = (x - n ln2_hi) - n ln2_lo`, the degree-12 Taylor polynomial of `r` (Horner), times `2^floor(n / 2)`,
    /// then times `2^(n - floor(n / 2))` (each scale built from its exponent bits). A NaN stays NaN.
    function exp64(uint64 x) public pure returns (uint64) {
        if (x & _ABS > _INF) return uint64(x | _QUIET);
        if (x.lt64(_EXP_LOW)) x = _EXP_LOW;
        else if (_EXP_HIGH.lt64(x)) x = _EXP_HIGH;
        int256 n = rint(x.mul64(_INV_LN2));
        uint64 nf = Float32.fromInt(n);
        uint64 r = sub64(sub64(x, nf.mul64(_LN2_HI)), nf.mul64(_LN2_LO));
        int256 half = n >> 1; // floor(n / 2): an arithmetic shift
        return _horner(r, _EXP_TERMS).mul64(pow2(half)).mul64(pow2(n - half));
    }

    /// @notice training/exact_math.py `log64`: `-inf` unless `x > 0` (zero, a negative, a NaN); `+inf` gives NaN
    /// (frexp's mantissa inf, `s = inf / inf`); else `x = m 2^e` (`frexp`, then `m` doubled and `e` less one
    /// where `m < sqrt(1/2)`), `f = m - 1`, `s = f / (f + 2)`, `e ln2_hi + (e ln2_lo + s horner(s^2))`.
    function log64(uint64 x) public pure returns (uint64) {
        if (!uint64(0).lt64(x)) return _NEG_INF;
        if (x == _INF) return _NAN;
        (uint64 m, int256 e) = frexp(x);
        if (m.lt64(_SQRT_HALF)) {
            m = m.mul64(_TWO);
            e -= 1;
        }
        uint64 ef = Float32.fromInt(e);
        uint64 f = sub64(m, _ONE);
        uint64 s = div(f, add64(f, _TWO));
        uint64 series = s.mul64(_horner(s.mul64(s), _LOG_TERMS));
        return add64(ef.mul64(_LN2_HI), add64(ef.mul64(_LN2_LO), series));
    }

    /// @notice training/exact_math.py `tanh64`: `t = exp64(|x| * -2)`, `(1 - t) / (1 + t)`, negated for `x < 0`.
    function tanh64(uint64 x) public pure returns (uint64) {
        uint64 t = exp64(uint64(x & _ABS).mul64(_MINUS_TWO));
        uint64 magnitude = div(sub64(_ONE, t), add64(_ONE, t));
        return x.lt64(0) ? neg(magnitude) : magnitude;
    }

    /// @notice binary64 `a + b`, round to nearest even (the exact sum of the two significands aligned, with the
    /// smaller's bits past 128 below the larger's as one sticky bit, rounded once by `Float32General.round64`).
    function add64(uint64 a, uint64 b) public pure returns (uint64) {
        unchecked {
            uint256 x = a;
            uint256 y = b;
            uint256 absX = x & _ABS;
            uint256 absY = y & _ABS;
            if (absX >= _INF || absY >= _INF) {
                if (absX > _INF) return uint64(x | _QUIET);
                if (absY > _INF) return uint64(y | _QUIET);
                if (absX == absY && x != y) return _NAN; // inf - inf
                return absX == _INF ? a : b;
            }
            if (absX == 0) return absY == 0 ? uint64(x & y) : b; // -0 + -0 = -0, else +0
            if (absY == 0) return a;
            if (absX < absY) (x, y, absX, absY) = (y, x, absY, absX);
            (uint256 mx, uint256 ex) = Float32General.unpack64(absX);
            (uint256 my, uint256 ey) = Float32General.unpack64(absY);
            uint256 gap = ex - ey;
            uint256 big = mx << 128;
            uint256 small = gap > 128 ? 1 : my << (128 - gap); // past 128: below half an ulp of `big`, sticky
            uint256 sig = (x ^ y) & _SIGN == 0 ? big + small : big - small;
            if (sig == 0) return 0; // an exact cancellation is +0
            return Float32General.round64(x & _SIGN, sig, int256(ex) - 1203);
        }
    }

    /// @notice binary64 `a - b`, round to nearest even (`a + (-b)`).
    function sub64(uint64 a, uint64 b) public pure returns (uint64) {
        return add64(a, neg(b));
    }

    /// @notice binary64 `a / b` (`Float32.div64`).
    function div(uint64 a, uint64 b) public pure returns (uint64) {
        return a.div64(b);
    }

    /// @notice `-a` (the sign bit flipped).
    function neg(uint64 a) public pure returns (uint64) {
        return uint64(a ^ _SIGN);
    }

    /// @notice The finite binary64 `a` (|a| < 2**200) rounded to the nearest integer, ties to even (torch.round).
    function rint(uint64 a) public pure returns (int256 k) {
        uint256 x = a;
        uint256 e = (x >> 52) & 0x7FF;
        if (e >= 1022) { // |a| >= 0.5
            uint256 m = (x & _MANT) | _HIDDEN; // |a| = m 2^(e - 1075)
            uint256 whole;
            if (e >= 1075) {
                whole = m << (e - 1075);
            } else {
                uint256 s = 1075 - e; // 1 to 53
                whole = m >> s;
                uint256 rest = m & ((uint256(1) << s) - 1);
                uint256 half = uint256(1) << (s - 1);
                if (rest > half || (rest == half && whole & 1 == 1)) ++whole;
            }
            k = int256(whole);
        }
        if (x & _SIGN != 0) k = -k;
    }

    /// @notice `2.0 ** n` for an integer `n` in [-1022, 1023], from its exponent bits (exact_math `pow2_64`).
    function pow2(int256 n) public pure returns (uint64) {
        // forge-lint: disable-next-line(unsafe-typecast)
        return uint64(uint256(n + 1023) << 52);
    }

    /// @notice `frexp` of a finite non-zero binary64 `x`: `(m, e)` with `x = m 2^e`, `|m|` in [0.5, 1) (m carries
    /// `x`'s sign), by the bits (a subnormal normalised first).
    function frexp(uint64 x) public pure returns (uint64 m, int256 e) {
        uint256 absX = x & _ABS;
        uint256 biased = absX >> 52;
        uint256 frac = absX & _MANT;
        if (biased == 0) { // subnormal: frac 2^-1074, its top bit p moved to bit 52
            uint256 p = Float32General.msb(frac);
            frac = (frac << (52 - p)) & _MANT;
            biased = 1;
            e = int256(p) - 52;
        }
        e += int256(biased) - 1022;
        m = uint64((x & _SIGN) | (1022 << 52) | frac);
    }

    /// @dev `terms[0] x^(n-1) + ... + terms[n-1]` (8-byte binary64 terms, highest power first): one multiply and one
    /// add a term.
    function _horner(uint64 x, bytes memory terms) private pure returns (uint64 acc) {
        uint256 n = terms.length / 8;
        acc = _term(terms, 0);
        for (uint256 i = 1; i < n; ++i) acc = add64(acc.mul64(x), _term(terms, i));
    }

    function _term(bytes memory terms, uint256 i) private pure returns (uint64 t) {
        assembly ("memory-safe") {
            t := shr(192, mload(add(add(terms, 32), mul(i, 8))))
        }
    }
}
