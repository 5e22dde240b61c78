// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {RewardPool} from "../src/RewardPool.sol";
import {TrainingLedger} from "../src/TrainingLedger.sol";
import {QuirkyToken} from "../src/test/QuirkyToken.sol";
import {PoolRounds} from "./PoolRounds.sol";

/// @notice The reward pool's actors (issue 77) for forge's invariant campaign (PoolInvariants.t.sol), the twin of
/// tests/trust_pool.py: one normed one-stage run of the six founders with two pools, one in ETH and one in a
/// fee-on-transfer QuirkyToken (10%), each paying a fifth of a round to its attesters and the rest to its listed
/// contributions (6 slots). Members commit rounds signed by any quorum, each listing signed contributions
/// (PoolRounds.sol: any account, steps or none, past the slots, forged signatures); blocks pass; attesters,
/// contributors and others (a front-runner copying a claim) claim, at once or later, a paid share again at once;
/// funders top up; anyone sweeps; an attester of the last round is convicted (equivocation) and then claims; a
/// fresh round is overturned (disputed, a quorum's verdict: the run halts, its attesters are slashed) and its
/// credits claimed; and the token, armed, calls its pool back from inside a funder's top-up. What a call sees that
/// breaks R2, R3 or R5 is kept in `violation`; R1 and R4 are read from the pools by the invariant.
contract PoolHandler is PoolRounds {
    uint128 internal constant AMOUNT = 10 ** 15;
    uint16 internal constant FEE_BPS = 1_000;
    uint16 internal constant ATTESTER_BPS = 2_000;
    uint16 internal constant SLOTS = 8; // attester shares
    uint16 internal constant CONTRIBUTION_SLOTS = 6;
    uint256 internal constant INNER_STEPS = 10;
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
    uint256 public contributionsPaid;
    uint256 public contributionsRefused;
    uint256 public forgedRefused;
    uint256 public overturnedRefused;
    uint64 public overturned; // the overturned round + 1 (0: none)

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

    /// @notice The next round committed, signed by the unslashed founders of `mask` (at least four of them), listing
    /// the contributions drawn from `listSeed` (PoolRounds.sol).
    function commit(uint256 mask, uint256 listSeed) public returns (bool) {
        uint256[] memory alive = _unslashed();
        uint256 n;
        for (uint256 i = 0; i < alive.length; ++i) if (mask >> i & 1 == 1 || i < 4) ++n;
        if (n == 0) return false; // every founder convicted
        uint256[] memory signers = new uint256[](n);
        n = 0;
        for (uint256 i = 0; i < alive.length; ++i) if (mask >> i & 1 == 1 || i < 4) signers[n++] = alive[i];
        uint64 round = commits;
        (, bytes memory leaf) = _drawListing(ledger, runId, round, listSeed);
        TrainingLedger.Record memory record = _record(round, _leafHash(leaf));
        vm.prank(who(signers[0]));
        try ledger.commitRound(record, signAll(signers, recordDigest(ledger, record))) {
            _records[round] = record;
            _attesters[round] = _addresses(signers);
            ++commits;
            return true;
        } catch {
            return false;
        }
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
            if (amount != uint256(AMOUNT) * ATTESTER_BPS / 10_000 / slots) {
                _violation("R2: an attestation paid another amount than its share");
            }
            if (overturned != 0 && round + 1 >= overturned) _violation("R2: an overturned round's attestation paid");
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
            if (overturned != 0 && round + 1 >= overturned) ++overturnedRefused;
        }
    }

    /// @dev One contribution claim as the handler drew it, and what the chain said before it.
    struct Draw {
        uint256 p;
        uint64 round;
        uint256 index;
        address claimer;
        bool slashed;
        bool wasFinal;
        bytes32 key;
    }

    /// @notice Contribution `index` of round `roundSeed`'s listing claimed by its listed account or (one call in
    /// four) another (a front-runner copying the claim; a forged entry's real signer), then again at once.
    function claimContribution(uint256 poolSeed, uint256 roundSeed, uint256 index, uint256 claimerSeed) public {
        if (commits == 0) return;
        Draw memory d;
        d.p = poolSeed % 2;
        d.round = uint64(roundSeed % commits);
        Listing storage listing = _listings[d.round];
        if (listing.contributors.length == 0) return;
        d.index = index % listing.contributors.length;
        d.claimer = claimerSeed % 4 == 0 ? who(1 + claimerSeed / 4 % OUTSIDER) : listing.contributors[d.index];
        d.slashed = ledger.memberOf(runId, d.claimer).status == TrainingLedger.MemberStatus.Slashed;
        d.wasFinal = ledger.isFinal(runId, d.round);
        d.key = keccak256(abi.encode(d.p, d.round, "contribution", d.claimer));
        (bool ok, uint256 amount) = _sendContribution(d);
        if (!ok) {
            ++contributionsRefused;
            if (listing.forged[d.index]) ++forgedRefused;
            if (overturned != 0 && d.round + 1 >= overturned) ++overturnedRefused;
            return;
        }
        _checkContribution(d, amount);
        (ok,) = _sendContribution(d);
        if (ok) _violation("R3: a contribution paid twice in a row");
    }

    function _sendContribution(Draw memory d) internal returns (bool, uint256) {
        bytes memory factors = _factorsOf[d.round];
        bytes memory leaf = _leafOf[d.round];
        vm.prank(d.claimer);
        try pools[d.p].claimContribution(_records[d.round], 0, leaf, new bytes32[](0), factors, d.index) returns (
            uint256 amount
        ) {
            return (true, amount);
        } catch {
            return (false, 0);
        }
    }

    /// @dev What a paid contribution claim must have been (R2, R3), and its payment counted.
    function _checkContribution(Draw memory d, uint256 amount) internal {
        Listing storage listing = _listings[d.round];
        if (d.claimer != listing.contributors[d.index]) _violation("R2: a contribution paid an account not listed");
        if (listing.forged[d.index]) _violation("R2: a contribution paid on a signature not its account's");
        if (d.slashed) _violation("R2: a contribution paid a convicted member");
        if (overturned != 0 && d.round + 1 >= overturned) _violation("R2: an overturned round's contribution paid");
        if (!d.wasFinal && !ledger.isFinal(runId, d.round)) _violation("R2: a contribution paid before final");
        if (_paid[d.key]) _violation("R3: a contribution paid twice");
        uint256 budget = uint256(AMOUNT) * (10_000 - ATTESTER_BPS) / 10_000;
        if (amount != _contributionShare(d.round, d.index, budget, CONTRIBUTION_SLOTS, INNER_STEPS)) {
            _violation("R2: a contribution paid another amount than its share");
        }
        _paid[d.key] = true;
        paid[d.p] += amount;
        paidOfRound[d.p][d.round] += amount;
        ++contributionsPaid;
    }

    /// @notice A fresh round committed and overturned at once (one call in four, once six rounds stand: it halts the
    /// run, so not before the pools had rounds to pay): a founder
    /// disputes it with its own record and a quorum of the unslashed founders' verdict overturns it, slashing its
    /// attesters and halting the run; then its contributions and an attestation are claimed (all refused).
    function overturn(uint256 seed) external {
        if (seed % 4 != 0 || commits < 6 || overturned != 0) return;
        if (!commit(seed >> 8, seed >> 16)) return;
        uint64 round = commits - 1;
        TrainingLedger.Record memory committed = _records[round];
        TrainingLedger.Record memory disputed = _records[round]; // a copy (memory to memory would alias)
        disputed.weightsRoot = keccak256(abi.encode("disputed", round));
        uint256[] memory alive = _unslashed();
        if (alive.length < ledger.commitQuorumOf(runId, round)) return;
        vm.prank(who(alive[0]));
        ledger.dispute{value: BOND}(committed, disputed, sign(alive[0], recordDigest(ledger, disputed)));
        ledger.resolveDispute(
            committed, false, signAll(alive, roundVerdictDigest(ledger, committed, false)), _attesters[round]
        );
        overturned = round + 1;
        if (_listings[round].contributors.length != 0) this.claimContribution(seed, round, seed >> 4, 1);
        this.claim(seed >> 1, round, seed >> 2, 1);
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
