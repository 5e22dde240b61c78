"""The node's long-lived ed25519 identity.

One key serves two purposes: it is the libp2p host key (so the peer id is the
node's identity on the network) and it signs application messages
(:mod:`p2p.envelope`). Signing and verification use ``cryptography`` only, so the
ledger and external auditors can check the same signatures without libp2p.

The key file holds the libp2p protobuf encoding of the private key (the format
go-libp2p and js-libp2p write: ``KeyType=Ed25519``, 64 bytes seed||public key);
a bare 32-byte seed is accepted on load as well.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from p2p.errors import IdentityError

logger = logging.getLogger(__name__)

# libp2p crypto.proto: message PrivateKey/PublicKey { required KeyType Type = 1; required bytes Data = 2; }
# with KeyType Ed25519 = 1. Hand-encoded because the layout is fixed for ed25519.
_PB_PRIVATE_PREFIX = b"\x08\x01\x12\x40"  # Type=Ed25519, Data=64 bytes
_PB_PUBLIC_PREFIX = b"\x08\x01\x12\x20"  # Type=Ed25519, Data=32 bytes
_B58_ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def _b58encode(data: bytes) -> str:
    number = int.from_bytes(data, "big")
    out = []
    while number:
        number, rem = divmod(number, 58)
        out.append(_B58_ALPHABET[rem])
    leading_zeros = len(data) - len(data.lstrip(b"\0"))
    return "1" * leading_zeros + "".join(reversed(out))


def _b58decode(text: str) -> bytes:
    number = 0
    for char in text:
        index = _B58_ALPHABET.find(char)
        if index < 0:
            raise ValueError(f"invalid base58 character {char!r}")
        number = number * 58 + index
    leading_ones = len(text) - len(text.lstrip("1"))
    body = number.to_bytes((number.bit_length() + 7) // 8, "big") if number else b""
    return b"\0" * leading_ones + body


def peer_id_from_public_key(public_key_bytes: bytes) -> str:
    """The standard libp2p peer id (``12D3KooW...``) of a raw 32-byte ed25519 public key.

    The peer id is the base58btc identity multihash (code 0x00, length 36) of the
    protobuf-encoded public key, as in the libp2p peer-id spec.
    """
    if len(public_key_bytes) != 32:
        raise IdentityError(f"ed25519 public key must be 32 bytes, got {len(public_key_bytes)}")
    encoded = _PB_PUBLIC_PREFIX + bytes(public_key_bytes)
    return _b58encode(b"\x00" + bytes([len(encoded)]) + encoded)


def public_key_from_peer_id(peer_id: str) -> bytes:
    """Inverse of :func:`peer_id_from_public_key` for ed25519 peer ids; raises IdentityError otherwise."""
    try:
        raw = _b58decode(peer_id)
    except ValueError as exc:
        raise IdentityError(f"peer id {peer_id!r} is not base58: {exc}") from None
    if len(raw) != 38 or raw[:2] != b"\x00\x24" or raw[2:6] != _PB_PUBLIC_PREFIX:
        raise IdentityError(f"peer id {peer_id!r} is not an ed25519 identity-multihash peer id")
    return raw[6:]


def verify_signature(public_key_bytes: bytes, msg: bytes, sig: bytes) -> bool:
    """True iff ``sig`` is a valid ed25519 signature of ``msg`` by ``public_key_bytes``; never raises."""
    if len(public_key_bytes) != 32 or len(sig) != 64:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(bytes(public_key_bytes)).verify(bytes(sig), bytes(msg))
    except (InvalidSignature, ValueError):
        return False
    return True


def sha256_hex(data: bytes) -> str:
    """Hex sha256 of ``data`` (content address of blobs, hash of envelopes)."""
    return hashlib.sha256(data).hexdigest()


class Identity:
    """An ed25519 key pair: the libp2p host key and the signer of envelopes."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._private_key = private_key
        self.public_key_bytes: bytes = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.peer_id: str = peer_id_from_public_key(self.public_key_bytes)

    @classmethod
    def generate(cls) -> Identity:
        """A fresh random identity (not persisted)."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        """The identity of a 32-byte ed25519 seed (deterministic; for tests and tools)."""
        if len(seed) != 32:
            raise IdentityError(f"ed25519 seed must be 32 bytes, got {len(seed)}")
        return cls(Ed25519PrivateKey.from_private_bytes(bytes(seed)))

    @classmethod
    def load_or_create(cls, path: str | os.PathLike[str]) -> Identity:
        """Load the key at ``path``, or create one there (mode 0600, written atomically)."""
        path = Path(path)
        if path.exists():
            return cls.load(path)
        identity = cls.generate()
        identity.save(path)
        logger.info("created identity %s at %s", identity.peer_id, path)
        return identity

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Identity:
        """Load a key file (libp2p protobuf private key, or a raw 32-byte seed)."""
        path = Path(path)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise IdentityError(f"cannot read identity key {path}: {exc}") from None
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            logger.warning("identity key %s has mode %o; it should be 0600", path, mode)
        if len(data) == 32:
            return cls.from_seed(data)
        if len(data) == 68 and data[:4] == _PB_PRIVATE_PREFIX:
            identity = cls.from_seed(data[4:36])
            if identity.public_key_bytes != data[36:68]:
                raise IdentityError(f"identity key {path}: stored public key does not match the seed")
            return identity
        raise IdentityError(
            f"identity key {path}: expected a libp2p ed25519 protobuf private key (68 bytes) "
            f"or a 32-byte seed, got {len(data)} bytes; delete it to create a new identity"
        )

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the key (libp2p protobuf format) atomically with mode 0600."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _PB_PRIVATE_PREFIX + self.seed + self.public_key_bytes
        fd, tmp_name = tempfile.mkstemp(prefix=".identity-", dir=path.parent)
        try:
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp_name, path)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise

    @property
    def seed(self) -> bytes:
        """The raw 32-byte private seed (keep secret)."""
        return self._private_key.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )

    def sign(self, msg: bytes) -> bytes:
        """Ed25519 signature (64 bytes) of ``msg``."""
        return self._private_key.sign(bytes(msg))

    def __repr__(self) -> str:
        return f"Identity({self.peer_id})"
