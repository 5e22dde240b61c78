"""Defending this node's contributions against contribution cases (issue 78; docs/FRAUD_PROOF.md "The node
defends its contributions").

Anyone may open a case against a contribution a committed round lists (StepProver ``openCase``); unless a run
claim on it stands by the case's deadline (``clock`` blocks later), the round is overturned and its attesters
are slashed. So an honest contributor answers every case on its own work: :class:`CaseDefender` watches the
run's ``CaseOpened`` events, and for a case on a contribution this account signed (the round's factors, as
this node kept them, name it as the contributor) it

1. rebuilds the claim from what it kept: the round's and the previous round's stage leaves and factors
   (``<data_dir>/rewards/``: node/casesubject.py, the chain vouching for them), its own state of the
   previous round (the committed start's weight chunk leaves, node/live/fraud/chunkstate.py, kept while a
   case can be opened), and the run's step program (``ledger.step_program``, checked against the chain's
   ``programOf`` and ``originOf``): the program run for the contribution's declared steps (else the run's H)
   from the committed start (node/stepprogram.py); in a run with the plain end rule (``endRuleOf`` 1) it
   also checks every element of the program's end against its contribution's payload pieces as an end
   dispute would (node/live/fraud/endcheck.py) and answers end disputes from them, and where one element
   does not hold it posts no claim (it would lose its bond there) and says which; in a run with data terms
   (StepProver ``setData``) it commits the claim's batches, the windows of its replica's key drawn again from
   its dataset, and answers data disputes from them (node/live/fraud/dataside.py), a later stage's claim
   carrying its replica's key, signed (where this node holds the replica's stage 0 too);
2. posts the run claim (``claimRun``, the run's bond) before the deadline;
3. each time it looks, answers every game on its claim whose move is its own (``ledger.stepdefense``: one
   move per game, the honest defender's), and ends a game whose challenger let its clock run out
   (``timeout``);
4. from the case's end on, dismisses the case (the opener's bond is paid to it) and withdraws what it won.

A case it cannot answer (no program configured, another program than the run's, its start state not held
any more, a payload that is not the program's end under the plain end rule, a claim refused) is logged as an
error with why: unless another holder of the inputs defends the contribution by the deadline, the round is
overturned. A case on another member's contribution is left to its contributor: outside runs with the plain
end rule the claim binds the start, the program and the steps but not the end (docs/FRAUD_PROOF.md "Not
done", 1), so a true run from the committed start stands whatever the payload is, and a node that defended
contributions it had not produced would shield a fabricated one from an honest case.

Across restarts (a restart drops the node's spilled states): for every round whose factors name this node's
account as a contributor it copies the start's leaves and its codec blob to ``<data_dir>/case-defense/``,
and each game's memory before each move (node/live/fraud/defensefiles.py); a new life reads every case of
the run from block 0, finds its standing claims and plays their games on from those copies. The copies of a
round go once its proof window has closed and no defense of it is being played.

It runs on a thread of its own (like the availability answerer), so training does not delay its moves; each
poll reads only the blocks since the last one and sends at most one move per game.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ledger.chunkproof import tree_root
from ledger.errors import LedgerError
from ledger.stepdata import batch_root
from ledger.stepdefense import DefenseSide, GameMemory, challenger_out, defender_move, games_on
from ledger.stepproof import PHASES, PLAIN_END, ZERO as ZERO_ROOT, StepProverClient, run_claim
from node.casesubject import kept_case
from node.errors import DLX_ERRORS, ConfigError
from node.live.chain.onchain import NodeChain
from node.live.fraud.dataside import NodeData
from node.live.fraud.defensefiles import DEFENSE_DIR, DefenseFiles
from node.stepprogram import StepProgram
from training.chunks import CutPayload

logger = logging.getLogger(__name__)

#: How often the defender reads the chain (seconds); every move waits at most this long for it.
DEFEND_EVERY_S = 2.0
#: Every how many polls the kept inputs of closed rounds are looked for (each look reads the chain per round).
PRUNE_EVERY = 30
ZERO_ADDRESS = "0x" + "00" * 20


@dataclass
class Defense:
    """One case on this node's contribution and the claim that answers it."""

    key: bytes
    round: int
    stage: int
    payload_root: bytes
    ends: int  # from this block a standing claim dismisses the case
    claim_id: bytes
    side: DefenseSide
    from_block: int  # the next block whose Challenged events are read
    games: dict[bytes, GameMemory] = field(default_factory=dict)
    decided: dict[bytes, bool] = field(default_factory=dict)  # game -> defender won
    dismissed: bool = False


class CaseDefender:
    """Watches the run's contribution cases and defends this node's contributions (module docstring)."""

    def __init__(self, *, run_id: int, chain: NodeChain, states, program: StepProgram | None, data_dir: Path,
                 stop: threading.Event, every_s: float = DEFEND_EVERY_S,
                 files: DefenseFiles | None = None, data: NodeData | None = None) -> None:
        """``states``: the node's ChunkedStates (``state(round, stage)``: its StageState of a round);
        ``program``: the run's step program (None: not configured, so no case can be answered); ``files``:
        where what a defense needs is kept across restarts (node/live/fraud/defensefiles.py; None: not
        kept); ``data``: its dataset, which its claims' batches are drawn from in a run whose data terms
        are fixed (node/live/fraud/dataside.py; None: it commits none, so it cannot defend there)."""
        self.files = files
        self.data = data
        self._terms = None  # the run's data terms once read (False: it has none)
        self._kept_seen: set[tuple[int, int]] = set()  # (round, stage) looked at for keeping
        self._polls = 0
        self.run_id = run_id
        self.chain = chain
        self.states = states
        self.program = program
        self.data_dir = data_dir
        self.stop = stop
        self.every_s = every_s
        self._prover: StepProverClient | None = None  # the ledger's StepProver, read once a case is taken up
        self.defenses: dict[bytes, Defense] = {}  # case key -> its defense
        self.failed: dict[bytes, str] = {}  # case key -> why it is not defended
        self.not_ours: set[bytes] = set()
        self._retrying: dict[bytes, dict] = {}  # case key -> its CaseOpened, tried again until its deadline
        self._from_block = 0

    def run(self) -> None:
        """Poll until the node stops (a thread of its own)."""
        while not self.stop.wait(self.every_s):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - an RPC's own error (web3, the transport): the thread must live on
                logger.exception("contribution cases: a poll failed (the next one tries again)")

    def poll(self) -> None:
        """Read the run's new cases, take up those on this node's contributions, play every game on its
        claims; nothing here raises."""
        try:
            cases, head = self.chain.contribution_cases(self.run_id, self._from_block)
        except (*DLX_ERRORS, LedgerError) as exc:
            logger.debug("contribution cases not read: %s", exc)
            return
        self._from_block = head + 1
        pending = {bytes(case["key"]): case for case in cases}
        pending.update({key: case for key, case in self._retrying.items()})
        for key, case in pending.items():
            if key in self.defenses:  # opened again after a dismissal: the standing claim still counts
                self._reopened(self.defenses[key])
            elif key not in self.not_ours:
                self._take(key, case, head)
        for defense in self.defenses.values():
            try:
                self._play(defense, head)
            except Exception as exc:  # noqa: BLE001 - the next poll tries again, within the clock
                logger.warning("round %d stage %d: a move on this node's claim failed (tried again): %s",
                               defense.round, defense.stage, exc)
        if self.files is not None and self.program is not None:
            try:
                self._keep_own()
                self._polls += 1
                if self._polls % PRUNE_EVERY == 1:
                    self._prune()
            except Exception as exc:  # noqa: BLE001 - a full disk, an RPC's error: tried again next poll
                logger.warning("contribution cases: this node's defense inputs not kept (tried again): %s",
                               exc)

    def _keep_own(self) -> None:
        """Copy to disk what a defense of each of this node's contributions needs (its start's weight chunk
        leaves, its codec blob) from the states it holds, once per round and stage: a restart drops those."""
        address = self.chain.client.address.lower()
        for outer_round, stage in self.states.held():
            if outer_round < 1 or (outer_round, stage) in self._kept_seen:
                continue
            self._kept_seen.add((outer_round, stage))
            if self.files.has(outer_round, stage):
                continue
            state = self.states.state(outer_round, stage)
            norms = state.factors.norms if state is not None else None
            contributors = [c.lower() for c in norms.contributors] if norms is not None else []
            start = self.states.state(outer_round - 1, stage)
            if address not in contributors or start is None:
                continue
            index = contributors.index(address)
            pieces = state.payload_leaves[index]
            blob, shapes = (pieces.blob, pieces.shapes) if isinstance(pieces, CutPayload) else (b"", {})
            self.files.keep(outer_round, stage, state.factors.payload_roots[index], list(start.weight_leaves),
                            blob, shapes)
            logger.info("round %d stage %d: this node's contribution %d's defense inputs kept on disk",
                        outer_round, stage, index)

    def _prune(self) -> None:
        """Remove the kept inputs of rounds whose proof window closed and that no defense plays now."""
        window = getattr(self.states, "window", None)
        if window is None:
            return
        playing = {(d.round, d.stage) for d in self.defenses.values()
                   if not d.dismissed or len(d.decided) < len(d.games)}
        for outer_round, stage in self.files.rounds():
            if (outer_round, stage) not in playing and not window.open(outer_round):
                self.files.drop(outer_round, stage)
                logger.info("round %d stage %d: defense inputs dropped (its proof window closed)",
                            outer_round, stage)

    @property
    def prover(self) -> StepProverClient:
        """The ledger's StepProver (its AggregationProver's), read on first use."""
        if self._prover is None:
            from ledger.stepcase import ledger_step_prover

            client = self.chain.client
            with self.chain.rpc_lock:
                address = ledger_step_prover(client.w3, client.ledger_address)
            self._prover = StepProverClient(client.w3, address, bond=0)
        return self._prover

    def _reopened(self, defense: Defense) -> None:
        """A new case on a contribution already defended: the claim stands for it too (the contract counts
        every claim on the contribution); dismiss it again from its own end."""
        try:
            with self.chain.rpc_lock:
                defense.ends = int(self.prover.contract.functions.caseOf(defense.key).call()[4])
        except (*DLX_ERRORS, LedgerError) as exc:
            logger.warning("round %d stage %d: a new case on this node's claimed contribution not read: %s",
                           defense.round, defense.stage, exc)
            return
        defense.dismissed = False
        logger.warning("round %d stage %d: a new case on this node's contribution; its claim stands for it "
                       "(dismissed from block %d)", defense.round, defense.stage, defense.ends)

    def _take(self, key: bytes, case: dict, head: int) -> None:
        """Defend the case's contribution if it is this node's; log why not where it cannot."""
        try:
            defense = self._defense(key, case, head)
        except Exception as exc:  # noqa: BLE001 - any failure (an RPC's own too) is said and tried again
            why = f"{type(exc).__name__}: {exc}"[:400]
            if head + 1 < case["deadline"]:
                self._retrying[key] = case
            else:
                self._retrying.pop(key, None)
            if self.failed.get(key) != why:
                self.failed[key] = why
                logger.error("CANNOT DEFEND this node's contribution %s (round %d, stage %d) against the "
                             "case opened by %s: %s. Unless a holder of its inputs posts a true claim by "
                             "block %d, round %d is overturned and its attesters slashed",
                             bytes(case["payloadRoot"]).hex(), case["round"], case["stage"], case["opener"],
                             why, case["deadline"], case["round"])
            return
        self._retrying.pop(key, None)
        if defense is None:
            self.not_ours.add(key)
            return
        self.failed.pop(key, None)
        self.defenses[key] = defense

    def _defense(self, key: bytes, case: dict, head: int) -> Defense | None:
        """The defense of the case (its claim posted), or None when the contribution is not this node's."""
        round_, stage, payload = case["round"], case["stage"], bytes(case["payloadRoot"])
        client = self.chain.client
        with self.chain.rpc_lock:
            kept = kept_case([self.data_dir], client, self.run_id, round_, stage)
        factors = kept.factors_parsed()
        roots = [bytes(r) for r in factors.payload_roots]
        if payload not in roots:
            raise ConfigError(f"the round's factors this node kept do not list payload root {payload.hex()}")
        index = roots.index(payload)
        norms = factors.norms
        contributors = norms.contributors if norms is not None else ()
        if index >= len(contributors) or contributors[index].lower() != client.address.lower():
            logger.info("round %d stage %d: a case on contribution %d (not this node's: left to its "
                        "contributor)", round_, stage, index)
            return None
        functions = self.prover.contract.functions
        committed, pieces = self._inputs(round_, stage, payload)
        with self.chain.rpc_lock:
            closed = int(functions.caseOf(key).call()[0], 16) == 0
        if closed and committed is None:  # dismissed or overturned before (a restart reads every case)
            logger.info("round %d stage %d: the case on this node's contribution %d is closed and its inputs "
                        "are not held any more", round_, stage, index)
            return None
        logger.warning("round %d stage %d: a case opened by %s against this node's contribution %d; "
                       "defending it (claims taken until block %d)", round_, stage, case["opener"], index,
                       case["deadline"])
        if self.program is None:
            raise ConfigError("no step program configured (ledger.step_program: the run's program file)")
        with self.chain.rpc_lock:
            self.program.check_on(bytes(functions.programOf(self.run_id).call()),
                                  bytes(functions.originOf(self.run_id).call()))
            end_rule = int(functions.endRuleOf(self.run_id).call())
        subject = kept.subject(index)
        if committed is None:
            raise ConfigError(f"this node no longer holds its state of round {round_ - 1} (the claim's "
                              f"start), nor a copy in {DEFENSE_DIR}/: dropped, or made before a node that "
                              "kept none")
        if tree_root(committed) != subject.start_weights:
            raise ConfigError(f"this node's state of round {round_ - 1} is not the committed start")
        declared = norms.steps[index] if index < len(norms.steps) else 0
        steps = declared or self.chain.run_info(self.run_id).inner_steps
        subject, batches, data = self._data(kept, subject, index, steps)
        side = self.program.defense(committed, steps, self._end_pieces(end_rule, round_, pieces, payload),
                                    batches)
        side.data = data
        claim = run_claim(side.traces, subject, batch_root(data.batches) if data is not None else ZERO_ROOT)
        with self.chain.rpc_lock:
            claim_id = bytes(functions.runIdOf(claim, client.address).call())
            posted = functions.claimOf(claim_id).call()[0] == ZERO_ADDRESS
            if posted:
                stake = int(functions.caseOf(key).call()[7])
                client.sender.transact(self.prover.contract, "claimRun", (claim, subject.binding),
                                       f"claim round {round_} stage {stage}'s contribution {index}", stake)
            ends = int(functions.caseOf(key).call()[4])
        logger.warning("round %d stage %d: %s this node's contribution %d (%d steps of the run's "
                       "program%s%s); every game on it is answered", round_, stage,
                       "claimed" if posted else "found its standing claim (posted before) on", index, steps,
                       ", its end checked against its payload" if end_rule else "",
                       f", its batches committed (data key {subject.data_key})" if data is not None else "")
        games = self.files.memories(round_, stage, claim_id) if self.files is not None else {}
        return Defense(key, round_, stage, payload, ends, claim_id, side, int(case["block"]), games)

    def _data(self, kept, subject, index: int, steps: int):
        """``(subject, batches, data side)`` of the claim on contribution ``index``: in a run whose data terms
        are fixed (or whose program reads each step's batch) the batches drawn with the replica's data key
        and what answers their disputes (node/live/fraud/dataside.py), a later stage's subject carrying its
        signed replica key; else ``(subject, None, None)``. ConfigError where they cannot be made."""
        terms = self._data_terms()
        if terms is None and not self.program.reads_data:
            return subject, None, None
        if terms is None:
            raise ConfigError("the run's program reads each step's batch but the run fixed no data terms "
                              "(StepProver.setData): no batches this node commits could answer a dispute")
        if self.data is None:
            raise ConfigError("the run fixed its data terms and this node was given no dataset to draw its "
                              "claim's batches from")
        if subject.stage > 0:
            subject = self._replica_subject(kept, subject, index)
        batches, side = self.data.side(terms, subject.data_key, subject.round, steps)
        return subject, batches, side

    def _data_terms(self):
        """The run's data terms (``DataFixed``; fixed once, before the first commit, so read once), or
        None."""
        if self._terms is None:
            from ledger.stepdata import DataClient

            with self.chain.rpc_lock:
                terms = DataClient(self.prover).terms_of(self.run_id, self.chain.client.from_block)
            self._terms = terms if terms is not None else False
        return self._terms or None

    def _replica_subject(self, kept, subject, index: int):
        """A later stage's subject naming its replica's data key: this node's own account where it holds the
        replica's stage 0 too (the round's stage-0 factors it kept list it), its ``DataKey`` signed and, as
        the replica's stage-0 member, its ``ReplicaPartner`` counter-signature naming itself
        (docs/FRAUD_PROOF.md "The replica's key"); ConfigError where it did not keep them."""
        from ledger.chunkproof import Factors
        from ledger.stepbinding import DataKeyClaim, PartnerClaim, ReplicaKey, sign_data_key
        from node.store.rewardsources import read_sources

        client = self.chain.client
        with self.chain.rpc_lock:
            sources = read_sources([self.data_dir], client, self.run_id)
            chain_id = client.w3.eth.chain_id
        zero = sources[kept.round][1][0] if kept.round in sources and sources[kept.round][1] else None
        if zero is None:
            raise ConfigError(f"round {kept.round} stage {kept.stage}: the claim names its replica's data "
                              "key, shown against the round's stage-0 factors, which this node did not keep "
                              "(a split replica's later stage: fetching them from its stage-0 member is not "
                              "built)")
        norms = Factors.decode(bytes(zero)).norms
        listed = [c.lower() for c in norms.contributors] if norms is not None else []
        if client.address.lower() not in listed:
            raise ConfigError(f"round {kept.round}: the stage-0 factors do not list this node's "
                              "contribution, so no stage-0 key of its replica is on the record")
        claim = DataKeyClaim(self.run_id, kept.round, kept.stage, subject.payload_root, client.address)
        signature = sign_data_key(client.account, claim, chain_id, client.ledger_address)
        partnered = PartnerClaim(self.run_id, kept.round, kept.stage, client.address)
        partner = sign_data_key(client.account, partnered, chain_id, client.ledger_address)
        return kept.subject(index, ReplicaKey(bytes(zero), listed.index(client.address.lower()), signature,
                                              partner))

    def _inputs(self, round_: int, stage: int, payload: bytes) -> tuple[list[bytes] | None, object]:
        """This node's start leaves of round ``round_ - 1`` and its payload pieces under ``payload`` of
        round ``round_``: from the states it holds, else from its kept copy (either None if neither)."""
        start = self.states.state(round_ - 1, stage)
        committed = list(start.weight_leaves) if start is not None else None
        pieces = self.states.pieces_of(round_, stage, payload)
        if (committed is None or pieces is None) and self.files is not None:
            kept = self.files.kept(round_, stage)
            if kept is not None and kept.payload_root == payload:
                logger.info("round %d stage %d: this node's defense inputs read from its kept copy (%s/)",
                            round_, stage, DEFENSE_DIR)
                committed = committed if committed is not None else kept.start
                pieces = pieces if pieces is not None else kept.pieces()
        return committed, pieces

    @staticmethod
    def _end_pieces(end_rule: int, round_: int, pieces, payload: bytes):
        """The payload pieces a claim answers end disputes from (None: the run takes none); ConfigError for a
        rule this node does not know or pieces it does not hold."""
        if not end_rule:
            return None
        if end_rule != PLAIN_END:
            raise ConfigError(f"the run's end rule is {end_rule}; this node answers end disputes under the "
                              f"plain end rule ({PLAIN_END}) only")
        if pieces is None or tree_root(list(pieces)) != payload:
            raise ConfigError(f"the run disputes its claims' ends (the plain end rule) and this node does "
                              f"not hold its contribution's payload pieces of round {round_} (needed to "
                              "answer one)")
        return pieces

    def _play(self, defense: Defense, head: int) -> None:
        """One move in every game on the claim that waits for this node, then the case's dismissal."""
        client, functions = self.chain.client, self.prover.contract.functions
        with self.chain.rpc_lock:
            games = games_on(client, self.prover.contract.address, defense.claim_id, defense.from_block, head)
        defense.from_block = head + 1
        for game in games:
            defense.games.setdefault(bytes(game["gameId"]), GameMemory())
        moves, before = [], {g: (m.step, m.op) for g, m in defense.games.items()}
        for game_id, memory in defense.games.items():
            if game_id in defense.decided:
                continue
            with self.chain.rpc_lock:
                state = self.prover.game(game_id)
            if state["phase"] == PHASES.index("Done"):
                with self.chain.rpc_lock:
                    won = not functions.claimOf(defense.claim_id).call()[1]
                defense.decided[game_id] = won
                log = logger.info if won else logger.error
                log("round %d stage %d: game %s on this node's claim decided: %s", defense.round,
                    defense.stage, game_id.hex()[:12], "won" if won else "LOST (the claim is refuted)")
                continue
            move = defender_move(game_id, state, defense.side, memory)
            if move is None and challenger_out(state, head):
                move = ("timeout", (game_id,))
            if move is not None:
                moves.append(move)
        if self.files is not None and before != {g: (m.step, m.op) for g, m in defense.games.items()}:
            self.files.remember(defense.round, defense.stage, defense.claim_id, defense.games)  # before sent
        if moves:  # sent together: with timed blocks no game's move waits for another's block
            contract = self.prover.contract
            requests = [({"to": contract.address, "value": 0,
                          "data": contract.encode_abi(name, args=list(args))}, f"{name} in a case game")
                        for name, args in moves]
            with self.chain.rpc_lock:
                results = client.sender.send_all(requests)
            for (name, _args), result in zip(moves, results):
                if isinstance(result, Exception):
                    logger.warning("round %d stage %d: %s on this node's claim failed (tried again): %s",
                                   defense.round, defense.stage, name, result)
        self._close(defense, head)

    def _close(self, defense: Defense, head: int) -> None:
        """From the case's end: dismiss it with the standing claim; withdraw what this account won."""
        client, functions = self.chain.client, self.prover.contract.functions
        if head < defense.ends or len(defense.decided) < len(defense.games):  # preflight at the head
            return
        with self.chain.rpc_lock:
            wrong = bool(functions.claimOf(defense.claim_id).call()[1])
            opener = functions.caseOf(defense.key).call()[0]
            if not defense.dismissed and not wrong and int(opener, 16) != 0:
                client.sender.transact(self.prover.contract, "dismissCase", (defense.key, defense.claim_id),
                                       "dismiss the case on this node's contribution")
                logger.warning("round %d stage %d: the case on this node's contribution is dismissed (the "
                               "opener's bond is this node's)", defense.round, defense.stage)
            defense.dismissed = True
            if functions.balanceOf(client.address).call():
                client.sender.transact(self.prover.contract, "withdraw", (), "withdraw the case winnings")

