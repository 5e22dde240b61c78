// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {AggregationProver} from "./AggregationProver.sol";
import {Float32} from "./Float32.sol";
import {NormRule} from "./NormRule.sol";
import {TrainingLedger} from "./TrainingLedger.sol";

/// @title ProverCommon
/// @notice What AggregationProver's libraries (ProverChunks, ProverNorms, ProverAvailability) share: the
/// commitments' openings (ledger/merkle.py trees, sum trees, stage leaves), a version-3 factors' norm commitment
/// and the pieces' decoding. Internal: compiled into each library that uses it.
/// @dev Reverts with AggregationProver's errors (declared there).
library ProverCommon {
    using Float32 for uint32;

    bytes32 internal constant RECORD_TYPEHASH = keccak256(
        "Record(uint256 runId,uint64 round,bytes32 prevHead,bytes32 weightsRoot,bytes32 contributionsRoot,"
        "uint64 trainLossMicro,uint64 evalLossMicro,uint64 tokens,uint32 numContributors,bytes32 checkpointHash)"
    );
    uint256 internal constant LEAF_HEADER = 24; // u32 tensor, u64 offset, u64 cols, u32 count
    uint256 internal constant PIECE_HEADER = 5; // u8 codec, u32 count
    uint256 internal constant WEIGHTS_AT = 10; // a lowrank piece's w, after its header, rank and S
    uint256 internal constant MAX_RANK = 64; // training/codec_wire.py MAX_RANK
    /// @dev AggregationProver.STAGE_LEAF and AggregationProver.SCALES.
    uint256 internal constant STAGE_LEAF = type(uint256).max;
    uint256 internal constant SCALES = type(uint256).max;
    /// @dev The head of version-3 factors: twelve fields (the norm commitment and the binding after version 2's six).
    uint256 internal constant HEAD_V3 = 384;

    function requireCommitted(TrainingLedger ledger, TrainingLedger.Record calldata record) internal view {
        bytes32 structHash = keccak256(abi.encode(RECORD_TYPEHASH, record));
        if (ledger.recordHashOf(record.runId, record.round) != structHash) {
            revert AggregationProver.ProverNotCommitted(record.runId, record.round);
        }
    }

    /// @dev The stage leaf at `stage` of the tree `root` (a record's weightsRoot, or a run's genesisRoot: `round`
    /// names it in errors); a wrong path reverts, a leaf that is not abi.encode(uint32 stage, uint32 numChunks,
    /// bytes32, bytes32, bytes32) of this stage gives `ok` false (what an honest committer never commits).
    function openStageLeaf(
        bytes calldata leaf,
        bytes32[] calldata path,
        bytes32 root,
        uint64 round,
        uint32 stage,
        uint32 numStages
    ) internal pure returns (AggregationProver.StageLeaf memory decoded, bool ok) {
        if (!verifyLeaf(leaf, stage, numStages, path, root)) {
            revert AggregationProver.ProverBadStagePath(round, stage);
        }
        if (leaf.length != 160 || word(leaf, 0) != stage || word(leaf, 32) > type(uint32).max) return (decoded, false);
        decoded = abi.decode(leaf, (AggregationProver.StageLeaf));
        ok = true;
    }

    /// @dev The accepted count of a canonical factors encoding, version 2 (six fields, the first list at byte 192)
    /// or 3 (twelve, at HEAD_V3: normCommitment), and which; `ok` false for any other bytes (an honest node writes none),
    /// so that no committed factors make a proof revert without a reason (abi.decode of them is safe once ok).
    function factorsShape(bytes calldata factors) internal pure returns (uint256 count, bool normed, bool ok) {
        if (factors.length < 224) return (0, false, false);
        uint256 first = word(factors, 96);
        if (first == HEAD_V3) {
            if (factors.length < HEAD_V3 + 32) return (0, true, false);
            (AggregationProver.Norms memory norms, bool good) = normCommitment(factors);
            return (norms.count, true, good);
        }
        count = word(factors, 192);
        if (first != 192 || count > type(uint32).max) return (0, false, false);
        uint256 list = 32 * (1 + count);
        if (word(factors, 128) != 192 + list || word(factors, 160) != 192 + 2 * list) return (0, false, false);
        if (factors.length != 192 + 3 * list) return (0, false, false);
        if (word(factors, 192 + list) != count || word(factors, 192 + 2 * list) != count) return (0, false, false);
        if (word(factors, 0) > type(uint32).max || word(factors, 32) > type(uint32).max) return (0, false, false);
        if (word(factors, 64) > 1) return (0, false, false);
        for (uint256 j = 0; j < count; ++j) {
            if (word(factors, 192 + 2 * list + 32 * (j + 1)) > type(uint64).max) return (0, false, false);
        }
        ok = true;
    }

    /// @dev Whether `leaf` is at position `index` of a ledger/merkle.py tree of `count` leaves with root `root`.
    function verifyLeaf(bytes calldata leaf, uint256 index, uint256 count, bytes32[] calldata path, bytes32 root)
        internal
        pure
        returns (bool)
    {
        if (index >= count) return false;
        bytes32 node = sha256(abi.encodePacked(bytes1(0x00), leaf));
        uint256 used = 0;
        for (uint256 size = count; size > 1; size = (size + 1) / 2) {
            uint256 sibling = index ^ 1;
            if (sibling < size) {
                if (used == path.length) return false;
                node = sibling < index
                    ? sha256(abi.encodePacked(bytes1(0x01), path[used], node))
                    : sha256(abi.encodePacked(bytes1(0x01), node, path[used]));
                ++used;
            }
            index >>= 1;
        }
        return used == path.length && node == root;
    }

    /// @dev The chunk's place, from round t - 1's weights leaf; its momentum leaf must have the same header.
    function chunkLayout(bytes calldata weights, bytes calldata momentum)
        internal
        pure
        returns (AggregationProver.Layout memory place)
    {
        if (weights.length < LEAF_HEADER) revert AggregationProver.ProverBadLeaf(0);
        place.count = u32(weights, 20);
        place.offset = uint64(bytes8(weights[4:12]));
        place.cols = uint64(bytes8(weights[12:20]));
        if (place.count == 0 || place.cols == 0 || weights.length != LEAF_HEADER + 4 * place.count) {
            revert AggregationProver.ProverBadLeaf(0);
        }
        if (momentum.length != weights.length || keccak256(momentum[:LEAF_HEADER]) != keccak256(weights[:LEAF_HEADER]))
        {
            revert AggregationProver.ProverBadLeaf(1);
        }
    }

    /// @dev The root and the total of a sum tree (ledger/normproof.py) from one leaf (96 bytes: hi, mid, lo) at
    /// `index` of `count` and its path (per level with a sibling: its hash and sum, four words). A leaf hashes
    /// as sha256(0x00 || sum), an inner node as sha256(0x01 || left hash || left sum || right hash || right sum)
    /// and sums its children; an odd node is promoted. `overflow`: a sum past 2^768 on the way.
    function openSum(bytes calldata leaf, uint256 index, uint256 count, bytes32[] calldata path, uint256 j)
        internal
        pure
        returns (bytes32 node, uint256[3] memory sum, bool overflow)
    {
        if (leaf.length != 96) revert AggregationProver.ProverBadSumPath(j);
        node = sha256(abi.encodePacked(bytes1(0x00), leaf));
        sum = [word(leaf, 0), word(leaf, 32), word(leaf, 64)];
        uint256 used = 0;
        for (uint256 size = count; size > 1; size = (size + 1) / 2) {
            uint256 sibling = index ^ 1;
            if (sibling < size) {
                if (used + 4 > path.length) revert AggregationProver.ProverBadSumPath(j);
                uint256[3] memory other = [uint256(path[used + 1]), uint256(path[used + 2]), uint256(path[used + 3])];
                node = sibling < index
                    ? sha256(abi.encodePacked(bytes1(0x01), path[used], other, node, sum))
                    : sha256(abi.encodePacked(bytes1(0x01), node, sum, path[used], other));
                bool carry;
                (sum[0], sum[1], sum[2], carry) = NormRule.add(sum[0], sum[1], sum[2], other[0], other[1], other[2]);
                overflow = overflow || carry;
                used += 4;
            }
            index >>= 1;
        }
        if (used != path.length) revert AggregationProver.ProverBadSumPath(j);
    }

    /// @dev Whether the factors are version 3's (twelve fields: the first list at byte HEAD_V3, and room for it).
    function isNormed(bytes calldata factors) internal pure returns (bool) {
        return factors.length >= HEAD_V3 + 32 && word(factors, 96) == HEAD_V3;
    }

    /// @dev Where a version-3 factors' norm commitment and binding lie, and whether they are well formed: the
    /// canonical encoding of abi.encode(uint32 lr, uint32 mu, bool nesterov, bytes32[] envelopes, bytes32[]
    /// payloadRoots, uint64[] scales, uint64 normClip, uint32[] steps, bytes32[] normRoots, uint256[] normSums,
    /// address[] contributors, bytes32[] signatures) with every list of the accepted count (steps: that count, or
    /// none; sums three words each, signatures two), every value in its type's range, normClip 0 or in [1, inf)
    /// and every step at least 1. The caller checked that it is version 3 (isNormed).
    function normCommitment(bytes calldata factors)
        internal
        pure
        returns (AggregationProver.Norms memory norms, bool ok)
    {
        uint256 count = word(factors, HEAD_V3);
        if (count > type(uint32).max) return (norms, false);
        uint256 list = 32 * (1 + count);
        uint256 stepsAt = HEAD_V3 + 3 * list; // after envelopes, payloadRoots and scales
        if (word(factors, 128) != HEAD_V3 + list || word(factors, 160) != HEAD_V3 + 2 * list) return (norms, false);
        if (word(factors, 224) != stepsAt || factors.length < stepsAt + 32) return (norms, false);
        norms.count = count;
        norms.steps = word(factors, stepsAt);
        if (norms.steps != 0 && norms.steps != count) return (norms, false);
        norms.stepsAt = stepsAt + 32;
        norms.rootsAt = norms.stepsAt + 32 * norms.steps;
        norms.sumsAt = norms.rootsAt + list;
        norms.contributorsAt = norms.sumsAt + 32 * (1 + 3 * count);
        norms.signaturesAt = norms.contributorsAt + list;
        if (word(factors, 256) != norms.rootsAt || word(factors, 288) != norms.sumsAt) return (norms, false);
        if (word(factors, 320) != norms.contributorsAt || word(factors, 352) != norms.signaturesAt) {
            return (norms, false);
        }
        if (factors.length != norms.signaturesAt + 32 * (1 + 2 * count)) return (norms, false);
        if (word(factors, HEAD_V3 + list) != count || word(factors, HEAD_V3 + 2 * list) != count) return (norms, false);
        if (word(factors, norms.rootsAt) != count || word(factors, norms.sumsAt) != 3 * count) return (norms, false);
        if (word(factors, norms.contributorsAt) != count || word(factors, norms.signaturesAt) != 2 * count) {
            return (norms, false);
        }
        norms.payloadRootsAt = HEAD_V3 + list + 32;
        norms.rootsAt += 32;
        norms.sumsAt += 32;
        norms.contributorsAt += 32;
        norms.signaturesAt += 32;
        uint256 clip = word(factors, 192);
        if (clip != 0 && (clip < NormRule.ONE || clip >= NormRule.INF)) return (norms, false);
        norms.clip = uint64(clip);
        ok = _normValuesOk(factors, norms, HEAD_V3 + 2 * list + 32);
    }

    /// @dev Every value of the factors in its type's range (what abi.decode would revert on), every step >= 1.
    function _normValuesOk(bytes calldata factors, AggregationProver.Norms memory norms, uint256 scalesAt)
        private
        pure
        returns (bool)
    {
        if (word(factors, 0) > type(uint32).max || word(factors, 32) > type(uint32).max) return false;
        if (word(factors, 64) > 1) return false;
        for (uint256 j = 0; j < norms.count; ++j) {
            if (word(factors, scalesAt + 32 * j) > type(uint64).max) return false;
            if (word(factors, norms.contributorsAt + 32 * j) > type(uint160).max) return false;
            if (j < norms.steps) {
                uint256 step = word(factors, norms.stepsAt + 32 * j);
                if (step == 0 || step > type(uint32).max) return false;
            }
        }
        return true;
    }

    function word(bytes calldata data, uint256 position) internal pure returns (uint256 value) {
        assembly ("memory-safe") {
            value := calldataload(add(data.offset, position))
        }
    }

    /// @dev Whether a piece has its codec's size for the chunk's layout (training/chunks.py), a low-rank one of rank
    /// at most `maxRank` (the run's, RunParams.maxRank) and at most its matrix's columns (as the decoder requires:
    /// so its rows of P, at most 64 / rank + 2, bound its size; LedgerCore.proofCost).
    function wellFormedPiece(bytes calldata piece, AggregationProver.Layout memory place, uint256 maxRank)
        internal
        pure
        returns (bool)
    {
        if (piece.length < PIECE_HEADER || u32(piece, 1) != place.count) return false;
        uint8 codec = uint8(piece[0]);
        if (codec == 0) return piece.length == PIECE_HEADER + 4 * place.count;
        if (codec == 1) return piece.length == PIECE_HEADER + 6 * place.count;
        if (codec != 2 || piece.length < WEIGHTS_AT) return false;
        uint256 rank = uint8(piece[PIECE_HEADER]);
        uint256 head = WEIGHTS_AT + 2 * rank;
        if (rank == 0 || rank > MAX_RANK || rank > maxRank || rank > place.cols || piece.length < head + 4) return false;
        uint256 rows = u32(piece, head);
        uint256 first = place.offset / place.cols;
        uint256 last = (uint256(place.offset) + place.count - 1) / place.cols;
        return rows == last - first + 1 && piece.length == head + 4 + 2 * rank * (rows + place.count);
    }

    /// @dev Element `k` of a checked piece, decoded exactly as training/codec_wire.py.
    function decodeElement(bytes calldata piece, AggregationProver.Layout memory place, uint256 k)
        internal
        pure
        returns (uint32)
    {
        uint8 codec = uint8(piece[0]);
        if (codec == 0) return u32(piece, PIECE_HEADER + 4 * k);
        if (codec == 1) {
            int256 q = _i16(piece, PIECE_HEADER + 2 * k);
            uint32 scale = u32(piece, PIECE_HEADER + 2 * place.count + 4 * k);
            return Float32.fromInt32(q).mul(scale); // float32(q) is exact: |q| < 2^15
        }
        return _lowrank(piece, place, k);
    }

    /// @dev ``float32(float64(sum_r P[i,r] w[r] Q[j,r]) * float64(S))``: the integer sum is exact (< 2^53).
    function _lowrank(bytes calldata piece, AggregationProver.Layout memory place, uint256 k)
        private
        pure
        returns (uint32)
    {
        uint256 rank = uint8(piece[PIECE_HEADER]);
        uint256 rowsAt = WEIGHTS_AT + 2 * rank + 4;
        uint256 pAt = rowsAt + 2 * rank * ((uint256(place.offset) + k) / place.cols - place.offset / place.cols);
        uint256 qAt = rowsAt + 2 * rank * (u32(piece, WEIGHTS_AT + 2 * rank) + k);
        int256 sum = _lowrankSum(piece, rank, pAt, qAt);
        return Float32.toFloat32(Float32.mul64(Float32.fromInt(sum), Float32.toFloat64(u32(piece, PIECE_HEADER + 1))));
    }

    /// @dev ``sum_r P[i,r] w[r] Q[j,r]`` over a checked piece: |P|, |Q| <= 2^15, w < 2^16 and r <= 64 bound every
    /// partial sum by 2^52, so the int256 arithmetic never wraps.
    function _lowrankSum(bytes calldata piece, uint256 rank, uint256 pAt, uint256 qAt)
        private
        pure
        returns (int256 sum)
    {
        assembly ("memory-safe") {
            let base := piece.offset
            for { let r := 0 } lt(r, rank) { r := add(r, 1) } {
                let at := mul(2, r)
                let w := shr(240, calldataload(add(base, add(WEIGHTS_AT, at))))
                let p := signextend(1, shr(240, calldataload(add(base, add(pAt, at)))))
                let q := signextend(1, shr(240, calldataload(add(base, add(qAt, at)))))
                sum := add(sum, mul(mul(p, w), q))
            }
        }
    }

    function u32(bytes calldata data, uint256 position) internal pure returns (uint32 value) {
        assembly ("memory-safe") {
            value := shr(224, calldataload(add(data.offset, position)))
        }
    }

    function _i16(bytes calldata data, uint256 position) private pure returns (int256) {
        uint16 raw;
        assembly ("memory-safe") {
            raw := shr(240, calldataload(add(data.offset, position)))
        }
        return int256(int16(raw));
    }
}
