// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {Float32} from "../src/Float32.sol";
import {NodeRegistry} from "../src/NodeRegistry.sol";
import {StepProver} from "../src/StepProver.sol";
import {StepProverMath} from "../src/StepProverMath.sol";
import {TrainingLedger} from "../src/TrainingLedger.sol";
import {TrustBase} from "./TrustBase.sol";

/// @notice The end dispute's rules inside the EVM (issue 78, docs/FRAUD_PROOF.md "The claim's end"): who fixes a
/// run's plain end rule and when (`setEndRule`), and the relation `proveEnd` decides an element by
/// (`StepProverMath.endHolds`, `rne`), fuzzed against a reference. tests/test_forge_invariants.py runs them; the
/// whole game (claims, `challengeEnd`, `proveEnd`, the clock) is tests/test_step_end.py's, on py-evm and anvil.
contract StepProverEndTest is TrustBase {
    using Float32 for uint32;

    uint32 internal constant TINY = 0x00800000; // torch.finfo(torch.float32).tiny
    uint32 internal constant TWO_23 = 0x4B000000; // 2**23: the float32 whose ulp is 1

    NodeRegistry internal registry;
    TrainingLedger internal ledger;
    StepProver internal prover;
    uint256 internal runId;

    function setUp() public {
        _castAddresses();
        registry = new NodeRegistry(0);
        ledger = new TrainingLedger(registry);
        for (uint256 key = 1; key <= 3; ++key) register(registry, key);
        prover = new StepProver(BOND, WINDOW, ledger); // on its own, bound to the ledger
        runId = _runWithTwoMembers("end rule");
    }

    function _runWithTwoMembers(string memory name) internal returns (uint256 run) {
        vm.prank(who(1));
        run = ledger.createRun(runParams(keccak256(bytes(name))), name);
        for (uint256 key = 1; key <= 2; ++key) {
            vm.prank(who(key));
            ledger.joinRun{value: STAKE}(run, bytes32("cpu"));
        }
    }

    function _fixed(uint256 run, address sender) internal pure returns (bytes memory) {
        return abi.encodeWithSelector(StepProver.ProverStepProgramFixed.selector, run, sender);
    }

    // ------------------------------------------------------------------------------------- setEndRule

    function test_the_end_rule_is_the_creators_once_and_only_the_plain_one() public {
        vm.assertEq(prover.endRuleOf(runId), 0, "a run starts with no end rule");
        vm.prank(who(2)); // a member, not the creator
        vm.expectRevert(_fixed(runId, who(2)));
        prover.setEndRule(runId, 1);
        vm.prank(who(3)); // a stranger
        vm.expectRevert(_fixed(runId, who(3)));
        prover.setEndRule(runId, 1);
        for (uint8 rule = 0; rule <= 2; rule += 2) { // 1 is the only rule
            vm.prank(who(1));
            vm.expectRevert(_fixed(runId, who(1)));
            prover.setEndRule(runId, rule);
        }
        vm.prank(who(1));
        prover.setEndRule(runId, 1);
        vm.assertEq(prover.endRuleOf(runId), 1, "the creator's rule not fixed");
        vm.prank(who(1)); // once
        vm.expectRevert(_fixed(runId, who(1)));
        prover.setEndRule(runId, 1);
        vm.assertEq(prover.endRuleOf(runId + 1), 0, "another run took the rule");
    }

    function test_the_end_rule_is_refused_after_the_runs_first_commit() public {
        uint256 run = _runWithTwoMembers("committed");
        TrainingLedger.Record memory record = TrainingLedger.Record(
            run, 0, ledger.headOf(run), keccak256("w"), keccak256("c"), 1, 1, 1, 1, 0
        );
        uint256[] memory keys = new uint256[](2);
        keys[0] = 1;
        keys[1] = 2;
        vm.prank(who(1));
        ledger.commitRound(record, signAll(keys, recordDigest(ledger, record)));
        vm.assertEq(ledger.commitCount(run), 1, "the round not committed");
        vm.prank(who(1));
        vm.expectRevert(_fixed(run, who(1)));
        prover.setEndRule(run, 1);
        vm.assertEq(prover.endRuleOf(run), 0, "a committed run took an end rule");
    }

    function test_challenge_end_of_an_unknown_claim_is_refused() public {
        vm.expectRevert(StepProver.ProverStepUnknownClaim.selector);
        prover.challengeEnd{value: BOND}(keccak256("no claim"), 0, 0);
    }

    // ------------------------------------------------------------------------------------- rne

    /// @dev The reference: |x| < 2**23 rounded by float32 addition itself (fl(|x| + 2**23) - 2**23: the ulp there
    /// is 1, and the addition rounds half to even), the integer read off the result; past 2**23 (or infinite): the
    /// limit; then clamped and signed.
    function _rneRef(uint32 x, int256 limit) internal pure returns (int256 r) {
        uint32 ax = x & 0x7FFFFFFF;
        if (ax >= TWO_23) {
            r = limit;
        } else {
            uint32 y = ax.add(TWO_23).sub(TWO_23); // an integer, 0 .. 2**23
            if (y != 0) {
                uint256 exp = y >> 23;
                r = int256(uint256((y & 0x7FFFFF) | 0x800000) >> (150 - exp));
            }
            if (r > limit) r = limit;
        }
        if (x >> 31 == 1) r = -r;
    }

    function _limit(uint8 bitsSeed) internal pure returns (int256 limit, uint8 bits) {
        bits = uint8(1 + bitsSeed % 16);
        limit = int256(uint256(1) << (bits - 1)) - 1;
    }

    function testFuzz_rne_is_round_half_even_then_clamped(uint32 x, uint8 bitsSeed) public pure {
        vm.assume(!x.isNaN32());
        (int256 limit,) = _limit(bitsSeed);
        vm.assertTrue(StepProverMath.rne(x, limit) == _rneRef(x, limit), "rne differs from float32's rounding");
    }

    /// @dev Near the integers and the halves, where ties and carries are (random words seldom land there).
    function testFuzz_rne_at_halves_and_integers(uint24 whole, bool half, bool negative, uint8 bitsSeed) public pure {
        uint32 x = Float32.fromInt32(int256(uint256(whole)) * 2 + (half ? int256(1) : int256(0)));
        x = x.div(0x40000000); // / 2: exact (whole < 2**24)
        if (negative) x |= 0x80000000;
        (int256 limit,) = _limit(bitsSeed);
        int256 ref = _rneRef(x, limit);
        vm.assertTrue(StepProverMath.rne(x, limit) == ref, "rne differs at a half or an integer");
        vm.assertTrue(StepProverMath.rne(x + 1, limit) == _rneRef(x + 1, limit), "rne differs an ulp past");
        if (x & 0x7FFFFFFF != 0) {
            vm.assertTrue(StepProverMath.rne(x - 1, limit) == _rneRef(x - 1, limit), "rne differs an ulp before");
        }
    }

    function test_rne_named_cases() public pure {
        int256 big = 32767;
        vm.assertTrue(StepProverMath.rne(0x3F000000, big) == 0, "0.5 -> 0");
        vm.assertTrue(StepProverMath.rne(0x3FC00000, big) == 2, "1.5 -> 2");
        vm.assertTrue(StepProverMath.rne(0x40200000, big) == 2, "2.5 -> 2");
        vm.assertTrue(StepProverMath.rne(0xC0200000, big) == -2, "-2.5 -> -2");
        vm.assertTrue(StepProverMath.rne(0x3F000001, big) == 1, "0.5 + ulp -> 1");
        vm.assertTrue(StepProverMath.rne(0x80000000, big) == 0, "-0 -> 0");
        vm.assertTrue(StepProverMath.rne(0x7F800000, 7) == 7, "inf -> the limit");
        vm.assertTrue(StepProverMath.rne(0xFF800000, 7) == -7, "-inf -> -limit");
        vm.assertTrue(StepProverMath.rne(0x4B000000, 0) == 0, "2**23 with limit 0 (one bit) -> 0");
        vm.assertTrue(StepProverMath.rne(0x40E00000, 3) == 3, "7 clamped to 3");
    }

    // ------------------------------------------------------------------------------------- endHolds

    function _raw(uint32[] memory values) internal pure returns (bytes memory piece) {
        piece = abi.encodePacked(bytes1(0x00), uint32(values.length));
        for (uint256 i = 0; i < values.length; ++i) piece = bytes.concat(piece, bytes4(values[i]));
    }

    /// @dev A quant piece of two elements, both of scale `scale`, element `pos` coded `q`, the other 0.
    function _quant(int256 q, uint32 scale, uint256 pos) internal pure returns (bytes memory) {
        // forge-lint: disable-next-line(unsafe-typecast)
        bytes2 code = bytes2(uint16(int16(q))); // |q| <= 32767: the cast is exact
        return abi.encodePacked(bytes1(0x01), uint32(2), pos == 0 ? code : bytes2(0), pos == 1 ? code : bytes2(0),
            scale, scale);
    }

    function testFuzz_a_raw_piece_holds_exactly_the_difference(uint32 s, uint32 e, uint32 other, uint8 posSeed)
        public
        pure
    {
        uint32 v = s.sub(e);
        vm.assume(v.isFinite32());
        uint256 pos = posSeed % 3;
        uint32[] memory values = new uint32[](3);
        for (uint256 i = 0; i < 3; ++i) values[i] = i == pos ? v : other;
        vm.assertTrue(StepProverMath.endHolds(_raw(values), pos, s, e, 0), "the honest raw element refused");
        values[pos] = v ^ 1; // one ulp off
        vm.assertFalse(StepProverMath.endHolds(_raw(values), pos, s, e, 0), "a raw element one ulp off held");
        values[pos] = v;
        vm.assertFalse(StepProverMath.endHolds(_raw(values), 3, s, e, 0), "an element past the piece held");
    }

    /// @param bitsSeed The width (1 to 16) and, in its top bit, the element (0 or 1) of the piece disputed.
    function testFuzz_a_quant_piece_holds_its_rounding_and_nothing_next_to_it(
        uint32 s,
        uint32 e,
        uint32 scale,
        uint8 bitsSeed
    ) public pure {
        scale &= 0x7FFFFFFF; // a positive scale; below tiny the encoder clamps it to tiny (torch's clamp_min)
        vm.assume(s.sub(e).isFinite32() && scale.isFinite32());
        (int256 limit, uint8 bits) = _limit(bitsSeed);
        int256 q;
        {
            uint32 x = s.sub(e).div(scale < TINY ? TINY : scale);
            vm.assume(!x.isNaN32());
            q = _rneRef(x, limit);
        }
        uint256 pos = bitsSeed >> 7;
        vm.assertTrue(_quantHolds(q, scale, pos, s, e, bits), "the honest quant element refused");
        vm.assertFalse(_quantHolds(q, scale, pos, s, e, 0), "a quant piece held at width 0");
        vm.assertFalse(_quantHolds(q, scale, pos, s, e, 17), "a quant piece held at width 17");
        q = q == type(int16).max ? q - 1 : q + 1; // one step of the code off
        vm.assertFalse(_quantHolds(q, scale, pos, s, e, bits), "a quant element one off held");
    }

    function _quantHolds(int256 q, uint32 scale, uint256 pos, uint32 s, uint32 e, uint8 bits)
        internal
        pure
        returns (bool)
    {
        return StepProverMath.endHolds(_quant(q, scale, pos), pos, s, e, bits);
    }

    function test_a_piece_of_another_codec_or_length_holds_nothing() public pure {
        uint32[] memory values = new uint32[](1);
        values[0] = uint32(0x3F800000); // 1.0 = 2.0 - 1.0
        bytes memory raw = _raw(values);
        vm.assertTrue(StepProverMath.endHolds(raw, 0, 0x40000000, 0x3F800000, 0), "2 - 1 = 1 refused");
        raw[0] = 0x02; // a low-rank piece codes no element
        vm.assertFalse(StepProverMath.endHolds(raw, 0, 0x40000000, 0x3F800000, 0), "a low-rank piece held");
        raw[0] = 0x00;
        vm.assertFalse(StepProverMath.endHolds(bytes.concat(raw, hex"00"), 0, 0x40000000, 0x3F800000, 0),
            "a raw piece with a trailing byte held");
        vm.assertFalse(StepProverMath.endHolds(hex"00000000", 0, 0, 0, 0), "a piece shorter than its header held");
    }
}
