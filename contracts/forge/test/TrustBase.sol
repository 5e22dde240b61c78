// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {NodeRegistry} from "../src/NodeRegistry.sol";
import {TrainingLedger} from "../src/TrainingLedger.sol";
import {WithVm} from "./Vm.sol";

/// @notice The cast, the run parameters and the signing helpers the invariant suite shares: the forge twin of
/// tests/trust_params.py. RunParams are built here only (`runParams`), so a new field is added in one place.
abstract contract TrustBase is WithVm {
    uint256 internal constant STAKE = 10 ** 15;
    uint256 internal constant BOND = 10 ** 14;
    /// @dev What a game run's creator puts in its proof fund (issue 79): pays the reward, half the slash (2.5 STAKE).
    uint256 internal constant GAME_FUND = 3 * STAKE;
    uint64 internal constant WINDOW = 8; // accusation and dispute windows, in blocks
    uint16 internal constant GAME_STEPS = 4; // RunParams.maxGameSteps
    uint32 internal constant INACTIVITY = 2;
    uint32 internal constant TENURE = 2;
    uint16 internal constant K = 2;
    uint16 internal constant QUORUM_BPS = 5000;

    // Private keys: honest founders 1-4, coalition founders 5-6, the joiners 7 (honest) and 8 (coalition), the
    // outsider 9 (proves and challenges: no seat, no stake).
    uint256 internal constant HONEST_JOINER = 7;
    uint256 internal constant COALITION_JOINER = 8;
    uint256 internal constant OUTSIDER = 9;

    bytes32 internal constant RECORD_TYPEHASH = keccak256(
        "Record(uint256 runId,uint64 round,bytes32 prevHead,bytes32 weightsRoot,bytes32 contributionsRoot,"
        "uint64 trainLossMicro,uint64 evalLossMicro,uint64 tokens,uint32 numContributors,bytes32 checkpointHash)"
    );
    bytes32 internal constant VERDICT_TYPEHASH =
        keccak256("Verdict(uint256 runId,address accused,bytes32 evidenceHash,bool guilty)");
    bytes32 internal constant ROUND_VERDICT_TYPEHASH =
        keccak256("RoundVerdict(uint256 runId,uint64 round,bytes32 recordHash,bool upheld)");

    address[10] internal _who; // the cast's addresses, derived once (vm.addr is a curve multiplication)

    function _castAddresses() internal {
        for (uint256 key = 1; key <= OUTSIDER; ++key) _who[key] = vm.addr(key);
    }

    function who(uint256 key) internal view returns (address) {
        return _who[key];
    }

    function runParams(bytes32 configHash) internal pure returns (TrainingLedger.RunParams memory p) {
        p.configHash = configHash;
        p.numStages = 1;
        p.innerSteps = 10;
        p.minStake = STAKE;
        p.quorum = K;
        p.quorumBps = QUORUM_BPS;
        p.bond = uint128(BOND);
        p.unbondingBlocks = WINDOW + (2 * uint64(GAME_STEPS) + 2) * WINDOW; // the longest proof window (issue 62)
        p.accusationBlocks = WINDOW;
        p.disputeBlocks = WINDOW;
        p.inactivityRounds = INACTIVITY;
        p.maxRounds = 0;
        p.tenureRounds = TENURE;
        p.commitments = 3;
        p.maxContributions = 6; // issue 62: per-round values (the schedule left unbound: scheduleRounds 0)
        p.maxRank = 64;
        p.maxGameSteps = GAME_STEPS; // issue 62: the clock
    }

    function register(NodeRegistry registry, uint256 key) internal {
        address account = who(key);
        vm.deal(account, 1000 ether);
        vm.prank(account);
        registry.register(keccak256(abi.encode("node key", key)), new bytes(64));
    }

    function structHash(TrainingLedger.Record memory record) internal pure returns (bytes32) {
        return keccak256(abi.encode(RECORD_TYPEHASH, record));
    }

    function domainSeparator(TrainingLedger ledger) internal view returns (bytes32) {
        return keccak256(
            abi.encode(
                keccak256("EIP712Domain(string name,string version,uint256 chainId,address verifyingContract)"),
                keccak256("dlx-node TrainingLedger"),
                keccak256("1"),
                block.chainid,
                address(ledger)
            )
        );
    }

    function typed(TrainingLedger ledger, bytes32 hash) internal view returns (bytes32) {
        return keccak256(abi.encodePacked(hex"1901", domainSeparator(ledger), hash));
    }

    function sign(uint256 key, bytes32 digest) internal pure returns (bytes memory) {
        (uint8 v, bytes32 r, bytes32 s) = vm.sign(key, digest);
        return abi.encodePacked(r, s, v);
    }

    /// @dev Concatenated signatures of `keys` over `digest`, ascending by signer address as the ledger wants.
    function signAll(uint256[] memory keys, bytes32 digest) internal view returns (bytes memory out) {
        uint256[] memory sorted = sortByAddress(keys);
        for (uint256 i = 0; i < sorted.length; ++i) out = bytes.concat(out, sign(sorted[i], digest));
    }

    /// @dev `keys` ascending by address (insertion sort over addresses derived once each).
    function sortByAddress(uint256[] memory keys) internal view returns (uint256[] memory sorted) {
        uint256 n = keys.length;
        sorted = new uint256[](n);
        address[] memory addrs = new address[](n);
        for (uint256 i = 0; i < n; ++i) {
            uint256 key = keys[i];
            address a = who(key);
            uint256 j = i;
            while (j > 0 && addrs[j - 1] > a) {
                sorted[j] = sorted[j - 1];
                addrs[j] = addrs[j - 1];
                --j;
            }
            sorted[j] = key;
            addrs[j] = a;
        }
    }

    /// @dev The addresses of `keys`, ascending (a commit's attesters as RoundCommitted gives them).
    function _addresses(uint256[] memory keys) internal view returns (address[] memory out) {
        uint256[] memory sorted = sortByAddress(keys);
        out = new address[](sorted.length);
        for (uint256 i = 0; i < sorted.length; ++i) out[i] = who(sorted[i]);
    }

    function recordDigest(TrainingLedger ledger, TrainingLedger.Record memory record) internal view returns (bytes32) {
        return typed(ledger, structHash(record));
    }

    function verdictDigest(TrainingLedger ledger, TrainingLedger.Verdict memory verdict)
        internal
        view
        returns (bytes32)
    {
        return typed(
            ledger,
            keccak256(
                abi.encode(VERDICT_TYPEHASH, verdict.runId, verdict.accused, verdict.evidenceHash, verdict.guilty)
            )
        );
    }

    function roundVerdictDigest(TrainingLedger ledger, TrainingLedger.Record memory committed, bool upheld)
        internal
        view
        returns (bytes32)
    {
        return typed(
            ledger,
            keccak256(
                abi.encode(ROUND_VERDICT_TYPEHASH, committed.runId, committed.round, structHash(committed), upheld)
            )
        );
    }
}
