"""The registry of commitment schemes (node/commitments/): one name per scheme, one ledger number, and a new
version is one subclass plus one registration, nothing else."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ledger.runparams import DEFAULT_COMMITMENTS, RunParams
from node.commitments import (
    SCHEMES,
    UNNAMED,
    CommitmentScheme,
    register,
    scheme_named,
    scheme_of,
    scheme_of_version,
    unregister,
    version_name,
)
from node.commitments.normed import NormedScheme
from node.config import load_config
from node.errors import ConfigError
from node.runconfig import node_config_from_run, run_document
from node.tools.audit_rundoc import commitments_check
from node.tools.report import FAIL, OK
from training.config import DilocoConfig

ROOT = Path(__file__).resolve().parents[1]


def test_the_built_in_schemes_and_their_ledger_numbers():
    assert {name: scheme.version for name, scheme in SCHEMES.items()} == {"hashed": 1, "chunked": 2,
                                                                          "normed": 3}
    for name, scheme in SCHEMES.items():
        assert scheme.name == name and scheme_named(name) is scheme
        assert scheme_of_version(scheme.version) is scheme and version_name(scheme.version) == name
    assert [SCHEMES[n].chunked for n in SCHEMES] == [False, True, True]
    assert [SCHEMES[n].proves_factors for n in SCHEMES] == [False, False, True]
    assert UNNAMED == "hashed"  # a run document naming none: every run made before version 2


def test_an_unknown_name_or_number_is_refused_naming_the_known_ones():
    for bad in ("merkle", "auto", "", None, 3):
        with pytest.raises(ConfigError, match=r"diloco.commitments=.*must be one of hashed, chunked, normed"):
            scheme_named(bad)
    with pytest.raises(ConfigError,
                       match=r"commitments version 9 .*1 \(hashed\), 2 \(chunked\), 3 \(normed\)"):
        scheme_of_version(9)
    assert version_name(9) == "unknown"
    with pytest.raises(ConfigError, match="must be one of hashed, chunked, normed"):
        load_config(None, ["diloco.commitments=merkle"])


def test_a_name_or_number_taken_is_refused():
    class Again(NormedScheme):
        name = "normed2"  # a new name on an old number

    class Renamed(NormedScheme):
        version = 9  # an old name on a new number

    for clash in (Again, Renamed):
        with pytest.raises(ConfigError, match="clashes with"):
            register(clash)
    assert set(SCHEMES) == {"hashed", "chunked", "normed"}


def test_what_auto_gives_is_the_ledgers_default_number():
    """A run created naming no version (the ledger's default) is what a new fraud-provable run's "auto"
    gives."""
    assert scheme_of(DilocoConfig()).version == DEFAULT_COMMITMENTS == RunParams(b"\x01" * 32, 1,
                                                                                 1).commitments
    assert scheme_of(DilocoConfig(exchange="sliced")).name == UNNAMED


class WideScheme(NormedScheme):
    """A version 4 as its module would write it: here, version 3 that also publishes a note beside each
    state."""

    name = "wide"
    version = 4
    audit_note = "chunk and norm proofs open its roots, and a note rides along"

    def published_parts(self, leaf: bytes, state) -> list[tuple[str, bytes]]:
        return [*super().published_parts(leaf, state), ("wide-" + leaf.hex()[:8], b"note")]


@pytest.fixture
def wide():
    register(WideScheme)  # the one registry line a new version adds
    yield SCHEMES["wide"]
    unregister("wide")
    assert "wide" not in SCHEMES


def test_a_version_four_is_one_subclass_and_one_registration(wide):
    # Config validation and its needs of the outer loop: the registry's, nothing else to edit.
    cfg = load_config(None, ["diloco.commitments=wide"])
    assert cfg.commitment_scheme is wide and cfg.diloco.commitments == "wide"
    with pytest.raises(ConfigError, match="diloco.commitments='wide' needs diloco.exchange"):
        load_config(None, ["diloco.commitments=wide", "diloco.exchange=sliced"])
    # The run document names it, and reads back to it (a joiner, the auditor).
    document = run_document(cfg)
    assert document["diloco"]["commitments"] == "wide"
    assert node_config_from_run(document).commitment_scheme is wide
    # The ledger's number: the scheme's version goes on chain, and the chain's number maps back to it.
    assert RunParams(b"\x01" * 32, 1, 1, commitments=cfg.commitment_scheme.version).commitments == 4
    assert scheme_of_version(4) is wide and version_name(4) == "wide"
    # The audit's check of the document against the chain's number.
    check = commitments_check(document, 4)
    assert check.status == OK and "a note rides along" in check.reason
    assert commitments_check(document, 3).status == FAIL
    # What differs from version 3 (here, a part published beside the state) is the subclass's alone.
    assert wide.chunked and wide.proves_factors
    assert [alias for alias, _blob in wide.published_parts(b"\x00" * 160, _NormlessState())][-1] \
        == "wide-00000000"
    # Unknown names still say which are known, the new one among them.
    with pytest.raises(ConfigError, match="hashed, chunked, normed, wide"):
        scheme_named("wider")


class _Factors:
    @staticmethod
    def encode() -> bytes:
        return b""


class _NormlessState:
    """The least a state needs for :meth:`NormedScheme.published_parts`: factors that encode, no sum trees."""

    def __init__(self) -> None:
        self.factors = _Factors()
        self.sum_trees: list = []


def test_the_setting_is_tested_nowhere_but_in_the_schemes():
    """No module outside node/commitments/ compares the setting with a version's name or number; the config's
    "auto" resolution (training/config.py) and the unnamed scheme of old run documents are the exceptions."""
    name = r"\"(hashed|chunked|normed)\""
    pattern = re.compile(
        rf"(==|!=)\s*{name}|commitments\s*(==|!=)\s*\d|in \(\s*{name}|\[\s*{name}\s*\]|{name}:\s*\d")
    offenders = []
    for package in ("node", "ledger", "training", "p2p"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.parent.name == "commitments":
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line) and "UNNAMED" not in line:
                    offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_the_protocol_has_no_version_of_its_own():
    assert CommitmentScheme.version == 0 and CommitmentScheme.name == ""
    with pytest.raises(NotImplementedError):
        CommitmentScheme().weights_root([b"\x00" * 32], [])
