// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {TrainingLedger} from "./TrainingLedger.sol";

/// @title LedgerCore
/// @notice What TrainingLedger and its libraries (LedgerMembership, LedgerDisputes, LedgerAccusations) share:
/// the typed-data hashing, signature recovery, the quorum rule, and the seat changes (leave, count, credit,
/// slash) and bond moves several of them make. Internal: compiled into each user, so the hot path
/// (commitRound, attest) makes no external call.
/// @dev Every function works on the ledger's one `TrainingLedger.LedgerState`; run from a library through
/// DELEGATECALL, its events are the ledger's (declared there) and leave from the ledger's address.
library LedgerCore {
    bytes32 internal constant DOMAIN_TYPEHASH =
        keccak256("EIP712Domain(string name,string version,uint256 chainId,address verifyingContract)");
    bytes32 internal constant RECORD_TYPEHASH = keccak256(
        "Record(uint256 runId,uint64 round,bytes32 prevHead,bytes32 weightsRoot,bytes32 contributionsRoot,"
        "uint64 trainLossMicro,uint64 evalLossMicro,uint64 tokens,uint32 numContributors,bytes32 checkpointHash)"
    );
    bytes32 internal constant VERDICT_TYPEHASH =
        keccak256("Verdict(uint256 runId,address accused,bytes32 evidenceHash,bool guilty)");
    bytes32 internal constant ROUND_VERDICT_TYPEHASH =
        keccak256("RoundVerdict(uint256 runId,uint64 round,bytes32 recordHash,bool upheld)");
    bytes32 internal constant HASHED_NAME = keccak256("dlx-node TrainingLedger");
    bytes32 internal constant HASHED_VERSION = keccak256("1");
    /// @dev secp256k1n / 2: a larger `s` is the malleable twin of a valid signature (as OpenZeppelin ECDSA).
    uint256 internal constant MAX_S = 0x7FFFFFFFFFFFFFFFFFFFFFFFFFFFFFFF5D576E7357A4501DDFE92F46681B20A0;
    uint256 internal constant SIGNATURE_LENGTH = 65;
    uint256 internal constant BPS = 10_000;
    /// @dev The shortest accusation deadline and dispute window a run may have.
    uint64 internal constant MIN_WINDOW_BLOCKS = 8;
    /// @dev The longest unbonding (and so window) a run may have: 2^32 blocks (1,600 years at 12 s), which
    /// keeps every block number plus a period far below 2^64.
    uint64 internal constant MAX_UNBONDING_BLOCKS = 2 ** 32;
    /// @dev Gas forwarded when returning a guilty accusation's bond (an account that refuses it forfeits it).
    uint256 internal constant BOND_RETURN_GAS = 30_000;

    // issue 62: the bounds of a fraud proof's cost (docs/FRAUD_PROOF.md, "Bounded proofs"). A run's worst proof
    // of any kind (the chunk proof: every listed contribution's piece of one chunk decoded and summed) must fit a
    // block with room to spare and a node's transaction size limit. The formula is conservative: its constants
    // are the measured costs (bench/fraud_proof_bounds.py, bench/results/fraud_proof_bounds.json) rounded up,
    // with every path 32 levels deep (the schedule's 64) and every low-rank piece spanning the most rows of P its
    // rank allows (rank <= its matrix's columns, as the decoder requires).
    uint256 internal constant PROOF_MAX_GAS = 10_000_000;
    uint256 internal constant PROOF_MAX_CALLDATA = 131_072; // 128 KiB, a common node's transaction size limit
    uint256 internal constant MAX_RANK = 64; // training/codec_wire.py MAX_RANK
    // everything but the pieces (measured 636k with 8-level paths and 2 attesters), with 32-level paths, the
    // schedule's 64-level path and 32 attesters slashed
    uint256 internal constant PROOF_GAS_BASE = 2_200_000;
    // one piece of a chunk: its path, decode, clip, sum (measured: raw 193k, quant 268k, low-rank 369k + per rank)
    uint256 internal constant PROOF_GAS_PER_PIECE = 430_000;
    uint256 internal constant PROOF_GAS_PER_RANK = 13_200; // one rank of a low-rank piece, 64 elements (11.9k)
    // records, stage leaves, four tensor openings and the schedule's with their paths, 100 attesters
    uint256 internal constant PROOF_BYTES_BASE = 16_000;
    // a piece's ABI words, header and path, its factors' eight words (version 3)
    uint256 internal constant PROOF_BYTES_PER_PIECE = 1_700;
    // per rank of a low-rank piece: w (2), a row of Q per element (128), rows of P (64 / rank + 2 rows: 4 + 128 / r)
    uint256 internal constant PROOF_BYTES_PER_RANK = 134;

    // issue 79 (point 4): a proof slashes every attester of its round (LedgerDisputes._overturn), and a round's
    // attesters are members Active at its commit, so the proof's gas grows with the seats a run has. proofCost
    // counts PROOF_BASE_ATTESTERS of them; a run holds at most MAX_SEATS Active members (joinRun:
    // LedgerRunFull), so its worst proof is proofCost + PROOF_SEATS_GAS, at most PROOF_MAX_GAS + PROOF_SEATS_GAS
    // = 10M + 224 x 32k = 17.2M gas, under 60% of a 30M block (tests/test_proof_at_full_seats.py measures it
    // at 256 attesters on py-evm and anvil). Without the cap ~1,234 seats made a commit that fits a block
    // (~17.3M) and a proof that does not (~30M).
    uint32 internal constant MAX_SEATS = 256;
    uint256 internal constant PROOF_BASE_ATTESTERS = 32;
    // one more attester slashed by a proof: its calldata word, its seat's slash and MemberSlashed (measured
    // 18,233 on py-evm and anvil at 256 attesters, rounded up)
    uint256 internal constant PROOF_GAS_PER_ATTESTER = 32_000;
    uint256 internal constant PROOF_SEATS_GAS = (MAX_SEATS - PROOF_BASE_ATTESTERS) * PROOF_GAS_PER_ATTESTER;

    /// @dev The worst proof's gas and calldata at `contributions` listed pieces of rank at most `rank`.
    function proofCost(uint256 contributions, uint256 rank) internal pure returns (uint256 gas, uint256 size) {
        gas = PROOF_GAS_BASE + contributions * (PROOF_GAS_PER_PIECE + rank * PROOF_GAS_PER_RANK);
        size = PROOF_BYTES_BASE + contributions * (PROOF_BYTES_PER_PIECE + rank * PROOF_BYTES_PER_RANK);
    }

    /// @notice The longest a round's proof window can last after its commit (TrainingLedger.proofWindowOf): its
    /// dispute window, then a game of `maxGameSteps` steps each taking up to two accusation windows (the answer's
    /// deadline, then the fresh window to open the next), the last step's expiry window, and a child's grace.
    function proofWindowBound(uint64 disputeBlocks, uint64 accusationBlocks, uint16 maxGameSteps)
        internal
        pure
        returns (uint64)
    {
        return disputeBlocks + (2 * uint64(maxGameSteps) + 2) * accusationBlocks;
    }

    function existingRun(TrainingLedger.LedgerState storage s, uint256 runId)
        internal
        view
        returns (TrainingLedger.Run storage run)
    {
        run = s.runs[runId];
        if (run.headHash == bytes32(0)) revert TrainingLedger.LedgerUnknownRun(runId);
    }

    function requireBonded(TrainingLedger.LedgerState storage s, uint256 runId, address account) internal view {
        TrainingLedger.MemberStatus status = s.members[runId][account].status;
        if (status != TrainingLedger.MemberStatus.Active && status != TrainingLedger.MemberStatus.Unbonding) {
            revert TrainingLedger.LedgerNotBonded(runId, account);
        }
    }

    /// @dev max(k, ceil(bps x counted / 10000)); counted < 2^32 and bps <= 10^4, so nothing overflows.
    function quorum(uint16 k, uint16 bps, uint32 counted) internal pure returns (uint32) {
        uint256 fraction = (uint256(bps) * counted + BPS - 1) / BPS;
        return fraction > k ? uint32(fraction) : k;
    }

    /// @dev The active member stops signing now; its stake unbonds for the run's unbondingBlocks (at most 2^32,
    /// so the end block cannot overflow).
    function leaveRun(
        uint256 runId,
        TrainingLedger.Run storage run,
        TrainingLedger.Member storage member,
        address account
    ) internal {
        uint64 unbondingEnd = uint64(block.number) + run.unbondingBlocks;
        member.status = TrainingLedger.MemberStatus.Unbonding;
        member.unbondingEnd = unbondingEnd;
        member.leftRound = run.commitCount;
        run.memberCount -= 1;
        if (member.countedBlock != 0) run.countedCount -= 1;
        emit TrainingLedger.MemberLeft(runId, account, unbondingEnd);
    }

    function slash(TrainingLedger.LedgerState storage s, uint256 runId, address account) internal {
        TrainingLedger.Member storage member = s.members[runId][account];
        if (member.status == TrainingLedger.MemberStatus.Active) {
            TrainingLedger.Run storage run = s.runs[runId];
            run.memberCount -= 1;
            if (member.countedBlock != 0) run.countedCount -= 1;
            member.leftRound = run.commitCount;
        }
        uint256 stake = member.stake;
        member.status = TrainingLedger.MemberStatus.Slashed;
        member.stake = 0;
        s.slashedTotal += stake;
        emit TrainingLedger.MemberSlashed(runId, account, stake);
    }

    function forfeitBond(TrainingLedger.LedgerState storage s, uint256 runId, address account, uint256 bond)
        internal
    {
        if (bond == 0) return;
        s.forfeitedTotal += bond;
        emit TrainingLedger.BondForfeited(runId, account, bond);
    }

    /// @dev Last in its transaction (every effect is done); an account that refuses the bond forfeits it.
    function returnBond(TrainingLedger.LedgerState storage s, uint256 runId, address account, uint256 bond)
        internal
    {
        if (bond == 0) return;
        (bool ok,) = payable(account).call{value: bond, gas: BOND_RETURN_GAS}("");
        if (ok) {
            emit TrainingLedger.BondReturned(runId, account, bond);
        } else {
            forfeitBond(s, runId, account, bond);
        }
    }

    /// @dev Credit the active `member` with `round`: it is not silent up to it (ejectInactive), and a joiner
    /// whose tenure is over starts to count. Returns whether it counts now.
    function credit(
        uint256 runId,
        TrainingLedger.Run storage run,
        TrainingLedger.Member storage member,
        address account,
        uint64 round
    ) internal returns (bool) {
        if (member.activeRound <= round) member.activeRound = round + 1;
        if (member.countedBlock != 0) return true;
        // joinRound + tenureRounds < 2^64 + 2^32: no overflow in uint256.
        if (uint256(round) >= uint256(member.joinRound) + run.tenureRounds) {
            count(runId, run, member, account);
            return true;
        }
        return false;
    }

    function count(
        uint256 runId,
        TrainingLedger.Run storage run,
        TrainingLedger.Member storage member,
        address account
    ) internal {
        member.countedBlock = uint64(block.number);
        run.countedCount += 1;
        emit TrainingLedger.MemberCounted(runId, account);
    }

    /// @dev The struct hash of `committed`, which must be the record committed for its round.
    function committedHash(TrainingLedger.LedgerState storage s, TrainingLedger.Record calldata committed)
        internal
        view
        returns (bytes32 structHash)
    {
        bytes32 stored = s.recordHashes[committed.runId][committed.round];
        if (stored == bytes32(0)) revert TrainingLedger.LedgerRoundNotCommitted(committed.runId, committed.round);
        structHash = hashRecord(committed);
        if (structHash != stored) revert TrainingLedger.LedgerNotCommittedRecord(committed.runId, committed.round);
    }

    /// @dev `signer` holds a stake in `runId` (active or unbonding), counted toward quorums before `blockNumber`
    /// and, if it left, left after it (it left at unbondingEnd - unbondingBlocks): a seat counted or gone within
    /// that block may have been so before the quorum taken there was counted (an accusation's opening, a
    /// round's commit), so it does not sign (both found by the forge invariant campaign, contracts/forge).
    function requireCountedAt(TrainingLedger.LedgerState storage s, uint256 runId, address signer, uint64 blockNumber)
        internal
        view
    {
        TrainingLedger.Member storage member = s.members[runId][signer];
        TrainingLedger.MemberStatus status = member.status;
        if (status != TrainingLedger.MemberStatus.Active && status != TrainingLedger.MemberStatus.Unbonding) {
            revert TrainingLedger.LedgerSignerNotMember(runId, signer);
        }
        uint64 counted = member.countedBlock;
        if (
            counted == 0 || counted >= blockNumber
                || (
                    status == TrainingLedger.MemberStatus.Unbonding
                        && member.unbondingEnd - s.runs[runId].unbondingBlocks <= blockNumber
                )
        ) revert TrainingLedger.LedgerSignerNotInForce(runId, signer, blockNumber);
    }

    /// @dev The signers of the concatenated 65-byte `signatures` over `digest`, which must be strictly
    /// ascending (so distinct).
    function recoverAscending(bytes32 digest, bytes calldata signatures) internal pure returns (address[] memory) {
        uint256 n = signatureCount(signatures);
        address[] memory signers = new address[](n);
        address previous = address(0);
        for (uint256 i = 0; i < n; ++i) {
            address signer = recover(digest, signatures[i * SIGNATURE_LENGTH:(i + 1) * SIGNATURE_LENGTH], i);
            if (signer <= previous) revert TrainingLedger.LedgerSignersNotAscending(previous, signer);
            previous = signer;
            signers[i] = signer;
        }
        return signers;
    }

    function signatureCount(bytes calldata signatures) internal pure returns (uint256) {
        if (signatures.length % SIGNATURE_LENGTH != 0) {
            revert TrainingLedger.LedgerBadSignaturesLength(signatures.length);
        }
        return signatures.length / SIGNATURE_LENGTH;
    }

    /// @dev The signer of the 65-byte (r, s, v) `signature` over `digest`; rejects a wrong length, a high `s`
    /// (malleable), a `v` other than 27/28 and an unrecoverable signature with LedgerInvalidSignature(index).
    function recover(bytes32 digest, bytes calldata signature, uint256 index) internal pure returns (address signer) {
        if (signature.length != SIGNATURE_LENGTH) revert TrainingLedger.LedgerInvalidSignature(index);
        bytes32 r;
        bytes32 s;
        uint8 v;
        assembly ("memory-safe") {
            r := calldataload(signature.offset)
            s := calldataload(add(signature.offset, 32))
            v := byte(0, calldataload(add(signature.offset, 64)))
        }
        if (uint256(s) > MAX_S || (v != 27 && v != 28)) revert TrainingLedger.LedgerInvalidSignature(index);
        signer = ecrecover(digest, v, r, s);
        if (signer == address(0)) revert TrainingLedger.LedgerInvalidSignature(index);
    }

    function hashRecord(TrainingLedger.Record calldata record) internal pure returns (bytes32) {
        return keccak256(abi.encode(RECORD_TYPEHASH, record));
    }

    /// @dev keccak256("\x19\x01" || separator || structHash): the EIP-712 digest under the ledger's domain
    /// separator (TrainingLedger passes its cached one to its libraries).
    function typedDigest(bytes32 separator, bytes32 structHash) internal pure returns (bytes32 digest) {
        assembly ("memory-safe") {
            let ptr := mload(0x40)
            mstore(ptr, hex"1901")
            mstore(add(ptr, 0x02), separator)
            mstore(add(ptr, 0x22), structHash)
            digest := keccak256(ptr, 0x42)
        }
    }

    /// @dev The domain separator of the ledger at `ledger` on this chain.
    function domainSeparator(address ledger) internal view returns (bytes32) {
        return keccak256(abi.encode(DOMAIN_TYPEHASH, HASHED_NAME, HASHED_VERSION, block.chainid, ledger));
    }
}
