"""The replay side of an audit: the bit-exact replay of every round, the checkpoints.

The run document (sha256 = the chain's ``configHash``) pins the model, the seed and so the initial
weights, and the DiLoCoX outer-step settings. :class:`Replayer` advances every stage's global state round
by round with :func:`training.diloco.aggregate` (DiLoCo Algorithm 1's outer step, arXiv 2311.08105) and
compares the weights root with the commit's; a published checkpoint is checked against the chain and,
when the replay reached its round, against the replayed state, and restarts the replay after a gap.
The run document they start from is checked by node/tools/audit_rundoc.py. See docs/AUDIT.md.
"""

import time
from pathlib import Path
from typing import Any

from node.errors import DLX_ERRORS, StateError
from node.tools.evidence import checkpoint_digest, first_good_copy
from node.tools.report import FAIL, OK, UNVERIFIABLE, AuditReport, Check, RoundVerdict


class ScreeningUnavailable(Exception):
    """A round's screening cannot be re-derived here (the run's training text is missing)."""


class Replayer:
    """The global state of every stage, advanced round by round with the canonical aggregation."""

    def __init__(self, document: dict, data_path: str | Path | None = None) -> None:
        from node.runconfig import node_config_from_run
        from training.stages import split_stages, stage_param_names

        self.cfg = node_config_from_run(document)
        self.scheme = self.cfg.commitment_scheme
        self.num_stages = self.cfg.pipeline.num_stages
        specs = split_stages(self.cfg.model.n_layer, self.num_stages)
        self.names = [stage_param_names(self.cfg.model, spec) for spec in specs]
        self.weights: list[dict] | None = None
        self.momentum: list[dict] | None = None
        self.base = ""  # where the current state came from
        self.base_problem = ""  # why there is no starting state (an imported model's weights are missing)
        self.tokenizer_dirs: list = []  # where the run's sha256: tokenizer is (node/tools/audit_inputs.py)
        self.last_excluded: list[tuple[int, int, str, str]] = []
        # round -> [[stage, replica, peer id, envelope hash, reason, detail], ...] of each round whose replay
        # reproduced the committed weights root: the exclusions the run applied (a rerun of the next round
        # through the run's peers needs them: node/tools/audit_peer_archives.py)
        self.exclusions: dict[int, list[list]] = {}
        self._corpus_cache = None
        self.data_path = data_path
        self.data_sha256 = document.get("training", {}).get("data_sha256", "")
        self.sources: list = []  # where a sliced round's partials and slice blobs are (audit_sliced.py)
        self.run_id = 0
        # A chunked run's stage states (ledger.chunkproof.StageState) after the last replayed round and the
        # round before it: what the audit's fraud proof opens (node/tools/audit_proof.py). None: not known.
        self.states: list | None = None
        self.prev_states: list | None = None

    def start_from_initial(self) -> None:
        from training.diloco import zero_outer_state
        from training.errors import TrainingError
        from training.model import init_state_dict

        try:
            full = init_state_dict(self.cfg.model, self.cfg.training.seed)
        except TrainingError as exc:  # an imported model's weights, not here or not the run's
            self.drop()
            self.base_problem = f"the run's initial weights: {exc}"
            return
        self.base_problem = ""
        self.weights = [{n: full[n] for n in names} for names in self.names]
        self.momentum = [zero_outer_state(self.cfg.diloco, {n: full[n] for n in names})
                         for names in self.names]
        self.base = "initial weights"
        self._states_from_weights()

    def start_from_checkpoint(self, ckpt: Any) -> None:
        import torch

        self.weights, self.momentum = [], []
        for names in self.names:
            weights, momentum = ckpt.stage_state(names)
            self.weights.append({n: weights[n].to(torch.float32) for n in names})
            self.momentum.append({n: momentum[n].to(torch.float32) for n in names})
        self.base = f"checkpoint of round {ckpt.round}"
        self._states_from_weights()

    def _states_from_weights(self) -> None:
        """The stage states of a starting point (no round's factors: only its chunks are ever opened)."""
        self.prev_states = None
        if self.scheme.chunked:
            from node.fraudproof import initial_state

            self.states = [initial_state(stage, w, m)
                           for stage, (w, m) in enumerate(zip(self.weights, self.momentum))]

    def drop(self) -> None:
        self.weights = self.momentum = None
        self.states = self.prev_states = None

    def _corpus(self):
        """The run's training text (for screening batches), or None if this machine does not have it.

        The run document pins the text by sha256 (or "generated": the project's own corpus); a
        ``--data`` file is used only if it hashes to that. A prepared dataset (``manifest:<root>``) is read
        from a ``--data`` directory exactly as nodes read it, only if it is the run's (root, tokenizer,
        vocabulary, every shard checked); :attr:`corpus_problem` says why not.
        """
        if self._corpus_cache is None:
            from dataclasses import replace

            from node.runconfig import file_sha256
            from node.tools.audit_dataset import dataset_from_peers
            from training.data import check_corpus, corpus_from_config
            from training.shards import ROOT_PREFIX
            from training.sharded_corpus import open_run_dataset

            try:
                if self.data_sha256.startswith(ROOT_PREFIX):
                    if not self.data_path:  # its peers serve it (node/tools/audit_dataset.py)
                        self.data_path = dataset_from_peers(self.sources, self.data_sha256[len(ROOT_PREFIX):])
                    if not self.data_path:
                        raise FileNotFoundError(
                            f"the run trained on the prepared dataset {self.data_sha256[:25]}...; "
                            "pass its directory with --data DIR")
                    corpus = open_run_dataset(self.data_path, self.data_sha256, self.cfg.model.tokenizer,
                                              self.cfg.model.vocab_size)
                    check_corpus(corpus, self.cfg.model.block_size)
                    self._corpus_cache = corpus
                    return corpus
                if self.data_sha256 == "generated":
                    training = replace(self.cfg.training, data_path="")
                elif not self.data_path:
                    raise FileNotFoundError(
                        f"the run trained on a text of sha256 {self.data_sha256[:16]}...; "
                        "pass it with --data FILE")
                elif file_sha256(self.data_path) != self.data_sha256:
                    raise ValueError(f"{self.data_path} does not hash to the run's training text "
                                     f"{self.data_sha256[:16]}...")
                else:
                    training = replace(self.cfg.training, data_path=str(self.data_path))
                self._corpus_cache = corpus_from_config(training, self.cfg.model, self.tokenizer_dirs)
            except (*DLX_ERRORS, OSError, ValueError) as exc:
                self._corpus_cache = exc
        return None if isinstance(self._corpus_cache, Exception) else self._corpus_cache

    @property
    def corpus_problem(self) -> str:
        """Why the run's training data is not available here ("" when it is, or was not looked for yet)."""
        return str(self._corpus_cache) if isinstance(self._corpus_cache, Exception) else ""

    def screened(self, round_index: int, payloads_by_stage: list[list[bytes]]) -> dict[int, str]:
        """The screening exclusions of a round, re-derived (docs/DILOCOX.md section 10); {} if the run does
        not screen. Raises ScreeningUnavailable without the training text (the held-out batch comes from
        it)."""
        if not (self.cfg.diloco.screening and self.num_stages == 1):
            return {}
        from training.screening import (
            decode_full,
            model_loss_fn,
            screen_contributions,
            screening_batch,
            screening_exclusions,
            screening_steps,
        )

        corpus = self._corpus()
        if corpus is None:
            raise ScreeningUnavailable(f"the run screens contributions on its held-out text, which is not "
                                       f"available here ({self._corpus_cache})")
        shapes = {name: tuple(t.shape) for name, t in self.weights[0].items()}
        refuse_raw = self.cfg.compression.enabled
        decoded = [decode_full([blob], [shapes], outer_round=round_index, refuse_raw=refuse_raw)
                   for blob in payloads_by_stage[0]]
        x, y = screening_batch(corpus, self.cfg.training.seed, round_index, self.cfg.diloco.screen_batch_size,
                               self.cfg.model.block_size)
        reports = screen_contributions(model_loss_fn(self.cfg.model, x, y), self.weights[0], decoded,
                                       self.cfg.diloco, screening_steps(self.cfg.diloco,
                                                                        [[b] for b in payloads_by_stage[0]]))
        return screening_exclusions(reports)

    def apply_sliced(self, round_index: int, payloads_by_stage: list[list[bytes]],
                     peers_by_stage: list[list[str]], notes: list[str], checks: list,
                     hashes_by_stage: list[list[bytes]]) -> bytes:
        """:meth:`apply` of a sliced round: the average of each stage re-derived from its partials
        (node/tools/audit_sliced.py); raises ScreeningUnavailable when the archives lack them."""
        from node.tools.audit_sliced import SlicedEvidenceMissing, sliced_average
        from training.diloco import step_with_average

        hashes, new_weights, new_momentum = [], [], []
        for stage, payloads in enumerate(payloads_by_stage):
            shapes = {name: tuple(t.shape) for name, t in self.weights[stage].items()}
            try:
                average = sliced_average(self.cfg, self.run_id, round_index, stage, shapes, payloads,
                                         peers_by_stage[stage], self.sources, notes, checks,
                                         hashes_by_stage[stage])
            except SlicedEvidenceMissing as exc:
                raise ScreeningUnavailable(str(exc)) from None
            result = step_with_average(self.weights[stage], self.momentum[stage], average, self.cfg.diloco,
                                       round_index)
            new_weights.append(result.new_global)
            new_momentum.append(result.new_momentum)
            hashes.append(result.weights_hash)
        self.weights, self.momentum, self.last_excluded = new_weights, new_momentum, []
        return self.scheme.weights_root(hashes, [])  # a sliced run's scheme is hashed (its configuration)

    def apply(self, round_index: int, payloads_by_stage: list[list[bytes]],
              applied_by_stage: list[list[bytes]] | None = None,
              envelopes_by_stage: list[list[bytes]] | None = None,
              bindings_by_stage: list[list] | None = None) -> bytes:
        """Aggregate every stage of ``round_index``; return the new weights root (a chunked run's: version 2,
        over the stage leaves derived with ``envelopes_by_stage``, the envelope digests in the same order;
        the stage states are kept in ``self.states``, the round before's in ``self.prev_states``).

        The contributions the nodes had to leave out (training.robust: undecodable, wrong shape,
        non-finite, forbidden codec, screened, and built on another result of the round before than
        the replayed one: ``applied_by_stage``, the bodies' applied hashes in the same order) are
        re-derived and left out here too; they are listed in ``self.last_excluded`` as (stage, index,
        reason, detail).
        """
        from node.binding import other_result_exclusions
        from node.commitments import stage_state
        from training.diloco import aggregate_with_report
        from training.hashing import stage_weights_hash

        screened = self.screened(round_index, payloads_by_stage)
        hashes, new_weights, new_momentum, self.last_excluded, states = [], [], [], [], []
        for stage, payloads in enumerate(payloads_by_stage):
            excluded = dict(screened) if stage == 0 else {}
            if applied_by_stage is not None:
                excluded.update(other_result_exclusions(self.cfg.diloco, round_index, applied_by_stage[stage],
                                                        stage_weights_hash(self.weights[stage])))
            result = aggregate_with_report(
                self.weights[stage],
                self.momentum[stage],
                payloads,
                self.cfg.diloco,
                stage_index=stage,
                outer_round=round_index,
                compression_cfg=self.cfg.compression,
                excluded=excluded or None,
            )
            new_weights.append(result.new_global)
            new_momentum.append(result.new_momentum)
            hashes.append(result.weights_hash)
            self.last_excluded += [(stage, r.index, r.reason, r.detail) for r in result.contributions
                                   if not r.accepted]
            if self.scheme.chunked:
                states.append(stage_state(stage, result, payloads, self.cfg.diloco, round_index,
                                          envelopes=None if envelopes_by_stage is None
                                          else envelopes_by_stage[stage],
                                          decode_args={"stage_index": stage, "outer_round": round_index,
                                                       "refuse_raw": self.cfg.compression.enabled},
                                          bindings=None if bindings_by_stage is None
                                          else bindings_by_stage[stage]))
        self.weights, self.momentum = new_weights, new_momentum
        if self.scheme.chunked:
            self.prev_states, self.states = self.states, states
        return self.scheme.weights_root(hashes, [state.leaf().encode() for state in states])


def check_replay(
    verdict: RoundVerdict,
    commit: Any,
    replayer: Replayer | None,
    payloads: list[list[bytes]] | None,
    replay: bool,
) -> bytes | None:
    """The replayed weights root of one round against the commit (one item in ``verdict``).

    Returns the replayed root (to judge a disputer's record against it), or None if the round was not
    replayed.
    """
    from training.errors import TrainingError

    if not replay:
        verdict.checks.append(Check("weights root (replay)", UNVERIFIABLE, "replay skipped (--no-replay)"))
        return None
    if replayer is None:
        verdict.checks.append(Check("weights root (replay)", UNVERIFIABLE, "no verified run document"))
        return None
    if payloads is None:
        replayer.drop()
        verdict.checks.append(Check("weights root (replay)", UNVERIFIABLE, "contributions not verified"))
        return None
    if replayer.weights is None:
        verdict.checks.append(
            Check(
                "weights root (replay)",
                UNVERIFIABLE,
                replayer.base_problem or "no starting state: an earlier round "
                "could not be replayed and no checkpoint of the previous round was verified",
            )
        )
        return None
    started = time.perf_counter()
    try:
        if replayer.cfg.diloco.sliced:
            peers = [[c.peer_id for c in verdict.contributors if c.stage == stage]
                     for stage in range(len(payloads))]
            hashes = [[bytes.fromhex(c.envelope) for c in verdict.contributors if c.stage == stage]
                      for stage in range(len(payloads))]
            root = replayer.apply_sliced(commit.round, payloads, peers, verdict.notes, verdict.checks, hashes)
        else:
            applied = [[bytes.fromhex(c.applied) for c in verdict.contributors if c.stage == stage]
                       for stage in range(len(payloads))]
            envelopes = [[bytes.fromhex(c.envelope) for c in verdict.contributors if c.stage == stage]
                         for stage in range(len(payloads))]
            bindings = [[_binding(c.binding) for c in verdict.contributors if c.stage == stage]
                        for stage in range(len(payloads))]
            root = replayer.apply(commit.round, payloads, applied, envelopes, bindings)
    except ScreeningUnavailable as exc:
        replayer.drop()
        verdict.checks.append(Check("weights root (replay)", UNVERIFIABLE, str(exc)))
        return None
    except TrainingError as exc:
        replayer.drop()
        verdict.checks.append(
            Check("weights root (replay)", FAIL, f"the committed contributions do not aggregate: {exc}")
        )
        return None
    verdict.replay_seconds = time.perf_counter() - started
    for stage, index, reason, detail in replayer.last_excluded:
        verdict.notes.append(f"stage {stage} contribution {index} excluded ({reason}): {detail}")
    if root == commit.weights_root:
        verdict.checks.append(Check("weights root (replay)", OK, f"from {replayer.base}"))
        replayer.exclusions[commit.round] = _listed_exclusions(verdict, replayer.last_excluded)
    else:
        # Keep the replayed (honest) state: later rounds are checked against what the contributions imply.
        verdict.checks.append(
            Check(
                "weights root (replay)",
                FAIL,
                f"replayed {root.hex()} != committed {commit.weights_root.hex()}",
            )
        )
    return root


def _listed_exclusions(verdict: RoundVerdict, excluded: list[tuple[int, int, str, str]]) -> list[list]:
    """The replay's exclusions (stage, index in the stage's list, reason, detail) as round.json's ``excluded``
    entries: [stage, replica, peer id, envelope hash, reason, detail]."""
    by_stage: dict[int, list] = {}
    for contributor in verdict.contributors:
        by_stage.setdefault(contributor.stage, []).append(contributor)
    listed = []
    for stage, index, reason, detail in excluded:
        contributor = by_stage[stage][index]
        listed.append([stage, contributor.replica, contributor.peer_id, contributor.envelope, reason, detail])
    return listed


def check_checkpoint(
    report: AuditReport,
    record: Any,
    commit: Any,
    sources: list,
    replayer: Replayer | None,
    layout: Any,
) -> Any:
    """Check one published checkpoint; return it parsed if it is the run's (metadata and tensors as the run
    document gives them, weights root the committed one).

    ``layout`` is the run document's :class:`node.store.checkpoint.RunLayout`, None when no verified run
    document was found: then the content hash is all that can be checked, and the item is unverifiable
    (a file's own metadata proves nothing about the run).
    """
    import torch

    from node.store.checkpoint import checkpoint_problems, parse_checkpoint

    name = f"checkpoint of round {record.round} {record.content_hash.hex()[:16]}"

    def add(status: str, reason: str = "") -> None:
        report.checkpoints.append(Check(name, status, reason, round=record.round))

    expected = record.content_hash.hex()
    copy = first_good_copy(sources, lambda src: src.checkpoint(record.round, expected), expected,
                           checkpoint_digest(layout, expected))
    if copy.data is None:
        if copy.bad:
            add(FAIL, "no copy has the published content hash: " + "; ".join(copy.bad))
        else:
            add(UNVERIFIABLE, "file not held by any archive or peer")
        return None
    try:
        ckpt = parse_checkpoint(copy.data)  # its hash checked (a header-hashed run's: its header's)
    except StateError as exc:
        add(FAIL, f"content hash right but not a valid checkpoint: {exc}")
        return None
    problems = [] if commit is not None else ["its round was never committed"]
    if layout is None:
        if problems:
            add(FAIL, "; ".join(problems))
        else:
            add(UNVERIFIABLE,
                "content hash right; no verified run document to check its config and tensors against")
        return None
    problems += checkpoint_problems(ckpt, layout, record.round, commit.weights_root if commit is not None
                                    else None)
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
    basis = ("header hash, every stage's chunks against its leaf" if layout.header_hashed else
             "content hash") \
        + ", the run document's config and stages, weights root" + (
        ", replayed state" if replayer is not None and replayer.weights is not None else ""
    )
    add(OK, basis)
    return ckpt


def _binding(hexed: str) -> tuple[str, bytes] | None:
    """A contributor's ``(account, signature)`` from its audit entry's ``binding`` (issue 62), or None."""
    from eth_utils import to_checksum_address

    data = bytes.fromhex(hexed)
    return (to_checksum_address(data[:20]), data[20:]) if len(data) == 85 else None
