"""A contribution case on the ledger's StepProver (issue 78, docs/FRAUD_PROOF.md "The contribution case"):
the calls that challenge one contribution a committed round lists and, if every run claim on it is proven
wrong, overturn its round through the ledger.

The ledger's StepProver is the one its AggregationProver deployed (``ledger_step_prover``); it bonds and
clocks each run's cases and run claims with the run's own ``bond`` and ``accusationBlocks``
(``run_stake``). An opener commits first (``CaseClient.commitment``: its address, the contribution's key and
a secret salt), opens one block later, and whoever calls ``overturnContribution`` once the case is won pays
the opener.
"""

from __future__ import annotations

import contracts
from ledger.stepproof import StepProverClient

ZERO = bytes(32)


def ledger_step_prover(w3, ledger_address: str) -> str:
    """The address of the StepProver the TrainingLedger at ``ledger_address`` trusts (its
    AggregationProver's)."""
    ledger = w3.eth.contract(address=ledger_address, abi=contracts.artifact("TrainingLedger")["abi"])
    prover = w3.eth.contract(address=ledger.functions.prover().call(),
                             abi=contracts.artifact("AggregationProver")["abi"])
    return prover.functions.stepProver().call()


def run_stake(w3, ledger_address: str, run_id: int) -> int:
    """The bond of run ``run_id``'s cases, run claims and challenges on the ledger's StepProver."""
    ledger = w3.eth.contract(address=ledger_address, abi=contracts.artifact("TrainingLedger")["abi"])
    run_of = ledger.functions.runOf(run_id)
    names = [field["name"] for field in run_of.abi["outputs"][0]["components"]]
    return int(run_of.call()[names.index("bond")])


def case_claim(subject) -> tuple:
    """The ``RunClaim`` an opener names a contribution with (``subject``: ``ledger.stepbinding.RunSubject``);
    its program and state fields are not read."""
    return (ZERO, 0, 0, 0, ZERO, ZERO, 0, *subject.fields(), ZERO, subject.data_key)


class CaseClient:
    """The case moves on ``client``'s StepProver, each returning its receipt."""

    def __init__(self, client: StepProverClient) -> None:
        self.client = client
        self.functions = client.contract.functions

    def key(self, subject) -> bytes:
        return bytes(self.functions.contributionOf(subject.run_id, subject.round, subject.stage,
                                                   subject.payload_root).call())

    def commitment(self, opener: str, subject, salt: bytes) -> bytes:
        from eth_abi import encode

        return bytes(self.client.w3.keccak(encode(["address", "bytes32", "bytes32"],
                                                  [opener, self.key(subject), salt])))

    def commit(self, opener: str, subject, salt: bytes):
        return self.client._send("commitCase", opener, self.commitment(opener, subject, salt))

    def open(self, opener: str, subject, salt: bytes):
        return self.client._send("openCase", opener, case_claim(subject), subject.binding, salt,
                                 value=self.client.bond)

    def overturn(self, sender: str, subject, attesters):
        return self.client._send("overturnContribution", sender, self.key(subject), list(attesters))

    def dismiss(self, sender: str, subject, claim_id: bytes):
        return self.client._send("dismissCase", sender, self.key(subject), claim_id)

    def case(self, subject) -> dict:
        names = ("opener", "deadline", "claims", "refuted", "ends", "round", "runId", "stake")
        return dict(zip(names, self.functions.caseOf(self.key(subject)).call()))
