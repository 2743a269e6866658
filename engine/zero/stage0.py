"""ZeRO stage 0: plain data parallelism with bucketed gradient all-reduce.

Every rank keeps full parameters, full fp32 gradients and the full fp32 master weights and
optimizer state. Gradients are added by the backward hooks into per-bucket fp32
accumulators that are views of the master gradient, and each bucket is all-reduced (async)
as soon as its last gradient arrives on the boundary micro-step, overlapping with the rest
of backward. Memory per rank (mixed precision, Psi parameters): 2 Psi + 4 Psi + 12 Psi. With fp32
parameters the master IS the parameter storage (no second copy, nothing to publish after
the step): 4 Psi + 4 Psi + 8 Psi.
"""

from __future__ import annotations

import torch

from engine.distributed import comm
from engine.zero.base import ZeroOptimizer
from engine.zero.buckets import FlatBucket

__all__ = ["DataParallelOptimizer"]


class DataParallelOptimizer(ZeroOptimizer):
    stage = 0
    shards_optimizer_state = False
    keeps_full_grads = True

    def _init_bucket(self, b: FlatBucket) -> None:
        if b.dtype != torch.float32:
            super()._init_bucket(b)
            return
        # fp32: bind the parameters straight into the (padded,) master view, so the inner
        # optimizer's in-place update is the parameter update.
        b.shard_master.copy_(b.flatten_params())
        b.bind(b.shard_master)
        self._init_grad_storage(b)

    def _publish(self) -> None:
        for b in self.buckets:
            assert b.full is not None  # stage 0 keeps every bucket bound
            if b.full.data_ptr() != b.shard_master.data_ptr():
                b.full.copy_(b.shard_master)

    def _launch_remaining(self) -> None:
        # Nothing launched during backward (overlap_comm off, or accumulation): the buckets
        # of a group are consecutive views of its master gradient, so one all-reduce per
        # group replaces one per bucket (gloo, 2 ranks, 5.3M fp32: 16 ms vs 20 ms queued,
        # 30 ms one by one).
        if any(b.launched for b in self.buckets) or self.precision.comm_dtype != torch.float32:
            # (a low-precision communication_data_type casts bucket by bucket)
            super()._launch_remaining()
            return
        for g in self.groups:
            assert g.master.grad is not None  # the group's master gradient storage (_init_grad_storage)
            work = comm.all_reduce(g.master.grad, g.reduce_group, async_op=True)
            for b in g.buckets:
                b.launched = True
            g.buckets[-1].work = work  # waited with the group's last bucket

    def _init_grad_storage(self, b: FlatBucket) -> None:
        # one shard of the whole bucket: the accumulator IS the master gradient (fp32, in place)
        b.grad_acc = b.shard_grad
