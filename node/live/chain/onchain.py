"""The node's view of the chain: one small adapter over :mod:`ledger`.

Everything the runtime asks of the ledger goes through here, so the round
protocol reads in its own terms (``last_round`` is -1 before the first commit,
seats are cached, registration and joining the run happen once).
"""

from __future__ import annotations

import logging
import threading

from ledger.account import load_account
from ledger.chain import connect_rpc
from ledger.anvil import AnvilProcess
from ledger.binding import binding_message
from ledger.client import LedgerClient
from ledger.errors import DeploymentMismatch, LedgerError
from ledger.attest import recover_signer
from ledger.contribution_binding import ContributionClaim, recover_contributor
from ledger.eventrecords import CheckpointRecord
from ledger.records import CommitRecord, Membership, RoundRecord
from ledger.runparams import MIN_WINDOW_BLOCKS, RunInfo
from node.commitments import scheme_named, version_name
from node.config import NodeConfig
from node.errors import ConfigError, NotRegistered
from node.live.chain.disputes import ChainDisputes
from node.live.chain.seats import ChainSeats

logger = logging.getLogger(__name__)


class NodeChain(ChainSeats, ChainDisputes):
    def __init__(self, client: LedgerClient, anvil: AnvilProcess | None = None, *,
                 confirmations: int = 0) -> None:
        self.client = client
        self._anvil = anvil
        #: Blocks (its own included) before a commit counts as final (ledger.confirmations; 0/1: once mined).
        self.confirmations = confirmations
        self._seats: dict[str, Membership] = {}  # account -> its current membership period
        self._placed: dict[str, Membership] = {}  # account -> its latest period, current or ended
        self._joins: list[tuple[int, int]] = []  # where every period of the run began, in chain order
        self._seats_read = 0.0
        self._unknown_checked: dict[str, float] = {}
        self._run_info: dict[int, RunInfo] = {}
        self._counted: dict[str, tuple[bool, float]] = {}  # account -> (counted, when read)
        self._declared: dict[bytes, bytes] = {}  # node key -> the platform its latest seat declared
        self._challenge_opened: dict[bytes, int] = {}  # own availability challenge -> the head before it
        self._lock = threading.Lock()  # web3 HTTP sessions and nonces are not shared across threads safely

    @classmethod
    def connect(cls, cfg: NodeConfig, stop: threading.Event | None = None) -> NodeChain:
        """Connect to the run's chain and check that it is the run's: chain id and contracts.

        A chain that does not answer yet is waited for, up to ``ledger.startup_wait`` seconds
        (logged when the wait starts, every 30 s and when the chain answers; ``stop`` ends it
        early with :class:`ChainWaitStopped`): nodes and their chain may start in any order.
        What waiting cannot fix fails at once with what to change: another chain id than
        ``ledger.chain_id``, no contract at the configured addresses, a ledger bound to
        another registry.
        """
        lc = cfg.ledger
        if not (lc.registry_address and lc.ledger_address):
            raise ConfigError("ledger.registry_address and ledger.ledger_address must be set to the run's "
                              "deployment (see deployment.json written by 'dlx-node demo')")
        anvil = None
        if lc.backend == "rpc":
            w3 = connect_rpc(lc.rpc_url, timeout=lc.request_timeout, wait=lc.startup_wait, stop=stop)
            where = f"ledger.rpc_url {lc.rpc_url}"
        elif lc.backend == "anvil":
            anvil = AnvilProcess(state_file=cfg.path(lc.anvil_state_file) if lc.anvil_state_file else None)
            w3 = connect_rpc(anvil.start(), timeout=lc.request_timeout, wait=lc.request_timeout)
            where = "the managed anvil"
        else:
            raise ConfigError("ledger.backend='pyevm' is in-process only: a node process needs "
                              "ledger.backend='rpc' (or 'anvil') to share the chain with its peers")
        try:
            chain_id = w3.eth.chain_id
            if lc.chain_id and chain_id != lc.chain_id:
                raise ConfigError(f"{where} serves chain id {chain_id}, but ledger.chain_id = {lc.chain_id}: "
                                  "point rpc_url at the run's chain (the run link names it)")
            account = load_account(lc, chain_id)
            client = LedgerClient.from_config(w3, account, lc)
            try:
                client.check_deployment()
            except DeploymentMismatch as exc:
                raise ConfigError(
                    f"{exc}; set ledger.registry_address and ledger.ledger_address to the run's "
                    f"deployment on chain {chain_id} (deployment.json, or the run link)") from None
        except BaseException:
            if anvil is not None:
                anvil.stop()
            raise
        return cls(client, anvil, confirmations=lc.confirmations)

    @property
    def rpc_lock(self) -> threading.Lock:
        """The lock each of this chain's calls holds (a reader on another thread takes it per call)."""
        return self._lock

    @property
    def account_bytes(self) -> bytes:
        return bytes.fromhex(self.client.address[2:])

    def close(self) -> None:
        if self._anvil is not None:
            self._anvil.stop()

    def run_info(self, run_id: int) -> RunInfo:
        """The run as created (its parameters never change: cached)."""
        if run_id not in self._run_info:
            with self._lock:
                self._run_info[run_id] = self.client.run_info(run_id)
        return self._run_info[run_id]

    def quorum_of(self, run_id: int) -> int:
        """The signatures the run's next commit needs now (it grows with the members in force)."""
        with self._lock:
            return self.client.quorum_of(run_id)

    def check_run(self, run_id: int, config_hash: bytes, rounds: int | None = None, *,
                  commitments: str, cfg=None) -> None:
        """Refuse settings that would train differently from the run's other members.

        ``rounds`` must be the run's ``maxRounds``: the inner learning rate follows a schedule over
        the run's ``rounds x H`` steps, so a node with another horizon would send contributions
        that re-execute differently (a spot check would find them wrong). ``commitments`` (the run
        document's ``diloco.commitments``) must be the version the ledger holds the run to
        (``RunParams.commitments``): the prover proves wrong every round whose factors are of another
        version, so a node of a run created with another one would sign rounds that lose its stake.
        With ``cfg``: the run's values (:meth:`_check_values`), in a run with the plain end rule, settings
        that carry no state between rounds (node/live/fraud/endrule.py), and the run's data terms on chain
        against this node's dataset (node/dataterms.py).
        """
        info = self.run_info(run_id)
        version = scheme_named(commitments).version
        if info.commitments != version:
            raise ConfigError(
                f"run {run_id} was created on chain with commitments version {info.commitments} "
                f"({version_name(info.commitments)}), but its document says diloco.commitments = "
                f"{commitments!r} (version {version}): the prover would prove every round "
                "of this node wrong; "
                "the run's creator must create it again with its document's version"
            )
        if rounds is not None and rounds != info.max_rounds:
            raise ConfigError(
                f"rounds={rounds}, but run {run_id} on chain has maxRounds={info.max_rounds}: the inner "
                f"learning-rate schedule spans the run's rounds; set rounds = {info.max_rounds} (stop a node "
                "early with SIGTERM instead)"
            )
        if info.config_hash != config_hash:
            raise ConfigError(
                f"run {run_id} on chain has configHash {info.config_hash.hex()}, but this node's settings "
                f"hash to {config_hash.hex()}: use exactly the run's [model], [training], "
                "[diloco], [compression] "
                "and pipeline.num_stages settings and the same training text"
            )
        if cfg is not None:
            self._check_values(run_id, info, cfg)
            from node.live.fraud.endrule import check_end_rule

            check_end_rule(self.client, run_id, cfg)  # issue 78: a plain-end run takes no carried state
            from node.dataterms import check_data_terms

            check_data_terms(self.client, run_id, cfg)  # issue 78: the run's data terms are this dataset's

    @staticmethod
    def _check_values(run_id: int, info: RunInfo, cfg) -> None:
        """The run's parameters must leave every part of the fraud proof possible (issue 79: a schedule, a
        genesis root, a proof within its gas bound, games long enough for the largest stage), and its
        per-round values on chain (issue 62: schedule, Nesterov, norm clip, genesis root) must be the ones its
        document gives (node/commitments/values.py), before round 0."""
        from node.commitments.values import other_values, unprovable_values, values_of

        if cfg.commitment_scheme.weakness:  # joined, as the run's members chose, but said (issue 79)
            logger.warning("run %d: %s", run_id, cfg.commitment_scheme.weakness)
        on_chain = values_of(info)
        problems = unprovable_values(cfg, on_chain)
        if problems:
            raise ConfigError(
                f"run {run_id} was created with parameters that make a wrong round unprovable "
                f"({'; '.join(problems)}): its members would sign rounds nobody can prove wrong; not joining "
                "or signing in it (dlx-node create-run binds them all from the run document)"
            )
        problems = other_values(cfg, on_chain, info.max_rounds) if cfg.commitment_scheme.chunked else []
        if problems:
            raise ConfigError(
                f"run {run_id} was created on chain with other per-round values than its document gives "
                f"({'; '.join(problems)}): the fraud proofs hold every round to the chain's, so this node's "
                "rounds would be proven wrong; the run's creator must create it again (dlx-node create-run "
                "derives them from the document)"
            )

    def ensure_registered(self, identity) -> None:
        """Register this node's ed25519 key with its account, once."""
        with self._lock:
            key = self.client.key_of(self.client.address)
            if key == identity.public_key_bytes:
                return
            if key is not None:
                raise NotRegistered(f"account {self.client.address} is registered with another node key: an "
                                    "account has one node key; make this node with it (`dlx-node join ... "
                                    "--identity OLD_DIR/identity.key` or `create-run ... --identity "
                                    "OLD_DIR/identity.key`, OLD_DIR the node directory that registered it) "
                                    "or use another account")
            message = binding_message(self.client.chain_id, self.client.registry_address, self.client.address)
            try:
                self.client.register(identity.public_key_bytes, identity.sign(message))
            except LedgerError as exc:
                raise NotRegistered(
                    f"account {self.client.address} is not registered and registering failed: "
                    f"{exc}") from exc
        logger.info("registered account %s with peer id %s", self.client.address, identity.peer_id)

    def ensure_member(self, run_id: int, platform: bytes, also: tuple[bytes, ...] = ()) -> None:
        """Hold a signing seat in the run: join it with the run's minimum stake, once, declaring ``platform``
        (the declaration of the platform this node trains on: node.platforms.own_platforms, docs/DILOCOX.md
        section 11; ``also``: older forms of the same declaration a seat held already may carry).

        A run whose stake unbonds faster than its accusation deadline plus its dispute window is refused:
        there a member could sign a bad record and take its stake out before anyone could act on it. A seat
        held already must have declared ``platform``: a node that now trains on another platform (another
        CPU, instruction set, device, precision or torch) would claim one it did not declare, which every
        verifier refuses, so it is stopped here, saying so.
        """
        # Read (and cache) before taking the lock: run_info takes it too when the run is not cached yet.
        info = self.run_info(run_id)
        stake = info.min_stake
        with self._lock:
            seat = self.client.member(run_id, self.client.address)
            if seat is not None and seat.active:
                periods = [m for m in self.client.memberships(run_id)
                           if m.account.lower() == self.client.address.lower() and m.ended is None]
                declared = periods[-1].platform if periods else None
                if declared is not None and declared != platform and declared not in also:
                    raise NotRegistered(
                        f"account {self.client.address} declared platform {declared.hex()[:16]} when it "
                        f"joined run {run_id}, but this node trains on platform "
                        f"{platform.hex()[:16]} (another CPU, "
                        "ATEN_CPU_CAPABILITY, device, precision or torch): run it where it joined, or leave "
                        "the run, withdraw after unbonding and join again")
                return
            if info.unbonding_blocks < max(info.min_unbonding_blocks, 2 * MIN_WINDOW_BLOCKS):
                raise NotRegistered(
                    f"run {run_id} unbonds stakes in {info.unbonding_blocks} blocks, less than its "
                    f"longest proof window ({info.min_unbonding_blocks} blocks, at least "
                    f"{2 * MIN_WINDOW_BLOCKS}): a member could withdraw before a report, verdict or fraud "
                    "proof lands; not joining it")
            if seat is not None:
                raise NotRegistered(
                    f"account {self.client.address} holds a {seat.status} seat in run {run_id}; "
                    "a member that left must withdraw its stake after unbonding before joining "
                    "again, and a slashed member cannot rejoin")
            try:
                self.client.join_run(run_id, stake, platform)
            except LedgerError as exc:
                raise NotRegistered(
                    f"account {self.client.address} could not join run {run_id} with a stake of "
                    f"{stake} wei: {exc}") from exc
        logger.info("joined run %d with a stake of %d wei, declaring platform %s", run_id, stake,
                    platform.hex()[:16])

    def signer_of(self, record: RoundRecord, signature: bytes) -> str:
        """The account whose EIP-712 signature over ``record`` this is (raises LedgerError if malformed)."""
        return recover_signer(record, signature, self.client.chain_id, self.client.ledger_address)

    def sign_record(self, record: RoundRecord) -> bytes:
        return self.client.sign_record(record)

    def sign_contribution(self, claim: ContributionClaim) -> bytes:
        """This account's signature of a contribution it sends (issue 62: ledger/contribution_binding.py)."""
        return self.client.sign_contribution(claim)

    def contributor_of(self, claim: ContributionClaim, signature: bytes) -> str:
        """The account whose signature of ``claim`` this is (LedgerInputError if malformed)."""
        return recover_contributor(claim, signature, self.client.chain_id, self.client.ledger_address)

    def own_seat_status(self, run_id: int) -> str:
        """This account's seat in the run: "active", "unbonding" (it left), or "withdrawn" (none)."""
        with self._lock:
            seat = self.client.member(run_id, self.client.address)
        return "withdrawn" if seat is None else seat.status

    def last_round(self, run_id: int) -> int:
        with self._lock:
            last = self.client.last_round(run_id)
        return -1 if last is None else last

    def head_of(self, run_id: int) -> bytes:
        with self._lock:
            return self.client.head_of(run_id)

    def commit_of(self, run_id: int, round_index: int) -> RoundRecord | None:
        with self._lock:
            return self.client.commit_of(run_id, round_index)

    def attesters_of(self, run_id: int, round_index: int) -> tuple[str, ...] | None:
        """The attesters the round's commit credited (RoundCommitted), or None if it is not committed."""
        with self._lock:
            committed = self.client.commit_record(run_id, round_index)
        return None if committed is None else committed.attesters

    def attest(self, record: RoundRecord, signature: bytes, committed: RoundRecord | None = None) -> str:
        """Put this member's own signature over ``record`` on chain: the record committed as ``committed``
        (default: ``record``), or one of its result with other figures or checkpoint hash (docs/TRUST.md,
        G2)."""
        with self._lock:
            return self.client.attest(record, signature, committed)

    def commit_record(self, run_id: int, round_index: int) -> CommitRecord | None:
        """The round's RoundCommitted event (its record and block), or None if it is not committed."""
        with self._lock:
            return self.client.commit_record(run_id, round_index)

    def block_number(self) -> int:
        """The chain's head block (ChainUnavailable once an RPC outage outlasts the retries)."""
        with self._lock:
            return self.client.head_block()

    def final_commit_of(self, run_id: int, round_index: int) -> RoundRecord | None:
        """The round's committed record once its block is ``confirmations`` deep on the canonical chain; None
        before (or once a reorg dropped it): a node confirms a round, whoever committed it, only then."""
        with self._lock:
            committed = self.client.commit_record(run_id, round_index)
            if committed is None or self.confirmations <= 1:
                return committed.commit if committed is not None else None
            head = self.client.head_block()
        return committed.commit if head - committed.block_number + 1 >= self.confirmations else None

    def latest_checkpoint(self, run_id: int) -> CheckpointRecord | None:
        with self._lock:
            return self.client.latest_checkpoint(run_id)

    def checkpoints(self, run_id: int) -> list[CheckpointRecord]:
        """Every checkpoint the run's committed records publish, oldest first."""
        with self._lock:
            history = self.client.history(run_id, with_registrations=False)
        return list(history.checkpoints)

    def disputed_rounds(self, run_id: int, exclude: str = "") -> set[int]:
        """The committed rounds of ``run_id`` that a member (other than ``exclude``) disputed on chain."""
        with self._lock:
            history = self.client.history(run_id, with_registrations=False)
        return {d.round for d in history.disputes if d.disputer.lower() != exclude.lower()}

    def commit_round(self, record: RoundRecord, signatures: list[bytes]) -> str:
        with self._lock:
            return self.client.commit_round(record, signatures)

