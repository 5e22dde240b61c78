"""EIP-712 signatures over round records and verdicts, exactly as TrainingLedger checks them.

Members sign a :class:`RoundRecord` with their Ethereum key; ``quorum`` distinct members' signatures commit
the round (``LedgerClient.commit_round``). Two signatures of one member over different records of the same run
and round are equivocation (``LedgerClient.report_equivocation``). The same scheme signs accusation verdicts.

Domain and types (EIP-712, https://eips.ethereum.org/EIPS/eip-712)::

    EIP712Domain(string name,string version,uint256 chainId,address verifyingContract)
        name = "dlx-node TrainingLedger", version = "1", verifyingContract = the TrainingLedger
    Record(uint256 runId,uint64 round,bytes32 prevHead,bytes32 weightsRoot,bytes32 contributionsRoot,
           uint64 trainLossMicro,uint64 evalLossMicro,uint64 tokens,uint32 numContributors,
           bytes32 checkpointHash)
    Verdict(uint256 runId,address accused,bytes32 evidenceHash,bool guilty)

    digest = keccak256(0x19 0x01 || domainSeparator || hashStruct(message))

A signature is 65 bytes ``r || s || v`` with ``v`` in {27, 28} and ``s`` at most secp256k1n/2 (the contract
refuses the malleable high-``s`` twin, as OpenZeppelin's ECDSA does).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from eth_abi import encode
from eth_keys import keys
from eth_keys.exceptions import BadSignature, ValidationError
from eth_utils import keccak, to_checksum_address

from ledger.errors import LedgerInputError
from ledger.records import RoundRecord, RoundVerdict, Verdict, check_bytes32, check_uint

__all__ = [
    "DOMAIN_NAME",
    "DOMAIN_VERSION",
    "RECORD_TYPE",
    "ROUND_VERDICT_TYPE",
    "RoundVerdict",
    "round_verdict_digest",
    "sign_round_verdict",
    "VERDICT_TYPE",
    "RoundRecord",
    "Verdict",
    "domain_separator",
    "order_signatures",
    "pack_signatures",
    "record_digest",
    "record_struct_hash",
    "recover_signer",
    "sign_digest",
    "recover_verdict_signer",
    "sign_record",
    "sign_verdict",
    "typed_data",
    "verdict_digest",
    "verdict_struct_hash",
]

DOMAIN_NAME = "dlx-node TrainingLedger"
DOMAIN_VERSION = "1"
DOMAIN_TYPE = "EIP712Domain(string name,string version,uint256 chainId,address verifyingContract)"
RECORD_TYPE = (
    "Record(uint256 runId,uint64 round,bytes32 prevHead,bytes32 weightsRoot,bytes32 contributionsRoot,"
    "uint64 trainLossMicro,uint64 evalLossMicro,uint64 tokens,uint32 numContributors,bytes32 checkpointHash)"
)
VERDICT_TYPE = "Verdict(uint256 runId,address accused,bytes32 evidenceHash,bool guilty)"
ROUND_VERDICT_TYPE = "RoundVerdict(uint256 runId,uint64 round,bytes32 recordHash,bool upheld)"
SIGNATURE_LENGTH = 65

_RECORD_FIELDS = [
    ("runId", "uint256"),
    ("round", "uint64"),
    ("prevHead", "bytes32"),
    ("weightsRoot", "bytes32"),
    ("contributionsRoot", "bytes32"),
    ("trainLossMicro", "uint64"),
    ("evalLossMicro", "uint64"),
    ("tokens", "uint64"),
    ("numContributors", "uint32"),
    ("checkpointHash", "bytes32"),
]
_VERDICT_FIELDS = [("runId", "uint256"), ("accused", "address"), ("evidenceHash", "bytes32"),
                   ("guilty", "bool")]
_ROUND_VERDICT_FIELDS = [("runId", "uint256"), ("round", "uint64"), ("recordHash", "bytes32"),
                         ("upheld", "bool")]
_SECP256K1_N = 0xFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFEBAAEDCE6AF48A03BBFD25E8CD0364141


def domain_separator(chain_id: int, ledger_address: str) -> bytes:
    """The EIP-712 domain separator of the TrainingLedger at ``ledger_address`` on chain ``chain_id``."""
    check_uint("chain_id", chain_id, 2**256 - 1)
    return keccak(
        encode(
            ["bytes32", "bytes32", "bytes32", "uint256", "address"],
            [
                keccak(text=DOMAIN_TYPE),
                keccak(text=DOMAIN_NAME),
                keccak(text=DOMAIN_VERSION),
                chain_id,
                to_checksum_address(ledger_address),
            ],
        )
    )


def record_struct_hash(record: RoundRecord) -> bytes:
    """hashStruct(record): what the contract stores per round (``recordHashOf``) and chains into the head."""
    return keccak(
        encode(["bytes32", *(kind for _, kind in _RECORD_FIELDS)],
               [keccak(text=RECORD_TYPE), *record.fields()])
    )


def verdict_struct_hash(verdict: Verdict) -> bytes:
    """hashStruct(verdict)."""
    return keccak(
        encode(
            ["bytes32", *(kind for _, kind in _VERDICT_FIELDS)],
            [keccak(text=VERDICT_TYPE), *verdict.fields()]
        )
    )


def round_verdict_digest(verdict: RoundVerdict, chain_id: int, ledger_address: str) -> bytes:
    """The 32-byte EIP-712 digest a counted member signs to settle a round's disputes."""
    struct_hash = keccak(
        encode(
            ["bytes32", *(kind for _, kind in _ROUND_VERDICT_FIELDS)],
            [keccak(text=ROUND_VERDICT_TYPE), *verdict.fields()],
        )
    )
    return _typed_digest(chain_id, ledger_address, struct_hash)


def sign_round_verdict(account: Any, verdict: RoundVerdict, chain_id: int, ledger_address: str) -> bytes:
    """``account``'s 65-byte signature over ``verdict``'s EIP-712 digest."""
    if not isinstance(verdict, RoundVerdict):
        raise LedgerInputError(f"sign_round_verdict needs a RoundVerdict, got {type(verdict).__name__}")
    return sign_digest(account, round_verdict_digest(verdict, chain_id, ledger_address))


def _typed_digest(chain_id: int, ledger_address: str, struct_hash: bytes) -> bytes:
    return keccak(b"\x19\x01" + domain_separator(chain_id, ledger_address) + struct_hash)


def record_digest(record: RoundRecord, chain_id: int, ledger_address: str) -> bytes:
    """The 32-byte EIP-712 digest a member signs for ``record`` (``TrainingLedger.recordDigest``)."""
    return _typed_digest(chain_id, ledger_address, record_struct_hash(record))


def verdict_digest(verdict: Verdict, chain_id: int, ledger_address: str) -> bytes:
    """The 32-byte EIP-712 digest a member signs for ``verdict``."""
    return _typed_digest(chain_id, ledger_address, verdict_struct_hash(verdict))


def typed_data(message: RoundRecord | Verdict, chain_id: int, ledger_address: str) -> dict:
    """The EIP-712 typed data of ``message`` as JSON-RPC ``eth_signTypedData_v4`` and wallets take it."""
    if isinstance(message, RoundRecord):
        name, fields = "Record", _RECORD_FIELDS
    elif isinstance(message, Verdict):
        name, fields = "Verdict", _VERDICT_FIELDS
    else:
        raise LedgerInputError(f"typed_data needs a RoundRecord or a Verdict, got {type(message).__name__}")
    return typed_message(name, fields, message.fields(), chain_id, ledger_address)


def typed_message(name: str, fields, field_values, chain_id: int, ledger_address: str) -> dict:
    """The ``eth_signTypedData_v4`` typed data of a message of type ``name`` (``fields``: ``(key, type)``
    pairs in order, ``field_values`` their values) under the ledger's domain."""
    values = {
        key: "0x" + value.hex() if isinstance(value, bytes) else value
        for (key, _), value in zip(fields, field_values, strict=True)
    }
    return {
        "types": {
            "EIP712Domain": [
                {"name": "name", "type": "string"},
                {"name": "version", "type": "string"},
                {"name": "chainId", "type": "uint256"},
                {"name": "verifyingContract", "type": "address"},
            ],
            name: [{"name": key, "type": kind} for key, kind in fields],
        },
        "primaryType": name,
        "domain": {
            "name": DOMAIN_NAME,
            "version": DOMAIN_VERSION,
            "chainId": chain_id,
            "verifyingContract": to_checksum_address(ledger_address),
        },
        "message": values,
    }


def sign_digest(account: Any, digest: bytes) -> bytes:
    """``account``'s 65-byte signature (r || s || v, low s: the form the contracts accept) over ``digest``."""
    signed = account.unsafe_sign_hash(digest)
    r, s, v = signed.r, signed.s, signed.v
    if s > _SECP256K1_N // 2:  # normalise to the low-s form the contract accepts
        s, v = _SECP256K1_N - s, 55 - v
    return r.to_bytes(32, "big") + s.to_bytes(32, "big") + bytes([v])


def sign_record(account: Any, record: RoundRecord, chain_id: int, ledger_address: str) -> bytes:
    """``account``'s 65-byte signature (r || s || v, low s) over ``record``'s EIP-712 digest.

    Args:
        account: A local signer (``eth_account`` LocalAccount, e.g. :func:`ledger.account.load_keystore`).
    """
    if not isinstance(record, RoundRecord):
        raise LedgerInputError(f"sign_record needs a RoundRecord, got {type(record).__name__}")
    return sign_digest(account, record_digest(record, chain_id, ledger_address))


def sign_verdict(account: Any, verdict: Verdict, chain_id: int, ledger_address: str) -> bytes:
    """``account``'s 65-byte signature over ``verdict``'s EIP-712 digest."""
    if not isinstance(verdict, Verdict):
        raise LedgerInputError(f"sign_verdict needs a Verdict, got {type(verdict).__name__}")
    return sign_digest(account, verdict_digest(verdict, chain_id, ledger_address))


def recover_digest_signer(digest: bytes, signature: bytes) -> str:
    """The checksummed address that made the 65-byte ``signature`` over ``digest``.

    Raises:
        LedgerInputError: The signature is malformed, malleable (high s), has a bad v or recovers nothing,
            exactly the signatures the contract refuses with LedgerInvalidSignature.
    """
    digest = check_bytes32("digest", digest)
    if not isinstance(signature, (bytes, bytearray)) or len(signature) != SIGNATURE_LENGTH:
        raise LedgerInputError(f"signature: must be {SIGNATURE_LENGTH} bytes (r || s || v)")
    r = int.from_bytes(signature[:32], "big")
    s = int.from_bytes(signature[32:64], "big")
    v = signature[64]
    if v not in (27, 28):
        raise LedgerInputError(f"signature: v={v} must be 27 or 28")
    if s > _SECP256K1_N // 2:
        raise LedgerInputError("signature: s is in the upper half of the curve order (malleable)")
    try:
        public_key = keys.Signature(vrs=(v - 27, r, s)).recover_public_key_from_msg_hash(digest)
    except (BadSignature, ValidationError) as exc:
        raise LedgerInputError(f"signature: recovers no key ({exc})") from exc
    return public_key.to_checksum_address()


def recover_signer(record: RoundRecord, signature: bytes, chain_id: int, ledger_address: str) -> str:
    """The address whose key signed ``record`` with ``signature`` (see :func:`recover_digest_signer`)."""
    return recover_digest_signer(record_digest(record, chain_id, ledger_address), signature)


def recover_verdict_signer(verdict: Verdict, signature: bytes, chain_id: int, ledger_address: str) -> str:
    """The address whose key signed ``verdict`` with ``signature``."""
    return recover_digest_signer(verdict_digest(verdict, chain_id, ledger_address), signature)


def order_signatures(digest: bytes, signatures: Iterable[bytes]) -> list[bytes]:
    """``signatures`` sorted by signer address, ascending, as the contract requires.

    Signatures that recover nothing are kept, last, for the contract to refuse with a named error; duplicates
    are kept too (the contract refuses them: LedgerSignersNotAscending). The caller decides what to drop.
    """
    keyed = []
    for index, signature in enumerate(signatures):
        try:
            key = int(recover_digest_signer(digest, signature), 16)
        except LedgerInputError:
            key = 2**160 + index
        keyed.append((key, index, bytes(signature)))
    return [signature for _, _, signature in sorted(keyed)]


def pack_signatures(signatures: Iterable[bytes]) -> bytes:
    """The contract's ``signatures`` argument: the 65-byte signatures concatenated, in the order given."""
    packed = b""
    for signature in signatures:
        if not isinstance(signature, (bytes, bytearray)) or len(signature) != SIGNATURE_LENGTH:
            raise LedgerInputError(f"signature: must be {SIGNATURE_LENGTH} bytes (r || s || v)")
        packed += bytes(signature)
    return packed
