"""Pure shard maths for ZeRO: flat layouts, padding, alignment, buckets and grouping.

Nothing here touches torch.distributed. A *layout* describes how a list of parameters
(given by their element counts) is laid end to end in one flat buffer:

    [ p0 | pad | p1 | pad | ... | p_{n-1} | tail pad ]   (padded_numel,)
    [   shard 0   |   shard 1   | ... |  shard W-1   ]   W = num_shards, each shard_numel

- every parameter starts at a multiple of ``align`` elements (so views of it are aligned
  for vector loads; the gaps hold zeros and never receive gradient),
- the total is padded to a multiple of ``num_shards * align`` so that every shard has the
  same size (collectives need equal chunks) and starts aligned,
- a parameter may straddle one or more shard boundaries; :meth:`FlatLayout.pieces` says
  which slice of which parameter lands where in a given shard.

ZeRO stages build one layout per *bucket*: a run of parameters of one group (same dtype,
same TP layout, same optimizer options) whose gradients are reduced by one collective.
Because each bucket is partitioned on its own, a reduce-scatter of the bucket's flat
gradient lands exactly in the owning ranks' shards, and an all-gather of the shards
rebuilds the bucket. A rank's shard of a group is the concatenation of its chunk of every
bucket of that group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from engine.placement import placement_of

__all__ = ["align_up", "Piece", "FlatLayout", "build_layout", "bucketize", "GroupKey",
           "group_key", "group_params"]


def align_up(n: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``n``."""
    if multiple <= 0:
        raise ValueError(f"alignment must be a positive integer, got {multiple}")
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class Piece:
    """``numel`` elements of parameter ``param_index`` starting at ``param_start`` (in the
    parameter's own flattened index space) live at ``shard_start`` within one shard."""

    param_index: int
    param_start: int
    shard_start: int
    numel: int


@dataclass(frozen=True)
class FlatLayout:
    """Offsets of parameters in a padded flat buffer cut into ``num_shards`` equal shards."""

    numels: tuple[int, ...]
    offsets: tuple[int, ...]
    num_shards: int
    align: int
    padded_numel: int

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.num_shards

    @property
    def numel(self) -> int:
        """Elements that belong to parameters (padding excluded)."""
        return sum(self.numels)

    def param_range(self, i: int) -> tuple[int, int]:
        """[start, end) of parameter ``i`` in the flat buffer."""
        return self.offsets[i], self.offsets[i] + self.numels[i]

    def shard_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of shard ``rank`` in the flat buffer."""
        if not 0 <= rank < self.num_shards:
            raise ValueError(f"shard index {rank} out of range for {self.num_shards} shards")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def pieces(self, rank: int) -> tuple[Piece, ...]:
        """The parameter slices stored in shard ``rank``, in flat order."""
        lo, hi = self.shard_range(rank)
        out = []
        for i, (off, n) in enumerate(zip(self.offsets, self.numels)):
            start, end = max(off, lo), min(off + n, hi)
            if start < end:
                out.append(Piece(param_index=i, param_start=start - off, shard_start=start - lo,
                                 numel=end - start))
        return tuple(out)

    def owners(self, i: int) -> tuple[int, ...]:
        """Shards that hold at least one element of parameter ``i``."""
        if self.numels[i] == 0:
            return ()
        start, end = self.param_range(i)
        return tuple(range(start // self.shard_numel, (end - 1) // self.shard_numel + 1))


def build_layout(numels: Sequence[int], num_shards: int, align: int = 1) -> FlatLayout:
    """Lay parameters of the given sizes end to end, each start aligned to ``align``
    elements, and pad the total to a multiple of ``num_shards * align``."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    offsets, cursor = [], 0
    for n in numels:
        if n < 0:
            raise ValueError(f"parameter sizes must be >= 0, got {n}")
        cursor = align_up(cursor, align)
        offsets.append(cursor)
        cursor += n
    # An empty bucket still gets one aligned element per shard so collectives have a buffer.
    padded = align_up(max(cursor, 1), num_shards * align)
    return FlatLayout(numels=tuple(int(n) for n in numels), offsets=tuple(offsets),
                      num_shards=num_shards, align=align, padded_numel=padded)


def bucketize(numels: Sequence[int], bucket_numel: int) -> list[list[int]]:
    """Split indices ``0..len(numels)-1`` (kept in order) into runs whose total is at most
    ``bucket_numel``; a parameter larger than the bucket gets a bucket of its own."""
    if bucket_numel < 1:
        raise ValueError(f"bucket size must be >= 1 element, got {bucket_numel}")
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, n in enumerate(numels):
        if current and size + n > bucket_numel:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += n
    if current:
        buckets.append(current)
    return buckets


@dataclass(frozen=True)
class GroupKey:
    """What must be uniform within one flat buffer.

    ``param_group``: index of the user's optimizer param group (its hyper-parameters);
    ``dtype``: the parameters' dtype; ``tp_sharded``: TP-sharded vs TP-replicated (the
    gradient norm counts replicated elements once per TP group); ``tied_copy``: a pipeline
    duplicate of a tied weight (not counted in the norm); ``expert``: an expert shard, whose
    gradient is reduced and partitioned over the expert-gradient role instead of the grad
    role (a flat group of its own); all three from the parameter's
    :class:`~engine.placement.Placement`; ``tied_index``: >= 0 for a tied
    weight (original or copy), which gets a flat buffer of its own so that its layout is
    the same on every pipeline stage that holds it (its gradient is summed across them).
    """

    param_group: int
    dtype: torch.dtype
    tp_sharded: bool
    tied_copy: bool = False
    tied_index: int = -1
    expert: bool = False


def group_key(param: torch.Tensor, param_group: int, tied_index: int = -1) -> GroupKey:
    placement = placement_of(param)
    return GroupKey(param_group=param_group, dtype=param.dtype, tp_sharded=placement.tp_sharded,
                    tied_copy=placement.tied_copy, tied_index=tied_index, expert=placement.expert_sharded)


def group_params(param_groups: Sequence[Iterable[torch.Tensor]],
                 tied: Sequence[torch.Tensor] = ()) -> dict[GroupKey, list[torch.Tensor]]:
    """Group parameters by :class:`GroupKey`, keeping first-appearance order.

    ``param_groups`` is a list of parameter lists (the user's optimizer groups); ``tied``
    lists the tied weights held here, in an order that matches on every stage holding them.
    A parameter may appear only once.
    """
    tied_pos = {id(p): i for i, p in enumerate(tied)}
    seen: set[int] = set()
    out: dict[GroupKey, list[torch.Tensor]] = {}
    for g, params in enumerate(param_groups):
        for p in params:
            if id(p) in seen:
                raise ValueError("a parameter appears twice in the parameter groups; each parameter "
                                 "must belong to exactly one group")
            seen.add(id(p))
            key = group_key(p, g, tied_pos.get(id(p), -1))
            out.setdefault(key, []).append(p)
    missing = [i for i, p in enumerate(tied) if id(p) not in seen]
    if missing:
        raise ValueError(f"tied parameters at positions {missing} are not among the optimized "
                         "parameters; pass only trainable parameters of this model as tied")
    return out
