"""Which ``anvil`` binary a command that runs a local chain uses, inside a clone and outside it.

In a clone, ``npm ci --prefix contracts`` installs the pinned anvil under ``contracts/node_modules`` and
:func:`ledger.anvil.anvil_binary` finds it there. An installed package (``pip install dlx_node-*.whl``)
has no ``node_modules``: it then takes the ``anvil`` on ``PATH``, by setting ``DLX_ANVIL`` (which
``ledger.anvil`` reads) for this process and its children. ``DLX_ANVIL`` set by the user always wins.
"""

from __future__ import annotations

import os
import shutil

from node.errors import ConfigError

#: The anvil release contracts/package.json pins (the npm package @foundry-rs/anvil).
ANVIL_VERSION = "1.7.1"

HOW_TO_GET_ANVIL = (
    f"install it with `npm install -g @foundry-rs/anvil@{ANVIL_VERSION}` (Node.js 20; or "
    "Foundry's `foundryup`) so "
    "that `anvil` is on PATH, or set DLX_ANVIL=/path/to/anvil; in a clone of the repository, "
    "`npm ci --prefix contracts` installs it"
)


def locate_anvil(required: bool = False) -> str | None:
    """The anvil binary this process will run (setting ``DLX_ANVIL`` to one found on PATH), or None.

    ``required``: raise :class:`ConfigError` saying how to get anvil when there is none.
    """
    from ledger.anvil import DEFAULT_ANVIL

    override = os.environ.get("DLX_ANVIL")
    if override:
        if os.path.isfile(override):
            return override
        if required:
            raise ConfigError(f"DLX_ANVIL={override}: no such file; {HOW_TO_GET_ANVIL}")
        return None
    if DEFAULT_ANVIL.is_file():
        return str(DEFAULT_ANVIL)
    found = shutil.which("anvil")
    if found:
        os.environ["DLX_ANVIL"] = found
        return found
    if required:
        raise ConfigError(f"no anvil binary (the local chain): {HOW_TO_GET_ANVIL}")
    return None
