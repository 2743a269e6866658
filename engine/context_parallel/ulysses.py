"""Ulysses: one all-to-all turns a sequence shard of every head into every token of a group of
heads, attention runs on whole heads, and the inverse all-to-all brings the output back.

Within a Ulysses group of U ranks (consecutive CP ranks), member i holds the head-tail shard
x_i (B, H, S_l, d). Forward all-to-all: member j receives, from every member i, the heads
[j H/U, (j+1) H/U) of x_i, and concatenates them along the sequence in member order:
(B, H/U, U S_l, d). The tokens of that sequence are the group's shards one after the other
(not in position order), which is why masks use the gathered global positions and document
ids (:func:`gather_meta`), never the index. The autograd backward of each all-to-all is the
inverse all-to-all.

GQA: member j's query heads need their own KV heads. With U dividing the KV heads nkv, KV
heads split like the query heads. Otherwise the KV heads are repeated (repeat_interleave,
whose backward sums the copies) to lcm(nkv, U) heads, which U and nkv both divide and which
divides H, so one KV head works at any U that divides H.
"""

from __future__ import annotations

import math

import torch

from engine.distributed import comm
from engine.distributed.groups import AxisGroup

__all__ = ["seq_to_heads", "heads_to_seq", "expand_kv_heads", "gather_meta"]


def _a2a(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """All-to-all along dim 0 of ``x`` (U, ...): piece i goes to member i; piece i of the
    result came from member i."""
    x = x.contiguous()
    out = torch.empty_like(x)                                                # contiguous, like x now
    comm.all_to_all_single(out, x, [1] * group.size, [1] * group.size, group)
    return out


def _seq_to_heads(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """(B, H, S_l, d) sequence shard -> (B, H/U, U S_l, d) head shard."""
    b, h, s, d = x.shape
    u = group.size
    pieces = x.reshape(b, u, h // u, s, d).transpose(0, 1)                   # (U, B, H/U, S_l, d)
    got = _a2a(pieces, group)                                                # piece i: member i's tokens
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // u, u * s, d)


def _heads_to_seq(y: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """(B, H/U, U S_l, d) head shard -> (B, H, S_l, d) sequence shard (inverse of the above)."""
    b, hu, us, d = y.shape
    u = group.size
    pieces = y.reshape(b, hu, u, us // u, d).permute(2, 0, 1, 3, 4)         # (U, B, H/U, S_l, d)
    got = _a2a(pieces, group)                                                # piece i: head group i
    return got.transpose(0, 1).reshape(b, hu * u, us // u, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, g):
        return _heads_to_seq(g, ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        return _heads_to_seq(y, group)

    @staticmethod
    def backward(ctx, g):
        return _seq_to_heads(g, ctx.group), None


def seq_to_heads(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """Differentiable (B, H, S_l, d) -> (B, H/U, U S_l, d); U = ``group.size`` divides H."""
    out: torch.Tensor = _SeqToHeads.apply(x, group)
    return out


def heads_to_seq(y: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """Differentiable (B, H/U, U S_l, d) -> (B, H, S_l, d)."""
    out: torch.Tensor = _HeadsToSeq.apply(y, group)
    return out


def expand_kv_heads(kv: torch.Tensor, u: int) -> torch.Tensor:
    """k or v (B, nkv, S_l, d) with its heads repeated to lcm(nkv, U) when U does not divide
    nkv (each copy next to its original, as GQA's query-head groups expect)."""
    nkv = kv.shape[1]
    if nkv % u == 0:
        return kv
    return kv.repeat_interleave(u // math.gcd(nkv, u), dim=1)


def gather_meta(meta: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """(B, 2, S_l) positions/doc ids of this member -> (B, 2, U S_l) of the whole group, in
    the order :func:`seq_to_heads` concatenates the tokens."""
    b, two, s = meta.shape
    out = meta.new_empty((group.size, b, two, s))
    comm.all_gather(out, meta.unsqueeze(0).contiguous(), group)
    return out.permute(1, 2, 0, 3).reshape(b, two, group.size * s)
