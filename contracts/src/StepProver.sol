// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {AggregationProver} from "./AggregationProver.sol";
import {StepProverBinding} from "./StepProverBinding.sol";
import {StepProverMath} from "./StepProverMath.sol";
import {TrainingLedger} from "./TrainingLedger.sol";

/// @title StepProver
/// @notice The innermost legs of the contribution proof (issue 78, docs/FRAUD_PROOF.md "The contribution proof"):
/// one operation of a reproducible inner step (kernel version 3), its inputs agreed, its output disputed. A
/// defender claims, with a bond, that the tensor `outRoot` is `kind(aRoot, bRoot)`; anyone may challenge one
/// element of it with a bond. For an elementwise operation the defender opens the output element and its two
/// input elements and the contract recomputes it in soft-float; for a matrix product it is a clocked bisection
/// over the partial sums of the element's fixed k-order (`s_0 = +0`, `s_{k+1} = s_k + a[r,k] * b[k,c]`, one
/// float32 multiply and one float32 add, as `ordered_matmul` computes it), down to one step recomputed here; for a
/// tree sum (`TREESUM`, training/exact_math.py `tree_sum`) a descent of the disputed row's pairwise tree, each
/// posted pair of children checked to add up to its node in float32, down to one element opened.
/// Above it: a step claim (`claimStep`) bisects the ops of one traced step to the op where the sides split; a run
/// claim (`claimRun`, a contribution's H inner steps) first bisects the steps over posted state roots.
/// The loser's bond goes to the winner; a claim proven wrong stays wrong (`claimOf(..).wrong`).
/// @dev Tensors are committed as ledger/merkle.py trees over training/chunks.py tensor leaves of the tensor alone
/// (tensor index 0; the element order is the tensor's contiguous order). A chess clock (each side `clockBlocks`
/// blocks for all its moves) ends a game whose mover stalls: `timeout` gives it to the other side.
contract StepProver {
    uint8 internal constant ADD = 1;
    uint8 internal constant SUB = 2;
    uint8 internal constant MUL = 3;
    uint8 internal constant DIV = 4;
    uint8 internal constant MATMUL = 5;
    uint8 internal constant TREESUM = 7;
    /// @notice A program input index (an op leaf's `aIndex` or `bIndex`) that names the step's batch: the token
    /// tensor of the run claim's `batchRoot` leaf of the step in dispute (`StepProverMath.openOp`).
    uint256 internal constant DATA_INPUT = type(uint32).max;

    /// @notice An operation's shape and commitments. Elementwise: `rows` output elements (`cols` 1, `inner` 0),
    /// `a[e % aLen]`, `b[e % bLen]`. MATMUL: `(rows x inner) @ (inner x cols)`, aLen = rows*inner, bLen = inner*cols.
    /// TREESUM: `a` as `(rows x inner x cols)` summed over its middle dimension, output `(r, c)` the tree sum of
    /// `a[r, 0 .. inner - 1, c]` (`cols` 1: each row's sum; `rows` 1: each column's), aLen = rows*inner*cols, bLen 0
    /// (`b` unread), training/exact_math.py's `tree_sum` (`StepProverMath.openOutput`). UNARY (8) and UNARY_SLOPE
    /// (9): `out[e] = f(a[e])` or `f'(a[e])`, `inner` the function's code (Float64Functions), `cols` 1, aLen = rows,
    /// bLen 0 (`b` unread).
    struct Op {
        uint8 kind;
        uint32 rows;
        uint32 inner;
        uint32 cols;
        uint32 aLen;
        uint32 bLen;
        bytes32 aRoot;
        bytes32 bRoot;
        bytes32 outRoot;
    }

    /// @notice One element's opening: its tensor's chunk leaf and the leaf's path (ledger.merkle).
    struct Element {
        bytes leaf;
        bytes32[] path;
    }

    enum Phase { None, Open, Sums, Final, Done, Trace, TraceEnd, Ops, OpOpen, Pick, Copy, Steps, Start, End, Data, Tree }

    /// @notice One inner step's claim: from the trace tree `startRoot` (its first `stateLeaves` leaves the state's
    /// tensor roots, the rest zero), the ops of `programRoot` give the state tree `endRoot`. The trace tree has
    /// `2**depth` leaves of 32 bytes: the state's tensors, then op `j`'s output at `stateLeaves + j`. The program's
    /// leaf `j < ops` is abi.encode(kind, rows, inner, cols, aLen, bLen, aIndex, bIndex) (the inputs' trace leaves,
    /// before `stateLeaves + j`), leaf `ops + q` abi.encode(source): the trace leaf that is state tensor `q` after.
    struct StepClaim {
        bytes32 programRoot;
        uint32 stateLeaves;
        uint32 ops;
        uint8 depth;
        bytes32 startRoot;
        bytes32 endRoot;
    }

    /// @notice A contribution's claim: `steps` inner steps, each the program `programRoot` (as in `StepClaim`),
    /// take the state tree `startRoot` to the state tree `endRoot`. A state tree is a trace tree whose first
    /// `stateLeaves` leaves are the state's tensor roots (each tensor's own chunk tree) and the rest zero, so one
    /// element of the state after any step is provable against its root. A game bisects the steps over the
    /// state roots the defender posts, then plays the step game on the one step where the sides split.
    /// The claim is about contribution `payloadRoot` of stage `stage` in round `round` of run `runId` of the
    /// ledger, from the stage's committed start `startWeights` (StepProverBinding checks both on the record).
    /// Its steps read the batches `batchRoot` commits (a full tree of `2**ceil(log2 steps)` 32-byte leaves, leaf
    /// `k` the root of step `k`'s token tensor, zero past the steps; `challengeData`), drawn from the run's data
    /// with the key `dataKey`, checked at `claimRun`: the replica's key, the account of its stage-0 member. For a
    /// stage-0 contribution that is its member account as its round's version-3 factors list it (zero where the
    /// factors list none); a later stage's claim shows it with `RunBinding.replica`.
    struct RunClaim {
        bytes32 programRoot;
        uint32 stateLeaves;
        uint32 ops;
        uint8 depth;
        bytes32 startRoot;
        bytes32 endRoot;
        uint32 steps;
        uint256 runId;
        uint64 round;
        uint32 stage;
        bytes32 payloadRoot;
        bytes32 startWeights;
        bytes32 batchRoot;
        address dataKey;
    }

    /// @notice A run's data (`setData`): `root` the ledger/merkle.py root over the chunk leaves (training/chunks.py
    /// layout, 64 ids a leaf, each a big-endian u32) of the training split's `tokens` token ids; step `k`'s batch
    /// of a claim is `rows` windows of `window + 1` ids, row `b` the ids at `offset + 0 .. window` with
    /// `offset = u64(sha256("dlx-node/round-batches/v2" || u64 seed || dataKey || u64 round || u64 k ||
    /// u64 b)) % (tokens - window)` (training/data_binding.py).
    struct DataTerms {
        bytes32 root;
        uint64 seed;
        uint64 tokens;
        uint32 rows;
        uint32 window;
    }

    /// @notice The openings that bind a run claim to the ledger's record: round `round`'s committed record, its
    /// stage leaf and path, the factors hashing to the leaf's factorsHash, the index of the claim's payload root
    /// in their payloadRoots; round - 1's committed record (ignored for round 0, whose start is the run's
    /// genesisRoot) and its stage leaf and path, whose weightsRoot is the claim's startWeights. `replica` (empty for
    /// stage 0, and in a case, which checks no key) binds a later stage's contribution to its replica's data key
    /// (docs/FRAUD_PROOF.md "The replica's key"): abi.encode(bytes stageLeaf, bytes32[] stagePath, bytes factors,
    /// uint256 index, bytes32 r, bytes32 vs), the same round's stage-0 leaf and path under the record's
    /// weightsRoot, its factors, the index of the stage-0 contribution whose listed member is the key, and the
    /// stage's listed member's EIP-2098 signature of `DataKey(runId, round, stage, payloadRoot, dataKey)`
    /// (domain: the ledger).
    struct RunBinding {
        TrainingLedger.Record record;
        bytes stageLeaf;
        bytes32[] stagePath;
        bytes factors;
        uint256 index;
        TrainingLedger.Record prevRecord;
        bytes prevStageLeaf;
        bytes32[] prevStagePath;
        bytes replica;
    }

    /// @notice The defender's opening of the op where the trace splits: its program leaf, its output's root (the
    /// leaf that is empty in the agreed tree and set in the disputed one, one path for both), its inputs' roots.
    struct OpOpening {
        bytes spec;
        bytes32[] specPath;
        bytes32 outRoot;
        bytes32[] outPath;
        bytes32 aRoot;
        bytes32[] aPath;
        bytes32 bRoot;
        bytes32[] bPath;
    }

    /// @notice The defender's answer to a dispute of its claim's start (`challengeStart`): state tensor `q`'s
    /// origin (the run's `originOf` leaf `q`: abi.encode(uint32 tensor, uint64 numel, uint64 firstChunk,
    /// uint64 stageChunks), `tensor` all ones for a tensor that starts at zero), its root (leaf `q` of the claim's
    /// `startRoot`), the disputed element under it, and the committed start's chunk that holds it (chunk
    /// `firstChunk + elem / 64` of `stageChunks` under the claim's `startWeights`; empty for a zero start).
    struct StartOpening {
        bytes origin;
        bytes32[] originPath;
        bytes32 tensorRoot;
        bytes32[] rootPath;
        Element state;
        Element committed;
    }

    struct Game {
        bytes32 claimId;
        address challenger;
        Phase phase;
        bool defenderTurn;
        bool midPosted;
        uint64 elem;
        uint32 lo;
        uint32 hi;
        uint64 defenderLeft;
        uint64 challengerLeft;
        uint64 turnSince;
        uint32 moves;
        uint32 copyLeaf;
        bytes32 loRoot;
        bytes32 hiRoot;
        bytes32 midRoot;
        // The StepClaim the step game plays: the claim's own, or the split step of a run; zero in an op claim's
        // game, whose element game plays the claim's op (`_ops[claimId]`; a step game's is `_ops[gameId]`).
        bytes32 stepKey;
    }

    /// @notice A claim: its defender, whether proven wrong, whether a game is open on it (op and step claims:
    /// one game at a time; a run claim takes any number at once, one per challenger), each side's blocks in a
    /// game on it (`clock`) and its bond, which each challenge of it matches (`stake`).
    struct Claim {
        address defender;
        bool wrong;
        bool busy;
        uint64 clock;
        uint256 stake;
    }

    /// @notice A contribution case (docs/FRAUD_PROOF.md "The contribution case"): `opener` bonded `stake` that
    /// the contribution is wrong; run claims on it are taken until `deadline`; `claims` and `refuted` count every
    /// run claim on the contribution and those proven wrong; from `deadline` on, once all are refuted (or none was
    /// made), the round is overturned; from `ends` on a claim still standing dismisses the case.
    struct Case {
        address opener;
        uint64 deadline;
        uint32 claims;
        uint32 refuted;
        uint64 ends;
        uint64 round;
        uint256 runId;
        uint256 stake;
    }

    /// @notice The bond of a claim and of a challenge (the loser's goes to the winner); zero: a run's own bond
    /// (run claims and cases only: the ledger's StepProver, deployed by its AggregationProver).
    uint256 public immutable bond;
    /// @notice Each side's blocks for all its moves of one game (a chess clock); zero: a run's accusationBlocks.
    uint64 public immutable clockBlocks;
    /// @notice The ledger whose records a run claim is bound to.
    TrainingLedger public immutable ledger;
    mapping(bytes32 => Claim) internal _claims;
    /// @dev An op claim's op (by its claim id), or the split op of a step game (by its game id: `Game.stepKey`).
    mapping(bytes32 => Op) internal _ops;
    mapping(bytes32 => Game) internal _games;
    mapping(bytes32 => StepClaim) internal _steps;
    mapping(bytes32 => RunClaim) internal _runs;
    /// @dev Each contribution's case and claim counts, by `contributionOf`.
    mapping(bytes32 => Case) internal _cases;
    /// @notice The block a case commitment was first made (`commitCase`; 0: never).
    mapping(bytes32 => uint64) public caseCommittedAt;
    /// @notice What each account won and has not withdrawn.
    mapping(address => uint256) public balanceOf;
    /// @notice Run `runId`'s step program: keccak256(abi.encode(programRoot, stateLeaves, ops, depth)), set once
    /// by the run's creator before its first commit (`setProgram`); zero: none, so the run takes no run claim
    /// and no case.
    mapping(uint256 => bytes32) public programOf;
    /// @notice Run `runId`'s state origins: the ledger/merkle.py root over one leaf per state tensor (`StartOpening`):
    /// where in the committed start each tensor of a claim's first state is (set with its program).
    mapping(uint256 => bytes32) public originOf;
    /// @notice Run `runId`'s end rule (`setEndRule`): 0, a claim's end is not disputed; 1 (`PLAIN_END`), nothing is
    /// carried between rounds (no error feedback, no undelivered update, no inner-optimizer state) and no piece
    /// is low-rank, so each payload element codes `fl(S - E)` and `challengeEnd` may dispute it.
    mapping(uint256 => uint8) public endRuleOf;
    /// @dev A quant tensor's bit width in an end dispute, by keccak256(abi.encode(claimId, q)): the first answer's.
    mapping(bytes32 => uint8) internal _endBits;
    /// @dev Run `runId`'s data (`setData`; root zero: none, so no claim's batches are disputed). Internal (its
    /// getter would pass EIP-170's room): `DataFixed` gives the terms.
    mapping(uint256 => DataTerms) internal _data;

    event Claimed(bytes32 indexed claimId, address defender);
    event Challenged(bytes32 indexed gameId, bytes32 indexed claimId, address challenger, uint64 elem);
    event SumPosted(bytes32 indexed gameId, uint32 point, uint32 sum);
    event Judged(bytes32 indexed gameId, bool agree, uint32 lo, uint32 hi);
    event Decided(bytes32 indexed gameId, bytes32 indexed claimId, bool defenderWon, uint32 moves);
    event ClaimRefuted(bytes32 indexed claimId, address challenger);
    event StateRootPosted(bytes32 indexed gameId, uint32 step, bytes32 root);
    event StepNarrowed(bytes32 indexed gameId, uint32 step);
    event RunClaimed(
        bytes32 indexed claimId, uint256 indexed runId, uint64 round, uint32 stage, bytes32 payloadRoot, address defender
    );
    event CaseCommitted(bytes32 indexed commitment, address committer);
    event CaseOpened(
        bytes32 indexed key, uint256 indexed runId, uint64 round, uint32 stage, bytes32 payloadRoot, address opener,
        uint64 deadline
    );
    event ContributionOverturned(bytes32 indexed key, uint256 indexed runId, uint64 round, address opener);
    event CaseDismissed(bytes32 indexed key, bytes32 claimId, address defender);
    event ProgramRegistered(uint256 indexed runId, bytes32 programHash, bytes32 originRoot);
    event EndRuleFixed(uint256 indexed runId, uint8 rule);
    event DataFixed(uint256 indexed runId, bytes32 root, uint64 seed, uint64 tokens, uint32 rows, uint32 window);

    error ProverStepBondMismatch(uint256 required, uint256 sent);
    error ProverStepBadOp();
    error ProverStepUnknownClaim();
    error ProverStepClaimClosed();
    error ProverStepBadElement(uint64 elem);
    error ProverStepNotYourMove();
    error ProverStepWrongPhase();
    error ProverStepClockOut();
    error ProverStepClockRunning();
    error ProverStepBadOpening(uint8 which);
    error ProverStepTreeMismatch(uint32 left, uint32 right, uint32 node);
    error ProverStepNotListed(uint256 runId, uint64 round, uint32 stage, bytes32 payloadRoot);
    error ProverStepWrongStart(uint256 runId, uint64 round, uint32 stage, bytes32 startWeights);
    error ProverStepWindowClosed(uint256 runId, uint64 round, uint64 closesAt);
    error ProverStepClaimsClosed(bytes32 key, uint64 deadline);
    error ProverStepNotCommitted(bytes32 commitment);
    error ProverStepCaseOpen(bytes32 key);
    error ProverStepNoCase(bytes32 key);
    error ProverStepCaseRunning(bytes32 key, uint64 until);
    error ProverStepClaimStands(bytes32 key, uint32 claims, uint32 refuted);
    error ProverStepNoProgram(uint256 runId);
    error ProverStepWrongProgram(uint256 runId, bytes32 programHash);
    error ProverStepWrongSteps(uint256 runId, uint32 innerSteps, uint32 steps);
    error ProverStepProgramFixed(uint256 runId, address sender);
    error ProverStepEndUnbound(uint256 runId);
    error ProverStepDataUnbound(uint256 runId);
    error ProverStepWrongDataKey(address listed, address named);
    error ProverStepWrongReplica(address contributor, address dataKey);

    constructor(uint256 bond_, uint64 clockBlocks_, TrainingLedger ledger_) {
        bond = bond_;
        clockBlocks = clockBlocks_;
        ledger = ledger_;
    }

    /// @notice The id of `defender`'s claim on `op`.
    function claimIdOf(Op calldata op, address defender) public pure returns (bytes32) {
        return keccak256(abi.encode(op, defender));
    }

    /// @notice The id of `challenger`'s game on claim `claimId`.
    function gameIdOf(bytes32 claimId, address challenger) public pure returns (bytes32) {
        return keccak256(abi.encode(claimId, challenger));
    }

    /// @notice Game `gameId`'s state.
    function gameOf(bytes32 gameId) external view returns (Game memory) {
        return _games[gameId];
    }

    /// @notice Claim `claimId`: its defender, whether proven wrong, whether a game is open on it, its op.
    function claimOf(bytes32 claimId) external view returns (Claim memory) {
        return _claims[claimId];
    }

    /// @notice Bond `bond` on `op`: that its output tensor is `kind(a, b)`.
    function claim(Op calldata op) external payable returns (bytes32 claimId) {
        _opBond();
        StepProverMath.checkOp(op);
        claimId = claimIdOf(op, msg.sender);
        _newClaim(claimId, clockBlocks, bond);
        _ops[claimId] = op;
        emit Claimed(claimId, msg.sender);
    }

    /// @notice Bond `bond` against element `elem` of a claim's output (one game at a time per claim).
    function challenge(bytes32 claimId, uint64 elem) external payable returns (bytes32 gameId) {
        if (msg.value != bond) revert ProverStepBondMismatch(bond, msg.value);
        Claim storage c = _claims[claimId];
        if (c.defender == address(0)) revert ProverStepUnknownClaim();
        if (c.wrong || c.busy) revert ProverStepClaimClosed();
        Op storage op = _ops[claimId];
        if (elem >= uint256(op.rows) * op.cols) revert ProverStepBadElement(elem);
        Game storage g = _start(claimId, Phase.Open);
        g.elem = elem;
        gameId = gameIdOf(claimId, msg.sender);
        emit Challenged(gameId, claimId, msg.sender, elem);
    }

    /// @notice Bond `bond` on one inner step (`StepClaim`): that its program takes `startRoot` to `endRoot`.
    function claimStep(StepClaim calldata step) external payable returns (bytes32 claimId) {
        _opBond();
        StepProverMath.checkStep(step);
        claimId = keccak256(abi.encode(step, msg.sender));
        _newClaim(claimId, clockBlocks, bond);
        _steps[claimId] = step;
        emit Claimed(claimId, msg.sender);
    }

    /// @notice Bond `bond` against a step claim: the defender answers with its whole trace's root.
    function challengeStep(bytes32 claimId) external payable returns (bytes32 gameId) {
        if (msg.value != bond) revert ProverStepBondMismatch(bond, msg.value);
        if (_steps[claimId].ops == 0) revert ProverStepUnknownClaim();
        Claim storage c = _claims[claimId];
        if (c.wrong || c.busy) revert ProverStepClaimClosed();
        _start(claimId, Phase.Trace).stepKey = claimId;
        gameId = gameIdOf(claimId, msg.sender);
        emit Challenged(gameId, claimId, msg.sender, 0);
    }

    /// @notice Bond the run's stake (`StepProverBinding.terms`) on a contribution's `run.steps` inner steps
    /// (`RunClaim`): anyone may defend a contribution the ledger's record lists, from the start the record holds
    /// (`b` opens both; refused otherwise: `ProverStepNotListed`, `ProverStepWrongStart`, or the record openings'
    /// AggregationProver errors), within the round's proof window (`ProverStepWindowClosed`) and, while a case
    /// on the contribution is open, before its deadline (`ProverStepClaimsClosed`).
    function claimRun(RunClaim calldata run, RunBinding calldata b) external payable returns (bytes32 claimId) {
        claimId =
            StepProverBinding.register(ledger, _cases, programOf, _claims, _runs, _data, run, b, bond, clockBlocks);
    }

    /// @notice The key of a contribution (its run, round, stage and payload root): its case and claim counts.
    function contributionOf(uint256 runId, uint64 round, uint32 stage, bytes32 payloadRoot)
        public
        pure
        returns (bytes32)
    {
        return keccak256(abi.encode(runId, round, stage, payloadRoot));
    }

    /// @notice Contribution `key`'s case (opener zero: none open) and claim counts.
    function caseOf(bytes32 key) external view returns (Case memory) {
        return _cases[key];
    }

    /// @notice Commit to a case before opening it, so that a copy of `openCase` sent by another (a front-runner)
    /// is refused: `commitment` = keccak256(abi.encode(opener, contributionOf(..), salt)), the salt secret until
    /// the case opens. The first commitment of a hash counts.
    function commitCase(bytes32 commitment) external {
        StepProverBinding.commit(caseCommittedAt, commitment);
    }

    /// @notice Bond the run's stake that the contribution `run` names (its run, round, stage, payload root and
    /// start, opened by `b` as for `claimRun`; its other fields are ignored) is not what its inputs give: run
    /// claims on it are taken for `clock` blocks more; the sender must have committed the case (`commitCase`)
    /// in an earlier block. One case at a time per contribution; refused unless the case's whole course (claims,
    /// then a challenge and a full game on the last one: `4 clock + 1` blocks) ends inside the round's proof
    /// window (`ProverStepWindowClosed`).
    function openCase(RunClaim calldata run, RunBinding calldata b, bytes32 salt)
        external
        payable
        returns (bytes32 key)
    {
        key = StepProverBinding.openCase(
            ledger, _cases, caseCommittedAt, programOf, run, b, salt, bond, clockBlocks
        );
    }

    /// @notice The run's creator, once, before the run's first commit: every run claim in run `runId` is about
    /// `steps` = the run's innerSteps steps of the program `programHash` names (`RunClaim`'s fields of the same names; else
    /// `ProverStepWrongProgram`, `ProverStepWrongSteps`), and cases are taken in it. Honest members check it
    /// against the program their run document gives before they join (as the run's other values).
    /// @param programHash keccak256(abi.encode(programRoot, stateLeaves, ops, depth)).
    /// @param originRoot the state tensors' origins in the committed start (`originOf`, `StartOpening`).
    function setProgram(uint256 runId, bytes32 programHash, bytes32 originRoot) external {
        StepProverBinding.setProgram(ledger, programOf, originOf, runId, programHash, originRoot);
    }

    /// @notice The run's creator, once, before the run's first commit: run `runId`'s end rule (`endRuleOf`; 1 the
    /// only one), so that its claims' ends are disputed (`challengeEnd`). Honest members check it against their
    /// run document (no error feedback, no low-rank coding, no undelivered update or optimizer state carried)
    /// before they join.
    function setEndRule(uint256 runId, uint8 rule) external {
        StepProverBinding.setEndRule(ledger, endRuleOf, runId, rule);
    }

    /// @notice The run's creator, once, before the run's first commit: run `runId`'s data (`DataTerms`), so that
    /// its claims' batches are disputed (`challengeData`). Honest members check it against their run document
    /// (the corpus, its tokenizer and split, the seed, the batch size and the block size) before they join.
    function setData(uint256 runId, DataTerms calldata terms) external {
        StepProverBinding.setData(ledger, _data, runId, terms);
    }

    /// @notice Anyone, from the case's deadline on: every run claim on the contribution was proven wrong (or none
    /// was made), so its round is wrong: it is overturned through the ledger's AggregationProver
    /// (`overturnByStep`, inside the round's proof window), the attesters slashed; the opener gets its bond back
    /// here and the ledger's reward (`ProverRewarded`) whoever calls.
    /// @param attesters The round's attesters as RoundCommitted gave them.
    function overturnContribution(bytes32 key, address[] calldata attesters) external returns (uint256 reward) {
        reward = StepProverBinding.overturn(ledger, _cases, balanceOf, key, attesters);
    }

    /// @notice Anyone, from the case's end on: run claim `claimId` on the contribution stands (not proven wrong);
    /// the case is closed and its opener's bond paid to that claim's defender.
    function dismissCase(bytes32 key, bytes32 claimId) external {
        StepProverBinding.dismiss(_cases, _claims, _runs, balanceOf, key, claimId);
    }

    /// @notice The id of `defender`'s claim on `run`.
    function runIdOf(RunClaim calldata run, address defender) public pure returns (bytes32) {
        return keccak256(abi.encode(run, defender));
    }

    /// @notice Bond the claim's stake against a run claim: the bisection over its steps starts (the defender posts
    /// first). Any number of challengers play at once, each its own game (so that no one holds the claim by
    /// squatting a game); one running game per challenger; refused once the claim is proven wrong.
    function challengeRun(bytes32 claimId) external payable returns (bytes32 gameId) {
        Game storage g;
        (gameId, g) = _challengeRun(claimId, Phase.Steps, 0);
        RunClaim storage run = _runs[claimId];
        g.lo = 0;
        g.hi = run.steps;
        g.loRoot = run.startRoot;
        g.hiRoot = run.endRoot;
        if (run.steps == 1) _enterStep(gameId, g);
    }

    /// @notice Bond the claim's stake that element `elem` of state tensor `q` of the claim's first state is not
    /// the committed start's (the run's origin of tensor `q`): the defender must open both (`proveStart`) within
    /// its clock, or the claim is proven wrong. A claim's start is the round's committed start, element by element.
    function challengeStart(bytes32 claimId, uint32 q, uint64 elem) external payable returns (bytes32 gameId) {
        gameId = _challengeElement(claimId, Phase.Start, q, elem);
    }

    /// @notice Bond the claim's stake that the contribution's payload does not code element `elem` of state
    /// tensor `q` of the claim's end as the run's encoder would (a run with an end rule: `endRuleOf`): the
    /// defender must open it (`proveEnd`) within its clock, or the claim is proven wrong. With the start bound,
    /// a claim's end is the contribution's payload, element by element.
    function challengeEnd(bytes32 claimId, uint32 q, uint64 elem) external payable returns (bytes32 gameId) {
        gameId = _challengeElement(claimId, Phase.End, q, elem);
        uint256 runId = _runs[claimId].runId;
        if (endRuleOf[runId] == 0) revert ProverStepEndUnbound(runId);
    }

    /// @notice Defender: the disputed end element is what the payload codes; decides the game. `o` as for
    /// `proveStart`, but the tensor's root a leaf of the claim's `endRoot` and the element its end value; `piece`
    /// the contribution's payload piece of the same chunk (`firstChunk + elem / 64` of `stageChunks`) under the
    /// claim's `payloadRoot`; `bits` a quant piece's bit width (the first answer on a tensor of a claim fixes it).
    function proveEnd(bytes32 gameId, StartOpening calldata o, Element calldata piece, uint8 bits) external {
        (Game storage g,) = _move(gameId, true, Phase.End);
        StepProverMath.proveEnd(o, piece, bits, g, _runs, originOf, _endBits);
        _decide(gameId, g, true);
    }

    /// @notice Bond the claim's stake that token `pos` of row `row` of step `step`'s batch (the claim's
    /// `batchRoot`) is not the run's data (`setData`: the corpus's token at the row's window offset plus `pos`):
    /// the defender must open both (`proveData`) within its clock, or the claim is proven wrong.
    function challengeData(bytes32 claimId, uint32 step, uint32 row, uint32 pos) external payable returns (bytes32 gameId) {
        Game storage g;
        (gameId, g) = _challengeRun(claimId, Phase.Data, 0);
        StepProverMath.challengeData(g, _runs, _data, step, row, pos);
    }

    /// @notice Defender: the disputed batch token is the run's data (`o` a `StartOpening` of the batch: no
    /// origin, `tensorRoot` step `lo`'s token tensor root under the claim's `batchRoot` with `rootPath`, `state`
    /// the token under it, `committed` the corpus's chunk that holds the window's token under the run's data
    /// root); decides the game.
    function proveData(bytes32 gameId, StartOpening calldata o) external {
        (Game storage g,) = _move(gameId, true, Phase.Data);
        StepProverMath.proveData(o, g, _runs, _data);
        _decide(gameId, g, true);
    }

    /// @dev A challenger's game on element `elem` of state tensor `q` of a run claim (its start or its end).
    function _challengeElement(bytes32 claimId, Phase phase, uint32 q, uint64 elem) private returns (bytes32 gameId) {
        Game storage g;
        (gameId, g) = _challengeRun(claimId, phase, elem);
        if (q >= _runs[claimId].stateLeaves) revert ProverStepBadElement(q);
        g.copyLeaf = q;
        g.elem = elem;
    }

    /// @notice Defender: the disputed start element is the committed start's (`StartOpening`); decides the game.
    function proveStart(bytes32 gameId, StartOpening calldata o) external {
        (Game storage g,) = _move(gameId, true, Phase.Start);
        StepProverMath.proveStart(o, g, _runs, originOf);
        _decide(gameId, g, true);
    }

    /// @dev A challenger's bonded game on run claim `claimId` (one running game per challenger), in `phase`.
    function _challengeRun(bytes32 claimId, Phase phase, uint64 elem) private returns (bytes32 gameId, Game storage g) {
        if (_runs[claimId].steps == 0) revert ProverStepUnknownClaim();
        Claim storage c = _claims[claimId];
        if (msg.value != c.stake) revert ProverStepBondMismatch(c.stake, msg.value);
        gameId = gameIdOf(claimId, msg.sender);
        Phase now_ = _games[gameId].phase;
        if (c.wrong || (now_ != Phase.None && now_ != Phase.Done)) revert ProverStepClaimClosed();
        g = _start(claimId, phase);
        emit Challenged(gameId, claimId, msg.sender, elem);
    }

    /// @notice Defender: the state root after step `(lo + hi) / 2` of the interval in dispute.
    function postStateRoot(bytes32 gameId, bytes32 root) external {
        Game storage g = _post(gameId, Phase.Steps, root);
        emit StateRootPosted(gameId, (g.lo + g.hi) / 2, root);
    }

    /// @notice Challenger: whether it agrees with the posted state root; at one step apart the step game of that
    /// step starts (from the agreed root to the disputed one).
    function judgeStateRoot(bytes32 gameId, bool agree) external {
        Game storage g = _judge(gameId, Phase.Steps, agree);
        if (g.hi == g.lo + 1) _enterStep(gameId, g);
    }

    /// @dev The step game of step `lo` of a run: its claim is the run's program from `loRoot` to `hiRoot`.
    function _enterStep(bytes32 gameId, Game storage g) private {
        RunClaim storage run = _runs[g.claimId];
        _steps[gameId] = StepClaim(run.programRoot, run.stateLeaves, run.ops, run.depth, g.loRoot, g.hiRoot);
        g.stepKey = gameId;
        g.elem = g.lo; // the step, until pickElement: openOp reads its batch (`DATA_INPUT`)
        g.phase = Phase.Trace;
        g.defenderTurn = true;
        emit StepNarrowed(gameId, g.lo);
    }

    /// @dev The defender's move in a bisection (`phase`): `value` at the interval's midpoint (a root, or a sum's
    /// bits).
    function _post(bytes32 gameId, Phase phase, bytes32 value) private returns (Game storage g) {
        (g,) = _move(gameId, true, phase);
        g.midRoot = value;
        g.midPosted = true;
        g.defenderTurn = false;
    }

    /// @dev The challenger's move in a bisection (`phase`): the interval moves to the half in dispute, past the
    /// midpoint if it agrees with the posted value, up to it if not.
    function _judge(bytes32 gameId, Phase phase, bool agree) private returns (Game storage g) {
        (g,) = _move(gameId, false, phase);
        if (!g.midPosted) revert ProverStepWrongPhase();
        uint32 mid = (g.lo + g.hi) / 2;
        if (agree) {
            g.lo = mid;
            g.loRoot = g.midRoot;
        } else {
            g.hi = mid;
            g.hiRoot = g.midRoot;
        }
        g.midPosted = false;
        g.defenderTurn = true;
        emit Judged(gameId, agree, g.lo, g.hi);
    }

    /// @notice Defender: the root of its trace tree after the step's last op.
    function postTrace(bytes32 gameId, bytes32 traceRoot) external {
        (Game storage g,) = _move(gameId, true, Phase.Trace);
        StepClaim storage step = _steps[g.stepKey];
        g.loRoot = step.startRoot;
        g.hiRoot = traceRoot;
        g.lo = 0;
        g.hi = step.ops;
        g.phase = Phase.TraceEnd;
        g.defenderTurn = false;
    }

    /// @notice Challenger: state leaf `leaf` of `endRoot` is not what the trace's last tree says it is.
    function disputeCopy(bytes32 gameId, uint32 leaf) external {
        (Game storage g,) = _move(gameId, false, Phase.TraceEnd);
        if (leaf >= uint256(1) << _steps[g.stepKey].depth) revert ProverStepBadElement(leaf);
        g.copyLeaf = leaf;
        g.phase = Phase.Copy;
        g.defenderTurn = true;
    }

    /// @notice Challenger: the trace itself is wrong; the bisection over the ops starts.
    function disputeTrace(bytes32 gameId) external {
        (Game storage g,) = _move(gameId, false, Phase.TraceEnd);
        g.phase = g.hi == 1 ? Phase.OpOpen : Phase.Ops;
        g.defenderTurn = true;
    }

    /// @notice Defender: its trace tree after the op at the interval's midpoint.
    function postRoot(bytes32 gameId, bytes32 root) external {
        _post(gameId, Phase.Ops, root);
    }

    /// @notice Challenger: whether it agrees with the posted trace tree.
    function judgeRoot(bytes32 gameId, bool agree) external {
        Game storage g = _judge(gameId, Phase.Ops, agree);
        if (g.hi == g.lo + 1) g.phase = Phase.OpOpen;
    }

    /// @notice Defender: open op `lo`, the one whose output the trees disagree on; its claim becomes the game's.
    function openOp(bytes32 gameId, OpOpening calldata o) external {
        (Game storage g,) = _move(gameId, true, Phase.OpOpen);
        _ops[gameId] = StepProverMath.openOp(o, _steps[g.stepKey], g, _runs);
        g.phase = Phase.Pick;
        g.defenderTurn = false;
    }


    /// @notice Challenger: the element of the split op's output it disputes; the element game follows.
    function pickElement(bytes32 gameId, uint64 elem) external {
        (Game storage g, Op storage op) = _move(gameId, false, Phase.Pick);
        if (elem >= uint256(op.rows) * op.cols) revert ProverStepBadElement(elem);
        g.elem = elem;
        g.phase = Phase.Open;
        g.defenderTurn = true;
    }

    /// @notice Defender: state leaf `copyLeaf` of `endRoot` is `value`, the trace's leaf `source` (the program's
    /// copy entry), or zero past the state's leaves; decides the game.
    function proveCopy(
        bytes32 gameId,
        bytes32 value,
        bytes32[] calldata endPath,
        bytes calldata copy,
        bytes32[] calldata copyPath,
        bytes32[] calldata sourcePath
    ) external {
        (Game storage g,) = _move(gameId, true, Phase.Copy);
        StepClaim storage step = _steps[g.stepKey];
        if (!StepProverMath.verifyWord(value, g.copyLeaf, step.depth, endPath, step.endRoot)) {
            revert ProverStepBadOpening(0);
        }
        StepProverMath.proveCopy(step, g.copyLeaf, g.hiRoot, value, copy, copyPath, sourcePath);
        _decide(gameId, g, true);
    }

    /// @notice Defender: open the challenged output element; for an elementwise operation also its inputs
    /// (`a`, `b`), which decides the game; for a product `a` and `b` are empty and the partial sums' bisection starts;
    /// for a tree sum (empty too) the descent of its tree (`postChildren`).
    function openOutput(bytes32 gameId, Element calldata out, Element calldata a, Element calldata b) external {
        (Game storage g, Op storage op) = _move(gameId, true, Phase.Open);
        uint8 outcome = StepProverMath.openOutput(op, g, out, a, b);
        if (outcome != 0) _decide(gameId, g, outcome == 1);
    }

    /// @notice Defender: its partial sum at the interval's midpoint.
    function postSum(bytes32 gameId, uint32 sum) external {
        Game storage g = _post(gameId, Phase.Sums, bytes32(uint256(sum)));
        emit SumPosted(gameId, (g.lo + g.hi) / 2, sum);
    }

    /// @notice Challenger: whether it agrees with the posted midpoint (the interval moves to the half in dispute).
    function judge(bytes32 gameId, bool agree) external {
        Game storage g = _judge(gameId, Phase.Sums, agree);
        if (g.hi == g.lo + 1) g.phase = Phase.Final;
    }

    /// @notice Defender: the one step `s_hi = s_lo + a[r,lo] * b[lo,c]`, its two inputs opened; decides the game.
    /// A tree sum's: the disputed leaf `a[r * inner + lo]` opened (`b` empty).
    function proveStep(bytes32 gameId, Element calldata a, Element calldata b) external {
        (Game storage g, Op storage op) = _move(gameId, true, Phase.Final);
        _decide(gameId, g, StepProverMath.finalStepHolds(op, g, a, b));
    }

    /// @notice Defender: the two children of the disputed node of a tree sum (node `lo` of level `hi`, its value
    /// `hiRoot`), whose float32 sum must be the node (`ProverStepTreeMismatch`); the game's `loRoot` and `midRoot`
    /// hold them for the challenger.
    function postChildren(bytes32 gameId, uint32 left, uint32 right) external {
        _treeMove(gameId, true, left, right, false);
    }

    /// @notice Challenger: the child of the tree sum's node it disputes (`right`, else the left); the descent goes
    /// on from it (a carried node passed down as it is), down to a leaf that the defender opens (`proveStep`).
    function pickChild(bytes32 gameId, bool right) external {
        _treeMove(gameId, false, 0, 0, right);
    }

    /// @dev A move of a tree sum's descent (one library call for both sides: `StepProverMath.treeMove`).
    function _treeMove(bytes32 gameId, bool byDefender, uint32 left, uint32 right, bool pickRight) private {
        (Game storage g, Op storage op) = _move(gameId, byDefender, Phase.Tree);
        StepProverMath.treeMove(op, g, left, right, pickRight);
    }

    /// @notice Anyone: the side to move let its clock run out; the other side wins.
    function timeout(bytes32 gameId) external {
        Game storage g = _games[gameId];
        if (g.phase == Phase.None || g.phase == Phase.Done) revert ProverStepWrongPhase();
        uint64 left = g.defenderTurn ? g.defenderLeft : g.challengerLeft;
        if (block.number - g.turnSince <= left) revert ProverStepClockRunning();
        _decide(gameId, g, !g.defenderTurn);
    }

    /// @notice Take out what the caller won.
    function withdraw() external {
        StepProverBinding.withdraw(balanceOf);
    }

    /// @dev Op and step claims: the bond is StepProver's own (a ledger's StepProver, bond zero, takes none).
    function _opBond() private view {
        if (bond == 0) revert ProverStepBadOp();
        if (msg.value != bond) revert ProverStepBondMismatch(bond, msg.value);
    }

    function _newClaim(bytes32 claimId, uint64 clock, uint256 stake) private {
        if (_claims[claimId].defender != address(0)) revert ProverStepClaimClosed();
        _claims[claimId] = Claim(msg.sender, false, false, clock, stake);
    }

    function _start(bytes32 claimId, Phase phase) private returns (Game storage g) {
        uint64 clock = _claims[claimId].clock;
        _claims[claimId].busy = true;
        g = _games[gameIdOf(claimId, msg.sender)];
        g.claimId = claimId;
        g.challenger = msg.sender;
        g.phase = phase;
        g.defenderTurn = true;
        g.midPosted = false;
        g.defenderLeft = clock;
        g.challengerLeft = clock;
        g.turnSince = uint64(block.number);
        g.moves = 1;
    }

    function _move(bytes32 gameId, bool byDefender, Phase phase) private returns (Game storage g, Op storage op) {
        g = _games[gameId];
        if (g.phase != phase) revert ProverStepWrongPhase();
        Claim storage c = _claims[g.claimId];
        if (g.defenderTurn != byDefender || msg.sender != (byDefender ? c.defender : g.challenger)) {
            revert ProverStepNotYourMove();
        }
        uint64 elapsed = uint64(block.number) - g.turnSince;
        if (byDefender) {
            if (elapsed > g.defenderLeft) revert ProverStepClockOut();
            g.defenderLeft -= elapsed;
        } else {
            if (elapsed > g.challengerLeft) revert ProverStepClockOut();
            g.challengerLeft -= elapsed;
        }
        g.turnSince = uint64(block.number);
        ++g.moves;
        op = _ops[g.stepKey == bytes32(0) ? g.claimId : gameId];
    }

    /// @dev The loser's bond to the winner; a claim already refuted (another game on a run claim) has no bond
    /// left to lose: its challenger's own comes back. A run claim's first refutation counts for its contribution.
    function _decide(bytes32 gameId, Game storage g, bool defenderWon) private {
        Claim storage c = _claims[g.claimId];
        uint256 stake = c.stake;
        g.phase = Phase.Done;
        c.busy = false;
        if (defenderWon) {
            balanceOf[c.defender] += stake;
        } else if (c.wrong) {
            balanceOf[g.challenger] += stake;
        } else {
            c.wrong = true;
            balanceOf[g.challenger] += 2 * stake;
            RunClaim storage run = _runs[g.claimId];
            if (run.steps != 0) ++_cases[contributionOf(run.runId, run.round, run.stage, run.payloadRoot)].refuted;
            emit ClaimRefuted(g.claimId, g.challenger);
        }
        emit Decided(gameId, g.claimId, defenderWon, g.moves);
    }
}
