"""The end relation of a contribution (issue 78; docs/FRAUD_PROOF.md "The claim's end", built on chain for
runs with the plain end rule, and "The carried state", designed): what an end dispute recomputes for one
element (StepProverMath.endHolds, with nothing carried), here for every element.

An honest replica's payload codes, element by element of each stage tensor, the target ``v = fl(S - E)``
(``S`` its round start, ``E`` its weights after the inner steps) plus its carried residual where it has one
(``v = fl(g + e)``); a raw piece holds ``v`` itself, a quant piece ``q = clamp(rne(fl(v / max(s, tiny))),
-qmax(b), qmax(b))`` with ``s`` its column's scale (training/codec/coding.py ``ColumnQuantizer._round``) and
``b`` the tensor's bit width; a low-rank piece is a factorization of the whole matrix, not checkable element
by element. :func:`end_relation` checks a payload blob against ``S``, ``E`` (and ``e``) and names the elements
that break the relation: the reference of the on-chain check (tests/test_end_relation_chain.py: the contract
refuses exactly the elements this names), and the evidence that the run's encoder codes by exactly that
relation (tests/test_end_relation.py).

:func:`program_end` is the ``E`` the relation assumes, from the committed start ``S`` alone: the round's inner
steps run by a new trainer loaded with ``S``, its inner optimizer new (zero moments, step count 0). A node's
own ``E`` is that exactly when its run carries nothing between rounds (``training.inner_state = "fresh"``,
``diloco.put_back = false``, error feedback off) and trains each round from the committed start
(``diloco.one_step_delay = false``): tests/test_fresh_inner_state.py checks a node engine's contributions
against it, bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import msgpack
import numpy as np
import torch

from training.codec_exact import qmax, unpack_ints
from training.codec_wire import matrix_view_shape

_TINY = torch.finfo(torch.float32).tiny


@dataclass
class EndRelation:
    """Per codec, how many elements were checked, and the first elements (tensor, element, why) that break
    the relation; ``unchecked`` counts a low-rank tensor's elements (not checkable element by element)."""

    checked: dict[str, int] = field(default_factory=dict)
    unchecked: int = 0
    broken: list[tuple[str, int, str]] = field(default_factory=list)

    @property
    def holds(self) -> bool:
        return not self.broken


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int32).numpy()


def end_relation(start: Mapping[str, torch.Tensor], end: Mapping[str, torch.Tensor], blob: bytes,
                 residual: Mapping[str, torch.Tensor] | None = None, limit: int = 8) -> EndRelation:
    """Check ``blob`` (a codec blob of the stage's tensors) against ``start``, ``end`` and the carried
    ``residual`` (None: none); at most ``limit`` broken elements are named."""
    entries = {entry["n"]: entry for entry in msgpack.unpackb(bytes(blob), raw=False)["t"]}
    out = EndRelation()
    for name in sorted(start, key=lambda n: n.encode()):
        g = torch.sub(start[name].to(torch.float32), end[name].to(torch.float32))
        v = g if residual is None else torch.add(g, residual[name].to(torch.float32))
        m, n = matrix_view_shape(tuple(start[name].shape))
        v = v.reshape(m, n)
        entry = entries[name]
        codec = entry["c"]
        if codec == "lowrank":
            out.unchecked += m * n
            continue
        if codec == "raw":
            sent = torch.from_numpy(np.frombuffer(entry["d"], dtype="<f4").copy()).reshape(m, n)
            same = (_bits(sent) == _bits(v)) | (torch.isnan(sent) & torch.isnan(v)).numpy()
        else:
            bits = int(entry["b"])
            q = unpack_ints(entry["q"], bits, m * n, name).reshape(m, n).to(torch.float32)
            scales = torch.from_numpy(np.frombuffer(entry["x"], dtype="<f4").copy()).reshape(1, n)
            limit_q = float(qmax(bits))
            expected = torch.clamp(torch.round(torch.div(v, scales.clamp_min(_TINY))), -limit_q, limit_q)
            same = (expected == q).numpy()
        out.checked[codec] = out.checked.get(codec, 0) + m * n
        for flat in np.flatnonzero(~same.reshape(-1))[:max(0, limit - len(out.broken))]:
            out.broken.append((name, int(flat), f"{codec} piece is not the coding of start - end"))
    return out


def program_end(model_cfg, training_cfg, start: Mapping[str, torch.Tensor], batches, outer_round: int,
                inner_steps: int, lr_total_steps: int | None, num_stages: int = 1,
                micro_batches: int = 1) -> dict[str, torch.Tensor]:
    """The end weights (the full model's, by name) of round ``outer_round``'s program from ``start`` (the
    full model's committed weights, by name) alone: a new :class:`~training.pipeline.LocalReplicaTrainer`
    (``num_stages`` stages, its inner optimizers new) loaded with ``start`` runs one inner step per batch
    of ``batches`` (the replica's round batches, in order) at the run's inner lr ``inner_lr(t * H + k)``
    (``inner_steps`` H, ``lr_total_steps`` the schedule's horizon), ``micro_batches`` slices a step."""
    from training.pipeline import LocalReplicaTrainer
    from training.schedule import inner_lr, set_lr

    trainer = LocalReplicaTrainer(model_cfg, training_cfg, num_stages,
                                  state_dict={name: value.clone() for name, value in start.items()})
    for step, (x, y) in enumerate(batches):
        set_lr(trainer.optimizers, inner_lr(training_cfg, outer_round * inner_steps + step, lr_total_steps))
        trainer.train_step(x, y, micro_batches)
    return trainer.state_dict()
