"""ZeRO stage 1: optimizer state sharded over the DP group.

Each rank keeps full compute-dtype parameters and a full fp32 gradient accumulator per
bucket, but only its shard of the fp32 master weights and optimizer moments. On the
boundary micro-step each bucket is reduce-scattered (async, as it fills) straight into the
owning ranks' master-gradient shards; after the update every bucket's shard is
all-gathered back into the parameters. Memory per rank: 2 Psi + 4 Psi + 12 Psi / N_d.
"""

from __future__ import annotations

from engine.zero.base import ZeroOptimizer

__all__ = ["Zero1Optimizer"]


class Zero1Optimizer(ZeroOptimizer):
    stage = 1
    shards_optimizer_state = True
    keeps_full_grads = True
