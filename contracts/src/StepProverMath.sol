// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {Float32} from "./Float32.sol";
import {Float64Functions} from "./Float64Functions.sol";
import {ProverCommon} from "./ProverCommon.sol";
import {StepProver} from "./StepProver.sol";

/// @title StepProverMath
/// @notice StepProver's pure pieces (issue 78): the openings of one element against a tensor's chunk tree, of one
/// word against a trace or state tree, of the op the trace splits at, and the float32 arithmetic that decides an
/// element game. A linked library (deployed once, called by DELEGATECALL), so that StepProver's own code keeps
/// room under EIP-170 for the game's next levels.
/// @dev Reverts with StepProver's errors (declared there).
library StepProverMath {
    using Float32 for uint32;

    uint8 internal constant ADD = 1;
    uint8 internal constant SUB = 2;
    uint8 internal constant MUL = 3;
    uint8 internal constant MATMUL = 5;
    uint8 internal constant GATHER = 6;
    uint8 internal constant TREESUM = 7;
    uint8 internal constant UNARY = 8; // Float64Functions.UNARY; 9 UNARY_SLOPE
    uint256 internal constant DATA_INPUT = type(uint32).max; // StepProver.DATA_INPUT
    /// @notice A program input index `CONST_INPUT + bits` (below `2 * CONST_INPUT`) names the one-element tensor
    /// of float32 `bits` (`constRoot`): a constant operand, e.g. the count a mean divides by.
    uint256 internal constant CONST_INPUT = 1 << 32;
    bytes internal constant WINDOWS = "dlx-node/round-batches/v2"; // training/data_binding.py WINDOWS_DOMAIN
    uint256 internal constant CHUNK = 64; // training/chunks.py CHUNK_ELEMENTS
    uint256 internal constant HEADER = 24; // u32 tensor, u64 offset, u64 cols, u32 count
    uint32 internal constant TINY = 0x00800000; // torch.finfo(torch.float32).tiny

    /// @notice Whether `out` is `kind(x, y)` (ADD, SUB, MUL, else DIV) in float32, bit for bit (any NaNs agree).
    function elementHolds(uint8 kind, uint32 x, uint32 y, uint32 out) public pure returns (bool) {
        uint32 r;
        if (kind == ADD) r = x.add(y);
        else if (kind == SUB) r = x.sub(y);
        else if (kind == MUL) r = x.mul(y);
        else r = x.div(y);
        return r.same32(out);
    }

    /// @notice Whether `hi` is `lo + x * y` in float32 (one multiply, then one add), bit for bit.
    function sumStepHolds(uint32 lo, uint32 x, uint32 y, uint32 hi) public pure returns (bool) {
        return lo.add(x.mul(y)).same32(hi);
    }

    /// @notice StepProver.openOutput's move: output element `g.elem` opened (`out`, against `op.outRoot`). An
    /// elementwise op: its inputs' elements opened too (`a[elem % aLen]`, `b[elem % bLen]`; GATHER: the id
    /// `a[elem / cols]` and the table's `b[id * cols + elem % cols]`; UNARY and UNARY_SLOPE: `a[elem]` alone,
    /// `Float64Functions.unaryHolds`) and the element recomputed (`elementHolds`): 1 it holds, 2 not. A product: the bisection of its partial sums starts (`s_0 = +0`,
    /// `s_inner` the element; the defender posts first). A tree sum: its descent starts (`_enterTree`). Both 0.
    function openOutput(
        StepProver.Op storage op,
        StepProver.Game storage g,
        StepProver.Element calldata out,
        StepProver.Element calldata a,
        StepProver.Element calldata b
    ) external returns (uint8) {
        uint64 elem = g.elem;
        uint32 v = open(out, op.outRoot, uint256(op.rows) * op.cols, elem, 0);
        uint8 kind = op.kind;
        if (kind == MATMUL) {
            g.phase = op.inner == 1 ? StepProver.Phase.Final : StepProver.Phase.Sums;
            g.lo = 0;
            g.hi = op.inner;
            g.loRoot = 0;
            g.hiRoot = bytes32(uint256(v));
            return 0; // the defender posts the first midpoint (or the final step): its turn already
        }
        if (kind == TREESUM) {
            _enterTree(op.inner, g, v);
            return 0;
        }
        bool holds;
        if (kind == GATHER) { // out[e] = b[a[e / cols] * cols + e % cols]: an embedding's lookup, bits copied
            uint256 id = open(a, op.aRoot, op.aLen, elem / op.cols, 1);
            uint256 place = id * op.cols + elem % op.cols;
            holds = place < op.bLen && open(b, op.bRoot, op.bLen, place, 2) == v;
        } else if (kind >= UNARY) { // out[e] = f(a[e]) or f'(a[e]), f the function code `inner`; b unread
            holds = _unaryHolds(op, a, elem, v);
        } else {
            uint32 x = open(a, op.aRoot, op.aLen, elem % op.aLen, 1);
            uint32 y = open(b, op.bRoot, op.bLen, elem % op.bLen, 2);
            holds = elementHolds(kind, x, y, v);
        }
        return holds ? 1 : 2;
    }

    /// @dev UNARY or UNARY_SLOPE element `elem` of `op`: `a[elem]` opened, `v` recomputed from it.
    function _unaryHolds(StepProver.Op storage op, StepProver.Element calldata a, uint64 elem, uint32 v)
        private
        view
        returns (bool)
    {
        return Float64Functions.unaryHolds(op.kind, op.inner, open(a, op.aRoot, op.aLen, elem, 1), v);
    }

    /// @notice StepProver.proveStep's check. A product: `a[r, lo]` and `b[lo, c]` of the game's element `(r, c)`
    /// opened and the sum at `lo + 1` (the game's `hiRoot`) recomputed from the one at `lo` (`loRoot`;
    /// `sumStepHolds`). A tree sum: the disputed leaf `a[r, lo, c]` of the game's element `(r, c)` opened, its bits
    /// the disputed value's (`hiRoot`; any NaNs agree); `b` unread.
    function finalStepHolds(
        StepProver.Op storage op,
        StepProver.Game storage g,
        StepProver.Element calldata a,
        StepProver.Element calldata b
    ) external view returns (bool) {
        uint256 lo = g.lo;
        if (op.kind == TREESUM) { // output (r, c) sums a[r, k, c] over k: a as (rows x inner x cols)
            uint256 cols = op.cols;
            uint256 place = (g.elem / cols) * op.inner * cols + lo * cols + g.elem % cols;
            return open(a, op.aRoot, op.aLen, place, 1).same32(uint32(uint256(g.hiRoot)));
        }
        uint256 row = g.elem / op.cols; // the output element's row: a[row, lo]
        uint32 x = open(a, op.aRoot, op.aLen, row * op.inner + lo, 1);
        uint32 y = open(b, op.bRoot, op.bLen, lo * op.cols + g.elem % op.cols, 2);
        return sumStepHolds(uint32(uint256(g.loRoot)), x, y, uint32(uint256(g.hiRoot)));
    }

    /// @notice The node count of level `level` of a tree sum over `n` elements (training/exact_math.py
    /// `tree_sum`): level 0 the elements, each next level `ceil(count / 2)` nodes, the last level one node.
    function levelCount(uint256 n, uint256 level) public pure returns (uint256 count) {
        count = n;
        for (uint256 l = 0; l < level; ++l) count = (count + 1) / 2;
    }

    /// @dev The start of a tree sum's descent (`openOutput`): the disputed node is the root (the output element
    /// `v` of the game's row `g.elem`), on the tree's top level. Level `l + 1` of a level `l` of `c` nodes: node
    /// `i < c / 2` is `fl(node_l(i) + node_l(i + c / 2))`; for an odd `c`, node `c / 2` is `node_l(c - 1)`
    /// carried (the same bits).
    function _enterTree(uint256 n, StepProver.Game storage g, uint32 v) private {
        uint256 top = 0;
        while (levelCount(n, top) > 1) ++top;
        g.hiRoot = bytes32(uint256(v));
        _settle(n, g, top, 0);
    }

    /// @notice A move of a tree sum's descent (StepProver checked the mover: the defender on its turn, else the
    /// challenger): the defender's posted children (`postChildren`), or the challenger's pick (`pickChild`).
    function treeMove(StepProver.Op storage op, StepProver.Game storage g, uint32 left, uint32 right, bool pickRight)
        external
    {
        if (g.defenderTurn) postChildren(g, left, right);
        else pickChild(op, g, pickRight);
    }

    /// @notice StepProver.postChildren's check and record: `left + right` is the disputed node in float32 (any
    /// NaNs agree; `ProverStepTreeMismatch` otherwise), kept for the challenger's pick (`loRoot`, `midRoot`).
    function postChildren(StepProver.Game storage g, uint32 left, uint32 right) internal {
        uint32 node = uint32(uint256(g.hiRoot));
        if (!left.add(right).same32(node)) revert StepProver.ProverStepTreeMismatch(left, right, node);
        g.loRoot = bytes32(uint256(left));
        g.midRoot = bytes32(uint256(right));
        g.midPosted = true;
        g.defenderTurn = false;
    }

    /// @notice StepProver.pickChild's move: the disputed node becomes the picked child (node `lo` or
    /// `lo + c / 2` of the level below, `c` its count), its value the posted one.
    function pickChild(StepProver.Op storage op, StepProver.Game storage g, bool right) internal {
        if (!g.midPosted) revert StepProver.ProverStepWrongPhase();
        uint256 level = g.hi - 1;
        uint256 index = g.lo;
        if (right) index += levelCount(op.inner, level) / 2;
        g.hiRoot = right ? g.midRoot : g.loRoot;
        g.midPosted = false;
        _settle(op.inner, g, level, index);
    }

    /// @dev The disputed node (node `index` of level `level`) moved down past carried nodes (each is the last
    /// node of the level below, the same bits), then the defender's move: the children of a sum node
    /// (`Phase.Tree`), or a leaf's opening (`Phase.Final`).
    function _settle(uint256 n, StepProver.Game storage g, uint256 level, uint256 index) private {
        while (level > 0) {
            uint256 below = levelCount(n, level - 1);
            if (below % 2 == 0 || index != below / 2) break;
            index = below - 1;
            --level;
        }
        g.lo = uint32(index);
        g.hi = uint32(level);
        g.phase = level == 0 ? StepProver.Phase.Final : StepProver.Phase.Tree;
        g.defenderTurn = true;
    }

    /// @notice Element `index` of the tensor of `numel` elements committed by `root`; reverts on a bad opening
    /// (`ProverStepBadOpening(which)`).
    function open(StepProver.Element calldata e, bytes32 root, uint256 numel, uint256 index, uint8 which)
        public
        pure
        returns (uint32)
    {
        uint256 chunk = index / CHUNK;
        if (!_header(e.leaf, chunk, numel)) revert StepProver.ProverStepBadOpening(which);
        if (!verify(e.leaf, chunk, (numel + CHUNK - 1) / CHUNK, e.path, root)) {
            revert StepProver.ProverStepBadOpening(which);
        }
        uint256 pos = HEADER + 4 * (index % CHUNK);
        return uint32(bytes4(e.leaf[pos:pos + 4]));
    }

    /// @notice StepProver.proveStart's check: reverts (`ProverStepBadOpening`: 3 the origin, 4 the tensor's root
    /// in the claim's start, 1 the element, 5 the committed chunk or a different value) unless element `elem`
    /// of state tensor `q` of `run`'s first state tree is the committed start's (its `startWeights`, as the run's
    /// origin leaf `q` places it; zero bits for a tensor that starts at zero), or `elem` is past the tensor.
    function proveStart(
        StepProver.StartOpening calldata o,
        StepProver.Game storage g,
        mapping(bytes32 => StepProver.RunClaim) storage runs,
        mapping(uint256 => bytes32) storage origins
    ) external view {
        StepProver.RunClaim storage run = runs[g.claimId];
        _proveStart(o, origins[run.runId], run, g.copyLeaf, g.elem);
    }

    function _proveStart(
        StepProver.StartOpening calldata o,
        bytes32 originRoot,
        StepProver.RunClaim storage run,
        uint32 q,
        uint64 elem
    ) private view {
        if (!verify(o.origin, q, run.stateLeaves, o.originPath, originRoot)) revert StepProver.ProverStepBadOpening(3);
        (uint32 tensor, uint64 numel, uint64 first, uint64 chunks) =
            abi.decode(o.origin, (uint32, uint64, uint64, uint64));
        if (elem >= numel) return; // no such element: nothing differs
        if (!verifyWord(o.tensorRoot, q, run.depth, o.rootPath, run.startRoot)) {
            revert StepProver.ProverStepBadOpening(4);
        }
        uint32 value = open(o.state, o.tensorRoot, numel, elem, 1);
        if (tensor != type(uint32).max) {
            if (!verify(o.committed.leaf, first + elem / CHUNK, chunks, o.committed.path, run.startWeights)) {
                revert StepProver.ProverStepBadOpening(5);
            }
            if (_committedValue(o.committed.leaf, tensor, elem) == value) return;
        } else if (value == 0) {
            return;
        }
        revert StepProver.ProverStepBadOpening(5);
    }

    /// @notice StepProver.proveEnd's check (a run whose end rule is set, `StepProver.setEndRule`): reverts
    /// (`ProverStepBadOpening`: 3 the origin, 4 the tensor's root in the claim's end, 1 the end element, 5 the
    /// committed chunk, 6 the payload piece's path, 7 a piece that does not code the element, or a bit width
    /// other than the first answer's on the tensor) unless the contribution's payload piece codes element
    /// `elem` of state tensor `q` (the game's) as the run's encoder codes `v = fl(S - E)` (`S` the committed
    /// start, `E` the claim's end; `endHolds`); a tensor that starts at zero (no stage tensor: the payload codes
    /// none of it) and an element past the tensor need no opening. `o` opens the end as it opens the start for
    /// proveStart (the tensor's root under the claim's `endRoot`); `piece` is the payload's piece of the chunk,
    /// `bits` a quant piece's bit width: the first answer on a tensor of a claim fixes it (`endBits`).
    function proveEnd(
        StepProver.StartOpening calldata o,
        StepProver.Element calldata piece,
        uint8 bits,
        StepProver.Game storage g,
        mapping(bytes32 => StepProver.RunClaim) storage runs,
        mapping(uint256 => bytes32) storage origins,
        mapping(bytes32 => uint8) storage endBits
    ) external {
        StepProver.RunClaim storage run = runs[g.claimId];
        _proveEnd(o, piece, bits, origins[run.runId], run, g.copyLeaf, g.elem);
        if (bits != 0 && piece.leaf.length != 0 && piece.leaf[0] == 0x01) { // a quant piece's width named
            bytes32 key = keccak256(abi.encode(g.claimId, g.copyLeaf));
            uint8 fixed_ = endBits[key];
            if (fixed_ == 0) endBits[key] = bits;
            else if (fixed_ != bits) revert StepProver.ProverStepBadOpening(7);
        }
    }

    function _proveEnd(
        StepProver.StartOpening calldata o,
        StepProver.Element calldata piece,
        uint8 bits,
        bytes32 originRoot,
        StepProver.RunClaim storage run,
        uint32 q,
        uint64 elem
    ) private view {
        if (!verify(o.origin, q, run.stateLeaves, o.originPath, originRoot)) revert StepProver.ProverStepBadOpening(3);
        (uint32 tensor, uint64 numel,,) = abi.decode(o.origin, (uint32, uint64, uint64, uint64));
        if (elem >= numel || tensor == type(uint32).max) return; // nothing of the payload to check
        if (!verifyWord(o.tensorRoot, q, run.depth, o.rootPath, run.endRoot)) {
            revert StepProver.ProverStepBadOpening(4);
        }
        uint32 e = open(o.state, o.tensorRoot, numel, elem, 1);
        uint32 s = _endStart(o, run, tensor, elem);
        if (!verify(piece.leaf, _chunkOf(o, elem), _chunksOf(o), piece.path, run.payloadRoot)) {
            revert StepProver.ProverStepBadOpening(6);
        }
        if (!endHolds(piece.leaf, elem % CHUNK, s, e, bits)) revert StepProver.ProverStepBadOpening(7);
    }

    /// @dev proveEnd's opening of the committed start's chunk that holds element `elem` of stage tensor `tensor`:
    /// the element's start value.
    function _endStart(StepProver.StartOpening calldata o, StepProver.RunClaim storage run, uint32 tensor,
        uint64 elem) private view returns (uint32)
    {
        if (!verify(o.committed.leaf, _chunkOf(o, elem), _chunksOf(o), o.committed.path, run.startWeights)) {
            revert StepProver.ProverStepBadOpening(5);
        }
        return _committedValue(o.committed.leaf, tensor, elem);
    }

    /// @dev The stage chunk that holds element `elem` of the origin's tensor.
    function _chunkOf(StepProver.StartOpening calldata o, uint64 elem) private pure returns (uint256) {
        (,, uint64 first,) = abi.decode(o.origin, (uint32, uint64, uint64, uint64));
        return first + elem / CHUNK;
    }

    /// @dev The stage's chunk count (the origin's).
    function _chunksOf(StepProver.StartOpening calldata o) private pure returns (uint256) {
        (,,, uint64 chunks) = abi.decode(o.origin, (uint32, uint64, uint64, uint64));
        return chunks;
    }

    /// @notice Whether payload piece `piece` (training/chunks.py: u8 codec, u32 count, then the elements) codes
    /// its element `pos` from the start `s` and the end `e` as the run's encoder does with nothing carried
    /// (training/end_relation.py): the target `v = fl(s - e)`; raw: the element is `v` (`same32`); quant: its
    /// i16 `q` is `clamp(rne(fl(v / max(x, tiny))), -qmax(bits), qmax(bits))`, `x` the element's column scale
    /// in the piece, `qmax(b) = 2**(b - 1) - 1`, `bits` 1 to 16; any other piece (a low-rank one) codes nothing.
    function endHolds(bytes calldata piece, uint256 pos, uint32 s, uint32 e, uint8 bits)
        public
        pure
        returns (bool)
    {
        if (piece.length < 5) return false;
        uint256 count = uint32(bytes4(piece[1:5]));
        if (pos >= count) return false;
        uint32 v = s.sub(e);
        if (piece[0] == 0x00) {
            if (piece.length != 5 + 4 * count) return false;
            return uint32(bytes4(piece[5 + 4 * pos:9 + 4 * pos])).same32(v);
        }
        if (piece[0] != 0x01 || piece.length != 5 + 6 * count || bits == 0 || bits > 16) return false;
        int256 q = int16(uint16(bytes2(piece[5 + 2 * pos:7 + 2 * pos])));
        uint256 where = 5 + 2 * count + 4 * pos;
        uint32 scale = uint32(bytes4(piece[where:where + 4]));
        // torch's clamp_min(tiny): a NaN scale stays NaN; a negative, zero or subnormal one becomes tiny
        if (!scale.isNaN32() && (scale >> 31 == 1 || scale < TINY)) scale = TINY;
        uint32 x = v.div(scale);
        if (x.isNaN32()) return false; // an honest encoder codes no NaN (it refuses a non-finite target)
        return rne(x, int256(uint256(1) << (bits - 1)) - 1) == q;
    }

    /// @notice `x` (a float32, not a NaN) rounded to the nearest integer, ties to even (torch.round), then
    /// clamped to `[-limit, limit]` (`limit` below 2**23).
    function rne(uint32 x, int256 limit) public pure returns (int256 r) {
        uint256 exp = (x >> 23) & 0xFF;
        if (exp >= 150) {
            r = limit; // |x| >= 2**23, or infinite: past any limit
        } else if (exp >= 126) { // |x| >= 0.5
            uint256 m = (x & 0x7FFFFF) | 0x800000;
            uint256 k = 150 - exp; // 1 to 24: |x| = m / 2**k
            uint256 whole = m >> k;
            uint256 rest = m & ((uint256(1) << k) - 1);
            uint256 half = uint256(1) << (k - 1);
            if (rest > half || (rest == half && whole & 1 == 1)) ++whole;
            // forge-lint: disable-next-line(unsafe-typecast)
            r = int256(whole) < limit ? int256(whole) : limit; // whole < 2**25: the cast is exact
        }
        if (x >> 31 == 1) r = -r;
    }

    /// @dev Element `elem` of tensor `tensor` in its committed chunk leaf (reverts unless the leaf holds it).
    function _committedValue(bytes calldata leaf, uint32 tensor, uint64 elem) private pure returns (uint32) {
        uint256 pos = HEADER + 4 * (elem % CHUNK);
        if (leaf.length < pos + 4 || uint32(bytes4(leaf[0:4])) != tensor
            || uint64(bytes8(leaf[4:12])) != elem - elem % CHUNK) {
            revert StepProver.ProverStepBadOpening(5);
        }
        return uint32(bytes4(leaf[pos:pos + 4]));
    }

    /// @notice Reverts (`ProverStepBadOp`) unless `op` is a shape the contract recomputes (StepProver.claim).
    function checkOp(StepProver.Op calldata op) external pure {
        bool ok = false;
        if (op.kind == MATMUL) {
            ok = op.inner != 0 && op.aLen == uint256(op.rows) * op.inner && op.bLen == uint256(op.inner) * op.cols;
        } else if (op.kind == TREESUM) { // rows x cols sums of `inner` elements each, a (rows x inner x cols)
            ok = op.inner != 0 && op.aLen == uint256(op.rows) * op.inner * op.cols && op.bLen == 0;
        } else if (op.kind == GATHER) { // rows ids, each a row of `cols` of the table b
            ok = op.inner == 0 && op.aLen == op.rows && op.bLen != 0 && op.bLen % op.cols == 0;
        } else if (op.kind == UNARY || op.kind == UNARY + 1) { // codes 1-8 (Float64Functions), no slope of 8
            ok = op.cols == 1 && op.aLen == op.rows && op.bLen == 0 && op.inner != 0
                && op.inner < (op.kind == UNARY ? 9 : 8);
        } else if (op.kind >= ADD && op.kind <= 4) {
            ok = op.cols == 1 && op.inner == 0 && op.aLen != 0 && op.bLen != 0;
        }
        if (!ok || uint256(op.rows) * op.cols == 0) revert StepProver.ProverStepBadOp();
    }

    /// @notice Reverts (`ProverStepBadOp`) unless `step`'s ops and state fit its trace tree (StepProver.claimStep).
    function checkStep(StepProver.StepClaim calldata step) external pure {
        if (step.ops == 0 || step.depth > 32 || uint256(step.stateLeaves) + step.ops > (uint256(1) << step.depth)) {
            revert StepProver.ProverStepBadOp();
        }
    }

    /// @notice StepProver.openOp's opening of op `g.lo` of `step`: its program leaf, its output leaf empty in the
    /// agreed tree `g.loRoot` and set in the disputed `g.hiRoot` (one path), its inputs in the agreed tree, or,
    /// an input `DATA_INPUT`, the step's batch: leaf `g.elem` (the step of a run game) of the run claim's
    /// `batchRoot` (`runs[g.claimId]`; none in a step claim's game).
    function openOp(
        StepProver.OpOpening calldata o,
        StepProver.StepClaim storage step,
        StepProver.Game storage g,
        mapping(bytes32 => StepProver.RunClaim) storage runs
    ) external view returns (StepProver.Op memory) {
        uint256 lo = g.lo;
        uint256 out = uint256(step.stateLeaves) + lo;
        uint256 depth = step.depth;
        if (!verify(o.spec, lo, uint256(step.ops) + step.stateLeaves, o.specPath, step.programRoot)) {
            revert StepProver.ProverStepBadOpening(3);
        }
        if (!verifyWord(bytes32(0), out, depth, o.outPath, g.loRoot) || !verifyWord(o.outRoot, out, depth, o.outPath, g.hiRoot)) {
            revert StepProver.ProverStepBadOpening(0);
        }
        StepProver.RunClaim storage run = runs[g.claimId];
        return inputs(o, depth, g.loRoot, out, run.batchRoot, g.elem, batchDepth(run.steps));
    }

    /// @notice StepProver.proveCopy's check, state leaf `q` of `step.endRoot` being `value` (checked there): it is
    /// the trace `hiRoot`'s leaf that the program's copy entry names, or zero past the state's leaves.
    function proveCopy(
        StepProver.StepClaim storage step,
        uint256 q,
        bytes32 hiRoot,
        bytes32 value,
        bytes calldata copy,
        bytes32[] calldata copyPath,
        bytes32[] calldata sourcePath
    ) external view {
        if (q >= step.stateLeaves) {
            if (value != bytes32(0)) revert StepProver.ProverStepBadOpening(0);
            return;
        }
        if (!_copyEntry(step, q, copy, copyPath)) revert StepProver.ProverStepBadOpening(3);
        if (!verifyWord(value, abi.decode(copy, (uint256)), step.depth, sourcePath, hiRoot)) {
            revert StepProver.ProverStepBadOpening(1);
        }
    }

    /// @dev Whether `copy` is `step`'s program leaf `ops + q` (state tensor `q`'s copy entry).
    function _copyEntry(StepProver.StepClaim storage step, uint256 q, bytes calldata copy, bytes32[] calldata path)
        private
        view
        returns (bool)
    {
        uint256 ops = step.ops;
        return verify(copy, ops + q, ops + step.stateLeaves, path, step.programRoot);
    }

    /// @notice The op of program leaf `o.spec`, its inputs' roots opened in the agreed tree `agreed` (before
    /// `out`) or, an input `DATA_INPUT`, at leaf `k` of the batch tree `batchRoot` (`bdepth` levels), its output
    /// `o.outRoot`.
    function inputs(
        StepProver.OpOpening calldata o,
        uint256 depth,
        bytes32 agreed,
        uint256 out,
        bytes32 batchRoot,
        uint256 k,
        uint256 bdepth
    ) public pure returns (StepProver.Op memory op) {
        if (o.spec.length != 256) revert StepProver.ProverStepBadOp();
        uint256[8] memory f = abi.decode(o.spec, (uint256[8]));
        if (f[0] > type(uint8).max) revert StepProver.ProverStepBadOp();
        for (uint256 i = 1; i < 6; ++i) {
            if (f[i] > type(uint32).max) revert StepProver.ProverStepBadOp();
        }
        _input(o.aRoot, f[6], o.aPath, depth, agreed, out, batchRoot, k, bdepth, 1);
        _input(o.bRoot, f[7], o.bPath, depth, agreed, out, batchRoot, k, bdepth, 2);
        op = StepProver.Op(uint8(f[0]), uint32(f[1]), uint32(f[2]), uint32(f[3]), uint32(f[4]), uint32(f[5]),
            o.aRoot, o.bRoot, o.outRoot);
    }

    /// @dev An op input's root: at trace leaf `index` (before `out`) of `agreed`, the step's batch, or a constant
    /// (`CONST_INPUT + bits`: `constRoot(bits)`).
    function _input(
        bytes32 root,
        uint256 index,
        bytes32[] calldata path,
        uint256 depth,
        bytes32 agreed,
        uint256 out,
        bytes32 batchRoot,
        uint256 k,
        uint256 bdepth,
        uint8 which
    ) private pure {
        if (index == DATA_INPUT) {
            if (batchRoot == bytes32(0) || !verifyWord(root, k, bdepth, path, batchRoot)) {
                revert StepProver.ProverStepBadOpening(which);
            }
            return;
        }
        if (index >= CONST_INPUT && index < CONST_INPUT << 1) { // a constant: no path, its root recomputed
            // forge-lint: disable-next-line(unsafe-typecast)
            uint32 bits = uint32(index); // the low 32 bits: index - CONST_INPUT
            if (root != constRoot(bits)) revert StepProver.ProverStepBadOpening(which);
            return;
        }
        if (index >= out) revert StepProver.ProverStepBadOp();
        if (!verifyWord(root, index, depth, path, agreed)) revert StepProver.ProverStepBadOpening(which);
    }

    /// @notice The root of the one-element tensor of float32 `bits` (a program's constant operand, an input
    /// index `CONST_INPUT + bits`, e.g. a mean's count): the ledger/merkle.py root of its one chunk leaf (u32
    /// tensor 0, u64 offset 0, u64 cols 1, u32 count 1, the bits; training/chunks.py).
    function constRoot(uint32 bits) public pure returns (bytes32) {
        return sha256(abi.encodePacked(bytes1(0x00), uint32(0), uint64(0), uint64(1), uint32(1), bits));
    }

    /// @notice The depth of a run claim's batch tree over `steps` steps: ceil(log2 steps).
    function batchDepth(uint256 steps) public pure returns (uint256 d) {
        while ((uint256(1) << d) < steps) ++d;
    }

    /// @notice Row `row`'s window offset of step `step` in round `round` (`StepProver.DataTerms`): the first
    /// 8 bytes of sha256("dlx-node/round-batches/v2" || u64 seed || key || u64 round || u64 step || u64 row),
    /// big-endian, modulo `nStart` (training/data_binding.py `key_window_offsets`).
    function windowOffset(uint64 seed, address key, uint64 round, uint64 step, uint64 row, uint64 nStart)
        public
        pure
        returns (uint64)
    {
        return uint64(bytes8(sha256(abi.encodePacked(WINDOWS, seed, key, round, step, row)))) % nStart;
    }

    /// @notice StepProver.challengeData's checks: the run's data is set and the claim names its key
    /// (`ProverStepDataUnbound`), the step, row and position are inside the batch (`ProverStepBadElement`); the
    /// game `g` disputes step `step` (`g.lo`) and its token tensor's element `row * (window + 1) + pos`.
    function challengeData(
        StepProver.Game storage g,
        mapping(bytes32 => StepProver.RunClaim) storage runs,
        mapping(uint256 => StepProver.DataTerms) storage data,
        uint32 step,
        uint32 row,
        uint32 pos
    ) external {
        StepProver.RunClaim storage run = runs[g.claimId];
        StepProver.DataTerms storage t = data[run.runId];
        if (t.root == bytes32(0) || run.dataKey == address(0)) revert StepProver.ProverStepDataUnbound(run.runId);
        if (step >= run.steps) revert StepProver.ProverStepBadElement(step);
        if (row >= t.rows) revert StepProver.ProverStepBadElement(row);
        if (pos > t.window) revert StepProver.ProverStepBadElement(pos);
        g.lo = step;
        g.elem = uint64(row) * (uint64(t.window) + 1) + pos;
    }

    /// @notice StepProver.proveData's check of `o` (a `StartOpening` of the batch: `tensorRoot` step `g.lo`'s
    /// token tensor root, `rootPath` its path in the claim's batch tree, `state` the token, `committed` the
    /// corpus's chunk; the origin unread): reverts (`ProverStepBadOpening`: 4 the batch's root under the
    /// claim's `batchRoot`, 1 the token under it, 5 the corpus's chunk or a different token) unless token
    /// `g.elem` of step `g.lo`'s batch is the run's data: the corpus's token at the row's window offset plus
    /// the position (`windowOffset`, keyed by the claim's `dataKey`, in the claim's round).
    function proveData(
        StepProver.StartOpening calldata o,
        StepProver.Game storage g,
        mapping(bytes32 => StepProver.RunClaim) storage runs,
        mapping(uint256 => StepProver.DataTerms) storage data
    ) external view {
        StepProver.RunClaim storage run = runs[g.claimId];
        StepProver.DataTerms memory t = data[run.runId];
        uint64 k = g.lo;
        if (!verifyWord(o.tensorRoot, k, batchDepth(run.steps), o.rootPath, run.batchRoot)) {
            revert StepProver.ProverStepBadOpening(4);
        }
        uint64 width = uint64(t.window) + 1;
        uint32 value = open(o.state, o.tensorRoot, uint256(t.rows) * width, g.elem, 1);
        uint64 row = g.elem / width;
        uint256 index = uint256(windowOffset(t.seed, run.dataKey, run.round, k, row, t.tokens - t.window))
            + g.elem % width;
        if (open(o.committed, t.root, t.tokens, index, 5) != value) revert StepProver.ProverStepBadOpening(5);
    }

    /// @notice Whether the 32-byte leaf `value` is at `index` of a full ledger/merkle.py tree of `2**depth` leaves.
    function verifyWord(bytes32 value, uint256 index, uint256 depth, bytes32[] calldata path, bytes32 root)
        public
        pure
        returns (bool)
    {
        if (path.length != depth || index >> depth != 0) return false;
        bytes32 node = sha256(abi.encodePacked(bytes1(0x00), value));
        for (uint256 d = 0; d < depth; ++d) {
            node = (index >> d) & 1 == 1
                ? sha256(abi.encodePacked(bytes1(0x01), path[d], node))
                : sha256(abi.encodePacked(bytes1(0x01), node, path[d]));
        }
        return node == root;
    }

    /// @notice ProverCommon.verifyLeaf (the one implementation): `leaf` at `index` of a ledger/merkle.py tree of
    /// `count` leaves, callable by StepProver through this linked library.
    function verify(bytes calldata leaf, uint256 index, uint256 count, bytes32[] calldata path, bytes32 root)
        public
        pure
        returns (bool)
    {
        return ProverCommon.verifyLeaf(leaf, index, count, path, root);
    }

    /// @dev Whether `leaf` is chunk `chunk`'s leaf of a lone tensor of `numel` elements: u32 tensor 0, u64 offset,
    /// u64 cols (not checked: the flat order is the same for any matrix view), u32 count, count values.
    function _header(bytes calldata leaf, uint256 chunk, uint256 numel) private pure returns (bool) {
        uint256 count = numel - chunk * CHUNK;
        if (count > CHUNK) count = CHUNK;
        if (leaf.length != HEADER + 4 * count) return false;
        uint256 head = uint256(bytes32(leaf[0:HEADER])); // zero-padded: a one-element leaf has 28 bytes
        return head >> 224 == 0 && (head >> 160) & type(uint64).max == chunk * CHUNK && uint32(head >> 64) == count;
    }
}
