"""Process groups for one run, built once from a :class:`~engine.topology.Topology`.

Construction protocol (why it is written this way):

* ``dist.new_group`` names an unnamed group from a per-process counter, so every rank
  must call it for EVERY group, members or not, in the SAME order; a non-member gets
  ``NON_GROUP_MEMBER`` back and spends no communication. We walk a fixed order (tp, dp,
  pp, then embedding when pp > 2; within an axis ``Topology.groups`` order, sorted by
  first rank) on every rank.
* ``use_local_synchronization`` stays False, deliberately: with True, torch names a
  group by hashing its rank list, and two groups with identical rank lists would get the
  same name and store prefix.
* No group is built twice: with pp <= 2 the embedding group (first and last stage) IS the
  pp group and is that object; every group costs an NCCL communicator (GPU memory and
  set-up time on its first collective). No model-parallel (tp x pp) group is built:
  nothing communicates over it.
  Since torch 2.3 no store barrier follows ``new_group`` unless
  TORCH_DIST_INIT_BARRIER=1, so calling it on every rank costs O(#groups) local work only.
* Subgroups do NOT inherit the default group's timeout (torch uses 30 min for gloo), so
  the collective timeout is passed to each ``new_group`` explicitly.

The embedding group of a (dp, tp) coordinate is its first and last pipeline stage: the
two ranks holding the tied input embedding and output head, whose gradients are summed
over it. A rank on a middle stage holds neither and is in no embedding group
(``embedding_group is None``, ``embedding_ranks == ()``). With pp == 1 the group is the
single rank itself (embedding and head on one rank, so the all-reduce is the identity).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from engine.topology import Axis, Coord, Topology

__all__ = ["ParallelGroups"]


def _default_timeout() -> datetime.timedelta:
    """The default group's collective timeout, so subgroups fail as fast as it does."""
    import torch

    world = dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            return world._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError):
            continue
    raise RuntimeError("cannot read the default group's timeout: pass timeout_s= to "
                       "ParallelGroups.build")


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's tp / dp / pp / embedding groups and their global ranks.

    Immutable after :meth:`build`. Pass it (or one of its groups) to whatever
    communicates; nothing here is global.
    """

    topology: Topology
    rank: int
    tp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    embedding_group: Optional[dist.ProcessGroup]  # None on middle pipeline stages; pp_group if pp <= 2
    tp_ranks: tuple[int, ...]
    dp_ranks: tuple[int, ...]
    pp_ranks: tuple[int, ...]
    embedding_ranks: tuple[int, ...]  # () on middle pipeline stages

    @classmethod
    def build(cls, topology: Topology, rank: Optional[int] = None,
              timeout_s: Optional[float] = None) -> "ParallelGroups":
        """Collective over the whole world: every rank must call it with the same topology.

        ``rank`` defaults to ``dist.get_rank()``; ``timeout_s`` defaults to the default
        group's timeout.
        """
        if not dist.is_initialized():
            raise RuntimeError("ParallelGroups.build needs an initialised default group: "
                               "call engine.dist.env.init_distributed() first")
        world = dist.get_world_size()
        if world != topology.world_size:
            raise ValueError(f"{topology} needs {topology.world_size} ranks but the job has "
                             f"{world}: change dp/tp/pp or the number of processes launched")
        rank = dist.get_rank() if rank is None else rank
        if rank != dist.get_rank():
            raise ValueError(f"rank={rank} is not this process's rank {dist.get_rank()}")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive (or None to inherit), got {timeout_s!r}")
        timeout = (_default_timeout() if timeout_s is None
                   else datetime.timedelta(seconds=timeout_s))

        def make(all_groups: list[list[int]]) -> tuple[Optional[dist.ProcessGroup], tuple[int, ...]]:
            mine: tuple[Optional[dist.ProcessGroup], tuple[int, ...]] = (None, ())
            for ranks in all_groups:  # same order on every rank, members or not
                group = dist.new_group(ranks, timeout=timeout, use_local_synchronization=False)
                if rank in ranks:
                    mine = (group, tuple(ranks))
            return mine

        tp = make(topology.groups(Axis.TP))
        dp = make(topology.groups(Axis.DP))
        pp = make(topology.groups(Axis.PP))
        # first + last stage: the whole pp group when pp <= 2 (the rank alone at pp == 1)
        emb = pp if topology.pp <= 2 else make(topology.embedding_groups())
        return cls(topology, rank, tp[0], dp[0], pp[0], emb[0], tp[1], dp[1], pp[1], emb[1])

    # ------------------------------------------------------------- coordinates
    @property
    def coord(self) -> Coord:
        return self.topology.coord(self.rank)

    @property
    def tp_size(self) -> int:
        return self.topology.tp

    @property
    def dp_size(self) -> int:
        return self.topology.dp

    @property
    def pp_size(self) -> int:
        return self.topology.pp

    @property
    def tp_rank(self) -> int:
        return self.coord.tp

    @property
    def dp_rank(self) -> int:
        return self.coord.dp

    @property
    def pp_rank(self) -> int:
        return self.coord.pp

    # ---------------------------------------------------------------- pipeline
    @property
    def is_first_stage(self) -> bool:
        return self.topology.is_first_stage(self.rank)

    @property
    def is_last_stage(self) -> bool:
        return self.topology.is_last_stage(self.rank)

    @property
    def prev_stage_rank(self) -> Optional[int]:
        """Global rank of the previous stage (same dp, tp); None on the first stage."""
        return self.topology.prev_stage_rank(self.rank)

    @property
    def next_stage_rank(self) -> Optional[int]:
        """Global rank of the next stage (same dp, tp); None on the last stage."""
        return self.topology.next_stage_rank(self.rank)

    @property
    def in_embedding_group(self) -> bool:
        """True on the first and last pipeline stage (the ranks holding tied embeddings)."""
        return self.embedding_group is not None

    def all_groups(self) -> list[dist.ProcessGroup]:
        """This rank's distinct groups in creation order (the embedding group only when it is
        not the pp group)."""
        groups = [self.tp_group, self.dp_group, self.pp_group]
        if self.embedding_group is not None and self.embedding_group is not self.pp_group:
            groups.append(self.embedding_group)
        return groups
