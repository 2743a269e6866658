"""ZeRO stage 2: optimizer state and gradients sharded over the DP group.

As stage 1, but no full gradient buffer lives across steps: a bucket's fp32 accumulator
is allocated when its first gradient of the step arrives and freed as soon as its
reduce-scatter into the master-gradient shard completes (during backward, when the
boundary micro-step fills it). Between steps a rank holds only its gradient shard.

With gradient accumulation (or pipeline micro-batches) the accumulators of the buckets
touched so far stay alive until the boundary micro-step, so gradients are reduced exactly
once per optimizer step; the peak during accumulation is one full fp32 gradient copy.
Memory per rank between steps: 2 Psi + (4 + 12) Psi / N_d.
"""

from __future__ import annotations

from engine.zero.base import ZeroOptimizer

__all__ = ["Zero2Optimizer"]


class Zero2Optimizer(ZeroOptimizer):
    stage = 2
    shards_optimizer_state = True
    keeps_full_grads = False
