// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {Float32} from "../src/Float32.sol";
import {NodeRegistry} from "../src/NodeRegistry.sol";
import {StepProver} from "../src/StepProver.sol";
import {StepProverMath} from "../src/StepProverMath.sol";
import {TrainingLedger} from "../src/TrainingLedger.sol";
import {TrustBase} from "./TrustBase.sol";

/// @notice The end dispute's rules inside the EVM (issue 78, docs/FRAUD_PROOF.md "The claim's end"): who fixes a
/// run's plain end rule and when (`setEndRule`); `challengeEnd` refused without it; `proveEnd` on a claim bound
/// to two committed rounds (one tensor of two elements, one chunk): honest raw and quant answers taken, one ulp
/// or one code off refused, the width fixed by the first answer, the clock's last block taken and the next
/// refused; and the relation `proveEnd` decides an element by (`StepProverMath.endHolds`, `rne`), fuzzed against
/// a reference. tests/test_forge_invariants.py runs them; tests/test_step_end.py plays the game with the node's
/// own trees on py-evm and anvil.
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

    // ------------------------------------------------------------------------------------- challengeEnd

    bytes32 internal constant PROGRAM_ROOT = keccak256("program");

    /// @dev What a claim is made on: the run's origin root (setProgram), the committed start (round 0's stage
    /// leaf's weightsRoot), the claim's end state root and the payload root round 1 lists.
    struct Trees {
        bytes32 origin;
        bytes32 startWeights;
        bytes32 endRoot;
        bytes32 payload;
    }

    function _anyTrees() internal pure returns (Trees memory) {
        return Trees(keccak256("o"), keccak256("start weights"), keccak256("E"), keccak256("payload"));
    }

    /// @dev Version-3 factors listing one contribution, `payload` (no declared steps: the run's H counts).
    function _factorsListing(bytes32 payload) internal pure returns (bytes memory) {
        bytes32[] memory roots = new bytes32[](1);
        roots[0] = payload;
        return abi.encode(
            uint32(0), uint32(0), false, roots, roots, new uint64[](1), uint64(0), new uint32[](0), roots,
            new uint256[](3), new address[](1), new bytes32[](2)
        );
    }

    function _stageLeafOf(bytes32 weights, bytes memory factors) internal pure returns (bytes memory) {
        return abi.encode(uint32(0), uint32(2), weights, keccak256("momentum"), sha256(factors));
    }

    function _leaf(bytes memory leaf) internal pure returns (bytes32) {
        return sha256(abi.encodePacked(bytes1(0x00), leaf));
    }

    function _commit(uint256 run, bytes memory stageLeaf) internal returns (TrainingLedger.Record memory record) {
        record = TrainingLedger.Record(
            run, ledger.commitCount(run), ledger.headOf(run), _leaf(stageLeaf), keccak256("c"), 1, 1, 1, 1, 0
        );
        uint256[] memory keys = new uint256[](2);
        keys[0] = 1;
        keys[1] = 2;
        vm.prank(who(1));
        ledger.commitRound(record, signAll(keys, recordDigest(ledger, record)));
        vm.roll(block.number + 1);
    }

    function _claimed(bool endRule) internal returns (uint256 run, bytes32 claimId) {
        return _claimed(endRule, _anyTrees());
    }

    /// @dev A run (its program set, of one state tensor; its plain end rule if `endRule`) with rounds 0 and 1
    /// committed, round 1 listing `trees.payload` and starting from `trees.startWeights`; outsider 3's run claim
    /// on that contribution, ending at `trees.endRoot`.
    function _claimed(bool endRule, Trees memory trees) internal returns (uint256 run, bytes32 claimId) {
        run = _runWithTwoMembers(string(abi.encode(endRule, trees)));
        StepProver.RunClaim memory claim = StepProver.RunClaim(
            PROGRAM_ROOT, 1, 1, 1, keccak256("S"), trees.endRoot, 10, run, 1, 0, trees.payload, trees.startWeights,
            bytes32(0), address(0)
        );
        vm.startPrank(who(1));
        prover.setProgram(run, keccak256(abi.encode(PROGRAM_ROOT, uint32(1), uint32(1), uint8(1))), trees.origin);
        if (endRule) prover.setEndRule(run, 1);
        vm.stopPrank();
        bytes memory prevLeaf = _stageLeafOf(trees.startWeights, _factorsListing(trees.payload));
        StepProver.RunBinding memory b;
        b.prevRecord = _commit(run, prevLeaf);
        b.prevStageLeaf = prevLeaf;
        b.factors = _factorsListing(trees.payload);
        b.stageLeaf = _stageLeafOf(keccak256("end weights"), b.factors);
        b.record = _commit(run, b.stageLeaf);
        vm.prank(who(3));
        claimId = prover.claimRun{value: BOND}(claim, b);
    }

    function test_challenge_end_is_refused_without_the_end_rule() public {
        (uint256 run, bytes32 claimId) = _claimed(false);
        vm.prank(who(2));
        vm.expectRevert(abi.encodeWithSelector(StepProver.ProverStepEndUnbound.selector, run));
        prover.challengeEnd{value: BOND}(claimId, 0, 0);
        vm.prank(who(2)); // its start is disputed all the same
        prover.challengeStart{value: BOND}(claimId, 0, 0);
    }

    /// @dev The end game's clock: a defender's answer in its clock's last block is taken (judged on its content:
    /// a junk opening is refused as one), the next block's is refused (ProverStepClockOut) and `timeout`
    /// refutes the claim.
    function test_the_end_games_clock_takes_its_last_block_and_refuses_the_next() public {
        (, bytes32 claimId) = _claimed(true);
        vm.prank(who(2));
        vm.expectRevert(abi.encodeWithSelector(StepProver.ProverStepBadElement.selector, uint64(1)));
        prover.challengeEnd{value: BOND}(claimId, 1, 0); // the claim's state has one tensor
        vm.prank(who(2));
        bytes32 gameId = prover.challengeEnd{value: BOND}(claimId, 0, 0);
        uint256 start = block.number;
        StepProver.StartOpening memory junk;
        StepProver.Element memory piece;
        vm.roll(start + WINDOW); // the clock's last block
        vm.expectRevert(StepProver.ProverStepClockRunning.selector);
        prover.timeout(gameId);
        vm.prank(who(3));
        vm.expectRevert(abi.encodeWithSelector(StepProver.ProverStepBadOpening.selector, uint8(3)));
        prover.proveEnd(gameId, junk, piece, 0);
        vm.roll(start + WINDOW + 1);
        vm.prank(who(3));
        vm.expectRevert(StepProver.ProverStepClockOut.selector);
        prover.proveEnd(gameId, junk, piece, 0);
        vm.assertFalse(prover.claimOf(claimId).wrong, "the claim refuted before the timeout");
        prover.timeout(gameId);
        vm.assertTrue(prover.claimOf(claimId).wrong, "the silent defender's claim stands");
    }

    // ------------------------------------------------------------------------------------- proveEnd

    uint32 internal constant S0 = 0x3F800000; // the committed start: 1.0, 0.5
    uint32 internal constant S1 = 0x3F000000;
    uint32 internal constant E0 = 0x3E800000; // the claim's end: 0.25, 0.75
    uint32 internal constant E1 = 0x3F400000;

    /// @dev A two-element tensor's one chunk leaf (u32 tensor 0, u64 offset 0, u64 cols 2, u32 count 2, values).
    function _chunkLeaf(uint32 a, uint32 b) internal pure returns (bytes memory) {
        return abi.encodePacked(uint32(0), uint64(0), uint64(2), uint32(2), a, b);
    }

    /// @dev The end tensor's opening (origin: tensor 0 of 2 elements, chunk 0 of 1; the end state tree of depth 1,
    /// the tensor's root its leaf 0) and the trees a claim on `piece` is made on.
    function _endOpening(bytes memory piece) internal pure returns (StepProver.StartOpening memory o, Trees memory t) {
        o.origin = abi.encode(uint32(0), uint64(2), uint64(0), uint64(1));
        o.state.leaf = _chunkLeaf(E0, E1);
        o.tensorRoot = _leaf(o.state.leaf);
        o.rootPath = new bytes32[](1);
        o.rootPath[0] = keccak256("the other state leaf");
        o.committed.leaf = _chunkLeaf(S0, S1);
        t = Trees(
            _leaf(o.origin), _leaf(o.committed.leaf),
            sha256(abi.encodePacked(bytes1(0x01), sha256(abi.encodePacked(bytes1(0x00), o.tensorRoot)), o.rootPath[0])),
            _leaf(piece)
        );
    }

    function _rawPiece(uint32 v0, uint32 v1) internal pure returns (bytes memory) {
        return abi.encodePacked(bytes1(0x00), uint32(2), v0, v1);
    }

    /// @dev Scale 0.25 for both: S - E = (0.75, -0.25) codes (3, -1) before the clamp.
    function _quantPiece(int16 q0, int16 q1) internal pure returns (bytes memory) {
        return abi.encodePacked(bytes1(0x01), uint32(2), q0, q1, uint32(0x3E800000), uint32(0x3E800000));
    }

    /// @dev Challenger 2's end game on element `elem` of a claim on `piece`, answered by its defender with
    /// `answer` at width `bits` (refused with `refusal` where one is given); the claim's id.
    function _answer(bytes memory piece, bytes memory answer, uint64 elem, uint8 bits, bytes memory refusal)
        internal
        returns (bytes32 claimId)
    {
        (StepProver.StartOpening memory o, Trees memory trees) = _endOpening(piece);
        (, claimId) = _claimed(true, trees);
        vm.prank(who(2));
        bytes32 gameId = prover.challengeEnd{value: BOND}(claimId, 0, elem);
        vm.prank(who(3));
        if (refusal.length != 0) vm.expectRevert(refusal);
        prover.proveEnd(gameId, o, StepProver.Element(answer, new bytes32[](0)), bits);
    }

    function _badOpening(uint8 which) internal pure returns (bytes memory) {
        return abi.encodeWithSelector(StepProver.ProverStepBadOpening.selector, which);
    }

    function test_prove_end_takes_the_honest_raw_element_and_refuses_one_ulp_off() public {
        bytes memory honest = _rawPiece(0x3F400000, 0xBE800000); // 0.75, -0.25
        bytes32 claimId = _answer(honest, honest, 1, 0, "");
        vm.assertFalse(prover.claimOf(claimId).wrong, "the honest raw answer lost");
        bytes memory off = _rawPiece(0x3F400000, 0xBE800001); // -0.25 one ulp off
        _answer(off, off, 1, 0, _badOpening(7));
        _answer(off, off, 0, 0, ""); // its other element is right
        _answer(honest, off, 1, 0, _badOpening(6)); // another piece than the payload's
    }

    function test_prove_end_takes_the_honest_quant_element_refuses_one_off_and_keeps_the_first_width() public {
        bytes memory honest = _quantPiece(1, -1); // 2 bits: 3 clamped to 1, and -1
        bytes32 claimId = _answer(honest, honest, 1, 2, "");
        vm.assertFalse(prover.claimOf(claimId).wrong, "the honest quant answer lost");
        _answer(_quantPiece(1, 0), _quantPiece(1, 0), 1, 2, _badOpening(7)); // -1 coded 0
        _answer(_quantPiece(3, -1), _quantPiece(3, -1), 0, 2, _badOpening(7)); // 3 unclamped at 2 bits
        // The first answer on the tensor fixes its width: 4 bits after 2 refused, where both code -1 the same.
        (StepProver.StartOpening memory o, Trees memory trees) = _endOpening(honest);
        (, claimId) = _claimed(true, trees);
        StepProver.Element memory piece = StepProver.Element(honest, new bytes32[](0));
        vm.prank(who(2));
        bytes32 first = prover.challengeEnd{value: BOND}(claimId, 0, 1);
        vm.prank(who(1));
        bytes32 second = prover.challengeEnd{value: BOND}(claimId, 0, 1);
        vm.startPrank(who(3));
        prover.proveEnd(first, o, piece, 2);
        vm.expectRevert(_badOpening(7));
        prover.proveEnd(second, o, piece, 4);
        vm.stopPrank();
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
