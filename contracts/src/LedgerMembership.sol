// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {LedgerCore} from "./LedgerCore.sol";
import {NodeRegistry} from "./NodeRegistry.sol";
import {TrainingLedger} from "./TrainingLedger.sol";

/// @title LedgerMembership
/// @notice TrainingLedger's runs and seats: creating a run, joining, leaving, ejecting a silent member and
/// withdrawing a stake. Linked into TrainingLedger and run in its context (DELEGATECALL) on its state; the
/// ledger's functions of the same names (documented there) are its only callers.
library LedgerMembership {
    /// @notice TrainingLedger.createRun.
    function createRun(
        TrainingLedger.LedgerState storage s,
        TrainingLedger.RunParams calldata params,
        string calldata configUri
    ) external returns (uint256 runId) {
        _checkParams(params);
        runId = ++s.runCount;
        bytes32 genesis = keccak256(abi.encode(block.chainid, address(this), runId, params.configHash));
        TrainingLedger.Run storage run = s.runs[runId];
        run.maxRounds = params.maxRounds;
        run.quorum = params.quorum;
        run.quorumBps = params.quorumBps;
        run.headHash = genesis;
        run.creator = msg.sender;
        run.numStages = params.numStages;
        run.innerSteps = params.innerSteps;
        run.inactivityRounds = params.inactivityRounds;
        run.tenureRounds = params.tenureRounds;
        run.unbondingBlocks = params.unbondingBlocks;
        run.accusationBlocks = params.accusationBlocks;
        run.disputeBlocks = params.disputeBlocks;
        run.commitments = params.commitments;
        run.minStake = params.minStake;
        run.bond = params.bond;
        run.configHash = params.configHash;
        if (params.commitments > 1) _storeValues(s.values[runId], params);
        run.maxGameSteps = params.maxGameSteps;
        emit TrainingLedger.RunCreated(runId, msg.sender, params, genesis, configUri);
    }

    /// @notice TrainingLedger.joinRun, with the ledger's registry.
    function joinRun(TrainingLedger.LedgerState storage s, NodeRegistry registry, uint256 runId, bytes32 platform)
        external
    {
        TrainingLedger.Run storage run = LedgerCore.existingRun(s, runId);
        bytes32 nodeKey = registry.keyOf(msg.sender);
        if (nodeKey == bytes32(0)) revert TrainingLedger.LedgerNotRegistered(msg.sender);
        if (msg.value < run.minStake) revert TrainingLedger.LedgerStakeTooLow(run.minStake, msg.value);
        TrainingLedger.Member storage member = s.members[runId][msg.sender];
        if (member.status == TrainingLedger.MemberStatus.Slashed) {
            revert TrainingLedger.LedgerMemberSlashed(runId, msg.sender);
        }
        if (member.status != TrainingLedger.MemberStatus.None) {
            revert TrainingLedger.LedgerAlreadyMember(runId, msg.sender);
        }

        // issue 79 (point 4): a round's attesters are Active members, and a proof slashes each of them; the cap
        // keeps the largest quorum's proof inside a block (LedgerCore.PROOF_SEATS_GAS).
        if (run.memberCount >= LedgerCore.MAX_SEATS) revert TrainingLedger.LedgerRunFull(runId, LedgerCore.MAX_SEATS);
        uint64 round = run.commitCount;
        member.nodeKey = nodeKey;
        member.stake = uint128(msg.value);
        member.activeRound = round;
        member.status = TrainingLedger.MemberStatus.Active;
        member.joinRound = round;
        member.joinBlock = uint64(block.number);
        run.memberCount += 1;
        emit TrainingLedger.MemberJoined(runId, msg.sender, nodeKey, msg.value, platform);
        // Founders (joined before the first commit) count at once; a later joiner once a commit or its own
        // attest credits it with a round at least tenureRounds after it joined (see LedgerCore.credit).
        if (round == 0) LedgerCore.count(runId, run, member, msg.sender);
    }

    /// @notice TrainingLedger.leaveRun.
    function leaveRun(TrainingLedger.LedgerState storage s, uint256 runId) external {
        TrainingLedger.Run storage run = LedgerCore.existingRun(s, runId);
        TrainingLedger.Member storage member = s.members[runId][msg.sender];
        if (member.status != TrainingLedger.MemberStatus.Active) {
            revert TrainingLedger.LedgerNotMember(runId, msg.sender);
        }
        LedgerCore.leaveRun(runId, run, member, msg.sender);
    }

    /// @notice TrainingLedger.ejectInactive.
    function ejectInactive(TrainingLedger.LedgerState storage s, uint256 runId, address account) external {
        TrainingLedger.Run storage run = LedgerCore.existingRun(s, runId);
        TrainingLedger.Member storage member = s.members[runId][account];
        if (member.status != TrainingLedger.MemberStatus.Active) revert TrainingLedger.LedgerNotMember(runId, account);
        uint64 missed = run.commitCount - member.activeRound;
        if (missed < run.inactivityRounds) {
            revert TrainingLedger.LedgerMemberNotInactive(runId, account, missed, run.inactivityRounds);
        }
        emit TrainingLedger.MemberEjected(runId, account, msg.sender, missed);
        LedgerCore.leaveRun(runId, run, member, account);
    }

    /// @notice TrainingLedger.withdrawStake.
    function withdrawStake(TrainingLedger.LedgerState storage s, uint256 runId) external {
        TrainingLedger.Run storage run = LedgerCore.existingRun(s, runId);
        TrainingLedger.Member storage member = s.members[runId][msg.sender];
        if (member.status != TrainingLedger.MemberStatus.Unbonding) {
            revert TrainingLedger.LedgerNotUnbonding(runId, msg.sender);
        }
        if (block.number < member.unbondingEnd) {
            revert TrainingLedger.LedgerStillUnbonding(runId, msg.sender, member.unbondingEnd);
        }
        if (member.openAccusations > 0) {
            revert TrainingLedger.LedgerAccusationPending(runId, msg.sender, member.openAccusations);
        }
        uint256 stake = member.stake;

        // Effects before the refund call, so a re-entrant call finds the seat already gone. The seat's rounds
        // stay on record (issue 79): a contribution it signed while its stake was held stays bound to it.
        uint64 joinRound = member.joinRound;
        delete s.members[runId][msg.sender];
        member.pastJoinRound = joinRound;
        member.pastUntil = run.commitCount + 1;
        emit TrainingLedger.StakeWithdrawn(runId, msg.sender, stake);

        if (stake > 0) {
            (bool ok,) = payable(msg.sender).call{value: stake}("");
            if (!ok) revert TrainingLedger.LedgerRefundFailed(msg.sender, stake);
        }
    }

    function _checkParams(TrainingLedger.RunParams calldata params) private pure {
        if (params.configHash == bytes32(0)) revert TrainingLedger.LedgerZeroHash();
        if (params.numStages == 0 || params.innerSteps == 0) {
            revert TrainingLedger.LedgerBadRunShape(params.numStages, params.innerSteps);
        }
        if (params.quorum == 0 || params.quorumBps > LedgerCore.BPS) {
            revert TrainingLedger.LedgerBadQuorum(params.quorum, params.quorumBps);
        }
        if (params.inactivityRounds == 0) revert TrainingLedger.LedgerBadInactivityRounds(params.inactivityRounds);
        if (params.tenureRounds == 0) revert TrainingLedger.LedgerBadTenure(params.tenureRounds);
        if (params.commitments == 0 || params.commitments > 3) {
            revert TrainingLedger.LedgerBadCommitments(params.commitments);
        }
        uint64 accusationBlocks = params.accusationBlocks;
        uint64 disputeBlocks = params.disputeBlocks;
        uint64 minimum = LedgerCore.MIN_WINDOW_BLOCKS;
        uint64 maximum = LedgerCore.MAX_UNBONDING_BLOCKS;
        if (
            accusationBlocks < minimum || disputeBlocks < minimum || accusationBlocks > maximum
                || disputeBlocks > maximum
        ) revert TrainingLedger.LedgerBadWindow(accusationBlocks, disputeBlocks, minimum, maximum);
        // Both windows are at most 2^32: the sum cannot overflow.
        uint64 floor = accusationBlocks + disputeBlocks;
        if (params.unbondingBlocks < floor) {
            revert TrainingLedger.LedgerUnbondingTooShort(params.unbondingBlocks, floor);
        }
        if (params.unbondingBlocks > maximum) {
            revert TrainingLedger.LedgerUnbondingTooLong(params.unbondingBlocks, maximum);
        }
        // A stake outlives every proof of a round its member attested: a coalition that leaves at once and
        // withdraws after unbonding is still there to slash (issue 62).
        if (params.maxGameSteps == 0) revert TrainingLedger.LedgerBadGameSteps(params.maxGameSteps);
        uint64 window = LedgerCore.proofWindowBound(disputeBlocks, accusationBlocks, params.maxGameSteps);
        if (params.unbondingBlocks < window) {
            revert TrainingLedger.LedgerUnbondingBelowProofWindow(params.unbondingBlocks, window);
        }
        if (params.commitments > 1) _checkValues(params);
    }

    /// @dev A fraud-provable run's per-round values (issue 62): at least one contribution, a rank in 1 .. 64, a
    /// norm clip of 0 or in [1, inf), and no proof of any kind past PROOF_MAX_GAS or PROOF_MAX_CALLDATA at the
    /// run's bounds (LedgerCore.proofCost: a conservative formula, bench/results/fraud_proof_bounds.json).
    function _checkValues(TrainingLedger.RunParams calldata params) private pure {
        uint64 clip = params.normClipBits;
        if (
            params.maxContributions == 0 || params.maxRank == 0 || params.maxRank > LedgerCore.MAX_RANK
                || (clip != 0 && (clip < 0x3FF0000000000000 || clip >= 0x7FF0000000000000))
        ) revert TrainingLedger.LedgerBadRunValues(params.maxContributions, params.maxRank, clip);
        (uint256 gas, uint256 bytes_) = LedgerCore.proofCost(params.maxContributions, params.maxRank);
        if (gas > LedgerCore.PROOF_MAX_GAS || bytes_ > LedgerCore.PROOF_MAX_CALLDATA) {
            revert TrainingLedger.LedgerProofTooCostly(
                gas, bytes_, LedgerCore.PROOF_MAX_GAS, LedgerCore.PROOF_MAX_CALLDATA
            );
        }
    }

    function _storeValues(TrainingLedger.RunValues storage values, TrainingLedger.RunParams calldata params) private {
        values.scheduleRoot = params.scheduleRoot;
        values.genesisRoot = params.genesisRoot;
        values.scheduleRounds = params.scheduleRounds;
        values.normClipBits = params.normClipBits;
        values.maxContributions = params.maxContributions;
        values.maxRank = params.maxRank;
        values.nesterov = params.nesterov;
    }
}
