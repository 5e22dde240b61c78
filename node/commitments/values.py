"""A fraud-provable run's per-round values as ``TrainingLedger.createRun`` binds them (issue 62;
docs/FRAUD_PROOF.md, "The run's values"), derived from the run's configuration exactly as training uses it.

- the outer schedule (:func:`schedule_of`): each round's lr and momentum as the float32 bit patterns the outer
  step multiplies by (``node.fraudproof.round_factors_bits``, training/schedule.py), one leaf per round until
  the schedule is constant (:mod:`ledger.runvalues`);
- the Nesterov flag and the norm clip's float64 bits;
- the genesis root (:func:`genesis_root`): the version-2/3 weights root of round 0's start, the model's
  initial weights (training.model.init_state_dict of the model and seed) and zero outer momentum, one stage
  leaf per stage (``node.fraudproof.initial_state``): what a proof of round 0 opens as round -1's record;
- the bounds of a proof's cost: the decoder's largest rank and the most contributions the contract's bound
  allows at it (``ledger.runparams.most_contributions``).

A hashed run (version 1: nothing is provable) binds none: :func:`run_values` gives ``{}``.
"""

from __future__ import annotations

from ledger.chunkproof import chunked_weights_root
from ledger.runparams import DEFAULT_MAX_CONTRIBUTIONS, DEFAULT_MAX_RANK
from ledger.runvalues import Schedule


def schedule_rounds(diloco_cfg) -> int:
    """The leaves the schedule needs: 1 if constant, else up to the round from which it no longer changes
    (the warmup's end, the decay's end: ``p`` is clamped at 1 from ``outer_decay_rounds`` on)."""
    from training.schedule import outer_schedule_is_constant

    if outer_schedule_is_constant(diloco_cfg):
        return 1
    decay = 0 if diloco_cfg.outer_decay == "constant" else diloco_cfg.outer_decay_rounds
    return max(diloco_cfg.outer_warmup_rounds, decay) + 1


def schedule_of(diloco_cfg, max_rounds: int = 0) -> Schedule:
    """The run's committed schedule: rounds ``0 .. schedule_rounds - 1`` (fewer if the run has fewer)."""
    from node.fraudproof import round_factors_bits

    rounds = schedule_rounds(diloco_cfg)
    if max_rounds:
        rounds = min(rounds, max_rounds)
    return Schedule(tuple(round_factors_bits(diloco_cfg, t) for t in range(rounds)))


def genesis_states(cfg) -> list:
    """Each stage's state before round 0 (``node.fraudproof.initial_state``): the initial weights of the
    run's model and seed, zero outer momentum; as training and ``audit`` build round 0's start."""
    from node.fraudproof import initial_state
    from training.diloco import zero_outer_state
    from training.model import init_state_dict
    from training.stages import split_stages, stage_param_names

    full = init_state_dict(cfg.model, cfg.training.seed)
    states = []
    for stage, spec in enumerate(split_stages(cfg.model.n_layer, cfg.pipeline.num_stages)):
        weights = {name: full[name] for name in stage_param_names(cfg.model, spec)}
        states.append(initial_state(stage, weights, zero_outer_state(cfg.diloco, weights)))
    return states


def genesis_root(cfg) -> bytes:
    """The run's genesis root (``RunParams.genesisRoot``): the root over :func:`genesis_states`' leaves."""
    return chunked_weights_root([state.leaf() for state in genesis_states(cfg)])


def run_values(cfg, max_rounds: int | None = None) -> dict:
    """The per-round values of ``RunParams`` (``RunParams.VALUES`` by name) of a node configuration's run
    (``max_rounds``: the run's, default the configuration's ``rounds``); ``{}`` for a hashed run."""
    from training.chunks import float64_bits

    if not cfg.commitment_scheme.chunked:
        return {}
    schedule = schedule_of(cfg.diloco, cfg.rounds if max_rounds is None else max_rounds)
    return {"schedule_root": schedule.root, "schedule_rounds": schedule.rounds,
            "nesterov": bool(cfg.diloco.nesterov),
            "norm_clip_bits": float64_bits(float(cfg.diloco.norm_clip)),
            "genesis_root": genesis_root(cfg), "max_contributions": DEFAULT_MAX_CONTRIBUTIONS,
            "max_rank": DEFAULT_MAX_RANK}


def max_game_steps(cfg) -> int:
    """``RunParams.max_game_steps`` of the run ``cfg`` describes (issue 62): the bisection of its largest
    stage's chunks (training/chunks.py) and a few steps more (ledger.runparams.game_steps_for)."""
    from ledger.runparams import game_steps_for

    return game_steps_for(largest_stage_chunks(cfg))


def largest_stage_chunks(cfg) -> int:
    """The chunks (training/chunks.py CHUNK_ELEMENTS each, per tensor) of the run's largest stage."""
    from math import prod

    from training.chunks import CHUNK_ELEMENTS
    from training.stages import split_stages, stage_param_shapes

    def chunks(shapes) -> int:
        return sum(-(-prod(shape) // CHUNK_ELEMENTS) for shape in shapes.values())

    specs = split_stages(cfg.model.n_layer, cfg.pipeline.num_stages)
    return max(chunks(stage_param_shapes(cfg.model, spec)) for spec in specs)


def check_run_values(cfg, on_chain: dict, max_rounds: int | None = None) -> list[str]:
    """Why an honest node must not join, or sign in, the run whose chain binds ``on_chain``
    (``RunParams.VALUES`` by name, and ``max_game_steps`` where known: :func:`values_of` of a RunInfo) for
    the run document ``cfg``:
    :func:`unprovable_values` (a part of the fraud proof the chain makes impossible, issue 79) and
    :func:`other_values` (values other than the document's: its honest rounds would be proven wrong). Empty:
    the node may join. A hashed run (version 1) binds none and proves nothing by design: empty."""
    if not cfg.commitment_scheme.chunked:
        return []
    return unprovable_values(cfg, on_chain) + other_values(cfg, on_chain, max_rounds)


def other_values(cfg, on_chain: dict, max_rounds: int | None = None) -> list[str]:
    """What differs between the values ``on_chain`` binds and the run document's (empty: they agree; values
    the chain leaves unbound are :func:`unprovable_values`' and not compared here)."""
    mine = run_values(cfg, max_rounds)
    if not mine:
        return []
    names = []
    if on_chain.get("schedule_rounds"):
        names += ["schedule_rounds", "schedule_root", "nesterov", "norm_clip_bits"]
    if on_chain.get("genesis_root", bytes(32)) != bytes(32):
        names.append("genesis_root")
    return [f"{name}: the chain binds {_shown(on_chain.get(name))}, the run document gives "
            f"{_shown(mine[name])}" for name in names if on_chain.get(name) != mine[name]]


def unprovable_values(cfg, on_chain: dict) -> list[str]:
    """The parameters of a chunked run (``on_chain``, as :func:`check_run_values` takes them) that make a part
    of the fraud proof impossible, one message each naming the parameter (issue 79): no schedule (no round's
    outer step can be proven wrong), no genesis root (round 0 cannot), fewer contributions than an honest
    round lists, a rank below the decoder's, a proof whose gas or calldata bound exceeds what a proof may use,
    a game too short to reach a chunk of the run's largest stage. Empty for a hashed run."""
    from ledger.runparams import PROOF_MAX_CALLDATA, PROOF_MAX_GAS, game_steps_for, proof_cost
    from training.config_base import MAX_LISTED

    if not cfg.commitment_scheme.chunked:
        return []
    problems = []
    if not on_chain.get("schedule_rounds"):
        problems.append("schedule_rounds: the chain binds no schedule (0): no round's outer step (lr, "
                        "momentum, Nesterov flag, norm clip) can be proven wrong")
    if on_chain.get("genesis_root", bytes(32)) == bytes(32):
        problems.append("genesis_root: the chain binds none (zero): round 0 cannot be proven wrong")
    most = on_chain.get("max_contributions", 0)
    if most < MAX_LISTED:
        problems.append(f"max_contributions: the chain allows {most}, fewer than the {MAX_LISTED} an honest "
                        "round may list")
    rank = on_chain.get("max_rank", DEFAULT_MAX_RANK)
    if 0 < rank < DEFAULT_MAX_RANK:  # the chain checks it in every chunked run, bound or not
        problems.append(f"max_rank: the chain allows rank {rank}, below the decoder's {DEFAULT_MAX_RANK}: a "
                        "contribution of a rank between them decodes here, and an honest round that accepted "
                        "it would be proven wrong")
    gas, size = proof_cost(most, rank)
    if gas > PROOF_MAX_GAS or size > PROOF_MAX_CALLDATA:
        problems.append(f"max_contributions: a proof of {most} contributions at rank {rank} may need {gas:,} "
                        f"gas and {size:,} bytes, above the {PROOF_MAX_GAS:,} gas and {PROOF_MAX_CALLDATA:,} "
                        "bytes a proof may use: it could not be sent")
    steps = on_chain.get("max_game_steps")
    if steps is not None:
        chunks = largest_stage_chunks(cfg)
        needed = game_steps_for(chunks)
        if steps < needed:
            problems.append(f"max_game_steps: the chain allows {steps} steps per game, fewer than the "
                            f"{needed} a stage of {chunks:,} chunks needs: a game could not reach the "
                            "differing chunk")
    return problems


def values_of(info) -> dict:
    """The per-round values of a :class:`ledger.runparams.RunInfo` by name, and its ``max_game_steps``."""
    from ledger.runparams import RunParams

    values = {name: getattr(info, name) for name in RunParams.VALUES}
    if getattr(info, "max_game_steps", None) is not None:
        values["max_game_steps"] = info.max_game_steps
    return values


def _shown(value) -> str:
    return "0x" + value.hex() if isinstance(value, bytes) else repr(value)
