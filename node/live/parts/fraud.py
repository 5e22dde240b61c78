"""A chunked run's fraud-proof parts, built from the node's base and their collaborators
(node/live/assembly.py calls these; docs/FRAUD_PROOF.md)."""

from __future__ import annotations

from node.live.chain.onchain import NodeChain
from node.live.fraud.chunkstate import CHUNK_STATES_DIR, ChunkedStates
from node.live.fraud.window import DisputeWindow
from node.live.fraud.contribution_binding import ContributionBinder
from node.live.fraud.dataside import NodeData
from node.live.fraud.defender import CaseDefender
from node.live.fraud.defensefiles import DEFENSE_DIR, DefenseFiles
from node.live.fraud.opener import CaseOpener
from node.live.fraud.prover import PROOFS_DIR, FraudProver
from node.live.state.base import NodeBase
from node.stepprogram import StepProgram
from node.store.rewardsources import REWARD_SOURCES_DIR
from p2p.host import P2PHost


def build_binder(base: NodeBase, *, chain: NodeChain) -> ContributionBinder | None:
    """A version-3 run's binding of contributions to members (issue 62); None in another run."""
    if not base.cfg.commitment_scheme.proves_factors:
        return None
    return ContributionBinder(run_id=base.run_id, chain=chain, diloco=base.cfg.diloco,
                              refuse_raw=base.cfg.compression.enabled)


def build_chunked_states(base: NodeBase, *, chain: NodeChain, host: P2PHost) -> ChunkedStates | None:
    """A chunked run's stage states (published to provers); None in a run that is not chunked."""
    if not base.cfg.commitment_scheme.chunked:
        return None
    return ChunkedStates(cfg=base.cfg, host=host, layout=base.layout, config_hash=base.config_hash,
                         window=DisputeWindow(chain, base.run_id), spill_dir=base.data_dir / CHUNK_STATES_DIR,
                         evidence_dir=base.evidence_dir, sources_dir=base.data_dir / REWARD_SOURCES_DIR,
                         keeps_starts=bool(base.cfg.ledger.step_program))


def build_fraud_prover(base: NodeBase, *, chain: NodeChain,
                       states: ChunkedStates | None) -> FraudProver | None:
    """The prover of a chunked run's wrong rounds (None without ``states``: a run that is not chunked)."""
    if states is None:
        return None
    return FraudProver(run_id=base.run_id, chain=chain, book=base.book, states=states,
                       stages=base.station.held_stages, num_stages=base.cfg.pipeline.num_stages,
                       stop=base.stop, proofs_dir=base.data_dir / PROOFS_DIR,
                       schedule=run_schedule(base.cfg, chain.run_info(base.run_id)))


def run_schedule(cfg, info):
    """The run's committed outer schedule (ledger.runvalues.Schedule) if its chain binds one (issue 62; the
    node checked at joining that it is its document's), else None."""
    from node.commitments.values import schedule_of

    return schedule_of(cfg.diloco, info.max_rounds) if getattr(info, "schedule_rounds", 0) else None


def build_case_defender(base: NodeBase, *, chain: NodeChain,
                        states: ChunkedStates | None) -> CaseDefender | None:
    """The defender of this node's contributions against contribution cases in a version-3 run (its factors
    name each contribution's signer); None in another run. Its program is ``ledger.step_program`` (none: a
    case on its work is logged as one it cannot answer; a program file that does not load stops the node
    here); its dataset, opened at the first case of a run whose data terms are fixed, draws its claims'
    batches."""
    if states is None or not base.cfg.commitment_scheme.proves_factors:
        return None
    path = base.cfg.ledger.step_program
    program = StepProgram.load(base.cfg.path(path)) if path else None
    return CaseDefender(run_id=base.run_id, chain=chain, states=states, program=program,
                        data_dir=base.data_dir, stop=base.stop,
                        files=DefenseFiles(base.data_dir / DEFENSE_DIR), data=NodeData.from_config(base.cfg))


def build_case_opener(base: NodeBase, *, chain: NodeChain) -> CaseOpener | None:
    """The follow-up of this node's accusations in a version-3 run (``ledger.open_cases``: open a contribution
    case where one was not convicted; off: log it); None in another run."""
    if not base.cfg.commitment_scheme.proves_factors:
        return None
    return CaseOpener(run_id=base.run_id, chain=chain, data_dir=base.data_dir,
                      num_stages=base.cfg.pipeline.num_stages, enabled=base.cfg.ledger.open_cases,
                      stop=base.stop)
