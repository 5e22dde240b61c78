"""What bench/bench_fraud_proof.py, bench/bench_fraud_proof_bounds.py and bench/bench_binding_gas.py share
(issue 62's review): a real anvil, contributions of a codec, an aggregation that lists all of them, the run's
bound values, and the worst chunk proof of a committed round (docs/FRAUD_PROOF.md "Gas" and "Bounded
proofs")."""

from __future__ import annotations

import contextlib

from ledger.anvil import AnvilProcess
from ledger.chain import connect_rpc
from ledger.runparams import PROOF_MAX_CALLDATA, PROOF_MAX_GAS, proof_cost
from tests.fraud_fixtures import DILOCO, aggregated_round, changed, commit, contribution, with_scale
from tests.ledger_fixtures import deploy
from training import diloco as diloco_module

STAKE = 10**18
CHUNK_ELEMENTS = 64
LAST_ELEMENT = CHUNK_ELEMENTS - 1  # the worst change: every element before it is recomputed first
ONE = 0x3FF0000000000000
# float64 1 + 2^-52: float32(float64(d) * s) == d for every float32 d (the change is far below half a float32
# ulp), so the weights stay the honest ones while the contract takes the clip's product for every element
NEXT_AFTER_ONE = 0x3FF0000000000001


@contextlib.contextmanager
def anvil_url():
    """A real anvil (prague) for the bench's runs, its URL; stopped after."""
    anvil = AnvilProcess()
    url = anvil.start()
    try:
        yield url
    finally:
        anvil.stop()


def blobs_of(shapes, codec: str, options: dict, count: int, *, seed: int = 100, large_every: int = 4,
             outer_round: int = 1) -> list[bytes]:
    """``count`` contributions of ``codec``; every ``large_every``-th made large so the norm rule clips it
    (0: none)."""
    return [contribution(shapes, codec, seed + i, outer_round=outer_round, **options,
                         scale=0.05 if large_every and i % large_every == large_every - 1 else 1e-3)
            for i in range(count)]


def aggregated(shapes, blobs: list[bytes], diloco=DILOCO):
    """:func:`tests.fraud_fixtures.aggregated_round` listing every one of ``blobs``: an honest node lists at
    most ``MAX_LISTED`` (training/config_base.py), but a run created with a larger ``maxContributions`` may
    carry a round that lists that many (a quorum's), and its proofs are what the bound is about."""
    saved = diloco_module.MAX_LISTED
    diloco_module.MAX_LISTED = max(saved, len(blobs))
    try:
        round_ = aggregated_round(shapes, blobs, diloco)
    finally:
        diloco_module.MAX_LISTED = saved
    assert len(round_.honest.factors.scale_bits) == len(blobs)
    return round_


def rank_of(options: dict) -> int:
    """The ``maxRank`` a run of the codec needs (1 for raw and quant)."""
    return max(options.get("rank", 1), 1)


def run_values(options: dict, count: int) -> dict:
    """The run's bound values for ``count`` contributions of the codec (what createRun checks)."""
    return {"max_contributions": count, "max_rank": rank_of(options)}


def refusal(options: dict, count: int) -> dict | None:
    """The bound's gas and bytes where createRun refuses a run listing ``count`` contributions of the
    codec."""
    gas, size = proof_cost(count, rank_of(options))
    if gas <= PROOF_MAX_GAS and size <= PROOF_MAX_CALLDATA:
        return None
    return {"gas": None, "error": f"createRun refuses the run: its bound is {gas:,} gas, {size:,} bytes",
            "gas_bound": gas, "calldata_bound": size}


def worst_case(state, chunk: int):
    """``state`` changed as the costliest chunk proof needs: every clip scale of 1.0 committed as 1 + 2^-52
    (the float64 product taken for every element of every piece; no value moves) and the chunk's last
    element flipped (all 64 recomputed before the difference)."""
    for j, bits in enumerate(state.factors.scale_bits):
        if bits == ONE:
            state = with_scale(state, j, NEXT_AFTER_ONE)
    return changed(state, chunk, LAST_ELEMENT)


def prove_chunk(url: str, round_, wrong, chunk: int, values: dict) -> dict:
    """Round 1 committed as ``wrong`` in a fresh run on ``url`` and chunk ``chunk``'s proof sent: its gas and
    calldata bytes (or its error, e.g. above the block's gas limit: recorded, not hidden)."""
    committed = commit(deploy(connect_rpc(url, timeout=60.0), min_stake=STAKE), round_, wrong, stake=STAKE,
                       values=values)
    try:
        receipt = committed.prover().prove_wrong_aggregation(committed.proof(chunk))
    except Exception as exc:  # noqa: BLE001 - recorded, not hidden
        return {"gas": None, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    sent = committed.deployment.w3.eth.get_transaction(receipt["transactionHash"])
    return {"gas": receipt["gasUsed"], "calldata_bytes": len(sent["input"])}
