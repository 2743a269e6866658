"""Pure planning for distributed Muon: which matrices there are, how each is cut across
TP ranks and ZeRO shards, and which rank orthogonalises it (no torch.distributed here).

Every Muon parameter becomes one :class:`MuonMatrix`. Its Newton–Schulz runs on ONE rank
of the (dp x tp) grid of its pipeline stage, the *owner* ``(dp_owner, tp_owner)``; owners
are balanced by Newton–Schulz FLOPs with a deterministic greedy (largest first, to the
least-loaded rank, ties to the lowest rank), computed identically on every rank.

Fused projections (q/k/v, gate/up: a weight whose placement has ``fused_parts``) are orthogonalised
as the separate matrices they stand for: the full weight is cut into its parts along the
partition dim and each part gets its own Newton–Schulz and its own learning-rate
adjustment (the part's shape). This is what a model with separate q, k, v projections
would do, and it is the same at every TP degree (the fused layout is an implementation
detail of the TP layers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from engine.optim.newton_schulz import newton_schulz_flops
from engine.placement import placement_of

__all__ = ["MuonMatrix", "matrix_of", "assign_owners", "lr_segments"]


@dataclass(frozen=True)
class MuonMatrix:
    """Parameter ``slot`` of bucket ``bucket`` of inner group ``group``: a TP-local
    ``local_shape`` (r, c) slice of a ``full_shape`` matrix (``tp_dim`` None: replicated
    over TP), made of ``parts`` (full sizes along ``tp_dim``, or along dim 0 when
    replicated; one part = a plain matrix)."""

    group: int
    bucket: int
    slot: int
    local_shape: tuple[int, int]
    full_shape: tuple[int, int]
    tp_dim: Optional[int]
    parts: tuple[int, ...]
    dp_owner: int = 0
    tp_owner: int = 0

    @property
    def part_dim(self) -> int:
        return 0 if self.tp_dim is None else self.tp_dim

    def part_shapes(self) -> list[tuple[int, int]]:
        """The full shapes of the matrices Newton–Schulz runs on."""
        r, c = self.full_shape
        return [(p, c) if self.part_dim == 0 else (r, p) for p in self.parts]

    def flops(self, ns_steps: int) -> int:
        return sum(newton_schulz_flops(r, c, ns_steps) for r, c in self.part_shapes())


def matrix_of(param: Any, local_shape: Sequence[int], tp_size: int, group: int, bucket: int, slot: int,
              name: str = "") -> MuonMatrix:
    """The :class:`MuonMatrix` of a Muon parameter from its TP placement."""
    what = f"Muon parameter {name or f'(group {group}, bucket {bucket}, slot {slot})'} of shape {tuple(local_shape)}"
    if len(local_shape) != 2:
        raise ValueError(f"{what} is not a matrix: Muon updates 2-D weights only; leave it to AdamW (its "
                         f"name matches no muon pattern, or add it to the adamw patterns)")
    r, c = int(local_shape[0]), int(local_shape[1])
    shard = placement_of(param).tp
    if shard is None:  # TP-replicated: one whole matrix
        return MuonMatrix(group, bucket, slot, (r, c), (r, c), None, (r,))
    if shard.unpadded_size is not None:
        raise ValueError(f"{what} has a padded TP partition (a vocabulary table): embeddings and LM heads are "
                         f"AdamW parameters; remove it from the muon patterns")
    dim = shard.dim
    if dim not in (0, 1):
        raise ValueError(f"{what} is TP-sharded along dim {dim!r}; Muon needs dim 0 or 1")
    full = (r * tp_size, c) if dim == 0 else (r, c * tp_size)
    parts = shard.fused_parts or (full[dim],)
    if sum(parts) != full[dim]:
        raise ValueError(f"{what}: fused parts {parts} do not add up to its full size {full[dim]} along dim {dim}")
    if len(parts) > 1 and dim != 0:
        raise ValueError(f"{what}: fused parts along dim 1 are not supported by Muon (each part's learning "
                         f"rate would not be a contiguous range)")
    return MuonMatrix(group, bucket, slot, (r, c), full, dim, parts)


def assign_owners(matrices: Sequence[MuonMatrix], grad_size: int, tp_size: int, ns_steps: int) -> list[MuonMatrix]:
    """The matrices with ``dp_owner`` / ``tp_owner`` set, balancing Newton–Schulz FLOPs
    over the dp x tp grid (greedy, largest first; deterministic)."""
    load = [0] * (grad_size * tp_size)
    owners: dict[int, int] = {}
    order = sorted(range(len(matrices)), key=lambda i: (-matrices[i].flops(ns_steps), i))
    for i in order:
        slot = min(range(len(load)), key=lambda s: (load[s], s))
        owners[i] = slot
        load[slot] += matrices[i].flops(ns_steps)
    out = []
    for i, m in enumerate(matrices):
        d, t = divmod(owners[i], tp_size)
        out.append(MuonMatrix(m.group, m.bucket, m.slot, m.local_shape, m.full_shape, m.tp_dim, m.parts, d, t))
    return out


def lr_segments(m: MuonMatrix, tp_size: int) -> list[tuple[int, int, tuple[int, int]]]:
    """``(start, end, part shape)``: contiguous ranges of the flattened TP-local matrix and
    the full shape of the part they belong to (the shape the learning rate is adjusted for)."""
    r, c = m.local_shape
    if len(m.parts) == 1:
        return [(0, r * c, m.full_shape)]
    world = tp_size if m.tp_dim is not None else 1
    out, row = [], 0
    for p, shape in zip(m.parts, m.part_shapes()):
        rows = p // world
        out.append((row * c, (row + rows) * c, shape))
        row += rows
    return out
