"""A node checks its settings against the run's end rule before it joins (issue 78; docs/FRAUD_PROOF.md "The
claim's end", "The node defends its contributions").

Under the plain end rule (StepProver ``endRuleOf`` 1, fixed by the run's creator) every element of a run
claim's end may be disputed: the contribution's payload must code ``v = fl(S - E)``, ``S`` the committed start
and ``E`` the end of the run's program from it, with nothing carried between rounds and no low-rank piece. A
node whose training carries state between rounds codes something else (``fl(g + e)`` with error feedback,
``fl(g + u)`` after a left-out round, an ``E`` from moments no record commits), so it could not defend its own
contributions there: an outsider's case on any of them would overturn its round and slash its attesters. So
a node refuses to join or start in such a run, naming each setting (:func:`plain_end_problems`). Those
settings are the run document's (its configHash binds them): the message says the run's creator must make the
run again. A run the rule takes: ``compression.error_feedback = false``, ``compression.min_compress_numel``
above its largest tensor (or compression off), ``training.inner_state = "fresh"``, ``diloco.put_back =
false`` and ``diloco.one_step_delay = false`` (each round trains from the committed start: under the delay it
trains from the replica's own end of the round before, and the end relation from the committed start breaks,
tests/test_fresh_inner_state.py).
"""

from __future__ import annotations

import logging
from math import prod

from ledger.stepproof import PLAIN_END
from node.errors import ConfigError

logger = logging.getLogger(__name__)


def plain_end_problems(cfg) -> list[str]:
    """Every way a node with settings ``cfg`` (a NodeConfig: the run document's) carries state between
    rounds, codes a piece low-rank or trains a round from another start than the committed one, one message
    each naming the setting; empty: its payload codes ``fl(S - E)`` alone, ``E`` the end of the round's
    program from the committed start ``S`` (training.end_relation.program_end)."""
    from training.stages import split_stages, stage_param_shapes

    problems = []
    comp = cfg.compression
    if comp.enabled and comp.error_feedback:
        problems.append("compression.error_feedback = true: the codec's residual is carried into the next "
                        "round's target (v = fl(g + e)); set it false")
    if comp.enabled:
        specs = split_stages(cfg.model.n_layer, cfg.pipeline.num_stages)
        sizes = {name: prod(shape) for spec in specs
                 for name, shape in stage_param_shapes(cfg.model, spec).items()}
        name, largest = max(sizes.items(), key=lambda item: (item[1], item[0]))
        if largest >= comp.min_compress_numel:
            problems.append(f"compression.min_compress_numel = {comp.min_compress_numel}: a tensor of that "
                            f"many elements or more may be coded low-rank (the largest, {name!r}, has "
                            f"{largest:,}); set it above {largest:,}, or compression.enabled = false")
    if not cfg.training.fresh_inner_state:
        optimizer = cfg.training.optimizer
        problems.append(f"training.inner_state = {cfg.training.inner_state!r}: the inner optimizer's "
                        f"state ({optimizer}'s moments) is carried across rounds, and the chain's claim "
                        "starts from the committed weights alone; set it \"fresh\" (a new inner "
                        "optimizer every round)")
    if cfg.diloco.put_back:
        problems.append("diloco.put_back = true: a contribution left out of its round is put back into the "
                        "next round's target (v = fl(g + u)); set it false (a left-out update is dropped)")
    if cfg.diloco.one_step_delay:
        problems.append("diloco.one_step_delay = true: a round trains from the replica's own end of the "
                        "round before, ahead of that round's outer step, not from the committed start the "
                        "claim names; set it false")
    return problems


def end_rule_of(client, run_id: int) -> int:
    """Run ``run_id``'s end rule on the ledger's StepProver (0: none, or a ledger without a StepProver)."""
    from web3.exceptions import Web3Exception

    from ledger.stepcase import ledger_step_prover
    from ledger.stepproof import StepProverClient

    try:
        address = ledger_step_prover(client.w3, client.ledger_address)
        return int(StepProverClient(client.w3, address, bond=0).contract.functions.endRuleOf(run_id).call())
    except (Web3Exception, ValueError) as exc:  # no StepProver behind this ledger: no rule
        logger.debug("run %d: end rule not read (%s): none", run_id, exc)
        return 0


def check_end_rule(client, run_id: int, cfg) -> None:
    """ConfigError naming every setting of ``cfg`` that carries state between rounds, if run ``run_id`` fixes
    the plain end rule on chain (module docstring); nothing otherwise (a run without the rule, or another
    version than 3, which takes no case)."""
    if not cfg.commitment_scheme.proves_factors:
        return
    rule = end_rule_of(client, run_id)
    if not rule:
        return
    if rule != PLAIN_END:
        raise ConfigError(f"run {run_id} fixes end rule {rule} on chain (StepProver.endRuleOf); this node "
                          f"knows the plain end rule ({PLAIN_END}) only: not joining")
    problems = plain_end_problems(cfg)
    if problems:
        raise ConfigError(
            f"run {run_id} fixes the plain end rule on chain (StepProver.endRuleOf = {PLAIN_END}: every "
            "contribution's payload must code fl(S - E) with nothing carried between rounds and no low-rank "
            f"piece), but its settings do not give that: {' | '.join(problems)}. This node could "
            "not defend its contributions (a case on each would overturn its round): not joining. These "
            "settings are the run document's (its configHash): the run's creator must make the run again "
            "without them or without the rule")
