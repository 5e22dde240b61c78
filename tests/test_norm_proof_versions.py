"""The run's version of its commitments (issue 43, issue 62 point 7; docs/FRAUD_PROOF.md "The run's version"):
factors of another version than the run's are a wrong round whichever proof opens them, proven and slashed on
py-evm and on a real anvil; a right round of its run's version is not.

Split from tests/test_norm_proof.py (its round, fixtures and proof builders).
"""

from __future__ import annotations

import dataclasses
import hashlib

import pytest

from ledger import errors
from ledger.chain import connect_pyevm
from node.commitments import SCHEMES, scheme_named, scheme_of_version
from node.errors import ConfigError
from tests.fraud_fixtures import DILOCO, aggregated_round, commit
from tests.ledger_fixtures import chain_w3, deploy  # noqa: F401 (chain_w3: the py-evm / anvil fixture)
from tests.test_norm_proof import (SHAPES, STAKE, blobs, honest, on_chain, overturn,  # noqa: F401
                                   proof_of_scales, right)

_V2: list = []


def version_two():
    """The three contributions aggregated as a chunked run's (version 2) round (cached)."""
    if not _V2:
        _V2.append(aggregated_round(SHAPES, blobs(), DILOCO))
    return _V2[0]


def test_a_version_two_round_has_no_norm_proof(honest):
    v2 = version_two()
    assert v2.honest.factors.norms is None and v2.honest.sum_trees == []
    committed = on_chain(v2, v2.honest)
    with pytest.raises(errors.ProverNotNormed):
        committed.prover().prove_wrong_norm(proof_of_scales(committed))


# ------------------------------------------------------------------------------------------ the run's version


def test_a_quorum_committing_version_two_factors_in_a_normed_run_is_proven_and_slashed(chain_w3, honest):
    """The version escape: the colluders aggregate with every scale 1.0 (the raw contribution unclipped) and
    commit version-2 factors (no norm commitment to open) in a run created as version 3. The norm proof proves
    it from the run's version alone; since issue 62 the chunk proof does too (factors of another version than
    the run's are a wrong round whichever proof opens them)."""
    loose = aggregated_round(SHAPES, blobs(), dataclasses.replace(DILOCO, norm_clip=0.0))
    assert loose.honest.factors.norms is None and set(loose.honest.factors.scale_bits) == {0x3FF0000000000000}
    committed = on_chain(loose, loose.honest, chain_w3, commitments=scheme_named("normed").version)
    prover = committed.prover()
    assert prover.run_info(committed.run_id).commitments == 3
    assert prover.proof_holds(committed.proof(1))
    proof = proof_of_scales(committed)
    assert prover.norm_proof_holds(proof)
    overturn(committed, lambda prover: prover.prove_wrong_norm(proof))
    with pytest.raises(errors.LedgerRunHalted):  # one reward per round
        prover.prove_wrong_norm(proof)


def test_any_norm_proof_over_version_two_factors_in_a_normed_run_proves_it(chain_w3):
    """The version is checked before the proof's kind: a sum proof's contribution and chunk need not exist."""
    v2 = version_two()
    committed = on_chain(v2, v2.honest, chain_w3, commitments=scheme_named("normed").version)
    proof = dataclasses.replace(proof_of_scales(committed), contribution=7, chunk=10**6)
    overturn(committed, lambda prover: prover.prove_wrong_norm(proof))


def test_version_three_factors_in_a_chunked_run_are_proven(chain_w3, honest):
    """The other way round: a right version-3 round committed in a run created as version 2 is no honest
    node's (an honest node of a chunked run writes version-2 factors)."""
    committed = on_chain(honest, honest.honest, chain_w3, commitments=scheme_named("chunked").version)
    overturn(committed, lambda prover: prover.prove_wrong_norm(proof_of_scales(committed)))


def test_an_honest_round_of_its_runs_version_is_not_proven(right, honest):
    """A right version-3 round in a version-3 run (the ``right`` fixture), and a right version-2 round in a
    version-2 or a hashed run: no norm proof holds (ProverNormCorrect, or ProverNotNormed: nothing to
    open)."""
    assert right.prover().run_info(right.run_id).commitments == 3
    assert not right.prover().norm_proof_holds(proof_of_scales(right))
    v2 = version_two()
    for version in ("chunked", "hashed"):
        committed = commit(deploy(connect_pyevm(), min_stake=STAKE), v2, v2.honest, stake=STAKE,
                           commitments=scheme_named(version).version)
        with pytest.raises(errors.ProverNotNormed):
            committed.prover().prove_wrong_norm(proof_of_scales(committed))
        assert committed.prover().invalid_from(committed.run_id) is None


def test_a_run_names_a_known_version_of_its_commitments():
    deployment = deploy(connect_pyevm())
    client = deployment.client(1)
    for bad in (0, 4, 255):
        with pytest.raises(errors.LedgerBadCommitments) as caught:
            client.create_run(b"v" * 32, 1, 10, commitments=bad)
        assert caught.value.values["commitments"] == bad
    with pytest.raises(errors.LedgerInputError, match="commitments"):
        client.create_run(b"v" * 32, 1, 10, commitments=256)
    for name, scheme in SCHEMES.items():  # every scheme this node knows is a version the ledger takes
        run_id = client.create_run(hashlib.sha256(name.encode()).digest(), 1, 10, commitments=scheme.version)
        assert scheme_of_version(scheme.version) is scheme_named(name) is scheme
        assert client.run_info(run_id).commitments == scheme.version
        assert client.commitments_of(run_id) == scheme.version
    assert client.run_info(client.create_run(b"d" * 32, 1, 10)).commitments == scheme_named("normed").version
    for bad in ("auto", "", None, 3):
        with pytest.raises(ConfigError, match="commitments"):
            scheme_named(bad)


