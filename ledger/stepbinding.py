"""What binds a run claim (StepProver.claimRun, issue 78) to the ledger's record: the contribution it is about
and the state its steps start from (contracts/src/StepProverBinding.sol; docs/FRAUD_PROOF.md, "The
contribution proof").

A run claim names the contribution's payload root (a leaf of its round's committed factors, which a normed
run's contributor signed) and the stage's weights root the round starts from (round ``t - 1``'s committed
stage leaf, or the run's genesis for round 0); :func:`bind_run` builds those fields and the openings the
contract checks them with, from what a node keeps of the two rounds (records, stage leaves, factors).

It also names the replica's data key (``dataKey``: the account whose windows the contribution's batches are,
docs/FRAUD_PROOF.md "The replica's key"): a stage-0 contribution's own listed member; a later stage's is the
member the same round's stage-0 factors list for its replica, which the later stage's member signs as its
key (:class:`DataKeyClaim`, the EIP-712 message ``DataKey``, domain: the ledger), which counter-signs that
member as its partner at the stage in the round (:class:`PartnerClaim`, ``ReplicaPartner``), and which the
claim carries with the stage-0 opening and both signatures (:class:`ReplicaKey`, :func:`replica_binding`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eth_abi import encode
from eth_utils import keccak, to_checksum_address

from ledger.attest import domain_separator, recover_digest_signer, sign_digest, typed_message
from ledger.chunkproof import genesis_record, tree_path
from ledger.contribution_binding import compact
from ledger.errors import LedgerInputError
from ledger.records import check_bytes32, check_uint

#: What a later stage's contributor signs of its replica's data key (StepProverBinding ``DATA_KEY_TYPEHASH``).
DATA_KEY_TYPE = "DataKey(uint256 runId,uint64 round,uint32 stage,bytes32 payloadRoot,address dataKey)"
_DATA_KEY_FIELDS = (("runId", "uint256"), ("round", "uint64"), ("stage", "uint32"),
                    ("payloadRoot", "bytes32"), ("dataKey", "address"))
ZERO_KEY = "0x" + "00" * 20
#: What the replica's stage-0 member (the key) counter-signs (StepProverBinding ``PARTNER_TYPEHASH``).
PARTNER_TYPE = "ReplicaPartner(uint256 runId,uint64 round,uint32 stage,address member)"
_PARTNER_FIELDS = (("runId", "uint256"), ("round", "uint64"), ("stage", "uint32"), ("member", "address"))


def _checked_address(name: str, value: str) -> str:
    try:
        return to_checksum_address(value)
    except (TypeError, ValueError) as exc:
        raise LedgerInputError(f"{name}: {value!r} is not an address") from exc


def _digest(type_: str, fields, values: tuple, chain_id: int, ledger_address: str) -> bytes:
    types = ("bytes32", *(kind for _, kind in fields))
    struct_hash = keccak(encode(types, [keccak(text=type_), *values]))
    return keccak(b"\x19\x01" + domain_separator(chain_id, ledger_address) + struct_hash)


@dataclass(frozen=True)
class DataKeyClaim:
    """A stage-``stage`` contribution's statement that its batches are drawn with ``data_key`` (its replica's
    stage-0 member's account), signed by the contribution's member (module docstring)."""

    run_id: int
    round: int
    stage: int
    payload_root: bytes
    data_key: str

    def __post_init__(self) -> None:
        check_uint("run_id", self.run_id, 2**256 - 1)
        check_uint("round", self.round, 2**64 - 1)
        check_uint("stage", self.stage, 2**32 - 1)
        object.__setattr__(self, "payload_root", check_bytes32("payload_root", self.payload_root))
        object.__setattr__(self, "data_key", _checked_address("data_key", self.data_key))

    def fields(self) -> tuple:
        return (self.run_id, self.round, self.stage, self.payload_root, self.data_key)

    def digest(self, chain_id: int, ledger_address: str) -> bytes:
        """The 32-byte EIP-712 digest the contribution's member signs."""
        return _digest(DATA_KEY_TYPE, _DATA_KEY_FIELDS, self.fields(), chain_id, ledger_address)

    def typed_data(self, chain_id: int, ledger_address: str) -> dict:
        """The message as ``eth_signTypedData_v4`` typed data (what a wallet signs)."""
        return typed_message("DataKey", _DATA_KEY_FIELDS, self.fields(), chain_id, ledger_address)


@dataclass(frozen=True)
class PartnerClaim:
    """A replica's stage-0 member's statement that ``member`` runs stage ``stage`` of its replica in round
    ``round`` (so draws its batches with the stage-0 member's key), signed by the stage-0 member (the key)."""

    run_id: int
    round: int
    stage: int
    member: str

    def __post_init__(self) -> None:
        check_uint("run_id", self.run_id, 2**256 - 1)
        check_uint("round", self.round, 2**64 - 1)
        check_uint("stage", self.stage, 2**32 - 1)
        object.__setattr__(self, "member", _checked_address("member", self.member))

    def fields(self) -> tuple:
        return (self.run_id, self.round, self.stage, self.member)

    def digest(self, chain_id: int, ledger_address: str) -> bytes:
        """The 32-byte EIP-712 digest the replica's stage-0 member signs."""
        return _digest(PARTNER_TYPE, _PARTNER_FIELDS, self.fields(), chain_id, ledger_address)

    def typed_data(self, chain_id: int, ledger_address: str) -> dict:
        return typed_message("ReplicaPartner", _PARTNER_FIELDS, self.fields(), chain_id, ledger_address)


def sign_data_key(account: Any, claim: DataKeyClaim | PartnerClaim, chain_id: int,
                  ledger_address: str) -> bytes:
    """``account``'s 65-byte signature (low s) of ``claim`` (an eth_account LocalAccount: for a
    :class:`DataKeyClaim` the member account that signed the contribution, for a :class:`PartnerClaim` the
    replica's stage-0 member, the key)."""
    return sign_digest(account, claim.digest(chain_id, ledger_address))


def recover_data_key_signer(claim: DataKeyClaim | PartnerClaim, signature: bytes, chain_id: int,
                            ledger_address: str) -> str:
    """The checksummed address that signed ``claim``; LedgerInputError for a malformed or malleable one."""
    return recover_digest_signer(claim.digest(chain_id, ledger_address), signature)


@dataclass(frozen=True)
class ReplicaKey:
    """What binds a later stage's contribution to its replica's key: the same round's stage-0 factors
    (``ledger.chunkproof.Factors``, anything with ``encode()``, or their encoded bytes), the index of the
    replica's stage-0 contribution in them, the later stage's member's 65-byte signature of
    :class:`DataKeyClaim` and the key's (the replica's stage-0 member's) of :class:`PartnerClaim` naming
    that member."""

    factors: Any
    index: int
    signature: bytes
    partner: bytes


@dataclass(frozen=True)
class RunSubject:
    """A run claim's subject (``fields()``: the claim's five fields after its step count) and the contract's
    ``RunBinding``; ``data_key``: the account the contribution's batches are drawn with (the member the
    round's version-3 factors list for it; the zero address where they list none), the claim's ``dataKey``."""

    run_id: int
    round: int
    stage: int
    payload_root: bytes
    start_weights: bytes
    binding: tuple
    data_key: str = ZERO_KEY

    def fields(self) -> tuple:
        return (self.run_id, self.round, self.stage, self.payload_root, self.start_weights)


def bind_run(record, stage_leaves: list, factors, index: int, prev_record, prev_stage_leaves: list,
             stage: int = 0, replica: ReplicaKey | None = None) -> RunSubject:
    """The subject of a claim about contribution ``index`` of ``factors`` (the round's committed
    ``ledger.chunkproof.Factors`` of ``stage``) in ``record``'s round.

    ``stage_leaves``: every ``StageLeaf`` of ``record`` (their tree is its weightsRoot); ``prev_record`` and
    ``prev_stage_leaves`` the same of round ``t - 1`` (round 0: ``prev_record`` None and the run's genesis
    stage leaves); ``replica``: a later stage's binding to its replica's key (None: none, so the claim names
    the stage's own member, which the contract refuses for a later stage of a version-3 round).

    Raises:
        LedgerInputError: ``index`` is not one of the factors' contributions, ``stage`` not a stage leaf,
            or ``replica``'s index not one of the stage-0 factors' members.
    """
    roots = list(factors.payload_roots)
    if not 0 <= index < len(roots):
        raise LedgerInputError(f"contribution {index} not in the round's {len(roots)} listed contributions")
    if not 0 <= stage < min(len(stage_leaves), len(prev_stage_leaves)):
        raise LedgerInputError(f"stage {stage} not among the records' {len(stage_leaves)} stage leaves")
    leaves = [leaf.encode() for leaf in stage_leaves]
    prev_leaves = [leaf.encode() for leaf in prev_stage_leaves]
    prev_fields = genesis_record(record.run_id) if prev_record is None else prev_record.fields()
    key = listed_contributor(factors.encode(), index)
    tail = b""
    if replica is not None and stage > 0:
        zero = replica.factors if isinstance(replica.factors, bytes) else replica.factors.encode()
        key = listed_contributor(zero, replica.index)
        if key == ZERO_KEY:
            raise LedgerInputError(f"stage-0 contribution {replica.index}: its factors list no member for it")
        tail = replica_binding(leaves, zero, replica.index, replica.signature, replica.partner)
    binding = (record.fields(), leaves[stage], tree_path(leaves, stage), factors.encode(), index, prev_fields,
               prev_leaves[stage], tree_path(prev_leaves, stage), tail)
    return RunSubject(record.run_id, record.round, stage, bytes(roots[index]),
                      bytes(prev_stage_leaves[stage].weights_root), binding, key)


def listed_contributor(factors: bytes, index: int) -> str:
    """The member account encoded ``factors`` list for contribution ``index`` (a version-3 round's, which
    StepProverBinding checks a run claim's ``dataKey`` against); the zero address where they list none."""
    from ledger.chunkproof import Factors

    try:
        norms = Factors.decode(factors).norms
    except LedgerInputError:
        norms = None
    listed = tuple(norms.contributors) if norms is not None else ()
    return listed[index] if index < len(listed) else ZERO_KEY


#: ``RunBinding.replica``'s ABI types (StepProverBinding ``_dataKey`` reads its words by place).
REPLICA_TYPES = ("bytes", "bytes32[]", "bytes", "uint256", "bytes32", "bytes32", "bytes32", "bytes32")


def replica_binding(leaves: list[bytes], factors: bytes, index: int, signature: bytes,
                    partner: bytes) -> bytes:
    """A ``RunBinding.replica``: the round's stage-0 leaf (``leaves``: every encoded stage leaf of the round)
    and its path, the stage-0 factors (encoded), the replica's index in them, the later stage's member's
    signature of its :class:`DataKeyClaim` and the key's of its :class:`PartnerClaim` (each EIP-2098's
    ``r``, ``vs``)."""
    r, vs = compact(signature)
    pr, pvs = compact(partner)
    return encode(REPLICA_TYPES, (leaves[0], tree_path(leaves, 0), factors, index, r, vs, pr, pvs))
