"""bench/fuzz_forge.py and bench/fuzz_forge_pool.py record the sources their campaign compiled
(bench/forgesources.py), so a result made on older contracts shows it: ``--merge`` keeps them (and refuses
campaigns of two trees), ``--stale`` names each source changed since."""

from __future__ import annotations

import json

import pytest

from bench import fuzz_forge, fuzz_forge_pool
from bench.forgesources import stale


def _chunk(path, seed: int, sources: dict[str, str] | None) -> str:
    result = {"forge": "forge Version: 1.7.1", "campaigns": [
        {"seed": hex(seed), "runs": 2, "depth": 500, "calls": 1000, "reverts": 1, "seconds": 10.0,
         "passed": True, "failure": ""}]}
    if sources is not None:
        result.update(sources_digest=fuzz_forge.digest(sources), sources=sources)
    path.write_text(json.dumps(result))
    return str(path)


def test_the_sources_are_the_contracts_and_the_campaigns_own_files():
    sources = fuzz_forge.sources(fuzz_forge.CAMPAIGN_TESTS)
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
    now = fuzz_forge.sources(fuzz_forge.CAMPAIGN_TESTS)
    out = tmp_path / "result.json"
    out.write_text(json.dumps({"sources": now}))
    assert stale(str(out), fuzz_forge.CAMPAIGN_TESTS) == 0
    then = {**now, "contracts/src/TrainingLedger.sol": "0" * 64, "contracts/src/Gone.sol": "1" * 64}
    del then["contracts/src/NormRule.sol"]
    out.write_text(json.dumps({"sources": then}))
    assert stale(str(out), fuzz_forge.CAMPAIGN_TESTS) == 1
    printed = capsys.readouterr().out
    assert "changed: contracts/src/TrainingLedger.sol" in printed
    assert "gone: contracts/src/Gone.sol" in printed and "new: contracts/src/NormRule.sol" in printed
    out.write_text(json.dumps({"calls": 1}))
    assert stale(str(out), fuzz_forge.CAMPAIGN_TESTS) == 1


def _pool_part(path, seed: int, sources: dict[str, str], paid: int) -> str:
    """One pool campaign's result (bench/fuzz_forge_pool.py's shape): a campaign paying ``paid`` claims."""
    tally = {"sequences": 3, **dict.fromkeys(fuzz_forge_pool.TALLY, 1), "attestations_paid": paid}
    campaign = {"seed": hex(seed), "runs": 2, "depth": 250, "calls": 500, "reverts": 0, "seconds": 5.0,
                "passed": seed != 7, "failure": "R3: a contribution paid twice" if seed == 7 else "",
                "calls_by_actor": {"claim": 200, "fund": 300}, "tally": tally}
    path.write_text(json.dumps({"forge": "forge Version: 1.7.1", "campaigns": [campaign], "sources": sources,
                                "sources_digest": fuzz_forge.digest(sources)}))
    return str(path)


def test_the_pool_campaign_records_its_own_files_and_merges_its_parts(tmp_path, monkeypatch):
    sources = fuzz_forge_pool.sources(fuzz_forge_pool.CAMPAIGN_TESTS)
    assert "contracts/src/RewardPool.sol" in sources and "contracts/src/test/QuirkyToken.sol" in sources
    assert {"contracts/forge/test/PoolHandler.sol", "contracts/forge/test/PoolRounds.sol",
            "contracts/forge/test/PoolInvariants.t.sol"} <= sources.keys()
    out = tmp_path / "pool.json"
    parts = [_pool_part(tmp_path / f"p{i}.json", i, sources, paid=i + 1) for i in range(2)]
    monkeypatch.setattr("sys.argv", ["fuzz_forge_pool.py", "--merge", *parts, "--commit", "abc123",
                                     "--out", str(out)])
    assert fuzz_forge_pool.main() == 0
    merged = json.loads(out.read_text())
    assert (merged["calls"], merged["runs"], merged["violations"], merged["campaigns_ran_on"]) == \
        (1000, 4, 0, "abc123")
    assert merged["calls_by_actor"] == {"claim": 400, "fund": 600}
    assert merged["tally"]["attestations_paid"] == 3 and merged["tally"]["sequences"] == 6
    assert merged["sources"] == sources
    monkeypatch.setattr("sys.argv", ["fuzz_forge_pool.py", "--stale", "--out", str(out)])
    assert fuzz_forge_pool.main() == 0
    # a part that failed is a violation, named with its seed; parts of two trees are refused
    failed = _pool_part(tmp_path / "f.json", 7, sources, paid=0)
    monkeypatch.setattr("sys.argv", ["fuzz_forge_pool.py", "--merge", *parts, failed, "--out", str(out)])
    assert fuzz_forge_pool.main() == 1
    assert json.loads(out.read_text())["failures"] == ["seed 0x7: R3: a contribution paid twice"]
    other = _pool_part(tmp_path / "o.json", 9, {**sources, "contracts/src/RewardPool.sol": "0" * 64}, 1)
    monkeypatch.setattr("sys.argv", ["fuzz_forge_pool.py", "--merge", *parts, other, "--out", str(out)])
    with pytest.raises(SystemExit, match="different sources"):
        fuzz_forge_pool.main()
