"""What every ZeRO stage shares: grouping into flat buckets, backward hooks that accumulate
and reduce gradients as buckets fill, the mixed-precision step (unscale, non-finite check,
global-norm clipping, inner optimizer on the fp32 master shard, publish), state dicts and
memory accounting. The stages (stage0.py ... stage3.py) differ only in where parameters,
gradients and master weights live; each is a small subclass.

One optimizer serves ONE data-parallel group. It takes the run's
:class:`~engine.distributed.groups.ParallelGroups` (or, for data parallelism alone, the DP
:class:`~engine.distributed.groups.AxisGroup`). Gradients are averaged over the DP group only;
the TP and PP groups (``tp_group``, ``pp_group``) enter only the global gradient norm and
the "did any rank overflow" vote, and the embedding group sums the gradients of tied
weights between the pipeline stages that hold them.

The step arithmetic (loss scale, 1/gradient-accumulation, 1/DP, the tied-weight sum) is
the contract of :mod:`engine.zero.step`; this class implements it (``scale_loss``,
``set_boundary``, ``finish_backward``). Usage per optimizer step (``ga`` micro-batches)::

    for i, mb in enumerate(micro_batches):
        opt.set_boundary(i == ga - 1)   # hooks launch the reductions only on the last one
        opt.backward(loss_fn(model(mb)), num_microbatches=ga)   # loss / ga * S, backward
    stepped = opt.step()                # reduces what is left, then updates; zeroes grads

The pipeline executor runs the backward itself (``opt.scale_loss(loss, ga)``), sets the
boundary around each model chunk's last backward and calls :meth:`finish_backward`.

Where gradients live between micro-batches (what decides the peak):

- stages 0/1 keep a full fp32 accumulator per bucket for the whole step (ZeRO-1 must hold
  full gradients); the boundary decides when they are reduced, exactly once per step;
- stages 2/3 never hold a full gradient beyond three buckets: a bucket's accumulator is
  borrowed from a :class:`~engine.zero.buckets.BufferPool` when its first gradient
  arrives and is reduce-scattered into the fp32 master-gradient shard as soon as every
  parameter of the bucket has delivered its gradient in this backward pass, at EVERY
  micro-batch (boundary or not, pipeline or not), as DeepSpeed's ZeRO-2 does. At most two
  reductions are in flight while the next bucket fills (three pooled full-size
  accumulators at most); when one completes, its received shard (a pooled ``(shard,)``
  buffer, two at most) is added into the master-gradient shard and both buffers go back
  to their pools.
  Communication: ``ga`` reduce-scatters of the gradients per step instead of one (each
  ``(N-1)/N`` of the bucket per rank), the price of the sharded-size accumulation.

Gradients live in the optimizer's flat fp32 buffers: the hooks move each ``p.grad`` there
and set it to None, so ``p.grad`` is None after backward; read :meth:`grad_norm` instead.
Frozen parameters (``requires_grad=False``) are left alone (not flattened, not sharded).
Parameters become views of flat buffers: build the optimizer after moving the model to its
device and dtype, and do not move it afterwards.
"""

from __future__ import annotations

import contextlib
import logging
import math
from types import MappingProxyType
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence, Union, cast

import torch
import torch.distributed as dist

from engine.distributed import comm, strict
from engine.distributed.groups import AxisGroup, ParallelGroups
from engine.precision.loss_scaler import DynamicLossScaler, StaticLossScaler
from engine.precision.mixed import PrecisionPolicy
from engine.timers import PhaseTimers
from engine.topology import Role
from engine.zero.buckets import BufferPool, FlatBucket, FlatGroup
from engine.zero.init import is_partitioned, param_numel
from engine.zero.norm import sum_of_squares
from engine.zero.offload import NO_OFFLOAD, HostStep, OffloadOptions, host_zeros
from engine.zero.partition import GroupKey, bucketize, build_layout, group_params
from engine.zero.shard_view import ShardView, build_shard_view
from engine.zero.step import scale_loss, step_factors, sum_tied_grads
from engine.zero.weak_hook import WeakMethodHook

__all__ = ["ZeroOptimizer", "OptimizerFactory", "normalize_param_groups"]

logger = logging.getLogger(__name__)

OptimizerFactory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]
ParamsArg = Union[torch.nn.Module, Iterable[torch.nn.Parameter], Iterable[dict[str, Any]]]


def normalize_param_groups(params: ParamsArg) -> list[dict[str, Any]]:
    """A module, a list of parameters or a list of torch-style group dicts -> group dicts
    holding only trainable parameters (frozen ones are left alone)."""
    if isinstance(params, torch.nn.Module):
        params = params.parameters()
    items: list[Any] = list(params)
    if not items:
        raise ValueError("ZeRO optimizer got no parameters: pass the model or its trainable parameters")
    if all(isinstance(x, dict) for x in items):
        groups = [dict(g) for g in items]
    elif all(isinstance(x, torch.Tensor) for x in items):
        groups = [{"params": items}]
    else:
        raise TypeError("params must be a module, a list of parameters, or a list of dicts with 'params'")
    for g in groups:
        if "params" not in g:
            raise ValueError("every parameter group dict needs a 'params' entry")
        ps = g["params"]
        g["params"] = [p for p in ([ps] if isinstance(ps, torch.Tensor) else list(ps)) if p.requires_grad]
    return groups


def _mesh(groups: Union[ParallelGroups, AxisGroup],
          tied: bool) -> tuple[AxisGroup, AxisGroup, AxisGroup, AxisGroup]:
    """(grad, tp, pp, embedding) from what the caller passed: the run's ParallelGroups (its
    ``Role.GRAD`` group reduces and partitions), or that group alone (tp = pp = 1, no tied
    weights across stages)."""
    if isinstance(groups, AxisGroup):
        if tied:
            raise ValueError("tied_params are summed over the embedding group: pass the ParallelGroups, "
                             "not the DP group alone")
        me = groups.global_rank
        return groups, AxisGroup.single("tp", me), AxisGroup.single("pp", me), AxisGroup.single("embedding", me)
    if not isinstance(groups, ParallelGroups):
        raise TypeError(f"ZeRO takes the ParallelGroups or the DP AxisGroup, got {type(groups).__name__} "
                        "(wrap a torch process group with engine.distributed.groups.AxisGroup.of(group))")
    if tied and not groups.in_embedding_group:
        raise ValueError(f"tied parameters were given on rank {groups.rank}, a middle pipeline stage: tied "
                         "weights live on the first and last stage only")
    emb = groups.embedding_group if tied else AxisGroup.single("embedding", groups.rank)
    return groups.role(Role.GRAD), groups.role(Role.TP), groups.role(Role.PP), emb


def _master_grad(master: torch.nn.Parameter) -> torch.Tensor:
    """A group's fp32 master gradient (the bucket shard grads are views into it)."""
    grad = master.grad
    assert grad is not None  # bound once in the group's _init_grad_storage, only ever zeroed in place
    return grad


class ZeroOptimizer:
    """Base class; use :func:`engine.zero.build_zero_optimizer` or a stage class."""

    stage: int = -1
    shards_optimizer_state: bool = True  # stage >= 1: reduce-scatter into DP shards
    keeps_full_grads: bool = True  # stages 0/1: a full fp32 accumulator while gradients accumulate
    # stage 1: a bucket with nothing accumulated when the boundary micro-step reaches it (no
    # gradient accumulation) is reduced as it fills, like stage 2; its full accumulator exists
    # only across accumulating micro-steps and is freed after the step's reduction
    pools_on_boundary: bool = False
    # pooled buckets: reduce-scatters in flight at once while the next bucket fills (so up to
    # MAX_INFLIGHT + 1 full-size accumulators and MAX_INFLIGHT (shard,) receive buffers)
    MAX_INFLIGHT: int = 2

    def _checked_precision(self, precision: PrecisionPolicy) -> PrecisionPolicy:
        """bf16 masters (DeepSpeed's bf16.bf16_master_weights_and_grads) need sharded state: an
        unsharded optimizer (stage 0) accumulates every micro-batch's gradient straight into
        the master gradient, which would round each add to bf16 (the config refuses stage 0;
        this is the same rule for an optimizer built directly)."""
        if precision.master_dtype != torch.float32 and not self.shards_optimizer_state:
            raise ValueError(f"{type(self).__name__} (ZeRO stage {self.stage}) with master_dtype "
                             f"{precision.master_dtype}: bf16 master weights and gradients need ZeRO stage 1, 2 or "
                             "3 (stage 0 would accumulate every micro-batch's gradient into the bf16 master "
                             "gradient); use stage 1-3, or PrecisionPolicy(master_dtype=torch.float32)")
        return precision

    def __init__(self, params: ParamsArg, optimizer_factory: OptimizerFactory,  # noqa: PLR0913 (keyword-only options named as DeepSpeed's zero_optimization keys)
                 groups: Union[ParallelGroups, AxisGroup], *,
                 tied_params: Sequence[torch.nn.Parameter] = (),
                 precision: Optional[PrecisionPolicy] = None,
                 loss_scaler: Union[StaticLossScaler, DynamicLossScaler, None] = None,
                 reduce_bucket_size: int = 500_000_000, overlap_comm: bool = True, alignment: int = 8,
                 clip_grad: float = 0.0, role_groups: Mapping[Role, AxisGroup] = MappingProxyType({}),
                 offload: OffloadOptions = NO_OFFLOAD):
        self.precision = self._checked_precision(precision or PrecisionPolicy())
        if not dist.is_initialized():
            raise RuntimeError("ZeRO optimizers need an initialised process group (even for one process: "
                               "engine.distributed.env.init_distributed(), or gloo with world_size=1)")
        self.grad_group, self.tp_group, self.pp_group, self.embedding_group = _mesh(groups, bool(tied_params))
        self.grad_size = comm.group_size(self.grad_group)
        self.grad_rank = comm.group_rank(self.grad_group)
        self.loss_scaler = loss_scaler or StaticLossScaler(1.0)
        if clip_grad < 0:
            raise ValueError(f"gradient_clipping must be >= 0 (0 disables it), got {clip_grad}")
        self.clip_grad = float(clip_grad)
        self.reduce_bucket_size = int(reduce_bucket_size)
        self.overlap_comm = bool(overlap_comm)
        self.alignment = int(alignment)
        self.skipped_steps = 0
        self.last_grad_norm: Optional[torch.Tensor] = None  # 0-dim, on the device: read it only when needed
        self._boundary = True
        self._reduced = False
        self._norm_cache: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._hooks: list[Any] = []
        self._pool = BufferPool(torch.device("cpu"))  # stages 2/3 accumulators; device set below
        self._recv_pool = BufferPool(torch.device("cpu"))
        self._inflight: list[FlatBucket] = []  # pooled buckets whose reduce-scatter is in flight
        if offload.optimizer and not self.shards_optimizer_state:
            raise ValueError("offload_optimizer needs ZeRO stage 1, 2 or 3 (the offloaded state is the rank's shard)")
        if offload.param and self.stage != 3:
            raise ValueError("offload_param needs ZeRO stage 3 (only stage 3 partitions the parameters)")
        self.offload = offload
        self._low_fresh = False  # the host low-precision copies hold the last step's update

        user_groups = normalize_param_groups(params)
        self._check_params([p for g in user_groups for p in g["params"]])
        keyed = group_params([g["params"] for g in user_groups], tied_params)
        self.groups: list[FlatGroup] = []
        self.buckets: list[FlatBucket] = []
        self._reduce_groups = {Role.GRAD: self.grad_group, **role_groups}
        for key, plist in keyed.items():
            reduce_group = self._reduce_group_of(key)
            num_shards = reduce_group.size if self.shards_optimizer_state else 1
            shard_index = reduce_group.rank if self.shards_optimizer_state else 0
            buckets: list[FlatBucket] = []
            for chunk in self._plan_buckets(key, cast(list[torch.nn.Parameter], plist)):  # module parameters
                layout = build_layout([param_numel(p) for p in chunk], num_shards, self.alignment)
                buckets.append(FlatBucket(chunk, layout, shard_index, index=len(self.buckets) + len(buckets)))
            options = {k: v for k, v in user_groups[key.param_group].items() if k != "params"}
            group = FlatGroup(key, buckets, options, self._device, reduce_group, offload=offload.optimizer,
                              pin_memory=offload.pin_memory, master_dtype=self.precision.master_dtype)
            self.groups.append(group)
            self.buckets.extend(buckets)
        self._where = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        # pooled full-size fp32 accumulators (<= MAX_INFLIGHT + 1 alive) and (shard,) receive
        # buffers (<= MAX_INFLIGHT) of stages 2/3, reused across micro-batches and steps
        self._pool = BufferPool(self._device, capacity=self.MAX_INFLIGHT + 1)
        self._recv_pool = BufferPool(self._device, capacity=self.MAX_INFLIGHT)
        for b in self.buckets:
            b.pooled = not self.keeps_full_grads
            b.comm_dtype = self.precision.comm_dtype  # communication_data_type
            self._init_bucket(b)
        self._host = HostStep(self._device, offload)
        self.optimizer = optimizer_factory([g.param_group() for g in self.groups])
        attach = getattr(self.optimizer, "attach_shard_view", None)
        if callable(attach):  # an inner optimizer that works on whole matrices (Muon) asks for the layout
            if offload.optimizer:
                raise ValueError("offload_optimizer with Muon is not implemented: its Newton-Schulz iterations "
                                 "run on whole matrices gathered on the accelerator; use AdamW or Lion")
            attach(self.shard_view())
        if offload.optimizer:
            self._attach_low_copies()
        self._register_grad_hooks()

    # ------------------------------------------------------------------ construction
    def _attach_low_copies(self) -> None:
        """Offload with a bf16/fp16 model and an inner optimizer that can write the
        low-precision copy of its update in the same pass (FusedAdamW: the fused CPU kernel):
        a host ``(shard,)`` buffer per group for it, what is copied back to the device."""
        attach = getattr(self.optimizer, "attach_param_copy", None)
        for g in self.groups:
            dtype = g.buckets[0].dtype
            # (bf16 masters are the low-precision copy themselves: nothing to attach)
            if callable(attach) and dtype in (torch.bfloat16, torch.float16) and g.master.numel() \
                    and g.master.dtype == torch.float32:
                g.low = host_zeros(g.master.numel(), dtype, self.offload.pin_memory)
                attach(g.master, g.low)

    def use_timers(self, timers: PhaseTimers) -> None:
        """Record the offloaded step's phases (copy out, CPU step, copy back) in ``timers``
        (the engine's ``wall_clock_breakdown``)."""
        self._host.timers = timers

    def _check_params(self, params: list[torch.nn.Parameter]) -> None:
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise ValueError(f"all parameters must be on one device, found {sorted(map(str, devices))}")
        self._device = devices.pop()
        if self.stage != 3 and any(is_partitioned(p) for p in params):
            raise ValueError("the model was built under engine.zero.Init(): its parameters are partitioned, which "
                             "only ZeRO stage 3 takes; set zero_optimization.stage to 3 or build it without Init")
        for p in params:
            if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                raise ValueError(f"parameter of dtype {p.dtype} cannot be trained with ZeRO: use fp32/bf16/fp16")

    def _plan_buckets(self, key: GroupKey, params: list[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
        """Consecutive runs of at most ``reduce_bucket_size`` elements; a tied weight always
        gets its own bucket (same layout on every stage holding it)."""
        if key.tied_index >= 0:
            return [[p] for p in params]
        return [[params[i] for i in idx] for idx in bucketize([p.numel() for p in params], self.reduce_bucket_size)]

    def _init_bucket(self, b: FlatBucket) -> None:
        """Stages 0-2: the parameters live in the bucket's full buffer; the master shard is
        this rank's chunk of it in fp32."""
        full = b.flatten_params()
        b.bind(full)
        b.shard_master.copy_(b.shard_of(full))
        self._init_grad_storage(b)

    def _init_grad_storage(self, b: FlatBucket) -> None:
        if self.keeps_full_grads and not self.pools_on_boundary:
            b.grad_acc = torch.zeros(b.layout.padded_numel, dtype=torch.float32, device=b.device)

    def _register_grad_hooks(self) -> None:
        for b in self.buckets:
            for p in b.params:
                # weakly: torch keeps this hook where gc cannot see it (engine/zero/weak_hook.py)
                self._hooks.append(p.register_post_accumulate_grad_hook(WeakMethodHook(self._on_grad)))

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def shard_view(self) -> ShardView:
        """Where each parameter's elements lie in this rank's master shards, their optimizer
        state and the way to load it back (engine.zero.shard_view: the checkpoint boundary)."""
        return build_shard_view(self.groups, self.shards_optimizer_state, self.grad_group, self.tp_group,
                                stage=self.stage, optimizer=self.optimizer, publish=self._publish)

    # ------------------------------------------------------------------ micro-steps
    def set_boundary(self, is_boundary: bool) -> None:
        """Whether the next backward is the last micro-batch of this optimizer step (only
        then do the hooks launch reductions as buckets fill)."""
        self._boundary = bool(is_boundary)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate (like DDP's ``no_sync``)."""
        prev = self._boundary
        self._boundary = False
        try:
            yield
        finally:
            self._boundary = prev

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.loss_scale

    def scale_loss(self, loss: torch.Tensor, num_microbatches: int = 1) -> torch.Tensor:
        """``loss / num_microbatches * loss scale``: what to differentiate (engine.zero.step)."""
        return scale_loss(loss, num_microbatches, self.loss_scaler.loss_scale)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, num_microbatches: int = 1) -> None:
        """Backward of one micro-batch's ``loss`` (one of ``num_microbatches`` of the step):
        ``loss / num_microbatches * loss scale``."""
        self.scale_loss(loss, num_microbatches).backward(retain_graph=retain_graph)

    def finish_backward(self) -> None:
        """After the step's last backward (the pipeline executor's end of step): complete
        every reduction and sum the tied weights (:meth:`reduce_gradients`)."""
        self.reduce_gradients()

    def _reduce_group_of(self, key: GroupKey) -> AxisGroup:
        """The group a flat group is reduced and partitioned over: the grad role's, or for
        expert shards the expert-gradient role's (``role_groups``), which must lie inside it
        (an expert's replicas are a subset of the data replicas)."""
        role = Role.EXPERT_GRAD if key.expert else Role.GRAD
        group = self._reduce_groups.get(role)
        if group is None:
            raise ValueError("expert-sharded parameters (Placement.expert) are reduced over the replicas of their "
                             "expert shard: pass role_groups={Role.EXPERT_GRAD: <that group>}")
        if not set(group.ranks) <= set(self.grad_group.ranks):
            raise ValueError(f"the {role.value} group {list(group.ranks)} is not inside the grad group "
                             f"{list(self.grad_group.ranks)}: an expert shard's replicas are data replicas")
        return group

    def _grad_factor(self) -> float:
        """The contract's gradient factor 1 / (dp * S), applied as the hooks add a gradient
        into an fp32 accumulator (engine.zero.step)."""
        return step_factors(1, self.grad_size, self.loss_scaler.loss_scale).grad

    def _on_grad(self, p: torch.Tensor) -> None:
        b, i = self._where[id(p)]
        alpha = self._grad_factor()
        self._reduced = False
        if self.pools_on_boundary and not b.pooled and b.grad_acc is None and self._boundary:
            b.pooled = True  # nothing accumulated here this step: no full gradient needed
        if b.pooled:
            self._on_grad_sharded(b, i, p, alpha)
            return
        if b.launched:
            raise RuntimeError(
                "a gradient arrived for a parameter whose bucket was already reduced this step: "
                "call set_boundary(True) only before the LAST backward of the step, or run every "
                "backward before reduce_gradients()")
        assert p.grad is not None  # called from the parameter's gradient hook
        # a low-precision accumulator holds raw sums (a scaled fp16 gradient stays in range);
        # the factor is applied when it is copied to fp32 for the reduction (stage 1's _launch)
        b.accumulate(i, p.grad, alpha=alpha if b.acc_dtype == torch.float32 else 1.0)
        p.grad = None  # the fp32 accumulator holds it now
        if self._boundary and self.overlap_comm:
            b.ready += 1
            if b.ready == len(b.params):
                self._launch(b)

    def _on_grad_sharded(self, b: FlatBucket, i: int, p: torch.Tensor, alpha: float,
                         grad: Optional[torch.Tensor] = None) -> None:
        """Stages 2/3: fill the bucket's pooled accumulator; reduce-scatter it as soon as every
        parameter of the bucket delivered its gradient in this backward pass. ``grad``: one
        use's gradient contribution handed over directly (ZeRO-3's shared parameters), instead
        of ``p.grad``; the caller owns it (it may be scaled in place and borrowed)."""
        if any(x is b for x in self._inflight):
            self._drain_through(b)  # the previous pass's reduction of this bucket must land first
        if i in b.arrived:
            # a new backward pass reached a bucket the previous one left incomplete (a
            # parameter unused there, or one of another pipeline chunk): reduce what the
            # previous pass left first, and complete that reduction before this gradient is
            # added: the accumulator (and ``arrived``) belong to the reduction until then, and
            # an add into it in flight is either reduced or lost depending on timing (on gloo
            # and NCCL alike)
            self._launch_sharded(b)
            self._drain_through(b)
        g = p.grad if grad is None else grad
        assert g is not None  # a post-accumulate-grad hook: the gradient is there
        if len(b.params) == 1 and b.grad_acc is None and g.numel() == b.layout.padded_numel:
            # a bucket of one parameter (a tied embedding, a large unit): reduce its fp32
            # gradient where autograd left it (ours alone: AccumulateGrad clones shared ones),
            # scaled in place as the copy into a pooled buffer would be; a bf16/fp16 one through
            # its own fp32 copy, freed after the reduction. Either way the pool's buffers stay
            # the size of the ordinary buckets (not kept at a large parameter's size between steps)
            if g.dtype != torch.float32 or not g.is_contiguous():
                g = g.reshape(-1).to(torch.float32, copy=True)
            b.grad_acc = g.view(-1).mul_(alpha) if alpha != 1.0 else g.view(-1)
            b.borrowed = True
            b.arrived.add(i)
            p.grad = None
            self._launch_sharded(b)
            return
        if b.grad_acc is None:
            b.grad_acc = self._pool.acquire(b.layout.padded_numel)
        b.accumulate(i, g, alpha=alpha)
        p.grad = None
        if len(b.arrived) == len(b.params):
            self._launch_sharded(b)

    def _launch_sharded(self, b: FlatBucket) -> None:
        """Reduce-scatter the pooled accumulator of ``b`` (async when overlapping). At most
        ``MAX_INFLIGHT`` (2) reductions are in flight: the oldest completes before a third
        is launched, so at most three full-size accumulators exist (two being reduced, one
        filling) and at most two (shard,) receive buffers."""
        self._drain_inflight(keep=self.MAX_INFLIGHT - 1)
        if b.grad_acc is None:
            b.grad_acc = self._pool.acquire(b.layout.padded_numel)
        b.zero_unfilled()
        # the step's first reduction lands in the master-gradient shard itself; later ones
        # land in a pooled (shard,) receive buffer that is added into it when they complete
        if b.reductions > 0:
            b.recv = self._recv_pool.acquire(b.layout.shard_numel)
        b.launch_reduce(b.reduce_group, sharded=True, async_op=self.overlap_comm, out=b.recv)
        b.reductions += 1
        self._inflight.append(b)
        if not self.overlap_comm:
            self._drain_inflight()

    def _drain_through(self, b: FlatBucket) -> None:
        """Complete the reductions in flight up to and including ``b``'s (launch order)."""
        while any(x is b for x in self._inflight):
            self._complete(self._inflight.pop(0))

    def _drain_inflight(self, keep: int = 0) -> None:
        """Complete the oldest reductions in flight until at most ``keep`` remain."""
        while len(self._inflight) > keep:
            self._complete(self._inflight.pop(0))

    def _complete(self, b: FlatBucket) -> None:
        b.wait()
        if b.recv is not None:
            b.shard_grad.add_(b.recv)
            self._recv_pool.release(b.recv)
            b.recv = None
        if not b.borrowed:
            assert b.grad_acc is not None  # a bucket in flight holds its pooled accumulator
            self._pool.release(b.grad_acc)
        b.grad_acc = None
        b.borrowed = False
        b.arrived.clear()

    def _launch(self, b: FlatBucket) -> None:
        # Always async: the hooks only launch with overlap_comm, and after backward the
        # remaining buckets are queued back to back and waited together (gloo, 2 ranks,
        # 11 x 500k fp32: 30 ms one at a time, 20 ms queued).
        b.launch_reduce(b.reduce_group, sharded=self.shards_optimizer_state, async_op=True)

    def _launch_remaining(self) -> None:
        """Launch the reduction of every bucket the hooks did not launch."""
        for b in self.buckets:
            if not b.launched and not b.pooled:
                self._launch(b)

    def reduce_gradients(self) -> None:
        """Reduce every bucket not yet reduced and wait for all (the hooks pre-divided by
        dp * loss scale, so the result is the unscaled DP mean).
        Idempotent until the next backward. Call once after the last micro-batch (the
        pipeline executor does); :meth:`step` calls it if needed."""
        if self._reduced:
            return
        # pooled buckets: partly filled accumulators (parameters unused in the last pass); a
        # bucket no gradient reached this step still takes part once (same collectives everywhere)
        self._drain_inflight()
        for b in self.buckets:
            if b.pooled and (b.grad_acc is not None or b.reductions == 0):
                self._launch_sharded(b)
        if not all(b.pooled for b in self.buckets):  # full accumulators: one reduction each
            self._launch_remaining()
        self._drain_inflight()  # pooled ones (and stage 1's low-precision accumulators, upcast at launch)
        for b in self.buckets:
            if not b.pooled:
                b.wait()
                self._after_reduce(b)
        self._reduce_tied()  # the hooks already divided by dp * loss scale
        for b in self.buckets:
            b.reset_step()
        self._reduced = True
        self._norm_cache = None

    def _after_reduce(self, b: FlatBucket) -> None:
        """After a full accumulator's reduction completed: stage 1 frees it (its shard is in
        the master gradient now); stage 0's is the master gradient itself."""
        if self.pools_on_boundary:
            b.grad_acc = None

    def _reduce_tied(self) -> None:
        """Sum tied-weight gradients between the pipeline stages that hold a copy (same DP
        shard on each: a tied weight's bucket has the same layout everywhere)."""
        tied = sorted((g for g in self.groups if g.key.tied_index >= 0), key=lambda g: g.key.tied_index)
        sum_tied_grads([g.grad for g in tied], self.embedding_group)

    # ------------------------------------------------------------------ norm and step
    def _mesh_groups(self) -> list[AxisGroup]:
        # unsharded state with more than one reduce group (stage 0 with expert shards): each
        # flat group counts on the replica that speaks for it, summed over the grad group
        several = any(g.reduce_group is not self.grad_group for g in self.groups)
        groups = [self.grad_group] if self.shards_optimizer_state or several else []
        return [g for g in groups + [self.tp_group, self.pp_group] if g.size > 1]

    def _counts_in_norm(self, g: FlatGroup, tp_rank: int, several: bool) -> bool:
        """Each element of the unsharded model once: TP-replicated groups on tp rank 0 only,
        pipeline duplicates of tied weights never, and (unsharded state summed over the grad
        group, see _mesh_groups) each group on the first of its replicas."""
        if g.key.tied_copy or (not g.key.tp_sharded and tp_rank != 0):
            return False
        return self.shards_optimizer_state or not several or g.reduce_group.rank == 0

    def _grad_stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(global grad norm, any non-finite anywhere) as 0-dim tensors on the device (no
        host sync); one all-reduce; cached per step."""
        if self._norm_cache is not None:
            return self._norm_cache
        tp_rank = comm.group_rank(self.tp_group)
        several = any(g.reduce_group is not self.grad_group for g in self.groups)
        stats = torch.zeros(2, dtype=torch.float64, device=self._device)  # [sum of squares, non-finite count]
        for g in self.groups:
            # No host sync here: a non-finite sum lands in both stats (the count decides).
            sq = sum_of_squares(g.grad)
            stats[1] += (~torch.isfinite(sq)).to(stats.dtype)
            if not self._counts_in_norm(g, tp_rank, several):
                continue
            stats[0] += sq
        for grp in self._mesh_groups():
            comm.all_reduce(stats, grp)
        overflow = stats[1] > 0
        norm = torch.where(overflow, torch.full_like(stats[0], math.inf), stats[0].sqrt())
        self._norm_cache = (norm, overflow)
        return self._norm_cache

    def grad_norm_tensor(self) -> torch.Tensor:
        """Global L2 norm of the (reduced, unscaled) gradients over DP, TP and PP, every
        element of the unsharded model counted once, inf if any gradient is non-finite: a
        0-dim float64 tensor on the device (reading it on the host is the caller's sync)."""
        self.reduce_gradients()
        return self._grad_stats()[0]

    def grad_norm(self) -> float:
        """:meth:`grad_norm_tensor` read on the host (one device sync)."""
        return float(self.grad_norm_tensor())

    def step(self, closure: None = None) -> bool:
        """Reduce (if not done), skip on non-finite gradients anywhere (counted; fp16 adjusts
        the loss scale), clip by global norm, update the master shard, publish it to the
        parameters, zero the gradients. Returns whether the parameters were updated."""
        if closure is not None:
            raise ValueError("ZeRO optimizers do not take a closure")
        # the strict mode (engine.distributed.strict, rule 6) checks this region has no host sync but
        # the fp16 skip decision; the inner optimizer's own step is not checked (torch's
        # Adam reads its step counter, a CPU tensor, on the host)
        with comm.no_host_sync("the ZeRO optimizer step (reduction, norm, clipping)"):
            if not self._prepare_step():
                return False
        if self.offload.optimizer:  # engine.zero.offload: reduced (and clipped) shards to the host, step there
            self._host.copy_out([(_master_grad(g.master), g.grad) for g in self.groups])
            self._host.cpu_step(self.optimizer.step)
            self._low_fresh = True
        else:
            self.optimizer.step()
        self.loss_scaler.update(False)
        self._publish()
        self.zero_grad()
        return True

    def _prepare_step(self) -> bool:
        """Reduce (if not done), the global norm and overflow vote on the device, the fp16
        skip, clipping. Returns False when the step is skipped (gradients zeroed)."""
        self.reduce_gradients()
        need_norm = self.clip_grad > 0 or self.precision.checks_nonfinite
        norm, overflow = self._grad_stats() if need_norm else (None, None)
        self.last_grad_norm = norm
        if self.precision.checks_nonfinite:
            assert overflow is not None
            # the ONE host read of the step (whether any rank overflowed decides the skip and
            # the fp16 loss scaler's update, both host logic); every precision checks by default
            with strict.host_sync_allowed():
                skip = bool(overflow)
            if skip:
                self.skipped_steps += 1
                self.loss_scaler.update(True)
                logger.warning("non-finite gradients: step skipped (%d skipped so far)", self.skipped_steps)
                self.zero_grad()
                return False
        if self.clip_grad > 0:
            assert norm is not None
            # clip on the device: coef = min(1, clip / (norm + 1e-6)); a factor of exactly 1
            # leaves the gradients unchanged (DeepSpeed clips when norm + 1e-6 > clip, as here)
            coef = torch.clamp(self.clip_grad / (norm + 1e-6), max=1.0)
            for g in self.groups:
                g.grad.mul_(coef)
        return True

    def _publish(self) -> None:
        """Updated master shards -> parameters (with offload: the copy back to the device, a
        ``wall_clock_breakdown`` phase of its own)."""
        if self.offload.optimizer:
            with self._host.copy_back_phase():
                self._publish_shards()
        else:
            self._publish_shards()
        self._low_fresh = False

    def _publish_shards(self) -> None:
        """All-gather each bucket's updated shard over DP (stages 0 and 3 override)."""
        works = []
        for b in self.buckets:
            works.append(self._gather_bucket(b))
        for w in works:
            if w is not None:
                w.wait()

    def _updated_shard(self, b: FlatBucket) -> torch.Tensor:
        """Where ``b``'s updated shard is read from: the fp32 master, or (offload, right after
        a step) the host low-precision copy the CPU kernel wrote in the same pass."""
        g = b.group
        assert g is not None  # bound by FlatGroup
        if self._low_fresh and g.low is not None:
            return g.low[b.master_offset:b.master_offset + b.layout.shard_numel]
        return b.shard_master

    def _gather_bucket(self, b: FlatBucket) -> Any:
        # a separate send buffer: the shard's slot in ``full`` is also written by the gather
        if self.offload.optimizer:
            send = self._host.to_device(self._updated_shard(b), b.dtype)
        else:
            send = b.shard_master.to(b.dtype, copy=True)
        assert b.full is not None  # stages 0-2 keep every bucket bound
        return comm.all_gather(b.full, send, b.reduce_group, async_op=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear accumulated gradients (``set_to_none`` accepted for torch compatibility)."""
        self._drain_inflight()
        for b in self.buckets:
            b.wait()
            b.reset_step()
            if b.pooled:
                if b.grad_acc is not None:  # filled but never reduced (zero_grad without a step)
                    self._pool.release(b.grad_acc)
                    b.grad_acc = None
                b.arrived.clear()
                b.pooled = not self.keeps_full_grads  # stage 1 decides again next step
            elif self.pools_on_boundary:
                b.grad_acc = None  # freed (a zero_grad without a step)
            else:
                assert b.grad_acc is not None  # unpooled stages keep their accumulator bound
                if b.grad_acc.data_ptr() != b.shard_grad.data_ptr():  # stage 0: zeroed as the master grad
                    b.grad_acc.zero_()
            for p in b.params:
                p.grad = None
        for g in self.groups:
            g.grad.zero_()
        self._reduced = False
        self._norm_cache = None

    # ------------------------------------------------------------------ torch-like surface
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard: fp32 master shards, inner optimizer state, loss scaler."""
        return {
            "stage": self.stage, "dp_size": self.grad_size, "dp_rank": self.grad_rank,
            "master": [g.master.detach() for g in self.groups],  # live views, as torch state dicts
            "optimizer": self.optimizer.state_dict(),
            "loss_scaler": self.loss_scaler.state_dict(),
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if (sd["stage"], sd["dp_size"], sd["dp_rank"]) != (self.stage, self.grad_size, self.grad_rank):
            raise ValueError(f"state dict is for stage {sd['stage']} at grad-group rank {sd['dp_rank']}/{sd['dp_size']}, "
                             f"this optimizer is stage {self.stage} at {self.grad_rank}/{self.grad_size}; "
                             f"resharding needs the checkpoint tools")
        if [m.shape for m in sd["master"]] != [g.master.shape for g in self.groups]:
            raise ValueError("state dict master shards do not match this model's layout")
        for g, m in zip(self.groups, sd["master"]):
            g.master.data.copy_(m)
        self.optimizer.load_state_dict(sd["optimizer"])
        self.loss_scaler.load_state_dict(sd["loss_scaler"])
        self.skipped_steps = int(sd["skipped_steps"])
        self._publish()

    # ------------------------------------------------------------------ memory
    def empty_partition_cache(self) -> None:
        """Release parameters held gathered between uses (ZeRO-3 overrides it); nothing to
        release below stage 3."""

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now, counted from its own tensors (each storage once):
        ``params`` (compute-dtype parameter storage), ``grads`` (gradient buffers, fp32
        accumulators of stages 0/1 and master gradients included), ``optimizer_state`` (fp32
        master shards and the inner optimizer's state), ``buckets`` (stages 2/3: the
        reusable reduction buffers: at most three buckets and two receive shards);
        ``offloaded``: what ZeRO-Offload keeps in host memory (fp32 master shards, their
        gradient copies, the optimizer state, the low-precision update copies and, with
        offload_param, the stage-3 parameter shards), counted there and not in the others."""
        seen: set[int] = set()

        def size(ts: Iterable[Optional[torch.Tensor]]) -> int:
            total = 0
            for t in ts:
                if t is None or not isinstance(t, torch.Tensor) or t.numel() == 0:
                    continue
                st = t.untyped_storage()
                if st.data_ptr() in seen:
                    continue
                seen.add(st.data_ptr())
                total += st.nbytes()
            return total

        offloaded = size(self._offloaded_tensors())  # first: the keys below count the rest
        grads = size([g.master.grad for g in self.groups] + [g.grad for g in self.groups] + [p.grad for b in self.buckets for p in b.params]
                     + [b.grad_acc for b in self.buckets if not b.pooled])
        buckets = size(self._pool.buffers() + self._recv_pool.buffers())
        opt_state = size([g.master for g in self.groups]
                         + [v for st in self.optimizer.state.values() for v in st.values()])
        return {"params": size(self._param_tensors()), "grads": grads, "optimizer_state": opt_state,
                "buckets": buckets, "offloaded": offloaded}

    def _offloaded_tensors(self) -> list[Optional[torch.Tensor]]:
        out: list[Optional[torch.Tensor]] = []
        if self.offload.optimizer:
            out += [t for g in self.groups for t in (g.master, g.master.grad, g.low)]
            out += [v for st in self.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        if self.offload.param:
            out += [b.compute_shard for b in self.buckets if not b.persistent]
        return out

    def _param_tensors(self) -> list[Optional[torch.Tensor]]:
        return [b.full for b in self.buckets]
