"""What binds a contribution case to the ledger's record, from what node directories kept (issue 78;
docs/FRAUD_PROOF.md "The command", "The node defends its contributions").

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

    def subject(self, index: int):
        """The subject (``ledger.stepbinding.RunSubject``) of contribution ``index``; ConfigError for an index
        the factors do not list."""
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
                            self.stage)
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
