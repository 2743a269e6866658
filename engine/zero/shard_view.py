"""ZeRO's shard view: which elements of which parameter this rank's fp32 master shards hold.

The inner optimizer of a :class:`~engine.zero.base.ZeroOptimizer` steps on flat master
shards (one ``nn.Parameter`` per flat group, the concatenation of this rank's chunk of
each bucket of the group). An element-wise optimizer (AdamW, Lion) needs nothing more.
An optimizer that works on whole matrices (Muon's Newton–Schulz) needs to know, for
every parameter, where it lies in the bucket's flat buffer and which part of it is here;
this module exports that as a small frozen value, built from the stage's layouts.

An inner optimizer asks for it by having a method ``attach_shard_view(view: ShardView)``;
the ZeRO optimizer calls it once, right after building the inner optimizer.

The view is also ZeRO's checkpoint boundary (``ZeroOptimizer.shard_view()``): what this
rank holds (:meth:`ShardView.pieces`), which groups it writes (:attr:`GroupView.owner`:
each element of the unsharded model is written by one rank), each group's fp32 master
shard with its element-wise optimizer state, scalar state and hyper-parameters
(:meth:`ShardView.group_state`), and the way back in (:meth:`ShardView.load`: masters and
optimizer state installed, then the parameters published). A checkpoint needs nothing
else of ZeRO.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import torch

from engine.distributed.groups import AxisGroup
from engine.zero.partition import FlatLayout

__all__ = ["ParamSlot", "BucketView", "GroupView", "ShardPiece", "GroupState", "Scalar", "ShardView",
           "build_shard_view", "split_state"]

Scalar = Union[torch.Tensor, int, float, bool]  # a one-element tensor (Adam's ``step``) or a Python number


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
    """One flat group (= inner param group ``i`` of the inner optimizer). ``tied_index``:
    >= 0 for a tied weight (``tied_copy``: a pipeline stage's duplicate of it); ``owner``:
    this rank writes the group in a checkpoint (ZeRO-0 replicas: DP rank 0 only;
    TP-replicated groups: TP rank 0 only; a tied copy never, its original is written);
    ``master``: the live ``(shard,)`` fp32 master (the inner optimizer's parameter);
    ``expert``: expert shards, reduced and partitioned over the expert-gradient group (its
    buckets' shard index is this rank's place in that group, not in the grad group)."""

    param_group: int  # the user's param group index
    tp_sharded: bool
    tied: bool
    buckets: tuple[BucketView, ...]
    tied_index: int = -1
    tied_copy: bool = False
    owner: bool = True
    master: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)
    expert: bool = False


@dataclass(frozen=True)
class ShardPiece:
    """Elements ``[start, start + numel)`` of parameter ``param``'s flattened (TP-local)
    tensor of shape ``shape`` live at ``[offset, offset + numel)`` of group ``group``'s master."""

    group: int
    offset: int
    numel: int
    start: int
    shape: tuple[int, ...]
    param: Any  # the nn.Parameter (identity and TP tags; under ZeRO-3 its data is empty)


@dataclass(frozen=True)
class GroupState:
    """One flat group's state on this rank: the ``(shard,)`` fp32 ``master``, the inner
    optimizer's ``elementwise`` state (each ``(shard,)``, e.g. ``exp_avg``), its ``scalars``
    (e.g. ``step``) and ``options`` (the inner param group's hyper-parameters). From
    :meth:`ShardView.group_state` the tensors are live views; to :meth:`ShardView.load`
    any tensors of those sizes (any device)."""

    master: torch.Tensor
    elementwise: dict[str, torch.Tensor]
    scalars: dict[str, Scalar]
    options: dict[str, Any]


class _InnerAccess:
    """The live inner optimizer and the publish step, for reading and loading state."""

    def __init__(self, optimizer: torch.optim.Optimizer, publish: Callable[[], None]) -> None:
        self.optimizer, self.publish = optimizer, publish


def split_state(state: dict[str, Any], numel: int) -> tuple[dict[str, torch.Tensor], dict[str, Scalar]]:
    """An inner-optimizer state entry -> (element-wise ``(numel,)`` tensors, scalars)."""
    elementwise: dict[str, torch.Tensor] = {}
    scalars: dict[str, Scalar] = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.numel() == numel:
            elementwise[k] = v.detach().reshape(-1)
        elif isinstance(v, torch.Tensor) and v.numel() == 1:
            scalars[k] = v.detach()
        elif isinstance(v, (int, float, bool)):
            scalars[k] = v
        else:
            raise ValueError(f"optimizer state entry {k!r} ({type(v).__name__}) is neither element-wise nor a "
                             f"scalar: this optimizer's state cannot be exported (checkpointed)")
    return elementwise, scalars


@dataclass(frozen=True)
class ShardView:
    """Every flat group of one ZeRO optimizer, in the inner optimizer's group order, and the
    groups it spans: ``grad_group`` (the gradient role's group: the shards), ``tp_group`` (size 1
    when there is no TP). ``stage``: the ZeRO stage; ``sharded``: optimizer state is split over
    the grad group (stage >= 1);
    ``optimizer_class``: the inner optimizer's class name."""

    groups: tuple[GroupView, ...]
    grad_group: AxisGroup
    grad_size: int
    grad_rank: int
    tp_group: AxisGroup
    tp_size: int
    tp_rank: int
    stage: int = -1
    sharded: bool = True
    optimizer_class: str = ""
    _access: Optional[_InnerAccess] = field(default=None, repr=False, compare=False)

    def pieces(self) -> list[ShardPiece]:
        """Every parameter fragment in this rank's master shards, group by group, in flat order."""
        out = []
        for gi, g in enumerate(self.groups):
            for b in g.buckets:
                for s in b.params:
                    if s.hi > s.lo:
                        out.append(ShardPiece(gi, s.master_offset, s.hi - s.lo, s.lo, s.shape, s.param))
        return out

    def masters(self) -> list[torch.Tensor]:
        """Each group's live ``(shard,)`` fp32 master (write into them, then :meth:`load` them
        to publish)."""
        out = []
        for g in self.groups:
            if g.master is None:
                raise RuntimeError("this shard view was built without its masters: use ZeroOptimizer.shard_view()")
            out.append(g.master.detach())
        return out

    def _inner(self) -> _InnerAccess:
        if self._access is None:
            raise RuntimeError("this shard view was built without its optimizer: use ZeroOptimizer.shard_view()")
        return self._access

    def group_state(self, i: int) -> GroupState:
        """Group ``i``'s state now (live views; see :class:`GroupState`)."""
        opt = self._inner().optimizer
        g = self.groups[i]
        assert g.master is not None
        elementwise, scalars = split_state(opt.state.get(g.master, {}), g.master.numel())
        options = {k: v for k, v in opt.param_groups[i].items() if k not in ("params", "param_names")}
        return GroupState(g.master.detach(), elementwise, scalars, options)

    def load(self, masters: Sequence[torch.Tensor], states: Optional[Sequence[GroupState]] = None) -> None:
        """Install ``masters`` (one ``(shard,)`` tensor per group) and, unless ``states`` is
        None (then the optimizer state and hyper-parameters stay as they are), each group's
        element-wise state, scalars and options (an option not given keeps its value; a group
        given no state starts with none); then publish the masters to the parameters.
        Collective over the DP group (the publish all-gathers)."""
        acc = self._inner()
        if len(masters) != len(self.groups) or (states is not None and len(states) != len(self.groups)):
            raise ValueError(f"{len(masters)} masters / {None if states is None else len(states)} states for "
                             f"{len(self.groups)} flat groups")
        for g, m in zip(self.groups, masters):
            assert g.master is not None
            if m.numel() != g.master.numel():
                raise ValueError(f"a master shard of {m.numel()} elements for a flat group of {g.master.numel()}: "
                                 f"the state is for another layout")
        if states is not None:
            inner = acc.optimizer.state_dict()
            groups, state = [], {}
            for cur, st in zip(inner["param_groups"], states):
                opts = dict(cur)
                opts.update(st.options)
                opts["params"] = cur["params"]
                if st.elementwise or st.scalars:
                    state[cur["params"][0]] = {**st.elementwise, **st.scalars}
                groups.append(opts)
            acc.optimizer.load_state_dict({"state": state, "param_groups": groups})
        for g, m in zip(self.groups, masters):
            assert g.master is not None
            g.master.data.copy_(m.reshape(-1))
        acc.publish()


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


def build_shard_view(groups: Sequence[Any], sharded: bool, grad_group: AxisGroup, tp_group: AxisGroup, *,
                     stage: int = -1,
                     optimizer: Optional[torch.optim.Optimizer] = None,
                     publish: Optional[Callable[[], None]] = None) -> ShardView:
    """The view of a ZeRO optimizer's flat groups (:class:`~engine.zero.buckets.FlatGroup`);
    with its inner ``optimizer`` and ``publish`` step, the view also reads and loads state."""
    tp_size, tp_rank = tp_group.size, tp_group.rank
    out = []
    for g in groups:
        buckets, off = [], 0
        for b in g.buckets:
            buckets.append(_bucket_view(b, off, sharded))
            off += b.layout.shard_numel
        if off != g.master.numel():
            raise RuntimeError(f"flat group of {g.master.numel()} elements does not match its buckets ({off})")
        key = g.key
        # the one copy that speaks for the replicas: index 0 of every group the state is replicated over
        owner = not key.tied_copy and (sharded or g.reduce_group.rank == 0) and (key.tp_sharded or tp_rank == 0)
        out.append(GroupView(key.param_group, key.tp_sharded, key.tied_index >= 0, tuple(buckets),
                             key.tied_index, key.tied_copy, owner, g.master, key.expert))
    access = _InnerAccess(optimizer, publish) if optimizer is not None and publish is not None else None
    return ShardView(tuple(out), grad_group, grad_group.size, grad_group.rank, tp_group, tp_size, tp_rank, stage, sharded,
                     type(optimizer).__name__ if optimizer is not None else "", access)

