// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {LedgerCore} from "./LedgerCore.sol";
import {TrainingLedger} from "./TrainingLedger.sol";

/// @title LedgerDisputes
/// @notice TrainingLedger's disputes of committed rounds and their verdicts, the overturn of a round on a
/// fraud proof, and equivocation reports. Linked into TrainingLedger and run in its context (DELEGATECALL) on
/// its state; the ledger's functions of the same names (documented there) are its only callers, passing the
/// ledger's EIP-712 domain separator.
library LedgerDisputes {
    /// @notice TrainingLedger.dispute.
    function dispute(
        TrainingLedger.LedgerState storage s,
        bytes32 separator,
        TrainingLedger.Record calldata committed,
        TrainingLedger.Record calldata disputed,
        bytes calldata signature
    ) external {
        uint256 runId = disputed.runId;
        uint64 round = disputed.round;
        TrainingLedger.Run storage run = LedgerCore.existingRun(s, runId);
        bytes32 structHash = _checkDisputedRecord(s, committed, disputed);
        uint64 closedAt = uint64(s.commitBlocks[runId][round]) + run.disputeBlocks;
        if (block.number >= closedAt) revert TrainingLedger.LedgerDisputeWindowClosed(runId, round, closedAt);
        if (msg.value != run.bond) revert TrainingLedger.LedgerBondMismatch(run.bond, msg.value);
        address disputer = LedgerCore.recover(LedgerCore.typedDigest(separator, structHash), signature, 0);
        if (disputer != msg.sender) revert TrainingLedger.LedgerDisputerNotSender(disputer, msg.sender);
        LedgerCore.requireBonded(s, runId, disputer);
        TrainingLedger.Member storage member = s.members[runId][disputer];
        if (
            member.joinRound > round
                || (member.status != TrainingLedger.MemberStatus.Active && member.leftRound <= round)
        ) revert TrainingLedger.LedgerNotInForce(runId, round, disputer);
        if (s.disputed[runId][round][disputer]) revert TrainingLedger.LedgerAlreadyDisputed(runId, round, disputer);

        TrainingLedger.DisputeCase storage case_ = s.disputeCases[runId][round];
        if (case_.status == TrainingLedger.DisputeStatus.None) {
            case_.status = TrainingLedger.DisputeStatus.Open;
            case_.deadline = uint64(block.number) + run.accusationBlocks;
        } else if (case_.status != TrainingLedger.DisputeStatus.Open) {
            revert TrainingLedger.LedgerDisputeNotOpen(runId, round);
        }
        case_.disputers += 1;
        s.disputed[runId][round][disputer] = true;
        s.disputers[runId][round].push(disputer);
        emit TrainingLedger.RoundDisputed(runId, round, disputer, disputed, signature);
    }

    /// @notice TrainingLedger.resolveDispute.
    function resolveDispute(
        TrainingLedger.LedgerState storage s,
        bytes32 separator,
        TrainingLedger.Record calldata committed,
        bool upheld,
        bytes calldata signatures,
        address[] calldata attesters
    ) external {
        uint256 runId = committed.runId;
        uint64 round = committed.round;
        LedgerCore.existingRun(s, runId);
        bytes32 digest = _roundVerdictDigest(s, separator, committed, upheld);
        TrainingLedger.DisputeCase storage case_ = s.disputeCases[runId][round];
        if (case_.status != TrainingLedger.DisputeStatus.Open) revert TrainingLedger.LedgerDisputeNotOpen(runId, round);
        if (block.number >= case_.deadline) revert TrainingLedger.LedgerDisputeExpired(runId, round, case_.deadline);
        if (keccak256(abi.encode(attesters)) != s.attestations[runId][round]) {
            revert TrainingLedger.LedgerNotAttesters(runId, round);
        }
        uint256 committedAt = s.commitBlocks[runId][round];
        // Counted before the commit's block and gone (if gone) after it, so in force when its quorum was counted
        // (a member counted later in that block by a second commit, or one that left in it before the commit,
        // is not: contracts/forge/test/VerdictTiming.t.sol); at least as many as it needed.
        address[] memory signers =
            _roundVerdictSigners(s, runId, uint64(committedAt), digest, signatures, uint32(committedAt >> 64));
        emit TrainingLedger.DisputeResolved(runId, round, upheld, signers);
        _settleDispute(s, runId, round, upheld, attesters);
    }

    /// @notice TrainingLedger.invalidateByProof, once the ledger checked that its prover calls.
    function invalidateByProof(
        TrainingLedger.LedgerState storage s,
        uint256 runId,
        uint64 round,
        address[] calldata attesters,
        address recipient
    ) external returns (uint256 reward) {
        TrainingLedger.Run storage run = LedgerCore.existingRun(s, runId);
        if (run.invalidFrom != 0 && run.invalidFrom <= round + 1) {
            revert TrainingLedger.LedgerRunHalted(runId, run.invalidFrom - 1);
        }
        if (keccak256(abi.encode(attesters)) != s.attestations[runId][round]) {
            revert TrainingLedger.LedgerNotAttesters(runId, round);
        }
        uint256 before = s.slashedTotal;
        _overturn(s, runId, round, attesters);
        // issue 79: the slash is burned whole; the reward, half of it at most, comes from the run's proof fund,
        // which no attester paid into: a coalition proving its own round recovers none of its stakes.
        reward = (s.slashedTotal - before) / 2;
        uint256 fund = s.proofFunds[runId];
        if (reward > fund) reward = fund;
        s.proofFunds[runId] = fund - reward;
        s.proofFundTotal -= reward;
        emit TrainingLedger.ProverRewarded(runId, round, recipient, reward);
        // Last: every effect is done. A prover that refuses the payment leaves it in the fund.
        (bool ok,) = payable(recipient).call{value: reward}("");
        if (!ok) {
            s.proofFunds[runId] += reward;
            s.proofFundTotal += reward;
        }
    }

    /// @notice TrainingLedger.expireDispute.
    function expireDispute(TrainingLedger.LedgerState storage s, uint256 runId, uint64 round) external {
        TrainingLedger.Run storage run = LedgerCore.existingRun(s, runId);
        TrainingLedger.DisputeCase storage case_ = s.disputeCases[runId][round];
        if (case_.status != TrainingLedger.DisputeStatus.Open) revert TrainingLedger.LedgerDisputeNotOpen(runId, round);
        if (block.number < case_.deadline) revert TrainingLedger.LedgerDisputeNotExpired(runId, round, case_.deadline);
        case_.status = TrainingLedger.DisputeStatus.Lapsed;
        emit TrainingLedger.DisputeLapsed(runId, round);
        address[] storage disputers = s.disputers[runId][round];
        uint256 bond = run.bond;
        for (uint256 i = 0; i < disputers.length; ++i) {
            LedgerCore.forfeitBond(s, runId, disputers[i], bond);
        }
    }

    /// @notice TrainingLedger.reportEquivocation.
    function reportEquivocation(
        TrainingLedger.LedgerState storage s,
        bytes32 separator,
        TrainingLedger.Record calldata recordA,
        bytes calldata signatureA,
        TrainingLedger.Record calldata recordB,
        bytes calldata signatureB
    ) external {
        bytes32 hashA = LedgerCore.hashRecord(recordA);
        bytes32 hashB = LedgerCore.hashRecord(recordB);
        if (recordA.runId != recordB.runId || recordA.round != recordB.round || hashA == hashB) {
            revert TrainingLedger.LedgerNotEquivocation(hashA, hashB);
        }
        uint256 runId = recordA.runId;
        LedgerCore.existingRun(s, runId);
        address signerA = LedgerCore.recover(LedgerCore.typedDigest(separator, hashA), signatureA, 0);
        address signerB = LedgerCore.recover(LedgerCore.typedDigest(separator, hashB), signatureB, 1);
        if (signerA != signerB) revert TrainingLedger.LedgerDifferentSigners(signerA, signerB);
        LedgerCore.requireBonded(s, runId, signerA);

        emit TrainingLedger.EquivocationReported(runId, signerA, recordA.round, hashA, hashB, msg.sender);
        LedgerCore.slash(s, runId, signerA);
    }

    /// @dev The EIP-712 digest of a RoundVerdict on `committed`, which must be the record committed for its round.
    function _roundVerdictDigest(
        TrainingLedger.LedgerState storage s,
        bytes32 separator,
        TrainingLedger.Record calldata committed,
        bool upheld
    ) private view returns (bytes32) {
        bytes32 recordHash = LedgerCore.committedHash(s, committed);
        return LedgerCore.typedDigest(
            separator,
            keccak256(
                abi.encode(LedgerCore.ROUND_VERDICT_TYPEHASH, committed.runId, committed.round, recordHash, upheld)
            )
        );
    }

    function _settleDispute(
        TrainingLedger.LedgerState storage s,
        uint256 runId,
        uint64 round,
        bool upheld,
        address[] calldata attesters
    ) private {
        TrainingLedger.DisputeCase storage case_ = s.disputeCases[runId][round];
        if (upheld) {
            case_.status = TrainingLedger.DisputeStatus.Upheld;
            address[] storage disputers = s.disputers[runId][round];
            uint256 bond = s.runs[runId].bond;
            for (uint256 i = 0; i < disputers.length; ++i) {
                LedgerCore.forfeitBond(s, runId, disputers[i], bond);
            }
            return;
        }
        _overturn(s, runId, round, attesters);
    }

    /// @dev Round `round` is wrong: it and every later round are invalid (the run halts), every attester still
    /// holding a stake is slashed and, if its disputes are open, the disputers' bonds are returned.
    function _overturn(TrainingLedger.LedgerState storage s, uint256 runId, uint64 round, address[] calldata attesters)
        private
    {
        TrainingLedger.Run storage run = s.runs[runId];
        TrainingLedger.DisputeCase storage case_ = s.disputeCases[runId][round];
        bool open = case_.status == TrainingLedger.DisputeStatus.Open;
        case_.status = TrainingLedger.DisputeStatus.Overturned;
        if (run.invalidFrom == 0 || round < run.invalidFrom - 1) run.invalidFrom = round + 1;
        emit TrainingLedger.RunHalted(runId, round);
        for (uint256 i = 0; i < attesters.length; ++i) {
            TrainingLedger.MemberStatus status = s.members[runId][attesters[i]].status;
            if (status == TrainingLedger.MemberStatus.Active || status == TrainingLedger.MemberStatus.Unbonding) {
                LedgerCore.slash(s, runId, attesters[i]);
            }
        }
        if (!open) return;
        address[] storage disputers = s.disputers[runId][round];
        uint256 bond = run.bond;
        for (uint256 i = 0; i < disputers.length; ++i) {
            LedgerCore.returnBond(s, runId, disputers[i], bond);
        }
    }

    /// @dev The struct hash of `disputed` once it is shown to differ from the committed record of its round
    /// in a field the replay decides.
    function _checkDisputedRecord(
        TrainingLedger.LedgerState storage s,
        TrainingLedger.Record calldata committed,
        TrainingLedger.Record calldata disputed
    ) private view returns (bytes32 structHash) {
        uint256 runId = disputed.runId;
        uint64 round = disputed.round;
        bytes32 stored = s.recordHashes[runId][round];
        if (stored == bytes32(0)) revert TrainingLedger.LedgerRoundNotCommitted(runId, round);
        if (committed.runId != runId || committed.round != round || LedgerCore.hashRecord(committed) != stored) {
            revert TrainingLedger.LedgerNotCommittedRecord(runId, round);
        }
        structHash = LedgerCore.hashRecord(disputed);
        if (structHash == stored) revert TrainingLedger.LedgerDisputeMatchesCommit(runId, round);
        if (
            disputed.weightsRoot == committed.weightsRoot && disputed.contributionsRoot == committed.contributionsRoot
                && disputed.checkpointHash == committed.checkpointHash
        ) revert TrainingLedger.LedgerDisputeOnlyMetrics(runId, round);
    }

    /// @dev The signers of `signatures` over `digest`, strictly ascending, each counted before `beforeBlock`
    /// and not left before it; at least `quorum` of them.
    function _roundVerdictSigners(
        TrainingLedger.LedgerState storage s,
        uint256 runId,
        uint64 beforeBlock,
        bytes32 digest,
        bytes calldata signatures,
        uint32 quorum
    ) private view returns (address[] memory signers) {
        signers = LedgerCore.recoverAscending(digest, signatures);
        for (uint256 i = 0; i < signers.length; ++i) {
            LedgerCore.requireCountedAt(s, runId, signers[i], beforeBlock);
        }
        if (signers.length < quorum) revert TrainingLedger.LedgerQuorumNotMet(quorum, signers.length);
    }
}
