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

A node keeps the terms it computed in ``<data_dir>/data-terms.json`` (:func:`cached_terms`), keyed by the
dataset's identity (each of its files' device, inode, size, modification and change times, as ``git``'s index
does: a rewrite changes the change time, which no user sets) and every input of the terms (the seed, the
held-out fraction, the tokenizer and its file's identity, the batch rows, the block size), so a start does not
read the whole split again (0.54 s of CPU for 9 million ids) unless one of them changed. An entry is not
written where a file changed within :data:`RACY_S` seconds (a rewrite in the same clock tick could keep every
time: ``git``'s racy-clean rule), nor where the dataset changed while it was read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

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


#: The cache of a node's own data terms, in its data directory.
TERMS_CACHE = "data-terms.json"
#: A file changed less than this many seconds before the terms were computed is not trusted to a cache entry.
RACY_S = 2.0


def _identity(path: Path) -> list:
    """What identifies ``path``'s contents without reading them: each file's relative name, device, inode,
    size, modification and change times (a directory's files, sorted), or ``["missing"]``."""
    if not path.exists():
        return ["missing"]
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    out = []
    for file in files:
        st = file.stat()
        out.append([str(file.relative_to(path)) if path.is_dir() else file.name, st.st_dev, st.st_ino,
                    st.st_size, st.st_mtime_ns, st.st_ctime_ns])
    return out


def _terms_key(cfg) -> tuple[str, int]:
    """The cache key of ``cfg``'s data terms (module docstring) and the newest change time (ns) it saw."""
    training, model = cfg.training, cfg.model
    data = _identity(Path(training.data_path).expanduser().resolve()) if training.data_path else ["generated"]
    tokenizer = str(getattr(model, "tokenizer", ""))
    tokenizer_file = Path(tokenizer).expanduser()
    value = {"version": 1, "data": data, "seed": training.seed, "eval_fraction": training.eval_fraction,
             "rows": training.batch_size, "block": model.block_size, "tokenizer": tokenizer,
             "tokenizer_file": _identity(tokenizer_file) if tokenizer and tokenizer_file.is_file() else None,
             "vocab": getattr(model, "vocab_size", None), "byte_level": getattr(model, "byte_level", None)}
    files = [*data, *(value["tokenizer_file"] or [])]
    newest = max((entry[-1] for entry in files if isinstance(entry, list)), default=0)
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest(), newest


def cached_terms(cfg, cache: Path | None):
    """:func:`own_terms` of ``cfg``'s dataset, read from ``cache`` (a JSON file) where its key is this
    dataset's and these inputs' (module docstring), else computed and kept there (``cache`` None:
    computed)."""
    from ledger.stepdata import DataTerms

    if cache is None:
        return own_terms(cfg)
    key, _newest = _terms_key(cfg)
    try:
        value = json.loads(cache.read_text())
        if value.get("key") == key:
            return DataTerms(bytes.fromhex(value["root"]), int(value["seed"]), int(value["tokens"]),
                             int(value["rows"]), int(value["window"]))
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        logger.warning("%s does not read (%s): the data terms are computed again", cache, exc)
    terms = own_terms(cfg)
    after, newest = _terms_key(cfg)
    if after != key or time.time_ns() - newest < RACY_S * 1e9:  # changed while read, or too new to trust
        return terms
    try:
        from node.fsutil import atomic_write_bytes

        atomic_write_bytes(cache, json.dumps({
            "key": key, "root": bytes(terms.root).hex(), "seed": terms.seed, "tokens": terms.tokens,
            "rows": terms.rows, "window": terms.window}).encode(), durable=False)
    except OSError as exc:
        logger.warning("the data terms are not kept in %s (%s): computed again at the next start", cache, exc)
    return terms


def _cache_of(cfg) -> Path | None:
    """The terms cache in ``cfg``'s data directory (None: it has none, or it does not exist yet)."""
    data_dir = getattr(cfg, "data_dir", None)
    if not data_dir or not Path(data_dir).expanduser().is_dir():
        return None
    return Path(data_dir).expanduser() / TERMS_CACHE


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
    document ``cfg``, or are set in a run drawn by replica index; log a run drawn by account without terms.
    ``corpus``: the dataset (None: ``cfg``'s, its terms cached in its data directory,
    :func:`cached_terms`)."""
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
        mine = own_terms(cfg, corpus) if corpus is not None else cached_terms(cfg, _cache_of(cfg))
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
