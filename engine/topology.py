"""The DP x TP x PP mesh as one immutable value.

Pure: nothing here touches ``torch.distributed``. Process groups are built from a
``Topology`` in :mod:`engine.distributed.groups`.

Rank layout (TP innermost so tensor-parallel peers are neighbouring ranks, which on a
real node share the fastest links; PP outermost so a pipeline stage is a contiguous
block of ranks)::

    rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple, Optional, Union

from engine.validate import check_int

__all__ = ["Axis", "Coord", "Topology", "TopologyError"]


class TopologyError(ValueError):
    """A topology that cannot exist (non-positive degree, size mismatch, bad rank)."""


class Axis(str, enum.Enum):
    """A mesh axis. ``Axis("dp")`` and ``Axis.DP`` are the same value."""

    DP = "dp"
    TP = "tp"
    PP = "pp"

    @classmethod
    def parse(cls, axis: Union["Axis", str]) -> "Axis":
        if isinstance(axis, Axis):
            return axis
        try:
            return cls(str(axis).lower())
        except ValueError:
            raise TopologyError(f"unknown axis {axis!r}: expected one of 'dp', 'tp', 'pp'") from None


class Coord(NamedTuple):
    """Coordinates of one rank in the mesh."""

    dp: int
    tp: int
    pp: int


@dataclass(frozen=True)
class Topology:
    """A validated ``dp x tp x pp`` mesh.

    ``Topology(dp=2, tp=2, pp=2, world_size=8)`` additionally checks the product
    against the world size the run was launched with.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    world_size: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp"):
            check_int(name, getattr(self, name), minimum=1, error=TopologyError)
        product = self.dp * self.tp * self.pp
        if self.world_size is None:
            object.__setattr__(self, "world_size", product)
        elif self.world_size != product:
            raise TopologyError(
                f"dp*tp*pp = {self.dp}*{self.tp}*{self.pp} = {product} does not equal the world "
                f"size {self.world_size}: launch {product} ranks, or change the degrees so that "
                f"their product is {self.world_size}"
            )

    # ------------------------------------------------------------------ sizes
    def size(self, axis: Union[Axis, str]) -> int:
        return getattr(self, Axis.parse(axis).value)

    @property
    def model_parallel_size(self) -> int:
        """Ranks that together hold one model replica (tp * pp)."""
        return self.tp * self.pp

    # ------------------------------------------------------- rank <-> coords
    def _check_rank(self, rank: int) -> None:
        check_int("rank", rank, minimum=0, maximum=self.dp * self.tp * self.pp - 1, error=TopologyError,
                  fix=f"it is outside this topology's {self.world_size} ranks")

    def coord(self, rank: int) -> Coord:
        self._check_rank(rank)
        tp_rank = rank % self.tp
        dp_rank = (rank // self.tp) % self.dp
        pp_rank = rank // (self.tp * self.dp)
        return Coord(dp=dp_rank, tp=tp_rank, pp=pp_rank)

    def rank(self, dp: int = 0, tp: int = 0, pp: int = 0) -> int:
        for name, value, size in (("dp", dp, self.dp), ("tp", tp, self.tp), ("pp", pp, self.pp)):
            if not 0 <= value < size:
                raise TopologyError(f"{name} coordinate {value} is outside [0, {size})")
        return pp * (self.dp * self.tp) + dp * self.tp + tp

    # ------------------------------------------------------------ groups
    def ranks_along(self, axis: Union[Axis, str], rank: int) -> list[int]:
        """Ranks that differ from ``rank`` only along ``axis`` (``rank`` included), in axis order."""
        axis = Axis.parse(axis)
        c = self.coord(rank)._asdict()
        out = []
        for i in range(self.size(axis)):
            c[axis.value] = i
            out.append(self.rank(**c))
        return out

    def groups(self, axis: Union[Axis, str]) -> list[list[int]]:
        """All groups along ``axis``; they partition the world. Sorted by their first rank."""
        axis = Axis.parse(axis)
        seen: set[int] = set()
        out = []
        for r in range(self.dp * self.tp * self.pp):  # == world_size (checked at construction)
            if r not in seen:
                g = self.ranks_along(axis, r)
                seen.update(g)
                out.append(g)
        return out

    def model_parallel_ranks(self, rank: int) -> list[int]:
        """The tp*pp ranks holding the same model replica as ``rank`` (same dp coordinate)."""
        dp = self.coord(rank).dp
        return sorted(self.rank(dp=dp, tp=t, pp=p) for p in range(self.pp) for t in range(self.tp))

    def model_parallel_groups(self) -> list[list[int]]:
        return [self.model_parallel_ranks(self.rank(dp=d)) for d in range(self.dp)]

    def embedding_ranks(self, rank: int) -> list[int]:
        """First and last pipeline stage with ``rank``'s (dp, tp): they hold the tied embedding/head.

        With pp == 1 this is just ``[rank]``.
        """
        c = self.coord(rank)
        first = self.rank(dp=c.dp, tp=c.tp, pp=0)
        last = self.rank(dp=c.dp, tp=c.tp, pp=self.pp - 1)
        return sorted({first, last})

    def embedding_groups(self) -> list[list[int]]:
        return [self.embedding_ranks(self.rank(dp=d, tp=t)) for d in range(self.dp) for t in range(self.tp)]

    # -------------------------------------------------------- pipeline
    def is_first_stage(self, rank: int) -> bool:
        return self.coord(rank).pp == 0

    def is_last_stage(self, rank: int) -> bool:
        return self.coord(rank).pp == self.pp - 1

    def prev_stage_rank(self, rank: int) -> Optional[int]:
        """Rank holding the previous pipeline stage for the same (dp, tp); None on the first stage."""
        c = self.coord(rank)
        return None if c.pp == 0 else self.rank(dp=c.dp, tp=c.tp, pp=c.pp - 1)

    def next_stage_rank(self, rank: int) -> Optional[int]:
        """Rank holding the next pipeline stage for the same (dp, tp); None on the last stage."""
        c = self.coord(rank)
        return None if c.pp == self.pp - 1 else self.rank(dp=c.dp, tp=c.tp, pp=c.pp + 1)

    def __str__(self) -> str:
        return f"Topology(dp={self.dp}, tp={self.tp}, pp={self.pp})"
