"""The run's data terms: what ``create-run`` fixes on chain and what a joining node checks (issue 78;
docs/FRAUD_PROOF.md "The data's binding", "The run's data terms").

A run claim's batches are disputed against the run's data terms on the ledger's StepProver (``setData``: the
root over the training split's token-id chunk leaves, the seed, the split's length, the batch rows and the
block size). The chain holds only the run document's hash, so it cannot check them: the creator computes them
from the run's own dataset (:func:`own_terms`), and every member recomputes them from its copy before it joins
or starts (:func:`check_data_terms`).

A run whose windows are drawn by account (``training.data_windows = "account"``) is the one that takes data
disputes: ``create-run`` fixes its terms by default (``--no-data-terms``: none, said). A run drawn by replica
index takes none: terms there would dispute every honest claim's batches at windows it never drew (a claim is
keyed by account), so a node refuses to join a run drawn by replica index whose terms are set.
"""

from __future__ import annotations

import logging

from node.errors import ConfigError

logger = logging.getLogger(__name__)

#: Gas reserved for ``setData`` in create-run's spend plan (measured: 102,924 on py-evm, bench/results/
#: step_proof.json ``data_dispute``).
SET_DATA_GAS = 150_000


def own_terms(cfg, corpus=None):
    """The data terms (``ledger.stepdata.DataTerms``) of the run document ``cfg`` (a NodeConfig) on this
    node's dataset (``corpus``; None: ``training.data_path``'s, opened here), the training split read a span
    at a time."""
    from ledger.merkle import merkle_root
    from ledger.stepdata import DataTerms
    from training.data import corpus_from_config
    from training.data_binding import iter_data_leaves

    if corpus is None:
        corpus = corpus_from_config(cfg.training, cfg.model)
    root = merkle_root(iter_data_leaves(corpus))
    return DataTerms(root, cfg.training.seed, corpus.split_tokens("train"), cfg.training.batch_size,
                     cfg.model.block_size)


def data_client(client):
    """The data moves on the StepProver behind ``client``'s ledger (a ``ledger.client.LedgerClient``); None
    where its ledger has none."""
    from web3.exceptions import Web3Exception

    from ledger.stepcase import ledger_step_prover
    from ledger.stepdata import DataClient
    from ledger.stepproof import StepProverClient

    try:
        address = ledger_step_prover(client.w3, client.ledger_address)
        return DataClient(StepProverClient(client.w3, address, bond=0))
    except (Web3Exception, ValueError) as exc:  # no StepProver behind this ledger: no data terms
        logger.debug("no StepProver behind ledger %s (%s)", client.ledger_address, exc)
        return None


def _describe(terms) -> str:
    return (f"root {bytes(terms.root).hex()[:16]}.., seed {terms.seed}, {terms.tokens:,} training tokens, "
            f"{terms.rows} rows, block {terms.window}")


def check_data_terms(client, run_id: int, cfg, corpus=None) -> None:
    """Refuse (ConfigError) run ``run_id`` whose data terms on chain are not this node's dataset's under its
    document ``cfg``, or are set in a run drawn by replica index; log a run drawn by account without terms."""
    data = data_client(client)
    on_chain = data.terms_of(run_id, client.from_block) if data is not None else None
    windows = cfg.training.data_windows
    if on_chain is None:
        if windows == "account":
            logger.warning("run %d draws its windows by account but has no data terms on chain "
                           "(StepProver.setData): its contributions' batches cannot be disputed", run_id)
        return
    if windows != "account":
        raise ConfigError(
            f"run {run_id} has data terms on chain ({_describe(on_chain)}) but its document draws each "
            f"round's windows by replica index (training.data_windows = {windows!r}): a claim's batches are "
            "keyed by account, so every honest contribution's data disputes would be lost; not joining (the "
            "run's creator must create it again with training.data_windows = \"account\")")
    from training.errors import TrainingError

    try:
        mine = own_terms(cfg, corpus)
    except (OSError, ValueError, TrainingError) as exc:
        raise ConfigError(f"run {run_id} has data terms on chain: this node must check them against its "
                          f"dataset (training.data_path = {cfg.training.data_path!r}), which it cannot read "
                          f"({exc}); dlx-node join fetches a prepared dataset from the run's peers") from exc
    if mine != on_chain:
        raise ConfigError(
            f"run {run_id}'s data terms on chain ({_describe(on_chain)}) are not this node's dataset's under "
            f"the run document ({_describe(mine)}): its contributions could not answer the data disputes of "
            "their own batches; not joining (check training.data_path, or the run's creator fixed other "
            "terms)")
    logger.info("run %d: its data terms on chain are this node's dataset's (%s)", run_id, _describe(mine))


def fix_data_terms(client, run_id: int, terms) -> str:
    """``create-run``'s step: fix ``terms`` (the run's dataset's, :func:`own_terms`) as run ``run_id``'s data
    terms on the ledger's StepProver unless they are already these; a line saying what was done. ConfigError
    where the ledger has no StepProver, the run holds other terms, or it committed a round before any were
    set."""
    data = data_client(client)
    if data is None:
        raise ConfigError(f"ledger {client.ledger_address} has no StepProver: no data terms can be fixed "
                          "(pass --no-data-terms to create the run without them)")
    on_chain = data.terms_of(run_id, client.from_block)
    if on_chain == terms:
        return f"run {run_id}'s data terms were fixed before ({_describe(terms)})"
    if on_chain is not None:
        raise ConfigError(f"run {run_id} holds other data terms ({_describe(on_chain)}) than its dataset's "
                          f"({_describe(terms)}): they are fixed once; create the run again")
    if client.commit_count(run_id):
        raise ConfigError(f"run {run_id} committed a round before its data terms were fixed: they can no "
                          "longer be set (StepProver.setData takes them before the first commit only)")
    client.sender.transact(data.client.contract, "setData", (run_id, terms.as_tuple()),
                           f"fix run {run_id}'s data terms")
    return f"fixed run {run_id}'s data terms on chain ({_describe(terms)})"
