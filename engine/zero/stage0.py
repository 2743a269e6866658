"""ZeRO stage 0: plain data parallelism with bucketed gradient all-reduce.

Every rank keeps full parameters, full fp32 gradients and the full fp32 master weights and
optimizer state. Gradients are added by the backward hooks into per-bucket fp32
accumulators that are views of the master gradient, and each bucket is all-reduced (async)
as soon as its last gradient arrives on the boundary micro-step, overlapping with the rest
of backward. Memory per rank (mixed precision, Psi parameters): 2 Psi + 4 Psi + 12 Psi.
"""

from __future__ import annotations

from engine.zero.base import ZeroOptimizer
from engine.zero.buckets import FlatBucket

__all__ = ["DataParallelOptimizer"]


class DataParallelOptimizer(ZeroOptimizer):
    stage = 0
    shards_optimizer_state = False
    keeps_full_grads = True

    def _init_grad_storage(self, b: FlatBucket) -> None:
        # one shard of the whole bucket: the accumulator IS the master gradient (fp32, in place)
        b.grad_acc = b.shard_grad
