"""ZeRO stage 1: optimizer state sharded over the DP group.

Each rank keeps full compute-dtype parameters but only its shard of the fp32 master
weights and optimizer moments. Full fp32 gradients exist only where ZeRO-1 needs them:
while gradients accumulate over micro-steps (a full accumulator per bucket, from the first
micro-step to the step's reduce-scatter, then freed). A bucket that has accumulated
nothing when the boundary micro-step reaches it (no gradient accumulation) is reduced as
it fills, through the pooled bucket buffers, as in stage 2. After the update every
bucket's shard is all-gathered back into the parameters.
Memory per rank: 2 Psi + 12 Psi / N_d + 4 Psi / N_d (master gradient) + 4 Psi while
accumulating (three pooled buckets otherwise).
"""

from __future__ import annotations

from engine.zero.base import ZeroOptimizer

__all__ = ["Zero1Optimizer"]


class Zero1Optimizer(ZeroOptimizer):
    stage = 1
    shards_optimizer_state = True
    keeps_full_grads = True
    pools_on_boundary = True
