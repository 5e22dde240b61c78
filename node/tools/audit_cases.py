"""The contribution cases an audit leads to (issue 78; docs/FRAUD_PROOF.md "The command").

``audit --reexecute`` reruns contributions by (round, replica). Every contribution it found wrong, or could
not rerun, is named here stage by stage, with the ``dlx-node challenge`` command that opens a case against it
(node/commands/challenge.py), or with why none can be opened. A case names a contribution by its round, stage
and index among the stage's listed contributions (the version-3 factors' order); the audit finds the index
from the factors the archives kept (``<data_dir>/rewards/``, node/store/rewardsources.py, each checked
against the chain's record): the contribution's envelope digest among the factors' ``envelopes``. A
contribution the factors do not list was left out of the aggregate (it changed nothing on chain), and round 0
starts from the run's genesis, which the command does not open; a run with no step program takes no case
(``ProverStepNoProgram``).

A contribution found wrong gets the command with ``--open`` (it bonds the run's bond and opens the case); one
not rerun is not known wrong, so its command shows the case and opening it is left to the reader: a case
against an honest contribution that nobody defends in time overturns an honest round (docs/FRAUD_PROOF.md,
"Not done", 5).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

#: A lead's finding: the rerun did not reproduce it, or it was not rerun (inputs missing, undecided).
WRONG, NOT_RERUN = "wrong", "not rerun"


@dataclass
class CaseLead:
    """One contribution of one stage the audit found wrong or could not rerun, and the case against it."""

    round: int
    stage: int
    replica: int
    envelope: str  # sha256 hex of its envelope (the contributions root's leaf)
    finding: str  # WRONG or NOT_RERUN
    reason: str
    index: int | None = None  # its place among the stage's listed contributions (the factors' order)
    payload_root: str = ""
    command: str = ""  # the dlx-node challenge command that opens a case against it
    no_case: str = ""  # why no command: it opens no case, or the archives cannot name it

    def line(self) -> str:
        head = (f"case lead: round {self.round} stage {self.stage} replica {self.replica} ({self.finding}: "
                f"{self.reason})")
        if self.command:
            return f"{head}: contribution {self.index}: {self.command}"
        return f"{head}: no case: {self.no_case}"


@dataclass
class Pending:
    """What the reruns found of one (round, replica): the stages they blame (empty: all of the replica's)."""

    round: int
    replica: int
    finding: str
    reason: str
    stages: tuple[int, ...] = ()


def case_leads(pending: list[Pending], sealed: dict, directories, reader, run_id: int,
               config: str = "node.toml") -> list[CaseLead]:
    """The leads of ``pending`` (module docstring): one per sealed contribution of each (round, replica) in
    the stages it blames. ``sealed``: the archives' round -> [stage, replica, peer, envelope hex];
    ``directories``: the node directories the audit read (their rewards/ factors; empty when it read the
    run's peers); ``reader``: a LedgerClient (None: the chain is not asked, no command is given)."""
    if not pending:
        return []
    directories = [str(Path(d).resolve()) for d in directories or ()]
    sources, no_program = {}, ""
    if reader is not None:
        no_program = _no_program(reader, run_id)
        if directories:
            from node.store.rewardsources import read_sources

            sources = read_sources(directories, reader, run_id)
    leads = []
    for item in pending:
        entries = sorted((int(e[0]), str(e[3])) for e in sealed.get(item.round, [])
                         if int(e[1]) == item.replica and (not item.stages or int(e[0]) in item.stages))
        for stage, envelope in entries:
            lead = CaseLead(item.round, stage, item.replica, envelope, item.finding, item.reason)
            _name(lead, sources, directories, no_program, reader, config)
            leads.append(lead)
    return leads


def _name(lead: CaseLead, sources: dict, directories: list[str], no_program: str, reader,
          config: str) -> None:
    """Fill ``lead``'s index, payload root and command, or its ``no_case``."""
    from ledger.chunkproof import Factors
    from ledger.errors import LedgerInputError

    if lead.round < 1:
        lead.no_case = "round 0 starts from the run's genesis, which a case does not open yet"
        return
    if reader is None:
        lead.no_case = "the chain was not read"
        return
    missing = [r for r in (lead.round - 1, lead.round) if r not in sources]
    if missing:
        where = "the archives" if directories else "no --archive (the reruns read the run's peers)"
        rounds = ", ".join(map(str, missing))
        lead.no_case = (f"{where}: no stage leaves of round(s) {rounds} the chain vouches for (a node of a "
                        "version-3 run keeps them in <data_dir>/rewards/)")
        return
    kept = sources[lead.round][1]
    raw = kept[lead.stage] if lead.stage < len(kept) else None
    if raw is None:
        lead.no_case = f"the archives kept no factors of round {lead.round} stage {lead.stage}"
        return
    try:
        factors = Factors.decode(raw)
    except LedgerInputError as exc:
        lead.no_case = f"round {lead.round} stage {lead.stage}'s factors do not decode ({exc})"
        return
    digest = bytes.fromhex(lead.envelope)
    if digest not in factors.envelopes:
        lead.no_case = "the round's factors do not list it: it was left out of the aggregate"
        return
    lead.index = factors.envelopes.index(digest)
    lead.payload_root = factors.payload_roots[lead.index].hex()
    if factors.norms is None:
        lead.no_case = "a version-2 round binds no contribution to its member: no case"
    elif no_program:
        lead.no_case = no_program
    else:
        # a contribution not rerun is not known wrong: its command shows the case, --open is the reader's call
        lead.command = challenge_command(lead.round, lead.stage, lead.index, config, directories,
                                         open_=lead.finding == WRONG)


def _no_program(reader, run_id: int) -> str:
    """Why run ``run_id`` takes no case on the ledger's StepProver ("" if it takes them)."""
    from ledger.stepcase import ledger_step_prover
    from ledger.stepproof import StepProverClient

    try:
        address = ledger_step_prover(reader.w3, reader.ledger_address)
        program = StepProverClient(reader.w3, address).program_of(run_id)
    except Exception as exc:  # noqa: BLE001 - an older deployment or a chain that does not answer: said so
        logger.debug("the run's step program not read: %s", exc)
        return f"the ledger's step prover did not answer ({type(exc).__name__}): no case known to be possible"
    if program == bytes(32):
        return ("the run set no step program, so the ledger takes no case against its contributions "
                "(ProverStepNoProgram)")
    return ""


def challenge_command(round_: int, stage: int, index: int, config: str = "node.toml",
                      archives: list[str] | tuple = (), open_: bool = True) -> str:
    """The command that opens a case against contribution ``index`` of ``stage`` in round ``round_``, reading
    the rounds' factors from the node directory of ``config`` and ``archives`` (quoted for a shell)."""
    import shlex

    parts = ["dlx-node", "challenge", "--config", config, "--round", round_, "--stage", stage,
             "--contribution", index]
    for directory in archives:
        parts += ["--archive", directory]
    return " ".join(shlex.quote(str(part)) for part in [*parts, *(["--open"] if open_ else [])])


def print_leads(leads: list[CaseLead]) -> None:
    """The leads as the audit prints them, one line each, and how many commands."""
    for lead in leads:
        print(lead.line())
    if leads:
        opened = sum(bool(lead.command) for lead in leads)
        print(f"case leads: {len(leads)} contribution(s) wrong or not rerun, {opened} with a challenge "
              "command (run it from the directory of your node.toml; --open bonds the run's bond: a "
              "contribution not rerun is not known wrong)")
