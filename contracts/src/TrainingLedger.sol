// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {NodeRegistry} from "./NodeRegistry.sol";

/// @title TrainingLedger
/// @notice The on-chain record of dlx-node training runs. Each run has staked members; an outer round is
/// committed only with the EIP-712 signatures of at least `quorum` distinct members over the round's record,
/// and a running hash chain links a run's records. A member that signs two different records for one round
/// (equivocation), or that `quorum` members find guilty on an accusation, loses its stake and its seat.
/// @dev Trust model, typed data and hash chain: docs/LEDGER.md. Per-round contributor data lives off-chain
/// behind `contributionsRoot`, so a commit's gas depends only on the number of signatures.
///
/// EIP-712 domain: {name: "dlx-node TrainingLedger", version: "1", chainId, verifyingContract: this}.
/// Hash chain: head_0 = keccak256(abi.encode(chainid, ledger, runId, configHash)) and
/// head_n = keccak256(abi.encode(head_{n-1}, hashStruct(record_n))), where record_n.prevHead == head_{n-1}.
///
/// Slashed stake stays in this contract for good: no function moves it (it is burned in effect), so a slash
/// pays nobody and no one profits from accusing.
contract TrainingLedger {
    /// @notice A run's fixed parameters and its progress.
    /// @dev The first slot holds everything a commit reads and updates; it is nonzero from creation on
    /// (quorum >= 1), so the run's first commit costs no more than later ones.
    struct Run {
        uint64 commitCount; // rounds committed; the next round to commit has this number
        uint64 maxRounds; // rounds 0 .. maxRounds-1 may be committed; 0: open-ended
        uint32 quorum; // member signatures a commit or a verdict needs (>= 1)
        uint32 checkpointCount;
        uint64 latestCheckpointRound; // meaningful only when checkpointCount > 0
        address creator;
        uint32 numStages;
        uint32 innerSteps;
        uint32 memberCount; // members currently able to sign
        uint64 unbondingBlocks; // blocks between leaveRun and the earliest withdrawStake
        uint256 minStake; // wei each member stakes to join
        bytes32 configHash; // hash of the run's full configuration (model, data, hyperparameters, stages, H)
        bytes32 headHash; // head of the run's hash chain; nonzero once the run exists
    }

    /// @notice What a round's signers attest (EIP-712 type `Record`).
    struct Record {
        uint256 runId;
        uint64 round; // exactly the run's commitCount when committed
        bytes32 prevHead; // the run's head before this round: a signature cannot be replayed later
        bytes32 weightsRoot; // root over the stage weight hashes after the outer step
        bytes32 contributionsRoot; // Merkle root of the round's signed contributions (ledger/merkle.py)
        uint64 trainLossMicro; // mean training loss x 1e6
        uint64 evalLossMicro; // evaluation loss x 1e6
        uint64 tokens; // tokens processed in the round
        uint32 numContributors;
        bytes32 checkpointHash; // content hash of the round's checkpoint, zero when it has none
    }

    /// @notice The outcome of an accusation (EIP-712 type `Verdict`).
    struct Verdict {
        uint256 runId;
        address accused;
        bytes32 evidenceHash;
        bool guilty;
    }

    enum MemberStatus {
        None, // never joined, or left and withdrew its stake (may join again)
        Active, // signs the run's records
        Unbonding, // left: cannot sign, stake still held (slashable) until withdrawn
        Slashed // stake taken; may never join the run again
    }

    /// @notice A run member's seat.
    struct Member {
        bytes32 nodeKey; // the registry's key of the account when it joined
        uint128 stake; // wei held for the member (2^128 wei exceeds all ether)
        uint64 unbondingEnd; // first block at which withdrawStake succeeds (set by leaveRun)
        uint32 openAccusations;
        MemberStatus status;
    }

    enum AccusationStatus {
        None,
        Open,
        Guilty,
        Cleared
    }

    bytes32 private constant _DOMAIN_TYPEHASH =
        keccak256("EIP712Domain(string name,string version,uint256 chainId,address verifyingContract)");
    bytes32 private constant _RECORD_TYPEHASH = keccak256(
        "Record(uint256 runId,uint64 round,bytes32 prevHead,bytes32 weightsRoot,bytes32 contributionsRoot,"
        "uint64 trainLossMicro,uint64 evalLossMicro,uint64 tokens,uint32 numContributors,bytes32 checkpointHash)"
    );
    bytes32 private constant _VERDICT_TYPEHASH =
        keccak256("Verdict(uint256 runId,address accused,bytes32 evidenceHash,bool guilty)");
    bytes32 private constant _HASHED_NAME = keccak256("dlx-node TrainingLedger");
    bytes32 private constant _HASHED_VERSION = keccak256("1");
    /// @dev secp256k1n / 2: a larger `s` is the malleable twin of a valid signature (as OpenZeppelin ECDSA).
    uint256 private constant _MAX_S = 0x7FFFFFFFFFFFFFFFFFFFFFFFFFFFFFFF5D576E7357A4501DDFE92F46681B20A0;
    uint256 private constant _SIGNATURE_LENGTH = 65;

    NodeRegistry private immutable _registry;
    bytes32 private immutable _cachedDomainSeparator;
    uint256 private immutable _cachedChainId;
    address private immutable _cachedThis;

    uint256 private _runCount;
    uint256 private _slashedTotal;
    mapping(uint256 runId => Run) private _runs;
    mapping(uint256 runId => mapping(uint64 round => bytes32 structHash)) private _recordHashes;
    mapping(uint256 runId => mapping(uint64 round => bytes32 contentHash)) private _checkpoints;
    mapping(uint256 runId => mapping(address account => Member)) private _members;
    mapping(uint256 runId => mapping(uint64 round => uint256)) private _disputeCounts;
    mapping(uint256 runId => mapping(uint64 round => mapping(address account => bool))) private _disputed;
    mapping(uint256 runId => mapping(address accused => mapping(bytes32 evidenceHash => AccusationStatus)))
        private _accusations;

    /// @notice Run `runId` was created by `creator` with the given configuration and membership rules.
    event RunCreated(
        uint256 indexed runId,
        address indexed creator,
        bytes32 configHash,
        uint32 numStages,
        uint32 innerSteps,
        uint256 minStake,
        uint32 quorum,
        uint64 unbondingBlocks,
        uint64 maxRounds,
        bytes32 genesisHead,
        string configUri
    );
    /// @notice `account` joined run `runId` with node key `nodeKey`, staking `stake` wei.
    event MemberJoined(uint256 indexed runId, address indexed account, bytes32 nodeKey, uint256 stake);
    /// @notice `account` left run `runId`; its stake can be withdrawn from block `unbondingEnd` on.
    event MemberLeft(uint256 indexed runId, address indexed account, uint64 unbondingEnd);
    /// @notice `account` took back its `stake` wei from run `runId`.
    event StakeWithdrawn(uint256 indexed runId, address indexed account, uint256 stake);
    /// @notice `account` lost its `stake` wei and its seat in run `runId` (see EquivocationReported or
    /// AccusationResolved in the same transaction for why).
    event MemberSlashed(uint256 indexed runId, address indexed account, uint256 stake);
    /// @notice Round `round` of run `runId` was committed by `submitter` with the signatures of `attesters`
    /// (ascending); `headHash` is the new chain head.
    event RoundCommitted(
        uint256 indexed runId,
        uint64 indexed round,
        address indexed submitter,
        Record record,
        address[] attesters,
        bytes32 headHash
    );
    /// @notice Member `disputer` signed `record` for round `round` of run `runId`, which differs from the
    /// committed one.
    event RoundDisputed(
        uint256 indexed runId, uint64 indexed round, address indexed disputer, Record record, bytes signature
    );
    /// @notice `account` signed two different records, hashing to `recordHashA` and `recordHashB`, for round
    /// `round` of run `runId`; `reporter` brought the evidence.
    event EquivocationReported(
        uint256 indexed runId,
        address indexed account,
        uint64 indexed round,
        bytes32 recordHashA,
        bytes32 recordHashB,
        address reporter
    );
    /// @notice Member `accuser` accused `accused` in run `runId`, pointing at off-chain `evidenceHash`.
    event AccusationOpened(
        uint256 indexed runId, address indexed accused, address indexed accuser, bytes32 evidenceHash
    );
    /// @notice The accusation (`runId`, `accused`, `evidenceHash`) was decided by `signers` (ascending).
    event AccusationResolved(
        uint256 indexed runId, address indexed accused, bytes32 evidenceHash, bool guilty, address[] signers
    );

    error LedgerNotRegistered(address account);
    error LedgerUnknownRun(uint256 runId);
    error LedgerBadRunShape(uint32 numStages, uint32 innerSteps);
    error LedgerBadQuorum(uint32 quorum);
    error LedgerZeroHash();
    error LedgerStakeTooLow(uint256 required, uint256 sent);
    error LedgerAlreadyMember(uint256 runId, address account);
    error LedgerMemberSlashed(uint256 runId, address account);
    error LedgerNotMember(uint256 runId, address account);
    error LedgerNotUnbonding(uint256 runId, address account);
    error LedgerStillUnbonding(uint256 runId, address account, uint64 unbondingEnd);
    error LedgerAccusationPending(uint256 runId, address account, uint32 openAccusations);
    error LedgerRefundFailed(address account, uint256 amount);
    error LedgerRoundNotNext(uint64 expected, uint64 got);
    error LedgerRoundBeyondMax(uint64 maxRounds, uint64 got);
    error LedgerStaleHead(bytes32 head, bytes32 prevHead);
    error LedgerBadSignaturesLength(uint256 length);
    error LedgerInvalidSignature(uint256 index);
    error LedgerSignerNotMember(uint256 runId, address signer);
    error LedgerSignersNotAscending(address previous, address signer);
    error LedgerQuorumNotMet(uint32 quorum, uint256 signers);
    error LedgerNotEquivocation(bytes32 recordHashA, bytes32 recordHashB);
    error LedgerDifferentSigners(address signerA, address signerB);
    error LedgerNotBonded(uint256 runId, address account);
    error LedgerRoundNotCommitted(uint256 runId, uint64 round);
    error LedgerDisputeMatchesCommit(uint256 runId, uint64 round);
    error LedgerAlreadyDisputed(uint256 runId, uint64 round, address account);
    error LedgerAccusationExists(uint256 runId, address accused, bytes32 evidenceHash);
    error LedgerAccusationNotOpen(uint256 runId, address accused, bytes32 evidenceHash);

    /// @param registry_ The NodeRegistry whose nodes may join runs.
    constructor(NodeRegistry registry_) {
        _registry = registry_;
        _cachedChainId = block.chainid;
        _cachedThis = address(this);
        _cachedDomainSeparator = _buildDomainSeparator();
    }

    // ------------------------------------------------------------------------------------------- runs

    /// @notice Create a training run; its parameters never change.
    /// @param configHash Hash of the run's full configuration; must be nonzero.
    /// @param numStages Number of pipeline stages (>= 1).
    /// @param innerSteps Inner steps H per outer round (>= 1).
    /// @param minStake Wei each member must stake to join.
    /// @param quorum Distinct member signatures a commit or a verdict needs (>= 1).
    /// @param unbondingBlocks Blocks between `leaveRun` and the earliest `withdrawStake`.
    /// @param maxRounds Rounds 0 .. maxRounds-1 may be committed; 0 leaves the run open-ended.
    /// @param configUri Where to fetch the configuration whose hash is `configHash` (emitted, not stored).
    /// @return runId The new run's id (ids start at 1).
    function createRun(
        bytes32 configHash,
        uint32 numStages,
        uint32 innerSteps,
        uint256 minStake,
        uint32 quorum,
        uint64 unbondingBlocks,
        uint64 maxRounds,
        string calldata configUri
    ) external returns (uint256 runId) {
        if (configHash == bytes32(0)) revert LedgerZeroHash();
        if (numStages == 0 || innerSteps == 0) revert LedgerBadRunShape(numStages, innerSteps);
        if (quorum == 0) revert LedgerBadQuorum(quorum);
        runId = ++_runCount;
        bytes32 genesis = keccak256(abi.encode(block.chainid, address(this), runId, configHash));
        Run storage run = _runs[runId];
        run.maxRounds = maxRounds;
        run.quorum = quorum;
        run.creator = msg.sender;
        run.numStages = numStages;
        run.innerSteps = innerSteps;
        run.unbondingBlocks = unbondingBlocks;
        run.minStake = minStake;
        run.configHash = configHash;
        run.headHash = genesis;
        emit RunCreated(
            runId,
            msg.sender,
            configHash,
            numStages,
            innerSteps,
            minStake,
            quorum,
            unbondingBlocks,
            maxRounds,
            genesis,
            configUri
        );
    }

    // ------------------------------------------------------------------------------------------- membership

    /// @notice Join run `runId` as a signing member, staking `msg.value` wei.
    /// @param runId The run.
    /// @dev The caller must be registered in the NodeRegistry; its node key is copied into the seat, so the
    /// membership does not depend on later registry changes. A slashed account can never join again.
    function joinRun(uint256 runId) external payable {
        Run storage run = _existingRun(runId);
        bytes32 nodeKey = _registry.keyOf(msg.sender);
        if (nodeKey == bytes32(0)) revert LedgerNotRegistered(msg.sender);
        if (msg.value < run.minStake) revert LedgerStakeTooLow(run.minStake, msg.value);
        Member storage member = _members[runId][msg.sender];
        if (member.status == MemberStatus.Slashed) revert LedgerMemberSlashed(runId, msg.sender);
        if (member.status != MemberStatus.None) revert LedgerAlreadyMember(runId, msg.sender);

        member.nodeKey = nodeKey;
        member.stake = uint128(msg.value);
        member.unbondingEnd = 0;
        member.status = MemberStatus.Active;
        run.memberCount += 1;
        emit MemberJoined(runId, msg.sender, nodeKey, msg.value);
    }

    /// @notice Leave run `runId`: the caller stops counting as a signer now and its stake unbonds.
    /// @param runId The run.
    function leaveRun(uint256 runId) external {
        Run storage run = _existingRun(runId);
        Member storage member = _members[runId][msg.sender];
        if (member.status != MemberStatus.Active) revert LedgerNotMember(runId, msg.sender);
        uint64 unbondingEnd = uint64(block.number) + run.unbondingBlocks;
        member.status = MemberStatus.Unbonding;
        member.unbondingEnd = unbondingEnd;
        run.memberCount -= 1;
        emit MemberLeft(runId, msg.sender, unbondingEnd);
    }

    /// @notice Take back the caller's stake in run `runId` once unbonding is over and no accusation is open.
    /// @param runId The run.
    function withdrawStake(uint256 runId) external {
        _existingRun(runId);
        Member storage member = _members[runId][msg.sender];
        if (member.status != MemberStatus.Unbonding) revert LedgerNotUnbonding(runId, msg.sender);
        if (block.number < member.unbondingEnd) {
            revert LedgerStillUnbonding(runId, msg.sender, member.unbondingEnd);
        }
        if (member.openAccusations > 0) revert LedgerAccusationPending(runId, msg.sender, member.openAccusations);
        uint256 stake = member.stake;

        // Effects before the refund call, so a re-entrant call finds the seat already gone.
        delete _members[runId][msg.sender];
        emit StakeWithdrawn(runId, msg.sender, stake);

        if (stake > 0) {
            (bool ok,) = payable(msg.sender).call{value: stake}("");
            if (!ok) revert LedgerRefundFailed(msg.sender, stake);
        }
    }

    // ------------------------------------------------------------------------------------------- rounds

    /// @notice Commit the round `record` describes, attested by at least `quorum` members.
    /// @param record The round's record; `round` must be the run's next round and `prevHead` its current head.
    /// @param signatures Concatenated 65-byte signatures (r, s, v) over the record's EIP-712 digest, by
    /// distinct current members in strictly ascending signer address order.
    /// @dev Any current member may submit. The checkpoint, if `checkpointHash` is nonzero, is published with
    /// the round (fetchable as dlx://blob/<hash>).
    function commitRound(Record calldata record, bytes calldata signatures) external {
        uint256 runId = record.runId;
        Run storage run = _existingRun(runId);
        if (_members[runId][msg.sender].status != MemberStatus.Active) revert LedgerNotMember(runId, msg.sender);
        uint64 round = record.round;
        if (round != run.commitCount) revert LedgerRoundNotNext(run.commitCount, round);
        if (run.maxRounds != 0 && round >= run.maxRounds) revert LedgerRoundBeyondMax(run.maxRounds, round);
        bytes32 head = run.headHash;
        if (record.prevHead != head) revert LedgerStaleHead(head, record.prevHead);
        if (record.weightsRoot == bytes32(0) || record.contributionsRoot == bytes32(0)) revert LedgerZeroHash();

        bytes32 structHash = _hashRecord(record);
        address[] memory attesters = _quorumSigners(runId, _hashTypedData(structHash), signatures, run.quorum, address(0));
        head = keccak256(abi.encode(head, structHash));
        _recordHashes[runId][round] = structHash;
        run.headHash = head;
        run.commitCount = round + 1;
        if (record.checkpointHash != bytes32(0)) {
            _checkpoints[runId][round] = record.checkpointHash;
            run.latestCheckpointRound = round;
            run.checkpointCount += 1;
        }
        emit RoundCommitted(runId, round, msg.sender, record, attesters, head);
    }

    /// @notice Record on chain that a member computed a different record for a committed round.
    /// @param record The record the disputer computed; it must differ from the committed one.
    /// @param signature The disputer's 65-byte signature over `record` (the disputer is its signer).
    /// @dev Anyone may submit; the signer must hold a stake in the run. Each member disputes a round once, and
    /// a dispute cannot be withdrawn. A member that also attested the committed record has now signed two
    /// records for the round: its dispute is equivocation evidence against itself.
    function dispute(Record calldata record, bytes calldata signature) external {
        uint256 runId = record.runId;
        uint64 round = record.round;
        _existingRun(runId);
        bytes32 committed = _recordHashes[runId][round];
        if (committed == bytes32(0)) revert LedgerRoundNotCommitted(runId, round);
        bytes32 structHash = _hashRecord(record);
        if (structHash == committed) revert LedgerDisputeMatchesCommit(runId, round);
        address disputer = _recover(_hashTypedData(structHash), signature, 0);
        _requireBonded(runId, disputer);
        if (_disputed[runId][round][disputer]) revert LedgerAlreadyDisputed(runId, round, disputer);

        _disputed[runId][round][disputer] = true;
        _disputeCounts[runId][round] += 1;
        emit RoundDisputed(runId, round, disputer, record, signature);
    }

    /// @notice Slash a member that signed two different records for the same round of a run.
    /// @param recordA One record.
    /// @param signatureA The member's 65-byte signature over `recordA`.
    /// @param recordB Another record for the same run and round.
    /// @param signatureB The same member's 65-byte signature over `recordB`.
    /// @dev Anyone may report. The member must still hold its stake (active or unbonding): the stake is kept
    /// by this contract for good and the member removed from the run.
    function reportEquivocation(
        Record calldata recordA,
        bytes calldata signatureA,
        Record calldata recordB,
        bytes calldata signatureB
    ) external {
        bytes32 hashA = _hashRecord(recordA);
        bytes32 hashB = _hashRecord(recordB);
        if (recordA.runId != recordB.runId || recordA.round != recordB.round || hashA == hashB) {
            revert LedgerNotEquivocation(hashA, hashB);
        }
        uint256 runId = recordA.runId;
        _existingRun(runId);
        address signerA = _recover(_hashTypedData(hashA), signatureA, 0);
        address signerB = _recover(_hashTypedData(hashB), signatureB, 1);
        if (signerA != signerB) revert LedgerDifferentSigners(signerA, signerB);
        _requireBonded(runId, signerA);

        emit EquivocationReported(runId, signerA, recordA.round, hashA, hashB, msg.sender);
        _slash(runId, signerA);
    }

    // ------------------------------------------------------------------------------------------- accusations

    /// @notice Accuse a staked member of run `runId`; until resolved, the accused cannot withdraw its stake.
    /// @param runId The run.
    /// @param accused A member holding a stake in the run (active or unbonding).
    /// @param evidenceHash Hash of the off-chain evidence; nonzero, once per (accused, evidence).
    /// @dev Only a current member may accuse.
    function accuse(uint256 runId, address accused, bytes32 evidenceHash) external {
        _existingRun(runId);
        if (_members[runId][msg.sender].status != MemberStatus.Active) revert LedgerNotMember(runId, msg.sender);
        if (evidenceHash == bytes32(0)) revert LedgerZeroHash();
        _requireBonded(runId, accused);
        if (_accusations[runId][accused][evidenceHash] != AccusationStatus.None) {
            revert LedgerAccusationExists(runId, accused, evidenceHash);
        }
        _accusations[runId][accused][evidenceHash] = AccusationStatus.Open;
        _members[runId][accused].openAccusations += 1;
        emit AccusationOpened(runId, accused, msg.sender, evidenceHash);
    }

    /// @notice Decide an open accusation with `quorum` member signatures over `verdict`.
    /// @param verdict The decision; guilty slashes the accused and removes it from the run.
    /// @param signatures Concatenated 65-byte signatures over the verdict's EIP-712 digest by distinct current
    /// members, ascending by signer address; the accused's own signature is not counted.
    /// @dev Anyone may submit.
    function resolveAccusation(Verdict calldata verdict, bytes calldata signatures) external {
        uint256 runId = verdict.runId;
        Run storage run = _existingRun(runId);
        address accused = verdict.accused;
        if (_accusations[runId][accused][verdict.evidenceHash] != AccusationStatus.Open) {
            revert LedgerAccusationNotOpen(runId, accused, verdict.evidenceHash);
        }
        bytes32 structHash = keccak256(
            abi.encode(_VERDICT_TYPEHASH, runId, accused, verdict.evidenceHash, verdict.guilty)
        );
        address[] memory signers = _quorumSigners(runId, _hashTypedData(structHash), signatures, run.quorum, accused);

        _accusations[runId][accused][verdict.evidenceHash] =
            verdict.guilty ? AccusationStatus.Guilty : AccusationStatus.Cleared;
        Member storage member = _members[runId][accused];
        member.openAccusations -= 1;
        emit AccusationResolved(runId, accused, verdict.evidenceHash, verdict.guilty, signers);
        if (verdict.guilty && member.status != MemberStatus.Slashed) _slash(runId, accused);
    }

    // ------------------------------------------------------------------------------------------- views

    /// @notice The NodeRegistry this ledger trusts.
    /// @return The registry's address.
    function registry() external view returns (NodeRegistry) {
        return _registry;
    }

    /// @notice The EIP-712 domain (EIP-5267).
    /// @return fields 0x0f: name, version, chainId and verifyingContract are used.
    /// @return name The domain name.
    /// @return version The domain version.
    /// @return chainId The chain id.
    /// @return verifyingContract This ledger.
    /// @return salt Unused (zero).
    /// @return extensions Unused (empty).
    function eip712Domain()
        external
        view
        returns (
            bytes1 fields,
            string memory name,
            string memory version,
            uint256 chainId,
            address verifyingContract,
            bytes32 salt,
            uint256[] memory extensions
        )
    {
        return (hex"0f", "dlx-node TrainingLedger", "1", block.chainid, address(this), bytes32(0), new uint256[](0));
    }

    /// @notice The EIP-712 digest members sign for `record`.
    /// @param record The record.
    /// @return The digest keccak256("\x19\x01" || domainSeparator || hashStruct(record)).
    function recordDigest(Record calldata record) external view returns (bytes32) {
        return _hashTypedData(_hashRecord(record));
    }

    /// @notice The number of runs created so far (the latest run id).
    /// @return The count.
    function runCount() external view returns (uint256) {
        return _runCount;
    }

    /// @notice Run `runId`'s parameters and progress.
    /// @param runId The run.
    /// @return The run (all zero for an unknown run).
    function runOf(uint256 runId) external view returns (Run memory) {
        return _runs[runId];
    }

    /// @notice The last committed round of run `runId`.
    /// @param runId The run.
    /// @return The round; 0 also when nothing is committed yet (see `commitCount`).
    function lastRound(uint256 runId) external view returns (uint64) {
        uint64 count = _runs[runId].commitCount;
        return count > 0 ? count - 1 : 0;
    }

    /// @notice The number of rounds committed for run `runId` (also the next round's number).
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

    /// @notice The EIP-712 struct hash of the record committed for round `round` of run `runId`.
    /// @param runId The run.
    /// @param round The outer round.
    /// @return The struct hash, or zero if the round is not committed (the record is in RoundCommitted).
    function recordHashOf(uint256 runId, uint64 round) external view returns (bytes32) {
        return _recordHashes[runId][round];
    }

    /// @notice The content hash of the checkpoint committed with round `round` of run `runId`.
    /// @param runId The run.
    /// @param round The outer round.
    /// @return The content hash, or zero if the round has none.
    function checkpointOf(uint256 runId, uint64 round) external view returns (bytes32) {
        return _checkpoints[runId][round];
    }

    /// @notice The seat of `account` in run `runId`.
    /// @param runId The run.
    /// @param account The account.
    /// @return The seat (status None and zeros if it never joined or withdrew).
    function memberOf(uint256 runId, address account) external view returns (Member memory) {
        return _members[runId][account];
    }

    /// @notice The state of the accusation (`runId`, `accused`, `evidenceHash`).
    /// @param runId The run.
    /// @param accused The accused account.
    /// @param evidenceHash The evidence's hash.
    /// @return The status (None if never opened).
    function accusationOf(uint256 runId, address accused, bytes32 evidenceHash)
        external
        view
        returns (AccusationStatus)
    {
        return _accusations[runId][accused][evidenceHash];
    }

    /// @notice The number of disputes raised against round `round` of run `runId`.
    /// @param runId The run.
    /// @param round The outer round.
    /// @return The count.
    function disputeCount(uint256 runId, uint64 round) external view returns (uint256) {
        return _disputeCounts[runId][round];
    }

    /// @notice Wei slashed so far over all runs (held by this contract for good).
    /// @return The total.
    function slashedTotal() external view returns (uint256) {
        return _slashedTotal;
    }

    // ------------------------------------------------------------------------------------------- internals

    function _existingRun(uint256 runId) private view returns (Run storage run) {
        run = _runs[runId];
        if (run.headHash == bytes32(0)) revert LedgerUnknownRun(runId);
    }

    function _requireBonded(uint256 runId, address account) private view {
        MemberStatus status = _members[runId][account].status;
        if (status != MemberStatus.Active && status != MemberStatus.Unbonding) revert LedgerNotBonded(runId, account);
    }

    function _slash(uint256 runId, address account) private {
        Member storage member = _members[runId][account];
        if (member.status == MemberStatus.Active) _runs[runId].memberCount -= 1;
        uint256 stake = member.stake;
        member.status = MemberStatus.Slashed;
        member.stake = 0;
        _slashedTotal += stake;
        emit MemberSlashed(runId, account, stake);
    }

    /// @dev The signers of `signatures` over `digest`, strictly ascending; each but `excluded` a current member
    /// of `runId`, and at least `quorum` of them. Returns the counted signers (`excluded` left out).
    function _quorumSigners(
        uint256 runId,
        bytes32 digest,
        bytes calldata signatures,
        uint32 quorum,
        address excluded
    ) private view returns (address[] memory signers) {
        if (signatures.length % _SIGNATURE_LENGTH != 0) revert LedgerBadSignaturesLength(signatures.length);
        uint256 count = signatures.length / _SIGNATURE_LENGTH;
        signers = new address[](count);
        uint256 counted = 0;
        address previous = address(0);
        mapping(address account => Member) storage members = _members[runId];
        for (uint256 i = 0; i < count; ++i) {
            address signer = _recover(digest, signatures[i * _SIGNATURE_LENGTH:(i + 1) * _SIGNATURE_LENGTH], i);
            if (signer <= previous) revert LedgerSignersNotAscending(previous, signer);
            previous = signer;
            if (signer == excluded) continue; // present but not counted, whatever its seat
            if (members[signer].status != MemberStatus.Active) revert LedgerSignerNotMember(runId, signer);
            signers[counted++] = signer;
        }
        if (counted < quorum) revert LedgerQuorumNotMet(quorum, counted);
        assembly ("memory-safe") {
            mstore(signers, counted)
        }
    }

    /// @dev The signer of the 65-byte (r, s, v) `signature` over `digest`; rejects a wrong length, a high `s`
    /// (malleable), a `v` other than 27/28 and an unrecoverable signature with LedgerInvalidSignature(index).
    function _recover(bytes32 digest, bytes calldata signature, uint256 index) private pure returns (address signer) {
        if (signature.length != _SIGNATURE_LENGTH) revert LedgerInvalidSignature(index);
        bytes32 r;
        bytes32 s;
        uint8 v;
        assembly ("memory-safe") {
            r := calldataload(signature.offset)
            s := calldataload(add(signature.offset, 32))
            v := byte(0, calldataload(add(signature.offset, 64)))
        }
        if (uint256(s) > _MAX_S || (v != 27 && v != 28)) revert LedgerInvalidSignature(index);
        signer = ecrecover(digest, v, r, s);
        if (signer == address(0)) revert LedgerInvalidSignature(index);
    }

    function _hashRecord(Record calldata record) private pure returns (bytes32) {
        return keccak256(abi.encode(_RECORD_TYPEHASH, record));
    }

    function _hashTypedData(bytes32 structHash) private view returns (bytes32 digest) {
        bytes32 separator = (block.chainid == _cachedChainId && address(this) == _cachedThis)
            ? _cachedDomainSeparator
            : _buildDomainSeparator();
        assembly ("memory-safe") {
            let ptr := mload(0x40)
            mstore(ptr, hex"1901")
            mstore(add(ptr, 0x02), separator)
            mstore(add(ptr, 0x22), structHash)
            digest := keccak256(ptr, 0x42)
        }
    }

    function _buildDomainSeparator() private view returns (bytes32) {
        return keccak256(abi.encode(_DOMAIN_TYPEHASH, _HASHED_NAME, _HASHED_VERSION, block.chainid, address(this)));
    }
}
