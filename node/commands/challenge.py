"""``dlx-node challenge``: a contribution case (issue 78; docs/FRAUD_PROOF.md "The contribution case") against
one contribution a committed round lists: show it, open it (``--open``: commit, then open a block later, the
run's bond sent) and overturn the round once every claim on it is refuted or none was made (``--overturn``).

The contribution is named by its round, stage and index among the stage's listed contributions; the round's
and the previous round's stage leaves and factors come from what the node directory kept
(node/store/rewardsources.py, checked against the chain's record): what binds the case to the record
(ledger.stepbinding.bind_run). The account, chain and run are the node.toml's (``--config``).
"""

from __future__ import annotations

import argparse

from node.commands.chainops import Spend, add_fee_args, agree, check_funds
from node.errors import ConfigError
from node.tools.audit_cases import challenge_command  # noqa: F401 - the command line of a case, here too


def add_parser(sub) -> None:
    p = sub.add_parser("challenge", help="a contribution case against one listed contribution: show it, "
                                         "--open it, --overturn its round once it is won")
    p.add_argument("--config", "-c", default="node.toml",
                   help="the node.toml of the account that opens or pays (its chain and run)")
    p.add_argument("--round", type=int, required=True, help="the round that lists the contribution")
    p.add_argument("--stage", type=int, default=0, help="its stage (default 0)")
    p.add_argument("--contribution", type=int, required=True, metavar="INDEX",
                   help="its index among the stage's listed contributions (the factors' order)")
    p.add_argument("--open", action="store_true",
                   help="commit and open a case (bonds the run's bond; listed and agreed first)")
    p.add_argument("--overturn", action="store_true",
                   help="overturn the round: the case is won (every claim refuted, or none made, by its "
                        "deadline)")
    p.add_argument("--archive", action="append", default=[], metavar="DIR",
                   help="another node directory (or a copy of one) whose rewards/ kept the rounds' stage "
                        "leaves and factors (as audit --archive; the chain vouches for what is read)")
    add_fee_args(p)


def run_challenge(args: argparse.Namespace) -> int:
    """``dlx-node challenge``."""
    from node.commands.member import member_chain

    if args.round < 1:
        raise ConfigError(f"--round {args.round}: round 0 starts from the run's genesis, which this command "
                          "does not open yet: a round >= 1")
    chain, run_id, _seat = member_chain(args)
    try:
        client = chain.client
        subject = _subject(args.config, client, run_id, args.round, args.stage, args.contribution,
                           args.archive)
        prover = _prover(client)
        if args.open:
            _open(client, prover, run_id, subject, args.yes)
        if args.overturn:
            record = client.commit_record(run_id, args.round)
            key = prover.functions.contributionOf(*subject.fields()[:4]).call()
            client.sender.transact(prover, "overturnContribution", (key, list(record.attesters)),
                                   "overturnContribution")
            print(f"overturned round {args.round} of run {run_id}: its attesters are slashed")
        _show(client, prover, run_id, subject)
    finally:
        chain.close()
    return 0


def _subject(config: str, client, run_id: int, round_: int, stage: int, index: int, archives=()):
    """The case's subject (ledger.stepbinding.RunSubject) from the kept stage leaves and factors of rounds
    ``round_`` and ``round_ - 1`` (the node directory's and ``archives``'); ConfigError naming what is
    missing."""
    from node.casesubject import kept_case
    from node.config import load_config

    return kept_case([load_config(config).path("."), *archives], client, run_id, round_, stage).subject(index)


def _prover(client):
    import contracts
    from ledger.stepcase import ledger_step_prover

    address = ledger_step_prover(client.w3, client.ledger_address)
    return client.w3.eth.contract(address=address, abi=contracts.artifact("StepProver")["abi"])


def _open(client, prover, run_id: int, subject, yes: bool) -> None:
    """Commit the case, then open it in a later block with the run's bond; listed and agreed first. The salt
    is the account's own (``case_salt``), so a rerun after a commit whose opening did not follow opens it."""
    from ledger.stepcase import run_stake
    from node.casesubject import OPEN_GAS, case_commitment, open_case

    stake = run_stake(client.w3, client.ledger_address, run_id)
    commitment = case_commitment(client, prover, subject)
    committed_at = prover.functions.caseCommittedAt(commitment).call()
    what = f"commit a case against contribution {subject.payload_root.hex()[:12]} of round {subject.round}"
    data = prover.encode_abi("commitCase", args=[commitment])
    gas, fees = client.sender.estimate({"to": prover.address, "value": 0, "data": data}, what)
    plan = ([] if committed_at else [Spend(what, gas, fees["maxFeePerGas"])]) + [
        Spend("open it (the run's bond)", OPEN_GAS, fees["maxFeePerGas"], stake)]
    check_funds(client.balance(), client.address, plan)
    agree(plan, yes, "opening the case")
    open_case(client, prover, subject, stake)
    print(f"opened a case against contribution {subject.payload_root.hex()} (round {subject.round}, stage "
          f"{subject.stage}) of run {run_id}, bond {stake / 1e18:.9f} ETH")


def _show(client, prover, run_id: int, subject) -> None:
    key = prover.functions.contributionOf(*subject.fields()[:4]).call()
    names = ("opener", "deadline", "claims", "refuted", "ends", "round", "runId", "stake")
    case = dict(zip(names, prover.functions.caseOf(key).call()))
    block = client.w3.eth.block_number
    print(f"contribution {subject.payload_root.hex()} (run {run_id}, round {subject.round}, stage "
          f"{subject.stage}): case key 0x{bytes(key).hex()}")
    if int(case["opener"], 16) == 0:
        print("no case open")
        return
    print(f"case opened by {case['opener']}: claims {case['claims']}, refuted {case['refuted']}; claims "
          f"taken until block {case['deadline']}, a standing claim dismisses it from block {case['ends']} "
          f"(now {block})")
    if block + 1 >= case["deadline"] and case["claims"] == case["refuted"]:
        print("won: every claim refuted (or none made); overturn: the same command with --overturn")
