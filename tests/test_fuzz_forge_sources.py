"""bench/fuzz_forge.py records the sources its campaign compiled, so a result made on older contracts shows
it: ``--merge`` keeps them (and refuses campaigns of two trees), ``--stale`` names each source changed
since."""

from __future__ import annotations

import json

import pytest

from bench import fuzz_forge


def _chunk(path, seed: int, sources: dict[str, str] | None) -> str:
    result = {"forge": "forge Version: 1.7.1", "campaigns": [
        {"seed": hex(seed), "runs": 2, "depth": 500, "calls": 1000, "reverts": 1, "seconds": 10.0,
         "passed": True, "failure": ""}]}
    if sources is not None:
        result.update(sources_digest=fuzz_forge.digest(sources), sources=sources)
    path.write_text(json.dumps(result))
    return str(path)


def test_the_sources_are_the_contracts_and_the_campaigns_own_files():
    sources = fuzz_forge.sources()
    assert "contracts/src/TrainingLedger.sol" in sources and "contracts/src/AggregationProver.sol" in sources
    assert {f"contracts/forge/test/{name}" for name in fuzz_forge.CAMPAIGN_TESTS} <= sources.keys()
    assert all(len(h) == 64 for h in sources.values())
    assert fuzz_forge.digest(sources) == fuzz_forge.digest(dict(reversed(list(sources.items()))))


def test_a_merge_keeps_the_sources_and_refuses_two_trees(tmp_path):
    tree = {"contracts/src/A.sol": "1" * 64, "contracts/forge/test/Vm.sol": "2" * 64}
    out = tmp_path / "merged.json"
    chunks = [_chunk(tmp_path / f"c{i}.json", i, tree) for i in range(2)]
    assert fuzz_forge.merge(chunks, str(out), "abc123") == 0
    merged = json.loads(out.read_text())
    assert merged["calls"] == 2000 and merged["sources"] == tree
    assert merged["sources_digest"] == fuzz_forge.digest(tree)
    other = _chunk(tmp_path / "other.json", 9, {**tree, "contracts/src/A.sol": "3" * 64})
    with pytest.raises(SystemExit, match="different sources"):
        fuzz_forge.merge([*chunks, other], str(out), "abc123")
    with pytest.raises(SystemExit, match="recorded none"):
        fuzz_forge.merge([*chunks, _chunk(tmp_path / "none.json", 8, None)], str(out), "abc123")


def test_stale_names_each_source_changed_since(tmp_path, capsys):
    now = fuzz_forge.sources()
    out = tmp_path / "result.json"
    out.write_text(json.dumps({"sources": now}))
    assert fuzz_forge.stale(str(out)) == 0
    then = {**now, "contracts/src/TrainingLedger.sol": "0" * 64, "contracts/src/Gone.sol": "1" * 64}
    del then["contracts/src/NormRule.sol"]
    out.write_text(json.dumps({"sources": then}))
    assert fuzz_forge.stale(str(out)) == 1
    printed = capsys.readouterr().out
    assert "changed: contracts/src/TrainingLedger.sol" in printed
    assert "gone: contracts/src/Gone.sol" in printed and "new: contracts/src/NormRule.sol" in printed
    out.write_text(json.dumps({"calls": 1}))
    assert fuzz_forge.stale(str(out)) == 1
