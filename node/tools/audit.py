"""``dlx-node audit``: re-derive a run's training history from the chain and the signed contributions.

An auditor trusts no node. It reads the run's record from the chain (an RPC URL
and the two contract addresses are all it needs) and checks, item by item:

1. **Chain** -- the contracts' bytecode against the committed build artifacts
   and the ledger's trusted registry; the commit hash chain link by link up to
   the contract's ``headOf(runId)``; every registration's ed25519 binding
   signature (the EVM cannot check it); that every committer held a valid
   registration at the commit's block.
2. **Run document** -- a copy whose sha256 is the chain's ``configHash`` (from an
   archive or fetched by that hash from peers); it pins the model, the seed and
   so the initial weights, and the DiLoCoX settings of the outer step.
3. **Each round t** -- the signed contribution envelopes (archives given with
   ``--archive`` and/or fetched by hash over libp2p from ``--bootstrap`` peers):
   their Merkle root in canonical order (stage, replica, peer id, hash) against
   the commit's ``contributionsRoot``; each envelope's signature, run, round,
   stage, replica, kind and that its signer's key is bound to a registered
   account; then the bit-exact replay of aggregation + outer step
   (:func:`training.diloco.aggregate`, DiLoCo Algorithm 1's outer step,
   arXiv 2311.08105) from the initial weights or from a published checkpoint,
   compared with the committed ``weightsRoot``.
4. **Each published checkpoint** -- the file's sha256 against the chain's content
   hash, its metadata, its weights against the commit of its round and, when
   the replay reached that round, against the replayed weights and momentum.

Every item ends as ``ok``, ``FAIL`` (with the reason) or ``unverifiable`` (with
the reason: the evidence was not available, e.g. an archive no peer serves any
more). Nothing that could not be checked is reported as ``ok``. See
docs/AUDIT.md.
"""

import hashlib
import itertools
import logging
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from node.errors import DLX_ERRORS, AuditFailed, StateError
from node.tools.pull import ArchiveSource, PeerSource, first_good_copy, reader_client
from node.tools.report import FAIL, OK, UNVERIFIABLE, AuditReport, Check, Contributor, RoundVerdict, worst

__all__ = [
    "FAIL",
    "OK",
    "UNVERIFIABLE",
    "AuditFailed",
    "AuditReport",
    "Check",
    "RoundVerdict",
    "audit_run",
    "run_audit",
    "worst",
]

logger = logging.getLogger(__name__)

MAX_COMBINATIONS = 64  # distinct per-stage contribution lists tried against one contributions root
CONTRIBUTION_KIND = "contribution"  # node.live.protocol.CONTRIBUTION (not imported: keeps this module light)
MAX_ENVELOPE_BYTES = 2 << 30

Progress = Callable[[int, int, str], None]



# ---------------------------------------------------------------------- chain checks
def _check_chain(client: Any, history: Any, report: AuditReport, check_code: bool) -> dict[str, list]:
    """Bytecode, hash chain, registrations and committers; return valid registrations by account."""
    import contracts
    from ledger.audit import verify_binding, verify_bytecode
    from ledger.errors import LedgerError
    from ledger.hashchain import genesis_head, next_head

    chain_id = report.chain_id
    if check_code:
        for name, address in (
            ("NodeRegistry", client.registry_address),
            ("TrainingLedger", client.ledger_address),
        ):
            try:
                verify_bytecode(client.w3, address, contracts.artifact(name))
                report.general.append(Check(f"bytecode {name} {address}", OK))
            except LedgerError as exc:
                report.general.append(Check(f"bytecode {name} {address}", FAIL, str(exc)))
        try:
            client.check_deployment()
            report.general.append(Check("ledger trusts registry", OK))
        except LedgerError as exc:
            report.general.append(Check("ledger trusts registry", FAIL, str(exc)))
    else:
        report.general.append(Check("contract bytecode", UNVERIFIABLE, "skipped on request"))

    run = history.run
    head = genesis_head(chain_id, client.ledger_address, run.run_id, run.config_hash)
    report.general.append(
        Check("genesis head", OK)
        if head == run.genesis_head
        else Check("genesis head", FAIL, f"event {run.genesis_head.hex()} != recomputed {head.hex()}")
    )

    valid: dict[str, list] = {}
    for registration in history.registrations:
        name = f"registration {registration.account} key {registration.pubkey.hex()[:16]} (block {registration.block_number})"
        if verify_binding(registration, chain_id, client.registry_address):
            valid.setdefault(registration.account, []).append(registration)
            report.general.append(Check(name, OK))
        else:
            report.general.append(
                Check(
                    name,
                    FAIL,
                    "ed25519 binding signature does not verify: the key never "
                    "signed this account's binding message (forged registration)",
                )
            )

    previous_round = None
    for record, verdict in zip(history.commits, report.rounds):
        commit = record.commit
        problems = []
        if previous_round is not None and commit.round <= previous_round:
            problems.append(f"committed after round {previous_round}")
        previous_round = commit.round
        head = next_head(head, commit, record.committer)
        if head != record.head_hash:
            problems.append(f"event head {record.head_hash.hex()} != recomputed {head.hex()}")
            head = record.head_hash  # resynchronise so one bad link is reported once
        verdict.checks.append(
            Check("hash chain link", FAIL, "; ".join(problems)) if problems else Check("hash chain link", OK)
        )
        in_force = any(
            r.block_number <= record.block_number
            and (r.unregistered_block is None or r.unregistered_block > record.block_number)
            for r in valid.get(record.committer, [])
        )
        verdict.checks.append(
            Check("committer registered", OK)
            if in_force
            else Check(
                "committer registered",
                FAIL,
                f"{record.committer} had no registration with a valid binding "
                f"signature at block {record.block_number}",
            )
        )
    report.general.append(
        Check("hash chain head", OK)
        if head == history.head_hash
        else Check(
            "hash chain head", FAIL, f"contract headOf {history.head_hash.hex()} != replayed {head.hex()}"
        )
    )
    return valid


# ---------------------------------------------------------------------- the run document
def _run_document(report: AuditReport, history: Any, sources: list) -> dict | None:
    from node.runconfig import parse_run_document

    expected = history.run.config_hash.hex()

    def getter(source: Any) -> bytes | None:
        if isinstance(source, PeerSource):
            return source.blob(expected)
        docs = source.run_documents()
        good = [d for d in docs if hashlib.sha256(d).hexdigest() == expected]
        return (good or docs or [None])[0]

    copy = first_good_copy(sources, getter, expected)
    if copy.data is None:
        if copy.bad:
            report.general.append(
                Check("run document", FAIL, "no copy hashes to the configHash: " + "; ".join(copy.bad))
            )
        else:
            report.general.append(
                Check(
                    "run document", UNVERIFIABLE, f"no archive or peer holds the run document {expected[:16]}"
                )
            )
        return None
    try:
        document = parse_run_document(copy.data, history.run.config_hash)
        stages, inner = document["pipeline"]["num_stages"], document["diloco"]["inner_steps"]
    except (*DLX_ERRORS, KeyError, TypeError) as exc:
        report.general.append(
            Check("run document", FAIL, f"hashes to the configHash but is not a valid run document: {exc}")
        )
        return None
    if (stages, inner) != (history.run.num_stages, history.run.inner_steps):
        report.general.append(
            Check(
                "run document",
                FAIL,
                f"says {stages} stages x H={inner}, the run was created "
                f"with {history.run.num_stages} x {history.run.inner_steps}",
            )
        )
        return None
    note = f" (corrupt copies ignored: {'; '.join(copy.bad)})" if copy.bad else ""
    report.general.append(Check("run document", OK, f"sha256 = configHash{note}" if note else ""))
    return document


# ---------------------------------------------------------------------- replay state
class _Replayer:
    """The global state of every stage, advanced round by round with the canonical aggregation."""

    def __init__(self, document: dict) -> None:
        from node.runconfig import node_config_from_run
        from training.stages import split_stages, stage_param_names

        self.cfg = node_config_from_run(document)
        self.num_stages = self.cfg.pipeline.num_stages
        specs = split_stages(self.cfg.model.n_layer, self.num_stages)
        self.names = [stage_param_names(self.cfg.model, spec) for spec in specs]
        self.weights: list[dict] | None = None
        self.momentum: list[dict] | None = None
        self.base = ""  # where the current state came from

    def start_from_initial(self) -> None:
        import torch

        from training.model import init_state_dict

        full = init_state_dict(self.cfg.model, self.cfg.training.seed)
        self.weights = [{n: full[n] for n in names} for names in self.names]
        self.momentum = [{n: torch.zeros_like(full[n]) for n in names} for names in self.names]
        self.base = "initial weights"

    def start_from_checkpoint(self, ckpt: Any) -> None:
        import torch

        self.weights, self.momentum = [], []
        for names in self.names:
            weights, momentum = ckpt.stage_state(names)
            self.weights.append({n: weights[n].to(torch.float32) for n in names})
            self.momentum.append({n: momentum[n].to(torch.float32) for n in names})
        self.base = f"checkpoint of round {ckpt.round}"

    def drop(self) -> None:
        self.weights = self.momentum = None

    def apply(self, round_index: int, payloads_by_stage: list[list[bytes]]) -> bytes:
        """Aggregate every stage of ``round_index``; return the new weights root."""
        from training.diloco import aggregate
        from training.hashing import weights_root

        hashes, new_weights, new_momentum = [], [], []
        for stage, payloads in enumerate(payloads_by_stage):
            weights, momentum, digest = aggregate(
                self.weights[stage],
                self.momentum[stage],
                payloads,
                self.cfg.diloco,
                stage_index=stage,
                outer_round=round_index,
            )
            new_weights.append(weights)
            new_momentum.append(momentum)
            hashes.append(digest)
        self.weights, self.momentum = new_weights, new_momentum
        return weights_root(hashes)


# ---------------------------------------------------------------------- one round's contributions
def _candidate_sets(
    sources: list, round_index: int, num_stages: int
) -> tuple[list[list[tuple[int, int, str, str]]], list[int]]:
    """Full canonical contribution lists to try (one distinct per-stage list per stage, combined), and the
    stages no source lists (then the evidence is incomplete and nothing is tried)."""
    per_stage: dict[int, list[tuple]] = {s: [] for s in range(num_stages)}
    for source in sources:
        try:
            lists = source.round_lists(round_index)
        except DLX_ERRORS as exc:
            logger.debug("%s: %s", source.name, exc)
            continue
        for entries in lists:
            for stage in range(num_stages):
                part = tuple(sorted(e for e in entries if e[0] == stage))
                if part and part not in per_stage[stage]:
                    per_stage[stage].append(part)
    unlisted = [s for s in range(num_stages) if not per_stage[s]]
    if unlisted:
        return [], unlisted
    combos = itertools.islice(itertools.product(*(per_stage[s] for s in range(num_stages))), MAX_COMBINATIONS)
    return [[e for part in combo for e in part] for combo in combos], []


def _contribution_root(entries: list[tuple[int, int, str, str]]) -> bytes:
    from ledger.merkle import merkle_root

    return merkle_root([bytes.fromhex(h) for _s, _r, _p, h in entries])


def _registered_key(valid: dict[str, list], pubkey: bytes, from_block: int, to_block: int) -> str | None:
    """The account whose valid registration binds ``pubkey`` and was in force during [from_block, to_block]."""
    for account, registrations in valid.items():
        for r in registrations:
            if (
                r.pubkey == pubkey
                and r.block_number <= to_block
                and (r.unregistered_block is None or r.unregistered_block > from_block)
            ):
                return account
    return None


def _check_contributions(
    verdict: RoundVerdict,
    record: Any,
    sources: list,
    num_stages: int,
    valid: dict[str, list],
    previous_block: int,
    run: Any,
    document: dict | None,
) -> list[list[bytes]] | None:
    """Contributions root and envelopes of one round; return the payloads per stage if all verified."""
    from p2p.envelope import decode_envelope
    from p2p.errors import EnvelopeRejected

    commit = record.commit
    candidates, unlisted = _candidate_sets(sources, commit.round, num_stages)
    if unlisted:
        what = (
            "this round's contributions"
            if len(unlisted) == num_stages
            else f"stage(s) {unlisted} of this round"
        )
        verdict.checks.append(Check("contributions root", UNVERIFIABLE, f"no archive or peer lists {what}"))
        return None
    entries = next((c for c in candidates if _contribution_root(c) == commit.contributions_root), None)
    if entries is None:
        got = _contribution_root(candidates[0]).hex()
        verdict.checks.append(
            Check(
                "contributions root",
                FAIL,
                f"Merkle root of the archived contributions is "
                f"{got}, chain says {commit.contributions_root.hex()}",
            )
        )
        return None
    verdict.checks.append(Check("contributions root", OK))
    verdict.contributors = [Contributor(s, r, p, h) for s, r, p, h in entries]

    # Structure: every stage aggregated something, one contribution per replica per stage.
    problems = []
    for stage in range(num_stages):
        replicas = [r for s, r, _p, _h in entries if s == stage]
        if not replicas:
            problems.append(f"stage {stage} has no contribution")
        if len(set(replicas)) != len(replicas):
            problems.append(f"stage {stage} has two contributions of one replica")
    peers = {p for _s, _r, p, _h in entries}
    if len(peers) != commit.num_contributors:
        problems.append(f"{len(peers)} distinct contributors, commit says {commit.num_contributors}")
    if document is not None:
        last_replicas = {r for s, r, _p, _h in entries if s == num_stages - 1}
        per_replica = (
            document["diloco"]["inner_steps"]
            * document["training"]["batch_size"]
            * document["model"]["block_size"]
        )
        if commit.tokens != per_replica * len(last_replicas):
            problems.append(f"tokens {commit.tokens} != {per_replica} x {len(last_replicas)} replicas")
    verdict.checks.append(
        Check("round shape", FAIL, "; ".join(problems)) if problems else Check("round shape", OK)
    )

    payloads: list[list[bytes]] = [[] for _ in range(num_stages)]
    missing = 0
    for contributor in verdict.contributors:
        label = f"contribution s{contributor.stage} r{contributor.replica} {contributor.envelope[:12]}"
        copy = first_good_copy(
            sources, lambda src, c=contributor: src.envelope(commit.round, c.envelope), contributor.envelope
        )
        if copy.data is None:
            if copy.bad:
                verdict.checks.append(
                    Check(
                        label, FAIL, "archived bytes are not the committed envelope: " + "; ".join(copy.bad)
                    )
                )
            else:
                verdict.checks.append(
                    Check(label, UNVERIFIABLE, "envelope bytes not held by any archive or peer")
                )
                missing += 1
            continue
        verdict.notes += [f"{label}: corrupt copy ignored ({b})" for b in copy.bad]
        try:
            env = decode_envelope(copy.data, MAX_ENVELOPE_BYTES)
        except EnvelopeRejected as exc:
            verdict.checks.append(Check(label, FAIL, f"envelope rejected: {exc}"))
            continue
        got = (env.kind, env.run_id, env.round, env.stage, env.replica, env.sender_peer_id)
        want = (
            CONTRIBUTION_KIND,
            run.run_id,
            commit.round,
            contributor.stage,
            contributor.replica,
            contributor.peer_id,
        )
        if got != want:
            fields = ("kind", "run", "round", "stage", "replica", "signer")
            diff = ", ".join(f"{f} {g!r} != {w!r}" for f, g, w in zip(fields, got, want) if g != w)
            verdict.checks.append(Check(label, FAIL, f"signed header does not match: {diff}"))
            continue
        account = _registered_key(valid, env.sender, previous_block, record.block_number)
        if account is None:
            verdict.checks.append(
                Check(
                    label,
                    FAIL,
                    f"signer {env.sender_peer_id} is not bound to any registered "
                    "account (valid binding signature) during the round",
                )
            )
            continue
        contributor.account = account
        verdict.checks.append(Check(label, OK))
        payloads[contributor.stage].append(env.payload)
    if any(c.status == FAIL for c in verdict.checks) or missing:
        return None
    return payloads


def _replay_round(
    verdict: RoundVerdict,
    commit: Any,
    replayer: _Replayer | None,
    payloads: list[list[bytes]] | None,
    replay: bool,
) -> None:
    from training.errors import TrainingError

    if not replay:
        verdict.checks.append(Check("weights root (replay)", UNVERIFIABLE, "replay skipped (--no-replay)"))
        return
    if replayer is None:
        verdict.checks.append(Check("weights root (replay)", UNVERIFIABLE, "no verified run document"))
        return
    if payloads is None:
        replayer.drop()
        verdict.checks.append(Check("weights root (replay)", UNVERIFIABLE, "contributions not verified"))
        return
    if replayer.weights is None:
        verdict.checks.append(
            Check(
                "weights root (replay)",
                UNVERIFIABLE,
                "no starting state: an earlier round "
                "could not be replayed and no checkpoint of the previous round was verified",
            )
        )
        return
    started = time.perf_counter()
    try:
        root = replayer.apply(commit.round, payloads)
    except TrainingError as exc:
        replayer.drop()
        verdict.checks.append(
            Check("weights root (replay)", FAIL, f"the committed contributions do not aggregate: {exc}")
        )
        return
    verdict.replay_seconds = time.perf_counter() - started
    if root == commit.weights_root:
        verdict.checks.append(Check("weights root (replay)", OK, f"from {replayer.base}"))
    else:
        # Keep the replayed (honest) state: later rounds are checked against what the contributions imply.
        verdict.checks.append(
            Check(
                "weights root (replay)",
                FAIL,
                f"replayed {root.hex()} != committed {commit.weights_root.hex()}",
            )
        )


def _check_checkpoint(
    report: AuditReport,
    record: Any,
    commit: Any,
    sources: list,
    replayer: _Replayer | None,
    config_hash: bytes,
) -> Any:
    """Check one published checkpoint; return it parsed if its content and weights root are right."""
    import torch

    from node.store.checkpoint import parse_checkpoint
    from training.hashing import stage_weights_hash, weights_root

    name = f"checkpoint of round {record.round} {record.content_hash.hex()[:16]}"

    def add(status: str, reason: str = "") -> None:
        report.checkpoints.append(Check(name, status, reason, round=record.round))

    expected = record.content_hash.hex()
    copy = first_good_copy(sources, lambda src: src.checkpoint(record.round, expected), expected)
    if copy.data is None:
        if copy.bad:
            add(FAIL, "no copy has the published content hash: " + "; ".join(copy.bad))
        else:
            add(UNVERIFIABLE, "file not held by any archive or peer")
        return None
    try:
        ckpt = parse_checkpoint(copy.data, record.content_hash)
    except StateError as exc:
        add(FAIL, f"content hash right but not a valid checkpoint: {exc}")
        return None
    problems = []
    if (ckpt.run_id, ckpt.round, ckpt.config_hash) != (report.run_id, record.round, config_hash):
        problems.append(
            f"metadata says run {ckpt.run_id} round {ckpt.round} config {ckpt.config_hash.hex()[:16]}"
        )
    stage_names = replayer.names if replayer is not None else None
    hashes = []
    if stage_names is not None:
        for stage, names in enumerate(stage_names):
            try:
                hashes.append(stage_weights_hash({n: ckpt.weights[n] for n in names}))
            except KeyError as exc:
                problems.append(f"stage {stage} lacks {exc}")
                break
        else:
            if {s: h for s, h in enumerate(hashes)} != ckpt.stage_hashes:
                problems.append("stage hashes in its metadata do not match its tensors")
    else:
        hashes = [ckpt.stage_hashes.get(s, b"") for s in range(report.num_stages)]
    if commit is None:
        problems.append("its round was never committed")
    elif (
        len(hashes) == report.num_stages
        and all(len(h) == 32 for h in hashes)
        and weights_root(hashes) != commit.weights_root
    ):
        problems.append(
            f"its weights root {weights_root(hashes).hex()} != committed {commit.weights_root.hex()}"
        )
    if replayer is not None and replayer.weights is not None and not problems:
        for stage, names in enumerate(replayer.names):
            for n in names:
                if not (
                    torch.equal(ckpt.weights[n], replayer.weights[stage][n])
                    and torch.equal(ckpt.momentum.get(n, torch.zeros(0)), replayer.momentum[stage][n])
                ):
                    problems.append(f"{n} differs from the replayed weights/momentum of round {record.round}")
                    break
            if problems:
                break
    if problems:
        add(FAIL, "; ".join(problems))
        return None
    basis = "content hash, weights root" + (
        ", replayed state" if replayer is not None and replayer.weights is not None else ""
    )
    add(OK, basis)
    return ckpt


# ---------------------------------------------------------------------- the audit
def audit_run(
    client: Any,
    run_id: int,
    archives: Iterable[str | Path] = (),
    fetcher: Any = None,
    replay: bool = True,
    progress: Progress | None = None,
    check_code: bool = True,
) -> AuditReport:
    """Audit run ``run_id`` (module docstring): return an :class:`AuditReport`, never raise on a finding.

    Args:
        client: A :class:`ledger.client.LedgerClient` of the deployment (its account is only a reader).
        archives: Local directories with archived contributions, run documents and checkpoints.
        fetcher: A connected :class:`node.tools.pull.PeerFetcher` to fetch missing evidence from peers, or None.
        replay: Re-run the aggregation and outer step of every round (False: chain and archives only).
        progress: Called as ``progress(done, total, what)`` while rounds are checked.
    """
    timings: dict[str, float] = {}
    started = time.perf_counter()
    history = client.history(run_id)
    timings["read_history_s"] = time.perf_counter() - started
    run = history.run
    report = AuditReport(
        run_id=run_id,
        chain_id=client.chain_id,
        registry=client.registry_address,
        ledger=client.ledger_address,
        config_hash=run.config_hash.hex(),
        num_stages=run.num_stages,
        inner_steps=run.inner_steps,
        head=history.head_hash.hex(),
        replay=replay,
    )
    for record in history.commits:
        c = record.commit
        report.rounds.append(
            RoundVerdict(
                round=c.round,
                committer=record.committer,
                block=record.block_number,
                train_loss=c.train_loss_micro / 1e6,
                eval_loss=c.eval_loss_micro / 1e6,
                tokens=c.tokens,
                num_contributors=c.num_contributors,
                weights_root=c.weights_root.hex(),
                contributions_root=c.contributions_root.hex(),
            )
        )
    mark = time.perf_counter()
    valid = _check_chain(client, history, report, check_code)
    timings["chain_checks_s"] = time.perf_counter() - mark
    timings["chain_total_s"] = time.perf_counter() - started

    sources: list = [ArchiveSource(d, run_id) for d in archives]
    if fetcher is not None:
        sources.append(PeerSource(fetcher, run_id))
    report.sources = [s.name for s in sources]
    mark = time.perf_counter()
    document = _run_document(report, history, sources)
    replayer = None
    if document is not None:
        try:
            replayer = _Replayer(document)
        except DLX_ERRORS as exc:  # hashes to the configHash, yet its settings do not load
            report.general.append(Check("run document settings", FAIL, str(exc)))
    checkpoints = {c.round: c for c in history.checkpoints}
    commits = {r.commit.round: r.commit for r in history.commits}
    for ckpt_round in sorted(set(checkpoints) - set(commits)):
        _check_checkpoint(report, checkpoints[ckpt_round], None, sources, replayer, run.config_hash)

    previous_block = run.block_number
    previous_round = -1
    total = len(history.commits)
    for index, (record, verdict) in enumerate(zip(history.commits, report.rounds)):
        commit = record.commit
        if replayer is not None and replay:
            if commit.round == 0:
                replayer.start_from_initial()
            elif commit.round != previous_round + 1:
                replayer.drop()  # a round that was never committed: the state after it is unknown
                verdict.notes.append(f"rounds {previous_round + 1}..{commit.round - 1} were never committed")
        payloads = _check_contributions(
            verdict, record, sources, run.num_stages, valid, previous_block, run, document
        )
        _replay_round(verdict, commit, replayer, payloads, replay)
        if commit.round in checkpoints:
            ckpt = _check_checkpoint(
                report,
                checkpoints[commit.round],
                commit,
                sources,
                replayer if replay else None,
                run.config_hash,
            )
            if ckpt is not None and replayer is not None and replay and replayer.weights is None:
                replayer.start_from_checkpoint(ckpt)  # the base for the rounds after a gap
        previous_block, previous_round = record.block_number, commit.round
        if progress is not None:
            progress(index + 1, total, f"round {commit.round}")
    timings["rounds_s"] = time.perf_counter() - mark
    timings["total_s"] = time.perf_counter() - started
    replays = [r.replay_seconds for r in report.rounds if r.replay_seconds is not None]
    if replays:
        timings["replay_mean_s_per_round"] = sum(replays) / len(replays)
        timings["replay_max_s_per_round"] = max(replays)
    report.timings = {k: round(v, 4) for k, v in timings.items()}
    return report


# ---------------------------------------------------------------------- the command
class _ProgressBar:
    """A progress bar on stderr (redrawn in place on a terminal; a line every 10% otherwise)."""

    def __init__(self, stream: Any = None, min_total: int = 20) -> None:
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.min_total = min_total
        self._last_decile = -1

    def __call__(self, done: int, total: int, what: str) -> None:
        if total < self.min_total:
            return
        fraction = done / total
        if self.tty:
            filled = int(30 * fraction)
            self.stream.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {done}/{total} {what:<14}")
            if done == total:
                self.stream.write("\n")
            self.stream.flush()
        elif int(fraction * 10) > self._last_decile:
            self._last_decile = int(fraction * 10)
            self.stream.write(f"audit: {done}/{total} rounds checked\n")
            self.stream.flush()


def run_audit(args: Any) -> int:
    """``dlx-node audit``: print per-round verdicts and the summary, write --json/--html, exit 0 or 8."""
    from node.tools.pull import PeerFetcher
    from node.tools.report import write_html, write_json

    client = reader_client(args)
    fetcher = PeerFetcher.start(args.bootstrap) if args.bootstrap else None
    try:
        report = audit_run(
            client,
            args.run,
            archives=args.archive,
            fetcher=fetcher,
            replay=not args.no_replay,
            progress=_ProgressBar(),
        )
    finally:
        if fetcher is not None:
            fetcher.close()
    for check in report.general:
        if check.status != OK or len(report.general) <= 12:
            print(check.line())
    for verdict in report.rounds:
        print(verdict.line())
    for check in report.checkpoints:
        print(check.line())
    if args.json_out:
        write_json(report, args.json_out)
        print(f"JSON report: {args.json_out}")
    if args.html_out:
        write_html(report, args.html_out)
        print(f"HTML report: {args.html_out}")
    t = report.timings
    print(
        f"chain part {t.get('chain_total_s', 0):.2f}s, rounds {t.get('rounds_s', 0):.2f}s"
        + (f", replay {t['replay_mean_s_per_round']:.3f}s/round" if "replay_mean_s_per_round" in t else "")
    )
    print(report.summary())
    if not report.ok:
        first, bad = report.first_bad_round, report.first_failure()
        where = f"first bad round {first}" if first is not None else "a chain-level item"
        raise AuditFailed(f"run {args.run} does not match its record: {where}: {bad.name}: {bad.reason}")
    return 0
