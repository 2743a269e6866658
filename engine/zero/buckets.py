"""Flat buckets and flat groups: the storage the ZeRO stages work on.

A :class:`FlatBucket` is a run of parameters of one :class:`FlatGroup` laid out by a
:class:`~engine.zero.partition.FlatLayout`. It owns (depending on the stage):

- ``full``: the bucket's parameters in the compute dtype, ``(padded_numel,)``; the
  parameters' ``.data`` are views into it while it is bound;
- ``grad_acc``: fp32 gradient accumulator ``(padded_numel,)`` into which the backward hooks
  add each parameter's gradient (and free it); reduced over DP by one collective;
- ``shard_master`` / ``shard_grad``: this rank's chunk of the bucket inside the group's
  fp32 master shard and its gradient, ``(shard_numel,)``.

A :class:`FlatGroup` holds the fp32 master shard of every bucket of one group key,
concatenated, as a single ``nn.Parameter`` that the inner optimizer steps on.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from engine.dist import comm
from engine.zero.partition import FlatLayout, GroupKey

__all__ = ["FlatBucket", "FlatGroup"]


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
        self.shapes = [p.shape for p in self.params]
        self.full: Optional[torch.Tensor] = None  # (padded,) compute dtype
        self.grad_acc: Optional[torch.Tensor] = None  # (padded,) fp32
        self.shard_master: Optional[torch.Tensor] = None  # (shard,) fp32 view into the group master
        self.shard_grad: Optional[torch.Tensor] = None  # (shard,) fp32 view into the group master grad
        self.group: Optional["FlatGroup"] = None
        # ZeRO-3 only: this rank's chunk in the compute dtype (what the all-gather sends),
        # an in-flight prefetch (full buffer, work), and whether the bucket stays whole.
        self.compute_shard: Optional[torch.Tensor] = None  # (shard,) compute dtype
        self.pending: Optional[tuple[torch.Tensor, Any]] = None
        self.persistent = True
        # per-step reduction state
        self.ready = 0  # parameters whose gradient arrived on the boundary micro-step
        self.work: Any = None
        self.launched = False

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
        """Add ``alpha`` times parameter ``i``'s gradient into the fp32 accumulator
        (allocated on demand); the scaling rides on the add for free."""
        if self.grad_acc is None:
            self.grad_acc = torch.zeros(self.layout.padded_numel, dtype=torch.float32, device=self.device)
        lo, hi = self.layout.param_range(i)
        if alpha == 1.0:
            self.grad_acc[lo:hi].add_(grad.reshape(-1))
        else:
            self.grad_acc[lo:hi].add_(grad.reshape(-1), alpha=alpha)

    def launch_reduce(self, group: Optional[dist.ProcessGroup], sharded: bool, async_op: bool) -> None:
        """Sum the accumulator over ``group``: into ``shard_grad`` (reduce-scatter) when the
        optimizer state is sharded, in place (all-reduce) otherwise."""
        if self.launched:
            raise RuntimeError(f"bucket {self.index} reduced twice in one step")
        if self.grad_acc is None:  # no gradient arrived here: still take part in the collective
            self.grad_acc = torch.zeros(self.layout.padded_numel, dtype=torch.float32, device=self.device)
        if sharded:
            self.work = comm.reduce_scatter(self.shard_grad, self.grad_acc, group, async_op=async_op)
        else:
            self.work = comm.all_reduce(self.grad_acc, group, async_op=async_op)
        self.launched = True

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None

    def reset_step(self) -> None:
        self.ready = 0
        self.launched = False
        self.work = None


class FlatGroup:
    """The buckets of one group key and their concatenated fp32 master shard."""

    def __init__(self, key: GroupKey, buckets: Sequence[FlatBucket], options: dict[str, Any],
                 device: torch.device):
        self.key = key
        self.buckets = list(buckets)
        self.options = dict(options)
        total = sum(b.layout.shard_numel for b in self.buckets)
        # (sum of bucket shard sizes,) fp32: what the inner optimizer steps on
        self.master = torch.nn.Parameter(torch.zeros(total, dtype=torch.float32, device=device))
        self.master.grad = torch.zeros_like(self.master)
        off = 0
        for b in self.buckets:
            n = b.layout.shard_numel
            b.shard_master = self.master.data[off:off + n]
            b.shard_grad = self.master.grad[off:off + n]
            b.group = self
            off += n

    def param_group(self) -> dict[str, Any]:
        return {"params": [self.master], **self.options}
