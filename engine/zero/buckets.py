"""Flat buckets and flat groups: the storage the ZeRO stages work on.

A :class:`FlatBucket` is a run of parameters of one :class:`FlatGroup` laid out by a
:class:`~engine.zero.partition.FlatLayout`. It owns (depending on the stage):

- ``full``: the bucket's parameters in the compute dtype, ``(padded_numel,)``; the
  parameters' ``.data`` are views into it while it is bound;
- ``grad_acc``: fp32 gradient accumulator ``(padded_numel,)`` into which the backward hooks
  add each parameter's gradient (and free it); reduced over DP by one collective. Stages
  0/1 own it for the whole step; stages 2/3 borrow it from a :class:`BufferPool` only while
  the bucket fills and its reduce-scatter is in flight (``pooled``);
- ``shard_master`` / ``shard_grad``: this rank's chunk of the bucket inside the group's
  fp32 master shard and its gradient, ``(shard_numel,)``.

A :class:`FlatGroup` holds the fp32 master shard of every bucket of one group key,
concatenated, as a single ``nn.Parameter`` that the inner optimizer steps on.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from engine.distributed import comm
from engine.distributed.groups import AxisGroup
from engine.zero.init import param_shape
from engine.zero.offload import host_zeros
from engine.zero.partition import FlatLayout, GroupKey

__all__ = ["FlatBucket", "FlatGroup", "BufferPool"]


class FlatBucket:
    """Parameters of one bucket and the flat buffers that hold them (see module docstring)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], layout: FlatLayout, shard_index: int,
                 index: int):
        self.params = list(params)
        self.layout = layout
        self.shard_index = shard_index  # this rank's shard of the bucket (its DP rank, or 0)
        self.index = index  # position among all buckets of the optimizer (collective order)
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.dtype = self.params[0].dtype if self.params else torch.float32
        self.shapes = [param_shape(p) for p in self.params]
        self.full: Optional[torch.Tensor] = None  # (padded,) compute dtype
        self.grad_acc: Optional[torch.Tensor] = None  # (padded,) fp32 (or acc_dtype)
        # dtype of a full accumulator kept across micro-batches (ZeRO-1's grad_accum_dtype): a
        # low-precision one holds raw gradient sums; the step's factor is applied as it is
        # copied into an fp32 pooled buffer to be reduced (engine.zero.base._launch)
        self.acc_dtype = torch.float32
        # DeepSpeed's communication_data_type: the dtype the reduction runs in (fp32: the
        # accumulator itself; bf16/fp16: a cast copy, summed, then copied back into fp32)
        self.comm_dtype = torch.float32
        self._upcast: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # (fp32 target, low result)
        # set by the group (FlatGroup) right after the buckets are built:
        self.shard_master: torch.Tensor  # (shard,) view into the group master (fp32, or bf16)
        self.shard_grad: torch.Tensor  # (shard,) view into the group's (device) master gradient
        self.master_offset = 0  # where shard_master starts in the group's master
        self.group: Optional["FlatGroup"] = None
        # ZeRO-3 only: this rank's chunk in the compute dtype (what the all-gather sends),
        # an in-flight prefetch (full buffer, work), and whether the bucket stays whole.
        self.compute_shard: Optional[torch.Tensor] = None  # (shard,) compute dtype
        self.pending: Optional[tuple[torch.Tensor, Any]] = None
        self.gather_buf: Optional[torch.Tensor] = None  # (padded,) whose storage is freed between uses
        self.persistent = True
        # per-step reduction state
        self.ready = 0  # parameters whose gradient arrived on the boundary micro-step
        self.work: Any = None
        self.launched = False
        # stages 2/3 (pooled accumulator): which parameters the current fill holds, the
        # pooled (shard,) fp32 receive buffer of a reduction after the step's first, and how many
        # reductions this bucket had this step
        self.pooled = False
        self.arrived: set[int] = set()
        self.recv: Optional[torch.Tensor] = None
        self.reductions = 0
        self.borrowed = False  # grad_acc is the parameter's own fp32 gradient, not a pooled buffer

    # ----------------------------------------------------------------- parameter storage
    def flatten_params(self) -> torch.Tensor:
        """A fresh ``(padded,)`` buffer holding the parameters' current values (zeros in gaps)."""
        buf = torch.zeros(self.layout.padded_numel, dtype=self.dtype, device=self.device)
        for i, p in enumerate(self.params):
            lo, hi = self.layout.param_range(i)
            buf[lo:hi].copy_(p.detach().reshape(-1))
        return buf

    def bind(self, full: torch.Tensor) -> None:
        """Make ``full`` the storage of the parameters (``p.data`` become views into it)."""
        self.full = full
        for i, (p, shape) in enumerate(zip(self.params, self.shapes)):
            lo, hi = self.layout.param_range(i)
            p.data = full[lo:hi].view(shape)

    def unbind(self) -> None:
        """Drop the full buffer; the parameters become empty placeholders (ZeRO-3)."""
        self.full = None
        for p in self.params:
            p.data = torch.empty(0, dtype=self.dtype, device=self.device)

    def shard_of(self, flat: torch.Tensor) -> torch.Tensor:
        lo, hi = self.layout.shard_range(self.shard_index)
        return flat[lo:hi]

    # ----------------------------------------------------------------- gradients
    def accumulate(self, i: int, grad: torch.Tensor, alpha: float = 1.0) -> None:
        """Add ``alpha`` times parameter ``i``'s gradient into the accumulator (allocated on
        demand, ``acc_dtype``); the scaling rides on the add for free."""
        if self.grad_acc is None:
            self.grad_acc = torch.zeros(self.layout.padded_numel, dtype=self.acc_dtype, device=self.device)
        lo, hi = self.layout.param_range(i)
        if self.pooled and i not in self.arrived:
            # a reused buffer holds stale values: the first gradient overwrites its slice
            # (copy then scale = 0 + alpha * g exactly, as the add into zeros would give)
            self.arrived.add(i)
            self.grad_acc[lo:hi].copy_(grad.reshape(-1))
            if alpha != 1.0:
                self.grad_acc[lo:hi].mul_(alpha)
            return
        if alpha == 1.0:
            self.grad_acc[lo:hi].add_(grad.reshape(-1))
        else:
            self.grad_acc[lo:hi].add_(grad.reshape(-1), alpha=alpha)

    def zero_unfilled(self) -> None:
        """Zero what the current fill of a pooled accumulator did not write: alignment gaps,
        the tail, and parameters whose gradient did not arrive (their reduced gradient must
        be exactly the other ranks' contribution, and gaps must stay zero for the norm)."""
        assert self.grad_acc is not None
        cursor = 0
        for i in range(len(self.params)):
            lo, hi = self.layout.param_range(i)
            if i in self.arrived:
                if lo > cursor:
                    self.grad_acc[cursor:lo].zero_()
                cursor = hi
        if cursor < self.layout.padded_numel:
            self.grad_acc[cursor:].zero_()

    @property
    def reduce_group(self) -> AxisGroup:
        """The group this bucket's gradient is reduced (and its state partitioned) over: its
        flat group's (the grad role, or the expert-gradient role for expert shards)."""
        assert self.group is not None  # bound by FlatGroup right after construction
        return self.group.reduce_group

    def launch_reduce(self, group: AxisGroup, sharded: bool, async_op: bool,
                      out: Optional[torch.Tensor] = None) -> None:
        """Sum the accumulator over ``group``: into ``shard_grad`` (reduce-scatter; or into
        ``out`` (shard,) when given) when the optimizer state is sharded, in place
        (all-reduce) otherwise."""
        if self.launched and not self.pooled:
            raise RuntimeError(f"bucket {self.index} reduced twice in one step")
        if self.grad_acc is None:  # no gradient arrived here: still take part in the collective
            self.grad_acc = torch.zeros(self.layout.padded_numel, dtype=torch.float32, device=self.device)
        target = (self.shard_grad if out is None else out) if sharded else self.grad_acc
        src, dst = self.grad_acc, target
        if self.comm_dtype != self.grad_acc.dtype or (sharded and target.dtype != self.comm_dtype):
            # (padded,) cast copy in the communication dtype, or (shard,) a receive buffer in it
            # for a bf16 master-gradient shard; the result is copied (rounded) into the target
            # when the reduction completes (wait)
            src = self.grad_acc.to(self.comm_dtype)
            dst = src if not sharded else torch.empty(target.numel(), dtype=self.comm_dtype, device=self.device)
            self._upcast = (target, dst)
        if sharded:
            # the accumulator is not read after its reduction (freed, pooled or zeroed next)
            self.work = comm.reduce_scatter(dst, src, group, async_op=async_op, inp_is_scratch=True)
        else:
            self.work = comm.all_reduce(src, group, async_op=async_op)
        if not async_op:
            self._finish_upcast()
        self.launched = True

    def _finish_upcast(self) -> None:
        if self._upcast is not None:
            target, low = self._upcast
            target.copy_(low)
            self._upcast = None

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None
        self._finish_upcast()

    def reset_step(self) -> None:
        self.ready = 0
        self.launched = False
        self.work = None
        self.reductions = 0


class BufferPool:
    """Reusable fp32 flat buffers: the pooled gradient accumulators of stages 2/3 (and their
    ``(shard,)`` receive buffers).

    ``acquire(n)`` hands out a ``(n,)`` view of the smallest free buffer of at least ``n``
    elements; ``release`` returns it. A new buffer is allocated only when none fits, and
    the pool never owns more than ``capacity`` buffers (the most lent at once: with two
    reductions in flight and one bucket filling, three accumulators): when it is full, the
    largest free buffer is replaced by one of ``n`` elements. When backward fills more
    buckets at once than that (gradients arriving out of bucket order), the extra buffers
    are allocated and dropped on release. So between uses the pool keeps at most
    ``capacity`` buffers (at most ``capacity`` x the largest bucket), reused for every
    micro-batch and step.
    Contents are not zeroed: the buckets overwrite on first arrival and zero the rest
    before reducing.
    """

    def __init__(self, device: torch.device, capacity: int = 3):
        self.device = device
        self.capacity = int(capacity)
        self._free: list[torch.Tensor] = []
        self._all: list[torch.Tensor] = []
        self._lent: dict[int, torch.Tensor] = {}  # data_ptr of the view -> its base buffer

    def acquire(self, numel: int) -> torch.Tensor:
        fits = [k for k, b in enumerate(self._free) if b.numel() >= numel]
        if fits:
            base = self._free.pop(min(fits, key=lambda k: self._free[k].numel()))
        else:
            if len(self._all) >= self.capacity and self._free:
                self._drop(self._free.pop(max(range(len(self._free)), key=lambda k: self._free[k].numel())))
            base = torch.empty(numel, dtype=torch.float32, device=self.device)
            self._all.append(base)
        view = base[:numel]
        self._lent[view.data_ptr()] = base
        return view

    def release(self, view: torch.Tensor) -> None:
        base = self._lent.pop(view.data_ptr())
        if len(self._all) > self.capacity:
            self._drop(base)  # lent beyond the capacity (buckets filling out of order): not kept
        else:
            self._free.append(base)

    def _drop(self, base: torch.Tensor) -> None:
        self._all = [x for x in self._all if x is not base]

    def buffers(self) -> list[torch.Tensor]:
        """Every buffer the pool owns (for memory accounting)."""
        return list(self._all)

    def clear(self) -> None:
        """Drop the free buffers (the lent ones are dropped when released)."""
        ids = {id(b) for b in self._free}
        self._all = [b for b in self._all if id(b) not in ids]
        self._free.clear()


class FlatGroup:
    """The buckets of one group key and their concatenated fp32 master shard, reduced and
    partitioned over ``reduce_group``.

    ``offload`` (ZeRO-Offload, engine.zero.offload): the master and its ``.grad`` live in
    host memory (page-locked with ``pin_memory`` where CUDA is), and the reduce-scatters
    land in :attr:`grad`, a separate ``(shard,)`` fp32 buffer on the device, copied to
    ``master.grad`` before the host step. Without offload :attr:`grad` IS ``master.grad``."""

    def __init__(self, key: GroupKey, buckets: Sequence[FlatBucket], options: dict[str, Any],  # noqa: PLR0913
                 device: torch.device, reduce_group: AxisGroup, *, offload: bool = False, pin_memory: bool = False,
                 master_dtype: torch.dtype = torch.float32):
        self.key = key
        self.reduce_group = reduce_group
        self.buckets = list(buckets)
        self.options = dict(options)
        self.offload = bool(offload)
        total = sum(b.layout.shard_numel for b in self.buckets)
        # (sum of bucket shard sizes,) master_dtype (fp32; bf16 with DeepSpeed's
        # bf16_master_weights_and_grads, the gradient shard too): what the inner optimizer steps on
        if self.offload:
            self.master = torch.nn.Parameter(host_zeros(total, master_dtype, pin_memory))
            self.master.grad = host_zeros(total, master_dtype, pin_memory)
            self.grad = torch.zeros(total, dtype=master_dtype, device=device)
        else:
            self.master = torch.nn.Parameter(torch.zeros(total, dtype=master_dtype, device=device))
            self.master.grad = torch.zeros_like(self.master)
            self.grad = self.master.grad
        # offload with a bf16/fp16 model: the host (shard,) low-precision copy the fused CPU
        # kernel writes in the same pass as the update (engine.zero.base attaches it)
        self.low: Optional[torch.Tensor] = None
        off = 0
        for b in self.buckets:
            n = b.layout.shard_numel
            b.shard_master = self.master.data[off:off + n]
            b.shard_grad = self.grad[off:off + n]
            b.master_offset = off
            b.group = self
            off += n

    def param_group(self) -> dict[str, Any]:
        return {"params": [self.master], **self.options}
