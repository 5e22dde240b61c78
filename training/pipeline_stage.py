"""One pipeline stage per process: :class:`PipelineStageTrainer`, a real ``torch.distributed.pipelining``
pipeline running the inner step of :mod:`training.pipeline` (whose module docstring describes both runners).
"""

from __future__ import annotations

import gc
import logging

import torch
import torch.distributed as dist

from training.config import ModelConfig, TrainingConfig
from training.errors import PipelineError
from training.model import init_state_dict, lm_loss, token_ids_to
from training.pipeline import inner_step, make_inner_optimizer
from training.pipeline_group import close_pipeline_group, group_transport, init_pipeline_group
from training.platform import Platform, prepare_platform
from training.stages import StageModule, StageSpec

logger = logging.getLogger(__name__)


class HostBoundary(torch.nn.Module):
    """A stage on a GPU whose activations cross processes through the host (the ``"host"`` transport,
    training/pipeline_group.py): its input arrives on the CPU and goes to ``device``, and its output (but the
    last stage's, which the loss reads where it is) goes back to the CPU, so the schedule sends and receives
    CPU tensors over gloo. Autograd carries the gradients back across both copies."""

    def __init__(self, module: torch.nn.Module, device: torch.device, is_last: bool) -> None:
        super().__init__()
        self.inner = module
        self.device = device
        self.is_last = is_last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x.to(self.device))
        return out if self.is_last else out.to("cpu")


class PipelineStageTrainer:
    """One stage of a replica's pipeline, run in this process (rank == stage index).

    Every rank calls :meth:`train_step` / :meth:`eval_loss` with the same
    batches (the data is deterministic, see :mod:`training.data`); the first
    stage uses ``x``, the last ``y``, the others only their shapes. Every rank
    gets the loss back (broadcast from the last stage).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        spec: StageSpec,
        rank: int,
        world_size: int,
        micro_batches: int,
        training_cfg: TrainingConfig,
        group: dist.ProcessGroup | None = None,
        state_dict: dict[str, torch.Tensor] | None = None,
    ) -> None:
        if world_size != spec.num_stages or rank != spec.index:
            raise PipelineError(
                f"rank={rank}, world_size={world_size} do not match stage {spec.index} of {spec.num_stages}: "
                "run one process per stage with rank = stage index"
            )
        if micro_batches < 1:
            raise PipelineError(f"micro_batches={micro_batches}: must be >= 1")
        if not dist.is_initialized():
            raise PipelineError("no process group: call init_pipeline_group() first")
        self.cfg = cfg
        self.spec = spec
        self.rank = rank
        self.world_size = world_size
        self.micro_batches = micro_batches
        self.training_cfg = training_cfg
        self.group = group if group is not None else dist.group.WORLD
        if training_cfg.compile:
            raise PipelineError(
                "training.compile = true with the replica split over processes: not supported "
                "(a rerun chains the stages in one process, not shown bit-exact compiled); "
                "set training.compile = false"
            )
        if training_cfg.reproducible:
            raise PipelineError(
                "training.reproducible = true with the replica split over processes: not supported (the "
                "pipeline schedule's own operations have no fixed-order kernels; the squared norms' "
                "all-reduce of 3 or more stages has no fixed order); train the replica in one process"
            )
        self.platform: Platform = prepare_platform(training_cfg.device, training_cfg.precision)
        self.device = self.platform.device
        self.module = StageModule(cfg, spec, seed=None)
        if state_dict is None:
            names = list(self.module.state_dict())  # only this stage's weights are drawn (issue 75)
            own = init_state_dict(cfg, training_cfg.seed, names=names)
            state_dict = {name: own[name] for name in names}
        self.module.load_state_dict(state_dict)
        self.module.to(self.device)
        self.optimizer = make_inner_optimizer(self.module, training_cfg)
        self._schedule = None
        self._schedule_shape: tuple[int, ...] | None = None
        self._closed = False

    def _schedule_for(self, shape: tuple[int, ...]):
        # PipelineStage infers the activation shapes from the first micro-batch and
        # keeps them, so a new batch shape needs a new stage and schedule.
        if self._schedule is None or self._schedule_shape != shape:
            from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

            module, device = self.module, self.device
            if self._through_host():
                module = HostBoundary(self.module, self.device, self.spec.is_last)
                device = torch.device("cpu")
            stage = PipelineStage(module, self.spec.index, self.spec.num_stages, device, group=self.group)
            self._schedule = ScheduleGPipe(stage, n_microbatches=self.micro_batches, loss_fn=lm_loss)
            self._schedule_shape = shape
        return self._schedule

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One pipelined inner step on ``(x, y)``; every rank returns the batch loss."""
        self._check_open()
        if x.size(0) % self.micro_batches != 0:
            raise PipelineError(
                f"batch size {x.size(0)} is not divisible by micro_batches={self.micro_batches}"
            )
        schedule = self._schedule_for(tuple(x.shape))
        # where the schedule's inputs live
        wire = torch.device("cpu") if self._through_host() else self.device
        x = token_ids_to(x, wire, self.cfg) if self.spec.is_first else x.to(wire)
        y = y.to(self.device)

        def backward() -> float:
            # ScheduleGPipe back-propagates each micro-batch and divides the gradients by their count.
            losses: list[torch.Tensor] = []
            with self.platform.autocast():
                if self.spec.is_first and self.spec.is_last:
                    schedule.step(x, target=y, losses=losses)
                elif self.spec.is_first:
                    schedule.step(x)
                elif self.spec.is_last:
                    schedule.step(target=y, losses=losses)
                else:
                    schedule.step()
            loss = torch.zeros((), dtype=torch.float64)
            if self.spec.is_last:
                # Equal-size micro-batches: the mean of their means is the batch mean. On the
                # host: scalars travel over gloo whatever the device.
                loss = torch.stack([each.detach().double() for each in losses]).mean().cpu()
            dist.broadcast(loss, group_src=self.world_size - 1, group=self.group)
            return float(loss)

        def reduce_sq_norm(total: torch.Tensor) -> None:
            if self._through_host() and total.device.type != "cpu":
                host = total.cpu()
                dist.all_reduce(host, op=dist.ReduceOp.SUM, group=self.group)
                total.copy_(host)
            else:
                dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group)

        try:
            return inner_step([self.module], [self.optimizer], self.training_cfg.grad_clip, backward,
                              reduce_sq_norm)
        except PipelineError:
            raise
        except (RuntimeError, OSError) as exc:  # gloo timeouts and peer failures surface as RuntimeError
            raise PipelineError(f"stage {self.spec.index}: pipeline step failed: {exc}") from exc

    def follow_first_stage(self, decision: bool) -> bool:
        """The first stage's ``decision`` on every rank (a broadcast from rank 0): in a time-bounded run the
        first stage decides whether the replica takes another inner step, so that every stage trains, and
        declares, the same count."""
        self._check_open()
        flag = torch.tensor([1 if decision else 0], dtype=torch.int64)
        try:
            dist.broadcast(flag, group_src=0, group=self.group)
        except (RuntimeError, OSError) as exc:  # gloo timeouts and peer failures surface as RuntimeError
            raise PipelineError(
                f"stage {self.spec.index}: agreeing on the next inner step failed: {exc}"
            ) from exc
        return bool(flag.item())

    @torch.no_grad()
    def eval_loss(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean held-out loss over ``batches``, forward only; every rank returns it."""
        self._check_open()
        self.module.eval()
        total = torch.zeros((), dtype=torch.float64)
        wire = torch.device("cpu") if self._through_host() else self.device  # where activations cross
        try:
            for x, y in batches:
                with self.platform.autocast():
                    if self.spec.is_first:
                        hidden = self.module(x.to(self.device))
                    else:
                        # float32 activations between stages: a block's output is its float32 residual stream.
                        hidden = torch.empty(x.size(0), x.size(1), self.cfg.n_embd, device=wire)
                        dist.recv(hidden, group_src=self.rank - 1, group=self.group)
                        hidden = self.module(hidden.to(self.device))
                    if self.spec.is_last:
                        total += float(lm_loss(hidden, y.to(self.device)))
                if not self.spec.is_last:
                    dist.send(hidden.to(wire).contiguous(), group_dst=self.rank + 1, group=self.group)
            dist.broadcast(total, group_src=self.world_size - 1, group=self.group)
        except (RuntimeError, OSError) as exc:  # gloo timeouts and peer failures surface as RuntimeError
            raise PipelineError(f"stage {self.spec.index}: pipeline eval failed: {exc}") from exc
        finally:
            self.module.train()
        return float(total) / len(batches)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's weights under their full-model names, on the CPU."""
        return {name: tensor.cpu() for name, tensor in self.module.state_dict().items()}

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Replace this stage's weights (optimizer state is kept)."""
        self.module.load_state_dict(state_dict)

    def leave_group(self) -> None:
        """Drop a broken pipeline (a stage's process died): destroy the process group, keep the weights.

        The module, its optimizer state and the caller's references to the parameters
        stay as they are; :meth:`join_group` re-forms the pipeline with the same ranks
        once the other stages are back (a restarted process re-joins with its rank).
        """
        self._check_open()
        # Every reference to the old group goes: it holds the rendezvous store, whose server
        # (on rank 0) must release the port before the group can be formed again there.
        self._schedule = None  # the schedule's PipelineStage holds the old group
        self._schedule_shape = None
        self.group = None
        try:
            close_pipeline_group()
        # Process boundary, must not die: a group whose peer process died may fail to shut down in any
        # way, and leaving the broken pipeline (to re-form it) goes on whatever it raised.
        except Exception as exc:  # noqa: BLE001
            logger.warning(
                "stage %d: the broken process group did not shut down cleanly: %s", self.spec.index, exc
            )
        gc.collect()

    def join_group(self, master_addr: str, master_port: int, timeout_s: float) -> None:
        """Re-form the pipeline after :meth:`leave_group` (rendezvous as :func:`init_pipeline_group`).

        Raises PipelineError if the other stages do not come within ``timeout_s``; the
        caller may simply try again.
        """
        self._check_open()
        init_pipeline_group(self.rank, self.world_size, master_addr, master_port, timeout_s=timeout_s,
                            device=self.device)
        self.group = dist.group.WORLD

    def _through_host(self) -> bool:
        """Whether this stage's activations cross processes on the CPU while it trains on a GPU."""
        return group_transport() == "host" and self.device.type != "cpu"

    def _check_open(self) -> None:
        if self._closed:
            raise PipelineError(f"stage {self.spec.index}: trainer is closed")

    def close(self) -> None:
        """Destroy the process group; the trainer cannot be used afterwards. Idempotent."""
        if not self._closed:
            self._closed = True
            self._schedule = None
            close_pipeline_group()
