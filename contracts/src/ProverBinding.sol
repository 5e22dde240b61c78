// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {AggregationProver} from "./AggregationProver.sol";
import {LedgerCore} from "./LedgerCore.sol";
import {ProverCommon} from "./ProverCommon.sol";
import {TrainingLedger} from "./TrainingLedger.sol";

/// @title ProverBinding
/// @notice Every contribution a version-3 round lists is bound to a member (issue 62; docs/FRAUD_PROOF.md, "The
/// binding"): its contributor signed, with its member account's key, the EIP-712 message `Contribution` (domain:
/// the ledger) over the run, round, stage, payload root, norm root and declared steps, and the factors carry the
/// contributor's address and signature. A round is wrong if it lists more than `maxContributions`, if a signature
/// does not recover to its listed contributor, if one contributor is listed twice, or (until `unbondingBlocks` after
/// the round's commit, which outlasts its whole proof window) if a contributor held no seat in force in the round:
/// joined at or before it, and not withdrawn before it was the round open (issue 79; `_inForce`).
/// Linked into AggregationProver and run in its context (DELEGATECALL): both proofs ask it once their own check
/// finds the round right.
library ProverBinding {
    /// @dev The contributor's signed message (ledger/contribution_binding.py): `steps` 0 in a fixed-H run.
    bytes32 internal constant CONTRIBUTION_TYPEHASH = keccak256(
        "Contribution(uint256 runId,uint64 round,uint32 stage,bytes32 payloadRoot,bytes32 normRoot,uint32 steps)"
    );
    uint256 private constant _LOW_S = LedgerCore.MAX_S;
    uint8 private constant _NORMED = 3; // RunParams.commitments of a run whose factors carry the binding

    /// @notice Whether a stage's factors list more contributions than the run's maxContributions or, in a normed
    /// run, a contribution bound to no member of the round (see the library's notice) or are not well-formed
    /// version-3 factors: a wrong round either way. The caller checked the factors against the committed stage
    /// leaf of `record` (a committed record).
    /// @param listed The contributions the factors list, where they are not version 3 (the chunk proof's pieces).
    function unbound(
        TrainingLedger ledger,
        TrainingLedger.Record calldata record,
        uint32 stage,
        bytes calldata factors,
        uint256 listed
    ) external view returns (bool) {
        if (_tooMany(ledger, record.runId, factors, listed)) return true;
        TrainingLedger.Run memory run = ledger.runOf(record.runId);
        if (!ProverCommon.isNormed(factors)) return run.commitments == _NORMED;
        (AggregationProver.Norms memory norms, bool ok) = ProverCommon.normCommitment(factors);
        if (!ok) return true;
        if (run.commitments != _NORMED) return true; // version-3 factors in another run: no honest node's
        // The seats are read for as long as none in force in the round can be gone. A seat in force in round t
        // is never deleted (a slashed seat stays; a withdrawal keeps the withdrawn seat's rounds, pastJoinRound ..
        // pastUntil - 1, across a rejoin) until its account withdraws a later seat, which it joined after the
        // withdrawal, at least unbondingBlocks after that rejoin: after commit(t) + unbondingBlocks where t was
        // committed before the rejoin (a round committed later is the rejoined seat's). And every proof of t lands
        // before then: its window closes (TrainingLedger.proofWindowOf) at
        // max(end(t), end(t - 1) + accusationBlocks), where a round's own end is at most disputeBlocks +
        // (2 maxGameSteps + 1) accusationBlocks after its commit (a game's steps open within the dispute window
        // or within accusationBlocks of an answer, each answered within accusationBlocks, expired within
        // accusationBlocks more; a dispute's deadline is accusationBlocks after one opened in the window) and
        // commit(t - 1) <= commit(t): so before commit(t) + proofWindowBound <= commit(t) + unbondingBlocks
        // (createRun, LedgerUnbondingBelowProofWindow).
        Signed memory signed = Signed(
            record.runId, record.round, stage, LedgerCore.domainSeparator(address(ledger)),
            block.number < ledger.commitBlockOf(record.runId, record.round) + run.unbondingBlocks
        );
        return _anyUnbound(ledger, factors, norms, signed);
    }

    /// @dev Whether the factors list more contributions than the run's maxContributions (`listed`: the chunk
    /// proof's count where the factors are not version 3).
    function _tooMany(TrainingLedger ledger, uint256 runId, bytes calldata factors, uint256 listed)
        private
        view
        returns (bool)
    {
        uint256 most = ledger.valuesOf(runId).maxContributions;
        if (!ProverCommon.isNormed(factors)) return listed > most;
        (AggregationProver.Norms memory norms, bool ok) = ProverCommon.normCommitment(factors);
        return ok && norms.count > most;
    }

    /// @dev What every contribution's message shares, and whether the round's seats can still be read.
    struct Signed {
        uint256 runId;
        uint64 round;
        uint32 stage;
        bytes32 separator; // the ledger's EIP-712 domain separator
        bool seatsKept; // before commit + unbondingBlocks: no seat in force in the round has been overwritten
    }

    function _anyUnbound(
        TrainingLedger ledger,
        bytes calldata factors,
        AggregationProver.Norms memory norms,
        Signed memory signed
    ) private view returns (bool) {
        address[] memory signers = new address[](norms.count);
        for (uint256 j = 0; j < norms.count; ++j) {
            address signer = _signer(factors, norms, signed, j);
            address listedAs = address(uint160(ProverCommon.word(factors, norms.contributorsAt + 32 * j)));
            if (signer == address(0) || signer != listedAs) return true;
            for (uint256 i = 0; i < j; ++i) {
                if (signers[i] == signer) return true; // one member listed twice
            }
            signers[j] = signer;
            if (signed.seatsKept && !_inForce(ledger, signed.runId, signed.round, signer)) return true;
        }
        return false;
    }

    /// @dev The account whose EIP-2098 signature (r, vs) over contribution j's message the factors hold; zero for
    /// a signature that recovers to none or is malleable (a high s).
    function _signer(bytes calldata factors, AggregationProver.Norms memory norms, Signed memory signed, uint256 j)
        private
        pure
        returns (address)
    {
        uint256 steps = j < norms.steps ? ProverCommon.word(factors, norms.stepsAt + 32 * j) : 0;
        bytes32 structHash = keccak256(
            abi.encode(
                CONTRIBUTION_TYPEHASH,
                signed.runId,
                signed.round,
                signed.stage,
                ProverCommon.word(factors, norms.payloadRootsAt + 32 * j),
                ProverCommon.word(factors, norms.rootsAt + 32 * j),
                steps
            )
        );
        bytes32 r = bytes32(ProverCommon.word(factors, norms.signaturesAt + 64 * j));
        uint256 vs = ProverCommon.word(factors, norms.signaturesAt + 64 * j + 32);
        uint256 s = vs & (type(uint256).max >> 1);
        if (s > _LOW_S) return address(0);
        return ecrecover(LedgerCore.typedDigest(signed.separator, structHash), uint8(27 + (vs >> 255)), r, bytes32(s));
    }

    /// @dev Whether `account` held a seat in force in `round` (issue 79): a seat joined at or before it whose stake
    /// is still held (active, unbonding) or was taken for cause (slashed), or its last withdrawn seat, which was in
    /// force up to the round open at its withdrawal. Leaving never unbinds: a member that contributes and then
    /// leaves, even in the commit's own block ahead of it, leaves a right round right; a withdrawal comes at least
    /// unbondingBlocks after leaving and keeps the round open then, and a rejoin keeps the withdrawn seat's rounds.
    function _inForce(TrainingLedger ledger, uint256 runId, uint64 round, address account) private view returns (bool) {
        TrainingLedger.Member memory member = ledger.memberOf(runId, account);
        if (member.pastUntil > round && member.pastJoinRound <= round) return true;
        return member.status != TrainingLedger.MemberStatus.None && member.joinRound <= round;
    }
}
