"""The device mesh as one immutable value, and the roles its axes play.

Pure: nothing here touches ``torch.distributed``. Process groups are built from a
``Topology`` in :mod:`engine.distributed.groups`.

**The axis list.** :data:`MESH_AXES` names the mesh's axes innermost first; a rank's
coordinates are its digits in that mixed radix::

    rank = sum(coord[a] * stride[a]),  stride[a] = product of the sizes of the axes before a

With ``(tp, cp, dp, pp)``: ``rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank``.
TP is innermost so tensor-parallel peers are neighbouring ranks (on a real node they share
the fastest links); context parallelism (CP) comes next, because its ring / all-to-all
traffic runs in every attention layer, then data parallelism; PP is outermost so a pipeline
stage is a contiguous block of ranks. World size = ``dp * tp * pp * cp``. Adding an axis is
one name in :class:`Axis`, one place in :data:`MESH_AXES`, one field of :class:`Topology` and
:class:`Coord` (size 1, coordinate 0 by default), and a column in :data:`ROLE_AXES`; every
method below is written over the list.

The CP ranks of one group hold the same parameters and different head-tail shards of the
same sequences (engine.context_parallel.sharding): they read the same rows (``batch`` is
``dp`` alone), but reduce and partition gradients and share the loss's token count with the
other data replicas (``grad`` and ``loss`` span ``cp x dp``).

**Roles, not axes.** Code asks "which ranks reduce this gradient", "which ranks share the
loss denominator", never "the dp group": :data:`ROLE_AXES` maps each :class:`Role` to the
axes it spans. ``batch`` is ``dp``; ``grad`` and ``loss`` are ``cp x dp`` (the CP ranks
of a replica hold copies of the same parameters and parts of the same loss); ``amax`` is
every axis but PP. A role over several axes is one flattened group (its ranks vary along all
of them), except the separable ones in :data:`PER_AXIS_ROLES` (a MAX can be taken over each
axis in turn, so they need no communicator of their own).

**A second folding.** :meth:`Topology.expert_mesh` folds the same ranks again for experts
(Megatron's ``tp, ep, edp, pp``): the axes between TP and PP (the data axes) are re-read as
``ep x edp``. :class:`Mesh` is the generic value both foldings are.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, NamedTuple, Optional, Sequence, Union

from engine.validate import check_int

__all__ = ["Axis", "Coord", "EXPERT_ROLE_AXES", "Mesh", "MESH_AXES", "PER_AXIS_ROLES", "ROLE_AXES", "Role", "Topology",
           "TopologyError"]


class TopologyError(ValueError):
    """A topology that cannot exist (non-positive degree, size mismatch, bad rank)."""


class Axis(str, enum.Enum):
    """A mesh axis. ``Axis("dp")`` and ``Axis.DP`` are the same value."""

    DP = "dp"
    TP = "tp"
    PP = "pp"
    CP = "cp"

    @classmethod
    def parse(cls, axis: Union["Axis", str]) -> "Axis":
        if isinstance(axis, Axis):
            return axis
        try:
            return cls(str(axis).lower())
        except ValueError:
            names = ", ".join(repr(a.value) for a in cls)
            raise TopologyError(f"unknown axis {axis!r}: expected one of {names}") from None


# The mesh's axes, innermost first (see the module docstring). TP first and PP last.
MESH_AXES: tuple[Axis, ...] = (Axis.TP, Axis.CP, Axis.DP, Axis.PP)


class Role(str, enum.Enum):
    """What a group of ranks does together (see :data:`ROLE_AXES`)."""

    BATCH = "batch"  # ranks that read different rows of the global batch; the batch arithmetic's divisor
    GRAD = "grad"    # ranks that reduce (and, under ZeRO, partition) the dense gradients and optimizer state
    LOSS = "loss"    # ranks whose micro-batches share the step's loss denominator and the reported mean
    AMAX = "amax"    # ranks whose FP8 amax must agree (every copy of a scaled tensor)
    TP = "tp"        # tensor parallelism: the ranks that split one layer
    PP = "pp"        # pipeline parallelism: the stages of one model replica
    EP = "ep"        # expert parallelism: the ranks whose experts together make one layer's (all-to-all)
    EXPERT_GRAD = "expert_grad"  # the replicas of one expert shard: reduce and partition its gradients


# The role table: the axes each role spans (in MESH_AXES order).
ROLE_AXES: dict[Role, tuple[Axis, ...]] = {
    Role.BATCH: (Axis.DP,),
    Role.GRAD: (Axis.CP, Axis.DP),
    Role.LOSS: (Axis.CP, Axis.DP),
    Role.AMAX: (Axis.TP, Axis.CP, Axis.DP),
    Role.TP: (Axis.TP,),
    Role.PP: (Axis.PP,),
}

# The expert roles live on the expert folding (Topology.expert_mesh: tp, ep, edp, pp), by axis name.
EXPERT_ROLE_AXES: dict[Role, tuple[str, ...]] = {
    Role.EP: ("ep",),
    Role.EXPERT_GRAD: ("edp",),
}

# Roles reduced axis by axis (a MAX is separable): no flattened communicator is built for them.
PER_AXIS_ROLES: frozenset[Role] = frozenset({Role.AMAX})

AxesLike = Union[Axis, str, Sequence[Union[Axis, str]]]


def _axes(axes: AxesLike) -> tuple[Axis, ...]:
    """One axis or several, parsed, in MESH_AXES order (duplicates dropped)."""
    given: list[Union[Axis, str]] = list(axes) if isinstance(axes, (list, tuple)) else [axes]  # type: ignore[list-item]
    parsed = {Axis.parse(a) for a in given}
    return tuple(a for a in MESH_AXES if a in parsed)


class Coord(NamedTuple):
    """Coordinates of one rank in the mesh (one field per :class:`Axis`)."""

    dp: int
    tp: int
    pp: int
    cp: int = 0


@dataclass(frozen=True)
class Mesh:
    """Named axes with sizes, innermost first: the rank arithmetic of any folding of the world."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.names) != len(self.sizes) or len(set(self.names)) != len(self.names):
            raise TopologyError(f"mesh axes {self.names} and sizes {self.sizes} do not match one to one")
        for name, size in zip(self.names, self.sizes):
            check_int(name, size, minimum=1, error=TopologyError)

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes)

    def size(self, name: str) -> int:
        return self.sizes[self._index(name)]

    def _index(self, name: str) -> int:
        if name not in self.names:
            raise TopologyError(f"unknown axis {name!r}: this mesh has {', '.join(self.names)}")
        return self.names.index(name)

    def coords(self, rank: int) -> dict[str, int]:
        check_int("rank", rank, minimum=0, maximum=self.world_size - 1, error=TopologyError,
                  fix=f"it is outside this topology's {self.world_size} ranks")
        out = {}
        for name, size in zip(self.names, self.sizes):
            rank, out[name] = divmod(rank, size)
        return out

    def rank(self, coords: dict[str, int]) -> int:
        rank, stride = 0, 1
        for name, size in zip(self.names, self.sizes):
            value = coords.get(name, 0)
            if not 0 <= value < size:
                raise TopologyError(f"{name} coordinate {value} is outside [0, {size})")
            rank += value * stride
            stride *= size
        return rank

    def ranks_along(self, names: Iterable[str], rank: int) -> list[int]:
        """Ranks that differ from ``rank`` only along ``names`` (``rank`` included), in rank order
        of the flattened group (the innermost of ``names`` varies fastest)."""
        varying = [n for n in self.names if n in set(names)]
        for n in names:
            self._index(n)
        base = self.coords(rank)
        out = []
        for i in range(math.prod(self.size(n) for n in varying)):
            c = dict(base)
            for n in varying:
                i, c[n] = divmod(i, self.size(n))
            out.append(self.rank(c))
        return out

    def groups(self, names: Iterable[str]) -> list[list[int]]:
        """All groups along ``names``; they partition the world. Sorted by their first rank."""
        names = list(names)
        seen: set[int] = set()
        out = []
        for r in range(self.world_size):
            if r not in seen:
                g = self.ranks_along(names, r)
                seen.update(g)
                out.append(g)
        return out


@dataclass(frozen=True)
class Topology:
    """A validated mesh of the axes in :data:`MESH_AXES` (``dp x tp x pp x cp``).

    ``Topology(dp=2, tp=2, pp=2, world_size=8)`` additionally checks the product
    against the world size the run was launched with.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    world_size: Optional[int] = None

    def __post_init__(self) -> None:
        for axis in Axis:
            check_int(axis.value, getattr(self, axis.value), minimum=1, error=TopologyError)
        product = math.prod(self.size(a) for a in Axis)
        if self.world_size is None:
            object.__setattr__(self, "world_size", product)
        elif self.world_size != product:
            used = [a for a in Axis if self.size(a) > 1] or [Axis.DP]
            names, sizes = "*".join(a.value for a in used), "*".join(str(self.size(a)) for a in used)
            raise TopologyError(
                f"{names} = {sizes} = {product} does not equal the world size {self.world_size}: launch "
                f"{product} ranks, or change the degrees so that their product is {self.world_size}")

    # ------------------------------------------------------------------ sizes
    def size(self, axis: AxesLike) -> int:
        """The size of one axis, or of the flattened group over several."""
        return math.prod(getattr(self, a.value) for a in _axes(axis))

    def role_size(self, role: Role) -> int:
        """How many ranks play ``role`` together (e.g. the ranks that reduce one gradient)."""
        return self.size(ROLE_AXES[role])

    @cached_property
    def mesh(self) -> Mesh:
        """The generic mesh value of this topology (names and sizes innermost first)."""
        return Mesh(tuple(a.value for a in MESH_AXES), tuple(self.size(a) for a in MESH_AXES))

    @property
    def model_parallel_size(self) -> int:
        """Ranks that together hold one model replica (tp * pp)."""
        return self.tp * self.pp

    # ------------------------------------------------------- rank <-> coords
    def coord(self, rank: int) -> Coord:
        return Coord(**self.mesh.coords(rank))

    def rank(self, **coords: int) -> int:
        """The rank at the given coordinates (an axis left out is at 0)."""
        return self.mesh.rank({Axis.parse(a).value: v for a, v in coords.items()})

    def speaks_for(self, rank: int, axes: AxesLike) -> bool:
        """True when ``rank`` is the one replica that speaks for the ranks varying along ``axes``
        (coordinate 0 on each): the one predicate for "who writes / sends / logs for the others"."""
        c = self.coord(rank)
        return all(getattr(c, a.value) == 0 for a in _axes(axes))

    # ------------------------------------------------------------ groups
    def ranks_along(self, axis: AxesLike, rank: int) -> list[int]:
        """Ranks that differ from ``rank`` only along ``axis`` (one axis or several; ``rank``
        included), in the order of the flattened group."""
        return self.mesh.ranks_along([a.value for a in _axes(axis)], rank)

    def groups(self, axis: AxesLike) -> list[list[int]]:
        """All groups along ``axis`` (one or several axes); they partition the world. Sorted by
        their first rank."""
        return self.mesh.groups([a.value for a in _axes(axis)])

    def role_ranks(self, role: Role, rank: int) -> list[int]:
        return self.ranks_along(ROLE_AXES[role], rank)

    def model_parallel_ranks(self, rank: int) -> list[int]:
        """The tp*pp ranks holding the same model replica as ``rank``."""
        return sorted(self.ranks_along((Axis.TP, Axis.PP), rank))

    def model_parallel_groups(self) -> list[list[int]]:
        return [sorted(g) for g in self.groups((Axis.TP, Axis.PP))]

    def embedding_ranks(self, rank: int) -> list[int]:
        """First and last pipeline stage with ``rank``'s other coordinates: they hold the tied
        embedding/head. With pp == 1 this is just ``[rank]``."""
        c = self.coord(rank)._asdict()
        return sorted({self.rank(**{**c, "pp": 0}), self.rank(**{**c, "pp": self.pp - 1})})

    def embedding_groups(self) -> list[list[int]]:
        firsts = [r for r in range(self.mesh.world_size) if self.coord(r).pp == 0]
        return [self.embedding_ranks(r) for r in firsts]

    # -------------------------------------------------------- pipeline
    def is_first_stage(self, rank: int) -> bool:
        return self.coord(rank).pp == 0

    def is_last_stage(self, rank: int) -> bool:
        return self.coord(rank).pp == self.pp - 1

    def _stage_neighbour(self, rank: int, step: int) -> Optional[int]:
        c = self.coord(rank)._asdict()
        pp = c["pp"] + step
        return self.rank(**{**c, "pp": pp}) if 0 <= pp < self.pp else None

    def prev_stage_rank(self, rank: int) -> Optional[int]:
        """Rank holding the previous pipeline stage with the same other coordinates; None on the first."""
        return self._stage_neighbour(rank, -1)

    def next_stage_rank(self, rank: int) -> Optional[int]:
        """Rank holding the next pipeline stage with the same other coordinates; None on the last."""
        return self._stage_neighbour(rank, +1)

    # -------------------------------------------------------- experts
    def expert_mesh(self, ep: int) -> Mesh:
        """The same ranks folded for experts, ``tp, ep, edp, pp`` innermost first: the data axes
        (every axis between TP and PP in :data:`MESH_AXES`) are re-read as ``ep x edp``, so an
        expert-parallel group is ``ep`` neighbouring data replicas and ``edp`` the replicas of
        one expert shard. The dense folding is untouched."""
        data = self.size(MESH_AXES[1:-1])
        check_int("ep", ep, minimum=1, error=TopologyError)
        if data % ep:
            raise TopologyError(f"expert parallel size {ep} does not divide the data-parallel ranks {data}: "
                                f"choose a divisor of {data}")
        return Mesh(("tp", "ep", "edp", "pp"), (self.tp, ep, data // ep, self.pp))

    def __str__(self) -> str:
        return "Topology(" + ", ".join(f"{a.value}={self.size(a)}" for a in Axis) + ")"
