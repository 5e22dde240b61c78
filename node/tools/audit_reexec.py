"""``dlx-node audit --reexecute N``: rerun sampled contributions and every ejection's evidence.

Contributions bind their replica's start state and data (docs/PROTOCOL.md, "Spot
checks"); the nodes keep their start states as blobs (``<data_dir>/blobs``) and
the evidence of their accusations under ``<data_dir>/evidence``. Given the
archives (node data directories), the auditor:

* reruns ``N`` contributions (or all), sampled from the run's chain head so that
  no member can predict them, and reports each as reproduced (bit-exact or
  within tolerance) or not, with the distance. A contribution that does not
  reproduce fails the audit unless its member was found guilty on chain for it
  (the run already caught the cheat);
* for every accusation decided guilty on chain, reruns the evidence's
  contribution: the ejection stands only if the rerun fails too.

Each rerun follows the platform rule (docs/DILOCOX.md section 11): a contribution whose claimed
platform is this auditor's is rerun here and must be bit-exact ("exact"); one trained on this CPU
model under another instruction set this CPU has is rerun in a child under the claimant's
``ATEN_CPU_CAPABILITY`` and must be bit-exact too ("emulated"); any other is judged by the
three-zone tolerance ("tolerance": passed, undecided, which leaves the item unverifiable until an
auditor of that platform reruns it, or a mismatch). Each item's line names which. A claimed platform
must be the one its member declared on chain when it joined (``MemberJoined``'s ``platform``, the seat
in force at the round's commit): one that is not does not reproduce.

A contribution or piece of evidence whose inputs are not in the archives is
unverifiable, never passed. A sliced run's contribution (``diloco.exchange =
"sliced"``) is rerun against the slices its reference binds, from the member's
archived bundle, as the nodes' spot checks do (node/tools/audit_sliced.py,
``SlicedRerunArchive``); an ejection whose evidence is a sliced proof (a wrong
partial, a bad bundle) is judged by the members' rule (node/tools/audit_slicedproof.py).
"""

from __future__ import annotations

import hashlib
import logging

from node import protocol as msg
from node.tools.audit_archives import AuditArchives
from node.tools.audit_sliced import SlicedBundleFails, SlicedInputsMissing, SlicedRerunArchive
from training.errors import TrainingError
from p2p.envelope import decode_envelope

logger = logging.getLogger(__name__)

MAX_BLOB = 1 << 32  # the largest envelope the audit decodes
#: How many rounds back the audit looks for a kept start state to replay a missing one from (rebuilt_parts)
REBUILD_ROUNDS = 64


def sample_contributions(pairs: list[tuple[int, int]], head: bytes, count: int) -> list[tuple[int, int]]:
    """``count`` (round, replica) pairs ordered by sha256(head || round || replica); all if count < 0."""
    ranked = sorted(pairs,
                    key=lambda p: hashlib.sha256(head + p[0].to_bytes(8, "big") + p[1].to_bytes(8, "big"))
                    .digest())
    return sorted(ranked if count < 0 else ranked[:count])


class ReexecAuditor:
    """Reruns contributions for the audit (module docstring)."""

    def __init__(self, replayer, archives, run_id: int, run_rounds: int, history=None, *,
                 processes: int = 1) -> None:
        self.replayer = replayer  # node.tools.audit_replay.Replayer: the run's settings and corpus
        self.processes = processes  # a cluster's claim of N <= processes reruns on N ranks (cluster_rerun)
        self.cfg = replayer.cfg
        # The inner-lr horizon is rounds x H; the run's length is fixed on chain (maxRounds), not in
        # the run document.
        self.run_rounds = run_rounds
        # node data directories, or an object that reads like them (the run's peers: audit_peer_archives.py)
        self.archives = archives if hasattr(archives, "sealed") else AuditArchives(archives, run_id)
        self.sealed = self.archives.sealed()
        self.sliced = SlicedRerunArchive(self.cfg, self.archives, self.sealed)
        self.history = history  # ledger.records.RunHistory: the declared platforms (declared_platform)
        self._replayed: dict = {}  # replica -> the last start state rebuilt_parts replayed

    def _envelopes(self, round_index: int, replica: int) -> list | None:
        """The replica's envelope of every stage of the round, in stage order (None: not all in the archives).

        A stage the close left out (its contribution came after the deadline) while another stage of the
        replica was aggregated is taken from its signer's own archive, which keeps it (``left_out_own``): the
        rerun of a replica runs its whole pipeline, so it needs every stage's start state and claim."""
        entries = [(e, True) for e in self.sealed.get(round_index, []) if int(e[1]) == replica]
        stages = {int(e[0]) for e, _ in entries}
        entries += [(e, False) for e in self.archives.left_out_own(round_index)
                    if e[1] == replica and e[0] not in stages and e[0] < self.cfg.pipeline.num_stages]
        envs = []
        for (stage, _replica, peer, hash_hex), bound in sorted(entries, key=lambda item: int(item[0][0])):
            data = self.archives.envelope(round_index, hash_hex)
            if data is None:
                return None
            env = decode_envelope(data, MAX_BLOB)
            # A left-out entry is bound by no root on chain: it
            # must be the replica's signed contribution itself.
            if not bound and (env.kind, env.round, env.stage, env.replica, env.sender_peer_id) != \
                    (msg.CONTRIBUTION, round_index, int(stage), replica, peer):
                return None
            envs.append(env)
        return envs if [e.stage for e in envs] == list(range(self.cfg.pipeline.num_stages)) else None

    def _previous(self, round_index: int):
        """(payloads by stage, exclusions by stage) of round ``round_index`` as the rerun of the next round
        needs them; (None, why not) when the sources lack them."""
        if round_index < 0:
            return {}, {}
        entries = self.sealed.get(round_index)
        where = getattr(self.archives, "where", "the archives")
        if entries is None:
            return None, f"round {round_index}'s contributions are not in {where}"
        unknown = getattr(self.archives, "exclusions_unknown", None)
        why = unknown(round_index) if unknown is not None else ""
        if why:
            return None, why
        previous: dict[int, list[bytes]] = {}
        where: dict[str, tuple[int, int]] = {}
        for stage, _replica, _peer, hash_hex in entries:
            data = self.archives.envelope(round_index, hash_hex)
            if data is None:
                return None, f"round {round_index}'s contributions are not in {where}"
            payloads = previous.setdefault(int(stage), [])
            where[hash_hex] = (int(stage), len(payloads))
            payloads.append(msg.decode_contribution_body(decode_envelope(data, MAX_BLOB).payload).blob)
        excluded: dict[int, dict[int, str]] = {}
        for stage, _replica, _peer, hash_hex, reason, detail in self.archives.excluded(round_index):
            # what the engine cannot re-derive
            if reason in ("screened", "other_result") and hash_hex in where:
                s, i = where[hash_hex]
                excluded.setdefault(s, {})[i] = str(detail)
        return previous, excluded

    def declared_platform(self, peer_id: str, round_index: int) -> bytes | None:
        """The platform ``peer_id`` declared on chain when it joined (``MemberJoined``), in the seat in force
        when round ``round_index`` was committed (None: no chain history here, or no such seat)."""
        seat = self._seat(peer_id, round_index)
        return None if seat is None else seat.platform

    def _seat(self, peer_id: str, round_index: int):
        """``peer_id``'s membership in force when round ``round_index`` was committed (None: no chain history
        here, or no such seat)."""
        if self.history is None:
            return None
        commits = [c for c in self.history.commits if c.commit.round == round_index]
        if not commits:
            return None
        seats = [m for m in self.history.members_at(commits[-1].position) if peer_of(m.node_key) == peer_id]
        return seats[-1] if seats else None

    def data_key(self, round_index: int, envs) -> tuple[bytes | None, str]:
        """(the key the replica's windows were drawn by, "") in a run keyed by account
        (``training.data_windows = "account"``): the account of the signer of its stage-0 contribution, as its
        seat in force at the round's commit names it; (None, "") in a run drawn by replica index; (None, why)
        where the seat is not known here."""
        if self.cfg.training.data_windows != "account":
            return None, ""
        signer = next((e.sender_peer_id for e in envs if e.stage == 0), None)
        seat = None if signer is None else self._seat(signer, round_index)
        if seat is None:
            return None, ("the run draws its data windows by account, and the account of the stage-0 signer "
                          "is not in the chain history here")
        return bytes.fromhex(seat.account.removeprefix("0x")), ""

    def check(self, round_index: int, replica: int, envs=None):
        """(verdict or None if unverifiable, reason, distance) of rerunning (round, replica), by the platform
        rule (module docstring); the result's ``how`` is "exact", "emulated" or "tolerance"."""
        from training.fingerprint import MISMATCH
        from training.reexec import ContributionClaim, SpotCheck

        envs = envs or self._envelopes(round_index, replica)
        if envs is None:
            why = getattr(self.archives, "no_contributions", "its contributions are not in the archives")
            return None, why, None
        bodies = [msg.decode_contribution_body(e.payload) for e in envs]
        parts = [self.archives.blob(b.state_hash.hex()) for b in bodies]
        if any(p is None for p in parts):
            parts, why = self.rebuilt_parts(round_index, replica, [b.state_hash for b in bodies])
            if parts is None:
                why = getattr(self.archives, "no_start_state",
                              "its start state is not in the archives' blob stores") + f" ({why})"
                return None, why, None
        payloads, partials = [b.blob for b in bodies], None
        if self.cfg.diloco.sliced:  # its envelopes carry slice references, not codec blobs
            try:
                payloads = self.sliced.claims(round_index, envs)
            except SlicedBundleFails as exc:  # its own signed record disproves it: a failing rerun
                return SpotCheck(round_index, replica, MISMATCH, str(exc), failed_stages=(exc.stage,)), \
                    str(exc), None
            except SlicedInputsMissing as exc:
                return None, f"sliced contribution: {exc}", None
            try:
                partials = self.sliced.previous(round_index - 1)
            except SlicedInputsMissing as exc:
                return None, f"sliced contribution: {exc}", None
            previous, excluded = {}, {}
        else:
            previous, excluded = self._previous(round_index - 1)
            if previous is None:
                return None, excluded, None
        held = {int(e[0]) for e in self.sealed.get(round_index - 1, []) if int(e[1]) == replica}
        dropped = [s for s in range(self.cfg.pipeline.num_stages) if s not in held] if round_index > 0 else []
        corpus = self.replayer._corpus()
        if corpus is None:
            return None, f"the run's training data is not available here ({self.replayer.corpus_problem})", \
                None
        claims = [ContributionClaim(e.stage, b.state_hash, b.data_commitment, p, b.applied_hash)
                  for e, b, p in zip(envs, bodies, payloads)]
        undeclared = self._undeclared(round_index, envs, parts)
        if undeclared is not None:
            stage, reason = undeclared
            return SpotCheck(round_index, replica, MISMATCH, reason, failed_stages=(stage,)), reason, None
        data_key, why = self.data_key(round_index, envs)
        if why:
            return None, why, None
        result = rerun_by_rule(parts, claims, corpus, self.cfg.model, self.cfg.training, self.cfg.diloco,
                               self.cfg.compression, outer_round=round_index, replica=replica,
                               run_rounds=self.run_rounds, previous_contributions=previous or None,
                               previous_excluded=excluded, previous_dropped=dropped,
                               previous_partials=partials or None, processes=self.processes,
                               data_key=data_key)
        distance = max(result.distances.values()) if result.distances else None
        return result, result.reason, distance

    def _kept_state(self, round_index: int, replica: int):
        """The replica's start state of ``round_index`` if the archives keep every stage of it (parsed), else
        None; raises LookupError where the round's envelopes are not there either."""
        from training.replica_state import ReplicaStartState, parse_stage_state

        envs = self._envelopes(round_index, replica)
        if envs is None:
            raise LookupError(f"round {round_index}'s contributions of replica {replica} are not here")
        parts = [self.archives.blob(msg.decode_contribution_body(e.payload).state_hash.hex()) for e in envs]
        if any(p is None for p in parts):
            return None
        return ReplicaStartState(tuple(parse_stage_state(p) for p in parts))

    def rebuilt_parts(self, round_index: int, replica: int, wanted: list[bytes]) -> tuple[list | None, str]:
        """(the replica's start-state parts of ``round_index``, "") replayed from the newest start state of it
        the archives keep from an earlier round (a node keeps one every ``storage.start_state_every`` rounds
        and rebuilds the others when asked: node/live/checks/staterebuild.py), its rounds rerun as a spot
        check reruns them and the result's hashes checked against ``wanted`` (what the envelopes bind);
        (None, why not) where it cannot be. The last state replayed is kept for the replica's next round."""
        state = self._replayed.get(replica)
        if state is not None and state.meta.outer_round > round_index:
            state = None
        try:
            for anchor in range(round_index - 1, max(-1, round_index - 1 - REBUILD_ROUNDS), -1):
                if state is not None and state.meta.outer_round >= anchor:
                    break
                state = self._kept_state(anchor, replica)
                if state is not None:
                    break
        except LookupError as exc:
            return None, f"no kept start state to replay it from: {exc}"
        if state is None:
            return None, f"no start state of replica {replica} kept in the {REBUILD_ROUNDS} rounds before"
        corpus, start = self.replayer._corpus(), state.meta.outer_round
        if corpus is None:
            return None, f"the run's training data is not available here ({self.replayer.corpus_problem})"
        while state.meta.outer_round < round_index:
            outer_round = state.meta.outer_round
            try:
                state = self._replay_round(state, corpus, replica)
            except (SlicedInputsMissing, ValueError, TrainingError) as exc:
                self._replayed.pop(replica, None)
                return None, f"replaying round {outer_round} from round {start}'s kept start state: {exc}"
        self._replayed[replica] = state
        if state.stage_hashes() != list(wanted):
            return None, f"replayed from round {start}'s kept start state, it is not the state round " \
                         f"{round_index} binds"
        return [part.to_bytes() for part in state.stages], ""

    def _replay_round(self, state, corpus, replica: int):
        """Round ``state.meta.outer_round``'s rerun from ``state`` (consumed): the replica's next start state.
        Raises ValueError (inputs missing) or a TrainingError."""
        from training.reexec import claimed_steps, reexecute

        outer_round, partials, declared = state.meta.outer_round, None, None
        if self.cfg.diloco.sliced:
            previous, excluded, partials = {}, {}, self.sliced.previous(outer_round - 1)
        else:
            previous, excluded = self._previous(outer_round - 1)
            if previous is None:
                raise ValueError(excluded)
        keyed = self.cfg.training.data_windows == "account"
        envs = (self._envelopes(outer_round, replica) or []) if self.cfg.diloco.budgeted or keyed else []
        if self.cfg.diloco.budgeted:
            declared = claimed_steps(msg.decode_contribution_body(envs[0].payload).blob) if envs else None
        data_key, why = self.data_key(outer_round, envs)
        if why:
            raise ValueError(why)
        held = {int(e[0]) for e in self.sealed.get(outer_round - 1, []) if int(e[1]) == replica}
        dropped = [s for s in range(self.cfg.pipeline.num_stages) if s not in held] if outer_round else []
        cfg = self.cfg
        rerun = reexecute(state, corpus, cfg.model, cfg.training, cfg.diloco, cfg.compression,
                          previous_contributions=previous or None, previous_excluded=excluded,
                          previous_dropped=dropped, previous_partials=partials or None,
                          declared_steps=declared, processes=self.processes,  # copies: replayed on
                          data_key=data_key)
        if rerun.next_state is None:
            raise ValueError(f"the rerun of round {outer_round} gives no next start state (no delay)")
        return rerun.next_state

    def _undeclared(self, round_index: int, envs, parts) -> tuple[int, str] | None:
        """(stage, why) of the first stage whose claimed platform is not its signer's declared one."""
        from node.platforms import undeclared_claim

        declared = {e.sender_peer_id: self.declared_platform(e.sender_peer_id, round_index) for e in envs}
        return undeclared_claim([(e.stage, e.sender_peer_id, part) for e, part in zip(envs, parts)],
                                {peer: platform for peer, platform in declared.items()
                                     if platform is not None})

    def chain_broken(self, round_index: int, result, next_envs) -> tuple[bool | None, str, tuple[int, ...]]:
        """Whether round t+1's envelopes bind a start state that follows neither from the exact rerun
        ``result`` of round t nor from the record (None: cannot tell from these archives), why, and the
        stages whose state does not follow (judged stage by stage, as a split replica's stages are signed
        by different members)."""
        from training.reexec import EXACT, check_state_chain, restart_state_reason

        if result.next_state_hashes is None:
            return None, \
                f"the rerun of round {round_index} is not bit-exact here, so the chain cannot be judged", ()
        claimed = [msg.decode_contribution_body(e.payload).state_hash for e in next_envs]
        if check_state_chain(result.next_state_hashes, claimed) == EXACT:
            return False, f"round {round_index + 1} starts where the rerun of round {round_index} ends", ()
        differing = [stage for stage, h in enumerate(claimed) if h != result.next_state_hashes[stage]]
        parts = {stage: self.archives.blob(claimed[stage].hex()) for stage in differing}
        if any(p is None for p in parts.values()):
            return None, f"round {round_index + 1}'s start state is not in the archives' blob stores", ()
        # Structure only: the auditor has no per-stage weights hashes at hand here (nodes check the
        # global weights against their own hashes of the record).
        reasons = {stage: restart_state_reason([part], [claimed[stage]]) for stage, part in parts.items()}
        broken = tuple(stage for stage, why in reasons.items() if why is not None)
        if not broken:
            return False, f"round {round_index + 1} starts from the record (a restart)", ()
        return True, "; ".join(reasons[stage] for stage in broken), broken


def rerun_by_rule(state_parts, claims, corpus, *configs, **kwargs):
    """:func:`training.reexec.verify_contribution`, run where the platform rule says (module docstring):
    here, or in a child under the claimant's ATen CPU capability where this CPU has it. The result's
    ``how`` attribute says "exact", "emulated" or "tolerance". A reproducible run (``training.reproducible``)
    needs no child: its inner steps and its codec's encode are the same bits under every instruction set,
    math-library path and thread count."""
    import torch

    from training.errors import TrainingError
    from training.fingerprint import RULE_REPRODUCIBLE, RULE_SAME_PLATFORM, fingerprint
    from training.claimant_kernels import kernels_to_emulate, native_cpu_capability
    from training.replica_state import parse_stage_state
    from training.reexec import verify_contribution
    from training.rerun_child import verify_under_kernels

    try:
        claimed = parse_stage_state(state_parts[0], tensors=False).meta.platform  # its header only
    except (TrainingError, ValueError, IndexError):
        claimed = None  # verify_contribution gives the malformed state its verdict
    kernels = None if claimed is None else kernels_to_emulate(
        claimed, fingerprint(torch.device("cpu"), claimed.precision), native_cpu_capability())
    if configs[1].reproducible:
        kernels = None
    if kernels is not None:
        result = verify_under_kernels(kernels, state_parts=list(state_parts), claims=list(claims),
                                         corpus=corpus, model_cfg=configs[0], training_cfg=configs[1],
                                         diloco_cfg=configs[2], compression_cfg=configs[3], **kwargs)
    else:
        result = verify_contribution(state_parts, claims, corpus, *configs, **kwargs)
    exact = result.rule in (RULE_SAME_PLATFORM, RULE_REPRODUCIBLE)
    if exact:
        result.how = "emulated" if kernels is not None else "exact"
    else:
        result.how = "tolerance" if result.rule else ""
    return result


def how_judged(result) -> str:
    """The rule a rerun was judged by, for the audit's line: exact, emulated, tolerance, or why none."""
    if result.how:
        return result.how
    return "declared platform" if result.reason.startswith("declared platform") else "not rerun"


def peer_of(node_key: bytes) -> str | None:
    """The peer id of a seat's node key (None for a key that is not an ed25519 public key)."""
    from p2p.identity import peer_id_from_public_key

    try:
        return peer_id_from_public_key(node_key)
    except (ValueError, AttributeError, TypeError):
        return None


