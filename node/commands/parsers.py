"""The ``dlx-node`` command table: the argument parser of every subcommand (node/cli.py parses with it;
node/commands/faces.py maps each command to what it does). Light: no torch, libp2p or web3 here.
"""

from __future__ import annotations

import argparse

from node.commands.rundocs import PEER_WAIT_S


def _seconds(text: str) -> float:
    """A command line's duration: a finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number of seconds >= 0")
    return value


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", default="node.toml", help="node configuration file (TOML)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one setting, e.g. --set diloco.inner_steps=50 (repeatable)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dlx-node",
        description="Verifiable decentralized training: DiLoCoX over libp2p with an EVM ledger.",
    )
    _add_logging_args(parser, default=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_init_and_start(sub)
    _add_join(sub)
    _add_demo(sub)

    from node.commands.data import add_parser as add_data_parser
    from node.commands.explorer import add_parser as add_explorer_parser
    from node.commands.member import add_parsers as add_member_parsers
    from node.commands.organize import add_parsers as add_organizer_parsers
    from node.commands.challenge import add_parser as add_challenge_parser
    from node.commands.rewards import add_parser as add_rewards_parser

    add_data_parser(sub)
    add_organizer_parsers(sub)
    add_member_parsers(sub)
    add_rewards_parser(sub)
    add_challenge_parser(sub)
    p = sub.add_parser("status", help="what a running node is doing")
    p.add_argument("--data-dir", default=".", help="the node's data directory")
    p.add_argument("--json", action="store_true", help="print the raw status record")
    _add_audit_and_pull(sub)
    add_explorer_parser(sub)
    _logging_args_after_commands(parser)
    return parser


def _add_logging_args(parser: argparse.ArgumentParser, default: bool) -> None:
    """The logging options: the top parser's set the defaults; a command's (``default=False``) leave them
    unset unless given, so ``dlx-node start --config X --log-file F`` means what ``dlx-node --log-file F
    start --config X`` does."""
    def value(fallback):
        return fallback if default else argparse.SUPPRESS

    parser.add_argument("--log-level", default=value("info"), choices=["debug", "info", "warning", "error"])
    parser.add_argument("--log-json", action="store_true", default=value(False),
                        help="structured (JSON lines) logs on stderr")
    parser.add_argument("--log-file", default=value(None), help="write logs to this file instead of stderr")


def _logging_args_after_commands(parser: argparse.ArgumentParser) -> None:
    """Every command (and subcommand, e.g. ``data fetch``) takes the logging options after its name too."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                _add_logging_args(command, default=False)
                _logging_args_after_commands(command)


def _add_init_and_start(sub) -> None:
    p = sub.add_parser("init", help="create the identity key, Ethereum account and a commented node.toml")
    p.add_argument("--data-dir", default=".", help="directory for keys, state and node.toml")
    acct = p.add_mutually_exclusive_group()
    acct.add_argument("--dev-account", type=int, default=None, metavar="N",
                      help="use well-known local dev key N (local chains only)")
    acct.add_argument("--password-file", default=None,
                      help="create an encrypted keystore protected by the password in this file")
    p.add_argument("--force", action="store_true",
                   help="overwrite an existing node.toml (keys are never overwritten)")

    p = sub.add_parser("start", help="run a node: train, exchange, commit, checkpoint")
    _add_config_args(p)
    p.add_argument("--no-progress", action="store_true", help="no live progress line (logs only)")
    p.add_argument("--yes", "-y", action="store_true",
                   help="agree beforehand to registering and staking if the node holds no seat yet (else "
                        "asked on the terminal; without one, refused)")
    p.add_argument("--chain-wait", type=_seconds, default=None, metavar="SECONDS",
                   help="how long to wait for a chain that does not answer (default: 30 s on a node's first "
                        "start, ledger.startup_wait on a restart); a line says so every few seconds")


def _add_join(sub) -> None:
    p = sub.add_parser("join", help="join a running run from its link: fetch and check its settings, write "
                                    "node.toml, register and stake (after asking), start")
    p.add_argument("link", nargs="?", default="",
                   help="run link dlx://<chain_id>/<ledger>/<run_id>?rpc=<url>&peer=<multiaddr> (printed by "
                        "'dlx-node demo'); or give --rpc, --ledger, --run and --bootstrap")
    p.add_argument("--rpc", default="", help="chain JSON-RPC URL (overrides the link's)")
    p.add_argument("--ledger", default="", help="TrainingLedger address (without a link)")
    p.add_argument("--run", type=int, default=None, help="run id (without a link)")
    p.add_argument("--bootstrap", action="append", default=[], help="peer multiaddr of the run (repeatable)")
    p.add_argument("--data-dir", default="dlx-node", help="directory for keys, state and node.toml (created)")
    p.add_argument("--identity", default="", metavar="KEY_FILE",
                   help="the node key to use (copied into --data-dir): the identity.key of this account's "
                        "node directory of another run (an account registers one key)")
    acct = p.add_mutually_exclusive_group()
    acct.add_argument("--password-file", default=None,
                      help="password of the account's keystore (created in the data directory if --keystore "
                           "is not given and none exists yet)")
    acct.add_argument("--dev-account", type=int, default=None, metavar="N",
                      help="use well-known local dev key N (local chains only)")
    p.add_argument("--keystore", default="", help="an existing encrypted keystore (with --password-file)")
    p.add_argument("--data", default="", metavar="PATH",
                   help="the run's training text or prepared dataset directory, when it is not the generated "
                        "corpus (checked against the run document: sha256, or the manifest "
                        "root and every shard)")
    p.add_argument("--tokenizer", default="", metavar="FILE",
                   help="the run's tokenizer.json when it is not byte-level (checked by sha256; default: the "
                        "dataset's, else fetched from the run's peers)")
    p.add_argument("--cluster", default="", help="cluster name (default: a new one of this node alone)")
    p.add_argument("--listen-host", default="",
                   help="p2p listen address (default: 127.0.0.1 for a loopback run, else 0.0.0.0)")
    p.add_argument("--listen-port", type=int, default=0, help="p2p listen port (0 = any free port)")
    p.add_argument("--yes", "-y", action="store_true",
                   help="agree beforehand to registering and staking (else asked on the terminal)")
    p.add_argument("--force", action="store_true", help="rewrite an existing node.toml of another run")
    p.add_argument("--no-start", action="store_true",
                   help="stop after writing node.toml and joining on chain")
    p.add_argument("--peer-wait", type=_seconds, default=PEER_WAIT_S, metavar="SECONDS",
                   help="how long to dial the run's peers again while none answers, e.g. right after the "
                        f"organizer's start (default {PEER_WAIT_S:.0f}; a line says so at each try)")
    p.add_argument("--no-progress", action="store_true",
                   help="no live progress line once started (logs only)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one node setting in the node.toml written, e.g. --set round_timeout=60")


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="local multi-node training run on a managed local chain")
    p.add_argument("--data", default="",
                   help="text file or prepared dataset directory ('dlx-node data prepare') "
                                               "to train on (default: a corpus the project generates)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--attest-quorum", type=int, default=2, metavar="K",
                   help="member signatures every round's on-chain record needs (the run's k)")
    p.add_argument("--weak-run", action="store_true",
                   help="allow --attest-quorum 1 or --stake 0: one member then commits and slashes alone")
    p.add_argument("--allow-unpaid-proofs", action="store_true",
                   help="run even when k x stake / 2 does not cover a prover's worst-case gas at 10x the "
                        "chain's gas price: a wrong round may then stand with nobody paid to prove it")
    p.add_argument("--stake", type=float, default=1.0, metavar="ETH",
                   help="stake each member puts into the run (slashed for equivocation)")
    p.add_argument("--pool", type=float, default=0.01, metavar="ETH", dest="pool_eth",
                   help="the run's reward pool pays ETH a final round to its contributors and attesters, "
                        "funded for every round (0: no pool; docs/REWARDS.md)")
    p.add_argument("--inner-steps", type=int, default=20,
                   help="H: the inner steps of a round (with --round-budget, the most a round may train)")
    p.add_argument("--round-budget", type=float, default=0.0, metavar="S",
                   help="bound each round by S seconds (a replica's inner steps and its own work around "
                        "them, not its waits for peers): every replica trains what fits and declares it "
                        "(diloco.round_budget_s; default 0: fixed H)")
    p.add_argument("--min-inner-steps", type=int, default=None, metavar="N",
                   help="with --round-budget: the fewest inner steps of a round (default: one more than the "
                        "exchange overlaps)")
    p.add_argument("--throttle", type=float, default=None, metavar="CPUS",
                   help="limit the last replica's node processes to CPUS CPUs (a cgroup v1 cpu quota: a slow "
                        "contributor; needs root)")
    p.add_argument("--spot-checks", type=float, default=None, metavar="X",
                   help="expected re-executions of each contribution by other members (the nodes' "
                        "spot_checks; default the node's, 0.06)")
    p.add_argument("--preset", default="mini",
                   choices=["tiny", "mini", "small", "llama-tiny", "llama-mini", "llama-20m", "llama-60m",
                            "llama-124m", "llama-350m", "llama-1b"])
    p.add_argument("--init-from", default="", metavar="DIR",
                   help="start from a Hugging Face model directory (Llama, Qwen2, Mistral or GPT-2; "
                        "--preset is then unused): README 'Start from a model'")
    p.add_argument("--checkpoint-every", type=int, default=2)
    p.add_argument("--out", default="dlx-demo", help="working directory for node data, logs and checkpoints")
    p.add_argument("--timeout", type=float, default=1800.0, help="give up after this many seconds")
    p.add_argument("--keep", action="store_true",
                   help="after training, keep the chain running (for audit/pull) until Ctrl-C")
    p.add_argument("--no-reference", dest="reference", action="store_false",
                   help="skip training the centralized (DDP) reference the summary compares against")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="one more run or node setting of every node, after the demo's own, e.g. --set "
                        "training.reproducible=true (docs/REPRODUCIBLE.md)")


def _add_audit_and_pull(sub) -> None:
    for name, helptext in (
        ("audit", "re-derive a run's training history from the chain and archived contributions"),
        ("pull", "download a published checkpoint, verify it against the chain, write a transformers dir"),
    ):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("link", nargs="?", default="",
                       help="run link dlx://<chain_id>/<ledger>/<run_id>?rpc=...&peer=... (as for join); or "
                            "give --rpc, --run and --deployment (or --registry and --ledger)")
        p.add_argument("--rpc", default="", help="JSON-RPC URL of the chain, e.g. http://127.0.0.1:8545")
        p.add_argument("--run", type=int, default=None, help="run id")
        p.add_argument("--ledger", default="", help="TrainingLedger address (default: from --deployment)")
        p.add_argument("--registry", default="", help="NodeRegistry address (default: from --deployment)")
        p.add_argument("--deployment", default="", help="deployment.json written by 'dlx-node demo'")
        p.add_argument("--bootstrap", action="append", default=[],
                       help="peer multiaddr to fetch from (repeatable)")
        if name == "audit":
            p.add_argument("--archive", action="append", default=[],
                           help="local archive directory (a node's data dir) to read contributions from")
            p.add_argument("--json", dest="json_out", default="", help="write the report as JSON here")
            p.add_argument("--html", dest="html_out", default="", help="write an HTML report here")
            p.add_argument("--no-replay", action="store_true", help="skip the bit-exact weights replay")
            p.add_argument("--pool", default="", metavar="ADDRESS",
                           help="the run's RewardPool: recompute its books from its events and the record "
                                "(default: deployment.json's reward_pool, if any)")
            p.add_argument("--reexecute", default="0", metavar="N",
                           help="rerun N sampled contributions (or 'all') and every ejection's evidence from "
                                "the archives' start states, or without --archive from what the run's peers "
                                "serve (a run link or --bootstrap; docs/AUDIT.md, 'Re-execution')")
            p.add_argument("--processes", default="1", metavar="N",
                           help="processes a rerun may use: a contribution of a node of N <= this many "
                                "processes (compute.processes) reruns on N ranks, bit for bit; others in "
                                "one process (docs/CLUSTER.md, 'Re-execution')")
            p.add_argument("--data", default="", metavar="FILE|DIR",
                           help="the run's training text or prepared dataset directory (the run document "
                                "names its sha256 or manifest root): screened rounds and reruns read their "
                                "batches from it as nodes do; without it they are unverifiable")
        else:
            p.add_argument("--round", type=int, default=-1, help="checkpoint round (default: latest final)")
            p.add_argument("--pending", action="store_true",
                           help="also take a round still inside its dispute window (not final: a member may "
                                "still dispute it); by default only final rounds are installed")
            p.add_argument("--archive", action="append", default=[],
                           help="local directory holding checkpoint files to read instead of peers")
            p.add_argument("out_dir", help="output directory for the transformers model")
