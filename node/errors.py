"""The exception root of dlx-node.

Every error the project raises on purpose derives from :class:`DlxError`. Each
package keeps a small hierarchy of its own under it (``training.errors``,
``p2p.errors``, ``ledger.errors``); only the CLI turns them into exit codes and
one-line messages. This module imports nothing so that every package can use
it without pulling in torch, libp2p or web3.
"""


class DlxError(Exception):
    """Root of every error dlx-node raises deliberately."""


class ConfigError(DlxError, ValueError):
    """A configuration value is missing, malformed or out of range."""


class NodeError(DlxError):
    """An error of the node's orchestration (round protocol, state files)."""


class StateError(NodeError):
    """A checkpoint or state file is corrupt, mismatched or unreadable."""
