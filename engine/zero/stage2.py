"""ZeRO stage 2: optimizer state and gradients sharded over the DP group.

As stage 1, but no full gradient lives beyond three buckets: a bucket's fp32 accumulator
is borrowed from a reusable pool when its first gradient arrives and reduce-scattered into
the master-gradient shard as soon as every parameter of the bucket delivered its gradient
in this backward pass, at every micro-batch (gradient accumulation and pipeline
micro-batches included, as DeepSpeed's ZeRO-2); at most two reductions are in flight while
the next bucket fills. Between micro-batches and steps a rank holds only its gradient
shard (plus the pools: three bucket buffers, two shard-sized receive buffers). The cost: ``ga`` reduce-scatters per step.
Memory per rank between steps: 2 Psi + (4 + 12) Psi / N_d.
"""

from __future__ import annotations

from engine.zero.base import ZeroOptimizer

__all__ = ["Zero2Optimizer"]


class Zero2Optimizer(ZeroOptimizer):
    stage = 2
    shards_optimizer_state = True
    keeps_full_grads = False
