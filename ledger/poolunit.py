"""The unit a reward pool's amounts are in (issue 77; docs/REWARDS.md "A pool in an ERC-20").

An ETH pool's amounts are wei, shown in ETH; a token pool's are its ERC-20's smallest units, shown in whole
tokens by the token's ``decimals()`` and named by its ``symbol()``. ``dlx-node rewards``, the explorer and the
demo's summary all name and show a pool's amounts through :class:`PoolUnit`, so that a token pool is never
called wei. A token answering ``decimals()`` or ``symbol()`` badly (none, reverting, a symbol that is no short
printable word) is shown in its raw units, named by its address: what a token says of itself is not trusted.
"""

from __future__ import annotations

from dataclasses import dataclass

from eth_utils import to_checksum_address

ETH_DECIMALS = 18
#: Longest symbol shown as the token's name (ERC-20 symbols are short; a longer one is shown by address).
MAX_SYMBOL = 11
#: Most decimals a token may claim and be shown in whole tokens (uint8 allows 255; beyond this the units are
#: shown raw).
MAX_DECIMALS = 36

_NOT_A_TOKEN = {"ETH", "WEI", "GWEI"}
_SYMBOL_ABI = [{"type": "function", "name": "symbol", "stateMutability": "view", "inputs": [],
                "outputs": [{"name": "", "type": "string"}]}]
_SYMBOL32_ABI = [{"type": "function", "name": "symbol", "stateMutability": "view", "inputs": [],
                  "outputs": [{"name": "", "type": "bytes32"}]}]  # old tokens (MKR, SAI) answer bytes32
_DECIMALS_ABI = [{"type": "function", "name": "decimals", "stateMutability": "view", "inputs": [],
                  "outputs": [{"name": "", "type": "uint8"}]}]


@dataclass(frozen=True)
class PoolUnit:
    """How a pool's amounts are named: ``token`` None for ETH (wei; ``decimals`` 18, ``symbol`` "ETH"), else
    the ERC-20's address, its decimals and the symbol its amounts are shown in."""

    token: str | None = None
    decimals: int = ETH_DECIMALS
    symbol: str = "ETH"

    @property
    def unit(self) -> str:
        """The smallest unit the JSON amounts are in: ``"wei"`` or ``"token units"`` (as ``rewards --json``
        says)."""
        return "wei" if self.token is None else "token units"

    def whole(self, units: int, places: int = 9) -> str:
        """``units`` in whole ETH or tokens, exactly (no float), ``places`` decimals, cut (never rounded
        up)."""
        sign, units = ("-", -units) if units < 0 else ("", units)
        whole, rest = divmod(units, 10**self.decimals)
        fraction = str(rest).rjust(self.decimals, "0")[:places].ljust(places, "0")
        return f"{sign}{whole}" + (f".{fraction}" if places else "")

    def show(self, units: int, places: int = 9) -> str:
        """``units`` with the unit's name: ``0.010000000 ETH``, ``2.500000000 QRK``."""
        return f"{self.whole(units, places)} {self.symbol}"

    def to_json(self) -> dict:
        """``unit`` (the JSON amounts' unit), ``token`` (None: ETH), ``decimals`` and ``symbol`` (how the
        amounts are shown whole)."""
        return {"unit": self.unit, "token": self.token, "decimals": self.decimals, "symbol": self.symbol}


ETH = PoolUnit()


def pool_unit(w3, token: str | None) -> PoolUnit:
    """The unit of a pool paying in ``token`` (None or the zero address: ETH) on ``w3``, read from the token;
    a token that does not answer ``decimals()`` (or claims more than :data:`MAX_DECIMALS`) is shown in raw
    units, one without a printable short ``symbol()`` by its address."""
    if token is None or int(token, 16) == 0:
        return ETH
    address = to_checksum_address(token)
    decimals = _decimals(w3, address)
    if decimals is None:
        return PoolUnit(address, 0, f"units of token {address}")
    return PoolUnit(address, decimals, _symbol(w3, address) or f"of token {address}")


def _decimals(w3, address: str) -> int | None:
    try:
        decimals = w3.eth.contract(address=address, abi=_DECIMALS_ABI).functions.decimals().call()
    except Exception:  # noqa: BLE001 - any failure (no code, a revert, a bad answer): not known
        return None
    return decimals if isinstance(decimals, int) and 0 <= decimals <= MAX_DECIMALS else None


def _symbol(w3, address: str) -> str | None:
    """The token's symbol if it is a short word of printable ASCII (no spaces) other than ETH's names, else
    None."""
    for abi in (_SYMBOL_ABI, _SYMBOL32_ABI):
        try:
            answer = w3.eth.contract(address=address, abi=abi).functions.symbol().call()
        except Exception:  # noqa: BLE001 - try the other encoding, else no symbol
            continue
        if isinstance(answer, bytes):
            answer = answer.rstrip(b"\0").decode("ascii", "replace")
        printable = isinstance(answer, str) and 0 < len(answer) <= MAX_SYMBOL and all(
            33 <= ord(c) < 127 for c in answer)
        # a token calling itself ETH would pass its units off as ether: it is named by its address
        return answer if printable and answer.upper() not in _NOT_A_TOKEN else None
    return None
