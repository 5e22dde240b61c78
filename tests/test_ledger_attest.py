"""EIP-712 record and verdict signatures (ledger.attest): pure unit tests, no chain."""

from __future__ import annotations

from dataclasses import replace

import pytest
from eth_account import Account
from eth_account.messages import encode_typed_data
from eth_utils import keccak
from ledger_fixtures import digest, make_record

from ledger.attest import (
    RECORD_TYPE,
    VERDICT_TYPE,
    Verdict,
    order_signatures,
    pack_signatures,
    record_digest,
    recover_signer,
    recover_verdict_signer,
    sign_record,
    sign_verdict,
    typed_data,
    verdict_digest,
)
from ledger.errors import LedgerInputError

CHAIN_ID = 31337
LEDGER = "0x" + "42" * 20
N = 0xFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFEBAAEDCE6AF48A03BBFD25E8CD0364141


def eth_account_digest(message) -> bytes:
    """The digest eth-account's own EIP-712 encoder gives (an independent implementation)."""
    signable = encode_typed_data(full_message=typed_data(message, CHAIN_ID, LEDGER))
    return keccak(b"\x19" + signable.version + signable.header + signable.body)


def test_digests_match_an_independent_eip712_implementation():
    record = make_record(3, 7, digest("head"), checkpoint_hash=digest("ckpt"))
    assert record_digest(record, CHAIN_ID, LEDGER) == eth_account_digest(record)
    verdict = Verdict(3, "0x" + "11" * 20, digest("evidence"), True)
    assert verdict_digest(verdict, CHAIN_ID, LEDGER) == eth_account_digest(verdict)
    assert RECORD_TYPE.startswith("Record(uint256 runId,uint64 round,bytes32 prevHead,")
    assert VERDICT_TYPE == "Verdict(uint256 runId,address accused,bytes32 evidenceHash,bool guilty)"


def test_every_field_and_the_domain_change_the_digest():
    record = make_record(3, 7, digest("head"))
    base = record_digest(record, CHAIN_ID, LEDGER)
    variants = [
        replace(record, run_id=4),
        replace(record, round=8),
        replace(record, prev_head=digest("other head")),
        replace(record, weights_root=digest("w")),
        replace(record, contributions_root=digest("c")),
        replace(record, train_loss_micro=1),
        replace(record, eval_loss_micro=1),
        replace(record, tokens=1),
        replace(record, num_contributors=1),
        replace(record, checkpoint_hash=digest("ckpt")),
    ]
    digests = {record_digest(v, CHAIN_ID, LEDGER) for v in variants}
    digests |= {record_digest(record, CHAIN_ID + 1, LEDGER),
                record_digest(record, CHAIN_ID, "0x" + "43" * 20)}
    assert len(digests) == 12 and base not in digests


def test_sign_and_recover():
    account = Account.from_key(b"\x01" * 32)
    record = make_record(1, 0, digest("genesis"))
    signature = sign_record(account, record, CHAIN_ID, LEDGER)
    assert len(signature) == 65 and signature[64] in (27, 28)
    assert int.from_bytes(signature[32:64], "big") <= N // 2
    assert recover_signer(record, signature, CHAIN_ID, LEDGER) == account.address
    assert recover_signer(replace(record, tokens=0), signature, CHAIN_ID, LEDGER) != account.address
    # eth-account's own typed-data signing gives the same signature.
    theirs = account.sign_typed_data(full_message=typed_data(record, CHAIN_ID, LEDGER)).signature
    assert bytes(theirs) == signature
    verdict = Verdict(1, account.address, digest("e"), False)
    assert recover_verdict_signer(verdict, sign_verdict(account, verdict, CHAIN_ID, LEDGER), CHAIN_ID,
                                  LEDGER) == (
        account.address
    )


def test_malformed_and_malleable_signatures_are_refused():
    account = Account.from_key(b"\x02" * 32)
    record = make_record(1, 0, digest("genesis"))
    signature = sign_record(account, record, CHAIN_ID, LEDGER)
    s = int.from_bytes(signature[32:64], "big")
    twin = signature[:32] + (N - s).to_bytes(32, "big") + bytes([55 - signature[64]])
    for bad in (twin, signature[:64], signature[:64] + b"\x00", b"\x00" * 65):
        with pytest.raises(LedgerInputError):
            recover_signer(record, bad, CHAIN_ID, LEDGER)
    with pytest.raises(LedgerInputError):
        pack_signatures([signature[:64]])
    with pytest.raises(LedgerInputError):
        Verdict(1, "not an address", digest("e"), True)


def test_order_signatures_sorts_by_signer_and_keeps_what_the_chain_must_refuse():
    accounts = [Account.from_key(bytes([i]) * 32) for i in range(1, 6)]
    record = make_record(1, 0, digest("genesis"))
    signatures = [sign_record(a, record, CHAIN_ID, LEDGER) for a in accounts]
    ordered = order_signatures(record_digest(record, CHAIN_ID, LEDGER),
                               [b"\x00" * 65, *signatures, signatures[0]])
    signers = [recover_signer(record, s, CHAIN_ID, LEDGER) for s in ordered[:-1]]
    assert [int(a, 16) for a in signers] == sorted(int(a.address, 16) for a in [*accounts, accounts[0]])
    assert ordered[-1] == b"\x00" * 65
    assert pack_signatures(ordered[:2]) == ordered[0] + ordered[1]
