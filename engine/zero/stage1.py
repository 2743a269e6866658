"""ZeRO stage 1: optimizer state sharded over the DP group.

Each rank keeps full compute-dtype parameters but only its shard of the fp32 master
weights and optimizer moments. Full gradients exist only where ZeRO-1 needs them:
while gradients accumulate over micro-steps (a full accumulator per bucket, from the first
micro-step to the step's reduce-scatter, then freed). A bucket that has accumulated
nothing when the boundary micro-step reaches it (no gradient accumulation) is reduced as
it fills, through the pooled bucket buffers, as in stage 2. The full accumulator has the
dtype of ``data_types.grad_accum_dtype`` (default: the compute dtype, as DeepSpeed); a bf16/fp16
one is copied to fp32 bucket by bucket as it is reduced. After the update every
bucket's shard is all-gathered back into the parameters.
Memory per rank: 2 Psi + 12 Psi / N_d + 4 Psi / N_d (master gradient) + 2 Psi (bf16/fp16;
4 Psi with an fp32 accumulator) while accumulating, and three pooled buckets.
"""

from __future__ import annotations

import torch

from engine.zero.base import ZeroOptimizer
from engine.zero.buckets import FlatBucket

__all__ = ["Zero1Optimizer"]


class Zero1Optimizer(ZeroOptimizer):
    stage = 1
    shards_optimizer_state = True
    keeps_full_grads = True
    pools_on_boundary = True

    def _init_bucket(self, b: FlatBucket) -> None:
        b.acc_dtype = self.precision.accum_dtype  # data_types.grad_accum_dtype of the full accumulator
        super()._init_bucket(b)

    def _launch(self, b: FlatBucket) -> None:
        if b.grad_acc is not None and b.grad_acc.dtype != torch.float32:
            self._launch_upcast(b)
        else:
            super()._launch(b)

    def _launch_upcast(self, b: FlatBucket) -> None:
        """A low-precision full accumulator (``grad_accum_dtype``) holds raw sums: copy it into
        a pooled fp32 buffer times the gradient factor (what the fp32 path adds) and
        reduce-scatter that, so the reduction and the master gradient stay fp32 and the
        low-precision bucket is freed now. The bucket turns pooled for the rest of the step
        (at most MAX_INFLIGHT reductions in flight)."""
        self._drain_inflight(keep=self.MAX_INFLIGHT - 1)
        low = b.grad_acc
        assert low is not None  # a bucket with a low-precision accumulator
        acc = self._pool.acquire(b.layout.padded_numel)
        acc.copy_(low)
        alpha = self._grad_factor()
        if alpha != 1.0:
            acc.mul_(alpha)
        b.grad_acc = acc
        b.pooled = True
        b.arrived.update(range(len(b.params)))
        self._launch_sharded(b)
