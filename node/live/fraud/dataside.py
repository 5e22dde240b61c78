"""The data side of this node's defense (issue 78; docs/FRAUD_PROOF.md "The data's binding", "The node defends
its contributions").

In a run whose data terms are fixed (StepProver ``setData``) a run claim commits the batches its steps read
(``batchRoot``) and anyone may dispute one token of one of them (``challengeData``); a claim that cannot open
it (``proveData``) within its clock is refuted. The node's batches of a round are the run's windows keyed by
its replica's data key (``training.data_windows = "account"``: the account of the member holding the
replica's stage 0), so the defender draws them again from its dataset (``claim_batches``, the same windows the
worker trained on), commits them, and answers a data dispute with the batch's token and the corpus's chunk
that holds it under the run's data root (:class:`NodeData`). Nothing of it needs keeping across a restart: the
dataset, the terms (on chain) and the key (the round's factors) are all there again.

The corpus's tree is made once per life, at the first case of a data-bound run (one pass over the training
split, a span at a time: ``training.data_binding.iter_data_leaves``), and only its hashes are held
(``ledger.stepdata.CorpusTree``: 32 bytes a chunk of 64 ids); a chunk is read again from the dataset when a
dispute needs it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ledger.stepdata import CorpusTree, DataTerms
from ledger.stepdefense import DataSide
from node.errors import ConfigError

logger = logging.getLogger(__name__)


class NodeData:
    """This node's dataset as its defender reads it (module docstring): ``load`` opens the corpus (the run
    document's ``training.data_path`` under its tokenizer), ``windows`` the run's
    ``training.data_windows``."""

    def __init__(self, load: Callable[[], object], windows: str) -> None:
        self._load = load
        self.windows = windows
        self._corpus = None
        self._tree: CorpusTree | None = None

    @classmethod
    def from_config(cls, cfg) -> NodeData:
        """The dataset of node config ``cfg`` (opened at its first use)."""
        from training.data import corpus_from_config

        return cls(lambda: corpus_from_config(cfg.training, cfg.model), cfg.training.data_windows)

    def corpus(self):
        if self._corpus is None:
            try:
                self._corpus = self._load()
            except (OSError, ValueError) as exc:  # training's DataError is a ValueError
                raise ConfigError(f"this node's dataset does not read ({exc}): no data dispute of its claims "
                                  "can be answered") from exc
        return self._corpus

    def tree(self, terms: DataTerms) -> CorpusTree:
        """The run's data tree from this node's dataset; ConfigError where its root is not the terms'."""
        if self._tree is None or self._tree.root != bytes(terms.root):
            from training.data_binding import iter_data_leaves

            corpus = self.corpus()
            tree = CorpusTree(iter_data_leaves(corpus), lambda i: chunk_leaf(corpus, i))
            if tree.root != bytes(terms.root):
                raise ConfigError(f"this node's dataset's data root {tree.root.hex()[:16]}.. is not the "
                                  f"run's ({bytes(terms.root).hex()[:16]}..): it cannot open the run's data")
            self._tree = tree
        return self._tree

    def side(self, terms: DataTerms, key: str, round_: int,
             steps: int) -> tuple[list[torch.Tensor], DataSide]:
        """The batches a claim of ``steps`` steps of round ``round_`` drawn with account ``key`` commits, and
        the defender's data side answering their disputes; ConfigError where the run does not draw by
        account."""
        from training.data_binding import batch_leaves, claim_batches

        if self.windows != "account":
            raise ConfigError(f"the run binds its claims' batches by account but this node draws its "
                              f"windows by {self.windows!r} (training.data_windows): its claims could not "
                              "answer their data disputes")
        batches = claim_batches(self.corpus(), terms.seed, bytes.fromhex(key[2:]), round_, steps, terms.rows,
                                terms.window)
        side = DataSide(terms, self.tree(terms), [batch_leaves(b) for b in batches], key, round_)
        return batches, side


def chunk_leaf(corpus, index: int) -> bytes:
    """Chunk leaf ``index`` (64 ids) of ``corpus``'s training split, read from the corpus
    (``training.data_binding.data_leaves``' leaf ``index``)."""
    from training.data_binding import CHUNK, id_leaves

    start = index * CHUNK
    length = min(CHUNK, corpus.split_tokens("train") - start)
    train = getattr(corpus, "train", None)
    ids = train[start:start + length] if isinstance(train, torch.Tensor) \
        else corpus.split("train").windows(torch.tensor([start]), length)[0]
    return id_leaves(ids, first=start)[0]
