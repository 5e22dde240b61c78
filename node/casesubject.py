"""What binds a contribution case to the ledger's record, from what node directories kept, and opening one
(issue 78; docs/FRAUD_PROOF.md "The command", "The node defends its contributions").

A case or a run claim names a contribution by its round, stage and index among the stage's listed
contributions; its binding (``ledger.stepbinding.bind_run``) opens the round's and the previous round's
records with their stage leaves and the round's factors. A node keeps those in ``<data_dir>/rewards/``
(node/store/rewardsources.py, each read back only where the chain's record vouches for it), as long as a case
of the round or the next can read them. ``dlx-node challenge`` (an opener) and the node's case defender
(node/live/fraud/defender.py) both read them here.
"""

from __future__ import annotations

from dataclasses import dataclass

from node.errors import ConfigError


@dataclass(frozen=True)
class KeptCase:
    """Rounds ``round`` and ``round - 1`` of one stage as the node directories kept them, vouched for by the
    chain: what binds a case or claim on any contribution the round's factors list."""

    round: int
    stage: int
    records: tuple  # the committed RoundRecords of round - 1 and round
    leaves: tuple[bytes, ...]  # every stage leaf of round
    prev_leaves: tuple[bytes, ...]  # every stage leaf of round - 1
    factors: bytes  # the stage's factors of round (their ABI encoding)

    def factors_parsed(self):
        """The stage's factors (``ledger.chunkproof.Factors``)."""
        from ledger.chunkproof import Factors

        return Factors.decode(self.factors)

    def subject(self, index: int, replica=None):
        """The subject (``ledger.stepbinding.RunSubject``) of contribution ``index`` (``replica``: a later
        stage's ``ledger.stepbinding.ReplicaKey``, None for none); ConfigError for an index the factors do
        not list."""
        from ledger.chunkproof import StageLeaf
        from ledger.errors import LedgerInputError
        from ledger.stepbinding import bind_run

        raw = self.factors
        roots = self.factors_parsed().payload_roots

        class _Factors:
            payload_roots = roots

            @staticmethod
            def encode() -> bytes:
                return raw

        try:
            return bind_run(self.records[1], [StageLeaf.decode(leaf) for leaf in self.leaves], _Factors,
                            index, self.records[0], [StageLeaf.decode(leaf) for leaf in self.prev_leaves],
                            self.stage, replica)
        except LedgerInputError as exc:
            raise ConfigError(f"--contribution {index}: {exc}") from None


def kept_case(directories, client, run_id: int, round_: int, stage: int) -> KeptCase:
    """Round ``round_`` (>= 1) and ``round_ - 1`` of ``stage`` from what ``directories`` (node directories)
    kept, checked against the chain (``client``: a ``ledger.client.LedgerClient``); ConfigError naming what
    is missing."""
    from node.store.rewardsources import read_sources

    sources = read_sources(list(directories), client, run_id)
    for r in (round_ - 1, round_):
        if r not in sources:
            raise ConfigError(f"round {r} of run {run_id}: the node directory (and --archive) kept no stage "
                              "leaves the chain vouches for (a node of the run keeps them: "
                              "node/store/rewardsources.py)")
    leaves, factors = sources[round_]
    if not 0 <= stage < len(leaves) or factors[stage] is None:
        raise ConfigError(f"round {round_}, stage {stage}: no factors kept for it (of {len(leaves)} stages)")
    records = tuple(client.commit_record(run_id, r).commit for r in (round_ - 1, round_))
    return KeptCase(round_, stage, records, tuple(leaves), tuple(sources[round_ - 1][0]),
                    bytes(factors[stage]))


#: The most gas an opening takes (the binding's openings of two records; about 400,000 measured).
OPEN_GAS = 600_000
#: How long an opener waits for the block after its commitment (seconds).
NEXT_BLOCK_WAIT_S = 120.0


def case_salt(client, key: bytes) -> bytes:
    """A case's salt: the hash of the account's signature of the case key (secret until the opening reveals
    it, and the same on a rerun)."""
    from eth_account.messages import encode_defunct

    signed = client.account.sign_message(encode_defunct(primitive=b"dlx-node case salt" + key))
    return bytes(client.w3.keccak(signed.signature))


def case_commitment(client, prover, subject) -> bytes:
    """The commitment ``client``'s account opens a case on ``subject`` with (StepProver ``commitCase``)."""
    from eth_abi import encode

    key = bytes(prover.functions.contributionOf(*subject.fields()[:4]).call())
    return bytes(client.w3.keccak(encode(["address", "bytes32", "bytes32"],
                                         [client.address, key, case_salt(client, key)])))


def commit_case(client, prover, subject) -> int:
    """Commit a case on ``subject`` from ``client``'s account (``prover``: the ledger's StepProver, a web3
    contract), unless committed already; the commitment's block."""
    commitment = case_commitment(client, prover, subject)
    committed_at = prover.functions.caseCommittedAt(commitment).call()
    if not committed_at:
        what = f"commit a case on round {subject.round}'s contribution"
        committed_at = client.sender.transact(prover, "commitCase", (commitment,), what)["blockNumber"]
    return int(committed_at)


def reveal_case(client, prover, subject, stake: int) -> None:
    """Open the committed case on ``subject`` with the run's bond ``stake`` (a block after its commitment)."""
    from ledger.stepcase import case_claim

    key = bytes(prover.functions.contributionOf(*subject.fields()[:4]).call())
    client.sender.transact(prover, "openCase", (case_claim(subject), subject.binding, case_salt(client, key)),
                           "openCase", stake)


def open_case(client, prover, subject, stake: int) -> None:
    """Commit a case on ``subject``, wait for a later block and open it (``dlx-node challenge --open``)."""
    _next_block(client.w3, commit_case(client, prover, subject))
    reveal_case(client, prover, subject, stake)


def _next_block(w3, after: int) -> None:
    """Wait until the chain is past block ``after`` (an opening must come after its commitment's block)."""
    import time

    deadline = time.monotonic() + NEXT_BLOCK_WAIT_S
    while w3.eth.block_number <= after:
        if time.monotonic() > deadline:
            raise ConfigError(f"the chain made no block after {after} in {NEXT_BLOCK_WAIT_S:.0f} s: the case "
                              "is committed; run the same command again to open it")
        time.sleep(0.5)
