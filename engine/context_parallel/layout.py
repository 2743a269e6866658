"""What one rank's context-parallel attention needs to know: the mode, the degrees and
the groups it talks over.

CP rank order: ``cp_rank = ring_index * ulysses_size + ulysses_index``. Ulysses groups are
runs of ``ulysses_size`` consecutive CP ranks; ring groups take one rank of each Ulysses
group. Ring mode: ``ulysses_size`` 1, ``ring`` is the whole CP group. Ulysses mode:
``ulysses_size == size``, no ring. Hybrid: both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from engine.distributed.groups import AxisGroup

__all__ = ["CP_MODES", "CPLayout"]

CP_MODES = ("ring", "ulysses", "hybrid")


@dataclass(frozen=True)
class CPLayout:
    """``mode``: one of :data:`CP_MODES`. ``size``: C, the CP degree. ``rank``: this rank's
    CP index in [0, C) (its head-tail shard, :func:`engine.context_parallel.head_tail_indices`).
    ``ulysses_size``: U (1 for ring, C for Ulysses). ``ring``: the group over which KV
    blocks rotate (None when Ulysses alone); ``ulysses``: the all-to-all group (None when
    ring alone)."""

    mode: str
    size: int
    rank: int
    ulysses_size: int
    ring: Optional[AxisGroup]
    ulysses: Optional[AxisGroup]

    def __post_init__(self) -> None:
        if self.mode not in CP_MODES:
            raise ValueError(f"context_parallel.mode must be one of {CP_MODES}, got {self.mode!r}")
        if self.size % self.ulysses_size:
            raise ValueError(f"context_parallel.ulysses_size {self.ulysses_size} must divide size {self.size}")
