"""A reward pool's unit (issue 77; ledger/poolunit.py): ETH, or an ERC-20 shown in whole tokens by its
decimals and named by its symbol, read from the token on py-evm and anvil; a token answering badly is shown in
raw units or by its address, never as ether."""

from __future__ import annotations

from ledger.account import dev_account
from ledger.poolunit import ETH, PoolUnit, pool_unit
from ledger.rewards import NATIVE
from ledger.tx import TransactionSender
from tests.ledger_fixtures import FAST_RETRY, deploy
from tests.reward_fixtures import Token

#: A contract answering every call with abi.encode("ETH") (init code 11 bytes, then the 51-byte runtime):
#: ``symbol()`` says ETH, ``decimals()`` reads the string's offset word, 32.
_SAYS_ETH = ("0x603380600b6000396000f3" "60206000526003602052"
             "7f" + "455448" + "00" * 29 + "604052" "60606000f3")


def test_whole_amounts_are_exact_and_cut():
    assert ETH.whole(10**16) == "0.010000000" and ETH.show(10**16, 2) == "0.01 ETH"
    assert ETH.whole(10**18 - 1) == "0.999999999"  # cut, not rounded up to 1
    assert ETH.whole(12_345 * 10**18 + 1, 18) == "12345.000000000000000001"  # past a float's precision
    assert ETH.whole(0, 0) == "0" and ETH.whole(-5 * 10**17, 1) == "-0.5"
    six = PoolUnit("0x" + "11" * 20, 6, "USDC")
    assert six.show(2_500_000) == "2.500000000 USDC" and six.unit == "token units"
    raw = PoolUnit("0x" + "11" * 20, 0, "units of token 0x11")
    assert raw.show(7) == "7.000000000 units of token 0x11" and raw.whole(7, 0) == "7"
    assert ETH.to_json() == {"unit": "wei", "token": None, "decimals": 18, "symbol": "ETH"}


def test_pool_unit_reads_the_token_and_distrusts_a_bad_one(chain_w3):
    """ETH for no token; a QuirkyToken by its symbol and decimals; a contract with neither (the ledger) and an
    address without code in raw units; a token that calls itself ETH by its address."""
    assert pool_unit(chain_w3, None) is ETH and pool_unit(chain_w3, NATIVE) is ETH
    token = Token(chain_w3)
    unit = pool_unit(chain_w3, token.address.lower())
    assert unit == PoolUnit(token.address, 18, "QRK")
    assert unit.to_json() == {"unit": "token units", "token": token.address, "decimals": 18, "symbol": "QRK"}
    ledger = deploy(chain_w3).ledger
    assert pool_unit(chain_w3, ledger) == PoolUnit(ledger, 0, f"units of token {ledger}")
    empty = "0x" + "ab" * 20
    assert pool_unit(chain_w3, empty).symbol == f"units of token {chain_w3.to_checksum_address(empty)}"
    sender = TransactionSender(chain_w3, dev_account(0, chain_w3.eth.chain_id), retry=FAST_RETRY)
    liar = sender.deploy({"abi": [], "bytecode": _SAYS_ETH, "contractName": "SaysEth"})
    assert chain_w3.eth.get_code(liar).hex().removeprefix("0x").startswith("6020600052")
    said = pool_unit(chain_w3, liar)
    assert (said.decimals, said.symbol) == (32, f"of token {liar}") and "ETH" not in said.show(1)
