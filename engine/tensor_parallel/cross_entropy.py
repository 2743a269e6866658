"""Cross-entropy over vocabulary-parallel logits, without gathering the logits.

Each TP rank holds logits (..., V/tp) for its contiguous slice of the vocabulary (rank r:
ids ``[r*V/tp, (r+1)*V/tp)``). Per token, in fp32::

    m      = max_v z_v                      all-reduce MAX   (for stability only)
    s      = sum_v exp(z_v - m)             all-reduce SUM   } fused into one
    z_t    = z_target - m (0 off-shard)     all-reduce SUM   } all-reduce
    loss   = log(s) - z_t
    dloss/dz_v = softmax_v - [v == target]  (local, no communication)

Padded vocabulary columns are expected to be -inf (see ``vocab_parallel_logits``); they
contribute exp(-inf) = 0, so padding never changes the loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.distributed import comm
from engine.distributed.comm import ReduceOpLike
from engine.distributed.groups import AxisGroup
from engine.distributed.strict import host_sync_allowed
from engine.tensor_parallel.mappings import tp_rank, tp_world_size

__all__ = ["vocab_parallel_cross_entropy"]



def _all_reduce(t: torch.Tensor, group: AxisGroup, op: ReduceOpLike) -> None:
    if tp_world_size(group) > 1:  # a group of one: no TP, nothing to reduce
        comm.all_reduce(t, group, op=op)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss (...,) from logits shards (..., V/tp); see the module docstring."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, group: AxisGroup,
                ignore_index: int) -> torch.Tensor:
        z = logits.float()                                   # (..., Vl) fp32; the input itself if fp32,
        # so nothing below writes into z before `z - m` makes a new tensor
        v_local = z.shape[-1]
        start = tp_rank(group) * v_local
        m = z.max(dim=-1).values                             # (...,)
        _all_reduce(m, group, dist.ReduceOp.MAX)
        z = z - m.unsqueeze(-1)                              # (..., Vl), new tensor: safe to modify
        local_t = targets - start
        inside = (local_t >= 0) & (local_t < v_local)        # (...,) target is in this shard
        idx = local_t.masked_fill(~inside, 0).unsqueeze(-1)  # (..., 1)
        z_t = z.gather(-1, idx).squeeze(-1).masked_fill(~inside, 0.0)  # (...,)
        exp = z.exp_()                                       # (..., Vl)
        both = torch.stack([exp.sum(dim=-1), z_t])           # (2, ...): one all-reduce for two sums
        _all_reduce(both, group, dist.ReduceOp.SUM)
        sum_exp, z_t = both[0], both[1]
        valid = targets != ignore_index
        loss = (sum_exp.log() - z_t).masked_fill(~valid, 0.0)  # (...,)
        softmax = exp.div_(sum_exp.unsqueeze(-1))            # (..., Vl)
        ctx.save_for_backward(softmax, idx, inside & valid, valid)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, idx, hit, valid = ctx.saved_tensors
        grad = softmax.clone()                               # (..., Vl)
        grad.scatter_add_(-1, idx, -hit.unsqueeze(-1).to(grad.dtype))  # minus the one-hot target
        grad.mul_((grad_loss.float() * valid).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, tp_group: AxisGroup,
                                 *, ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of vocab-parallel ``logits`` (..., V/tp) against global ``targets`` (...).

    Matches ``F.cross_entropy(full_logits.flatten(0, -2), targets.flatten(),
    ignore_index=ignore_index, reduction=reduction)`` (``"mean"`` averages over the
    non-ignored tokens; ``"none"`` returns the per-token losses, 0 where ignored).
    A TP group of one (``NO_TP``) means the logits are not sharded.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"targets {tuple(targets.shape)} must have the logits' shape without the "
                         f"vocabulary dim, {tuple(logits.shape[:-1])}")
    if targets.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"targets must be integer token ids, got {targets.dtype}")
    vocab = logits.shape[-1] * tp_world_size(tp_group)
    if targets.device.type == "cpu" and targets.numel():  # no device sync on CPU
        bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab))
        with host_sync_allowed():
            any_bad = bool(bad.any())
        if any_bad:
            raise ValueError(f"targets must be in [0, {vocab}) or equal ignore_index={ignore_index}; "
                             f"found {targets[bad][:4].tolist()}")
    loss = _VocabParallelCrossEntropy.apply(logits, targets.long(), tp_group, ignore_index)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (targets != ignore_index).sum()
