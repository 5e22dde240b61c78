// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {TrainingLedger} from "../src/TrainingLedger.sol";
import {TrustBase} from "./TrustBase.sol";

/// @notice The rounds PoolHandler commits (issue 77): each a one-stage record of a normed run whose weights root
/// is the hash of its stage leaf, the leaf binding version-3 factors (ProverCommon.normCommitment's encoding) that
/// list signed contributions, as a node's record does (docs/FRAUD_PROOF.md, "The binding"). A listing is drawn
/// from one seed: 0-7 entries (its low three bits; 7 lists past the pool's 6 contribution slots), declared steps or
/// none (fixed H: bit 3), and each entry (entryOf) any account 1-9 as contributor (founders, joiners, the
/// outsider), steps 1-20 and, one entry in eight, forged: its Contribution signed by another key than the account
/// it lists.
abstract contract PoolRounds is TrustBase {
    uint64 internal constant ONE = 0x3FF0000000000000; // binary64 1.0, each listed contribution's scale
    uint256 internal constant MAX_LISTED = 7;
    bytes32 internal constant CONTRIBUTION_TYPEHASH = keccak256(
        "Contribution(uint256 runId,uint64 round,uint32 stage,bytes32 payloadRoot,bytes32 normRoot,uint32 steps)"
    );

    /// @dev What a round lists: each entry's account, whether its signature is another key's, its steps (none:
    /// fixed H).
    struct Listing {
        address[] contributors;
        bool[] forged;
        uint32[] steps;
    }

    mapping(uint64 round => Listing) internal _listings;
    mapping(uint64 round => bytes) internal _factorsOf;
    mapping(uint64 round => bytes) internal _leafOf;

    /// @dev Draw round `round`'s listing of run `run` from `seed`; its factors and stage leaf.
    function _drawListing(TrainingLedger ledger, uint256 run, uint64 round, uint256 seed)
        internal
        returns (bytes memory factors, bytes memory leaf)
    {
        uint256 n = seed % (MAX_LISTED + 1);
        bool timed = (seed >> 3) & 1 == 1;
        delete _listings[round];
        bytes32[] memory signatures = new bytes32[](2 * n);
        for (uint256 i = 0; i < n; ++i) {
            (signatures[2 * i], signatures[2 * i + 1]) = _drawEntry(ledger, run, round, seed, i, timed);
        }
        factors = _encodeFactors(_listings[round], signatures, n);
        leaf = abi.encode(uint32(0), uint32(2), keccak256(abi.encode("chunk", 0, round)),
                          keccak256(abi.encode("chunk", 1, round)), sha256(factors));
        _factorsOf[round] = factors;
        _leafOf[round] = leaf;
    }

    /// @notice Entry `i` of the listing drawn from `seed`: its account's key (1-9), whether its signature is
    /// another key's (one in eight) and its steps (1-20, where the listing is timed), from a hash of both, so that
    /// the fuzzer's small seeds still draw every kind of entry.
    function entryOf(uint256 seed, uint256 i) public pure returns (uint256 key, bool forged, uint32 steps) {
        uint256 bits = uint256(keccak256(abi.encode(seed, i)));
        return (1 + bits % OUTSIDER, (bits >> 8) % 8 == 0, uint32(1 + (bits >> 16) % 20));
    }

    /// @dev Entry `i` of round `round`'s listing drawn from `seed`, pushed to it; its EIP-2098 signature.
    function _drawEntry(TrainingLedger ledger, uint256 run, uint64 round, uint256 seed, uint256 i, bool timed)
        private
        returns (bytes32 r, bytes32 vs)
    {
        Listing storage listing = _listings[round];
        (uint256 key, bool forged, uint32 steps) = entryOf(seed, i);
        if (!timed) steps = 0;
        listing.contributors.push(who(key));
        listing.forged.push(forged);
        if (timed) listing.steps.push(steps);
        bytes32 digest = _contributionDigest(ledger, run, round, steps);
        return _sign2098(forged ? 1 + key % OUTSIDER : key, digest);
    }

    /// @dev `key`'s signature of `digest` in EIP-2098's two words.
    function _sign2098(uint256 key, bytes32 digest) private pure returns (bytes32 r, bytes32 vs) {
        (uint8 v, bytes32 r_, bytes32 s) = vm.sign(key, digest);
        return (r_, bytes32(uint256(s) | (uint256(v - 27) << 255)));
    }

    function _encodeFactors(Listing storage listing, bytes32[] memory signatures, uint256 n)
        private
        view
        returns (bytes memory)
    {
        bytes32[] memory roots = new bytes32[](n);
        uint64[] memory scales = new uint64[](n);
        for (uint256 i = 0; i < n; ++i) scales[i] = ONE;
        return abi.encode(
            uint32(0), uint32(0), false, roots, roots, scales, uint64(0), listing.steps, roots, new uint256[](3 * n),
            listing.contributors, signatures
        );
    }

    /// @dev The EIP-712 digest of a contribution to stage 0 of `round` (zero roots) declaring `steps`.
    function _contributionDigest(TrainingLedger ledger, uint256 run, uint64 round, uint32 steps)
        internal
        view
        returns (bytes32)
    {
        return typed(
            ledger, keccak256(abi.encode(CONTRIBUTION_TYPEHASH, run, round, uint32(0), bytes32(0), bytes32(0), steps))
        );
    }

    /// @dev The weights root of a one-stage record over `leaf` (ProverCommon.verifyLeaf with no path).
    function _leafHash(bytes memory leaf) internal pure returns (bytes32) {
        return sha256(abi.encodePacked(bytes1(0x00), leaf));
    }

    /// @dev What entry `index` of round `round` pays its contributor by the rule (docs/REWARDS.md): the stage's
    /// contributor budget over max(slots, listed) slots, times its steps (at most H) over H in a timed listing.
    function _contributionShare(uint64 round, uint256 index, uint256 budget, uint256 slots, uint256 h)
        internal
        view
        returns (uint256)
    {
        Listing storage listing = _listings[round];
        uint256 n = listing.contributors.length;
        uint256 s = n > slots ? n : slots;
        uint256 w = listing.steps.length == 0 ? h : (listing.steps[index] < h ? listing.steps[index] : h);
        return budget * w / (s * h);
    }
}
