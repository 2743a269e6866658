"""``deepspeed.runtime.pipe.topology``: :class:`ProcessTopology` (named axes laid out
row-major: the last axis varies fastest between neighbouring ranks), and DeepSpeed's two
layouts :class:`PipeDataParallelTopology` (``pipe``, ``data``) and
:class:`PipeModelDataParallelTopology` (``pipe``, ``data``, ``model``).

Pure values with DeepSpeed's methods and answers. The engine's own layout
(:class:`engine.topology.Topology`: TP innermost, PP outermost, DP between) is the same as
``PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)``, rank for rank.
``PipelineParallelGrid`` (process groups made from a topology) is refused: the engine's
groups come from its config (``engine.groups``).
"""

from __future__ import annotations

import itertools
import math
from collections import namedtuple
from typing import Any, Sequence

from engine.compat.deepspeed._unsupported import unsupported
from engine.validate import check_int

__all__ = ["ProcessTopology", "PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineParallelGrid"]


class ProcessTopology:
    """Ranks ``0 .. prod(dims) - 1`` on a grid with named ``axes`` of sizes ``dims``;
    rank = sum(coord[i] * stride[i]) with the last axis' stride 1."""

    def __init__(self, axes: Sequence[str], dims: Sequence[int]) -> None:
        if len(axes) != len(dims) or len(set(axes)) != len(axes):
            raise ValueError(f"axes {list(axes)} and dims {list(dims)}: give one size per distinct axis name")
        for d in dims:
            check_int("ProcessTopology dims", d, minimum=1, error=ValueError)
        self.axes = list(axes)
        self.dims = list(dims)
        self.ProcessCoord: Any = namedtuple("ProcessCoord", self.axes)  # type: ignore[misc]  # per topology, as DeepSpeed
        self._strides = [math.prod(self.dims[i + 1:]) for i in range(len(self.dims))]

    def world_size(self) -> int:
        return math.prod(self.dims)

    def get_axis_names(self) -> list[str]:
        return self.axes

    def get_dim(self, axis: str) -> int:
        """The size of ``axis`` (0 for an axis the topology does not have, as DeepSpeed)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_rank(self, **coord: int) -> int:
        if sorted(coord) != sorted(self.axes):
            raise ValueError(f"get_rank() needs one coordinate per axis {self.axes}, got {sorted(coord)} "
                             "(use filter_match() for a slice)")
        for axis, value in coord.items():
            if not 0 <= value < self.get_dim(axis):
                raise ValueError(f"coordinate {axis}={value} is outside [0, {self.get_dim(axis)})")
        return sum(coord[a] * s for a, s in zip(self.axes, self._strides))

    def get_coord(self, rank: int) -> Any:
        if not 0 <= rank < self.world_size():
            raise ValueError(f"rank {rank} not found in topology.")
        return self.ProcessCoord(*[(rank // s) % d for s, d in zip(self._strides, self.dims)])

    def _coords(self) -> list[Any]:
        return [self.get_coord(r) for r in range(self.world_size())]

    def get_rank_repr(self, rank: int, omit_axes: Sequence[str] = ("data", "pipe"), inner_sep: str = "_",
                      outer_sep: str = "-") -> str:
        """``"model_01"`` for rank 1 of a pipe/data/model topology (DeepSpeed's checkpoint naming)."""
        coord = self.get_coord(rank)
        return outer_sep.join(f"{a}{inner_sep}{getattr(coord, a):02d}" for a in self.axes if a not in omit_axes)

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """The rank lists along ``axis`` (one per combination of the other axes, in row-major
        order of those); [] for an axis the topology does not have."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for values in itertools.product(*(range(self.get_dim(a)) for a in others)):
            fixed = dict(zip(others, values))
            lists.append([self.get_rank(**fixed, **{axis: i}) for i in range(self.get_dim(axis))])
        return lists

    def filter_match(self, **filter_kwargs: int) -> list[int]:
        """The ranks whose coordinates equal every given one."""
        return [r for r, c in enumerate(self._coords()) if all(getattr(c, k) == v for k, v in filter_kwargs.items())]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """The ranks whose coordinate along ``axis`` is ``idx``."""
        return self.filter_match(**{axis: idx})

    def __str__(self) -> str:
        return str({c: r for r, c in enumerate(self._coords())})


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline and data parallelism: axes ``pipe``, ``data``."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline, data and model (tensor) parallelism: axes ``pipe``, ``data``, ``model``."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


PipelineParallelGrid = unsupported("deepspeed.runtime.pipe.topology.PipelineParallelGrid",
                                   "the engine builds its process groups from the config's layout (engine.groups); "
                                   "a topology describes that layout but does not make groups here")
