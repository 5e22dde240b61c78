// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {LedgerCore} from "./LedgerCore.sol";
import {TrainingLedger} from "./TrainingLedger.sol";

/// @title LedgerAccusations
/// @notice TrainingLedger's accusations of members and their verdicts. Linked into TrainingLedger and run in
/// its context (DELEGATECALL) on its state; the ledger's functions of the same names (documented there) are
/// its only callers, passing the ledger's EIP-712 domain separator.
library LedgerAccusations {
    /// @notice TrainingLedger.accuse.
    function accuse(TrainingLedger.LedgerState storage s, uint256 runId, address accused, bytes32 evidenceHash)
        external
    {
        TrainingLedger.Run storage run = LedgerCore.existingRun(s, runId);
        if (s.members[runId][msg.sender].status != TrainingLedger.MemberStatus.Active) {
            revert TrainingLedger.LedgerNotMember(runId, msg.sender);
        }
        if (evidenceHash == bytes32(0)) revert TrainingLedger.LedgerZeroHash();
        if (msg.value != run.bond) revert TrainingLedger.LedgerBondMismatch(run.bond, msg.value);
        LedgerCore.requireBonded(s, runId, accused);
        TrainingLedger.Member storage member = s.members[runId][accused];
        // An unbonding member can be accused only until its unbonding ends: its stake is locked at most one
        // accusation deadline past that, whatever an accuser pays in bonds.
        if (member.status == TrainingLedger.MemberStatus.Unbonding && block.number >= member.unbondingEnd) {
            revert TrainingLedger.LedgerAccusationTooLate(runId, accused, member.unbondingEnd);
        }
        TrainingLedger.Accusation storage accusation = s.accusations[runId][accused][evidenceHash];
        if (accusation.status != TrainingLedger.AccusationStatus.None) {
            revert TrainingLedger.LedgerAccusationExists(runId, accused, evidenceHash);
        }

        // Over every counted member, the accused included (its own signature never counts): with the accused
        // left out of the count, a coalition just below the fraction (2 of 5 at one half) would be a quorum.
        uint32 quorum = LedgerCore.quorum(run.quorum, run.quorumBps, run.countedCount);
        uint64 deadline = uint64(block.number) + run.accusationBlocks;
        accusation.status = TrainingLedger.AccusationStatus.Open;
        accusation.accuser = msg.sender;
        accusation.openedBlock = uint64(block.number);
        accusation.deadline = deadline;
        accusation.quorum = quorum;
        accusation.bond = uint128(msg.value);
        member.openAccusations += 1;
        emit TrainingLedger.AccusationOpened(runId, accused, msg.sender, evidenceHash, msg.value, deadline, quorum);
    }

    /// @notice TrainingLedger.resolveAccusation.
    function resolveAccusation(
        TrainingLedger.LedgerState storage s,
        bytes32 separator,
        TrainingLedger.Verdict calldata verdict,
        bytes calldata signatures
    ) external {
        uint256 runId = verdict.runId;
        LedgerCore.existingRun(s, runId);
        address accused = verdict.accused;
        TrainingLedger.Accusation storage accusation = _openAccusation(s, runId, accused, verdict.evidenceHash);
        if (block.number >= accusation.deadline) {
            revert TrainingLedger.LedgerAccusationExpired(runId, accused, verdict.evidenceHash, accusation.deadline);
        }
        bytes32 structHash = keccak256(
            abi.encode(LedgerCore.VERDICT_TYPEHASH, runId, accused, verdict.evidenceHash, verdict.guilty)
        );
        address[] memory signers =
            _verdictSigners(s, runId, accusation, accused, LedgerCore.typedDigest(separator, structHash), signatures);

        accusation.status =
            verdict.guilty ? TrainingLedger.AccusationStatus.Guilty : TrainingLedger.AccusationStatus.Cleared;
        TrainingLedger.Member storage member = s.members[runId][accused];
        member.openAccusations -= 1;
        emit TrainingLedger.AccusationResolved(runId, accused, verdict.evidenceHash, verdict.guilty, signers);
        if (verdict.guilty && member.status != TrainingLedger.MemberStatus.Slashed) LedgerCore.slash(s, runId, accused);
        if (verdict.guilty) {
            LedgerCore.returnBond(s, runId, accusation.accuser, accusation.bond);
        } else {
            LedgerCore.forfeitBond(s, runId, accusation.accuser, accusation.bond);
        }
    }

    /// @notice TrainingLedger.expireAccusation.
    function expireAccusation(
        TrainingLedger.LedgerState storage s,
        uint256 runId,
        address accused,
        bytes32 evidenceHash
    ) external {
        LedgerCore.existingRun(s, runId);
        TrainingLedger.Accusation storage accusation = _openAccusation(s, runId, accused, evidenceHash);
        if (block.number < accusation.deadline) {
            revert TrainingLedger.LedgerAccusationNotExpired(runId, accused, evidenceHash, accusation.deadline);
        }
        accusation.status = TrainingLedger.AccusationStatus.Expired;
        s.members[runId][accused].openAccusations -= 1;
        emit TrainingLedger.AccusationExpired(runId, accused, evidenceHash);
        LedgerCore.forfeitBond(s, runId, accusation.accuser, accusation.bond);
    }

    function _openAccusation(TrainingLedger.LedgerState storage s, uint256 runId, address accused, bytes32 evidenceHash)
        private
        view
        returns (TrainingLedger.Accusation storage accusation)
    {
        accusation = s.accusations[runId][accused][evidenceHash];
        if (accusation.status != TrainingLedger.AccusationStatus.Open) {
            revert TrainingLedger.LedgerAccusationNotOpen(runId, accused, evidenceHash);
        }
    }

    /// @dev `signer` was counted before the accusation's block and had not left by it: a seat that left in that
    /// block is not in force either, since it may have left before the accusation opened and its quorum was then
    /// counted without it (a coalition one seat short of that quorum would leave a seat and sign with it too;
    /// found by the forge invariant campaign, contracts/forge): LedgerCore.requireCountedAt.
    function _requireInForce(TrainingLedger.LedgerState storage s, uint256 runId, address signer, uint64 openedBlock)
        private
        view
    {
        LedgerCore.requireCountedAt(s, runId, signer, openedBlock);
    }

    /// @dev The signers of `signatures` over `digest`, strictly ascending; each but `accused` a member counted
    /// before the accusation's block and, if it left, left after that block (slashed and withdrawn
    /// accounts are not members); at least the accusation's quorum of them. Returns the counted signers
    /// (`accused` left out).
    function _verdictSigners(
        TrainingLedger.LedgerState storage s,
        uint256 runId,
        TrainingLedger.Accusation storage accusation,
        address accused,
        bytes32 digest,
        bytes calldata signatures
    ) private view returns (address[] memory signers) {
        uint256 count = LedgerCore.signatureCount(signatures);
        signers = new address[](count);
        uint256 counted = 0;
        address previous = address(0);
        uint256 size = LedgerCore.SIGNATURE_LENGTH;
        for (uint256 i = 0; i < count; ++i) {
            address signer = LedgerCore.recover(digest, signatures[i * size:(i + 1) * size], i);
            if (signer <= previous) revert TrainingLedger.LedgerSignersNotAscending(previous, signer);
            previous = signer;
            if (signer == accused) continue; // present but not counted, whatever its seat
            _requireInForce(s, runId, signer, accusation.openedBlock);
            signers[counted++] = signer;
        }
        if (counted < accusation.quorum) revert TrainingLedger.LedgerQuorumNotMet(accusation.quorum, counted);
        assembly ("memory-safe") {
            mstore(signers, counted)
        }
    }
}
