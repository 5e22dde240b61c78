// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {AggregationProver} from "./AggregationProver.sol";
import {LedgerAccusations} from "./LedgerAccusations.sol";
import {LedgerCore} from "./LedgerCore.sol";
import {LedgerDisputes} from "./LedgerDisputes.sol";
import {LedgerMembership} from "./LedgerMembership.sol";
import {NodeRegistry} from "./NodeRegistry.sol";

/// @title TrainingLedger
/// @notice The on-chain record of dlx-node training runs. Each run has staked members; an outer round is
/// committed only with the EIP-712 signatures of a quorum of distinct members over the round's record, and a
/// running hash chain links a run's records. The quorum is max(k, ceil(quorumBps / 10000 x active members)),
/// so a few fresh stakes are not a quorum of a large run; a member that attested none of the last
/// `inactivityRounds` committed rounds can be ejected by anyone, so silent members stop counting. A member
/// that signs two different records for one round (equivocation), or that a quorum of the members in force
/// finds guilty on an accusation, loses its stake and its seat. Accusations and disputes each cost a bond
/// and have a deadline; stakes unbond for at least the accusation deadline plus the dispute window.
/// @dev Trust model, typed data and hash chain: docs/LEDGER.md. Per-round contributor data lives off-chain
/// behind `contributionsRoot`, so a commit's gas depends only on the number of signatures.
/// The hot path (commitRound, attest) and the views are here; the other calls run in linked libraries on this
/// contract's storage (DELEGATECALL): LedgerMembership (runs and seats), LedgerDisputes (disputes, the fraud
/// proof's overturn, equivocation) and LedgerAccusations. Their events and errors are declared here, so this
/// contract's ABI has them all (docs/LEDGER.md, "Where the code lives").
///
/// EIP-712 domain: {name: "dlx-node TrainingLedger", version: "1", chainId, verifyingContract: this}.
/// Hash chain: head_0 = keccak256(abi.encode(chainid, ledger, runId, configHash)) and
/// head_n = keccak256(abi.encode(head_{n-1}, hashStruct(record_n))), where record_n.prevHead == head_{n-1}.
///
/// Slashed stakes and forfeited bonds stay in this contract for good (they are burned in effect), so a slash
/// by a vote pays nobody and no one profits from accusing; the one exception is a fraud proof
/// (AggregationProver, deployed by this constructor): it pays its prover half of the stake it slashes.
contract TrainingLedger {
    /// @notice The parameters a run is created with; they never change.
    struct RunParams {
        bytes32 configHash; // hash of the run's full configuration (model, data, hyperparameters, stages, H)
        uint32 numStages;
        uint32 innerSteps;
        uint256 minStake; // wei each member stakes to join
        uint16 quorum; // k: the fewest member signatures a commit or a verdict needs (>= 1)
        uint16 quorumBps; // the quorum is also at least this fraction (basis points) of the members counted
        uint128 bond; // wei an accuser or a disputer deposits (see accuse, dispute)
        uint64 unbondingBlocks; // blocks between leaving and the earliest withdrawal
        uint64 accusationBlocks; // blocks an accusation stays open before it lapses
        uint64 disputeBlocks; // blocks after a commit during which it can be disputed
        uint32 inactivityRounds; // committed rounds without a member's signature after which it can be ejected
        uint64 maxRounds; // rounds 0 .. maxRounds-1 may be committed; 0: open-ended
        uint32 tenureRounds; // rounds a joiner is in force before its signature counts (founders count at once)
        // How the run's records commit the stages' states (the run document's diloco.commitments;
        // docs/FRAUD_PROOF.md): 1 hashed, 2 chunked, 3 normed. The prover holds a round's factors to it.
        uint8 commitments;
        // issue 62: per-round values. What a chunked (2) or normed (3) run's rounds must commit, derived by the
        // node from the run document (node/commitments/values.py; docs/FRAUD_PROOF.md, "The run's values"); the
        // proofs hold every round's factors to them. A hashed run (1) may leave them zero.
        bytes32 scheduleRoot; // ledger/merkle.py root over abi.encode(uint64 round, uint32 lrBits, uint32 muBits)
        uint64 scheduleRounds; // leaves of scheduleRoot (rounds 0 .. scheduleRounds-1; later ones use the last); 0: unbound
        bool nesterov; // the outer step is Nesterov's (bound with the schedule)
        uint64 normClipBits; // the run's norm_clip, binary64 bits (0: the rule is off; bound with the schedule)
        bytes32 genesisRoot; // the version-2/3 weights root of round 0's start (zero momentum); zero: none
        uint16 maxContributions; // the most contributions a round's stage may list (chunked/normed: >= 1)
        uint8 maxRank; // the largest low-rank rank a listed piece may have (chunked/normed: 1 .. 64)
        // issue 62: the clock
        // Steps (availability challenges) one challenger's game on one stage of one round may take, >= 1: the
        // bisection of the largest stage's chunks, ceil(log2(chunks)) + a few (docs/FRAUD_PROOF.md).
        uint16 maxGameSteps;
    }

    /// @notice A run's per-round values (RunParams after `issue 62: per-round values`), as the provers read them.
    struct RunValues {
        bytes32 scheduleRoot;
        bytes32 genesisRoot;
        uint64 scheduleRounds;
        uint64 normClipBits;
        uint16 maxContributions;
        uint8 maxRank;
        bool nesterov;
    }

    /// @notice A run's fixed parameters and its progress.
    /// @dev The first slot holds what a commit updates and the quorum rule reads; it is nonzero from creation on
    /// (quorum >= 1), so the run's first commit costs no more than later ones.
    struct Run {
        uint64 commitCount; // rounds committed; the next round to commit has this number
        uint64 checkpointEnd; // 1 + the latest round that published a checkpoint; 0: none yet
        uint16 quorum;
        uint16 quorumBps;
        uint32 memberCount; // members currently able to sign (Active)
        uint32 countedCount; // Active members whose signatures count toward the quorum (see Member.countedBlock)
        uint32 tenureRounds;
        bytes32 headHash; // head of the run's hash chain; nonzero once the run exists
        address creator;
        uint32 numStages;
        uint32 innerSteps;
        uint32 inactivityRounds;
        uint64 maxRounds;
        uint64 invalidFrom; // 1 + the first round overturned (a verdict or a fraud proof); 0: none. Then halted.
        uint64 unbondingBlocks;
        uint64 accusationBlocks;
        uint64 disputeBlocks;
        uint8 commitments; // RunParams.commitments
        uint256 minStake;
        uint256 bond;
        bytes32 configHash;
        // issue 62: the clock
        uint16 maxGameSteps; // RunParams.maxGameSteps
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
        Unbonding, // left or was ejected: cannot sign records, stake still held (slashable) until withdrawn
        Slashed // stake taken; may never join the run again
    }

    /// @notice A run member's seat.
    struct Member {
        bytes32 nodeKey; // the registry's key of the account when it joined
        uint128 stake; // wei held for the member, dispute bonds included (2^128 wei exceeds all ether)
        uint64 activeRound; // the first round it has not attested: commitCount at joining, round + 1 after each
        uint32 openAccusations;
        MemberStatus status;
        uint64 joinRound; // commitCount when it joined: in force for this round and later ones
        uint64 leftRound; // commitCount when it left or was ejected (not Active): in force for earlier rounds
        uint64 joinBlock;
        uint64 unbondingEnd; // first block at which withdrawStake succeeds (set on leaving); left at end - unbonding
        uint64 countedBlock; // block from which its signatures count toward quorums; 0: not (yet) counted
        // issue 79: its last withdrawn seat, in force in rounds pastJoinRound .. pastUntil - 1 (pastUntil: 1 + the
        // commitCount at the withdrawal; 0: none). Kept across a rejoin, so a withdrawal or a rejoin never
        // unbinds a contribution a round listed (ProverBinding).
        uint64 pastJoinRound;
        uint64 pastUntil;
    }

    enum AccusationStatus {
        None,
        Open,
        Guilty,
        Cleared,
        Expired
    }

    enum DisputeStatus {
        None, // never disputed
        Open, // disputed; a verdict may come until the deadline
        Upheld, // a quorum of the round's counted members upheld the committed record
        Overturned, // a quorum of the round's counted members found it wrong: its attesters were slashed
        Lapsed // no verdict by the deadline: the committed record stands
    }

    /// @notice The disputes of one committed round, settled together.
    struct DisputeCase {
        DisputeStatus status;
        uint64 deadline; // first block at which no verdict is taken (expireDispute)
        uint32 disputers; // disputes filed, each with the run's bond
    }

    /// @notice The outcome of a round's disputes (EIP-712 type `RoundVerdict`).
    struct RoundVerdict {
        uint256 runId;
        uint64 round;
        bytes32 recordHash; // the committed record's struct hash
        bool upheld;
    }

    /// @notice An accusation's state.
    struct Accusation {
        AccusationStatus status;
        address accuser;
        uint64 openedBlock; // members that joined before this block and had not left by its end may decide
        uint64 deadline; // first block at which it lapses (expireAccusation) and no verdict is taken
        uint32 quorum; // verdict signatures needed: max(k, ceil(quorumBps x members counted at opening))
        uint128 bond; // wei the accuser deposited: returned if guilty, forfeited otherwise
    }

    /// @notice The ledger's storage, one struct so that its libraries (LedgerMembership, LedgerDisputes,
    /// LedgerAccusations) take it by reference; the slots are those of the state variables it replaced.
    struct LedgerState {
        uint256 runCount;
        uint256 slashedTotal;
        uint256 forfeitedTotal;
        mapping(uint256 runId => Run) runs;
        mapping(uint256 runId => mapping(uint64 round => bytes32 structHash)) recordHashes;
        // The commit's block number in the low 64 bits, the quorum it needed above them.
        mapping(uint256 runId => mapping(uint64 round => uint256 blockAndQuorum)) commitBlocks;
        mapping(uint256 runId => mapping(uint64 round => bytes32 contentHash)) checkpoints;
        mapping(uint256 runId => mapping(address account => Member)) members;
        mapping(uint256 runId => mapping(uint64 round => address[])) disputers;
        // keccak256(abi.encode(attesters)) of each commit: who a verdict that overturns it slashes.
        mapping(uint256 runId => mapping(uint64 round => bytes32)) attestations;
        mapping(uint256 runId => mapping(uint64 round => DisputeCase)) disputeCases;
        mapping(uint256 runId => mapping(uint64 round => mapping(address account => bool))) disputed;
        mapping(uint256 runId => mapping(address accused => mapping(bytes32 evidenceHash => Accusation)))
            accusations;
        mapping(uint256 runId => RunValues) values; // issue 62: per-round values
        // issue 79: each run's proof fund, what a fraud proof's reward is paid from (never the slash)
        mapping(uint256 runId => uint256) proofFunds;
        uint256 proofFundTotal; // the sum of proofFunds
    }

    NodeRegistry private immutable _registry;
    AggregationProver private immutable _prover;
    bytes32 private immutable _cachedDomainSeparator;
    uint256 private immutable _cachedChainId;
    address private immutable _cachedThis;

    LedgerState private _s;

    /// @notice Run `runId` was created by `creator` with `params`; `genesisHead` starts its hash chain.
    event RunCreated(
        uint256 indexed runId, address indexed creator, RunParams params, bytes32 genesisHead, string configUri
    );
    /// @notice `account` joined run `runId` with node key `nodeKey`, staking `stake` wei, declaring that it
    /// trains on the platform whose fingerprint hashes to `platform` (held to it off-chain: docs/TRUST.md).
    event MemberJoined(
        uint256 indexed runId, address indexed account, bytes32 nodeKey, uint256 stake, bytes32 platform
    );
    /// @notice `account` left run `runId` (or was ejected); its stake can be withdrawn from block
    /// `unbondingEnd` on.
    event MemberLeft(uint256 indexed runId, address indexed account, uint64 unbondingEnd);
    /// @notice `ejector` ejected `account` from run `runId` for attesting none of its last `missedRounds`
    /// committed rounds (MemberLeft follows).
    event MemberEjected(uint256 indexed runId, address indexed account, address ejector, uint64 missedRounds);
    /// @notice `account`'s signatures count toward run `runId`'s quorums from this block on (a founder, or a
    /// joiner credited with a round after its tenure).
    event MemberCounted(uint256 indexed runId, address indexed account);
    /// @notice `account` was credited with round `round` of run `runId` by its own signature over the
    /// committed record (see attest).
    event RoundAttested(uint256 indexed runId, uint64 indexed round, address indexed account);
    /// @notice The disputes of round `round` of run `runId` were settled: `upheld` by `signers` (ascending).
    event DisputeResolved(uint256 indexed runId, uint64 indexed round, bool upheld, address[] signers);
    /// @notice The disputes of round `round` of run `runId` reached their deadline without a verdict: the
    /// committed record stands.
    event DisputeLapsed(uint256 indexed runId, uint64 indexed round);
    /// @notice A verdict overturned round `round` of run `runId`: it and every later round are invalid and the
    /// run commits nothing more.
    event RunHalted(uint256 indexed runId, uint64 round);
    /// @notice `funder` added `amount` wei to run `runId`'s proof fund (createRun's value, or fundProofs).
    event ProofFunded(uint256 indexed runId, address indexed funder, uint256 amount);
    /// @notice A fraud proof overturned round `round` of run `runId`; `prover` was paid `reward` wei from the run's
    /// proof fund (issue 79: the slash itself is burned whole).
    event ProverRewarded(uint256 indexed runId, uint64 indexed round, address indexed prover, uint256 reward);
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
    /// committed one in its weights root, contributions root or checkpoint hash.
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
    /// @notice Member `accuser` accused `accused` in run `runId`, pointing at off-chain `evidenceHash`, with a
    /// bond of `bond` wei; a verdict needs `quorum` signatures before block `deadline`.
    event AccusationOpened(
        uint256 indexed runId,
        address indexed accused,
        address indexed accuser,
        bytes32 evidenceHash,
        uint256 bond,
        uint64 deadline,
        uint32 quorum
    );
    /// @notice The accusation (`runId`, `accused`, `evidenceHash`) was decided by `signers` (ascending).
    event AccusationResolved(
        uint256 indexed runId, address indexed accused, bytes32 evidenceHash, bool guilty, address[] signers
    );
    /// @notice The accusation (`runId`, `accused`, `evidenceHash`) reached its deadline undecided and lapsed.
    event AccusationExpired(uint256 indexed runId, address indexed accused, bytes32 evidenceHash);
    /// @notice `account`'s bond of `amount` wei in run `runId` was forfeited (kept by this contract for good).
    event BondForfeited(uint256 indexed runId, address indexed account, uint256 amount);
    /// @notice `account`'s bond of `amount` wei in run `runId` was returned to it.
    event BondReturned(uint256 indexed runId, address indexed account, uint256 amount);

    error LedgerNotRegistered(address account);
    error LedgerUnknownRun(uint256 runId);
    error LedgerBadRunShape(uint32 numStages, uint32 innerSteps);
    error LedgerBadQuorum(uint16 quorum, uint16 quorumBps);
    error LedgerBadWindow(uint64 accusationBlocks, uint64 disputeBlocks, uint64 minimum, uint64 maximum);
    error LedgerUnbondingTooShort(uint64 unbondingBlocks, uint64 minimum);
    error LedgerUnbondingTooLong(uint64 unbondingBlocks, uint64 maximum);
    error LedgerBadInactivityRounds(uint32 inactivityRounds);
    error LedgerZeroHash();
    error LedgerStakeTooLow(uint256 required, uint256 sent);
    error LedgerBondMismatch(uint256 required, uint256 sent);
    error LedgerAlreadyMember(uint256 runId, address account);
    error LedgerMemberSlashed(uint256 runId, address account);
    error LedgerNotMember(uint256 runId, address account);
    error LedgerNotUnbonding(uint256 runId, address account);
    error LedgerStillUnbonding(uint256 runId, address account, uint64 unbondingEnd);
    error LedgerAccusationPending(uint256 runId, address account, uint32 openAccusations);
    error LedgerRefundFailed(address account, uint256 amount);
    error LedgerMemberNotInactive(uint256 runId, address account, uint64 missedRounds, uint32 inactivityRounds);
    error LedgerRoundNotNext(uint64 expected, uint64 got);
    error LedgerRoundBeyondMax(uint64 maxRounds, uint64 got);
    error LedgerStaleHead(bytes32 head, bytes32 prevHead);
    error LedgerBadSignaturesLength(uint256 length);
    error LedgerInvalidSignature(uint256 index);
    error LedgerSignerNotMember(uint256 runId, address signer);
    error LedgerSignerNotInForce(uint256 runId, address signer, uint64 openedBlock);
    error LedgerSignersNotAscending(address previous, address signer);
    error LedgerQuorumNotMet(uint32 quorum, uint256 signers);
    error LedgerNotEquivocation(bytes32 recordHashA, bytes32 recordHashB);
    error LedgerDifferentSigners(address signerA, address signerB);
    error LedgerNotBonded(uint256 runId, address account);
    error LedgerRoundNotCommitted(uint256 runId, uint64 round);
    error LedgerNotCommittedRecord(uint256 runId, uint64 round);
    error LedgerDisputeMatchesCommit(uint256 runId, uint64 round);
    error LedgerDisputeOnlyMetrics(uint256 runId, uint64 round);
    error LedgerDisputeWindowClosed(uint256 runId, uint64 round, uint64 closedAt);
    error LedgerNotInForce(uint256 runId, uint64 round, address account);
    error LedgerAlreadyDisputed(uint256 runId, uint64 round, address account);
    error LedgerAccusationExists(uint256 runId, address accused, bytes32 evidenceHash);
    error LedgerAccusationNotOpen(uint256 runId, address accused, bytes32 evidenceHash);
    error LedgerAccusationExpired(uint256 runId, address accused, bytes32 evidenceHash, uint64 deadline);
    error LedgerAccusationNotExpired(uint256 runId, address accused, bytes32 evidenceHash, uint64 deadline);
    error LedgerBadTenure(uint32 tenureRounds);
    error LedgerDisputerNotSender(address signer, address sender);
    error LedgerDisputeNotOpen(uint256 runId, uint64 round);
    error LedgerDisputeExpired(uint256 runId, uint64 round, uint64 deadline);
    error LedgerDisputeNotExpired(uint256 runId, uint64 round, uint64 deadline);
    error LedgerNotAttesters(uint256 runId, uint64 round);
    error LedgerRunHalted(uint256 runId, uint64 invalidRound);
    error LedgerAccusationTooLate(uint256 runId, address accused, uint64 unbondingEnd);
    error LedgerAttestBeforeJoin(uint256 runId, uint64 round, address account);
    error LedgerAttestOtherResult(uint256 runId, uint64 round);
    error LedgerNotProver(address caller);
    error LedgerBadCommitments(uint8 commitments);
    error LedgerBadRunValues(uint16 maxContributions, uint8 maxRank, uint64 normClipBits);
    error LedgerProofTooCostly(uint256 gas, uint256 calldataBytes, uint256 maxGas, uint256 maxCalldata);
    error LedgerBadGameSteps(uint16 maxGameSteps);
    error LedgerUnbondingBelowProofWindow(uint64 unbondingBlocks, uint64 minimum);
    error LedgerRunFull(uint256 runId, uint32 seats);
    /// @param registry_ The NodeRegistry whose nodes may join runs.
    constructor(NodeRegistry registry_) {
        _registry = registry_;
        _cachedChainId = block.chainid;
        _cachedThis = address(this);
        _cachedDomainSeparator = LedgerCore.domainSeparator(address(this));
        _prover = new AggregationProver(this);
    }

    // ------------------------------------------------------------------------------------------- runs

    /// @notice Create a training run; its parameters never change.
    /// @param params The run's parameters (see RunParams). Rules: `configHash` nonzero; `numStages`,
    /// `innerSteps`, `quorum`, `inactivityRounds` >= 1; `quorumBps` <= 10000; `commitments` 1, 2 or 3; `accusationBlocks` and
    /// `disputeBlocks` in [minWindowBlocks(), maxUnbondingBlocks()]; `unbondingBlocks` in
    /// [accusationBlocks + disputeBlocks, maxUnbondingBlocks()] and at least the longest proof window,
    /// disputeBlocks + (2 maxGameSteps + 2) accusationBlocks (LedgerUnbondingBelowProofWindow); `maxGameSteps`
    /// >= 1.
    /// @param configUri Where to fetch the configuration whose hash is `configHash` (emitted, not stored).
    /// @return runId The new run's id (ids start at 1).
    /// @dev `msg.value` opens the run's proof fund (fundProofs): a fraud proof's reward is paid from it.
    function createRun(RunParams calldata params, string calldata configUri)
        external
        payable
        returns (uint256 runId)
    {
        runId = LedgerMembership.createRun(_s, params, configUri);
        if (msg.value > 0) _fundProofs(runId, msg.value);
    }

    /// @notice Add `msg.value` to run `runId`'s proof fund. A fraud proof of one of its rounds is paid from the
    /// fund, min(fund, half the stake it slashed), and never from the slash, which is burned whole (issue 79):
    /// a coalition that proves its own wrong round loses every slashed wei and recovers at most the bounty, which
    /// is not its money. Nobody withdraws a fund: what no proof takes stays here.
    /// @param runId The run.
    function fundProofs(uint256 runId) external payable {
        if (_s.runs[runId].headHash == bytes32(0)) revert LedgerUnknownRun(runId);
        _fundProofs(runId, msg.value);
    }

    /// @notice Run `runId`'s proof fund in wei: what the next fraud proof's reward is paid from.
    /// @param runId The run.
    /// @return The fund.
    function proofFundOf(uint256 runId) external view returns (uint256) {
        return _s.proofFunds[runId];
    }

    // ------------------------------------------------------------------------------------------- membership

    /// @notice Join run `runId` as a signing member, staking `msg.value` wei.
    /// @param runId The run.
    /// @param platform The hash of the platform fingerprint the member trains on, only emitted: every
    /// contribution's claimed platform is held to it off-chain (docs/DILOCOX.md section 11).
    /// @dev The caller must be registered in the NodeRegistry; its node key is copied into the seat, so the
    /// membership does not depend on later registry changes. A slashed account can never join again. A run holds
    /// at most maxSeats() active members (LedgerRunFull): a proof slashes every attester of a round, and the cap
    /// keeps that proof inside a block at the largest quorum (issue 79).
    function joinRun(uint256 runId, bytes32 platform) external payable {
        LedgerMembership.joinRun(_s, _registry, runId, platform);
    }

    /// @notice Leave run `runId`: the caller stops counting as a signer now and its stake unbonds.
    /// @param runId The run.
    function leaveRun(uint256 runId) external {
        LedgerMembership.leaveRun(_s, runId);
    }

    /// @notice Eject an active member of run `runId` that attested none of the last `inactivityRounds`
    /// committed rounds (counted from when it joined): it stops counting toward the quorum and its stake
    /// unbonds as if it had left. Anyone may call.
    /// @param runId The run.
    /// @param account The silent member.
    function ejectInactive(uint256 runId, address account) external {
        LedgerMembership.ejectInactive(_s, runId, account);
    }

    /// @notice Take back the caller's stake in run `runId` once unbonding is over and no accusation is open.
    /// @param runId The run.
    function withdrawStake(uint256 runId) external {
        LedgerMembership.withdrawStake(_s, runId);
    }

    // ------------------------------------------------------------------------------------------- rounds

    /// @notice Commit the round `record` describes, attested by at least `quorumOf(runId)` members.
    /// @param record The round's record; `round` must be the run's next round and `prevHead` its current head.
    /// @param signatures Concatenated 65-byte signatures (r, s, v) over the record's EIP-712 digest, by
    /// distinct current members in strictly ascending signer address order. Every signer is credited with the
    /// round (see ejectInactive); only counted signers (see Member.countedBlock) make up the quorum,
    /// max(k, ceil(quorumBps x counted members)). A member left out credits itself with attest.
    /// @dev Any current member may submit. The checkpoint, if `checkpointHash` is nonzero, is published with
    /// the round (fetchable as dlx://blob/<hash>).
    function commitRound(Record calldata record, bytes calldata signatures) external {
        uint256 runId = record.runId;
        Run storage run = LedgerCore.existingRun(_s, runId);
        if (_s.members[runId][msg.sender].status != MemberStatus.Active) revert LedgerNotMember(runId, msg.sender);
        uint64 round = record.round;
        if (round != run.commitCount) revert LedgerRoundNotNext(run.commitCount, round);
        if (run.maxRounds != 0 && round >= run.maxRounds) revert LedgerRoundBeyondMax(run.maxRounds, round);
        bytes32 head = run.headHash;
        if (record.prevHead != head) revert LedgerStaleHead(head, record.prevHead);
        if (record.weightsRoot == bytes32(0) || record.contributionsRoot == bytes32(0)) revert LedgerZeroHash();
        if (run.invalidFrom != 0) revert LedgerRunHalted(runId, run.invalidFrom - 1);

        bytes32 structHash = LedgerCore.hashRecord(record);
        (address[] memory attesters, uint32 quorum) =
            _commitSigners(runId, run, round, _hashTypedData(structHash), signatures);
        head = keccak256(abi.encode(head, structHash));
        _s.recordHashes[runId][round] = structHash;
        _s.commitBlocks[runId][round] = block.number | (uint256(quorum) << 64);
        _s.attestations[runId][round] = keccak256(abi.encode(attesters));
        run.headHash = head;
        run.commitCount = round + 1;
        if (record.checkpointHash != bytes32(0)) {
            _s.checkpoints[runId][round] = record.checkpointHash;
            run.checkpointEnd = round + 1;
        }
        emit RoundCommitted(runId, round, msg.sender, record, attesters, head);
    }

    /// @notice Credit the signer of `signature` with committed round `committed.round`: a member whose signature
    /// a submitter left out of the commit, or that signed the round's result with other figures, puts it on
    /// chain itself, so that silence (ejectInactive) is the only way to be ejected, and a joiner past its tenure
    /// starts to count.
    /// @param committed The record committed for the round (from RoundCommitted).
    /// @param signed The record the member signed: `committed`, or one of the same run, round, chain head and
    /// roots (the result it computed is the committed one) whose losses, tokens, contributor count or checkpoint
    /// hash differ: what a member derives from the attestations and shards it heard of its peers, which one
    /// peer can make honest members hear differently (docs/TRUST.md, G2).
    /// @param signature The member's 65-byte signature over `signed`.
    /// @dev Anyone may submit (the signature is the member's own). The signer must be an active member that
    /// joined at or before the round.
    function attest(Record calldata committed, Record calldata signed, bytes calldata signature) external {
        uint256 runId = committed.runId;
        uint64 round = committed.round;
        Run storage run = LedgerCore.existingRun(_s, runId);
        LedgerCore.committedHash(_s, committed);
        if (
            signed.runId != runId || signed.round != round || signed.prevHead != committed.prevHead
                || signed.weightsRoot != committed.weightsRoot
                || signed.contributionsRoot != committed.contributionsRoot
        ) revert LedgerAttestOtherResult(runId, round);
        address signer = LedgerCore.recover(_hashTypedData(LedgerCore.hashRecord(signed)), signature, 0);
        Member storage member = _s.members[runId][signer];
        if (member.status != MemberStatus.Active) revert LedgerNotMember(runId, signer);
        if (member.joinRound > round) revert LedgerAttestBeforeJoin(runId, round, signer);
        LedgerCore.credit(runId, run, member, signer, round);
        emit RoundAttested(runId, round, signer);
    }

    /// @notice Dispute a committed round with the caller's own signed record of it, depositing the run's bond.
    /// The round's disputes are settled together: by a verdict of the members counted at the round
    /// (resolveDispute) before the case's deadline, else they lapse (expireDispute) and the record stands.
    /// @param committed The record committed for the round (from RoundCommitted), to compare fields with.
    /// @param disputed The record the caller computed; its weights root, contributions root or checkpoint hash
    /// must differ from the committed one (losses, tokens and contributor counts alone are refused).
    /// @param signature The caller's own 65-byte signature over `disputed`.
    /// @dev The caller must be the signer, a member in force at the round (joined before it was committed and
    /// not left before that) still holding its stake, within `disputeBlocks` of the commit; once per member and
    /// round. The bond is returned if a verdict overturns the round, forfeited if it is upheld or lapses. The
    /// first dispute of a round opens its case with a deadline `accusationBlocks` later. A member that also
    /// attested the committed record has now signed two records: equivocation evidence against itself.
    function dispute(Record calldata committed, Record calldata disputed, bytes calldata signature)
        external
        payable
    {
        LedgerDisputes.dispute(_s, _domainSeparator(), committed, disputed, signature);
    }

    /// @notice Settle the disputes of a committed round with the signatures of the round's quorum over a
    /// RoundVerdict. Upheld: the record stands and the disputers' bonds are forfeited. Overturned: every
    /// attester of the round still holding a stake is slashed, the disputers' bonds are returned, and the
    /// round and all later ones are invalid: the run is halted (it commits nothing more).
    /// @param committed The record committed for the round.
    /// @param upheld Whether the committed record stands.
    /// @param signatures Concatenated 65-byte signatures over the RoundVerdict's EIP-712 digest, ascending by
    /// signer, by distinct members counted before the round's commit block and not left before it; at least
    /// the quorum the commit needed.
    /// @param attesters The round's attesters as RoundCommitted gave them (checked against the commit).
    /// @dev Anyone may submit, before the case's deadline.
    function resolveDispute(
        Record calldata committed,
        bool upheld,
        bytes calldata signatures,
        address[] calldata attesters
    ) external {
        LedgerDisputes.resolveDispute(_s, _domainSeparator(), committed, upheld, signatures, attesters);
    }



    /// @notice Overturn round `round` of run `runId` on a fraud proof: only this ledger's AggregationProver
    /// calls it, once it has recomputed a chunk of the round and found it differs. The round and every later
    /// one are invalid, every attester still holding a stake is slashed, open disputes of the round are
    /// returned their bonds, and `recipient` (the prover) is paid min(the run's proof fund, half the stake
    /// slashed) from the fund (issue 79). The slash is burned whole, so an attester proving its own round loses
    /// all of what its round's attesters held and recovers at most the bounty, someone else's money.
    /// @param attesters The round's attesters as RoundCommitted gave them (checked against the commit).
    /// @return reward The wei paid to `recipient`.
    function invalidateByProof(uint256 runId, uint64 round, address[] calldata attesters, address recipient)
        external
        returns (uint256 reward)
    {
        if (msg.sender != address(_prover)) revert LedgerNotProver(msg.sender);
        reward = LedgerDisputes.invalidateByProof(_s, runId, round, attesters, recipient);
    }

    /// @notice Close the disputes of a round whose case deadline passed without a verdict: they lapse, the
    /// committed record stands and the disputers' bonds are forfeited. Anyone may call.
    /// @param runId The run.
    /// @param round The disputed round.
    function expireDispute(uint256 runId, uint64 round) external {
        LedgerDisputes.expireDispute(_s, runId, round);
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
        LedgerDisputes.reportEquivocation(_s, _domainSeparator(), recordA, signatureA, recordB, signatureB);
    }

    // ------------------------------------------------------------------------------------------- accusations

    /// @notice Accuse a staked member of run `runId`, depositing the run's bond; until the accusation is
    /// resolved or lapses, the accused cannot withdraw its stake.
    /// @param runId The run.
    /// @param accused A member holding a stake in the run (active or unbonding).
    /// @param evidenceHash Hash of the off-chain evidence; nonzero, once per (accused, evidence).
    /// @dev Only a current member may accuse, with `msg.value` equal to the run's bond: returned if the
    /// verdict is guilty, forfeited if it is not guilty or no verdict comes within `accusationBlocks`. The
    /// verdict's quorum is fixed now: max(k, ceil(quorumBps x counted members, the accused included)). An
    /// unbonding member can be accused only before its unbonding ends.
    function accuse(uint256 runId, address accused, bytes32 evidenceHash) external payable {
        LedgerAccusations.accuse(_s, runId, accused, evidenceHash);
    }

    /// @notice Decide an open accusation, before its deadline, with the signatures over `verdict` of its
    /// quorum of members in force when it was opened.
    /// @param verdict The decision; guilty slashes the accused, removes it from the run and returns the
    /// accuser's bond; not guilty closes the accusation and forfeits the bond.
    /// @param signatures Concatenated 65-byte signatures over the verdict's EIP-712 digest, ascending by signer
    /// address, by distinct members counted before the accusation's block and not left by its end (unbonding
    /// ones included); the accused's own signature is not counted.
    /// @dev Anyone may submit.
    function resolveAccusation(Verdict calldata verdict, bytes calldata signatures) external {
        LedgerAccusations.resolveAccusation(_s, _domainSeparator(), verdict, signatures);
    }

    /// @notice Close an accusation whose deadline passed without a verdict: it lapses, the accused's stake is
    /// free of it, and the accuser's bond is forfeited. Anyone may call.
    /// @param runId The run.
    /// @param accused The accused account.
    /// @param evidenceHash The accusation's evidence hash.
    function expireAccusation(uint256 runId, address accused, bytes32 evidenceHash) external {
        LedgerAccusations.expireAccusation(_s, runId, accused, evidenceHash);
    }

    // ------------------------------------------------------------------------------------------- views

    /// @notice The AggregationProver this ledger deployed and takes fraud proofs from (invalidateByProof).
    function prover() external view returns (AggregationProver) {
        return _prover;
    }

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
        return _hashTypedData(LedgerCore.hashRecord(record));
    }

    /// @notice The shortest accusation deadline and dispute window a run may have, in blocks.
    /// @return The minimum.
    function minWindowBlocks() external pure returns (uint64) {
        return LedgerCore.MIN_WINDOW_BLOCKS;
    }

    /// @notice The longest unbonding period (and window) a run may have, in blocks.
    /// @return The maximum.
    function maxUnbondingBlocks() external pure returns (uint64) {
        return LedgerCore.MAX_UNBONDING_BLOCKS;
    }

    /// @notice The most active members (seats) a run may hold: a round's attesters are at most that many.
    /// @return The maximum.
    function maxSeats() external pure returns (uint32) {
        return LedgerCore.MAX_SEATS;
    }

    /// @notice The number of runs created so far (the latest run id).
    /// @return The count.
    function runCount() external view returns (uint256) {
        return _s.runCount;
    }

    /// @notice Run `runId`'s parameters and progress.
    /// @param runId The run.
    /// @return The run (all zero for an unknown run).
    function runOf(uint256 runId) external view returns (Run memory) {
        return _s.runs[runId];
    }

    /// @notice Run `runId`'s per-round values (RunParams' fields after `issue 62: per-round values`).
    /// @param runId The run.
    /// @return The values (all zero for an unknown run).
    function valuesOf(uint256 runId) external view returns (RunValues memory) {
        return _s.values[runId];
    }

    /// @notice The number of counted member signatures the next commit of run `runId` needs:
    /// max(k, ceil(quorumBps x counted members / 10000)) (a joiner credited past its tenure by the commit
    /// itself raises both).
    /// @param runId The run.
    /// @return The quorum (0 for an unknown run).
    function quorumOf(uint256 runId) external view returns (uint32) {
        Run storage run = _s.runs[runId];
        return LedgerCore.quorum(run.quorum, run.quorumBps, run.countedCount);
    }

    /// @notice The last committed round of run `runId`.
    /// @param runId The run.
    /// @return The round; 0 also when nothing is committed yet (see `commitCount`).
    function lastRound(uint256 runId) external view returns (uint64) {
        uint64 count = _s.runs[runId].commitCount;
        return count > 0 ? count - 1 : 0;
    }

    /// @notice The number of rounds committed for run `runId` (also the next round's number).
    /// @param runId The run.
    /// @return The count.
    function commitCount(uint256 runId) external view returns (uint64) {
        return _s.runs[runId].commitCount;
    }

    /// @notice The head of run `runId`'s hash chain.
    /// @param runId The run.
    /// @return The head (the genesis head before the first commit; zero for an unknown run).
    function headOf(uint256 runId) external view returns (bytes32) {
        return _s.runs[runId].headHash;
    }

    /// @notice The EIP-712 struct hash of the record committed for round `round` of run `runId`.
    /// @param runId The run.
    /// @param round The outer round.
    /// @return The struct hash, or zero if the round is not committed (the record is in RoundCommitted).
    function recordHashOf(uint256 runId, uint64 round) external view returns (bytes32) {
        return _s.recordHashes[runId][round];
    }

    /// @notice The block in which round `round` of run `runId` was committed (its dispute window starts there).
    /// @param runId The run.
    /// @param round The outer round.
    /// @return The block number, or zero if the round is not committed.
    function commitBlockOf(uint256 runId, uint64 round) external view returns (uint256) {
        return uint64(_s.commitBlocks[runId][round]);
    }

    /// @notice The counted signatures the commit of round `round` of run `runId` needed (a verdict on its
    /// disputes needs as many).
    /// @param runId The run.
    /// @param round The outer round.
    /// @return The quorum, or zero if the round is not committed.
    function commitQuorumOf(uint256 runId, uint64 round) external view returns (uint32) {
        return uint32(_s.commitBlocks[runId][round] >> 64);
    }

    /// @notice keccak256(abi.encode(attesters)) of the commit of round `round` of run `runId`: the attesters
    /// RoundCommitted gave, as a contract that pays or slashes them checks them (issue 77: RewardPool).
    /// @param runId The run.
    /// @param round The outer round.
    /// @return The hash, or zero if the round is not committed.
    function attestationsOf(uint256 runId, uint64 round) external view returns (bytes32) {
        return _s.attestations[runId][round];
    }

    /// @notice The state of the disputes of round `round` of run `runId`.
    /// @param runId The run.
    /// @param round The outer round.
    /// @return The case (status None and zeros if never disputed).
    function disputeCaseOf(uint256 runId, uint64 round) external view returns (DisputeCase memory) {
        return _s.disputeCases[runId][round];
    }

    /// @notice Whether round `round` of run `runId` is final: committed, neither it nor an earlier round
    /// overturned, and nothing can still overturn it or its parent: their proof windows (proofWindowOf: the
    /// dispute window, extended while an availability game on the round can go on) closed and their disputes
    /// (if any) upheld, lapsed or past their deadline. Once true it stays true (issue 62).
    /// @param runId The run.
    /// @param round The outer round.
    /// @return Whether it is final now.
    function isFinal(uint256 runId, uint64 round) external view returns (bool) {
        Run storage run = _s.runs[runId];
        if (uint64(_s.commitBlocks[runId][round]) == 0) return false;
        if (run.invalidFrom != 0 && round + 1 >= run.invalidFrom) return false;
        // A round committed more than the longest proof window ago is closed, and so is every earlier one.
        uint256 longest = LedgerCore.proofWindowBound(run.disputeBlocks, run.accusationBlocks, run.maxGameSteps);
        for (uint64 r = round + 1; r > 0; --r) {
            (, uint64 closesAt) = _proofWindow(runId, run, r - 1);
            if (block.number < closesAt) return false;
            if (uint64(_s.commitBlocks[runId][r - 1]) + longest <= block.number) break;
        }
        return true;
    }

    /// @notice The blocks [opensAt, closesAt) in which a fraud proof of round `round` of run `runId` is taken:
    /// it opens once its parent (round - 1) can no longer be overturned (its own window closed: a proof never
    /// slashes through a wrong parent) and closes at the later of its own window's end and `accusationBlocks`
    /// after it opens. A round's own window: its dispute window, its disputes' deadline, and its availability
    /// games (AggregationProver.liveUntil). Both at most disputeBlocks + (2 maxGameSteps + 2) accusationBlocks
    /// after its commit, which unbonding covers (createRun).
    /// @param runId The run.
    /// @param round The outer round (committed).
    /// @return opensAt The first block a proof is taken.
    /// @return closesAt The first block no proof is taken.
    function proofWindowOf(uint256 runId, uint64 round) external view returns (uint64 opensAt, uint64 closesAt) {
        return _proofWindow(runId, _s.runs[runId], round);
    }

    /// @notice The content hash of the checkpoint committed with round `round` of run `runId`.
    /// @param runId The run.
    /// @param round The outer round.
    /// @return The content hash, or zero if the round has none.
    function checkpointOf(uint256 runId, uint64 round) external view returns (bytes32) {
        return _s.checkpoints[runId][round];
    }

    /// @notice The seat of `account` in run `runId`.
    /// @param runId The run.
    /// @param account The account.
    /// @return The seat (status None and zeros if it never joined or withdrew).
    function memberOf(uint256 runId, address account) external view returns (Member memory) {
        return _s.members[runId][account];
    }

    /// @notice The accusation (`runId`, `accused`, `evidenceHash`).
    /// @param runId The run.
    /// @param accused The accused account.
    /// @param evidenceHash The evidence's hash.
    /// @return The accusation (status None and zeros if never opened).
    function accusationOf(uint256 runId, address accused, bytes32 evidenceHash)
        external
        view
        returns (Accusation memory)
    {
        return _s.accusations[runId][accused][evidenceHash];
    }

    /// @notice The number of disputes raised against round `round` of run `runId`.
    /// @param runId The run.
    /// @param round The outer round.
    /// @return The count.
    function disputeCount(uint256 runId, uint64 round) external view returns (uint256) {
        return _s.disputers[runId][round].length;
    }

    /// @notice The members that disputed round `round` of run `runId`, in the order they did (their records
    /// are in RoundDisputed).
    /// @param runId The run.
    /// @param round The outer round.
    /// @return The disputers.
    function disputersOf(uint256 runId, uint64 round) external view returns (address[] memory) {
        return _s.disputers[runId][round];
    }

    /// @notice Wei slashed so far over all runs (held by this contract for good).
    /// @return The total.
    function slashedTotal() external view returns (uint256) {
        return _s.slashedTotal;
    }

    /// @notice Wei of accusation bonds forfeited so far over all runs (held by this contract for good).
    /// @return The total.
    function forfeitedTotal() external view returns (uint256) {
        return _s.forfeitedTotal;
    }

    /// @notice Wei held in proof funds over all runs (issue 79: fundProofs; paid out only as provers' rewards).
    /// @return The total.
    function proofFundTotal() external view returns (uint256) {
        return _s.proofFundTotal;
    }
    // ------------------------------------------------------------------------------------------- internals

    /// @dev The signers of `signatures` over `digest`, strictly ascending, each a current member of `runId`;
    /// each is credited with `round`. At least the quorum of them must be counted members, the quorum being
    /// max(k, ceil(quorumBps x counted members)) once this commit's credits are in (a joiner whose tenure
    /// ends with this round counts in both).
    function _commitSigners(uint256 runId, Run storage run, uint64 round, bytes32 digest, bytes calldata signatures)
        private
        returns (address[] memory signers, uint32 quorum)
    {
        signers = LedgerCore.recoverAscending(digest, signatures);
        uint256 counted = 0;
        for (uint256 i = 0; i < signers.length; ++i) {
            Member storage member = _s.members[runId][signers[i]];
            if (member.status != MemberStatus.Active) revert LedgerSignerNotMember(runId, signers[i]);
            if (LedgerCore.credit(runId, run, member, signers[i], round)) ++counted;
        }
        quorum = LedgerCore.quorum(run.quorum, run.quorumBps, run.countedCount);
        if (counted < quorum) revert LedgerQuorumNotMet(quorum, counted);
    }

    /// @dev This ledger's EIP-712 domain separator (cached; rebuilt on another chain, e.g. after a fork).
    function _proofWindow(uint256 runId, Run storage run, uint64 round)
        private
        view
        returns (uint64 opensAt, uint64 closesAt)
    {
        if (round > 0) opensAt = _ownWindowEnd(runId, run, round - 1);
        closesAt = _ownWindowEnd(runId, run, round);
        if (opensAt != 0 && closesAt < opensAt + run.accusationBlocks) closesAt = opensAt + run.accusationBlocks;
    }

    /// @dev The first block from which nothing but a proof can overturn round `round`: its dispute window, its
    /// open disputes' deadline and its availability games are over.
    function _ownWindowEnd(uint256 runId, Run storage run, uint64 round) private view returns (uint64 end) {
        end = uint64(_s.commitBlocks[runId][round]) + run.disputeBlocks;
        uint64 live = _prover.liveUntil(runId, round);
        if (live > end) end = live;
        DisputeCase storage case_ = _s.disputeCases[runId][round];
        if (case_.status == DisputeStatus.Open && case_.deadline > end) end = case_.deadline;
    }

    function _fundProofs(uint256 runId, uint256 amount) private {
        _s.proofFunds[runId] += amount;
        _s.proofFundTotal += amount;
        emit ProofFunded(runId, msg.sender, amount);
    }

    function _domainSeparator() private view returns (bytes32) {
        return (block.chainid == _cachedChainId && address(this) == _cachedThis)
            ? _cachedDomainSeparator
            : LedgerCore.domainSeparator(address(this));
    }

    function _hashTypedData(bytes32 structHash) private view returns (bytes32) {
        return LedgerCore.typedDigest(_domainSeparator(), structHash);
    }
}
