// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {RewardPool} from "../src/RewardPool.sol";
import {TrainingLedger} from "../src/TrainingLedger.sol";
import {QuirkyToken} from "../src/test/QuirkyToken.sol";
import {TrustBase} from "./TrustBase.sol";

/// @notice The reward pool's actors (issue 77) for forge's invariant campaign (PoolInvariants.t.sol), the twin of
/// tests/trust_pool.py: one run of the six founders with two pools, one in ETH and one in a fee-on-transfer
/// QuirkyToken (10%), attesters only (a version-3 contribution's factors are not built here: the hypothesis
/// machines claim contributions). Members commit rounds signed by any quorum, blocks pass, attesters and others
/// claim (at once or later, a paid share again at once), funders top up, anyone sweeps, an attester of the last
/// round is convicted (equivocation) and then claims, and the token, armed, calls its pool back from inside a
/// funder's top-up. What a call sees that breaks R2, R3 or R5 is kept in `violation`; R1 and R4 are read from
/// the pools by the invariant.
contract PoolHandler is TrustBase {
    uint128 internal constant AMOUNT = 10 ** 15;
    uint16 internal constant FEE_BPS = 1_000;
    uint16 internal constant SLOTS = 8;
    uint256 internal constant FOUNDERS = 6;

    TrainingLedger public immutable ledger;
    uint256 public immutable runId;
    RewardPool[2] public pools; // 0: ETH, 1: the token's
    QuirkyToken public immutable token;

    uint256[2] public funded; // what arrived, per pool
    uint256[2] public paid; // what its claims paid, per pool
    mapping(uint256 pool => mapping(uint64 round => uint256)) public paidOfRound;
    mapping(bytes32 key => bool) internal _paid;
    mapping(uint64 round => address[]) internal _attesters;
    mapping(uint64 round => TrainingLedger.Record) internal _records;
    uint64 public commits;
    string public violation;
    uint256 public claimsPaid;
    uint256 public claimsRefused;
    uint256 public convictedRefused;
    uint256 public reentriesRefused;
    uint256 public convictions;

    constructor(TrainingLedger ledger_, uint256 runId_, RewardPool ethPool, RewardPool tokenPool, QuirkyToken token_) {
        _castAddresses();
        ledger = ledger_;
        runId = runId_;
        pools[0] = ethPool;
        pools[1] = tokenPool;
        token = token_;
        funded[0] = ethPool.poolOf(runId_).funded;
        funded[1] = tokenPool.poolOf(runId_).funded;
    }

    function _violation(string memory what) internal {
        if (bytes(violation).length == 0) violation = what;
    }

    function _slashed(uint256 key) internal view returns (bool) {
        return ledger.memberOf(runId, who(key)).status == TrainingLedger.MemberStatus.Slashed;
    }

    function _unslashed() internal view returns (uint256[] memory out) {
        uint256 n;
        for (uint256 key = 1; key <= FOUNDERS; ++key) if (!_slashed(key)) ++n;
        out = new uint256[](n);
        n = 0;
        for (uint256 key = 1; key <= FOUNDERS; ++key) if (!_slashed(key)) out[n++] = key;
    }

    function _record(uint64 round, bytes32 weights) internal view returns (TrainingLedger.Record memory) {
        return TrainingLedger.Record({
            runId: runId,
            round: round,
            prevHead: ledger.headOf(runId),
            weightsRoot: weights,
            contributionsRoot: keccak256(abi.encode("contributions", round)),
            trainLossMicro: 3_000_000,
            evalLossMicro: 3_100_000,
            tokens: 4096,
            numContributors: 4,
            checkpointHash: bytes32(0)
        });
    }

    // ------------------------------------------------------------------------------------------- actors

    /// @notice The next round committed, signed by the unslashed founders of `mask` (at least four of them).
    function commit(uint256 mask) external {
        uint256[] memory alive = _unslashed();
        uint256 n;
        for (uint256 i = 0; i < alive.length; ++i) if (mask >> i & 1 == 1 || i < 4) ++n;
        uint256[] memory signers = new uint256[](n);
        n = 0;
        for (uint256 i = 0; i < alive.length; ++i) if (mask >> i & 1 == 1 || i < 4) signers[n++] = alive[i];
        uint64 round = commits;
        TrainingLedger.Record memory record = _record(round, keccak256(abi.encode("weights", round)));
        vm.prank(who(signers[0]));
        try ledger.commitRound(record, signAll(signers, recordDigest(ledger, record))) {
            _records[round] = record;
            _attesters[round] = _addresses(signers);
            ++commits;
        } catch {}
    }

    function blocksPass(uint256 blocks) external {
        vm.roll(block.number + 1 + blocks % 40);
    }

    /// @notice Attester `index` of round `roundSeed`'s (or another account, one call in four) claims its share.
    function claim(uint256 poolSeed, uint256 roundSeed, uint256 index, uint256 claimerSeed) external {
        if (commits == 0) return;
        uint256 p = poolSeed % 2;
        uint64 round = uint64(roundSeed % commits);
        address[] memory attesters = _attesters[round];
        index %= attesters.length;
        address claimer = claimerSeed % 4 == 0 ? who(1 + claimerSeed / 4 % OUTSIDER) : attesters[index];
        bool slashed = ledger.memberOf(runId, claimer).status == TrainingLedger.MemberStatus.Slashed;
        bool wasFinal = ledger.isFinal(runId, round);
        bytes32 key = keccak256(abi.encode(p, round, claimer));
        vm.prank(claimer);
        try pools[p].claimAttestation(runId, round, attesters, index) returns (uint256 amount) {
            if (claimer != attesters[index]) _violation("R2: an attestation paid an account not listed");
            if (slashed) _violation("R2: an attestation paid a convicted member");
            if (!wasFinal && !ledger.isFinal(runId, round)) _violation("R2: an attestation paid before final");
            if (_paid[key]) _violation("R3: an attestation paid twice");
            uint256 slots = attesters.length > SLOTS ? attesters.length : SLOTS;
            if (amount != AMOUNT / slots) _violation("R2: an attestation paid another amount than its share");
            _paid[key] = true;
            paid[p] += amount;
            paidOfRound[p][round] += amount;
            ++claimsPaid;
            vm.prank(claimer);
            try pools[p].claimAttestation(runId, round, attesters, index) {
                _violation("R3: an attestation paid twice in a row");
            } catch {}
        } catch {
            ++claimsRefused;
            if (slashed) ++convictedRefused;
        }
    }

    /// @notice A funder (an outsider, a joiner's key or a founder) tops pool `poolSeed` up.
    function fund(uint256 poolSeed, uint256 amountSeed, uint256 funderSeed) external {
        _fund(poolSeed % 2, [uint256(1), AMOUNT / 3, AMOUNT][amountSeed % 3], who(1 + funderSeed % OUTSIDER));
    }

    function _fund(uint256 p, uint256 amount, address funder) internal {
        if (p == 0) {
            vm.prank(funder);
            pools[0].fund{value: amount}(runId, amount);
            funded[0] += amount;
            return;
        }
        token.mint(funder, amount);
        vm.prank(funder);
        token.approve(address(pools[1]), amount);
        vm.prank(funder);
        pools[1].fund(runId, amount);
        funded[1] += amount - amount * FEE_BPS / 10_000;
    }

    /// @notice The token, armed, calls its pool back (fund, claimAttestation, open, sweep) from inside a top-up.
    function tokenReenters(uint256 callSeed) external {
        uint256 which = callSeed % 4;
        bytes memory data;
        if (which == 0) data = abi.encodeCall(RewardPool.fund, (runId, AMOUNT));
        else if (which == 1) data = abi.encodeCall(RewardPool.claimAttestation, (runId, 0, new address[](0), 0));
        else if (which == 2) data = abi.encodeCall(RewardPool.open, (runId, 0));
        else data = abi.encodeCall(RewardPool.sweep, (runId, 0));
        token.arm(address(pools[1]), data);
        _fund(1, AMOUNT, who(OUTSIDER));
        (, bool reentered, bool ok, bytes memory returned) = token.outcome();
        if (!reentered) _violation("R5: the armed token did not re-enter");
        if (ok) _violation("R5: the token's call into its pool from inside a transfer succeeded");
        if (returned.length < 4 || bytes4(returned) != RewardPool.RewardReentered.selector) {
            _violation("R5: the token's call refused for another reason than RewardReentered");
        }
        ++reentriesRefused;
    }

    function sweep(uint256 poolSeed, uint256 roundSeed) external {
        RewardPool pool = pools[poolSeed % 2];
        RewardPool.Pool memory view_ = pool.poolOf(runId);
        if (view_.nextRound <= view_.firstRound) return;
        uint64 round = view_.firstRound + uint64(roundSeed % (view_.nextRound - view_.firstRound));
        vm.prank(who(OUTSIDER));
        try pool.sweep(runId, round) {} catch {}
    }

    /// @notice An attester of the last round signs another record for it: convicted (two founders at most, so a
    /// quorum of four stays), then claims an attestation of its own.
    function convict(uint256 seed, uint256 poolSeed) external {
        if (commits == 0 || convictions >= 2) return;
        uint64 round = commits - 1;
        address[] memory attesters = _attesters[round];
        uint256 index = seed % attesters.length;
        uint256 key;
        for (uint256 k = 1; k <= FOUNDERS; ++k) if (who(k) == attesters[index]) key = k;
        if (key == 0 || _slashed(key)) return;
        TrainingLedger.Record memory other = _record(round, keccak256(abi.encode("other", round)));
        other.prevHead = _records[round].prevHead;
        vm.prank(who(OUTSIDER));
        try ledger.reportEquivocation(_records[round], sign(key, recordDigest(ledger, _records[round])), other,
                                      sign(key, recordDigest(ledger, other))) {
            ++convictions;
        } catch {
            return;
        }
        this.claim(poolSeed, round, index, 1);
    }
}
