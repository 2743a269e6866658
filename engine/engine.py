"""The training engine: one object that owns the model (or this rank's pipeline chunk), the
ZeRO optimizer with its loss scaler, the LR schedule, the process groups and, with pipeline
parallelism, the schedule runner. Build it with :func:`engine.initialize`.

Two ways to drive it, named as in DeepSpeed:

- the DeepSpeed loop (no pipeline parallelism; any ``nn.Module``)::

      loss = engine(batch)        # the module's forward
      engine.backward(loss)       # loss / gradient_accumulation_steps, times the loss scale
                                  # (the optimizer's step contract, engine.zero.step)
      engine.step()               # optimizer step on accumulation boundaries only

- ``engine.train_batch(data_iter)``: one whole optimizer step over
  ``gradient_accumulation_steps`` micro-batches taken from ``data_iter`` (required with
  pipeline parallelism, where it runs the configured schedule); ``eval_batch`` the same
  without gradients.

Counters follow DeepSpeed: ``global_steps`` counts optimizer steps including skipped fp16
steps; ``micro_steps`` counts backward passes; the LR schedule advances only on steps
that were taken.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Optional, Protocol, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from engine.checkpoint.layout import module_names
from engine.config import Config
from engine.context_parallel.data import SEQUENCE_KWARGS, shard_microbatch
from engine.data.microbatch import MicroBatch, split_microbatch, to_microbatch
from engine.distributed import comm
from engine.distributed.env import DistEnv, launcher_local_rank
from engine.distributed.groups import AxisGroup, ParallelGroups
from engine.ds_queries import DeepSpeedQueries
from engine.errors import ConfigError
from engine.moe.stats import MoEStepGroups, moe_layers, moe_step_end
from engine.moe.wiring import moe_step_groups
from engine.monitor import EVAL_LOSS, LOSS_SCALE, LR, TRAIN_LOSS, Event, Monitor
from engine.parts import LossFn, ModelParts
from engine.precision.autocast import autocast_forward, lower_precision_safe_classes
from engine.precision.fp8 import Fp8LinearState, fp8_states, update_fp8_scales
from engine.timers import PhaseTimers
from engine.topology import Role
from engine.training_state import TrainingState
from engine.weights16 import save_16bit_model
from engine.zero import ZeroOptimizer
from engine.zero.step import token_mean

_FORWARD_BACKWARD = "forward_backward"  # the memory probe's phase (activation_peak_bytes)


class MemoryProbe(Protocol):
    """Measures tensor bytes allocated inside ``with probe.phase(name):`` over those alive at
    its entry, high-water mark in ``probe.phases[name]``
    (engine.zero.peak.LiveMemoryTracker; engine.training.memory_probe.CudaPeakProbe)."""

    phases: dict[str, int]

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]: ...

if TYPE_CHECKING:  # imported where used: the checkpoint package imports the engine's modules
    from engine.checkpoint.async_save import AsyncSaver

__all__ = ["Engine", "LRScheduler", "LossFn", "MemoryProbe", "Pipeline", "split_microbatch"]

logger = logging.getLogger(__name__)


class Pipeline(Protocol):
    """This rank's pipeline runner (:class:`engine.pipeline.runner.PipelineRunner`): the losses
    of a step's micro-batches on the last stage, None on the others. ``loss_fn``: this step's
    last-stage loss (the engine's token mean), instead of the runner's own."""

    loss_stage: int  # the pipeline rank holding the last model stage (p - 1; 0 in V placement)

    def prepare(self, microbatches: Sequence[MicroBatch]) -> None: ...

    def train(self, microbatches: Sequence[MicroBatch],
              loss_fn: Optional[LossFn] = None) -> Optional[list[torch.Tensor]]: ...

    def evaluate(self, microbatches: Sequence[MicroBatch],
                 loss_fn: Optional[LossFn] = None) -> Optional[list[torch.Tensor]]: ...


class LRScheduler(Protocol):
    """An LR schedule the engine advances once per optimizer step taken."""

    def step(self) -> Any: ...


class Engine(DeepSpeedQueries, nn.Module):
    """See the module docstring. Built by :func:`engine.assembly.assemble.assemble_engine` from
    the typed collaborators: the model's :class:`~engine.parts.ModelParts` (``module`` is the
    whole model, ``pp == 1``, or this rank's stage chunks, an ``nn.ModuleList`` driven by
    ``pipeline``), the ZeRO optimizer, the LR schedule and the pipeline runner.

    Every attribute an engine has is declared here (a test checks that no other is
    attached to it after construction)."""

    config: Config
    parts: ModelParts
    module: nn.Module
    optimizer: ZeroOptimizer
    lr_scheduler: Optional[LRScheduler]
    groups: Optional[ParallelGroups]  # None only after destroy()
    pipeline: Optional[Pipeline]
    loss_fn: Optional[LossFn]
    dist_env: Optional[DistEnv]
    device: torch.device
    training_dataloader: Optional[Iterable[Any]]
    monitor: Optional[Monitor]
    global_steps: int
    global_samples: int
    micro_steps: int
    timers: PhaseTimers
    _step_losses: list[torch.Tensor]
    _data_iter: Optional[Iterator[Any]]
    _step_skipped: bool
    _last_grad_norm: Optional[torch.Tensor]
    _last_lr: Optional[list[float]]
    _loss_group: Optional[AxisGroup]
    _fp8_states: list[Any]
    _fp8_groups: list[AxisGroup]
    _checked_groups: list[AxisGroup]
    _async_saver: Optional["AsyncSaver"]
    memory_probe: Optional["MemoryProbe"]
    activation_peak_bytes: Optional[int]
    _moe_groups: Optional[MoEStepGroups]
    _moe_metrics: dict[str, torch.Tensor]

    def __init__(self, config: Config, parts: ModelParts, optimizer: ZeroOptimizer, *,
                 device: torch.device, groups: ParallelGroups, lr_scheduler: Optional[LRScheduler] = None,
                 pipeline: Optional[Pipeline] = None, dist_env: Optional[DistEnv] = None,
                 training_dataloader: Optional[Iterable[Any]] = None, monitor: Optional[Monitor] = None) -> None:
        super().__init__()
        self.config = config
        self.parts = parts
        self.module = parts.module
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.groups: Optional[ParallelGroups] = groups  # None after destroy()
        self.pipeline = pipeline
        # the DeepSpeed loop's loss (pp == 1); with a pipeline the runner holds the loss
        self.loss_fn = parts.loss_fn if pipeline is None else None
        self.dist_env = dist_env
        self.device = device
        if config.torch_autocast.enabled:  # DeepSpeed's init_autocast_params: the names must import
            lower_precision_safe_classes(config.torch_autocast)
        self.training_dataloader = training_dataloader
        self.monitor = monitor  # rank 0 writes; None: no monitor section
        self._step_losses = []
        self._data_iter = None
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self._step_skipped = False
        self._last_grad_norm: Optional[torch.Tensor] = None  # 0-dim on the device until asked for
        self._last_lr: Optional[list[float]] = None
        self._async_saver: Optional[AsyncSaver] = None  # made at the first asynchronous save
        # a MemoryProbe active around the next train_batch (the trainer sets it for one step):
        # activation_peak_bytes is then its high-water mark inside forward + backward
        self.memory_probe: Optional[MemoryProbe] = None
        self.activation_peak_bytes: Optional[int] = None
        self._loss_group = groups.role(Role.LOSS)  # None after destroy()
        # the reference GPT's MoE layers (model.moe): per-step statistics and the aux-free bias
        # update, once per optimizer step on every rank (engine.moe.stats.moe_step_end)
        self._moe_groups = moe_step_groups(config, groups) if parts.reference else None
        self._moe_metrics = {}
        # wall_clock_breakdown: per-phase ms of each step (engine.timers.last), logged every
        # steps_per_print steps
        self.timers = PhaseTimers(config.wall_clock_breakdown, device)
        optimizer.use_timers(self.timers)  # ZeRO-Offload's phases: offload_copy_out / _cpu_step / _copy_back
        # FP8 layers: amaxes MAX-reduced over each axis of the amax role in turn (TP, then DP:
        # = over TP x DP, so scales are the same on every rank and replica and do not depend on
        # the layout), once per step.
        self._fp8_states = fp8_states(self.module)
        # With a pipeline a stage may legitimately hold no FP8 layer (embedding or head only);
        # engine.initialize checks the whole model on every rank before any collective.
        if config.fp8.enabled and not self._fp8_states and pipeline is None:
            raise ConfigError("fp8.enabled but the model has no FP8 layer (the reference model's blocks get them "
                              "from the config; a custom module needs engine.precision.fp8.Fp8Linear)")
        self._fp8_groups = list(groups.role_axes(Role.AMAX))
        # strict NCCL-rules mode: the groups whose collective sequences are compared at each step
        self._checked_groups = groups.all_groups()

    # ------------------------------------------------------------------ DeepSpeed-named queries
    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the next ``backward`` is the last micro-batch of the optimizer step: the
        value of :meth:`set_gradient_accumulation_boundary` once called, else every
        ``gradient_accumulation_steps``-th ``step()`` call (DeepSpeed's rule)."""
        if self._manual_boundary is not None:
            return self._manual_boundary
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def get_lr(self) -> list[float]:
        """The current learning rate of each param group (what the next step uses)."""
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def empty_partition_cache(self) -> None:
        """DeepSpeed's: release the parameters ZeRO-3 holds gathered between uses (those kept
        for reuse, e.g. after an evaluation forward); a no-op below stage 3. Not inside a
        forward/backward."""
        self.optimizer.empty_partition_cache()

    def get_loss_scale(self) -> float:
        return float(self.optimizer.loss_scale)

    @property
    def loss_scale(self) -> float:
        return self.get_loss_scale()

    def get_global_grad_norm(self) -> Optional[float]:
        """Global gradient norm (over DP, TP and PP, before clipping) of the last step (read
        on the host here, when asked: the step itself does not sync for it)."""
        return None if self._last_grad_norm is None else float(self._last_grad_norm)

    def moe_metrics(self) -> dict[str, float]:
        """The last step's ``moe_aux_loss``, ``moe_load_imbalance`` (and ``moe_dropped_tokens`` with a
        capacity) of the reference GPT's MoE layers, over the whole global batch (engine.moe.stats),
        read on the host here; empty without ``model.moe`` or before the first step."""
        return {k: float(v) for k, v in self._moe_metrics.items()}

    def was_step_skipped(self) -> bool:
        """Whether the last optimizer step was skipped (non-finite gradients)."""
        return self._step_skipped

    @property
    def skipped_steps(self) -> int:
        return self.optimizer.skipped_steps

    @property
    def last_step_lr(self) -> Optional[list[float]]:
        """The learning rates the last optimizer step used (``get_lr()`` is the next one's)."""
        return self._last_lr

    @property
    def dp_world_size(self) -> int:
        return self.config.dp

    @property
    def mp_world_size(self) -> int:
        return self.config.tp * self.config.pp

    @property
    def global_rank(self) -> int:
        return self.groups.rank if self.groups is not None else (dist.get_rank() if dist.is_initialized() else 0)

    @property
    def local_rank(self) -> int:
        """This process's rank on its node as the launcher gave it (``LOCAL_RANK``, or
        ``--local_rank`` from the deepspeed launcher), also when the script initialised
        ``torch.distributed`` itself (DeepSpeed reads ``LOCAL_RANK`` the same way)."""
        if self.dist_env is not None:
            return self.dist_env.local_rank
        world = dist.get_world_size() if dist.is_initialized() else 1
        local = launcher_local_rank(world)
        if local is None:
            raise RuntimeError(f"engine.local_rank: torch.distributed has {world} ranks but no launcher's environment "
                               "describes them: start the job with torchrun / deepspeed / srun / mpirun (which set "
                               "LOCAL_RANK), as DeepSpeed requires")
        return local

    def is_first_stage(self) -> bool:
        return self.groups is None or self.groups.is_first_stage

    def is_last_stage(self) -> bool:
        """This rank holds the last model stage (the head and the loss): pipeline rank p - 1,
        or 0 with a V-shaped schedule (zb-v), where it is also the first stage."""
        if self.groups is None:
            return True
        if self.pipeline is not None:
            return self.groups.pp_rank == self.pipeline.loss_stage
        return self.groups.is_last_stage

    # ------------------------------------------------------------------ the DeepSpeed loop
    def _require_no_pipeline(self, what: str) -> None:
        if self.pipeline is not None:
            raise RuntimeError(f"engine.{what}() is not available with pipeline parallelism "
                               f"(pipeline.stages = {self.config.pp}): use engine.train_batch(data_iter)")

    def _forward_rule(self) -> Any:
        """The strict mode's no-host-sync region for the forward (free when the mode is off).
        Not for a Hugging Face model: transformers' own code reads the host in its forward
        (its mask utilities, e.g. ``(mask[:, -1] == 0).all()``), which is not ours to change;
        the engine's parts of that forward (AutoTP's input broadcast) make one documented read."""
        if type(self.module).__module__.startswith("transformers."):
            return contextlib.nullcontext()
        return comm.no_host_sync("the forward")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._require_no_pipeline("forward")
        with self.timers.phase("forward"), self._forward_rule(), autocast_forward(self.config.torch_autocast,
                                                                                  self.device.type):
            return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of ``loss / gradient_accumulation_steps`` (times the loss scale); on the
        last micro-batch of a step the gradient reductions start as buckets fill.
        ``scale_wrt_gas=False`` (DeepSpeed's flag; Hugging Face's Trainer passes it, its loss
        already being normalized over the step's tokens): ``loss`` as it is, times the loss scale."""
        self._require_no_pipeline("backward")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("engine.backward expects the scalar loss tensor returned by the model")
        ga = self.gradient_accumulation_steps() if scale_wrt_gas else 1
        self.optimizer.set_boundary(self.is_gradient_accumulation_boundary())
        with self.timers.phase("backward"), comm.no_host_sync("backward (ZeRO gradient hooks)"):
            self.optimizer.backward(loss, retain_graph=retain_graph, num_microbatches=ga)
        if self.monitor is not None:
            self._step_losses.append(loss.detach())
        return loss

    def step(self) -> None:
        """On an accumulation boundary: reduce, clip, update (or skip), advance the LR
        schedule and ``global_steps``. Otherwise only counts the micro-step."""
        self._require_no_pipeline("step")
        if self.is_gradient_accumulation_boundary():
            self._optimizer_step()
            if self.monitor is not None:
                losses, self._step_losses = self._step_losses, []
                self._write_monitor(torch.stack(losses).float().mean() if losses else None)
        self.micro_steps += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def _optimizer_step(self) -> None:
        with self.timers.phase("reduce"), comm.no_host_sync("the gradient reduction"):
            self.optimizer.reduce_gradients()
        with self.timers.phase("step"):
            if self._fp8_states:
                update_fp8_scales(self._fp8_states, self._fp8_groups)
            self._last_grad_norm = self.optimizer.grad_norm_tensor()
            self._last_lr = self.get_lr()
            taken = self.optimizer.step()
            self._step_skipped = not taken
            if taken and self.lr_scheduler is not None:
                self.lr_scheduler.step()
            if self._moe_groups is not None:
                assert self.config.model is not None and self.config.model.moe is not None
                self._moe_metrics = moe_step_end(self.module, self.config.model.moe, self._moe_groups, self.device,
                                                 train=taken)
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        comm.check_sequence(self._checked_groups, f"end of step {self.global_steps}", self.device)
        self._report_timers()

    def _write_monitor(self, loss: Optional[torch.Tensor]) -> None:
        """DeepSpeed's per-step scalars (engine.monitor), at ``global_samples``."""
        assert self.monitor is not None
        if not self.monitor.enabled:  # not the writing rank: no device sync for .item()
            return
        self.monitor.write_events(self.step_events(None if loss is None else float(loss)))

    def step_events(self, loss: Optional[float]) -> list[Event]:
        """DeepSpeed's monitor events of the step just taken, at ``global_samples``: the loss,
        the LR after the step (the next step's rate) and, with fp16, the loss scale. The
        training loop writes them with its metrics row (engine.training.trainer.train)."""
        events: list[Event] = [] if loss is None else [(TRAIN_LOSS, loss, self.global_samples)]
        events.append((LR, self.get_lr()[0], self.global_samples))
        if self.config.fp16.enabled:
            events.append((LOSS_SCALE, self.get_loss_scale(), self.global_samples))
        return events

    def _report_timers(self) -> None:
        if not self.timers.enabled:
            return
        self.timers.end_step()
        every = self.config.steps_per_print
        if every and self.global_steps % every == 0 and self.global_rank == 0:
            logger.info("step %d time (ms): %s", self.global_steps, self.timers.summary())

    # ------------------------------------------------------------------ whole steps
    def _next_microbatches(self, data_iter: Optional[Iterator[Any]], n: int) -> list[MicroBatch]:
        if data_iter is None:
            if self.training_dataloader is None:
                raise ValueError("train_batch/eval_batch need a data_iter (or training_data given to initialize)")
            if self._data_iter is None:
                self._data_iter = iter(self.training_dataloader)
            data_iter = self._data_iter
        out = []
        for _ in range(n):
            try:
                mb = to_microbatch(next(data_iter))  # the data boundary: one type from here on
                # context parallelism: this rank's head-tail shard of the sequence, from here on
                out.append(mb if self.parts.cp is None else shard_microbatch(mb, self.parts.cp))
            except StopIteration:
                raise ValueError(f"the data iterator ran out after {len(out)} of the {n} micro-batches "
                                 "this step needs (gradient_accumulation_steps)") from None
        return out

    def _step_loss_fn(self, mbs: Sequence[MicroBatch]) -> Optional[LossFn]:
        """This step's loss where the engine owns it (``parts.token_loss``: the reference GPT's
        cross-entropy): each micro-batch's token-loss sum over the step's mean target count,
        whose mean over the step's micro-batches and replicas is the global token mean
        (:class:`engine.zero.step.TokenMean`; one all-reduce of the count over the loss role's
        group, on the device). Only the ranks computing the loss count (the last
        pipeline stage). None: the user's loss, as given (DeepSpeed's per-micro-batch mean)."""
        token = self.parts.token_loss
        if token is None or not self.is_last_stage():
            return None
        assert self._loss_group is not None  # destroy() drops the groups; no step runs after it
        norm = token_mean([mb.split()[1] for mb in mbs], self._loss_group, ignore_index=token.ignore_index,
                          device=self.device)
        return lambda output, targets: norm(token.sum_fn(output, targets))

    def _micro_loss(self, mb: MicroBatch, loss_fn: Optional[LossFn] = None) -> torch.Tensor:
        """Loss of one micro-batch without pipeline parallelism: ``module(*args, **kwargs)``
        (an ``engine.data.Batch``: ``module(inputs, targets, doc_ids=)``), or with a
        ``loss_fn`` (the step's, else the engine's) ``loss_fn(module(inputs, doc_ids=), targets)``;
        the document ids (``data.document_masking``) only where the micro-batch has them.
        Every tensor is moved to the engine's device first."""
        mb = mb.to(self.device)
        loss_fn = loss_fn or self.loss_fn
        # the module's call runs in forward()'s torch_autocast region (a loss_fn outside it, as
        # a DeepSpeed script computes its loss outside engine(...))
        region = autocast_forward(self.config.torch_autocast, self.device.type)
        if loss_fn is not None:
            inputs, targets = mb.split()
            extra = {k: mb.kwargs[k] for k in SEQUENCE_KWARGS if k in mb.kwargs}  # doc_ids; CP's positions
            with region:
                out = self.module(inputs, **extra)
            return loss_fn(out, targets)
        with region:
            return self.module(*mb.args, **mb.kwargs)

    def train_batch(self, data_iter: Optional[Iterator[Any]] = None) -> torch.Tensor:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches from
        ``data_iter``. Returns the mean loss over the micro-batches and the DP replicas (the
        loss of the global batch: with the engine's own loss, the mean over every target
        token of the step), on every rank."""
        ga = self.gradient_accumulation_steps()
        mbs = self._next_microbatches(data_iter, ga)
        self.module.train()
        step_loss = self._step_loss_fn(mbs)
        if self.pipeline is not None:
            self.pipeline.prepare(mbs)  # one-time setup (a PipelineModule's shape probe), before the step
        probe = self.memory_probe
        with probe.phase(_FORWARD_BACKWARD) if probe is not None else contextlib.nullcontext():
            losses = self._forward_backward(mbs, step_loss)
        if probe is not None:  # bytes allocated in forward + backward over what was held before the step
            self.activation_peak_bytes = probe.phases[_FORWARD_BACKWARD]
        self._optimizer_step()
        loss = self._aggregate_loss(losses)
        if self.monitor is not None:
            self._write_monitor(loss)
        return loss

    def _forward_backward(self, mbs: Sequence[MicroBatch], step_loss: Optional[LossFn]) -> Optional[list[torch.Tensor]]:
        """The step's forward and backward passes (the pipeline's schedule, or the DeepSpeed
        loop over the micro-batches); the micro-batch losses (None off the last stage)."""
        ga = len(mbs)
        if self.pipeline is not None:
            with self.timers.phase("pipeline"), comm.no_host_sync("the pipeline executor's step"):
                pipe_losses = self.pipeline.train(mbs, step_loss)
            self.micro_steps += ga
            return pipe_losses
        losses = []
        for i, mb in enumerate(mbs):
            self.optimizer.set_boundary(i == ga - 1)
            with self.timers.phase("forward"), self._forward_rule():
                loss = self._micro_loss(mb, step_loss)
            with self.timers.phase("backward"), comm.no_host_sync("backward (ZeRO gradient hooks)"):
                self.optimizer.backward(loss, num_microbatches=ga)
            losses.append(loss.detach())
            self.micro_steps += 1
        return losses

    @torch.no_grad()
    def eval_batch(self, data_iter: Iterator[Any], num_micro_batches: Optional[int] = None) -> torch.Tensor:
        """Mean loss over ``num_micro_batches`` (default: gradient_accumulation_steps)
        micro-batches and the DP replicas (the global token mean with the engine's own
        loss, as ``train_batch``), without gradients; on every rank."""
        n = num_micro_batches or self.gradient_accumulation_steps()
        mbs = self._next_microbatches(data_iter, n)
        was_training = self.module.training
        self.module.eval()
        try:
            step_loss = self._step_loss_fn(mbs)
            if self.pipeline is not None:
                losses = self.pipeline.evaluate(mbs, step_loss)
            else:
                losses = [self._micro_loss(mb, step_loss).detach() for mb in mbs]
        finally:
            self.module.train(was_training)
        loss = self._aggregate_loss(losses)
        if self.monitor is not None:
            self.monitor.write_events([(EVAL_LOSS, float(loss), self.global_samples)])
        return loss

    def _aggregate_loss(self, losses: Optional[list[torch.Tensor]]) -> torch.Tensor:
        """Mean over micro-batches (on the last stage), averaged over the loss role, then sent to every
        pipeline stage. (With the token mean each loss is ``L_i / n_bar``: this mean of them
        is the global ``sum L / N``, engine.zero.step.)"""
        out = torch.zeros((), dtype=torch.float32, device=self.device)
        if losses:  # the last pipeline stage (every rank without a pipeline)
            out = torch.stack([l.float() for l in losses]).mean()
        if self._loss_group is not None and self._loss_group.size > 1:
            comm.all_reduce(out, self._loss_group)
            out /= self._loss_group.size
        if self.pipeline is not None:
            groups = self.groups
            assert groups is not None  # destroy() drops the pipeline with the groups
            stages = groups.role(Role.PP)
            comm.broadcast(out, stages.global_rank_of(self.pipeline.loss_stage), stages)
        return out

    # ------------------------------------------------------------------ teardown
    def destroy(self) -> None:
        """Release what ties the process groups to this engine (DeepSpeed's ``destroy``): the
        optimizer's gradient hooks on the parameters (held weakly, engine/zero/weak_hook.py;
        removed so the model carries none), the pipeline and the groups.
        Call it before :func:`engine.distributed.env.shutdown`; the engine cannot train afterwards."""
        if self._async_saver is not None:  # no collectives here: an uncommitted save is abandoned
            self._async_saver.abandon()
        remove = getattr(self.optimizer, "remove_hooks", None)
        if remove is not None:
            remove()
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None
        self.pipeline = None
        self.groups = None
        self._loss_group = None
        self._fp8_groups, self._checked_groups = [], []

    # ------------------------------------------------------------------ checkpoints
    def training_state(self) -> TrainingState:
        """Counters, RNG states, LR schedule, loss scaler, data position and FP8 scaling
        state as one ``state_dict`` / ``load_state_dict`` value (engine.training_state)."""
        names = module_names(self.module)  # global layer names, as the checkpoint names parameters
        fp8: dict[str, Fp8LinearState] = {}
        for m in self.module.modules():
            st = getattr(m, "fp8_state", None)
            if isinstance(st, Fp8LinearState):
                fp8.setdefault(names[id(m)], st)
        # the MoE layers' routing biases (aux-free balancing), by global name (engine.moe.stats)
        biases = {f"{names[id(m)]}.expert_bias": m.expert_bias for m in moe_layers(self.module)}
        return TrainingState(self, self.optimizer, self.lr_scheduler,
                             [g.param_group for g in self.optimizer.shard_view().groups], fp8, self.device,
                             moe_bias=biases)

    def save_checkpoint(self, save_dir: str, tag: Optional[str] = None, client_state: Optional[dict] = None,
                        save_latest: bool = True) -> str:
        """DeepSpeed's ``save_checkpoint``: sharded, atomic, loadable at any layout
        (:func:`engine.checkpoint.save_checkpoint`, docs/checkpoints.md). Collective. Rank 0 also
        writes ``zero_to_fp32.py`` into ``save_dir``, as DeepSpeed does: ``python
        zero_to_fp32.py SAVE_DIR OUTPUT_DIR`` writes the fp32 weights
        (:mod:`engine.compat.zero_to_fp32`)."""
        if self.config.checkpoint.async_save:  # snapshot now, written in the background
            path, _ = self.checkpoint_saver().save(save_dir, tag, client_state, save_latest=save_latest)
        else:
            from engine.checkpoint import save_checkpoint

            path = save_checkpoint(self, save_dir, tag, client_state, save_latest=save_latest)
        if self.global_rank == 0:  # DeepSpeed's recovery script next to the checkpoints
            from engine.checkpoint.recovery_script import write_recovery_script

            write_recovery_script(save_dir)
        return path

    def checkpoint_saver(self) -> AsyncSaver:
        """This engine's one asynchronous saver (host buffers made once; at most one save in
        flight), used by ``save_checkpoint`` under ``checkpoint.async_save`` and the entry point."""
        if self._async_saver is None:
            from engine.checkpoint.async_save import AsyncSaver

            self._async_saver = AsyncSaver(self)
        return self._async_saver

    def wait_for_checkpoint(self) -> Optional[str]:
        """Wait for the asynchronous save in flight and publish it (``latest``); its path, or
        None when none was in flight. Collective; a failed write raises CheckpointError."""
        if self._async_saver is None:
            return None
        outcome = self._async_saver.wait()
        return None if outcome is None else outcome.path

    def load_checkpoint(self, load_dir: str, tag: Optional[str] = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False) -> tuple[Optional[str], Optional[dict]]:
        """DeepSpeed's ``load_checkpoint`` -> ``(path, client_state)``, from any (dp, tp, pp,
        ZeRO stage) (:func:`engine.checkpoint.load_checkpoint`). Collective."""
        if not load_module_strict:
            raise ValueError("load_module_strict=False is not supported: every parameter of the model must be in "
                             "the checkpoint (use load_module_only=True to skip the optimizer state)")
        from engine.checkpoint import load_checkpoint

        return load_checkpoint(self, load_dir, tag, load_optimizer_states=load_optimizer_states,
                               load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only)

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's: the model's weights in the training dtype, one file (see
        :mod:`engine.weights16`). Every rank must call it."""
        return save_16bit_model(self.config, self.module, self.optimizer, save_dir, save_filename,
                                exclude_frozen_parameters, ep_group=self._expert_gather_group())

    # ------------------------------------------------------------------ memory
    def memory_breakdown(self) -> dict[str, int]:
        """Bytes this rank holds in parameters, gradients and optimizer state (ZeRO's own
        accounting: each storage counted once)."""
        return dict(self.optimizer.memory_bytes())
