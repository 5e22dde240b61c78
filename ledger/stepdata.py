"""A run claim's data, bound (issue 78; docs/FRAUD_PROOF.md "The data's binding"): StepProver's
``setData``, ``challengeData`` and ``proveData`` and their openings.

The run's creator fixes the run's data (:class:`DataTerms`: the root over the training split's token-id chunk
leaves, the seed, the split's length, the batch rows and the block size) once, before the first commit. A run
claim commits the batches its steps read (:func:`batch_root`, the claim's ``batchRoot``) and names the account
they are drawn with (the claim's ``dataKey``: the member its round's factors list). Anyone may bond that one
token of one step's batch is not the run's data; the defender opens the batch's root in the claim's batch
tree, the token in the batch and the corpus's chunk that holds the token the window formula places there
(:func:`data_opening`). The leaves are the caller's (``training.data_binding``; this package knows no torch).
A node draws its batches by account in a run with ``training.data_windows = "account"``, keyed by its
replica's stage-0 member: the ``dataKey`` of its stage-0 contribution's claim and, shown by the later stage's
member's signature (``ledger.stepbinding.DataKeyClaim``), of its later stages' claims (docs/FRAUD_PROOF.md
"The node's draw", "The replica's key"). ``create-run`` fixes the terms of such a run (node/dataterms.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ledger.chunkproof import tree_path, tree_root
from ledger.errors import LedgerInputError
from ledger.merkle import merkle_levels
from ledger.stepproof import CHUNK, StepProverClient
from rulebook.data_windows import batch_words, window_offset


@dataclass(frozen=True)
class DataTerms:
    """A run's data (StepProver ``DataTerms``): ``root`` over the training split's token-id chunk leaves,
    ``seed`` the run's seed, ``tokens`` the split's length, ``rows`` a step's batch rows, ``window`` the block
    size (a row is ``window + 1`` ids)."""

    root: bytes
    seed: int
    tokens: int
    rows: int
    window: int

    def as_tuple(self) -> tuple:
        return (bytes(self.root), self.seed, self.tokens, self.rows, self.window)

    def element(self, row: int, pos: int) -> int:
        """The index of token ``pos`` of row ``row`` in a step's batch tensor."""
        return row * (self.window + 1) + pos


class CorpusTree:
    """The run's data tree as a defender holds it: every level of the tree over the training split's chunk
    leaves (32 bytes a leaf: about 4.5 MB for 9 million ids) and ``leaf_at(i)``, which reads chunk leaf ``i``
    again (a node: from its dataset), so the corpus's leaves are never held whole. :meth:`of` takes a list
    of leaves held in memory."""

    def __init__(self, leaves: Iterable[bytes], leaf_at: Callable[[int], bytes]) -> None:
        self.levels = merkle_levels(leaves)  # read once, in order (a generator is never held whole)
        self.leaf_at = leaf_at

    @classmethod
    def of(cls, leaves: list[bytes]) -> CorpusTree:
        return cls(leaves, leaves.__getitem__)

    @property
    def root(self) -> bytes:
        return self.levels[-1][0]

    @property
    def size(self) -> int:
        return len(self.levels[0])

    def opening(self, index: int) -> tuple[bytes, list[bytes]]:
        """Chunk leaf ``index`` and its path (``tree_path``'s); LedgerInputError past the leaves or where the
        leaf read again is not the tree's (the dataset changed under it)."""
        from ledger.merkle import leaf_hash

        if not 0 <= index < self.size:
            raise LedgerInputError(f"corpus chunk {index} past the data's {self.size}")
        leaf = bytes(self.leaf_at(index))
        if leaf_hash(leaf) != self.levels[0][index]:
            raise LedgerInputError(f"corpus chunk {index} read again is not the data tree's (the dataset "
                                   "changed since the tree was made)")
        path, position = [], index
        for level in self.levels[:-1]:
            sibling = position ^ 1
            if sibling < len(level):
                path.append(level[sibling])
            position //= 2
        return leaf, path


def batch_root(batches: list[list[bytes]]) -> bytes:
    """A run claim's ``batchRoot`` over its steps' batches (each a step's token tensor's chunk leaves)."""
    return tree_root(batch_words([tree_root(leaves) for leaves in batches]))


def batch_path(batches: list[list[bytes]], step: int) -> list[bytes]:
    """The path of step ``step``'s batch root in the claim's batch tree (``StepTrace.batch_path``)."""
    return tree_path(batch_words([tree_root(leaves) for leaves in batches]), step)


def offset_of(terms: DataTerms, key: str, round_: int, step: int, row: int) -> int:
    """Row ``row``'s window offset of step ``step`` (StepProverMath.windowOffset)."""
    return window_offset(terms.seed, bytes.fromhex(key[2:]), round_, step, row, terms.tokens - terms.window)


def data_opening(terms: DataTerms, batches: list[list[bytes]], corpus: list[bytes] | CorpusTree, key: str,
                 round_: int, step: int, elem: int) -> tuple:
    """``proveData``'s opening (a ``StartOpening`` of the batch: no origin, step ``step``'s batch root and its
    path in the batch tree, token ``elem`` under it, and the corpus's chunk that holds the token the window
    formula places there; ``corpus`` the data root's chunk leaves, or its :class:`CorpusTree`)."""
    words = batch_words([tree_root(leaves) for leaves in batches])
    leaves = batches[step]
    row, pos = divmod(elem, terms.window + 1)
    index = offset_of(terms, key, round_, step, row) + pos
    token = (leaves[elem // CHUNK], tree_path(leaves, elem // CHUNK))
    chunk = corpus.opening(index // CHUNK) if isinstance(corpus, CorpusTree) \
        else (corpus[index // CHUNK], tree_path(corpus, index // CHUNK))
    return (b"", [], words[step], tree_path(words, step), token, chunk)


class DataClient:
    """The data moves on ``client``'s StepProver, each returning its receipt."""

    def __init__(self, client: StepProverClient) -> None:
        self.client = client

    def set_data(self, creator: str, run_id: int, terms: DataTerms):
        """Fix run ``run_id``'s data (its creator, once, before the first commit)."""
        return self.client._send("setData", creator, run_id, terms.as_tuple())

    def challenge(self, claim_id: bytes, step: int, row: int, pos: int, challenger: str) -> bytes:
        """Bond the claim's stake against token ``pos`` of row ``row`` of step ``step``'s batch; its game."""
        self.client._send("challengeData", challenger, claim_id, step, row, pos, value=self.client.bond)
        return bytes(self.client.contract.functions.gameIdOf(claim_id, challenger).call())

    def prove(self, game_id: bytes, defender: str, opening: tuple):
        return self.client._send("proveData", defender, game_id, opening)

    def terms_of(self, run_id: int, from_block: int = 0) -> DataTerms | None:
        """Run ``run_id``'s data as its ``DataFixed`` event gave it (None: not fixed); ``from_block``: the
        ledger's deployment block (no event is older)."""
        event = self.client.contract.events.DataFixed
        logs = event.get_logs(from_block=from_block, argument_filters={"runId": run_id})
        if not logs:
            return None
        args = logs[-1]["args"]
        return DataTerms(bytes(args["root"]), args["seed"], args["tokens"], args["rows"], args["window"])
