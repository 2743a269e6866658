"""ZeRO's shard view: which elements of which parameter this rank's fp32 master shards hold.

The inner optimizer of a :class:`~engine.zero.base.ZeroOptimizer` steps on flat master
shards (one ``nn.Parameter`` per flat group, the concatenation of this rank's chunk of
each bucket of the group). An element-wise optimizer (AdamW, Lion) needs nothing more.
An optimizer that works on whole matrices (Muon's Newton–Schulz) needs to know, for
every parameter, where it lies in the bucket's flat buffer and which part of it is here;
this module exports that as a small frozen value, built from the stage's layouts.

An inner optimizer asks for it by having a method ``attach_shard_view(view: ShardView)``;
the ZeRO optimizer calls it once, right after building the inner optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from engine.dist.groups import AxisGroup
from engine.zero.partition import FlatLayout

__all__ = ["ParamSlot", "BucketView", "GroupView", "ShardView", "build_shard_view"]


@dataclass(frozen=True)
class ParamSlot:
    """Parameter ``index`` of a bucket: its (TP-local) ``shape``, its ``numel`` elements at
    ``[bucket_offset, bucket_offset + numel)`` of the bucket's flat buffer; elements
    ``[lo, hi)`` of its flattened self are in this rank's shard (``lo == hi``: none), at
    ``[master_offset, master_offset + hi - lo)`` of the group's master."""

    index: int
    param: Any  # the nn.Parameter (identity and layout tags; under ZeRO-3 its data is empty)
    shape: tuple[int, ...]
    bucket_offset: int
    numel: int
    lo: int
    hi: int
    master_offset: int


@dataclass(frozen=True)
class BucketView:
    """One bucket: its layout, this rank's shard of it (the whole bucket when ``sharded``
    is false, ZeRO-0) starting at ``master_offset`` of the group's master, its parameters."""

    layout: FlatLayout
    shard_index: int
    sharded: bool
    master_offset: int
    params: tuple[ParamSlot, ...]

    @property
    def shard_numel(self) -> int:
        return self.layout.shard_numel


@dataclass(frozen=True)
class GroupView:
    """One flat group (= inner param group ``i`` of the inner optimizer)."""

    param_group: int  # the user's param group index
    tp_sharded: bool
    tied: bool
    buckets: tuple[BucketView, ...]


@dataclass(frozen=True)
class ShardView:
    """Every flat group of one ZeRO optimizer, in the inner optimizer's group order, and the
    groups it spans: ``dp_group`` (the shards), ``tp_group`` (size 1 when there is no TP)."""

    groups: tuple[GroupView, ...]
    dp_group: AxisGroup
    dp_size: int
    dp_rank: int
    tp_group: AxisGroup
    tp_size: int
    tp_rank: int


def _bucket_view(bucket: Any, master_offset: int, sharded: bool) -> BucketView:
    layout: FlatLayout = bucket.layout
    lo_shard, hi_shard = layout.shard_range(bucket.shard_index)
    slots = []
    for i, shape in enumerate(bucket.shapes):
        start, end = layout.param_range(i)
        lo, hi = max(start, lo_shard), min(end, hi_shard)
        if lo >= hi:
            lo = hi = start
            lo_p = hi_p = 0
            moff = master_offset
        else:
            lo_p, hi_p = lo - start, hi - start
            moff = master_offset + lo - lo_shard
        slots.append(ParamSlot(i, bucket.params[i], tuple(int(s) for s in shape), start, end - start,
                               lo_p, hi_p, moff))
    return BucketView(layout, bucket.shard_index, sharded, master_offset, tuple(slots))


def build_shard_view(groups: Sequence[Any], sharded: bool, dp_group: AxisGroup, dp_size: int,
                     dp_rank: int, tp_group: AxisGroup) -> ShardView:
    """The view of a ZeRO optimizer's flat groups (:class:`~engine.zero.buckets.FlatGroup`)."""
    out = []
    for g in groups:
        buckets, off = [], 0
        for b in g.buckets:
            buckets.append(_bucket_view(b, off, sharded))
            off += b.layout.shard_numel
        if off != g.master.numel():
            raise RuntimeError(f"flat group of {g.master.numel()} elements does not match its buckets ({off})")
        out.append(GroupView(g.key.param_group, g.key.tp_sharded, g.key.tied_index >= 0, tuple(buckets)))
    tp_size, tp_rank = tp_group.size, tp_group.rank
    return ShardView(tuple(out), dp_group, dp_size, dp_rank, tp_group, tp_size, tp_rank)

