// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {NodeRegistry} from "./NodeRegistry.sol";

/// @title TrainingLedger
/// @notice The on-chain record of dlx-node training runs: one commit per outer round whatever the number of
/// peers, a running hash chain over a run's commits, checkpoint publication and disputes.
/// @dev Only nodes registered in the NodeRegistry may commit, publish or dispute; anyone may create a run.
/// Per-round contributor data lives off-chain behind `contributionsRoot`, so a commit costs O(1) gas.
/// Hash chain: head_0 = keccak256(abi.encode(chainid, ledger, runId, configHash)) and
/// head_n = keccak256(abi.encode(head_{n-1}, runId, round, weightsRoot, contributionsRoot, trainLossMicro,
/// evalLossMicro, tokens, numContributors, committer)).
contract TrainingLedger {
    /// @notice A run's fixed parameters and its commit progress.
    /// @dev Field order packs the fields a commit updates into one slot that is already nonzero (numStages >= 1)
    /// when the first commit arrives, so the first commit costs no more than later ones.
    struct Run {
        bytes32 configHash; // hash of the run's full configuration (model, data, hyperparameters, stages, H)
        bytes32 headHash; // head of the run's hash chain; nonzero once the run exists
        uint32 numStages;
        uint32 innerSteps;
        uint64 lastRound; // meaningful only when commitCount > 0
        uint64 commitCount;
        address creator;
        uint64 latestCheckpointRound; // meaningful only when checkpointCount > 0
        uint32 checkpointCount;
    }

    /// @notice One outer round's commitment.
    struct Commit {
        bytes32 weightsRoot; // root over the stage weight hashes after the outer step
        bytes32 contributionsRoot; // Merkle root of the round's signed contributions (ledger/merkle.py)
        uint64 trainLossMicro; // mean training loss x 1e6
        uint64 evalLossMicro; // evaluation loss x 1e6
        uint64 tokens; // tokens processed in the round
        uint32 numContributors;
        bool exists;
    }

    NodeRegistry private immutable _registry;
    uint256 private _runCount;
    mapping(uint256 runId => Run) private _runs;
    mapping(uint256 runId => mapping(uint64 round => Commit)) private _commits;
    mapping(uint256 runId => mapping(uint64 round => bytes32 contentHash)) private _checkpoints;
    mapping(uint256 runId => mapping(uint64 round => uint256)) private _disputeCounts;
    mapping(uint256 runId => mapping(uint64 round => mapping(address account => bool))) private _disputed;

    /// @notice Run `runId` was created by `creator` with the given configuration hash and shape.
    event RunCreated(
        uint256 indexed runId,
        address indexed creator,
        bytes32 configHash,
        uint32 numStages,
        uint32 innerSteps,
        bytes32 genesisHead,
        string configUri
    );
    /// @notice `committer` committed outer round `round` of run `runId`; `headHash` is the new chain head.
    event RoundCommitted(
        uint256 indexed runId,
        uint64 indexed round,
        address indexed committer,
        bytes32 weightsRoot,
        bytes32 contributionsRoot,
        uint64 trainLossMicro,
        uint64 evalLossMicro,
        uint64 tokens,
        uint32 numContributors,
        bytes32 headHash
    );
    /// @notice `publisher` published the checkpoint of round `round` of run `runId`, fetchable at `uri`.
    event CheckpointPublished(
        uint256 indexed runId, uint64 indexed round, address indexed publisher, bytes32 contentHash, string uri
    );
    /// @notice `disputer` computed different roots for round `round` of run `runId` than were committed.
    event RoundDisputed(
        uint256 indexed runId,
        uint64 indexed round,
        address indexed disputer,
        bytes32 computedWeightsRoot,
        bytes32 computedContributionsRoot
    );

    error LedgerNotRegistered(address account);
    error LedgerUnknownRun(uint256 runId);
    error LedgerBadRunShape(uint32 numStages, uint32 innerSteps);
    error LedgerZeroHash();
    error LedgerRoundNotIncreasing(uint64 last, uint64 got);
    error LedgerRoundNotCommitted(uint256 runId, uint64 round);
    error LedgerCheckpointAhead(uint64 last, uint64 got);
    error LedgerCheckpointExists(uint256 runId, uint64 round, bytes32 contentHash);
    error LedgerDisputeMatchesCommit(uint256 runId, uint64 round);
    error LedgerAlreadyDisputed(uint256 runId, uint64 round, address account);

    /// @param registry_ The NodeRegistry whose members may commit, publish and dispute.
    constructor(NodeRegistry registry_) {
        _registry = registry_;
    }

    modifier onlyRegistered() {
        if (!_registry.isRegistered(msg.sender)) revert LedgerNotRegistered(msg.sender);
        _;
    }

    /// @notice Create a training run.
    /// @param configHash Hash of the run's full configuration; must be nonzero.
    /// @param numStages Number of pipeline stages (>= 1).
    /// @param innerSteps Inner steps H per outer round (>= 1).
    /// @param configUri Where to fetch the configuration whose hash is `configHash` (emitted, not stored).
    /// @return runId The new run's id (ids start at 1).
    function createRun(bytes32 configHash, uint32 numStages, uint32 innerSteps, string calldata configUri)
        external
        returns (uint256 runId)
    {
        if (configHash == bytes32(0)) revert LedgerZeroHash();
        if (numStages == 0 || innerSteps == 0) revert LedgerBadRunShape(numStages, innerSteps);
        runId = ++_runCount;
        bytes32 genesis = keccak256(abi.encode(block.chainid, address(this), runId, configHash));
        Run storage run = _runs[runId];
        run.configHash = configHash;
        run.headHash = genesis;
        run.creator = msg.sender;
        run.numStages = numStages;
        run.innerSteps = innerSteps;
        emit RunCreated(runId, msg.sender, configHash, numStages, innerSteps, genesis, configUri);
    }

    /// @notice Commit outer round `round` of run `runId`; rounds strictly increase within a run.
    /// @param runId The run.
    /// @param round The outer round; greater than the run's last committed round.
    /// @param weightsRoot Root over the stage weight hashes after the round's outer step; nonzero.
    /// @param contributionsRoot Merkle root of the round's signed contributions; nonzero.
    /// @param trainLossMicro Mean training loss x 1e6.
    /// @param evalLossMicro Evaluation loss x 1e6.
    /// @param tokens Tokens processed in the round.
    /// @param numContributors Number of contributions under `contributionsRoot`.
    function commitRound(
        uint256 runId,
        uint64 round,
        bytes32 weightsRoot,
        bytes32 contributionsRoot,
        uint64 trainLossMicro,
        uint64 evalLossMicro,
        uint64 tokens,
        uint32 numContributors
    ) external onlyRegistered {
        Run storage run = _existingRun(runId);
        if (weightsRoot == bytes32(0) || contributionsRoot == bytes32(0)) revert LedgerZeroHash();
        if (run.commitCount > 0 && round <= run.lastRound) revert LedgerRoundNotIncreasing(run.lastRound, round);

        bytes32 head = keccak256(
            abi.encode(
                run.headHash,
                runId,
                round,
                weightsRoot,
                contributionsRoot,
                trainLossMicro,
                evalLossMicro,
                tokens,
                numContributors,
                msg.sender
            )
        );
        _commits[runId][round] =
            Commit(weightsRoot, contributionsRoot, trainLossMicro, evalLossMicro, tokens, numContributors, true);
        run.headHash = head;
        run.lastRound = round;
        run.commitCount += 1;
        emit RoundCommitted(
            runId,
            round,
            msg.sender,
            weightsRoot,
            contributionsRoot,
            trainLossMicro,
            evalLossMicro,
            tokens,
            numContributors,
            head
        );
    }

    /// @notice Publish the checkpoint of round `round` of run `runId`; one checkpoint per round.
    /// @param runId The run.
    /// @param round A committed round at most the last one, or 0 (initial weights) before any commit.
    /// @param contentHash Hash of the checkpoint's content; nonzero.
    /// @param uri Where to fetch the checkpoint (emitted, not stored).
    function publishCheckpoint(uint256 runId, uint64 round, bytes32 contentHash, string calldata uri)
        external
        onlyRegistered
    {
        Run storage run = _existingRun(runId);
        if (contentHash == bytes32(0)) revert LedgerZeroHash();
        uint64 last = run.commitCount > 0 ? run.lastRound : 0;
        if (round > last) revert LedgerCheckpointAhead(last, round);
        bytes32 existing = _checkpoints[runId][round];
        if (existing != bytes32(0)) revert LedgerCheckpointExists(runId, round, existing);

        _checkpoints[runId][round] = contentHash;
        if (run.checkpointCount == 0 || round > run.latestCheckpointRound) run.latestCheckpointRound = round;
        run.checkpointCount += 1;
        emit CheckpointPublished(runId, round, msg.sender, contentHash, uri);
    }

    /// @notice Flag committed round `round` of run `runId`, posting the roots the caller computed instead.
    /// @param runId The run.
    /// @param round A committed round.
    /// @param computedWeightsRoot The weights root the caller computed.
    /// @param computedContributionsRoot The contributions root the caller computed.
    /// @dev At least one root must differ from the commit; each account disputes a round at most once.
    function dispute(uint256 runId, uint64 round, bytes32 computedWeightsRoot, bytes32 computedContributionsRoot)
        external
        onlyRegistered
    {
        _existingRun(runId);
        Commit storage commit = _commits[runId][round];
        if (!commit.exists) revert LedgerRoundNotCommitted(runId, round);
        if (commit.weightsRoot == computedWeightsRoot && commit.contributionsRoot == computedContributionsRoot) {
            revert LedgerDisputeMatchesCommit(runId, round);
        }
        if (_disputed[runId][round][msg.sender]) revert LedgerAlreadyDisputed(runId, round, msg.sender);

        _disputed[runId][round][msg.sender] = true;
        _disputeCounts[runId][round] += 1;
        emit RoundDisputed(runId, round, msg.sender, computedWeightsRoot, computedContributionsRoot);
    }

    /// @notice The NodeRegistry this ledger trusts.
    /// @return The registry's address.
    function registry() external view returns (NodeRegistry) {
        return _registry;
    }

    /// @notice The number of runs created so far (the latest run id).
    /// @return The count.
    function runCount() external view returns (uint256) {
        return _runCount;
    }

    /// @notice Run `runId`'s parameters and progress.
    /// @param runId The run.
    /// @return The run record (all zero for an unknown run).
    function runOf(uint256 runId) external view returns (Run memory) {
        return _runs[runId];
    }

    /// @notice The last committed round of run `runId`.
    /// @param runId The run.
    /// @return The round; 0 also when nothing is committed yet (see `commitCount`).
    function lastRound(uint256 runId) external view returns (uint64) {
        return _runs[runId].lastRound;
    }

    /// @notice The number of rounds committed for run `runId`.
    /// @param runId The run.
    /// @return The count.
    function commitCount(uint256 runId) external view returns (uint64) {
        return _runs[runId].commitCount;
    }

    /// @notice The head of run `runId`'s hash chain.
    /// @param runId The run.
    /// @return The head (the genesis head before the first commit; zero for an unknown run).
    function headOf(uint256 runId) external view returns (bytes32) {
        return _runs[runId].headHash;
    }

    /// @notice The commit of round `round` of run `runId`.
    /// @param runId The run.
    /// @param round The outer round.
    /// @return The commit; `exists` is false if the round was not committed.
    function commitOf(uint256 runId, uint64 round) external view returns (Commit memory) {
        return _commits[runId][round];
    }

    /// @notice The content hash of the checkpoint published for round `round` of run `runId`.
    /// @param runId The run.
    /// @param round The outer round.
    /// @return The content hash, or zero if none was published.
    function checkpointOf(uint256 runId, uint64 round) external view returns (bytes32) {
        return _checkpoints[runId][round];
    }

    /// @notice The number of disputes raised against round `round` of run `runId`.
    /// @param runId The run.
    /// @param round The outer round.
    /// @return The count.
    function disputeCount(uint256 runId, uint64 round) external view returns (uint256) {
        return _disputeCounts[runId][round];
    }

    function _existingRun(uint256 runId) private view returns (Run storage run) {
        run = _runs[runId];
        if (run.headHash == bytes32(0)) revert LedgerUnknownRun(runId);
    }
}
