"""What an MoE layer needs from the run it is part of, as one value: :class:`MoEContext`.

The groups are passed, never looked up (the engine builds this value from its groups):

- ``ep_group``: the expert-parallel group the layer's tokens are dispatched over (size 1:
  every expert local). EP rank r holds global experts ``[r * E/ep, (r+1) * E/ep)``.
- ``tp_group`` and ``sequence_parallel``: experts and router are REPLICATED over TP (each
  TP rank holds whole experts; no expert is split). Without sequence parallelism every TP
  rank routes the same tokens and computes the same thing. With it, TP rank r routes its
  own ``S/tp`` tokens, so the router's and the experts' weights pass through
  copy-to-region (their gradients summed over TP, as the norms' are) and TP joins
  ``seq_groups``.
- ``seq_groups``: the groups whose ranks split one sequence's tokens (CP; TP under sequence
  parallelism): the balancing counts are all-reduced over them (engine.moe.balancing).
- ``grad_avg``: by how much the gradient reduction AVERAGES over ranks that split a sequence
  (the CP size: the grad role is cp x dp), which the balancing loss's parts compensate.
- ``loss_factor``: what the training loss is multiplied by before its backward (1 / the
  gradient accumulation steps; 1 for a plain ``loss.backward()``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from engine.distributed.groups import NO_TP, AxisGroup

__all__ = ["MoEContext", "NO_EP", "LOCAL_MOE"]

NO_EP = AxisGroup.single("ep")


@dataclass(frozen=True)
class MoEContext:
    """See the module docstring."""

    ep_group: AxisGroup = NO_EP
    tp_group: AxisGroup = NO_TP
    sequence_parallel: bool = False
    seq_groups: tuple[AxisGroup, ...] = field(default_factory=tuple)
    grad_avg: int = 1
    loss_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.grad_avg < 1:
            raise ValueError(f"MoEContext.grad_avg must be >= 1, got {self.grad_avg}")
        if not self.loss_factor > 0:
            raise ValueError(f"MoEContext.loss_factor must be > 0, got {self.loss_factor}")

    def with_tp(self, tp_group: AxisGroup, sequence_parallel: bool) -> "MoEContext":
        """This context for a block with ``tp_group``: TP joins ``seq_groups`` under sequence
        parallelism (TP ranks then hold different tokens of each sequence)."""
        seq = tuple(g for g in self.seq_groups if g.name != tp_group.name or g.ranks != tp_group.ranks)
        if sequence_parallel and tp_group.size > 1:
            seq = seq + (tp_group,)
        return replace(self, tp_group=tp_group, sequence_parallel=sequence_parallel, seq_groups=seq)

    @property
    def ep_size(self) -> int:
        return self.ep_group.size

    @property
    def ep_rank(self) -> int:
        return self.ep_group.rank

    @property
    def splits_tokens_over_tp(self) -> bool:
        """TP ranks hold different tokens (sequence parallelism with TP > 1)."""
        return self.sequence_parallel and self.tp_group.size > 1


LOCAL_MOE = MoEContext()
