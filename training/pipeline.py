"""Running one replica's pipeline stages: in one process, or one process per stage.

Both runners perform the same inner step (the "inner optimizer" of DiLoCo,
arXiv 2311.08105 Algorithm 1, here per stage as in DiLoCoX arXiv 2506.21263):

1. ``loss = mean cross-entropy over the batch``; backward (with ``micro_batches`` slices: each
   slice's mean loss back-propagated in slice order, the gradients divided by the slice count).
2. Global-norm gradient clipping over *all* stages' parameters::

       norm = sqrt(sum over stages s of sum_{g in stage s} ||g||^2)
       g   <- g * min(1, grad_clip / (norm + 1e-6))

   In the multi-process pipeline each stage computes its own sum of squares
   and the sums are all-reduced, so every stage scales by the same factor as
   the single-process run (``grad_clip = 0`` disables clipping).
3. One inner-optimizer step per stage (``training.optimizer``: AdamW, lr, betas, weight decay from
   :class:`training.config.TrainingConfig`, decay only on matrices, as GPT-2; or Muon for the hidden
   matrices and that AdamW for the rest, :mod:`training.muon`).

The three steps are one function, :func:`inner_step`: the chained trainer, the split pipeline's
stage, the re-execution (:mod:`training.reexec`, which reruns a split replica chained with its
micro-batch arithmetic) and the simulation all call it, with only how the gradients are produced
(``backward``) and how the squared norms are summed across processes (``reduce_sq_norm``) passed in.

:class:`LocalReplicaTrainer` chains the :class:`~training.stages.StageModule`
objects in one process. :class:`~training.pipeline_stage.PipelineStageTrainer` runs one stage per
process on a real ``torch.distributed.pipelining`` pipeline (gloo on CPU, NCCL
for the activations of stages on CUDA GPUs: :func:`training.pipeline_group.pipeline_backend`,
``ScheduleGPipe`` with ``micro_batches`` micro-batches; gradients are the mean
over micro-batches, which equals the full-batch mean because micro-batches have
equal size). Results agree up to float summation order (observed: ~1e-6 after a few steps).

Both run on ``training.device`` in ``training.precision`` (:mod:`training.platform`,
docs/GPU.md): float32 master weights and AdamW state on the device, the forward pass
in bfloat16 autocast with "bf16". Gradient norms and losses come back to the host.

Dropout draws random numbers in a different order in the two runners: the
equivalence holds for ``dropout = 0`` (the default).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from training import exact_kernel
from training.compiled import compile_modules
from training.config import ModelConfig, TrainingConfig
from training.errors import PipelineError
from training.exact_optim import exact_grad_sq_norm
from training.inner_optimizers import make_optimizer
from training.model import init_state_dict, lm_loss, token_ids_to
from training.platform import Platform, prepare_platform
from training.stages import StageModule, StageSpec, merge_state_dicts, split_stages, split_state_dict

_CLIP_EPS = 1e-6


def make_inner_optimizer(module: nn.Module, training_cfg: TrainingConfig):
    """The inner optimizer of one stage (``training.optimizer``, :mod:`training.muon`): AdamW with weight
    decay on matrices only (not biases, LayerNorms), or Muon for the hidden matrices and that AdamW for the
    rest."""
    return make_optimizer(module, training_cfg)


def grad_sq_norm(module: nn.Module) -> torch.Tensor:
    """Sum of squared gradient entries of ``module`` (a float64 scalar on the CPU; missing grads count 0).

    Summed on the parameters' device in parameter order, then brought to the host: on the CPU
    exactly the arithmetic it always was.
    """
    first = next(module.parameters(), None)
    total = torch.zeros((), dtype=torch.float64, device=first.device if first is not None else "cpu")
    for param in module.parameters():
        if param.grad is not None:
            total += param.grad.detach().double().pow(2).sum()
    return total.cpu()


def stage_sq_norm(training_cfg: TrainingConfig) -> Callable[[nn.Module], torch.Tensor]:
    """How a stage's squared gradient norm is summed: tree-summed under ``training.reproducible``
    (:func:`~training.exact_optim.exact_grad_sq_norm`), else :func:`grad_sq_norm`."""
    return exact_grad_sq_norm if training_cfg.reproducible else grad_sq_norm


def clip_coefficient(total_sq_norm: torch.Tensor, grad_clip: float) -> float:
    """The factor ``min(1, grad_clip / (norm + eps))`` for a global squared norm."""
    if grad_clip <= 0:
        return 1.0
    norm = math.sqrt(float(total_sq_norm))
    return min(1.0, grad_clip / (norm + _CLIP_EPS))


def scale_grads(module: nn.Module, coefficient: float) -> None:
    """Multiply every gradient of ``module`` by ``coefficient`` (skipped when it is 1)."""
    if coefficient >= 1.0:
        return
    for param in module.parameters():
        if param.grad is not None:
            param.grad.mul_(coefficient)


def inner_step(
    modules: list[nn.Module],
    optimizers: list[torch.optim.Optimizer],
    grad_clip: float,
    backward: Callable[[], float],
    reduce_sq_norm: Callable[[torch.Tensor], None] | None = None,
    sq_norm: Callable[[nn.Module], torch.Tensor] = grad_sq_norm,
) -> float:
    """One inner step (DiLoCo arXiv 2311.08105 Algorithm 1, the inner optimizer) over the stages this
    process holds: the one version of this arithmetic that training, re-execution and the simulation run.

    ``modules`` / ``optimizers``: the stages held here, in stage order. ``backward()`` runs the forward and
    backward passes, leaving every held parameter's gradient as the batch-mean gradient, and returns the
    batch loss. The squared gradient norms are summed stage by stage in float64 (``reduce_sq_norm``, when
    given, sums that in place across the pipeline's processes: an all-reduce), then every gradient is
    scaled by :func:`clip_coefficient` and each stage's AdamW steps. Returns ``backward()``'s loss.
    ``sq_norm``: a stage's squared gradient norm (:func:`stage_sq_norm` of the training configuration).
    """
    for module, optimizer in zip(modules, optimizers):
        module.train()
        optimizer.zero_grad(set_to_none=True)
    loss = backward()
    total = torch.zeros((), dtype=torch.float64)
    for module in modules:
        total = total + sq_norm(module)
    if reduce_sq_norm is not None:
        reduce_sq_norm(total)
    coefficient = clip_coefficient(total, grad_clip)
    for module, optimizer in zip(modules, optimizers):
        scale_grads(module, coefficient)
        optimizer.step()
    return loss


class LocalReplicaTrainer:
    """All stages of one replica chained in this process, one AdamW per stage.

    Weights start as ``state_dict`` (a full-model state dict) or
    ``init_state_dict(model_cfg, training_cfg.seed)``. The stages live on
    ``training_cfg.device`` as float32 master weights; the forward pass runs in
    ``training_cfg.precision`` (bf16: autocast). Batches may come on any device.
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        training_cfg: TrainingConfig,
        num_stages: int = 1,
        state_dict: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.model_cfg = model_cfg
        self.training_cfg = training_cfg
        self.platform: Platform = prepare_platform(
            training_cfg.device, training_cfg.precision, training_cfg.compile, training_cfg.reproducible,
            training_cfg.reproducible_kernels,
        )
        self.device = self.platform.device
        self.specs: list[StageSpec] = split_stages(model_cfg.n_layer, num_stages)
        full = state_dict if state_dict is not None else init_state_dict(model_cfg, training_cfg.seed)
        self.stage_modules: list[StageModule] = []
        for spec, part in zip(self.specs, split_state_dict(full, self.specs, model_cfg)):
            module = StageModule(model_cfg, spec, seed=None)
            module.load_state_dict(part)
            self.stage_modules.append(module.to(self.device))
        self.optimizers = [make_inner_optimizer(m, training_cfg) for m in self.stage_modules]
        if self.platform.compiled:  # training.compile: another platform (training/compiled.py)
            compile_modules(self.stage_modules)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of token ids ``x`` through every stage (call inside :meth:`Platform.autocast`)."""
        hidden = token_ids_to(x, self.device, self.model_cfg)
        for module in self.stage_modules:
            hidden = module(hidden)
        return hidden

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of batch ``(x, y)``, the forward pass in the node's precision."""
        with self.platform.autocast():
            return lm_loss(self.forward(x), y.to(self.device))

    def train_step(self, x: torch.Tensor, y: torch.Tensor, micro_batches: int = 1) -> float:
        """One inner step (:func:`inner_step`) on batch ``(x, y)``; returns the batch loss before the update.

        ``micro_batches`` > 1 gives the arithmetic of the split pipeline (``PipelineStageTrainer`` +
        ``ScheduleGPipe``), bit for bit: the batch is cut into equal slices (``tensor_split`` on the batch
        dimension, as torch's pipelining does), each slice's mean loss is back-propagated in slice order so
        that gradients accumulate as they do stage by stage, then every gradient is divided by the slice
        count (the schedule's ``scale_grads``); the loss is the mean of the slices' losses. With one slice
        this is the plain full-batch step.
        """
        if micro_batches < 1 or x.size(0) % micro_batches:
            raise PipelineError(f"batch size {x.size(0)} is not divisible by micro_batches={micro_batches}")

        def backward() -> float:
            losses = []
            for x_slice, y_slice in zip(x.tensor_split(micro_batches), y.tensor_split(micro_batches)):
                loss = self.loss(x_slice, y_slice)
                loss.backward()
                losses.append(float(loss.detach()))
            if micro_batches != 1:
                for module in self.stage_modules:
                    for param in module.parameters():
                        if param.grad is not None:
                            param.grad.div_(exact_kernel.as_divisor(param.grad, micro_batches))
            return sum(losses) / len(losses)

        return inner_step(self.stage_modules, self.optimizers, self.training_cfg.grad_clip, backward,
                          sq_norm=stage_sq_norm(self.training_cfg))

    @torch.no_grad()
    def eval_loss(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean over ``batches`` of the batch-mean cross-entropy (no update)."""
        for module in self.stage_modules:
            module.eval()
        total = 0.0
        for x, y in batches:
            total += float(self.loss(x, y))
        for module in self.stage_modules:
            module.train()
        return total / len(batches)

    def eval_snapshot(self) -> EvalSnapshot:
        """A frozen copy of the current weights whose :meth:`EvalSnapshot.eval_loss` equals
        :meth:`eval_loss` now, bit for bit, whatever training does meanwhile (it may run on
        another thread; the copy is its own)."""
        return EvalSnapshot(self.model_cfg, self.stage_modules, self.platform)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full model's weights (merged stage state dicts, canonical order), on the CPU."""
        return merge_state_dicts(
            [{n: t.cpu() for n, t in m.state_dict().items()} for m in self.stage_modules]
        )

    def load_state_dict(self, full_state_dict: dict[str, torch.Tensor]) -> None:
        """Replace the weights of every stage (optimizer state is kept)."""
        parts = split_state_dict(full_state_dict, self.specs, self.model_cfg)
        for module, part in zip(self.stage_modules, parts):
            module.load_state_dict(part)


class EvalSnapshot:
    """Copies of a chained replica's stage modules for a held-out eval off the training thread."""

    def __init__(self, model_cfg: ModelConfig, modules: list[nn.Module], platform: Platform) -> None:
        self.model_cfg = model_cfg
        self.platform = platform
        self.stage_modules = []
        for module in modules:
            copy = StageModule(model_cfg, module.spec, seed=None).to(platform.device)
            copy.load_state_dict(module.state_dict())  # copies every tensor: training may go on
            copy.eval()
            self.stage_modules.append(copy)
        if platform.compiled:  # the trainer's eval runs compiled: so does the copy, for the same bits
            compile_modules(self.stage_modules)

    @classmethod
    def owning(cls, model_cfg: ModelConfig, modules: list[nn.Module], platform: Platform) -> EvalSnapshot:
        """A snapshot of ``modules`` themselves, no copy (the caller made them for it and lets go of them:
        a cluster's weights gathered from its shards, training/cluster_replica.py)."""
        snapshot = cls.__new__(cls)
        snapshot.model_cfg, snapshot.platform = model_cfg, platform
        snapshot.stage_modules = [module.to(platform.device).eval() for module in modules]
        if platform.compiled:
            compile_modules(snapshot.stage_modules)
        return snapshot

    @torch.no_grad()
    def eval_loss(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """:meth:`LocalReplicaTrainer.eval_loss` of the weights at the snapshot (same operations)."""
        total = 0.0
        device = self.platform.device
        for x, y in batches:
            with self.platform.autocast():
                hidden = token_ids_to(x, device, self.model_cfg)
                for module in self.stage_modules:
                    hidden = module(hidden)
                total += float(lm_loss(hidden, y.to(device)))
        return total / len(batches)


