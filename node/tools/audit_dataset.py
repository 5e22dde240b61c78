"""The run's prepared dataset for an audit given no ``--data``: fetched from the peers it was given.

A run on a prepared dataset (``manifest:<root>`` in its run document) screens every round on the dataset's
held-out batches and reruns contributions on its training batches, so its replay and reruns need the
dataset. Its nodes serve it (and so does the demo's seeder, node/commands/seeder.py); an audit through a run
link fetches it shard by shard into its own scratch directory, every shard checked against the manifest whose
Merkle root the run document names (node/shardfetch.py), as a joining node does.
"""

from __future__ import annotations

from pathlib import Path


def dataset_from_peers(sources: list, root: str) -> Path | None:
    """A complete, checked copy of the dataset ``root`` fetched from the peers of the audit's
    :class:`node.tools.evidence.PeerSource` (None when it has none); raises
    :class:`node.shardfetch.DatasetUnavailable` when no peer serves it whole."""
    from node.shardfetch import complete_dataset

    fetcher = next((s.fetcher for s in sources if getattr(s, "name", "") == "peers"), None)
    if fetcher is None or not fetcher.bootstrap_peers:
        return None
    directory = fetcher.workdir / "dataset" / root
    complete_dataset(root, directory, fetcher.host, list(fetcher.bootstrap_peers), tty=False)
    return directory
