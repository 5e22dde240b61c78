"""The node's own errors, and the groups of every package's errors the node catches.

Each package keeps its own exception root (``training.errors.TrainingError``,
``p2p.errors.P2PError``, ``ledger.errors.LedgerError``) and imports nothing
from ``node/``. ``node/`` sits on top: its errors derive from :class:`NodeError`,
and :data:`DLX_ERRORS` / :data:`CONFIG_ERRORS` group every package's roots for
the places that handle "any deliberate error" (the CLI, which turns them into
exit codes and one-line messages; the committer and the offline tools, which
report and go on). Only light modules are imported here (no torch, libp2p, web3).
"""

from ledger.errors import LedgerConfigError, LedgerError
from p2p.errors import P2PConfigError, P2PError
from training.errors import TrainingConfigError, TrainingError


class NodeError(Exception):
    """Root of the errors of ``node/`` (round protocol, state files, commands)."""


class ConfigError(NodeError, ValueError):
    """A node configuration value (node.toml, run document, command line) is missing, malformed or out of
    range."""


class StateError(NodeError):
    """A checkpoint or state file is corrupt, mismatched or unreadable."""


#: Every error any package raises on purpose (the roots of the four packages).
DLX_ERRORS: tuple[type[Exception], ...] = (NodeError, TrainingError, P2PError, LedgerError)

#: A setting of any package is wrong: the user must fix a configuration.
CONFIG_ERRORS: tuple[type[Exception], ...] = (ConfigError, TrainingConfigError, P2PConfigError,
                                              LedgerConfigError)


class NotRegistered(NodeError):
    """The node's account is not registered on chain, or is registered to another key."""


class RunOver(NotRegistered):
    """The run's last round is committed: nothing a node trains for it could ever commit (exit 6)."""


class PortBusy(NodeError):
    """A port the node must listen on is taken by another process."""


class AuditFailed(NodeError):
    """The audit found an item that contradicts the chain's record."""


class AuditIncomplete(NodeError):
    """Nothing the audit checked contradicts the record, but some items could not be verified: not PASSED."""


class PullRefused(NodeError):
    """The checkpoint is not one to trust: the bytes offered are not the chain's, or its round fails a check.

    ``check`` names the check that failed (the subclasses set it); bytes already downloaded are discarded.
    """

    check = "content hash"


class RoundNotTrusted(PullRefused):
    """The checkpoint's round fails a chain check, so no file of it is written, whatever its bytes."""

    check = "round"


class RoundUnattested(RoundNotTrusted):
    """The round's record was not attested by ``quorum`` distinct members in force at its commit."""

    check = "attested by k members in force"


class RoundDisputed(RoundNotTrusted):
    """A staked member put its own, differing record of the round on chain (``RoundDisputed``)."""

    check = "undisputed"


class RoundPending(RoundNotTrusted):
    """The round is not final on chain yet (``isFinal``: its proof window, a dispute or a challenge is open;
    ``pull --pending`` takes it)."""

    check = "final"


class RoundBeyondMax(RoundNotTrusted):
    """The round is past the run's last round (``maxRounds``)."""

    check = "within maxRounds"


class RoundNotLinked(RoundNotTrusted):
    """The round's commit does not link into the run's hash chain."""

    check = "hash chain link"


class PullUnavailable(PullRefused):
    """The checkpoint (or the run's tokenizer) is found nowhere: no ``--archive`` directory holds it and no
    peer served it. Nothing is installed, as for any refusal."""

    check = "found"


class RunDocumentMissing(PullRefused):
    """No copy of the run document (by the chain's ``configHash``) was found: nothing can be checked against
    the run, so nothing is installed."""

    check = "run document"


class CheckpointInconsistent(PullRefused):
    """The file has the content hash the record names, but its metadata or weights root contradict the
    record."""

    check = "consistent with its commit"


class DataFetchError(NodeError):
    """A public dataset could not be fetched: unknown name, HTTP error, redirect loop, truncated or oversized
    body."""


class DataFetchUsage(DataFetchError, ConfigError):
    """``dlx-node data fetch`` was asked for what it cannot do: an unknown dataset, a URL that is not http(s)
    (a usage error, exit 2)."""


class NetworkUnreachable(NodeError):
    """Peers or a server the command needs could not be reached (no provider answered, a connection broke):
    a network failure, exit 10, whatever the command."""


class NoPeerReachable(NetworkUnreachable):
    """None of the run's peers a command dialled answered (they may still be starting): exit 10."""


class DataUnreachable(DataFetchError, NetworkUnreachable):
    """The dataset's server could not be reached, or the connection broke (offline, DNS, a reset): a network
    failure, exit 10 (``--from`` takes a copy made elsewhere, ``--url`` another mirror)."""


class NotYet(NodeError):
    """What was asked is not possible yet and will be later without any change (a stake still unbonding):
    run the command again then."""


class DataMismatch(DataFetchError):
    """The bytes fetched (or copied with ``--from``) are not the pinned ones; nothing was kept."""


class DiskFull(StateError):
    """A write the node cannot go on without met a full disk (ENOSPC, EDQUOT) and the node was stopped
    before space was freed: what was on disk is still loadable (every write is atomic), the rest is redone
    after a restart."""
