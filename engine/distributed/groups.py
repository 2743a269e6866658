"""Process groups for one run, keyed by mesh axis (``groups[Axis.TP]``) and by role
(``groups.role(Role.GRAD)``, see :data:`engine.topology.ROLE_AXES`): each an :class:`AxisGroup`.

An :class:`AxisGroup` is one value per axis: its global ranks, this rank's index in them,
the size, and the communicator. Everything that communicates (TP layers and mappings, the
ZeRO optimizer, the pipeline executor, :mod:`engine.distributed.comm`) takes one, never ``None``:
torch.distributed reads ``group=None`` as WORLD, while "no tensor parallelism" used to be
spelled the same way, so the two meanings are now two values (:meth:`AxisGroup.world` and
:meth:`AxisGroup.single`).

A size-1 axis is free: it has no communicator (``AxisGroup.single``), every op over it is
the identity, and asking for its ``process_group`` is an error naming the fix.

Construction protocol (why it is written this way):

* ``dist.new_group`` names an unnamed group from a per-process counter, so every rank
  must call it for EVERY group, members or not, in the SAME order; a non-member gets
  ``NON_GROUP_MEMBER`` back and spends no communication. We walk a fixed order (the axes
  in ``MESH_AXES`` order, then embedding when pp > 2, then the flattened role groups in
  ``ROLE_AXES`` order, then the expert roles when ``ep > 1``: every EP group, then every
  expert-data-parallel group of ``Topology.expert_mesh(ep)``; within each ``groups`` order,
  sorted by first rank) on every rank. An axis of size 1 is skipped on every rank alike (its size is global), so the
  counter stays in step.
* ``use_local_synchronization`` stays False, deliberately: with True, torch names a
  group by hashing its rank list, and two groups with identical rank lists would get the
  same name and store prefix.
* No group is built twice or built unused: with pp <= 2 the embedding group (first and
  last stage) IS the pp group and is that value; every group costs an NCCL communicator
  (GPU memory and set-up time on its first collective). No model-parallel (tp x pp) group
  is built: nothing communicates over it. Size-1 groups get no communicator at all. A role
  over one wide axis IS that axis's group; a flattened role group is built once per set
  of wide axes, shared by every role over them.
  Since torch 2.3 no store barrier follows ``new_group`` unless
  TORCH_DIST_INIT_BARRIER=1, so calling it on every rank costs O(#groups) local work only.
* Subgroups do NOT inherit the default group's timeout (torch uses 30 min for gloo), so
  the collective timeout is passed to each ``new_group`` explicitly.

The expert roles (``Role.EP``, ``Role.EXPERT_GRAD``) live on the second folding of the same
ranks, ``Topology.expert_mesh(ep)`` = ``tp, ep, edp, pp`` innermost first: the data x context
ranks of one (tp, pp) coordinate, in grad-role order (``d = cp_rank + cp * dp_rank``), are
re-read as ``d = ep_rank + ep * edp_rank``. The EP group is ``ep`` neighbouring data ranks
(they exchange tokens all-to-all and together hold one layer's experts); the EXPERT_GRAD group
is the ``dp * cp / ep`` ranks with the same ``ep_rank`` (the replicas of one expert shard:
they reduce and partition its gradients). With ``ep == 1`` they ARE the size-1 group and
the grad role's group (no communicator is built).

The embedding group of a (dp, tp) coordinate is its first and last pipeline stage: the
two ranks holding the tied input embedding and output head, whose gradients are summed
over it. A rank on a middle stage holds neither and is in no embedding group
(``in_embedding_group`` is False, ``embedding_ranks == ()``, and ``embedding_group``
raises). With pp == 1 the group is the single rank itself (embedding and head on one
rank, so the all-reduce is the identity).
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Union

import torch.distributed as dist

from engine.topology import EXPERT_ROLE_AXES, MESH_AXES, PER_AXIS_ROLES, ROLE_AXES, Axis, Coord, Role, Topology

__all__ = ["AxisGroup", "ParallelGroups", "NO_TP"]


def _default_timeout() -> datetime.timedelta:
    """The default group's collective timeout, so subgroups fail as fast as it does."""
    import torch

    world = dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            if world is not None:  # None before init: falls through to the error below, as before
                return world._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError):
            continue
    raise RuntimeError("cannot read the default group's timeout: pass timeout_s= to "
                       "ParallelGroups.build")


@dataclass(frozen=True)
class AxisGroup:
    """One communication axis as seen from this rank.

    ``name``: ``"tp"``, ``"dp"``, ``"pp"``, ``"embedding"``, ``"world"`` or a caller's label
    (for error messages). ``ranks``: the members' global ranks in group order. ``rank``:
    this process's index in ``ranks``. ``handle``: the communicator; absent on a size-1
    group, where every collective is the identity.
    """

    name: str
    ranks: tuple[int, ...]
    rank: int
    handle: Optional[dist.ProcessGroup] = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.ranks or len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"{self.name} group: ranks must be distinct and non-empty, got {self.ranks}")
        if not 0 <= self.rank < len(self.ranks):
            raise ValueError(f"{self.name} group: rank {self.rank} is outside [0, {len(self.ranks)})")
        if len(self.ranks) > 1 and self.handle is None:
            raise ValueError(f"{self.name} group of ranks {self.ranks} has no communicator: build it "
                             "with AxisGroup.of(process_group) or ParallelGroups.build")

    # ------------------------------------------------------------ constructors
    @classmethod
    def single(cls, name: str, global_rank: int = 0) -> "AxisGroup":
        """A size-1 axis (``global_rank`` alone): free, every op over it is the identity, and
        it needs no torch.distributed (a dense model in a plain process uses it)."""
        return cls(name, (global_rank,), 0)

    @classmethod
    def world(cls) -> "AxisGroup":
        """Every rank of the job (the default group), where "all ranks" is meant."""
        if not dist.is_initialized():
            raise RuntimeError("AxisGroup.world() needs an initialised default group: call "
                               "engine.distributed.env.init_distributed() first")
        n = dist.get_world_size()
        return cls("world", tuple(range(n)), dist.get_rank(), dist.group.WORLD if n > 1 else None)

    @classmethod
    def of(cls, group: dist.ProcessGroup, name: str = "group") -> "AxisGroup":
        """Wrap a torch process group this rank belongs to (for groups made by a caller, e.g.
        a DeepSpeed-style script's ``data_parallel_group``)."""
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"{name}: expected a torch.distributed.ProcessGroup, got {type(group).__name__} "
                            "(pass AxisGroup.world() for every rank)")
        ranks = tuple(dist.get_process_group_ranks(group))
        if dist.get_rank() not in ranks:
            raise ValueError(f"{name}: this rank ({dist.get_rank()}) is not a member of the group of ranks "
                             f"{list(ranks)}: pass this rank's own group")
        return cls(name, ranks, ranks.index(dist.get_rank()), group if len(ranks) > 1 else None)

    # ------------------------------------------------------------------ facts
    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def global_rank(self) -> int:
        """This process's global rank."""
        return self.ranks[self.rank]

    def global_rank_of(self, group_rank: int) -> int:
        """The global rank of member ``group_rank`` (what torch's ``src``/``dst`` want)."""
        if not 0 <= group_rank < self.size:
            raise ValueError(f"{self.name} group: rank {group_rank} is outside [0, {self.size})")
        return self.ranks[group_rank]

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The communicator; a size-1 group has none (its ops are identities: test ``size > 1``)."""
        if self.handle is None:
            raise RuntimeError(f"the {self.name} group of rank {self.ranks[0]} has size 1 and no communicator: "
                               "every collective over it is the identity; check .size > 1 before communicating")
        return self.handle


NO_TP = AxisGroup.single("tp")  # "not tensor-parallel": a dense model in any process


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's groups: one per mesh axis (``groups[Axis.TP]``), one per role
    (``groups.role(Role.GRAD)``: see :data:`engine.topology.ROLE_AXES`) and the embedding group.

    Immutable after :meth:`build`. Pass it (or one of its :class:`AxisGroup`) to whatever
    communicates; nothing here is global. A role that spans one axis (or several of which
    at most one has size > 1) IS that axis's group, so no communicator is built twice.
    """

    topology: Topology
    rank: int
    axes: Mapping[Axis, AxisGroup]
    roles: Mapping[Role, AxisGroup]  # the flattened roles (PER_AXIS_ROLES are read with role_axes)
    embedding: Optional[AxisGroup]  # stored only: absent on middle pipeline stages (read embedding_group)

    @classmethod
    def build(cls, topology: Topology, rank: Optional[int] = None,
              timeout_s: Optional[float] = None, *, ep: int = 1) -> "ParallelGroups":
        """Collective over the whole world: every rank must call it with the same topology
        and ``ep``.

        ``rank`` defaults to ``dist.get_rank()``; ``timeout_s`` defaults to the default
        group's timeout; ``ep``: the expert-parallel degree (``expert_parallel.size``), whose
        groups are built on :meth:`Topology.expert_mesh` (module docstring).
        """
        topology.expert_mesh(ep)  # raises (on every rank, before any collective) when ep does not divide dp * cp
        if not dist.is_initialized():
            raise RuntimeError("ParallelGroups.build needs an initialised default group: "
                               "call engine.distributed.env.init_distributed() first")
        world = dist.get_world_size()
        if world != topology.world_size:
            raise ValueError(f"{topology} needs {topology.world_size} ranks but the job has "
                             f"{world}: change the parallel degrees or the number of processes launched")
        rank = dist.get_rank() if rank is None else rank
        if rank != dist.get_rank():
            raise ValueError(f"rank={rank} is not this process's rank {dist.get_rank()}")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive (or None to inherit), got {timeout_s!r}")
        timeout = (_default_timeout() if timeout_s is None
                   else datetime.timedelta(seconds=timeout_s))

        def make(name: str, all_groups: list[list[int]]) -> Optional[AxisGroup]:
            """This rank's group among ``all_groups`` (None when it is in none of them)."""
            mine: Optional[AxisGroup] = None
            for ranks in all_groups:  # same order on every rank, members or not
                if len(ranks) == 1:  # free: no communicator (every rank skips alike)
                    handle = None
                else:
                    handle = dist.new_group(ranks, timeout=timeout, use_local_synchronization=False)
                if rank in ranks:
                    mine = AxisGroup(name, tuple(ranks), ranks.index(rank), handle)
            return mine

        axes = {}
        for axis in MESH_AXES:  # innermost first: tp, dp, pp (the order every rank walks)
            axes[axis] = make(axis.value, topology.groups(axis))
        pp = axes[Axis.PP]
        assert pp is not None  # an axis partitions the world
        if topology.pp <= 2:  # first + last stage: the whole pp group (the rank alone at pp == 1)
            emb: Optional[AxisGroup] = AxisGroup("embedding", pp.ranks, pp.rank, pp.handle)
        else:
            emb = make("embedding", topology.embedding_groups())

        def flat(wide: tuple[Axis, ...]) -> AxisGroup:
            built = make("x".join(a.value for a in wide), topology.groups(wide))
            assert built is not None  # the flattened groups partition the world
            return built

        built = cls.from_axes(topology, rank, {a: g for a, g in axes.items() if g is not None}, emb, flat)
        return built.with_expert_roles(ep, make)

    def with_expert_roles(self, ep: int,
                          make: Callable[[str, list[list[int]]], Optional[AxisGroup]]) -> "ParallelGroups":
        """These groups plus ``Role.EP`` and ``Role.EXPERT_GRAD`` at expert-parallel degree ``ep``
        (module docstring). ``make(name, rank_lists)``: this rank's group among ``rank_lists``,
        creating a communicator for each list of size > 1 (collective: the same calls on every
        rank); not called when ``ep == 1``."""
        mesh = self.topology.expert_mesh(ep)
        roles = dict(self.roles)
        if ep == 1:  # the whole data x context group replicates every expert: the grad role
            roles[Role.EP] = AxisGroup.single("ep", self.rank)
            roles[Role.EXPERT_GRAD] = self.roles[Role.GRAD]
        else:
            grad_lists = self.topology.groups(ROLE_AXES[Role.GRAD])
            for role, names in EXPERT_ROLE_AXES.items():  # dict order (EP, then EXPERT_GRAD) on every rank
                lists = mesh.groups(names)
                if lists == grad_lists:  # ep == dp * cp: the EP group is the grad group, no second communicator
                    roles[role] = self.roles[Role.GRAD]
                    continue
                mine = make(role.value, lists)
                assert mine is not None  # the groups of an axis partition the world
                roles[role] = mine
        return dataclasses.replace(self, roles=roles)

    @classmethod
    def from_axes(cls, topology: Topology, rank: int, axes: Mapping[Union[Axis, str], AxisGroup],
                  embedding: Optional[AxisGroup],
                  make_flat: Optional[Callable[[tuple[Axis, ...]], AxisGroup]] = None) -> "ParallelGroups":
        """Assemble from the axes' groups (an axis of size 1 may be left out) and derive the role
        groups. A role spanning several axes of size > 1 needs its own communicator: ``make_flat``
        builds it (collective: :meth:`build` passes one), once per set of axes, in
        :data:`ROLE_AXES` order on every rank."""
        given = {Axis.parse(a): g for a, g in axes.items()}
        full = {a: given.get(a) or AxisGroup.single(a.value, rank) for a in MESH_AXES}
        roles: dict[Role, AxisGroup] = {}
        built: dict[tuple[Axis, ...], AxisGroup] = {}  # one communicator per set of axes
        for role, spanned in ROLE_AXES.items():  # dict order: the same on every rank
            if role in PER_AXIS_ROLES:
                continue
            wide = tuple(a for a in spanned if topology.size(a) > 1)
            if len(wide) <= 1:  # the same ranks as one axis's group: that value, no new communicator
                roles[role] = full[wide[0] if wide else spanned[0]]
                continue
            if make_flat is None:
                raise ValueError(f"role {role.value!r} spans {[a.value for a in wide]}: it needs a flattened group "
                                 "(use ParallelGroups.build)")
            if wide not in built:
                built[wide] = make_flat(wide)
            roles[role] = built[wide]
        return cls(topology, rank, full, roles, embedding)

    # ------------------------------------------------------------------- axes
    def __getitem__(self, axis: Union[Axis, str]) -> AxisGroup:
        """``groups[Axis.TP]`` (or ``groups["tp"]``): that axis's group."""
        return self.axes[Axis.parse(axis)]

    def role(self, role: Role) -> AxisGroup:
        """The one group of ranks that play ``role`` together (e.g. ``Role.GRAD``: the ranks that
        reduce and partition the dense gradients)."""
        if role in PER_AXIS_ROLES:
            raise ValueError(f"role {role.value!r} is reduced axis by axis and has no flattened group: "
                             "use role_axes()")
        if role not in self.roles:
            raise ValueError(f"role {role.value!r} lives on the expert folding (Topology.expert_mesh): these groups "
                             "were assembled without expert roles (ParallelGroups.build(..., ep=) or "
                             "with_expert_roles builds them)")
        return self.roles[role]

    def role_axes(self, role: Role) -> tuple[AxisGroup, ...]:
        """The groups of each axis ``role`` spans, with a size > 1 (a separable reduction such as
        the FP8 amax MAX is taken over each in turn)."""
        if role not in ROLE_AXES:
            raise ValueError(f"role {role.value!r} lives on the expert folding: this run builds no expert groups")
        return tuple(self.axes[a] for a in ROLE_AXES[role] if self.axes[a].size > 1)

    def speaks_for(self, *replicated: Union[Role, Axis]) -> bool:
        """True on the one rank that writes, sends or logs for the ranks that hold the same thing
        along every given role or axis (index 0 in each): the one predicate for it."""
        axes = [a for r in replicated for a in (ROLE_AXES[r] if isinstance(r, Role) else (r,))]
        return self.topology.speaks_for(self.rank, axes)

    def expert_roles(self) -> dict[Role, AxisGroup]:
        """The expert roles' groups (``Role.EP``, ``Role.EXPERT_GRAD``) these groups were built
        with; empty when assembled without them (what ZeRO's ``role_groups`` takes)."""
        return {r: self.roles[r] for r in EXPERT_ROLE_AXES if r in self.roles}

    @property
    def ep_size(self) -> int:
        """The expert-parallel degree (1 when the expert roles were not built)."""
        ep = self.roles.get(Role.EP)
        return 1 if ep is None else ep.size

    @property
    def tp_group(self) -> AxisGroup:
        return self.axes[Axis.TP]

    @property
    def dp_group(self) -> AxisGroup:
        return self.axes[Axis.DP]

    @property
    def pp_group(self) -> AxisGroup:
        return self.axes[Axis.PP]

    @property
    def embedding_group(self) -> AxisGroup:
        """The first and last stage of this (dp, tp) (tied embedding and head); raises on a
        middle stage, which holds neither (test :attr:`in_embedding_group` first)."""
        if self.embedding is None:
            raise ValueError(f"rank {self.rank} is on a middle pipeline stage ({self.coord.pp} of "
                             f"{self.pp_size}) and in no embedding group: tied weights live on the first "
                             "and last stage only")
        return self.embedding

    @property
    def in_embedding_group(self) -> bool:
        """True on the first and last pipeline stage (the ranks holding tied embeddings)."""
        return self.embedding is not None

    @property
    def tp_ranks(self) -> tuple[int, ...]:
        return self.tp_group.ranks

    @property
    def dp_ranks(self) -> tuple[int, ...]:
        return self.dp_group.ranks

    @property
    def pp_ranks(self) -> tuple[int, ...]:
        return self.pp_group.ranks

    @property
    def embedding_ranks(self) -> tuple[int, ...]:
        """() on middle pipeline stages."""
        return self.embedding.ranks if self.embedding is not None else ()

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

    def all_groups(self) -> list[AxisGroup]:
        """This rank's distinct groups that have a communicator (size > 1), in creation order;
        the embedding group only when it is not the pp group."""
        groups = [self.axes[a] for a in MESH_AXES]
        emb = self.embedding
        if emb is not None and self.topology.pp > 2:
            groups.append(emb)
        for g in self.roles.values():  # a flattened role group (several wide axes), once
            if all(g is not h for h in groups):
                groups.append(g)
        return [g for g in groups if g.size > 1]
