"""Identity keys: peer ids match libp2p's, files are private and atomic, signatures verify without libp2p."""

import os
import stat

import pytest

from p2p.errors import IdentityError
from p2p.identity import Identity, peer_id_from_public_key, public_key_from_peer_id, verify_signature


def test_peer_id_matches_libp2p():
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.id import ID

    identity = Identity.from_seed(bytes(range(32)))
    libp2p_id = ID.from_pubkey(create_new_key_pair(identity.seed).public_key).to_base58()
    assert identity.peer_id == libp2p_id
    assert identity.peer_id.startswith("12D3KooW")
    assert public_key_from_peer_id(identity.peer_id) == identity.public_key_bytes


def test_load_or_create_persists_with_mode_0600(tmp_path):
    path = tmp_path / "sub" / "identity.key"
    first = Identity.load_or_create(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(path.read_bytes()) == 68  # libp2p protobuf private key
    second = Identity.load_or_create(path)
    assert second.peer_id == first.peer_id
    assert [p.name for p in path.parent.iterdir()] == ["identity.key"]  # no temp file left


def test_raw_seed_file_is_accepted(tmp_path):
    path = tmp_path / "seed.key"
    path.write_bytes(b"\x07" * 32)
    os.chmod(path, 0o600)
    assert Identity.load(path).peer_id == Identity.from_seed(b"\x07" * 32).peer_id


@pytest.mark.parametrize("content", [b"", b"garbage", b"\x08\x01\x12\x40" + b"\x01" * 64])
def test_corrupt_key_file_is_a_clear_error(tmp_path, content):
    path = tmp_path / "bad.key"
    path.write_bytes(content)
    with pytest.raises(IdentityError):
        Identity.load(path)


def test_sign_and_verify():
    identity = Identity.generate()
    signature = identity.sign(b"message")
    assert verify_signature(identity.public_key_bytes, b"message", signature)
    assert not verify_signature(identity.public_key_bytes, b"messagE", signature)
    assert not verify_signature(Identity.generate().public_key_bytes, b"message", signature)
    assert not verify_signature(identity.public_key_bytes, b"message", signature[:-1])
    assert not verify_signature(b"short", b"message", signature)


def test_peer_id_rejects_bad_key_lengths():
    with pytest.raises(IdentityError):
        peer_id_from_public_key(b"\x00" * 31)
    with pytest.raises(IdentityError):
        public_key_from_peer_id("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N")  # sha256 (RSA) peer id
