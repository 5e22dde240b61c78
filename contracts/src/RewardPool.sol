// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {AggregationProver} from "./AggregationProver.sol";
import {LedgerCore} from "./LedgerCore.sol";
import {ProverCommon} from "./ProverCommon.sol";
import {TrainingLedger} from "./TrainingLedger.sol";

/// @title RewardPool
/// @notice Pays a run's contributors and attesters from the record (issue 77; docs/REWARDS.md). A run's creator
/// opens its pool with a schedule and its funding, in native ETH or in the ERC-20 its schedule names; anyone tops
/// it up in the same currency. Each round of the run that the ledger says is
/// final (`TrainingLedger.isFinal`) is opened in order and reserves `amountPerRound` from the pool's free funds;
/// its accepted contributions and its attesters then claim fixed shares of it, each proving its own place in the
/// committed record: a contribution by the round's stage leaf (under the record's weightsRoot) and the stage's
/// version-3 factors, which list the contribution's member account, declared steps and signature; an attester by
/// the round's attester list (RoundCommitted), checked against the ledger's hash of it. Nothing is written at a
/// commit: a commit's gas does not change with a pool. What a round does not pay out (shares of unlisted slots,
/// of convicted members, of unclaimed credits) returns to the free funds once its claim window closes (`sweep`).
/// @dev The split, and why dropping honest work does not pay: a stage's contributor budget is cut into
/// max(contributionSlots, listed) equal slots, at least the run's maxContributions; a listed contribution earns
/// one slot times min(steps, innerSteps) / innerSteps in a run bounded by time (a whole slot in a fixed-H run).
/// The attesters' budget is cut into max(attesterSlots, attesters listed) equal shares. So leaving another's
/// contribution (or signature) out never raises one's own share while the list fits its slots: the left-out
/// share returns to the pool. A convicted member (MemberStatus.Slashed) claims nothing.
contract RewardPool {
    /// @notice A pool's schedule; it never changes.
    struct PoolParams {
        uint128 amountPerRound; // wei a final round reserves (and at most pays out)
        uint16 attesterBps; // the attesters' part of a round's amount, basis points; the rest is the contributors'
        uint16 contributionSlots; // equal slots a stage's contributor budget is cut into (>= the run's maxContributions)
        uint16 attesterSlots; // equal shares the attesters' budget is cut into (more attesters: smaller shares)
        uint64 claimBlocks; // blocks from a round's opening during which its credits are claimed (>= unbonding)
        address token; // the ERC-20 the pool is funded and pays in; zero: native ETH
    }

    /// @notice A run's pool: its schedule and its accounts (wei, or the token's smallest unit).
    struct Pool {
        PoolParams params;
        uint64 firstRound; // the run's commitCount at creation: earlier rounds are not paid
        uint64 nextRound; // the next round to open (rounds open in order)
        uint32 numStages;
        uint32 innerSteps;
        uint256 funded; // everything paid in, creation included (a token's: what arrived)
        uint256 free; // funded, not reserved by an open round, not claimed
        uint256 claimed; // paid out to claimers
    }

    /// @notice An opened round's budget.
    struct RoundBudget {
        uint128 budget; // reserved at opening: the pool's amountPerRound
        uint128 paid; // claimed from it so far
        uint64 openedAt; // block of its opening; claims are taken until openedAt + claimBlocks
        bool swept; // its remainder went back to the free funds: no more claims
    }

    /// @dev `stage` of a claim by an attester (its share is not a stage's): RewardClaimed and claimedOf use it.
    uint32 internal constant ATTESTER = type(uint32).max;
    uint256 private constant _BPS = 10_000;
    uint8 private constant _NORMED = 3; // RunParams.commitments of a run whose factors bind contributions

    TrainingLedger private immutable _ledger;
    mapping(uint256 runId => Pool) private _pools;
    mapping(uint256 runId => mapping(uint64 round => RoundBudget)) private _rounds;
    mapping(bytes32 key => bool) private _claimed; // keccak256(runId, round, stage, account)
    bool private transient _locked; // held around each token call (EIP-1153: cleared at the end of the call)

    /// @notice Run `runId`'s pool was opened by its creator with `funding` (wei, or the token's units that arrived);
    /// rounds from `firstRound` are paid.
    event PoolCreated(uint256 indexed runId, address indexed creator, PoolParams params, uint256 funding, uint64 firstRound);
    /// @notice `funder` added `amount` (wei, or the token's units that arrived) to run `runId`'s pool.
    event PoolFunded(uint256 indexed runId, address indexed funder, uint256 amount);
    /// @notice Final round `round` of run `runId` reserved `budget` wei for its credits.
    event RoundOpened(uint256 indexed runId, uint64 indexed round, uint256 budget);
    /// @notice `account` was paid `amount` wei for its contribution to stage `stage` of round `round` of run
    /// `runId` (`stage` ATTESTER: for attesting the round).
    event RewardClaimed(
        uint256 indexed runId, uint64 indexed round, address indexed account, uint32 stage, uint256 amount
    );
    /// @notice Round `round` of run `runId`'s claim window closed: `returned` wei went back to the free funds.
    event RoundClosed(uint256 indexed runId, uint64 indexed round, uint256 returned);

    /// @notice A pool's parameters refused at creation; `reason` says which rule.
    error RewardBadParams(uint256 runId, string reason);
    error RewardNoPool(uint256 runId);
    error RewardRoundNotPaid(uint256 runId, uint64 round, uint64 firstRound);
    error RewardRoundNotFinal(uint256 runId, uint64 round);
    error RewardPoolUnfunded(uint256 runId, uint64 round, uint256 free, uint256 needed);
    error RewardNotListed(uint256 runId, uint64 round, uint32 stage, address account);
    error RewardBadRecord(uint256 runId, uint64 round);
    error RewardBadStage(uint256 runId, uint64 round, uint32 stage);
    error RewardBadAttesters(uint256 runId, uint64 round);
    error RewardConvicted(uint256 runId, address account);
    error RewardAlreadyClaimed(uint256 runId, uint64 round, uint32 stage, address account);
    error RewardClaimClosed(uint256 runId, uint64 round, uint64 closedAt);
    error RewardClaimOpen(uint256 runId, uint64 round, uint64 closesAt);
    error RewardTransferFailed(address account, uint256 amount);
    error RewardNothingToPay(uint256 runId, uint64 round, uint32 stage, address account);
    /// @notice The ETH sent (`value`) is not the amount named (`amount`), or ETH was sent to a token pool.
    error RewardBadFunding(uint256 runId, uint256 amount, uint256 value);
    /// @notice The pool's token failed a call or did not move what it was asked to (`reason` says which).
    error RewardTokenFailed(address token, string reason);
    /// @notice The pool was called again from inside one of its token calls (a re-entrant token).
    error RewardReentered();

    /// @dev Every state-changing entry refuses to run inside a token call (`_locked`, transient, set around each
    /// one and cleared after it): a re-entrant token can neither fund twice nor claim or sweep in the middle of a
    /// transfer whose balance the pool is measuring.
    modifier unlocked() {
        if (_locked) revert RewardReentered();
        _;
    }

    /// @param ledger_ The TrainingLedger whose record the pool pays from.
    constructor(TrainingLedger ledger_) {
        _ledger = ledger_;
    }

    /// @notice The TrainingLedger whose record this pool pays from.
    function ledger() external view returns (TrainingLedger) {
        return _ledger;
    }

    // ------------------------------------------------------------------------------------------- funding

    /// @notice Open run `runId`'s pool with the schedule `params` and `funding`: wei sent with the call (msg.value
    /// must be `funding`), or, for a token pool (`params.token`), the token's units the pool pulls from the caller
    /// with transferFrom (approve it first; no ETH), credited as what arrived (a fee-on-transfer token's fee is
    /// not). Only the run's creator, once. Refused (RewardBadParams, one reason) when: the token has no code; a
    /// round's amount is zero or more than the funding (for a token: than what arrived); the
    /// attesters' part passes 10000 bps; the contributors' part is nonzero in a run that is not normed (no other
    /// record binds a contribution to a member); contributionSlots is below the run's maxContributions (dropping
    /// contributions would raise the others' shares); the attesters' part is nonzero with no attester slot; the
    /// claim window is shorter than the run's unbonding. No parameter pays before finality: a round opens only
    /// when the ledger says it is final.
    function createPool(uint256 runId, PoolParams calldata params, uint256 funding) external payable unlocked {
        TrainingLedger.Run memory run = _ledger.runOf(runId);
        if (run.headHash == bytes32(0)) revert RewardBadParams(runId, "unknown run");
        if (msg.sender != run.creator) revert RewardBadParams(runId, "only the run's creator opens its pool");
        Pool storage pool = _pools[runId];
        if (pool.params.amountPerRound != 0) revert RewardBadParams(runId, "the run has a pool");
        _checkParams(runId, run, params, funding);
        uint256 received = _receive(runId, params.token, funding);
        if (received < params.amountPerRound) {
            revert RewardBadParams(runId, "the funding received does not cover one round's amount");
        }
        uint64 first = run.commitCount;
        pool.params = params;
        pool.firstRound = first;
        pool.nextRound = first;
        pool.numStages = run.numStages;
        pool.innerSteps = run.innerSteps;
        pool.funded = received;
        pool.free = received;
        emit PoolCreated(runId, msg.sender, params, received, first);
    }

    /// @notice Add `amount` to run `runId`'s pool, in its currency: wei sent with the call (msg.value must be
    /// `amount`), or the token's units pulled from the caller with transferFrom (credited as what arrived). Anyone
    /// may.
    function fund(uint256 runId, uint256 amount) external payable unlocked {
        Pool storage pool = _existing(runId);
        uint256 received = _receive(runId, pool.params.token, amount);
        pool.funded += received;
        pool.free += received;
        emit PoolFunded(runId, msg.sender, received);
    }

    // ------------------------------------------------------------------------------------------- rounds

    /// @notice Open every round of run `runId`'s pool up to `round` that is not open yet, in order: each must be
    /// final and reserves amountPerRound of the free funds. Anyone may (a claim opens its round itself).
    function open(uint256 runId, uint64 round) external unlocked {
        _open(runId, _existing(runId), round);
    }

    /// @notice Return what round `round` of run `runId` did not pay out to the free funds, once its claim
    /// window closed. Anyone may.
    function sweep(uint256 runId, uint64 round) external unlocked returns (uint256 returned) {
        Pool storage pool = _existing(runId);
        RoundBudget storage budget = _rounds[runId][round];
        if (budget.openedAt == 0 || budget.swept) revert RewardClaimClosed(runId, round, budget.openedAt);
        uint64 closesAt = budget.openedAt + pool.params.claimBlocks;
        if (block.number < closesAt) revert RewardClaimOpen(runId, round, closesAt);
        returned = budget.budget - budget.paid;
        budget.swept = true;
        pool.free += returned;
        emit RoundClosed(runId, round, returned);
    }

    // ------------------------------------------------------------------------------------------- claims

    /// @notice Claim the caller's share for its contribution `index` to stage `stage` of committed round
    /// `record.round`, listed in the stage's factors; also after the caller left the run.
    /// @param record The committed record of the round (from RoundCommitted).
    /// @param stageLeaf The stage's leaf under `record.weightsRoot` (ledger/chunkproof.py StageLeaf).
    /// @param stagePath Its sibling hashes, from the leaf up.
    /// @param factors The preimage of the stage leaf's factorsHash (version 3: it lists the contributors).
    /// @param index The caller's place in the factors' lists.
    /// @return amount The wei paid.
    function claimContribution(
        TrainingLedger.Record calldata record,
        uint32 stage,
        bytes calldata stageLeaf,
        bytes32[] calldata stagePath,
        bytes calldata factors,
        uint256 index
    ) external unlocked returns (uint256 amount) {
        uint256 runId = record.runId;
        Pool storage pool = _existing(runId);
        amount = contributionShare(record, stage, stageLeaf, stagePath, factors, index, msg.sender);
        _pay(runId, pool, record.round, stage, amount);
    }

    /// @notice Claim the caller's share for attesting committed round `round` of run `runId`.
    /// @param attesters The round's attesters as RoundCommitted gave them (checked against the ledger).
    /// @param index The caller's place in `attesters`.
    /// @return amount The wei paid.
    function claimAttestation(uint256 runId, uint64 round, address[] calldata attesters, uint256 index)
        external
        unlocked
        returns (uint256 amount)
    {
        Pool storage pool = _existing(runId);
        amount = attesterShare(runId, round, attesters, index, msg.sender);
        _pay(runId, pool, round, ATTESTER, amount);
    }

    // ------------------------------------------------------------------------------------------- views

    /// @notice What contribution `index` of stage `stage` of `record`'s round credits `account` (its listed
    /// contributor, whose signature the factors carry): one slot of the stage's contributor budget, scaled by
    /// its declared steps in a run bounded by time. Reverts where `account` is not listed there.
    function contributionShare(
        TrainingLedger.Record calldata record,
        uint32 stage,
        bytes calldata stageLeaf,
        bytes32[] calldata stagePath,
        bytes calldata factors,
        uint256 index,
        address account
    ) public view returns (uint256) {
        Pool storage pool = _existing(record.runId);
        _checkStage(record, stage, stageLeaf, stagePath, factors, pool.numStages);
        (uint256 count, bool timed, uint256 steps) = _listed(record, stage, factors, index, account);
        PoolParams memory params = pool.params;
        uint256 slots = count > params.contributionSlots ? count : params.contributionSlots;
        uint256 budget = uint256(params.amountPerRound) * (_BPS - params.attesterBps) / _BPS;
        uint256 h = pool.innerSteps;
        uint256 weight = timed ? (steps < h ? steps : h) : h;
        return budget * weight / (uint256(pool.numStages) * slots * h);
    }

    /// @notice What attesting round `round` of run `runId` credits `account`, listed at `index` of the round's
    /// attesters: the attesters' budget over max(attesterSlots, attesters listed).
    function attesterShare(uint256 runId, uint64 round, address[] calldata attesters, uint256 index, address account)
        public
        view
        returns (uint256)
    {
        Pool storage pool = _existing(runId);
        if (_ledger.attestationsOf(runId, round) != keccak256(abi.encode(attesters)) || attesters.length == 0) {
            revert RewardBadAttesters(runId, round);
        }
        if (index >= attesters.length || attesters[index] != account) {
            revert RewardNotListed(runId, round, ATTESTER, account);
        }
        PoolParams memory params = pool.params;
        uint256 shares = attesters.length > params.attesterSlots ? attesters.length : params.attesterSlots;
        return uint256(params.amountPerRound) * params.attesterBps / _BPS / shares;
    }

    /// @notice Run `runId`'s pool (all zero: none).
    function poolOf(uint256 runId) external view returns (Pool memory) {
        return _pools[runId];
    }

    /// @notice The budget of round `round` of run `runId`'s pool (all zero: not open).
    function roundOf(uint256 runId, uint64 round) external view returns (RoundBudget memory) {
        return _rounds[runId][round];
    }

    /// @notice Whether `account` claimed its share of stage `stage` (ATTESTER: its attestation) of round `round`.
    function claimedOf(uint256 runId, uint64 round, uint32 stage, address account) external view returns (bool) {
        return _claimed[_key(runId, round, stage, account)];
    }

    // ------------------------------------------------------------------------------------------- internals

    function _checkParams(uint256 runId, TrainingLedger.Run memory run, PoolParams calldata params, uint256 funding)
        private
        view
    {
        if (params.token != address(0) && params.token.code.length == 0) {
            revert RewardBadParams(runId, "the token has no code");
        }
        if (params.amountPerRound == 0) revert RewardBadParams(runId, "amountPerRound is zero");
        if (funding < params.amountPerRound) {
            revert RewardBadParams(runId, "the funding does not cover one round's amount");
        }
        if (params.attesterBps > _BPS) revert RewardBadParams(runId, "attesterBps above 10000");
        if (params.attesterBps < _BPS) {
            if (run.commitments != _NORMED) {
                revert RewardBadParams(runId, "contributions are paid only in a normed run (commitments 3)");
            }
            if (params.contributionSlots == 0 || params.contributionSlots < _ledger.valuesOf(runId).maxContributions) {
                revert RewardBadParams(runId, "contributionSlots below the run's maxContributions");
            }
        }
        if (params.attesterBps > 0 && params.attesterSlots == 0) {
            revert RewardBadParams(runId, "attesterSlots is zero with an attesters' part");
        }
        if (params.claimBlocks < run.unbondingBlocks) {
            revert RewardBadParams(runId, "claimBlocks shorter than the run's unbonding");
        }
    }

    /// @dev `record` is the round's committed record and `stageLeaf` its stage `stage`'s leaf, whose factorsHash
    /// is sha256(factors), version-3 factors.
    function _checkStage(
        TrainingLedger.Record calldata record,
        uint32 stage,
        bytes calldata stageLeaf,
        bytes32[] calldata stagePath,
        bytes calldata factors,
        uint32 numStages
    ) private view {
        if (_ledger.recordHashOf(record.runId, record.round) != LedgerCore.hashRecord(record)) {
            revert RewardBadRecord(record.runId, record.round);
        }
        if (
            !ProverCommon.verifyLeaf(stageLeaf, stage, numStages, stagePath, record.weightsRoot)
                || stageLeaf.length != 160 || ProverCommon.word(stageLeaf, 0) != stage
                || bytes32(ProverCommon.word(stageLeaf, 128)) != sha256(factors) || !ProverCommon.isNormed(factors)
        ) revert RewardBadStage(record.runId, record.round, stage);
    }

    /// @dev The factors' count, whether they list steps (a run bounded by time) and contribution `index`'s, which
    /// must be `account`'s: listed as its contributor and signed by it.
    function _listed(
        TrainingLedger.Record calldata record,
        uint32 stage,
        bytes calldata factors,
        uint256 index,
        address account
    ) private view returns (uint256 count, bool timed, uint256 steps) {
        (AggregationProver.Norms memory norms, bool ok) = ProverCommon.normCommitment(factors);
        if (!ok) revert RewardBadStage(record.runId, record.round, stage);
        count = norms.count;
        if (index >= count || address(uint160(ProverCommon.word(factors, norms.contributorsAt + 32 * index))) != account) {
            revert RewardNotListed(record.runId, record.round, stage, account);
        }
        timed = norms.steps != 0;
        steps = timed ? ProverCommon.word(factors, norms.stepsAt + 32 * index) : 0;
        if (_signer(record, stage, factors, norms, index, steps) != account) {
            revert RewardNotListed(record.runId, record.round, stage, account);
        }
    }

    function _existing(uint256 runId) private view returns (Pool storage pool) {
        pool = _pools[runId];
        if (pool.params.amountPerRound == 0) revert RewardNoPool(runId);
    }

    function _open(uint256 runId, Pool storage pool, uint64 round) private {
        if (round < pool.firstRound) revert RewardRoundNotPaid(runId, round, pool.firstRound);
        uint256 amount = pool.params.amountPerRound;
        for (uint64 next = pool.nextRound; next <= round; ++next) {
            if (!_ledger.isFinal(runId, next)) revert RewardRoundNotFinal(runId, next);
            if (pool.free < amount) revert RewardPoolUnfunded(runId, next, pool.free, amount);
            pool.free -= amount;
            pool.nextRound = next + 1;
            _rounds[runId][next] = RoundBudget(uint128(amount), 0, uint64(block.number), false);
            emit RoundOpened(runId, next, amount);
        }
    }

    /// @dev Checks, effects, then the one external call (checks-effects-interactions): a re-entrant claim finds
    /// the share claimed.
    function _pay(uint256 runId, Pool storage pool, uint64 round, uint32 stage, uint256 amount) private {
        TrainingLedger.Member memory member = _ledger.memberOf(runId, msg.sender);
        if (member.status == TrainingLedger.MemberStatus.Slashed) revert RewardConvicted(runId, msg.sender);
        if (amount == 0) revert RewardNothingToPay(runId, round, stage, msg.sender);
        _open(runId, pool, round);
        RoundBudget storage budget = _rounds[runId][round];
        if (budget.swept) revert RewardClaimClosed(runId, round, budget.openedAt + pool.params.claimBlocks);
        bytes32 key = _key(runId, round, stage, msg.sender);
        if (_claimed[key]) revert RewardAlreadyClaimed(runId, round, stage, msg.sender);
        // The shares of a round sum to at most its budget (slots >= listed); this check keeps it so regardless.
        if (budget.paid + amount > budget.budget) revert RewardPoolUnfunded(runId, round, budget.budget - budget.paid, amount);
        _claimed[key] = true;
        budget.paid += uint128(amount);
        pool.claimed += amount;
        emit RewardClaimed(runId, round, msg.sender, stage, amount);
        address token = pool.params.token;
        if (token == address(0)) {
            (bool ok,) = payable(msg.sender).call{value: amount}("");
            if (!ok) revert RewardTransferFailed(msg.sender, amount);
            return;
        }
        uint256 before = _balanceOf(token);
        _tokenCall(token, abi.encodeWithSelector(0xa9059cbb, msg.sender, amount)); // transfer(address,uint256)
        uint256 left = _balanceOf(token);
        if (left > before || before - left != amount) {
            revert RewardTokenFailed(token, "the pool's balance did not fall by the amount paid");
        }
    }

    /// @dev Take `amount` in: the wei sent with the call (an ETH pool: msg.value must be `amount`), or the token's
    /// units pulled from the caller (no ETH with it), measured as the pool's balance change: what arrived.
    function _receive(uint256 runId, address token, uint256 amount) private returns (uint256 received) {
        if (token == address(0)) {
            if (msg.value != amount) revert RewardBadFunding(runId, amount, msg.value);
            return amount;
        }
        if (msg.value != 0) revert RewardBadFunding(runId, amount, msg.value);
        uint256 before = _balanceOf(token);
        // transferFrom(address,address,uint256)
        _tokenCall(token, abi.encodeWithSelector(0x23b872dd, msg.sender, address(this), amount));
        uint256 held = _balanceOf(token);
        if (held <= before || held - before > amount) {
            revert RewardTokenFailed(token, "the pool's balance did not rise by at most the amount");
        }
        received = held - before;
    }

    /// @dev One call of the pool's token, SafeERC20-style: it must succeed and return nothing or true (a token that
    /// returns false, or anything else, fails), with the re-entrancy lock held throughout.
    function _tokenCall(address token, bytes memory data) private {
        _locked = true;
        (bool ok, bytes memory returned) = token.call(data);
        _locked = false;
        if (!ok) revert RewardTokenFailed(token, "the transfer reverted");
        if (returned.length != 0 && (returned.length < 32 || abi.decode(returned, (uint256)) != 1)) {
            revert RewardTokenFailed(token, "the transfer did not return true");
        }
    }

    /// @dev The pool's balance of `token`; RewardTokenFailed where it does not answer one word.
    function _balanceOf(address token) private view returns (uint256) {
        (bool ok, bytes memory returned) = token.staticcall(abi.encodeWithSelector(0x70a08231, address(this)));
        if (!ok || returned.length < 32) revert RewardTokenFailed(token, "balanceOf did not answer");
        return abi.decode(returned, (uint256));
    }

    function _key(uint256 runId, uint64 round, uint32 stage, address account) private pure returns (bytes32) {
        return keccak256(abi.encode(runId, round, stage, account));
    }

    /// @dev The account whose EIP-2098 signature over contribution `index`'s Contribution message the factors
    /// hold (ProverBinding's message and domain); zero for none or a malleable one.
    function _signer(
        TrainingLedger.Record calldata record,
        uint32 stage,
        bytes calldata factors,
        AggregationProver.Norms memory norms,
        uint256 index,
        uint256 steps
    ) private view returns (address) {
        bytes32 structHash = keccak256(
            abi.encode(
                keccak256(
                    "Contribution(uint256 runId,uint64 round,uint32 stage,bytes32 payloadRoot,bytes32 normRoot,uint32 steps)"
                ),
                record.runId,
                record.round,
                stage,
                ProverCommon.word(factors, norms.payloadRootsAt + 32 * index),
                ProverCommon.word(factors, norms.rootsAt + 32 * index),
                steps
            )
        );
        bytes32 r = bytes32(ProverCommon.word(factors, norms.signaturesAt + 64 * index));
        uint256 vs = ProverCommon.word(factors, norms.signaturesAt + 64 * index + 32);
        uint256 s = vs & (type(uint256).max >> 1);
        if (s > LedgerCore.MAX_S) return address(0);
        bytes32 digest = LedgerCore.typedDigest(LedgerCore.domainSeparator(address(_ledger)), structHash);
        return ecrecover(digest, uint8(27 + (vs >> 255)), r, bytes32(s));
    }
}
