"""The attention call of a context-parallel block (the one function the model calls).

PLACEHOLDER during development (session 7): gathers K/V over the whole CP group and
computes the local queries' rows with one masked SDPA. Replaced by the ring / Ulysses /
hybrid implementations (ring.py, ulysses.py) before it lands; nothing user-facing relies
on this body.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine.context_parallel.layout import CPLayout

__all__ = ["context_parallel_attention"]


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: CPLayout, *,
                               positions: torch.Tensor, doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal (and, with ``doc_ids``, document-causal) softmax attention, scale 1/sqrt(d),
    of this rank's queries against the keys of the whole sequence.

    q (B, nh, S/C, d), k/v (B, nkv, S/C, d): this rank's head-tail shard (rotary already
    applied with the true positions). ``positions`` (B, S/C) long: the global position of
    each local token in the sequence (masking compares them: key j is visible to query i
    iff pos_j <= pos_i and, with ``doc_ids`` (B, S/C), doc_j == doc_i). Returns
    (B, nh, S/C, d) in q's order. Autograd flows to q, k and v."""
    if layout.ring is not None and layout.ulysses is not None:
        raise NotImplementedError("placeholder handles one group")
    group = layout.ring if layout.ring is not None else layout.ulysses
    assert group is not None and group.handle is not None

    def gather(t: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(layout.size)]
        dist.all_gather(parts, t.contiguous(), group=group.handle)
        return torch.cat(parts, dim=-2 if t.dim() == 4 else -1)

    kk, vv = _AllGather.apply(k, group), _AllGather.apply(v, group)
    kpos = gather(positions)
    mask = kpos[:, None, None, :] <= positions[:, None, :, None]          # (B, 1, S/C, S)
    if doc_ids is not None:
        mask = mask & (gather(doc_ids)[:, None, None, :] == doc_ids[:, None, :, None])
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, enable_gqa=gqa)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        parts = [torch.empty_like(t) for _ in range(len(group.ranks))]
        dist.all_gather(parts, t.contiguous(), group=group.handle)
        return torch.cat(parts, dim=-2)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group.handle)
        return g.chunk(len(ctx.group.ranks), dim=-2)[ctx.group.rank], None
