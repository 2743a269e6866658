"""The :class:`CPLayout` of this rank, built from its :class:`ParallelGroups` and the config.

Ring and Ulysses talk over the whole CP group (``groups[Axis.CP]``: the ``cp`` ranks that
differ only in their CP coordinate, ``tp`` apart). Hybrid splits each CP group of ranks
``g[0..C)`` (in CP order) into:

- Ulysses groups: runs of U consecutive CP ranks, ``g[i*U : (i+1)*U]`` for ``i < C/U``;
- ring groups: one rank of each Ulysses group, ``[g[j], g[j+U], ...]`` for ``j < U``;

so ``cp_rank = ring_index * U + ulysses_index`` (engine.context_parallel.layout). Those
groups are new communicators: every rank creates every one of them, members or not, in
the same order (all Ulysses groups of every CP group, then all ring groups), as
:meth:`ParallelGroups.build` does for the axes.
"""

from __future__ import annotations

import datetime
from typing import Optional

import torch.distributed as dist

from engine.config.schema import ContextParallelConfig
from engine.context_parallel.layout import CPLayout
from engine.distributed.groups import AxisGroup, ParallelGroups
from engine.topology import Axis

__all__ = ["build_cp_layout", "hybrid_rank_lists"]


def hybrid_rank_lists(cp_group: list[int], ulysses_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """(Ulysses groups, ring groups) of one CP group's global ranks (module docstring)."""
    c, u = len(cp_group), ulysses_size
    ulysses = [cp_group[i * u:(i + 1) * u] for i in range(c // u)]
    ring = [cp_group[j::u] for j in range(u)]
    return ulysses, ring


def build_cp_layout(cfg: ContextParallelConfig, groups: ParallelGroups,
                    timeout_s: Optional[float] = None) -> Optional[CPLayout]:
    """This rank's layout; None when ``size`` is 1. Collective for hybrid (every rank calls it)."""
    if cfg.size == 1:
        return None
    cp = groups[Axis.CP]
    if cp.size != cfg.size:
        raise ValueError(f"context_parallel.size {cfg.size} differs from the CP axis of the groups ({cp.size})")
    if cfg.mode == "ring":
        return CPLayout("ring", cp.size, cp.rank, 1, cp, None)
    if cfg.mode == "ulysses":
        return CPLayout("ulysses", cp.size, cp.rank, cp.size, None, cp)
    u = cfg.ulysses_size
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s is not None else None
    every = [hybrid_rank_lists(g, u) for g in groups.topology.groups(Axis.CP)]
    mine: dict[str, AxisGroup] = {}
    for kind, index in (("ulysses", 0), ("ring", 1)):
        for lists in every:
            for ranks in lists[index]:
                handle = dist.new_group(ranks, timeout=timeout, use_local_synchronization=False)
                if groups.rank in ranks:
                    mine[kind] = AxisGroup(f"cp_{kind}", tuple(ranks), ranks.index(groups.rank), handle)
    ring, ulysses = mine["ring"], mine["ulysses"]
    assert cp.rank == ring.rank * u + ulysses.rank  # the layout's rank order
    return CPLayout("hybrid", cp.size, cp.rank, u, ring, ulysses)
