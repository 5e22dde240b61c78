"""NodeRegistry rules through LedgerClient, on py-evm and a real anvil."""

from __future__ import annotations

import pytest
from ledger_fixtures import deploy, node_key, raw_public_key

from ledger import errors
from ledger.binding import BINDING_DOMAIN, binding_message, verify_binding


def test_binding_message_layout():
    message = binding_message(31337, "0x" + "11" * 20, "0x" + "22" * 20)
    assert len(message) == 28 + 32 + 20 + 20
    assert message.startswith(BINDING_DOMAIN)
    assert message[28:60] == (31337).to_bytes(32, "big")
    assert message[60:80] == bytes([0x11]) * 20
    assert message[80:] == bytes([0x22]) * 20


def test_register_binds_account_and_key(deployment):
    client = deployment.register(1)
    pubkey = raw_public_key(node_key(2))
    assert client.is_registered()
    assert client.key_of(client.address) == pubkey
    assert client.account_of(pubkey) == client.address
    assert client.node_count() == 1
    assert not deployment.client(2).is_registered()
    assert deployment.client(2).key_of(deployment.client(2).address) is None

    [registration] = client.registrations()
    assert registration.account == client.address and registration.pubkey == pubkey and registration.active
    assert verify_binding(registration, client.chain_id, client.registry_address)
    # The same signature does not bind another account or another deployment.
    moved = registration.__class__(**{**registration.__dict__, "account": deployment.client(2).address})
    assert not verify_binding(moved, client.chain_id, client.registry_address)
    assert not verify_binding(registration, client.chain_id + 1, client.registry_address)


def test_register_is_idempotent_for_the_same_key(deployment):
    client = deployment.client(1)
    key = node_key(7)
    first = client.register(raw_public_key(key), key.sign(client.my_binding_message()))
    block = deployment.w3.eth.block_number
    again = client.register(raw_public_key(key), key.sign(client.my_binding_message()))
    assert again == first
    assert deployment.w3.eth.block_number == block  # nothing was sent


def test_one_key_per_account_and_one_account_per_key(deployment):
    first = deployment.register(1, seed=10)
    with pytest.raises(errors.RegistryAlreadyRegistered) as raised:
        deployment.register(1, seed=11)
    assert raised.value.values["account"].lower() == first.address.lower()
    assert raised.value.values["pubkey"] == raw_public_key(node_key(10))

    with pytest.raises(errors.RegistryKeyTaken) as raised:
        deployment.register(2, seed=10)
    assert raised.value.values["holder"].lower() == first.address.lower()
    assert not deployment.client(2).is_registered()


def test_malformed_registrations_are_refused(deployment):
    client = deployment.client(1)
    with pytest.raises(errors.RegistryZeroKey):
        client.register(bytes(32), bytes(64))
    with pytest.raises(errors.RegistryBadSignatureLength) as raised:
        client.register(raw_public_key(node_key(3)), bytes(63))
    assert raised.value.values == {"length": 63}
    with pytest.raises(errors.LedgerInputError):
        client.register(bytes(31), bytes(64))
    assert not client.is_registered()


def test_unregister_frees_the_key_and_is_recorded(deployment):
    client = deployment.register(1, seed=20)
    client.unregister()
    assert not client.is_registered()
    assert client.node_count() == 0
    with pytest.raises(errors.RegistryNotRegistered):
        client.unregister()
    deployment.register(2, seed=20)  # the key is free again
    registrations = client.registrations()
    assert [(r.account, r.active) for r in registrations] == [
        (client.address, False),
        (deployment.client(2).address, True),
    ]
    assert registrations[0].unregistered_block > registrations[0].block_number


def test_minimum_stake_is_enforced_and_returned(chain_w3):
    stake = 10**18
    staked = deploy(chain_w3, min_stake=stake)
    client = staked.client(1)
    key = node_key(30)
    with pytest.raises(errors.RegistryStakeTooLow) as raised:
        client.register(raw_public_key(key), key.sign(client.my_binding_message()), stake=stake - 1)
    assert raised.value.values == {"required": stake, "sent": stake - 1}

    client.register(raw_public_key(key), key.sign(client.my_binding_message()))  # None: sends min stake
    assert client.min_stake() == stake
    assert chain_w3.eth.get_balance(staked.registry) == stake
    [registration] = client.registrations()
    assert registration.stake == stake
    client.unregister()
    assert chain_w3.eth.get_balance(staked.registry) == 0
