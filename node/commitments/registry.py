"""The commitment schemes by name: the one table from a run's ``diloco.commitments`` (and the ledger's
``RunParams.commitments`` number) to its :class:`node.commitments.base.CommitmentScheme`.

A new version is a module with its subclass and one line in :data:`BUILT_IN` (or, from a test or a plug-in,
one :func:`register` call): config validation, the ledger's version number and every lookup below follow.
"""

from __future__ import annotations

from node.commitments.base import CommitmentScheme
from node.commitments.chunked import ChunkedScheme
from node.commitments.hashed import HashedScheme
from node.commitments.normed import NormedScheme
from node.errors import ConfigError
from training.config_base import LISTING_SCHEMES

#: The schemes this node knows, oldest first.
BUILT_IN: tuple[type[CommitmentScheme], ...] = (HashedScheme, ChunkedScheme, NormedScheme)
#: The scheme of a run document that names no ``diloco.commitments`` (every run made before version 2): its
#: run documents leave the setting out, so their hashes stay what they were.
UNNAMED = HashedScheme.name

SCHEMES: dict[str, CommitmentScheme] = {}


def register(scheme_class: type[CommitmentScheme]) -> type[CommitmentScheme]:
    """Add ``scheme_class`` to the registry (usable as a class decorator); a name or version taken by another
    scheme is refused."""
    scheme = scheme_class()
    if not scheme.name or not 0 < scheme.version < 256:
        raise ConfigError(f"{scheme_class.__name__}: a scheme needs a name and a version in 1..255")
    for known in SCHEMES.values():
        if type(known) is not scheme_class and (known.name == scheme.name or known.version == scheme.version):
            raise ConfigError(f"{scheme_class.__name__} ({scheme.name!r}, version {scheme.version}) clashes "
                              f"with {known!r}")
    SCHEMES[scheme.name] = scheme
    if scheme.chunked:  # its rounds list their contributions: the aggregation caps them (issue 62)
        LISTING_SCHEMES.add(scheme.name)
    return scheme_class


def unregister(name: str) -> None:
    """Drop a scheme registered by :func:`register` (tests); the built-in ones stay."""
    if name not in {scheme_class.name for scheme_class in BUILT_IN}:
        SCHEMES.pop(name, None)
        LISTING_SCHEMES.discard(name)


def known_names() -> str:
    return ", ".join(SCHEMES)


def scheme_named(name: str) -> CommitmentScheme:
    """The scheme of a run's ``diloco.commitments`` (resolved: not "auto"); ConfigError naming the known
    ones."""
    scheme = SCHEMES.get(name) if isinstance(name, str) else None
    if scheme is None:
        raise ConfigError(f"diloco.commitments={name!r}: must be one of {known_names()} or \"auto\"")
    return scheme


def scheme_of(diloco) -> CommitmentScheme:
    """The scheme of a run's outer-loop configuration (:class:`training.config.DilocoConfig`)."""
    return scheme_named(diloco.commitments)


def scheme_of_version(version: int) -> CommitmentScheme:
    """The scheme the ledger's ``RunParams.commitments`` names; ConfigError for a number no scheme has."""
    for scheme in SCHEMES.values():
        if scheme.version == version:
            return scheme
    known = ", ".join(f"{scheme.version} ({scheme.name})" for scheme in SCHEMES.values())
    raise ConfigError(f"commitments version {version!r} is none this node knows: {known}")


def version_name(version: int) -> str:
    """The name of the scheme with ledger number ``version``, or "unknown" (for messages)."""
    return next((scheme.name for scheme in SCHEMES.values() if scheme.version == version), "unknown")


for _scheme_class in BUILT_IN:
    register(_scheme_class)
